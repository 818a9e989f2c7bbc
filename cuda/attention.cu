// Fused attention with in-kernel dropout, forward and backward (FlashAttention-2 structure
// on mma.sync m16n8k16 tensor-core instructions), CUDA. Contract: ABI.md ("Attention
// family"). The [B, H, Sq, Sk] scores never reach memory: the forward keeps a running
// max and sum per query row and saves only the log-sum-exp; the backward recomputes the
// probabilities from it and regenerates the dropout mask at the same logical index as
// the softmax op, so the fused and unfused paths drop the same elements.
//
// Block: 4 warps. Forward: 64 query rows per block (16 per warp), key tiles of 64 in
// shared memory. Backward: 64 keys per block (16 per warp), query tiles of 64 in shared
// memory; dK, dV accumulate in registers, dQ in an f32 workspace through atomics (one per
// element pair per block and query tile, 8-byte vector atomics on sm_90). Tiles are
// copied one ahead with cp.async (two shared-memory stages) where shared memory allows.
// Operands reach the tensor cores
// through ldmatrix. Each kernel is instantiated per score rule (MaskMode): calls without
// mask and causal carry no mask code, and a key-padding mask is read once per key.
// Probabilities enter the P V products unscaled (kept or zero); the dropout scale
// multiplies the output and dV once, in f32. On Hopper (sm_90a builds, compute capability
// 9.0) D = 64 and 128 run the same structure on warpgroup tensor cores instead
// (attention_sm90.cuh); these mma.sync kernels serve D = 32 and other GPUs. The FFI
// handlers, at the end, are in attention_ffi.cuh.
#include <cmath>
#include <atomic>
#include <cstdlib>

#include "attention.cuh"
#include "attention_bwd.cuh"
#include "attention_sm90.cuh"
#include "rows.cuh"  // column_sum_kernel: the bias gradient's ordered sum

