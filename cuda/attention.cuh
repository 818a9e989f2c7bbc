// The attention kernels' building blocks (attention.cu only): launch constants, the
// argument block, tile copies, the score rules (scale, mask, causal, bounds), the dropout
// keep bits of 16 keys, quad reductions, the pieces both forward kernels share, and the
// host side's shape reading (separate and packed q/k/v) and dispatch. The backward's
// pieces are in attention_bwd.cuh. Contract: ABI.md ("Attention family").
#pragma once

#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>

#include "common.h"
#include "mma.cuh"
#include "pdl.cuh"
#include "philox.h"

namespace jaxsub {
namespace {  // private to attention.cu, the one file that includes this header

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 64;  // rows per block and per shared-memory tile
constexpr int kPad = 8;    // 16 bytes of padding per shared-memory row: conflict-free pair reads

struct AttnArgs {
  // q, k, v (and the backward's dq, dk, dv) are [B, S, H, D] views: position s of batch b,
  // head h at b * q_batch (kv_batch) + s * qkv_row + h * D. Separate tensors: qkv_row =
  // H * D, q_batch = Sq * H * D, kv_batch = Sk * H * D; packed self-attention (one [B, S,
  // 3, H, D] or [3, B, S, H, D] tensor) has its own strides and q, k, v pointers into it.
  // The gradients' views have strides of their own (grad_row, dq_batch, dkv_batch): the
  // same as the inputs', except where separate q, k, v get one packed gradient.
  // Grouped-query attention (separate tensors only): k and v have H / group heads, q head
  // h reading k/v head h / group; their rows are kv_row = (H / group) * D apart (dk, dv:
  // dkv_row). Otherwise group = 1 and kv_row = qkv_row, dkv_row = grad_row.
  const void* q;         // [B, Sq, H, D] view, T
  const void* k;         // [B, Sk, H / group, D] view, T
  const void* v;         // [B, Sk, H / group, D] view, T
  const void* out;       // [B, Sq, H, D] T (backward: forward output)
  const void* dout;      // [B, Sq, H, D] T (backward)
  const void* mask;      // [Bm, Hm, Sqm, Skm] pred or f32
  const uint32_t* seed;  // [2] or [4] (philox.h Seed)
  bool seed_offset = false;  // the seed has four words: words 2-3 are the slice's offset
  void* o;               // forward: out [B, Sq, H, D]; backward: dq, a view like q
  void* dk;              // backward: a view like k, T
  void* dv;              // backward: a view like v, T
  float* lse;            // [B, H, Sq]
  float* delta;          // [B, H, Sq] workspace (backward): rowsum(dout * out)
  float* dq_acc;         // [B, Sq, H, D] f32 workspace (backward)
  // Backward, packed gradients: dbias[p], T[H, D], the column sums of dq, dk and dv (p = 0,
  // 1, 2: the q/k/v projection's bias gradient, three parts of one [3, H, D] result or three
  // results), or none (null); dbias_ws their f32 [R, 3, H, D] row partials, R = B * ceil(S /
  // 16) (attention_bwd.cuh, bwd_bias_sums).
  void* dbias[3] = {nullptr, nullptr, nullptr};
  float* dbias_ws = nullptr;
  int64_t b, h, sq, sk;
  int64_t bh0 = 0;  // the launch's first (b, h): blockIdx.y + bh0 (for_head_chunks)
  int64_t qkv_row, q_batch, kv_batch;  // the views' strides, in elements
  int64_t grad_row, dq_batch, dkv_batch;  // the gradient views' strides (backward)
  int64_t kv_row, dkv_row;                // k and v's row stride, dk and dv's
  int64_t group = 1;                      // q heads per k/v head
  int64_t bm, hm, sqm, skm;
  int mask_kind;
  float scale;
  bool causal;
  uint32_t threshold;
  float keep_scale;
  bool dropout_bcast = false;  // one keep mask [Sq, Sk] for every (b, h) (drop_index)
};

// The forward's key order inside a 64-key tile (attention.cu): the score mma's column c
// holds key key_of(c) = (c % 8 / 2) * 16 + (c / 8) * 2 + c % 2, and key j is stored in shared
// row slot_of(j), the inverse (both permute the 6 bits of the index), so that every
// ldmatrix reads eight consecutive rows: conflict-free with the 16-byte row padding
// (rows key_of(0..7) = 0, 1, 16, 17, ... sit in two of the eight 16-byte bank groups, a
// 4-way conflict).
__host__ __device__ constexpr int key_of(int c) { return (c % 8 / 2) * 16 + (c / 8) * 2 + c % 2; }
__host__ __device__ constexpr int slot_of(int j) { return (j % 16 / 2) * 8 + (j / 16) * 2 + j % 2; }
static_assert(slot_of(key_of(37)) == 37 && key_of(slot_of(50)) == 50 && slot_of(key_of(63)) == 63, "inverse");

__device__ __forceinline__ uint32_t ld32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Starts copying rows [row0, row0 + kTile) of one head of a [B, S, H, D] tensor into
// shared memory ([kTile][D + kPad]) with cp.async (the caller commits and waits); rows
// past `rows` are zero-filled. Thread t copies 16-byte piece t % kChunks of rows
// t / kChunks + p * kRowsPerPass, p < kPasses: a fixed trip count and one pointer step
// per pass (a loop over c = t, t + 128, ... compiled to a generic loop with 64-bit
// multiplies per piece and its offsets spilled to local memory). With kSlots, tile row r
// goes to shared row slot_of(r) instead of r (the forward's key order, attention.cu).
template <typename T, int D, bool kSlots = false>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t row0, int64_t rows, int64_t row_stride) {
  constexpr int kElems = 16 / sizeof(T);            // elements per 16-byte piece
  constexpr int kChunks = D / kElems;               // pieces per row
  static_assert(kThreads % kChunks == 0 && kTile % (kThreads / kChunks) == 0, "tile copy shape");
  constexpr int kRowsPerPass = kThreads / kChunks;  // rows the block copies per pass
  constexpr int kPasses = kTile / kRowsPerPass;
  const int r0 = threadIdx.x / kChunks, part = threadIdx.x % kChunks;
  const int64_t left = rows - row0 - r0;            // rows from this thread's first one to the end
  const T* s = src + (row0 + r0) * row_stride + part * kElems;
  auto slot = [](int r) { return kSlots ? slot_of(r) : r; };
  T* d = dst + slot(r0) * (D + kPad) + part * kElems;
  const int64_t step = kRowsPerPass * row_stride;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const bool full = p * kRowsPerPass < left;
    // slot_of permutes the bits of r, and r0 < kRowsPerPass (a power of two) shares none
    // with p * kRowsPerPass: slot_of(r0 + p kRowsPerPass) = slot_of(r0) + slot_of(p kRowsPerPass).
    cp_async16(d + slot(p * kRowsPerPass) * (D + kPad), full ? s + p * step : src, full);
  }
}

