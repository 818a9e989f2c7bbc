// The attention backward's building blocks (attention.cu only; used by the mma.sync
// backward there and the wgmma backward in attention_sm90.cuh): its warp-tile products, the
// probabilities and score gradients of a tile, the tile's rows, the dK/dV store, and its
// two row kernels (delta, dq). Contract: ABI.md ("Attention family").
#pragma once

#include "attention.cuh"

namespace jaxsub {
namespace {  // private to attention.cu, the one file that includes this header

// The backward's two warp-tile products (rows = the warp's 16 keys):
// acc[16 keys][64 queries] = A[16 keys][D] · B[64 queries][D]ᵀ, with A's rows at `a`
// (ldmatrix lane addresses, plain) and B's at `b` (plain); and
// acc[16 keys][D] += frag[16 keys][64 queries] · B[64 queries][D], B's rows at `b`
// (transposed lane addresses).
template <typename T, int D>
__device__ __forceinline__ void keys_by_queries(float (&acc)[8][4], const T* a, const T* b) {
  constexpr int kRow = D + kPad;
  uint32_t af[D / 16][4];
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) ldsm(af[kc], a + kc * 16);
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc += 2) {
      uint32_t bf[4];
      ldsm(bf, b + n * 8 * kRow + kc * 16);
      mma<T>(acc[n], af[kc], bf[0], bf[1]);
      mma<T>(acc[n], af[kc + 1], bf[2], bf[3]);
    }
  }
}
template <typename T, int D>
__device__ __forceinline__ void add_keys_by_d(float (&acc)[D / 8][4], const uint32_t (&frag)[4][4], const T* b) {
  constexpr int kRow = D + kPad;
#pragma unroll
  for (int kc = 0; kc < 4; ++kc)
#pragma unroll
    for (int dn = 0; dn < D / 8; dn += 2) {
      uint32_t bf[4];
      ldsm_t(bf, b + kc * 16 * kRow + dn * 8);
      mma<T>(acc[dn], frag[kc], bf[0], bf[1]);
      mma<T>(acc[dn + 1], frag[kc], bf[2], bf[3]);
    }
}

