// Fused attention on Hopper's warpgroup tensor cores (attention.cu only; sm_90a, D = 64
// and 128), forward and backward. Same contract, grids, key order and results as the
// mma.sync kernels of attention.cu: one warpgroup (the block's four warps) owns 64 rows;
// the products are wgmma with B (and in the backward some A) operands read from
// 128-byte-swizzled shared memory (wgmma.cuh) and the other A operands from registers, in
// the layout of the mma.sync kernels' fragments, so the element-wise steps are shared
// (attention.cuh, attention_bwd.cuh).
// Forward: Q stays in registers; the keep masks of tile t are drawn while O += P V of tile
// t - 1 runs on the tensor cores, and tile t + 2's copies are issued under tile t's score
// product. Three shared-memory stages: tile t + 2 is copied once P V of tile t - 1 has
// read its stage.
// Backward: below, before its kernel.
#pragma once

#include "attention_bwd.cuh"
#include "wgmma.cuh"

namespace jaxsub {
namespace {

constexpr int kSm90Stages = 3;

// Shared memory of the Hopper forward: per stage, the K tile and the V tile (64 keys, each
// a [64][D] swizzled tile of D / 64 panels). Launched with 1024 bytes more than this so
// that the tiles can be aligned to 1024 bytes (the swizzle works on address bits 4-9).
template <int D>
constexpr size_t sm90_fwd_smem() { return 2 * kSm90Stages * static_cast<size_t>(kTile) * D * 2; }
// Blocks per multiprocessor: four at D = 64 (48 KB each), two at D = 128.
template <int D>
constexpr int sm90_fwd_min_blocks() { return D <= 64 ? 4 : 2; }

// Starts copying rows [row0, row0 + 64) of one head of a [B, S, H, D] view into a swizzled
// tile at `dst` (rows past `rows` zero-filled); with kSlots, tile row r goes to tile row
// slot_of(r) (the forward's key order, attention.cuh). Thread t copies 16-byte piece
// t % (D / 8) of tile rows (slots) t / (D / 8) + p * R, R = 128 / (D / 8): R is a multiple
// of 8, so the swizzle of those rows is the same and their offsets are immediates; the
// source row of slot s + p R is key_of(s) + p kRowStep (kSlots) or s + p R, one pointer step
// per pass. (Copying source rows r + p R instead cost ~150 instructions per key tile in
// the forward: the slots of those rows do not share a swizzle.)
template <int R, int kStep>
__host__ __device__ constexpr bool slots_step_by(int passes) {
  for (int s = 0; s < R; ++s)
    for (int p = 0; p < passes; ++p)
      if (key_of(s + p * R) != key_of(s) + p * kStep) return false;
  return true;
}
template <typename T, int D, bool kSlots>
__device__ __forceinline__ void load_tile_swz(unsigned char* dst, const T* src, int64_t row0, int64_t rows,
                                              int64_t row_stride) {
  constexpr int kChunks = D / 8;
  constexpr int kRowsPerPass = kThreads / kChunks;
  constexpr int kPasses = kTile / kRowsPerPass;
  constexpr int kRowStep = kSlots ? 2 * kRowsPerPass / 8 : kRowsPerPass;
  static_assert(kRowsPerPass % 8 == 0 && (!kSlots || slots_step_by<kRowsPerPass, kRowStep>(kPasses)), "copy plan");
  const int slot = threadIdx.x / kChunks, part = threadIdx.x % kChunks;
  const int r0 = kSlots ? key_of(slot) : slot;
  const int64_t left64 = rows - row0 - r0;  // pass p copies a row when p kRowStep < left
  const int left = left64 > kTile ? kTile : static_cast<int>(left64 < 0 ? 0 : left64);
  // The tile's base is the same for the whole block (uniform registers); a thread's byte
  // offsets from it are 32-bit, one add with carry per pass (row_stride < 2^24 elements:
  // use_sm90(a, d), attention.cu).
  const char* tile = reinterpret_cast<const char*>(src + row0 * row_stride);
  const uint32_t off = (static_cast<uint32_t>(r0) * static_cast<uint32_t>(row_stride) + part * 8) * sizeof(T);
  const uint32_t step = kRowStep * static_cast<uint32_t>(row_stride) * sizeof(T);
  unsigned char* d = dst + swz_offset(slot, part * 8);
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const bool full = p * kRowStep < left;
    cp_async16(d + p * kRowsPerPass * 128, tile + (full ? off + p * step : 0u), full);
  }
}

// Bytes from the dynamic shared memory's start to its first 1024-byte boundary (both
// kernels are launched with 1024 bytes more than they use).
__device__ __forceinline__ uint32_t offset_to_1024(const void* raw) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return ((addr + 1023u) & ~1023u) - addr;
}