// Raises a kernel's dynamic shared-memory limit, once per kernel and device (needed above 48 KB).
template <auto Kernel>
ffi::Error smem_opt_in(const char* op, size_t bytes) {
  // The attribute belongs to the function on the current device: set it once per device
  // this process launches on (a process-wide once left every other GPU at 48 KB).
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static cudaError_t status[kMaxDevices];
  auto set = [bytes] {
    return cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  };
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && dev >= 0 && dev < kMaxDevices) {
    std::call_once(once[dev], [&] { status[dev] = set(); });
    e = status[dev];
  } else if (e == cudaSuccess) {
    e = set();
  }
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string(op) + ": shared-memory opt-in failed: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Scores: scale, mask, causal, bounds. -inf marks an entry that takes no probability.

struct RowCtx {
  int64_t bb, hh;
  int64_t mask_head;  // offset of (bb, hh) in the mask, before the query and key terms
};

__device__ __forceinline__ RowCtx row_ctx(const AttnArgs& a, int64_t bb, int64_t hh) {
  RowCtx r;
  r.bb = bb, r.hh = hh;
  r.mask_head = ((a.bm == 1 ? 0 : bb) * a.hm + (a.hm == 1 ? 0 : hh)) * a.sqm;
  return r;
}

// The scaled, masked score of raw s = q_i . k_j (natural-log units).
__device__ __forceinline__ float score(const AttnArgs& a, const RowCtx& rc, float s, int64_t i, int64_t j) {
  if (i >= a.sq || j >= a.sk) return -INFINITY;
  if (a.causal && j > i + a.sk - a.sq) return -INFINITY;
  float x = s * a.scale;
  if (a.mask_kind != kMaskNone) {
    const int64_t m = (rc.mask_head + (a.sqm == 1 ? 0 : i)) * a.skm + (a.skm == 1 ? 0 : j);
    if (a.mask_kind == kMaskBool) {
      if (!static_cast<const bool*>(a.mask)[m]) return -INFINITY;
    } else {
      x += static_cast<const float*>(a.mask)[m];
    }
  }
  return x;
}

// Which score rule a kernel is instantiated for (attention.cu picks per call):
// kNoMask: no mask and no causal rule, only the bounds; kAnyMask: the full rule (score());
// kKeyMask: a boolean mask that does not depend on the query ([Bm, Hm, 1, Skm]: key
// padding), its bits read once per key (key_bits16, key_visible), plus the causal rule;
// kCausal: the causal rule and the bounds, no mask tensor (only the tiles on the diagonal
// test each element: fwd_softmax_tile, bwd_probs); kKeyBias: an additive mask that does
// not depend on the query ([Bm, Hm, 1, Skm]: a key bias, such as BERT's (1 - valid) * -1e4),
// its values read where the scores take them (key_bias2, bwd_key_bias), plus the causal rule.
enum MaskMode : int { kNoMask = 0, kAnyMask = 1, kKeyMask = 2, kCausal = 3, kKeyBias = 4 };