// The backward's element-wise steps for a warp's tile Sᵀ [16 keys][64 queries] (both
// backward kernels): entry (n, e) of a thread is query il(n, e) = 8 n + 2 tq + e % 2 of the
// tile and key quad + 8 (e / 2) of the warp.
//
// The keep bits of a thread's 32 entries (bit 4 n + e), gathered from the warp's per-query
// keep words (`keep[il]`: bit t = key t of the warp); all kept without dropout.
__device__ __forceinline__ uint32_t bwd_keep_bits(const AttnArgs& a, const uint16_t* keep, int quad, int tq) {
  if (a.threshold == 0) return 0xffffffffu;
  uint32_t kbits = 0u;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t w = keep[n * 8 + tq * 2 + c] >> quad;
      kbits |= (w & 1u) << (4 * n + c);
      kbits |= ((w >> 8) & 1u) << (4 * n + 2 + c);
    }
  return kbits;
}
// Under a key bias, the values of a thread's keys j and j + 8 in log2 units (0 past Sk and
// under the other rules).
template <int kMode>
__device__ __forceinline__ void bwd_key_bias(const AttnArgs& a, const RowCtx& rc, int64_t j, float (&b2)[2]) {
  const float* row = key_bias_row(a, rc);
#pragma unroll
  for (int t = 0; t < 2; ++t) b2[t] = kMode == kKeyBias ? key_bias1(a, row, j + 8 * t) : 0.f;
}
// Probabilities in place of the raw scores P(n, e) (from -lse in log2 units per query,
// nlse2; kvis: the visibility of the thread's two keys; under kKeyBias their bias is added),
// and the kept ones (unscaled) as A fragments of Pᵀ, 16 queries each.
// Under kCausal (and kKeyMask, kKeyBias with the causal rule) the rule is kNoMask's plus the causal
// test in tile coordinates: key jl of the warp sees query il of the tile when jl - il <=
// lim = qb - k0 + Sk - Sq (always, off the diagonal: lim >= 15); kvis holds the keys'
// bounds and mask bits. 32-bit and one compare per element; a 64-bit test per element
// (score_log2), or a branch to kNoMask's loop off the diagonal, left ptxas short of
// registers for the products at D = 64.
template <typename T, int kMode, typename PF>
__device__ __forceinline__ void bwd_probs(const AttnArgs& a, const RowCtx& rc, PF&& P, const float* nlse2,
                                          uint32_t kvis, uint32_t kbits, int64_t qb, int64_t k0, float scale_log2,
                                          int quad, int tq, uint32_t (&pdf)[4][4]) {
  float kb2[2];  // read per tile: held across the loop, they left the wgmma backward at D 64 spilling
  bwd_key_bias<kMode>(a, rc, k0 + quad, kb2);
  int lim = kTile;
  if (kMode == kCausal || ((kMode == kKeyMask || kMode == kKeyBias) && a.causal)) {
    const int64_t l = qb - k0 + a.sk - a.sq;
    lim = l < -kTile ? -kTile : l > kTile ? kTile : static_cast<int>(l);
  }
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    float pd[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int il = n * 8 + tq * 2 + (e & 1), jl = quad + (e >> 1) * 8;
      float x;
      if constexpr (kMode != kAnyMask) {  // kvis: the key's bounds (and its mask bit)
        // No per-element branch: the key's bit is its bounds; a query past Sq has
        // nlse2 = -inf. (Under kKeyMask this took 16% off bert-pad's fwd+bwd against
        // score_log2; attention v4 had measured a form of it 7% slower: bench/NOTES.md.)
        const float base = kMode == kKeyBias ? nlse2[il] + kb2[e >> 1] : nlse2[il];
        x = ((kvis >> (e >> 1)) & 1u) && jl - il <= lim ? fmaf(P(n, e), scale_log2, base) : -INFINITY;
      } else {
        x = score_log2<kMode>(a, rc, P(n, e), qb + il, k0 + jl, (kvis >> (e >> 1)) & 1u) + nlse2[il];
      }
      P(n, e) = fast_exp2(x);  // 0 for masked scores and empty rows
      pd[e] = (kbits >> (4 * n + e)) & 1u ? P(n, e) : 0.f;
    }
    pdf[n / 2][(n & 1) * 2 + 0] = pack2<T>(pd[0], pd[1]);
    pdf[n / 2][(n & 1) * 2 + 1] = pack2<T>(pd[2], pd[3]);
  }
}
// dSᵀ = P ∘ (dropout'(dPᵀ) - delta) from the probabilities P(n, e) and dPdᵀ(n, e) = (V dOᵀ)
// entries, as A fragments of 16 queries each.
template <typename T, typename PF, typename DF>
__device__ __forceinline__ void bwd_dscores(const AttnArgs& a, PF&& P, DF&& DP, uint32_t kbits, const float* delta,
                                            int tq, uint32_t (&dsf)[4][4]) {
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    float ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      ds[e] = P(n, e) * (((kbits >> (4 * n + e)) & 1u ? DP(n, e) * a.keep_scale : 0.f) - delta[n * 8 + tq * 2 + (e & 1)]);
    dsf[n / 2][(n & 1) * 2 + 0] = pack2<T>(ds[0], ds[1]);
    dsf[n / 2][(n & 1) * 2 + 1] = pack2<T>(ds[2], ds[3]);
  }
}

// Pieces both backward kernels share besides the element-wise steps above: the block's
// heads, where its query tiles start, the per-query values of a tile, and the dK, dV stores.