template <typename T, int D, int kMode>
__global__ void __launch_bounds__(kThreads, sm90_fwd_min_blocks<D>()) attention_fwd_sm90_kernel(AttnArgs a) {
#ifdef JAXSUB_WGMMA
  wait_for_previous_grid();  // launched dependent on the kernel before it (pdl.cuh)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kTileBytes = kTile * D * 2;
  unsigned char* smem = smem_raw + offset_to_1024(smem_raw);
  auto k_stage = [&](int st) { return smem + st * 2 * kTileBytes; };
  auto v_stage = [&](int st) { return smem + st * 2 * kTileBytes + kTileBytes; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, tq = lane % 4;
  const int64_t bh = tile_block(a).bh, bb = bh / a.h, hh = bh % a.h;
  const int64_t q0 = fwd_query_tile(a) * kTile + warp * 16;  // warp's first query row
  const int64_t row_stride = a.kv_row;  // k and v's (q's: load_q_frags)
  const T* qg = static_cast<const T*>(a.q) + bb * a.q_batch + hh * D;
  const T* kg = static_cast<const T*>(a.k) + bb * a.kv_batch + hh / a.group * D;
  const T* vg = static_cast<const T*>(a.v) + bb * a.kv_batch + hh / a.group * D;
  const RowCtx rc = row_ctx(a, bb, hh);
  const Seed seed = load_seed(a.seed, a.seed_offset);

  uint32_t qf[D / 16][4];  // the warp's 16 query rows, A of S = Q Kᵀ
  load_q_frags<T, D>(qf, a, qg, q0, quad, tq);

  float o[D / 2];  // o[4 dn + e]: row quad + 8 (e / 2), column 8 dn + 2 tq + e % 2
#pragma unroll
  for (int x = 0; x < D / 2; ++x) o[x] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2 units), sum
  const int tiles = fwd_key_tiles(a);
  auto load_kv = [&](int t) {
    if (t < tiles) {
      const int st = t % kSm90Stages;
      load_tile_swz<T, D, true>(k_stage(st), kg, static_cast<int64_t>(t) * kTile, a.sk, row_stride);
      load_tile_swz<T, D, true>(v_stage(st), vg, static_cast<int64_t>(t) * kTile, a.sk, row_stride);
    }
    cp_async_commit();  // empty groups keep the count: tile t is always group t
  };
  load_kv(0);
  load_kv(1);
  uint32_t pf[4][4] = {};  // kept probabilities of the tile whose P V is in flight
  for (int t = 0; t < tiles; ++t) {
    const int64_t kb = static_cast<int64_t>(t) * kTile;
    const int st = t % kSm90Stages;
    // Keep masks first, while P V of tile t - 1 runs on the tensor cores (the scores'
    // registers are not live yet; pf, P V's operand, is).
    KeepMasks keep;
    if (a.threshold != 0) {
      keep_masks32(a, seed, bh, q0 + quad, kb + tq * 16, keep.m);
    } else {
#pragma unroll
      for (int n = 0; n < 8; ++n) keep.m[0][n] = keep.m[1][n] = 0xffffffffu;
    }
    wgmma_wait<0>();  // P V of the previous tile is done: pf and its stage are free
#pragma unroll
    for (int x = 0; x < D / 2; ++x) reg_fence(o[x]);
    cp_async_wait<1>();  // tile t landed (t + 1 may still be in flight)
    fence_proxy_async();
    __syncthreads();
    const uint32_t kaddr = static_cast<uint32_t>(__cvta_generic_to_shared(k_stage(st)));
    const uint32_t vaddr = static_cast<uint32_t>(__cvta_generic_to_shared(v_stage(st)));

    float s[32];  // s[4 n + e]: row quad + 8 (e / 2), key kb + 16 tq + 2 n + e % 2
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc)
      wgmma_rs<T, 64, false>(s, qf[kc], wgmma_desc(kaddr + (kc / 4) * kPanelBytes + (kc % 4) * 32), kc > 0);
    wgmma_commit();
    // The stage P V of tile t - 1 read is free: copy tile t + 2 into it under the product.
    load_kv(t + 2);
    wgmma_wait<0>();  // S of this tile
#pragma unroll
    for (int x = 0; x < 32; ++x) reg_fence(s[x]);

    fwd_softmax_tile<T, kMode, D>(
        a, rc, [&](int n, int e) -> float& { return s[4 * n + e]; }, [&](int dn, int e) -> float& { return o[4 * dn + e]; },
        m, l, keep, q0 + quad, kb, tq, pf);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) wgmma_rs<T, D, true>(o, pf[kc], wgmma_desc(vaddr + kc * 16 * 128), true);
    wgmma_commit();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int x = 0; x < D / 2; ++x) reg_fence(o[x]);
  cp_async_wait<0>();

  fwd_store<T, D>(a, [&](int dn, int e) { return o[4 * dn + e]; }, m, l, bh, bb, hh, q0, quad, tq);