// Under a key mask: whether key j is visible (false past Sk).
__device__ __forceinline__ bool key_visible(const AttnArgs& a, const RowCtx& rc, int64_t j) {
  const bool* row = static_cast<const bool*>(a.mask) + rc.mask_head * a.skm;  // sqm == 1
  return j < a.sk && row[a.skm == 1 ? 0 : j];
}

// Under a key mask: the visibility bits of keys j0 .. j0 + 15 (bit t: key j0 + t), one
// 16-byte load when the 16 flags are in bounds and aligned (each flag byte is 0 or 1:
// (w & 0x01010101) * 0x01020408 gathers a word's four flags into its top byte).
__device__ __forceinline__ uint32_t key_bits16(const AttnArgs& a, const RowCtx& rc, int64_t j0) {
  const bool* row = static_cast<const bool*>(a.mask) + rc.mask_head * a.skm;
  if (a.skm != 1 && j0 + 16 <= a.sk && (reinterpret_cast<uintptr_t>(row + j0) & 15) == 0) {
    const uint4 w = *reinterpret_cast<const uint4*>(row + j0);
    auto four = [](uint32_t x) { return ((x & 0x01010101u) * 0x01020408u) >> 24; };
    return four(w.x) | four(w.y) << 4 | four(w.z) << 8 | four(w.w) << 12;
  }
  uint32_t bits = 0;
  for (int t = 0; t < 16; ++t) bits |= static_cast<uint32_t>(key_visible(a, rc, j0 + t)) << t;
  return bits;
}

// Under a key bias: the mask row of the query's (batch, head) (sqm == 1), and key j's value
// in it in log2 units (0 past Sk, where the bounds hide the key; Skm == 1 broadcasts).
__device__ __forceinline__ const float* key_bias_row(const AttnArgs& a, const RowCtx& rc) {
  return static_cast<const float*>(a.mask) + rc.mask_head * a.skm;
}
__device__ __forceinline__ float key_bias1(const AttnArgs& a, const float* row, int64_t j) {
  return j < a.sk ? row[a.skm == 1 ? 0 : j] * kLog2e : 0.f;
}

// Under a key bias: the values of keys j and j + 1 in log2 units, one 8-byte load when in
// bounds and aligned. Read where the scores use them: sixteen values held across the tile
// left the wgmma forward at D 64 spilling.
__device__ __forceinline__ float2 key_bias2(const AttnArgs& a, const RowCtx& rc, int64_t j) {
  const float* row = key_bias_row(a, rc);
  if (a.skm != 1 && j + 2 <= a.sk && (reinterpret_cast<uintptr_t>(row + j) & 7) == 0) {
    const float2 v = *reinterpret_cast<const float2*>(row + j);
    return make_float2(v.x * kLog2e, v.y * kLog2e);
  }
  return make_float2(key_bias1(a, row, j), key_bias1(a, row, j + 1));
}

// The score of raw s at (i, j) in log2 units under rule kMode; `visible` is key j's bit
// under kKeyMask (bounds of j included) and unused otherwise.
template <int kMode>
__device__ __forceinline__ float score_log2(const AttnArgs& a, const RowCtx& rc, float s, int64_t i, int64_t j,
                                            bool visible = true) {
  if constexpr (kMode == kAnyMask) {
    return score(a, rc, s, i, j) * kLog2e;
  } else if constexpr (kMode == kKeyMask) {
    const bool in = visible && i < a.sq && !(a.causal && j > i + a.sk - a.sq);
    return in ? s * a.scale * kLog2e : -INFINITY;
  } else if constexpr (kMode == kCausal) {
    return i < a.sq && j < a.sk && j <= i + a.sk - a.sq ? s * a.scale * kLog2e : -INFINITY;
  } else {
    return i < a.sq && j < a.sk ? s * a.scale * kLog2e : -INFINITY;
  }
}

// Keep bits of 16 keys from their two Philox word sets w0 (keys 0..7) and w1 (8..15).
__device__ __forceinline__ uint32_t bits16(const U32x4& w0, const U32x4& w1, uint32_t threshold) {
  uint32_t bits = 0;
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    bits |= static_cast<uint32_t>(lane16(w0, t) >= threshold) << t;
    bits |= static_cast<uint32_t>(lane16(w1, t) >= threshold) << (t + 8);
  }
  return bits;
}