// A backward block owns one key block of k/v head kvh of batch bb (grid y: the B * H /
// group k/v heads). Under grouped-query attention (a.group > 1) its loop walks the query
// tiles of each q head reading that k/v head in turn, so dK and dV sum over the group in
// registers. A step is one iteration's query tile t of q head hh, the next one's next(s).
struct BwdStep {
  int t;
  int64_t hh;
};
struct BwdHeads {
  int64_t bb, kvh, first;
  int tiles, iters;  // query tiles per q head; loop iterations (tiles * group)
  __device__ __forceinline__ BwdStep start() const { return {0, first}; }
  __device__ __forceinline__ BwdStep next(BwdStep s) const {
    return s.t + 1 < tiles ? BwdStep{s.t + 1, s.hh} : BwdStep{0, s.hh + 1};
  }
};
__device__ __forceinline__ BwdHeads bwd_heads(const AttnArgs& a, int tiles) {
  const int64_t hkv = a.h / a.group, bhk = tile_block(a).bh;
  BwdHeads r;
  r.bb = bhk / hkv, r.kvh = bhk % hkv, r.first = r.kvh * a.group;
  r.tiles = tiles, r.iters = tiles * static_cast<int>(a.group);
  return r;
}
// The visibility of a thread's keys j and j + 8 (bits 0 and 1), the same for every query
// tile of a q head: in bounds, and under a key mask, visible to that head (rc).
template <int kMode>
__device__ __forceinline__ uint32_t bwd_key_vis(const AttnArgs& a, const RowCtx& rc, int64_t j) {
  auto visible = [&](int64_t x) { return kMode == kKeyMask ? key_visible(a, rc, x) : x < a.sk; };
  return static_cast<uint32_t>(visible(j)) | static_cast<uint32_t>(visible(j + 8)) << 1;
}
// Whether step s (iteration u) starts a q head whose key mask is not the previous head's
// (a per-head key mask under grouped-query attention): the bits above are read again.
template <int kMode>
__device__ __forceinline__ bool bwd_head_changes_vis(const AttnArgs& a, BwdStep s, int u) {
  return kMode == kKeyMask && a.group > 1 && a.hm != 1 && u > 0 && s.t == 0;
}

// The first query the backward block of keys kblock .. needs, a multiple of 64
// (causal: queries before its first visible key see none of its keys).
__device__ __forceinline__ int64_t bwd_query_begin(const AttnArgs& a, int64_t kblock) {
  if (!a.causal) return 0;
  const int64_t first = kblock - (a.sk - a.sq);
  return first > 0 ? first / kTile * kTile : 0;
}
// Starts copying the lse and delta of queries qb .. qb + 63 (threads 0 .. 63; zero-filled
// past Sq).
__device__ __forceinline__ void load_lse_delta(const AttnArgs& a, float* lse, float* delta, int64_t bh, int64_t qb) {
  if (threadIdx.x < kTile) {
    const int64_t i = qb + threadIdx.x;
    const bool in = i < a.sq;
    cp_async4(lse + threadIdx.x, a.lse + bh * a.sq + (in ? i : 0), in);
    cp_async4(delta + threadIdx.x, a.delta + bh * a.sq + (in ? i : 0), in);
  }
}
// Once a tile's copies have landed: its lse becomes -lse in log2 units (-inf for queries
// past Sq and empty rows: p = 0).
__device__ __forceinline__ void bwd_tile_lse(const AttnArgs& a, int64_t qb, float* nlse2) {
  if (threadIdx.x < kTile) {  // this thread's own copy has landed
    const float lse = nlse2[threadIdx.x];
    nlse2[threadIdx.x] = qb + threadIdx.x < a.sq && lse != -INFINITY ? -lse * kLog2e : -INFINITY;
  }
}
// The warp's keep words (bit t: key k0 + t of the warp) for the 64 queries from qb.
__device__ __forceinline__ void bwd_keep_words(const AttnArgs& a, const Seed& seed, int64_t bh, int64_t qb,
                                               int64_t k0, uint16_t* keep, int lane) {
  if (a.threshold != 0) {
    uint32_t bits[2];
    keep16_pair(a, seed, bh, qb + lane, 32, k0, bits);
    keep[lane] = static_cast<uint16_t>(bits[0]);
    keep[lane + 32] = static_cast<uint16_t>(bits[1]);
  }
}
// Both, as the tile's rows need them.
__device__ __forceinline__ void bwd_tile_rows(const AttnArgs& a, const Seed& seed, int64_t bh, int64_t qb,
                                              int64_t k0, float* nlse2, uint16_t* keep, int lane) {
  bwd_tile_lse(a, qb, nlse2);
  bwd_keep_words(a, seed, bh, qb, k0, keep, lane);
}
// bwd_bias_sums (below) with the validity of the thread's two keys given (in0, in1).
template <int D, typename KF, typename VF>
__device__ __forceinline__ void bwd_bias_sums_keys(const AttnArgs& a, KF&& DK, VF&& DV, int64_t bb, int64_t hh,
                                                   int64_t k0, int quad, int tq, bool in0, bool in1) {
  const bool v_half = (quad & 4) != 0, odd_col = (quad & 2) != 0;
  const int64_t hd = a.h * D, row = bb * ((a.sk + 15) / 16) + k0 / 16;
  float* w = a.dbias_ws + row * 3 * hd + (v_half ? 2 : 1) * hd + hh * D + tq * 2 + (odd_col ? 1 : 0);
  const float scale = v_half ? a.keep_scale : a.scale;
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
    float k[2], v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      k[e] = (in0 ? DK(dn, e) : 0.f) + (in1 ? DK(dn, 2 + e) : 0.f);
      v[e] = (in0 ? DV(dn, e) : 0.f) + (in1 ? DV(dn, 2 + e) : 0.f);
    }
    float pair[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
      pair[e] = (v_half ? v[e] : k[e]) + __shfl_xor_sync(0xffffffffu, v_half ? k[e] : v[e], 16);
    float s = (odd_col ? pair[1] : pair[0]) + __shfl_xor_sync(0xffffffffu, odd_col ? pair[0] : pair[1], 8);
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    if ((quad & 1) == 0) w[dn * 8] = s * scale;
  }
}