#else
  __trap();  // launched without sm_90a device code: a build error, never a wrong result
#endif
}

// The backward's cluster reduction of dQ (kClusterDq, below). Element (row, col) of a
// [64][D] f32 exchange buffer sits at row * D + (col ^ 4 (row % 8)): the writers' float2
// and the readers' float4 stay whole.
template <int D>
__device__ __forceinline__ int dq_slot(int row, int col) { return row * D + (col ^ ((row & 7) << 2)); }

// This warp's dQ partial of one query tile (the dQ product's accumulator c) into the
// block's exchange buffer x (the stage's Q and dO tiles, free once every warp's products
// are done with them).
template <int D>
__device__ __forceinline__ void bwd_stash_dq(const float (&c)[D / 2], float* x, int warp, int quad, int tq) {
  __syncthreads();  // every warp's products have read this stage's Q and dO
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + quad + r * 8;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<float2*>(x + dq_slot<D>(row, dn * 8 + tq * 2)) =
          make_float2(c[4 * dn + 2 * r], c[4 * dn + 2 * r + 1]);
  }
}

// After the loop: block r of the cluster sums rows r * 64 / C .. of every block's partials
// of query tile t (buffer x(t)) through distributed shared memory, in rank order, and
// stores dq = scale * sum in the output dtype. Tile t holds queries 64 t .. (no causal
// mask: every block's queries start at 0).
template <typename T, int D, typename X>
__device__ __forceinline__ void bwd_cluster_dq(const AttnArgs& a, X x, int tiles, int64_t bb, int64_t hh) {
  cluster_sync();  // every block's partials are written
  uint32_t rank = 0, size = 1;
  cluster_rank_size(rank, size);
  const int ranks = static_cast<int>(size), me = static_cast<int>(rank);
  const int per = (kTile + ranks - 1) / ranks, r0 = me * per, r1 = min(r0 + per, kTile);
  T* dq = static_cast<T*>(a.o) + bb * a.dq_batch + hh * D;
  for (int t = 0; t < tiles; ++t) {
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(x(t)));
    for (int idx = threadIdx.x; idx < (r1 - r0) * (D / 4); idx += kThreads) {
      const int row = r0 + idx / (D / 4), col = idx % (D / 4) * 4;
      const int64_t i = static_cast<int64_t>(t) * kTile + row;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int p = 0; p < ranks; ++p) {  // rank order: the same sum on every run
        const float4 v = cluster_load4(base + 4 * dq_slot<D>(row, col), static_cast<uint32_t>(p));
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
      }
      if (i < a.sq) {
        const float out[4] = {sum.x * a.scale, sum.y * a.scale, sum.z * a.scale, sum.w * a.scale};
        store_vec<T, 4>(dq + i * a.grad_row + col, out);
      }
    }
  }
  cluster_sync();  // no block leaves while another still reads its shared memory
}