// The keep decisions' element index of probability (bh, i, j) (philox.h): row major over
// [B * H, Sq, Sk], or over [Sq, Sk] under dropout_bcast (one mask for every batch and head).
__device__ __forceinline__ uint64_t drop_index(const AttnArgs& a, int64_t bh, int64_t i, int64_t j) {
  return static_cast<uint64_t>(((a.dropout_bcast ? 0 : bh) * a.sq + i) * a.sk + j);
}

// Keep bits of 16 consecutive keys j0 .. j0 + 15 of query i (bit t: key j0 + t), from the
// Philox lanes of their drop_index; 0 outside the tensor. Two Philox calls when the 16
// keys are two aligned groups of eight.
__device__ __forceinline__ uint32_t keep16(const AttnArgs& a, const Seed& seed, int64_t bh, int64_t i,
                                           int64_t j0) {
  if (i >= a.sq) return 0u;
  const uint64_t idx = drop_index(a, bh, i, j0);
  uint32_t bits = 0;
  if ((idx & 7) == 0 && j0 + 16 <= a.sk) {
    bits = bits16(dropout_words(seed, idx >> 3), dropout_words(seed, (idx >> 3) + 1), a.threshold);
  } else {
    for (int t = 0; t < 16 && j0 + t < a.sk; ++t)
      bits |= static_cast<uint32_t>(dropout_keep(seed, idx + t, a.threshold)) << t;
  }
  return bits;
}

// The Philox words of keys j0 .. j0 + 15 of rows i and i + di (di > 0; row r's in w[2 r],
// w[2 r + 1]) where both rows are in bounds and aligned: their four calls side by side with
// one key schedule (philox4x32_10_n). False, and w untouched, otherwise.
__device__ __forceinline__ bool pair_words(const AttnArgs& a, const Seed& seed, int64_t bh, int64_t i, int di,
                                           int64_t j0, U32x4 (&w)[4]) {
  const uint64_t idx = drop_index(a, bh, i, j0);
  const uint64_t step = static_cast<uint64_t>(di) * static_cast<uint64_t>(a.sk);
  if (!(i + di < a.sq && (idx & 7) == 0 && (step & 7) == 0 && j0 + 16 <= a.sk)) return false;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint64_t q = ((idx + (c < 2 ? 0 : step)) >> 3) + (c & 1);
    w[c] = counter(seed, q);
  }
  philox4x32_10_n<4>(w, seed.k0, seed.k1);
  return true;
}

// keep16 of rows i and i + di.
__device__ __forceinline__ void keep16_pair(const AttnArgs& a, const Seed& seed, int64_t bh, int64_t i,
                                            int di, int64_t j0, uint32_t (&bits)[2]) {
  U32x4 w[4];
  if (pair_words(a, seed, bh, i, di, j0, w)) {
#pragma unroll
    for (int r = 0; r < 2; ++r) bits[r] = bits16(w[2 * r], w[2 * r + 1], a.threshold);
  } else {
    bits[0] = keep16(a, seed, bh, i, j0);
    bits[1] = keep16(a, seed, bh, i + di, j0);
  }
}

// The forward's two ways to hold a thread's keep decisions for its rows r = 0, 1 (query
// qrow + 8 r) and 16 keys: KeepBits, bit t of bits[r] for key t (the mma.sync kernel: two
// registers across the score products); KeepMasks, per pair n of keys 2n, 2n + 1 a mask
// with 0xffff in the half of the packed probability pair whose key is kept (the wgmma
// kernel: no per-element select, one AND per packed pair; __vcmpgeu2 compares both 16-bit
// Philox lanes of a word at once).
struct KeepBits {
  uint32_t bits[2] = {0xffffu, 0xffffu};
  __device__ __forceinline__ float elem(int r, int n, int c, float p) const {
    return (bits[r] >> (n * 2 + c)) & 1u ? p : 0.f;
  }
  __device__ __forceinline__ uint32_t pair(int, int) const { return 0xffffffffu; }
};
struct KeepMasks {
  uint32_t m[2][8];
  __device__ __forceinline__ float elem(int, int, int, float p) const { return p; }
  __device__ __forceinline__ uint32_t pair(int r, int n) const { return m[r][n]; }
};
// KeepMasks' row of 16 keys from their two Philox word sets w0 (keys 0..7) and w1 (8..15).
__device__ __forceinline__ void masks16(const U32x4& w0, const U32x4& w1, uint32_t threshold, uint32_t (&mask)[8]) {
  const uint32_t t2 = threshold * 0x10001u;  // lane k kept when its 16 bits >= threshold
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    mask[n] = __vcmpgeu2(word_at(w0, n), t2);
    mask[n + 4] = __vcmpgeu2(word_at(w1, n), t2);
  }
}

