// Philox4x32-10 (Salmon et al., SC'11), identical in host and device code, and the
// dropout keep decision every jaxsub kernel uses.
//
// The decision for element `idx` of a logical tensor (row-major index) is a pure function
// of (seed, idx): the counter is (idx / 8 as a 64-bit number, 0, 0) keyed by the two seed
// words (a call on a slice of the tensor adds the slice's offset to idx / 8: `Seed`); the
// 128 output bits are eight 16-bit lanes (lane j = half j % 2 of word j / 2, low half first)
// and lane idx % 8 is compared with the drop threshold (round(rate * 2^16)). An element is kept when its lane is >= the threshold, so rate 0
// keeps everything. Sixteen bits per decision (rate resolution 2^-16) let one Philox call
// serve eight elements: the generator, not memory, was the bottleneck of the dropout
// kernels. CPU and CUDA code call the same functions, so masks are bit-identical.
#pragma once

#include <cstdint>

#include "common.h"

namespace jaxsub {

struct U32x4 {
  uint32_t x, y, z, w;
};

JAXSUB_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#ifdef __CUDA_ARCH__
  lo = a * b;
  hi = __umulhi(a, b);
#else
  uint64_t p = static_cast<uint64_t>(a) * b;
  lo = static_cast<uint32_t>(p);
  hi = static_cast<uint32_t>(p >> 32);
#endif
}

namespace philox_detail {
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key schedule increments
}  // namespace philox_detail

// One round with round keys k0, k1.
JAXSUB_HD U32x4 philox_round(const U32x4& c, uint32_t k0, uint32_t k1) {
  uint32_t hi0, lo0, hi1, lo1;
  mulhilo32(philox_detail::kM0, c.x, hi0, lo0);
  mulhilo32(philox_detail::kM1, c.z, hi1, lo1);
  return U32x4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
}

JAXSUB_HD U32x4 philox4x32_10(U32x4 c, uint32_t k0, uint32_t k1) {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    c = philox_round(c, k0, k1);
    k0 += philox_detail::kW0;
    k1 += philox_detail::kW1;
  }
  return c;
}

// N independent Philox4x32-10 calls with one key schedule, their rounds side by side (the
// same outputs as N calls of philox4x32_10): ptxas recomputes the round keys per call, and
// independent chains in one block can interleave.
template <int N>
JAXSUB_HD void philox4x32_10_n(U32x4 (&c)[N], uint32_t k0, uint32_t k1) {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int i = 0; i < N; ++i) c[i] = philox_round(c[i], k0, k1);
    k0 += philox_detail::kW0;
    k1 += philox_detail::kW1;
  }
}

// A dropout seed as the kernels use it: the Philox key (k0, k1) and `off`, the offset in
// 8-element blocks of the call's first element within the logical tensor whose keep
// decisions it draws (0 for a whole tensor; a slice's on one of several devices). The seed
// buffer is u32[2] (key; no offset) or u32[4] (key, then the offset's low and high words):
// ABI.md.
struct Seed {
  uint32_t k0 = 0, k1 = 0;
  uint64_t off = 0;
};

JAXSUB_HD Seed load_seed(const uint32_t* words, bool with_offset) {
  Seed s;
  s.k0 = words[0];
  s.k1 = words[1];
  if (with_offset) s.off = (static_cast<uint64_t>(words[3]) << 32) | words[2];
  return s;
}

// The Seed of a seed buffer in host memory (the CPU handlers; a CUDA handler passes the
// kernel its device pointer and `with_offset` for load_seed).
template <class Buffer>
inline Seed cpu_seed(const Buffer& b) {
  return load_seed(static_cast<const uint32_t*>(b.untyped_data()), b.element_count() == 4);
}

// The counter of block q (elements 8*q .. 8*q+7 of the call's tensor).
JAXSUB_HD U32x4 counter(const Seed& s, uint64_t q) {
  q += s.off;
  return U32x4{static_cast<uint32_t>(q), static_cast<uint32_t>(q >> 32), 0u, 0u};
}

// The random bits for elements 8*q .. 8*q+7 of a tensor.
JAXSUB_HD U32x4 dropout_words(const Seed& s, uint64_t q) { return philox4x32_10(counter(s, q), s.k0, s.k1); }

JAXSUB_HD uint32_t word_at(const U32x4& w, int i) {
  return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}

// 16-bit lane j (0..7) of a Philox output.
JAXSUB_HD uint32_t lane16(const U32x4& w, int j) {
  const uint32_t word = word_at(w, j >> 1);
  return (j & 1) ? word >> 16 : word & 0xffffu;
}

// The keep decision of lane j, with thr_hi = threshold << 16 (threshold < 2^16): lane j's
// 16 bits >= threshold exactly when (j odd: the word, j even: the word << 16) >= thr_hi,
// one compare (and a shift for even lanes) instead of extract, then compare.
JAXSUB_HD bool lane_kept(const U32x4& w, int j, uint32_t thr_hi) {
  const uint32_t word = word_at(w, j >> 1);
  return ((j & 1) ? word : word << 16) >= thr_hi;
}

// Keep decision for a single element (general paths; fast paths use dropout_words).
JAXSUB_HD bool dropout_keep(const Seed& seed, uint64_t idx, uint32_t threshold) {
  if (threshold == 0) return true;
  return lane16(dropout_words(seed, idx >> 3), static_cast<int>(idx & 7)) >= threshold;
}

}  // namespace jaxsub