namespace jaxsub {
namespace {

// ---------------------------------------------------------------------------------------
// Forward. grid (ceil(Sq / 64), B * H: for_head_chunks), block 128.
//
// Key order inside a tile: the score mma's column c (n-block c / 8, thread c % 8 / 2 of a
// quad) holds key  key_of(c) = (c % 8 / 2) * 16 + (c / 8) * 2 + c % 2,  so thread tq of a
// quad owns the 16 consecutive keys 16 tq .. 16 tq + 15 of each of its rows: their
// dropout decisions are two Philox calls (8 keys each) instead of one per pair. The K and
// V tiles are stored in that order (key j in shared row slot_of(j), attention.cuh), so
// the ldmatrix row addresses of column c are row c: consecutive, free of bank conflicts.

// Forward shared memory: K and V tiles, two stages (the next tile is copied while this
// one is used).
template <typename T, int D>
struct FwdSmem {
  T k[2][kTile * (D + kPad)];
  T v[2][kTile * (D + kPad)];
};
// Blocks per multiprocessor the forward is compiled for (register cap 65536 / (128 * n)):
// four at D <= 64 (128 registers), two at D = 128.
template <int D>
constexpr int fwd_min_blocks() { return D <= 64 ? 4 : 2; }

template <typename T, int D, int kMode>
__global__ void __launch_bounds__(kThreads, fwd_min_blocks<D>()) attention_fwd_kernel(AttnArgs a) {
  wait_for_previous_grid();  // launched dependent on the kernel before it (pdl.cuh)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  FwdSmem<T, D>& sm = *reinterpret_cast<FwdSmem<T, D>*>(smem_raw);
  constexpr int kRow = D + kPad;
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

  // This lane's ldmatrix row addresses. K (plain, B of Q Kᵀ): matrix m = lane / 8 is
  // (key rows key_of(8 n + r), d columns 16 kc + 8 (m % 2) + 16 (m / 2)). V (transposed, B
  // of P V): (key rows key_of(16 kc + 8 (m % 2) + r), d columns 8 dn + 8 (m / 2)). Key
  // key_of(c) is in shared row c.
  const int lm = lane / 8, lr = lane % 8;
  const int k_lane = lr * kRow + (lm % 2) * 8 + (lm / 2) * 16;
  const int v_lane = (lr + 8 * (lm % 2)) * kRow + (lm / 2) * 8;

  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2 units), sum
  const int tiles = fwd_key_tiles(a);
  if (tiles > 0) {
    load_tile<T, D, true>(sm.k[0], kg, 0, a.sk, row_stride);
    load_tile<T, D, true>(sm.v[0], vg, 0, a.sk, row_stride);
  }
  cp_async_commit();
  for (int t = 0; t < tiles; ++t) {
    const int64_t kb = static_cast<int64_t>(t) * kTile;
    const int buf = t & 1;
    // Copy the next tile into the other stage (free: the barrier at the end of the last
    // iteration saw every warp done with it), then wait for this one.
    if (t + 1 < tiles) {
      load_tile<T, D, true>(sm.k[buf ^ 1], kg, kb + kTile, a.sk, row_stride);
      load_tile<T, D, true>(sm.v[buf ^ 1], vg, kb + kTile, a.sk, row_stride);
    }
    cp_async_commit();
    // Keep bits first (while the copy lands): the generator's temporaries are dead before
    // the scores are live.
    KeepBits keep;
    if (a.threshold != 0) {
      keep.bits[0] = keep16(a, seed, bh, q0 + quad, kb + tq * 16);
      keep.bits[1] = keep16(a, seed, bh, q0 + quad + 8, kb + tq * 16);
    }
    cp_async_wait<1>();
    __syncthreads();
    const T* ks = sm.k[buf];
    const T* vs = sm.v[buf];

    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < D / 16; kc += 2) {
        uint32_t b[4];
        ldsm(b, ks + k_lane + n * 8 * kRow + kc * 16);
        mma<T>(s[n], qf[kc], b[0], b[1]);
        mma<T>(s[n], qf[kc + 1], b[2], b[3]);
      }
    }
    uint32_t pf[4][4];  // kept probabilities (unscaled) as A fragments, 16 key slots each
    fwd_softmax_tile<T, kMode, D>(
        a, rc, [&](int n, int e) -> float& { return s[n][e]; }, [&](int dn, int e) -> float& { return o[dn][e]; },
        m, l, keep, q0 + quad, kb, tq, pf);
#pragma unroll
    for (int kc = 0; kc < 4; ++kc)
#pragma unroll
      for (int dn = 0; dn < D / 8; dn += 2) {
        uint32_t b[4];
        ldsm_t(b, vs + v_lane + kc * 16 * kRow + dn * 8);
        mma<T>(o[dn], pf[kc], b[0], b[1]);
        mma<T>(o[dn + 1], pf[kc], b[2], b[3]);
      }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  fwd_store<T, D>(a, [&](int dn, int e) { return o[dn][e]; }, m, l, bh, bb, hh, q0, quad, tq);
}

// ---------------------------------------------------------------------------------------
// Backward (its warp-tile products and the delta and dq kernels: attention_bwd.cuh).

// Backward stages: two query tiles in flight (Q, dO, lse, delta of the next one are
// copied while this one is used) where shared memory allows three blocks per
// multiprocessor; one at D = 128.
template <int D>
constexpr int bwd_stages() { return D <= 64 ? 2 : 1; }
// Blocks per multiprocessor the backward is compiled for: three at D <= 64 (170
// registers), one at D = 128 (its 116 KB of shared memory allow no more).
template <int D>
constexpr int bwd_min_blocks() { return D <= 64 ? 3 : 1; }

// Shared memory of the backward kernel (dynamic; 66 KB at D = 64).
template <typename T, int D>
struct BwdSmem {
  static constexpr int kStages = bwd_stages<D>();
  T q[kStages][kTile * (D + kPad)];     // query tile
  T dout[kStages][kTile * (D + kPad)];  // dO tile
  T k[kTile * (D + kPad)];              // the block's 64 keys (A of Kᵀ.. and B of dQ = dS K)
  T v[kTile * (D + kPad)];              // the block's 64 values (A of V dOᵀ)
  T ds[kTile * (kTile + kPad)];         // dSᵀ of the block: [64 keys][64 queries]
  float lse[kStages][kTile];            // per query of the tile: lse (-lse in log2 units after the wait)
  float delta[kStages][kTile];          // per query of the tile: delta
  uint16_t keep[kWarps][kTile];         // per warp and query: keep bits of the warp's 16 keys
};