// ---------------------------------------------------------------------------------------
// The backward on the warpgroup tensor cores: same contract, grid and results as
// attention_bwd_kernel (attention.cu). One warpgroup owns 64 keys (warp w: keys 16 w ..
// 16 w + 15, the M rows of its products); per query tile of 64:
//   Sᵀ = K Qᵀ (A = K, B = Q, both K-major in shared memory) and dPdᵀ = V dOᵀ (A = V,
//   B = dO K-major), issued together; P in place of Sᵀ, and dSᵀ; dV += Pdᵀ dO (A = kept
//   Pᵀ in registers, B = dO MN-major) and dK += dSᵀ Q (A = dSᵀ in registers, B = Q
//   MN-major), issued together while dSᵀ goes to shared memory; then dQ = dS K (A = dSᵀ
//   MN-major, that is dS, B = K MN-major; warp w: queries 16 w ..) added to the f32
//   workspace.
// Shared memory: K, V, stage 0's Q and dO, dSᵀ, stage 1's Q and dO (swizzled tiles), at
// D = 64 the permuted K, then per stage the tile's lse and delta, then the warps' keep words.
// At D = 64 the accumulator path also keeps a copy of K with its columns permuted
// (bwd_permute_k, below): 7 tiles (66 KB a block, still three per SM). At D = 128 the
// eighth tile would leave room for one block per SM, so D = 128 adds float2 pairs.
template <int D, bool kClusterDq>
__host__ __device__ constexpr bool sm90_bwd_dq4() { return D == 64 && !kClusterDq; }
template <int D>
__host__ __device__ constexpr size_t sm90_bwd_tiles() {
  return (D == 64 ? 7 : 6) * static_cast<size_t>(kTile) * D * 2 + kTile * kTile * 2;
}
template <int D>
constexpr size_t sm90_bwd_smem() { return sm90_bwd_tiles<D>() + 2 * 2 * kTile * 4 + kWarps * kTile * 2; }
// Blocks per multiprocessor: three at D = 64 (66 KB each, 168 registers), two at D = 128
// (106 KB). (Before the products were regrouped, ptxas serialized them at D = 64 for lack of
// registers; two blocks of 198 registers without that measured slower: bench/NOTES.md,
// "Hopper kernels". The general-mask kernel, kAnyMask, is still serialized.)
template <int D>
constexpr int sm90_bwd_min_blocks() { return D <= 64 ? 3 : 2; }

// The dQ product's B operand, K with columns permuted inside each group of 16: column
// 16 j + 8 h + 2 u + e of the copy holds column 16 j + 4 u + 2 h + e of K (j < D / 16,
// h, e < 2, u < 4). The product's accumulator then gives thread tq of a quad columns
// 16 j + 4 tq .. + 3 of its rows, adjacent, in c[8 j + 2 r + {0, 1}] and c[8 j + 4 + 2 r +
// {0, 1}]: one 16-byte reduction (REDG.F32x4) where the plain layout needs two 8-byte
// ones, and no shuffles (the eighth session's float4 version traded halves between lanes
// and spilled). Word w of a 128-byte row: a warp copies one whole row, conflict-free.
template <int D>
__device__ __forceinline__ void bwd_permute_k(unsigned char* dst, const unsigned char* src) {
  constexpr int kWords = D / 2;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < kTile * kWords; idx += kThreads) {
    const int row = idx / kWords, w = idx % kWords;
    const int j = w / 8, h = (w / 4) & 1, u = w & 3;
    *reinterpret_cast<uint32_t*>(dst + swz_offset(row, 2 * w)) =
        *reinterpret_cast<const uint32_t*>(src + swz_offset(row, 16 * j + 4 * u + 2 * h));
  }
}