// The bias gradient's share of a warp's 16 keys (a.dbias given: packed gradients, whose
// column sums are the q/k/v projection's bias gradient): per column group dn, the dK and
// dV of the thread's valid keys summed over its two keys (four values: dK's columns
// 8 dn + 2 tq + {0, 1}, then dV's), then over the warp's eight quads by halving: across
// lane bit 4 the lower lanes keep dK's pair and the upper dV's, across bit 3 one column of
// the pair, across bit 2 the sum (4 shuffles per group where one sum per value took 12,
// and four values live at a time: the 168-register kernel keeps its stack). The even
// quads store their value, scaled, into the k or v part of workspace row
// b * ceil(Sk / 16) + k0 / 16 (no atomics: every (row, head) slot has one writer, and the
// q part of the row is attention_dq_bias_kernel's). Every lane of the warp calls it.
template <int D, typename KF, typename VF>
__device__ __forceinline__ void bwd_bias_sums(const AttnArgs& a, KF&& DK, VF&& DV, int64_t bb, int64_t hh, int64_t k0,
                                              int quad, int tq) {
  if (k0 >= a.sk) return;  // a warp past the last key (the whole warp: k0 is per warp)
  if (k0 + 16 <= a.sk) {   // every key valid (warp-uniform): no selects
    bwd_bias_sums_keys<D>(a, DK, DV, bb, hh, k0, quad, tq, true, true);
  } else {
    bwd_bias_sums_keys<D>(a, DK, DV, bb, hh, k0, quad, tq, k0 + quad < a.sk, k0 + quad + 8 < a.sk);
  }
}