// KeepMasks' row of query i and keys j0 .. j0 + 15 (the decisions of keep16).
__device__ __forceinline__ void keep_masks16(const AttnArgs& a, const Seed& seed, int64_t bh, int64_t i,
                                             int64_t j0, uint32_t (&mask)[8]) {
  const uint64_t idx = drop_index(a, bh, i, j0);
  if (i < a.sq && (idx & 7) == 0 && j0 + 16 <= a.sk) {
    masks16(dropout_words(seed, idx >> 3), dropout_words(seed, (idx >> 3) + 1), a.threshold, mask);
  } else {
    const uint32_t bits = keep16(a, seed, bh, i, j0);
#pragma unroll
    for (int n = 0; n < 8; ++n)
      mask[n] = ((bits >> (2 * n)) & 1u ? 0xffffu : 0u) | ((bits >> (2 * n + 1)) & 1u ? 0xffff0000u : 0u);
  }
}

// Both rows of KeepMasks (queries i and i + 8, keys j0 .. j0 + 15): pair_words where it
// applies, otherwise keep_masks16 per row.
__device__ __forceinline__ void keep_masks32(const AttnArgs& a, const Seed& seed, int64_t bh, int64_t i,
                                             int64_t j0, uint32_t (&mask)[2][8]) {
  U32x4 w[4];
  if (pair_words(a, seed, bh, i, 8, j0, w)) {
#pragma unroll
    for (int r = 0; r < 2; ++r) masks16(w[2 * r], w[2 * r + 1], a.threshold, mask[r]);
  } else {
    keep_masks16(a, seed, bh, i, j0, mask[0]);
    keep_masks16(a, seed, bh, i + 8, j0, mask[1]);
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return max_nan(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------------------------------
// Pieces both forward kernels share (attention.cu: mma.sync; attention_sm90.cuh: wgmma):
// the Q fragments, the key tiles a block needs, the output rows and lse.

// Q fragments of a warp's 16 rows q0 .. q0 + 15 (rows quad and quad + 8, columns tq*2
// (+8)), the A operand of S = Q Kᵀ in both kernels; zero past Sq.
template <typename T, int D>
__device__ __forceinline__ void load_q_frags(uint32_t (&qf)[D / 16][4], const AttnArgs& a, const T* qg, int64_t q0,
                                             int quad, int tq) {
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t i = q0 + quad + (r & 1) * 8;
      const int col = kc * 16 + tq * 2 + (r >> 1) * 8;
      qf[kc][r] = i < a.sq ? ld32(qg + i * a.qkv_row + col) : 0u;
    }
}
// A tile kernel's block (grid: tiles along x, heads along y; blocks start in that order,
// x fastest): its tile rank and its head (b * H + h; the backward's: the k/v head). Under
// the causal rule a tile's work follows its rank, the same in every head (rank 0 heaviest:
// below), so the blocks are taken tile-major: every head's heaviest tiles start first,
// where head-major order left the last heads' heaviest tiles to the grid's last wave.
// Otherwise head-major: a head's tiles run together, sharing its k and v in L2 (and the
// cluster backward's clusters are a head's key blocks along x).
struct TileBlock {
  int64_t rank, bh;
};
__device__ __forceinline__ TileBlock tile_block(const AttnArgs& a) {
  if (!a.causal) return {blockIdx.x, a.bh0 + blockIdx.y};
  const int64_t lin = blockIdx.x + static_cast<int64_t>(gridDim.x) * blockIdx.y;
  return {lin / gridDim.y, a.bh0 + lin % gridDim.y};
}
// The query tile of a forward block. Under the causal rule a tile's work grows with its
// index, so rank 0 takes the last (heaviest) tile and the grid ends on light ones.
__device__ __forceinline__ int64_t fwd_query_tile(const AttnArgs& a) {
  const int64_t r = tile_block(a).rank;
  return a.causal ? gridDim.x - 1 - r : r;
}
// Key tiles of 64 the forward block needs: keys beyond its last visible one are never
// needed (causal).
__device__ __forceinline__ int fwd_key_tiles(const AttnArgs& a) {
  int64_t key_end = a.sk;
  if (a.causal) {
    const int64_t last = fwd_query_tile(a) * kTile + kTile + a.sk - a.sq;
    key_end = last < a.sk ? last : a.sk;
  }
  return static_cast<int>((key_end + kTile - 1) / kTile);
}
// The forward's results for a thread's rows q0 + quad (+8): out (O(dn, e) the unnormalized
// accumulator, rows as in fwd_softmax_tile) over the row sums l, with the dropout scale,
// and the log-sum-exp from the running max m (log2 units).
template <typename T, int D, typename OF>
__device__ __forceinline__ void fwd_store(const AttnArgs& a, OF&& O, const float (&m)[2], const float (&l)[2],
                                          int64_t bh, int64_t bb, int64_t hh, int64_t q0, int quad, int tq) {
  const int64_t out_row = a.h * D;  // out is a plain [B, Sq, H, D] tensor
  T* og = static_cast<T*>(a.o) + (bb * a.sq * a.h + hh) * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float total = quad_sum(l[r]);
    // The dropout scale multiplies the output once, after the bf16/f16 product.
    // A NaN total (a NaN or +inf score the row sees) makes the row and its lse NaN.
    const float inv = total == 0.f ? 0.f : a.keep_scale / total;
    const int64_t i = q0 + quad + r * 8;
    if (i >= a.sq) continue;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<uint32_t*>(og + i * out_row + dn * 8 + tq * 2) =
          pack2<T>(O(dn, 2 * r) * inv, O(dn, 2 * r + 1) * inv);
    if (tq == 0) a.lse[bh * a.sq + i] = total == 0.f ? -INFINITY : (m[r] + __log2f(total)) * kLn2;
  }
}

// One key tile of the forward's online softmax (both forward kernels), for a thread's two
// query rows qrow, qrow + 8 and its 16 keys: score element (n, e), S(n, e), is row
// qrow + 8 (e / 2), key kb + 16 tq + 2 n + e % 2 (the key order of attention.cu). Scales
// and masks the raw scores, updates the running max m and sum l, rescales the output
// accumulator (O(dn, e), rows as S's), and packs the probabilities kept by `keep`
// (unscaled) into pf, A fragments of 16 key slots each.
// kPlain: the common case (no mask, no causal, a full key tile, scale > 0) needs no
// per-element test (rows past Sq are never stored) and keeps the raw scores: the max is
// taken raw and scaled once, and each probability is exp2(s * sc - base), one FFMA.
// Otherwise the scores are scaled and masked here (log2 units, sc = 1). A compile-time
// choice: as a run-time flag, ptxas computed every element's bounds predicates ahead of
// the branches that skip them (~170 instructions per tile in the plain case).
template <typename T, int kMode, int D, bool kPlain, typename SF, typename OF, typename K>
__device__ __forceinline__ void fwd_softmax_tile_as(const AttnArgs& a, const RowCtx& rc, SF&& S, OF&& O,
                                                    float (&m)[2], float (&l)[2], const K& keep, int64_t qrow,
                                                    int64_t kb, int tq, uint32_t (&pf)[4][4]) {
  constexpr bool plain = kPlain;
  // Under a key mask, this thread's 16 keys (shared by its two rows) are read once; under a
  // key bias, each pair as its scores take it (key_bias2).
  const uint32_t vis = kMode == kKeyMask ? key_bits16(a, rc, kb + tq * 16) : 0xffffu;
  const float sc = plain ? a.scale * kLog2e : 1.f;
  // kKeyMask, kKeyBias and kCausal test in tile coordinates, 32-bit: key c = 16 tq + 2 n +
  // e % 2 of the tile sees row qrow + 8 (e / 2) when c - 8 (e / 2) <= lim (always without
  // the causal rule), and is in bounds when c < kend (kKeyMask: in vis). Rows past Sq are
  // never stored, so they need no test.
  constexpr bool kLocal = kMode == kKeyMask || kMode == kCausal || kMode == kKeyBias;
  int lim = 2 * kTile, kend = kTile;
  if constexpr (kLocal && !plain) {
    auto clamp = [](int64_t x) { return static_cast<int>(x < -kTile ? -kTile : x > 2 * kTile ? 2 * kTile : x); };
    if (kMode == kCausal || a.causal) lim = clamp(qrow - kb + a.sk - a.sq);
    if (kMode == kCausal || kMode == kKeyBias) kend = clamp(a.sk - kb);
  }
  const float sl = a.scale * kLog2e;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    float2 kbias = {0.f, 0.f};
    if constexpr (kMode == kKeyBias) kbias = key_bias2(a, rc, kb + tq * 16 + n * 2);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (!plain && kLocal) {
        const int c = tq * 16 + n * 2 + (e & 1);
        const bool in = ((vis >> (n * 2 + (e & 1))) & 1u) && c - (e >> 1) * 8 <= lim && c < kend;
        if constexpr (kMode == kKeyBias)
          S(n, e) = in ? fmaf(S(n, e), sl, e & 1 ? kbias.y : kbias.x) : -INFINITY;
        else
          S(n, e) = in ? S(n, e) * sl : -INFINITY;
      } else if constexpr (!plain) {
        const int64_t i = qrow + (e >> 1) * 8, j = kb + tq * 16 + n * 2 + (e & 1);
        S(n, e) = score_log2<kMode>(a, rc, S(n, e), i, j, (vis >> (n * 2 + (e & 1))) & 1u);
      }
      mx[e >> 1] = max_nan(mx[e >> 1], S(n, e));
    }
  }
  float alpha[2], nbase[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = max_nan(m[r], quad_max(mx[r]) * sc);
    alpha[r] = m_new == -INFINITY ? 1.f : fast_exp2(m[r] - m_new);
    m[r] = m_new;
    nbase[r] = m_new == -INFINITY ? 0.f : -m_new;  // exp2(-inf + 0) = 0 for masked entries
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
    for (int e = 0; e < 4; ++e) O(dn, e) *= alpha[e >> 1];
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = fast_exp2(fmaf(S(n, e), sc, nbase[e >> 1]));
      l[e >> 1] += p[e];
      p[e] = keep.elem(e >> 1, n, e & 1, p[e]);
    }
    pf[n / 2][(n & 1) * 2 + 0] = pack2<T>(p[0], p[1]) & keep.pair(0, n);
    pf[n / 2][(n & 1) * 2 + 1] = pack2<T>(p[2], p[3]) & keep.pair(1, n);
  }
}
// Under kCausal, a tile whose every key the warp's first row already sees is plain too:
// only the tiles on the diagonal test each element. The test is on the warp's first row
// so that the whole warp takes one path (quad_max shuffles).
template <typename T, int kMode, int D, typename SF, typename OF, typename K>
__device__ __forceinline__ void fwd_softmax_tile(const AttnArgs& a, const RowCtx& rc, SF&& S, OF&& O, float (&m)[2],
                                                 float (&l)[2], const K& keep, int64_t qrow, int64_t kb, int tq,
                                                 uint32_t (&pf)[4][4]) {
  bool plain = false;
  if constexpr (kMode == kNoMask) plain = kb + kTile <= a.sk && a.scale > 0.f;
  if constexpr (kMode == kCausal) {
    const int64_t warp_row = qrow - (threadIdx.x % 32) / 4;
    plain = kb + kTile <= a.sk && a.scale > 0.f && kb + kTile - 1 <= warp_row + a.sk - a.sq;
  }
  if constexpr (kMode == kNoMask || kMode == kCausal) {
    if (plain) {
      fwd_softmax_tile_as<T, kMode, D, true>(a, rc, S, O, m, l, keep, qrow, kb, tq, pf);
      return;
    }
  }
  fwd_softmax_tile_as<T, kMode, D, false>(a, rc, S, O, m, l, keep, qrow, kb, tq, pf);
}