//
// kClusterDq (short sequences: at most two query tiles, Sq <= 128, so each tile keeps its
// stage; no causal mask; at most 8 key blocks): the key blocks of one (b, h) form a thread
// block cluster. Each block leaves its dQ partial of query tile t, f32, in the shared
// memory of stage t's Q and dO tiles (64 x D x 4 bytes, exactly the two tiles), and after
// the loop the cluster reduces them (bwd_cluster_dq): no f32 accumulator to zero and
// convert, no atomics, a deterministic dQ, and no barrier across blocks inside the loop
// (one per query tile measured slower: bench/NOTES.md).
template <typename T, int D, int kMode, bool kClusterDq>
__global__ void __launch_bounds__(kThreads, sm90_bwd_min_blocks<D>()) attention_bwd_sm90_kernel(AttnArgs a) {
#ifdef JAXSUB_WGMMA
  dependents_may_launch();  // the dq kernel (pdl.cuh)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kTileBytes = kTile * D * 2, kDsBytes = kTile * kTile * 2;
  unsigned char* smem = smem_raw + offset_to_1024(smem_raw);
  // K, V, Q0, dO0, dSᵀ, Q1, dO1: each stage's Q and dO tiles are adjacent.
  unsigned char* k_s = smem;
  unsigned char* v_s = smem + kTileBytes;
  auto q_s = [&](int st) { return smem + (st ? 4 * kTileBytes + kDsBytes : 2 * kTileBytes); };
  auto do_s = [&](int st) { return q_s(st) + kTileBytes; };
  unsigned char* ds_s = smem + 4 * kTileBytes;
  constexpr bool kDq4 = sm90_bwd_dq4<D, kClusterDq>();
  unsigned char* kp_s = smem + 6 * kTileBytes + kDsBytes;  // bwd_permute_k's copy (kDq4)
  float* lse_s = reinterpret_cast<float*>(smem + sm90_bwd_tiles<D>());  // [2][64]
  float* delta_s = lse_s + 2 * kTile;                                     // [2][64]
  uint16_t* keep_s = reinterpret_cast<uint16_t*>(delta_s + 2 * kTile);    // [4 warps][64]
  auto addr = [](const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, tq = lane % 4;
  const int64_t kblock = tile_block(a).rank * kTile;  // rank 0: seen by the most queries (causal)
  const int64_t k0 = kblock + warp * 16;  // warp's first key
  const int64_t out_row = a.h * D;        // dout and dq_acc: plain [B, Sq, H, D]
  const int64_t q_begin = bwd_query_begin(a, kblock);
  const BwdHeads hd = bwd_heads(a, a.sq > q_begin ? static_cast<int>((a.sq - q_begin + kTile - 1) / kTile) : 0);
  const int64_t bb = hd.bb;
  const T* kg = static_cast<const T*>(a.k) + bb * a.kv_batch + hd.kvh * D;
  const T* vg = static_cast<const T*>(a.v) + bb * a.kv_batch + hd.kvh * D;
  const Seed seed = load_seed(a.seed, a.seed_offset);
  const float scale_log2 = a.scale * kLog2e;
  auto q_of = [&](int64_t hh) { return static_cast<const T*>(a.q) + bb * a.q_batch + hh * D; };
  auto do_of = [&](int64_t hh) { return static_cast<const T*>(a.dout) + (bb * a.sq * a.h + hh) * D; };

  // Iteration u's query tile (BwdHeads): Q and dO, then its lse and delta.
  auto load_qdo = [&](BwdStep s, int st) {
    const int64_t hh = s.hh, qb = q_begin + static_cast<int64_t>(s.t) * kTile;
    load_tile_swz<T, D, false>(q_s(st), q_of(hh), qb, a.sq, a.qkv_row);
    load_tile_swz<T, D, false>(do_s(st), do_of(hh), qb, a.sq, out_row);
  };
  auto load_rows = [&](BwdStep s, int st) {
    load_lse_delta(a, lse_s + st * kTile, delta_s + st * kTile, bb * a.h + s.hh,
                   q_begin + static_cast<int64_t>(s.t) * kTile);
  };
  load_tile_swz<T, D, false>(k_s, kg, kblock, a.sk, a.kv_row);
  load_tile_swz<T, D, false>(v_s, vg, kblock, a.sk, a.kv_row);
  if (hd.iters > 0) load_qdo(hd.start(), 0);
  // Launched dependent on the delta kernel (pdl.cuh): the copies of the call's inputs above
  // are in flight while it finishes; delta and the zeroed dq accumulator only after it.
  wait_for_previous_grid();
  if (hd.iters > 0) load_rows(hd.start(), 0);
  cp_async_commit();
  if constexpr (kDq4) {  // the dQ product reads the copy after the loop's barriers
    cp_async_wait<0>();
    __syncthreads();
    bwd_permute_k<D>(kp_s, k_s);
  }

  float dk[D / 2], dv[D / 2];  // [4 dn + e]: key quad + 8 (e / 2) of the warp, column 8 dn + 2 tq + e % 2
#pragma unroll
  for (int x = 0; x < D / 2; ++x) dk[x] = dv[x] = 0.f;
  uint32_t kvis = bwd_key_vis<kMode>(a, row_ctx(a, bb, hd.first), k0 + quad);
  // K-major operand descriptors step 32 bytes per 16 columns inside a panel; MN-major
  // ones 16 rows (2048 bytes) per 16 of the reduction dim.
  auto kmajor = [](uint32_t tile, int kc) { return wgmma_desc(tile + (kc / 4) * kPanelBytes + (kc % 4) * 32); };
  auto mnmajor = [](uint32_t tile, int kc) { return wgmma_desc(tile + kc * 2048); };

  uint16_t* keep_w = keep_s + warp * kTile;  // the warp's keep words of the current tile

  BwdStep cur = hd.start();
  for (int u = 0; u < hd.iters; ++u, cur = hd.next(cur)) {
    const BwdStep nxt = hd.next(cur);
    const int64_t hh = cur.hh, bh = bb * a.h + hh;
    const int64_t qb = q_begin + static_cast<int64_t>(cur.t) * kTile;
    const RowCtx rc = row_ctx(a, bb, hh);
    if (bwd_head_changes_vis<kMode>(a, cur, u)) kvis = bwd_key_vis<kMode>(a, rc, k0 + quad);
    float* dqg = a.dq_acc + (bb * a.sq * a.h + hh) * D;
    const int buf = u & 1;
    // The other stage was last read by the previous tile's products, all waited for.
    if (u + 1 < hd.iters) load_qdo(nxt, buf ^ 1), load_rows(nxt, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    float* nlse2 = lse_s + buf * kTile;
    const float* delta = delta_s + buf * kTile;
    bwd_tile_lse(a, qb, nlse2);
    bwd_keep_words(a, seed, bh, qb, k0, keep_w, lane);
    fence_proxy_async();
    __syncthreads();
    const uint32_t qa = addr(q_s(buf)), da = addr(do_s(buf));

    // Sᵀ and dPdᵀ issued together, then P, dSᵀ, and dV and dK issued together: no more
    // than the two score tiles and dK, dV are live across a product (with P still live
    // across the dV and dP products, ptxas ran every product serialized).
    float p[32];    // Sᵀ, then P: [4 n + e] = query 8 n + 2 tq + e % 2 of the tile, key quad + 8 (e / 2)
    float dpt[32];  // dPdᵀ = V dOᵀ, entries as p's
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) wgmma_ss<T, 64, false, false>(p, kmajor(addr(k_s), kc), kmajor(qa, kc), kc > 0);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) wgmma_ss<T, 64, false, false>(dpt, kmajor(addr(v_s), kc), kmajor(da, kc), kc > 0);
    wgmma_commit();
    const uint32_t kbits = bwd_keep_bits(a, keep_w, quad, tq);
    wgmma_wait<0>();
#pragma unroll
    for (int x = 0; x < 32; ++x) reg_fence(p[x]), reg_fence(dpt[x]);
    uint32_t pdf[4][4], dsf[4][4];
    bwd_probs<T, kMode>(a, rc, [&](int n, int e) -> float& { return p[4 * n + e]; }, nlse2, kvis, kbits, qb, k0,
                        scale_log2, quad, tq, pdf);
    bwd_dscores<T>(a, [&](int n, int e) { return p[4 * n + e]; }, [&](int n, int e) { return dpt[4 * n + e]; }, kbits,
                   delta, tq, dsf);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) wgmma_rs<T, D, true>(dv, pdf[kc], mnmajor(da, kc), true);
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) wgmma_rs<T, D, true>(dk, dsf[kc], mnmajor(qa, kc), true);
    wgmma_commit();