// dK (times the score scale) and dV (times the dropout scale) of a thread's keys
// k0 + quad (+8): DK(dn, e), DV(dn, e) with e / 2 the key and 8 dn + 2 tq + e % 2 the column;
// with a.dbias, their column sums too (bwd_bias_sums). Every lane of the warp calls it.
template <typename T, int D, typename KF, typename VF>
__device__ __forceinline__ void bwd_store(const AttnArgs& a, KF&& DK, VF&& DV, int64_t bb, int64_t hh, int64_t k0,
                                          int quad, int tq) {
  T* dkg = static_cast<T*>(a.dk) + bb * a.dkv_batch + hh * D;  // hh: the k/v head
  T* dvg = static_cast<T*>(a.dv) + bb * a.dkv_batch + hh * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = k0 + quad + r * 8;
    if (j >= a.sk) continue;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      *reinterpret_cast<uint32_t*>(dkg + j * a.dkv_row + dn * 8 + tq * 2) =
          pack2<T>(DK(dn, 2 * r) * a.scale, DK(dn, 2 * r + 1) * a.scale);
      *reinterpret_cast<uint32_t*>(dvg + j * a.dkv_row + dn * 8 + tq * 2) =
          pack2<T>(DV(dn, 2 * r) * a.keep_scale, DV(dn, 2 * r + 1) * a.keep_scale);
    }
  }
  if (a.dbias[0] != nullptr) bwd_bias_sums<D>(a, DK, DV, bb, hh, k0, quad, tq);
}

// delta[b, h, i] = sum_d dout * out, and dq_acc = 0 (when given). Each row (b, i, h) is
// read by D / 8 consecutive lanes in 16-byte pieces and summed with shuffles; grid
// ceil(B*Sq*H*D/8 / 128), block 128.
template <typename T, int D>
__global__ void attention_delta_kernel(AttnArgs a) {
  // Launched the ordinary way: the tile kernel after it copies the call's inputs before it
  // waits for this kernel (pdl.cuh), so everything before this kernel has finished.
  dependents_may_launch();  // the tile kernel
  constexpr int kVec = 16 / sizeof(T), kLanes = D / kVec;  // lanes per row: 4, 8 or 16
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = g / kLanes, rows = a.b * a.sq * a.h;  // row: (b, i, h) row-major
  const int part = static_cast<int>(g % kLanes);
  float acc = 0.f;
  if (row < rows) {
    float x[kVec], y[kVec];
    load_vec<T, kVec>(static_cast<const T*>(a.dout) + row * D + part * kVec, x);
    load_vec<T, kVec>(static_cast<const T*>(a.out) + row * D + part * kVec, y);
#pragma unroll
    for (int t = 0; t < kVec; ++t) acc += x[t] * y[t];
    // The dq accumulator has the same [B, Sq, H, D] layout: zeroed here, not by a memset
    // (none where the backward reduces dq in clusters).
    if (a.dq_acc != nullptr) {
      float4* z = reinterpret_cast<float4*>(a.dq_acc + row * D + part * kVec);
#pragma unroll
      for (int t = 0; t < kVec / 4; ++t) z[t] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (row < rows && part == 0) {
    const int64_t hh = row % a.h, i = (row / a.h) % a.sq, bb = row / (a.h * a.sq);
    a.delta[(bb * a.h + hh) * a.sq + i] = acc;
  }
}

// dq = scale * dq_acc, rounded to T: eight elements per thread and step (two 16-byte
// loads, one 16-byte store; n is a multiple of 8, D being). The score scale multiplies
// here once instead of at each of the backward's atomics. dq_acc and dq are plain
// [B, Sq, H, D] tensors.
template <typename T>
__device__ __forceinline__ void scale_store8(const float* __restrict__ src, T* __restrict__ dst, float scale) {
  const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
  const float x[8] = {lo.x * scale, lo.y * scale, lo.z * scale, lo.w * scale,
                      hi.x * scale, hi.y * scale, hi.z * scale, hi.w * scale};
  store_vec<T, 8>(dst, x);
}
template <typename T>
__global__ void attention_dq_kernel(const float* __restrict__ acc, T* __restrict__ dq, int64_t n, float scale) {
  wait_for_previous_grid();  // the tile kernel's dq_acc (pdl.cuh)
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * 8; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8)
    scale_store8(acc + i, dq + i, scale);
}

// The same into dq's view (AttnArgs, packed gradients): row r = (b, i) of dq_acc, H * D
// elements, goes to b * dq_batch + i * grad_row. Blocks walk rows (one division per row, not
// per element), threads the row's 16-byte pieces.
template <typename T>
__global__ void attention_dq_view_kernel(const float* __restrict__ acc, T* __restrict__ dq, int64_t rows, int64_t hd,
                                         float scale, int64_t sq, int64_t grad_row, int64_t dq_batch) {
  wait_for_previous_grid();  // the tile kernel's dq_acc (pdl.cuh)
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t bb = r / sq;
    const float* src = acc + r * hd;
    T* dst = dq + bb * dq_batch + (r - bb * sq) * grad_row;
    for (int64_t c = threadIdx.x * 8; c < hd; c += blockDim.x * 8) scale_store8(src + c, dst + c, scale);
  }
}