// grid (ceil(Sk / 64), B * H: for_head_chunks), block 128; each warp owns 16 keys. dK, dV
// accumulate in registers; dQ for the tile's 64 queries is computed once per block from the
// block's dSᵀ in shared memory (warp w: queries 16 w .. 16 w + 15) and added to the f32 workspace.
// K and V fragments are read from shared memory per query tile (holding them in
// registers cost a block per multiprocessor).
template <typename T, int D, int kMode>
__global__ void __launch_bounds__(kThreads, bwd_min_blocks<D>()) attention_bwd_kernel(AttnArgs a) {
  wait_for_previous_grid();  // delta and the zeroed accumulator (launched dependent: pdl.cuh)
  dependents_may_launch();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using Smem = BwdSmem<T, D>;
  constexpr int kStages = Smem::kStages;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  constexpr int kRow = D + kPad, kDsRow = kTile + kPad;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, tq = lane % 4;
  const int64_t kblock = tile_block(a).rank * kTile;  // rank 0: seen by the most queries (causal)
  const int64_t k0 = kblock + warp * 16;  // warp's first key
  const int64_t out_row = a.h * D;        // dout and dq_acc: plain [B, Sq, H, D]
  // Queries before the block's first visible one are never needed.
  const int64_t q_begin = bwd_query_begin(a, kblock);
  const BwdHeads hd = bwd_heads(a, a.sq > q_begin ? static_cast<int>((a.sq - q_begin + kTile - 1) / kTile) : 0);
  const int64_t bb = hd.bb;
  const T* kg = static_cast<const T*>(a.k) + bb * a.kv_batch + hd.kvh * D;
  const T* vg = static_cast<const T*>(a.v) + bb * a.kv_batch + hd.kvh * D;
  const Seed seed = load_seed(a.seed, a.seed_offset);
  const float scale_log2 = a.scale * kLog2e;
  // Starts the copies of iteration u's query tile into stage `st`.
  auto load_query_tile = [&](BwdStep s, int st) {
    const int64_t hh = s.hh, qb = q_begin + static_cast<int64_t>(s.t) * kTile;
    load_tile<T, D>(sm.q[st], static_cast<const T*>(a.q) + bb * a.q_batch + hh * D, qb, a.sq, a.qkv_row);
    load_tile<T, D>(sm.dout[st], static_cast<const T*>(a.dout) + (bb * a.sq * a.h + hh) * D, qb, a.sq, out_row);
    load_lse_delta(a, sm.lse[st], sm.delta[st], bb * a.h + hh, qb);
  };

  load_tile<T, D>(sm.k, kg, kblock, a.sk, a.kv_row);
  load_tile<T, D>(sm.v, vg, kblock, a.sk, a.kv_row);
  if (kStages == 2 && hd.iters > 0) load_query_tile(hd.start(), 0);
  cp_async_commit();
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  // The visibility of this thread's two keys (k0 + quad, k0 + quad + 8: bits 0 and 1), the
  // same for every query tile of a q head: in bounds, and under a key mask, visible (unused
  // by kAnyMask).
  uint32_t kvis = bwd_key_vis<kMode>(a, row_ctx(a, bb, hd.first), k0 + quad);

  // ldmatrix row addresses of this lane (matrix m = lane / 8, row r = lane % 8).
  const int lm = lane / 8, lr = lane % 8;
  // Plain, A of Kᵀ Q / V dOᵀ (rows = the warp's keys 16 warp + 8 (m % 2) + r, d columns 8 (m / 2)).
  const int a_off = (warp * 16 + (lm % 2) * 8 + lr) * kRow + (lm / 2) * 8;
  // Plain, B of Kᵀ Q / V dOᵀ (rows = queries 8 n + r, d columns 16 kc + 8 (m % 2) + 16 (m / 2)).
  const int plain_off = lr * kRow + (lm % 2) * 8 + (lm / 2) * 16;
  // Transposed, B of Pᵀ dO / dSᵀ Q (rows = queries 16 kc + 8 (m % 2) + r, d columns 8 dn + 8 (m / 2)),
  // and of dS K (rows = keys 16 kc + 8 (m % 2) + r).
  const int trans_off = ((lm % 2) * 8 + lr) * kRow + (lm / 2) * 8;
  // Transposed, A of dS K from dSᵀ (rows = keys 16 kc + 8 (m / 2) + r, query columns 16 warp + 8 (m % 2)).
  const T* ds_lane = sm.ds + ((lm / 2) * 8 + lr) * kDsRow + warp * 16 + (lm % 2) * 8;

  BwdStep cur = hd.start();
  for (int u = 0; u < hd.iters; ++u, cur = hd.next(cur)) {
    const BwdStep nxt = hd.next(cur);
    const int64_t hh = cur.hh, bh = bb * a.h + hh;
    const int64_t qb = q_begin + static_cast<int64_t>(cur.t) * kTile;
    const RowCtx rc = row_ctx(a, bb, hh);
    if (bwd_head_changes_vis<kMode>(a, cur, u)) kvis = bwd_key_vis<kMode>(a, rc, k0 + quad);
    float* dqg = a.dq_acc + (bb * a.sq * a.h + hh) * D;
    const int buf = kStages == 2 ? (u & 1) : 0;
    if (kStages == 2) {
      if (u + 1 < hd.iters) load_query_tile(nxt, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      load_query_tile(cur, 0);  // the last iteration read this stage before its second barrier
      cp_async_commit();
      cp_async_wait<0>();
    }
    bwd_tile_rows(a, seed, bh, qb, k0, sm.lse[buf], sm.keep[warp], lane);
    __syncthreads();
    const T* qs = sm.q[buf];
    const T* dos = sm.dout[buf];
    const float* nlse2 = sm.lse[buf];
    const float* delta = sm.delta[buf];

    // Per query tile, in an order that keeps few tiles live: Sᵀ = K Qᵀ -> probabilities (in
    // place) -> dV += Pdᵀ dO -> dPdᵀ = V dOᵀ -> dSᵀ (in place) -> dK += dSᵀ Q. Rows = the
    // warp's 16 keys, columns = the tile's 64 queries.
    float p[8][4];
    keys_by_queries<T, D>(p, sm.k + a_off, qs + plain_off);
    const uint32_t kbits = bwd_keep_bits(a, sm.keep[warp], quad, tq);
    {
      uint32_t pdf[4][4];  // kept Pᵀ (unscaled) as A fragments, 16 queries each
      bwd_probs<T, kMode>(a, rc, [&](int n, int e) -> float& { return p[n][e]; }, nlse2, kvis, kbits, qb, k0,
                          scale_log2, quad, tq, pdf);
      add_keys_by_d<T, D>(dv, pdf, dos + trans_off);
    }
    {
      float dpt[8][4];
      keys_by_queries<T, D>(dpt, sm.v + a_off, dos + plain_off);
      uint32_t dsf[4][4];  // dSᵀ as A fragments (16 queries each)
      bwd_dscores<T>(a, [&](int n, int e) { return p[n][e]; }, [&](int n, int e) { return dpt[n][e]; }, kbits, delta, tq,
                     dsf);
#pragma unroll
      for (int n = 0; n < 8; ++n) {  // dSᵀ to shared memory for dQ = dS K
        T* w = sm.ds + (warp * 16 + quad) * kDsRow + n * 8 + tq * 2;
        *reinterpret_cast<uint32_t*>(w) = dsf[n / 2][(n & 1) * 2 + 0];
        *reinterpret_cast<uint32_t*>(w + 8 * kDsRow) = dsf[n / 2][(n & 1) * 2 + 1];
      }
      add_keys_by_d<T, D>(dk, dsf, qs + trans_off);
    }
    __syncthreads();
    // dQ[16 queries of this warp, D] += dS[those queries, 64 keys] K[64 keys, D].
    float c[D / 8][4] = {};
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
      uint32_t af[4];
      ldsm_t(af, ds_lane + kc * 16 * kDsRow);
#pragma unroll
      for (int dn = 0; dn < D / 8; dn += 2) {
        uint32_t b[4];
        ldsm_t(b, sm.k + trans_off + kc * 16 * kRow + dn * 8);
        mma<T>(c[dn], af, b[0], b[1]);
        mma<T>(c[dn + 1], af, b[2], b[3]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = qb + warp * 16 + quad + r * 8;
      if (i >= a.sq) continue;
      float* dq_row = dqg + i * out_row + tq * 2;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {  // the scale: the dq kernel
#if __CUDA_ARCH__ >= 900
        // One 8-byte vector atomic per pair: the backward was bound by these reductions
        // (bench/NOTES.md, "Vector atomics"); two scalar ones took 30% longer.
        atomicAdd(reinterpret_cast<float2*>(dq_row + dn * 8), make_float2(c[dn][2 * r], c[dn][2 * r + 1]));
#else
        atomicAdd(dq_row + dn * 8, c[dn][2 * r]);
        atomicAdd(dq_row + dn * 8 + 1, c[dn][2 * r + 1]);
#endif
      }
    }
    // No barrier here: after the one above nothing reads this stage, and the next
    // iteration's writes are safe without one. Its copies go to a stage last read before
    // that barrier; sm.keep[warp] is read and written by its own warp only; sm.ds is
    // rewritten after the next iteration's first barrier, which every warp reaches only
    // when done with its dQ products here.
  }
  cp_async_wait<0>();  // no copy outlives the block (tiles == 0: the K, V copies)

  bwd_store<T, D>(a, [&](int dn, int e) { return dk[dn][e]; }, [&](int dn, int e) { return dv[dn][e]; }, bb, hd.kvh,
                  k0, quad, tq);
}

// ---------------------------------------------------------------------------------------
// Launchers and FFI handlers.

// Whether the forward and backward run the wgmma kernels (attention_sm90.cuh) at D = 64
// and 128: device code for sm_90a was built and the current device has compute capability
// 9.0. JAXSUB_ATTENTION_SM90=0 in the environment keeps the mma.sync kernels (for comparisons).
bool use_sm90() {
#ifdef JAXSUB_SM90A
  const char* off = std::getenv("JAXSUB_ATTENTION_SM90");  // read per call: tests compare both kernels
  return !(off != nullptr && std::string(off) == "0") && device_is_sm90();
#else
  return false;
#endif
}
// use_sm90() for one call's views: the wgmma kernels address a thread's rows of a tile
// with 32-bit byte offsets (load_tile_swz), so every row stride stays below 2^24 elements;
// the backward at D = 64 adds dQ with 16-byte reductions (sm90_bwd_dq4), so its f32
// accumulator, when there is one, starts on 16 bytes (XLA's buffers do; the mma.sync
// kernel takes any other).
bool use_sm90(const AttnArgs& a, int d) {
  constexpr int64_t kMaxStride = int64_t{1} << 24;
  return a.qkv_row < kMaxStride && a.grad_row < kMaxStride && a.h * d < kMaxStride && a.kv_row < kMaxStride &&
         (a.dq_acc == nullptr || aligned16(a.dq_acc)) && use_sm90();
}

// The forward for a's views, pointers and attributes: out [B, Sq, H, D], lse [B, H, Sq].
ffi::Error run_fwd(const char* op, cudaStream_t stream, ffi::DataType t, int d, const AttnArgs& a) {
  if (a.b * a.h * a.sq == 0) return ffi::Error::Success();
  return dispatch_attention(op, t, d, [&](auto tt, auto dd) {
    using T = typename decltype(tt)::type;
    constexpr int D = decltype(dd)::value;
    const auto tiles = static_cast<unsigned>((a.sq + kTile - 1) / kTile);
    const ffi::Error e = by_mask_mode(a, [&](auto mode) {
      constexpr int kMode = decltype(mode)::value;
      if constexpr (D >= 64) {
        if (use_sm90(a, D))
          return launch_tile_kernel<attention_fwd_sm90_kernel<T, D, kMode>>(op, tiles, a.b * a.h,
                                                                             sm90_fwd_smem<D>() + 1024, stream, a);
      }
      return launch_tile_kernel<attention_fwd_kernel<T, D, kMode>>(op, tiles, a.b * a.h, sizeof(FwdSmem<T, D>),
                                                                   stream, a);
    });
    if (e.failure()) return e;
    return launch_status(op);
  });
}

// The launch configuration of the wgmma backward with the key blocks of each (b, h) as one
// thread block cluster (kClusterDq), dependent on the delta kernel before it (pdl.cuh).
struct ClusterLaunch {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attr[2];
  ClusterLaunch(dim3 grid, size_t smem, cudaStream_t stream) {
    config.gridDim = grid, config.blockDim = dim3(kThreads), config.dynamicSmemBytes = smem, config.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = grid.x, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
    config.attrs = attr, config.numAttrs = 2;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // config points at attr
};

// Whether the current GPU can co-schedule such a cluster of Kernel (asked once per device,
// kernel and cluster size; unknown devices past the table are asked every time).
template <auto Kernel>
bool cluster_fits(ClusterLaunch& l) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> ok[kMaxDevices][9];  // per cluster size: 0 unknown, 1 yes, -1 no
  const unsigned size = l.config.gridDim.x;
  int dev = 0;
  if (size > 8 || cudaGetDevice(&dev) != cudaSuccess) return false;
  auto ask = [&] {
    int clusters = 0;
    const bool fits = cudaOccupancyMaxActiveClusters(&clusters, Kernel, &l.config) == cudaSuccess && clusters > 0;
    cudaGetLastError();  // a refused query leaves no sticky error
    return fits;
  };
  if (dev < 0 || dev >= kMaxDevices) return ask();
  if (ok[dev][size].load() == 0) ok[dev][size].store(ask() ? 1 : -1);
  return ok[dev][size].load() > 0;
}

// Whether the backward reduces dq inside clusters (attention_sm90.cuh, kClusterDq): the
// wgmma kernels run, no causal mask (every key block then visits the same query tiles),
// at most two query tiles (Sq <= 128: each keeps its stage) and at most 8 key blocks
// (Sk <= 512; 8 is the portable cluster size), one q head per k/v head. JAXSUB_ATTENTION_
// CLUSTER_DQ=0 keeps the f32 accumulator and atomics (for comparisons).
bool use_cluster_dq(const AttnArgs& a) {
  const char* off = std::getenv("JAXSUB_ATTENTION_CLUSTER_DQ");
  return !(off != nullptr && std::string(off) == "0") && !a.causal && a.group == 1 && a.sq <= 2 * kTile &&
         (a.sk + kTile - 1) / kTile <= 8;
}

// The bias gradient (a.dbias given): dq's column partials into the workspace's q part
// (attention_dq_bias_kernel: from the accumulator, also writing dq (kFromAcc), or from dq
// as the clusters wrote it), then dbias = the workspace's rows summed in order
// (column_sum_kernel, rows.cuh), the tile kernel having written the k and v parts.
template <typename T, bool kFromAcc>
void launch_dq_bias(const AttnArgs& a, int64_t hd, cudaStream_t stream) {
  const int64_t rows = a.b * a.sq, groups = a.b * ((a.sq + 15) / 16), pieces = hd / 4;
  const auto cols = static_cast<unsigned>((pieces + kDqBiasX - 1) / kDqBiasX);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(groups, 65535));
  launch_dependent(attention_dq_bias_kernel<T, kFromAcc>, dim3(blocks, cols), dim3(kDqBiasX, kDqBiasY), 0, stream,
                   a.dq_acc, static_cast<T*>(a.o), a.dbias_ws, rows, groups, hd, a.scale, a.sq, a.grad_row,
                   a.dq_batch);
  // The workspace's rows are [3, H * D]: three groups of H * D columns, one per part.
  void* outs[3] = {a.dbias[0], a.dbias[1], a.dbias[2]};
  launch_column_sum<T>(a.dbias_ws, static_cast<int>(groups), 3, hd, false, outs, stream);
}

// The backward (a.b * a.h and a.sq * a.sk nonzero): delta and the zeroed dq accumulator,
// the tile kernel (dk, dv, dq_acc), then dq from dq_acc into q's view; or, where the
// clusters reduce dq (use_cluster_dq), delta and the tile kernel (dk, dv, dq).
ffi::Error run_bwd(const char* op, cudaStream_t stream, ffi::DataType t, int d, const AttnArgs& a) {
  return dispatch_attention(op, t, d, [&](auto tt, auto dd) {
    using T = typename decltype(tt)::type;
    constexpr int D = decltype(dd)::value;
    const int64_t rows = a.b * a.sq * a.h;
    constexpr int kLanes = D * static_cast<int>(sizeof(T)) / 16;
    const auto tiles = static_cast<unsigned>((a.sk + kTile - 1) / kTile);
    const unsigned delta_blocks = static_cast<unsigned>((rows * kLanes + kThreads - 1) / kThreads);
    if constexpr (D >= 64) {
      if (use_sm90(a, D) && use_cluster_dq(a)) {
        bool launched = false;
        const ffi::Error e = by_mask_mode(a, [&](auto mode) -> ffi::Error {
          constexpr int kMode = decltype(mode)::value;
          constexpr auto kernel = attention_bwd_sm90_kernel<T, D, kMode, true>;
          if (auto e = smem_opt_in<kernel>(op, sm90_bwd_smem<D>() + 1024); e.failure()) return e;
          const auto heads = static_cast<unsigned>(a.b * a.h < kMaxGridY ? a.b * a.h : kMaxGridY);
          ClusterLaunch l(dim3(tiles, heads), sm90_bwd_smem<D>() + 1024, stream);
          if (!cluster_fits<kernel>(l)) return ffi::Error::Success();  // the accumulator path below
          AttnArgs no_acc = a;
          no_acc.dq_acc = nullptr;  // the delta kernel leaves the accumulator alone
          attention_delta_kernel<T, D><<<delta_blocks, kThreads, 0, stream>>>(no_acc);
          launched = true;
          for_head_chunks(a, [&](const AttnArgs& c, unsigned n) {
            l.config.gridDim.y = n;
            launched = launched && cudaLaunchKernelEx(&l.config, kernel, c) == cudaSuccess;
          }, a.b * a.h);
          return ffi::Error::Success();
        });
        if (e.failure()) return e;
        if (launched) {
          if (a.dbias[0] != nullptr) launch_dq_bias<T, false>(a, a.h * D, stream);  // dq's column sums
          return launch_status(op);
        }
        cudaGetLastError();  // a refused launch after a fitting answer: delta again, with the accumulator
      }
    }
    attention_delta_kernel<T, D><<<delta_blocks, kThreads, 0, stream>>>(a);
    const int64_t kv_heads = a.b * (a.h / a.group);  // a block per key block of each k/v head
    const ffi::Error e = by_mask_mode(a, [&](auto mode) {
      constexpr int kMode = decltype(mode)::value;
      if constexpr (D >= 64) {
        if (use_sm90(a, D))
          return launch_tile_kernel<attention_bwd_sm90_kernel<T, D, kMode, false>>(
              op, tiles, kv_heads, sm90_bwd_smem<D>() + 1024, stream, a);
      }
      return launch_tile_kernel<attention_bwd_kernel<T, D, kMode>>(op, tiles, kv_heads, sizeof(BwdSmem<T, D>), stream,
                                                                   a);
    });
    if (e.failure()) return e;
    const int64_t n = rows * D, hd = a.h * D;
    auto* dq = static_cast<T*>(a.o);
    if (a.dbias[0] != nullptr) {
      launch_dq_bias<T, true>(a, hd, stream);
    } else if (a.grad_row == hd && a.dq_batch == a.sq * hd) {
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n / 8 + 255) / 256, 65535));
      launch_dependent(attention_dq_kernel<T>, dim3(blocks), dim3(256), 0, stream, a.dq_acc, dq, n, a.scale);
    } else {  // dq's view: (b, i) rows of H * D elements; 128 threads cover 1024 per pass
      const int64_t dq_rows = a.b * a.sq;
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(dq_rows, 65535));
      launch_dependent(attention_dq_view_kernel<T>, dim3(blocks), dim3(128), 0, stream, a.dq_acc, dq, dq_rows, hd,
                       a.scale, a.sq, a.grad_row, a.dq_batch);
    }
    return launch_status(op);
  });
}

}  // namespace

// For the module (module.cc): whether attention at D = 64 or 128 on the current device
// runs the wgmma kernels now (false without a device).
bool attention_sm90() { return use_sm90(); }

}  // namespace jaxsub

#include "attention_ffi.cuh"