#pragma unroll
    for (int n = 0; n < 8; ++n) {  // dSᵀ to shared memory: row = key of the block, column = query
      const int row = warp * 16 + quad, col = n * 8 + tq * 2;
      *reinterpret_cast<uint32_t*>(ds_s + swz_offset(row, col)) = dsf[n / 2][(n & 1) * 2 + 0];
      *reinterpret_cast<uint32_t*>(ds_s + swz_offset(row + 8, col)) = dsf[n / 2][(n & 1) * 2 + 1];
    }
    fence_proxy_async();
    __syncthreads();
    float c[D / 2];  // dQ of the warp's 16 queries: [4 dn + e] = query 16 warp + quad + 8 (e / 2), column 8 dn + 2 tq + e % 2
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < 4; ++kc)
      wgmma_ss<T, D, true, true>(c, mnmajor(addr(ds_s), kc), mnmajor(addr(kDq4 ? kp_s : k_s), kc), kc > 0);
    wgmma_commit();
    wgmma_wait<0>();  // dV, dK and dQ: Q, dO and dSᵀ are free after this
#pragma unroll
    for (int x = 0; x < D / 2; ++x) reg_fence(c[x]), reg_fence(dk[x]), reg_fence(dv[x]);
    if constexpr (kClusterDq) {
      bwd_stash_dq<D>(c, reinterpret_cast<float*>(q_s(buf)), warp, quad, tq);
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = qb + warp * 16 + quad + r * 8;
        if (i >= a.sq) continue;
        if constexpr (kDq4) {  // columns 16 j + 4 tq .. + 3 (bwd_permute_k)
          float* dq_row = dqg + i * out_row + tq * 4;
#pragma unroll
          for (int j = 0; j < D / 16; ++j)
            atomicAdd(reinterpret_cast<float4*>(dq_row + j * 16),
                      make_float4(c[8 * j + 2 * r], c[8 * j + 2 * r + 1], c[8 * j + 4 + 2 * r], c[8 * j + 5 + 2 * r]));
        } else {
          float* dq_row = dqg + i * out_row + tq * 2;
#pragma unroll
          for (int dn = 0; dn < D / 8; ++dn)  // the scale: the dq kernel
            atomicAdd(reinterpret_cast<float2*>(dq_row + dn * 8), make_float2(c[4 * dn + 2 * r], c[4 * dn + 2 * r + 1]));
        }
      }
    }
    // dSᵀ and keep_s are rewritten next iteration only after its first barrier, which
    // every warp reaches after its own wait above.
  }
  cp_async_wait<0>();  // no copy outlives the block (tiles == 0: the K, V copies)
  // (kClusterDq: group 1, so the k/v head is the q head and iteration u is query tile u.)
  if constexpr (kClusterDq)
    bwd_cluster_dq<T, D>(a, [&](int t) { return reinterpret_cast<float*>(q_s(t)); }, hd.iters, bb, hd.kvh);

  bwd_store<T, D>(a, [&](int dn, int e) { return dk[4 * dn + e]; }, [&](int dn, int e) { return dv[4 * dn + e]; }, bb,
                  hd.kvh, k0, quad, tq);
#else
  __trap();  // launched without sm_90a device code: a build error, never a wrong result
#endif
}

}  // namespace
}  // namespace jaxsub