// ---------------------------------------------------------------------------------------
// Host side: shapes of the separate and packed forms, and dispatch on mask mode, dtype and
// head dim.

// The mask's broadcast dims and the head dim, once a's sizes are set.
ffi::Error read_mask_and_dim(const char* op, const ffi::AnyBuffer& mask, int32_t mask_kind, int d, AttnArgs& a) {
  const int64_t full[4] = {a.b, a.h, a.sq, a.sk};
  int64_t dims[4];
  if (auto e = check_mask(op, mask, mask_kind, full, dims); e.failure()) return e;
  a.bm = dims[0], a.hm = dims[1], a.sqm = dims[2], a.skm = dims[3];
  a.mask_kind = mask_kind;
  if (d != 32 && d != 64 && d != 128) return invalid(op, "head dim must be 32, 64 or 128 on CUDA");
  return ffi::Error::Success();
}

// Separate q [B, Sq, H, D] and k, v [B, Sk, H, D].
ffi::Error read_shapes(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       const ffi::AnyBuffer& mask, int32_t mask_kind, AttnArgs& a, int& d) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) return invalid(op, "q, k, v must be [B, S, H, D]");
  a.b = qd[0], a.sq = qd[1], a.h = qd[2], d = static_cast<int>(qd[3]);
  a.sk = kd[1];
  const int64_t hkv = kd[2];
  if (kd[0] != a.b || hkv < 1 || a.h % hkv != 0 || kd[3] != d || vd[0] != a.b || vd[1] != a.sk || vd[2] != hkv ||
      vd[3] != d)
    return invalid(op, "q, k, v shapes do not match (k and v: [B, Sk, H_kv, D], H_kv dividing q's H)");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return invalid(op, "q, k, v dtypes differ");
  a.group = a.h / hkv;
  a.qkv_row = a.h * d, a.q_batch = a.sq * a.qkv_row, a.kv_row = hkv * d, a.kv_batch = a.sk * a.kv_row;
  a.grad_row = a.qkv_row, a.dq_batch = a.q_batch, a.dkv_row = a.kv_row, a.dkv_batch = a.kv_batch;
  return read_mask_and_dim(op, mask, mask_kind, d, a);
}