// dq's view with its column partials (a.dbias given): row r = (b, i) of H * D elements at
// b * dq_batch + i * grad_row, from the f32 accumulator (kFromAcc: dq = scale * dq_acc,
// written) or from dq itself (the clusters wrote it: read only). Row group g < R (the
// workspace's rows, R = B * ceil(S / 16) <= B * S) takes rows g, g + R, ...; a block
// (kDqBiasX, kDqBiasY) takes one group and kDqBiasX * 4 columns: thread (x, y) four
// columns of the rows u = y, y + kDqBiasY, ... of each 16 (all loaded before any is used),
// and the kDqBiasY sums of a column are added in order of y through shared memory into the
// q part of workspace row g, its one writer.
constexpr int kDqBiasX = 64, kDqBiasY = 4;
template <typename T, bool kFromAcc>
__global__ void __launch_bounds__(kDqBiasX* kDqBiasY)
    attention_dq_bias_kernel(const float* __restrict__ acc, T* __restrict__ dq, float* __restrict__ ws, int64_t rows,
                             int64_t groups, int64_t hd, float scale, int64_t sq, int64_t grad_row, int64_t dq_batch) {
  wait_for_previous_grid();  // the tile kernel's dq_acc and workspace rows (pdl.cuh)
  dependents_may_launch();   // the column sum
  constexpr int kRows = 16 / kDqBiasY;  // per thread and pass
  __shared__ float4 part[kDqBiasY][kDqBiasX];
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kDqBiasX + threadIdx.x) * 4;
  const bool col_ok = c < hd;
  auto at = [&](int64_t r) {
    const int64_t bb = r / sq;
    return dq + bb * dq_batch + (r - bb * sq) * grad_row + c;
  };
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    float sum[4] = {};
    for (int64_t r0 = g + threadIdx.y * groups; r0 < rows; r0 += 16 * groups) {
      float x[kRows][4];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int64_t r = r0 + u * kDqBiasY * groups;
        if (r >= rows || !col_ok) {
#pragma unroll
          for (int t = 0; t < 4; ++t) x[u][t] = 0.f;
        } else if constexpr (kFromAcc) {
          const float4 v = *reinterpret_cast<const float4*>(acc + r * hd + c);
          x[u][0] = v.x * scale, x[u][1] = v.y * scale, x[u][2] = v.z * scale, x[u][3] = v.w * scale;
        } else {
          load_vec<T, 4>(at(r), x[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        if constexpr (kFromAcc) {
          const int64_t r = r0 + u * kDqBiasY * groups;
          if (r < rows && col_ok) store_vec<T, 4>(at(r), x[u]);
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) sum[t] += x[u][t];
      }
    }
    part[threadIdx.y][threadIdx.x] = make_float4(sum[0], sum[1], sum[2], sum[3]);
    __syncthreads();
    if (threadIdx.y == 0 && col_ok) {
      float4 s = part[0][threadIdx.x];
#pragma unroll
      for (int y = 1; y < kDqBiasY; ++y) {
        const float4 p = part[y][threadIdx.x];
        s.x += p.x, s.y += p.y, s.z += p.z, s.w += p.w;
      }
      *reinterpret_cast<float4*>(ws + g * 3 * hd + c) = s;
    }
    __syncthreads();  // part is written again for the next group
  }
}

}  // namespace
}  // namespace jaxsub