// Packed self-attention: qkv [B, S, 3, H, D] (qkv_axis 2) or [3, B, S, H, D] (qkv_axis 0);
// q, k, v are the views at element offsets 0, koff, 2 koff.
ffi::Error read_packed_shapes(const char* op, const ffi::AnyBuffer& qkv, int32_t axis, const ffi::AnyBuffer& mask,
                              int32_t mask_kind, AttnArgs& a, int& d, int64_t& koff) {
  auto s = qkv.dimensions();
  if (s.size() != 5 || (axis != 0 && axis != 2) || s[axis] != 3)
    return invalid(op, "qkv must be [B, S, 3, H, D] (qkv_axis 2) or [3, B, S, H, D] (qkv_axis 0)");
  a.h = s[3], d = static_cast<int>(s[4]);
  const int64_t hd = a.h * d;
  if (axis == 2) {
    a.b = s[0], a.sq = a.sk = s[1], a.qkv_row = 3 * hd, koff = hd;
  } else {
    a.b = s[1], a.sq = a.sk = s[2], a.qkv_row = hd, koff = a.b * a.sq * hd;
  }
  a.q_batch = a.kv_batch = a.sq * a.qkv_row;
  a.grad_row = a.qkv_row, a.dq_batch = a.dkv_batch = a.q_batch;
  a.kv_row = a.dkv_row = a.qkv_row;
  return read_mask_and_dim(op, mask, mask_kind, d, a);
}

void set_attrs(AttnArgs& a, float scale, bool causal, uint32_t threshold, float keep_scale, bool dropout_bcast) {
  a.scale = scale, a.causal = causal, a.threshold = threshold, a.keep_scale = keep_scale;
  a.dropout_bcast = dropout_bcast;
}

// The score rule a call's kernels are instantiated for (MaskMode, above);
// launching a tile kernel (block kThreads, `smem` bytes of dynamic shared memory, raised
// past 48 KB once per kernel).
int mask_mode(const AttnArgs& a) {
  if (a.mask_kind == kMaskBool && a.sqm == 1) return kKeyMask;
  if (a.mask_kind == kMaskAdditive && a.sqm == 1) {
    const char* off = std::getenv("JAXSUB_KEY_BIAS");  // read per call: =0 keeps kAnyMask (A/B, tests)
    if (!(off && off[0] == '0')) return kKeyBias;
  }
  if (a.mask_kind == kMaskNone) return a.causal ? kCausal : kNoMask;
  return kAnyMask;
}
// Calls f(IntC<mode>) for the call's mask mode.
template <typename F>
ffi::Error by_mask_mode(const AttnArgs& a, F&& f) {
  switch (mask_mode(a)) {
    case kKeyMask: return f(std::integral_constant<int, kKeyMask>{});
    case kKeyBias: return f(std::integral_constant<int, kKeyBias>{});
    case kAnyMask: return f(std::integral_constant<int, kAnyMask>{});
    case kCausal: return f(std::integral_constant<int, kCausal>{});
    default: return f(std::integral_constant<int, kNoMask>{});
  }
}
// A grid has at most 65535 blocks along y, where the tile kernels put the B * H heads
// (the backward: the B * H / group k/v heads): more heads are launched in chunks, each
// kernel adding its chunk's first head (bh0) to blockIdx.y. Calls launch(args, heads) per
// chunk.
constexpr int64_t kMaxGridY = 65535;
template <typename F>
void for_head_chunks(const AttnArgs& a, F&& launch, int64_t heads) {
  for (int64_t bh0 = 0; bh0 < heads; bh0 += kMaxGridY) {
    AttnArgs c = a;
    c.bh0 = bh0;
    launch(c, static_cast<unsigned>(heads - bh0 < kMaxGridY ? heads - bh0 : kMaxGridY));
  }
}
// Kernel over `tiles` row tiles (grid x) of every head (grid y, in chunks), launched
// dependent on the kernel before it (pdl.cuh: Kernel waits for it).
template <auto Kernel>
ffi::Error launch_tile_kernel(const char* op, unsigned tiles, int64_t heads, size_t smem, cudaStream_t stream,
                              const AttnArgs& a) {
  if (auto e = smem_opt_in<Kernel>(op, smem); e.failure()) return e;
  for_head_chunks(a, [&](const AttnArgs& c, unsigned n) {
    launch_dependent(Kernel, dim3(tiles, n), dim3(kThreads), smem, stream, c);
  }, heads);
  return ffi::Error::Success();
}

// Calls f(TypeTag<T>, IntC<D>) for the 16-bit dtypes and head dims the kernels support.
template <typename F>
ffi::Error dispatch_attention(const char* op, ffi::DataType t, int d, F&& f) {
  auto by_dim = [&](auto tag) -> ffi::Error {
    switch (d) {
      case 32: return f(tag, std::integral_constant<int, 32>{});
      case 64: return f(tag, std::integral_constant<int, 64>{});
      case 128: return f(tag, std::integral_constant<int, 128>{});
    }
    return invalid(op, "head dim must be 32, 64 or 128 on CUDA");
  };
  if (t == ffi::DataType::BF16) return by_dim(TypeTag<__nv_bfloat16>{});
  if (t == ffi::DataType::F16) return by_dim(TypeTag<__half>{});
  return invalid(op, "the fused CUDA kernels take bfloat16 or float16");
}

}  // namespace
}  // namespace jaxsub
