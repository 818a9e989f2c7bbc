// Scale + mask + softmax + dropout over the last axis (the paper's SM forward and BS
// backward), CUDA. Contract: ABI.md ("Attention family"). Rows are the B*H*Sq rows of the
// logical [B, H, Sq, Sk] probability tensor; the row-tile engine is rows.cuh. The forward
// writes y and the per-row log-sum-exp; the backward recomputes p from the scores and
// the lse and regenerates the dropout mask, so no [B, H, Sq, Sk] residual is stored.
#include <cmath>

#include "common.h"
#include "philox.h"
#include "rows.cuh"

namespace jaxsub {
namespace {

struct SoftmaxArgs {
  const void* dy;        // [B, H, Sq, Sk] T (backward)
  const void* scores;    // [B, H, Sq, Sk] T
  const void* mask;      // [Bm, Hm, Sqm, Skm] pred or f32, each dim 1 or full
  const uint32_t* seed;  // [2] or [4] (philox.h Seed)
  bool seed_offset = false;  // the seed has four words: words 2-3 are the slice's offset
  void* out;             // [B, H, Sq, Sk] T: y (forward) or dscores (backward)
  float* lse;            // [B, H, Sq]: written by the forward, read by the backward
  int64_t b, h, sq, sk;
  int64_t bm, hm, sqm, skm;
  float scale;
  bool causal;
  bool idx32;  // every row index (and B*H) fits in 32 bits: cheaper (b, h, i) division
  int mask_kind;
  uint32_t threshold;
  float keep_scale;
  int ahead = 0;  // iterations ahead that the row loop asks L2 for its rows (rows.cuh); 0: none
};

// The scaled, masked scores of the thread's elements in row r in log2 units,
// log2(e) * (scale * s + mask), -inf where masked: a probability is then one
// special-function exp2 of (score - max). Without mask and causality only the row end
// masks (no index arithmetic per element); otherwise the row's (b, h, i) are computed
// once per row, in 32 bits when the row count allows (`idx32`).
template <typename T, int VEC, int NV>
__device__ __forceinline__ void masked_scores(const SoftmaxArgs& a, int64_t r, bool valid, Tile<VEC, NV>& s) {
  load_tile<T, VEC, NV>(static_cast<const T*>(a.scores) + r * a.sk, a.sk, valid, s);
  const float scale2 = a.scale * kLog2e;
  if (!a.causal && a.mask_kind == kMaskNone) {
    // A vector lies wholly inside or outside the row: on the fast path Sk is a multiple of
    // VEC and columns start at multiples of VEC; on the general path VEC is 1.
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const bool in = valid && tile_col(v, VEC) < a.sk;
#pragma unroll
      for (int e = 0; e < VEC; ++e) s.v[v][e] = in ? s.v[v][e] * scale2 : -INFINITY;
    }
    return;
  }
  int64_t i, hh, bb;
  if (a.idx32) {
    const uint32_t ru = static_cast<uint32_t>(r), sq = static_cast<uint32_t>(a.sq), h = static_cast<uint32_t>(a.h);
    const uint32_t bh = ru / sq;
    i = ru - bh * sq, hh = bh % h, bb = bh / h;
  } else {
    const int64_t bh = r / a.sq;
    i = r % a.sq, hh = bh % a.h, bb = bh / a.h;
  }
  const int64_t mask_row =
      (((a.bm == 1 ? 0 : bb) * a.hm + (a.hm == 1 ? 0 : hh)) * a.sqm + (a.sqm == 1 ? 0 : i)) * a.skm;
  const int64_t last = a.causal ? i + a.sk - a.sq : a.sk - 1;
#pragma unroll
  for (int v = 0; v < NV; ++v)
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int64_t j = tile_col(v, VEC) + e;
      bool visible = valid && j < a.sk && j <= last;
      float x = s.v[v][e] * scale2;
      if (a.mask_kind != kMaskNone && visible) {
        const int64_t m = mask_row + (a.skm == 1 ? 0 : j);
        if (a.mask_kind == kMaskBool) {
          visible = static_cast<const bool*>(a.mask)[m];
        } else {
          x = fmaf(static_cast<const float*>(a.mask)[m], kLog2e, x);
        }
      }
      s.v[v][e] = visible ? x : -INFINITY;
    }
}

// The dropout multipliers (keep_scale * mul, or 0) of the thread's vector v of row r, for
// use right away (no bit packing).
template <int VEC>
__device__ __forceinline__ void row_keep_scales(const SoftmaxArgs& a, const Seed& seed, int64_t r, int v,
                                                float mul, float (&m)[VEC]) {
  const int64_t c = tile_col(v, VEC);  // past the row end: no generator call, never stored
  keep_scales<VEC>(seed, c < a.sk ? a.threshold : 0u, a.keep_scale * mul, static_cast<uint64_t>(r * a.sk + c), m);
}

// Up to 16 elements per thread, the kernels fit in 64 registers without spilling: two
// blocks of 512 threads per multiprocessor (ptxas went to 79 and 95 registers unasked,
// which left the latency-bound backward with a quarter of the warps resident).
constexpr int min_blocks(int vec, int nv) { return vec * nv <= 16 && max_threads_for(vec, nv) == 512 ? 2 : 1; }

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(max_threads_for(VEC, NV), min_blocks(VEC, NV))
    softmax_fwd_kernel(SoftmaxArgs a, int64_t rows) {
  __shared__ float scratch[32 * kMaxBlockRows];
  const Seed seed = load_seed(a.seed, a.seed_offset);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows; base += stride) {
    const int64_t r = base + threadIdx.y;
    const bool valid = r < rows;
    if (a.ahead > 0 && r + a.ahead * stride < rows) prefetch_row_l2<T, VEC>(a.scores, r + a.ahead * stride, a.sk);
    Tile<VEC, NV> s;
    masked_scores<T, VEC, NV>(a, r, valid, s);
    // 16-bit rows of up to 16 elements per thread: the row's Philox calls side by side
    // (tile_words), issued here so that they overlap the two row reductions' shuffles. At 32
    // elements they took ptxas from 92 to 128 registers; those and f32 call per vector.
    constexpr bool kWords = VEC % 8 == 0 && VEC * NV <= 16;
    U32x4 w[kWords ? NV * VEC / 8 : 1];
    if constexpr (kWords) tile_words<VEC, NV>(seed, a.threshold, r, a.sk, w);
    float m = -INFINITY;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) m = max_nan(m, s.v[v][e]);
    m = row_group_reduce<MaxOp>(m, scratch);
    const float nm = m == -INFINITY ? 0.f : -m;  // a fully masked row: every exp2(-inf) is 0
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        s.v[v][e] = fast_exp2(s.v[v][e] + nm);
        sum += s.v[v][e];
      }
    sum = row_group_sum(sum, scratch);
    // A NaN sum (a NaN or +inf score the row sees) gives NaN probabilities and lse, so the
    // backward's are NaN too; a dropped element is 0 whatever the row, as in plain JAX.
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    // The keep decision is the select itself where the words are at hand (a multiply and a
    // select per element); the per-vector multipliers need a compare, since a NaN
    // probability times a dropped element's 0 would be NaN.
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      if constexpr (kWords) {
        const float ks = a.keep_scale * inv;
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          s.v[v][e] = lane_kept(w[(v * VEC + e) / 8], e % 8, a.threshold << 16) ? s.v[v][e] * ks : 0.f;
      } else {
        float keep[VEC];
        row_keep_scales<VEC>(a, seed, r, v, inv, keep);
#pragma unroll
        for (int e = 0; e < VEC; ++e) s.v[v][e] = keep[e] == 0.f ? 0.f : s.v[v][e] * keep[e];
      }
    }
    store_tile<T, VEC, NV>(static_cast<T*>(a.out) + r * a.sk, a.sk, valid, s);
    if (valid && threadIdx.x == 0) a.lse[r] = sum == 0.f ? -INFINITY : (m + __log2f(sum)) * kLn2;
  }
}

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(max_threads_for(VEC, NV), min_blocks(VEC, NV))
    softmax_bwd_kernel(SoftmaxArgs a, int64_t rows) {
  __shared__ float scratch[32 * kMaxBlockRows];
  const Seed seed = load_seed(a.seed, a.seed_offset);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows; base += stride) {
    const int64_t r = base + threadIdx.y;
    const bool valid = r < rows;
    if (a.ahead > 0 && r + a.ahead * stride < rows) {
      prefetch_row_l2<T, VEC>(a.scores, r + a.ahead * stride, a.sk);
      prefetch_row_l2<T, VEC>(a.dy, r + a.ahead * stride, a.sk);
    }
    Tile<VEC, NV> p, g;
    masked_scores<T, VEC, NV>(a, r, valid, p);
    load_tile<T, VEC, NV>(static_cast<const T*>(a.dy) + r * a.sk, a.sk, valid, g);
    const float lse = valid ? a.lse[r] : -INFINITY;
    // p = exp2(score - lse, both in log2 units): 0 for masked scores and for an empty row.
    const float nlse2 = lse == -INFINITY ? -INFINITY : -lse * kLog2e;
    const uint32_t keep = keep_bits<VEC, NV>(seed, a.threshold, r, a.sk);
    float c = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        p.v[v][e] = fast_exp2(p.v[v][e] + nlse2);
        g.v[v][e] = bit(keep, v * VEC + e) ? g.v[v][e] * a.keep_scale : 0.f;
        c += g.v[v][e] * p.v[v][e];
      }
    c = row_group_sum(c, scratch);
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) g.v[v][e] = a.scale * p.v[v][e] * (g.v[v][e] - c);
    store_tile<T, VEC, NV>(static_cast<T*>(a.out) + r * a.sk, a.sk, valid, g);
  }
}

ffi::Error check_shapes(const char* op, const ffi::AnyBuffer& scores, const ffi::AnyBuffer& mask, int32_t mask_kind,
                        SoftmaxArgs& a) {
  auto d = scores.dimensions();
  if (d.size() != 4) return invalid(op, "scores must be [B, H, Sq, Sk]");
  a.b = d[0], a.h = d[1], a.sq = d[2], a.sk = d[3];
  const int64_t full[4] = {a.b, a.h, a.sq, a.sk};
  int64_t dims[4];
  if (auto e = check_mask(op, mask, mask_kind, full, dims); e.failure()) return e;
  a.bm = dims[0], a.hm = dims[1], a.sqm = dims[2], a.skm = dims[3];
  a.mask_kind = mask_kind;
  return ffi::Error::Success();
}

template <bool kBackward>
ffi::Error launch_softmax(cudaStream_t stream, const char* op, ffi::DataType t, const SoftmaxArgs& a) {
  const int64_t rows = a.b * a.h * a.sq;
  if (rows == 0 || a.sk == 0) return ffi::Error::Success();
  SoftmaxArgs args = a;
  args.idx32 = rows + 2 * kMaxBlockRows < (int64_t{1} << 31);  // covers the r >= rows of a last partial block
  return dispatch_float<DeviceTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const bool aligned = aligned16(a.scores) && aligned16(a.out) && (!kBackward || aligned16(a.dy));
    // Up to 32 elements per thread: a 16-bit row of 512 is one warp with 2 vectors per
    // thread, of 1024 one warp with 4 (shuffle-only reductions).
    const RowConfig c = choose_rows(a.sk, sizeof(T), aligned, 32, 256);
    if (!c.ok) return invalid(op, "row too long for the kernel");
    const dim3 block(c.tx, c.ty);
    ffi::Error status = invalid(op, "no kernel for this row length");
    // The resident blocks walk the rows, each row group asking L2 for the rows it reads on
    // its next iteration (rows.cuh); with JAXSUB_L2_PREFETCH=0 a block per row group.
    args.ahead = std::max(0, l2_ahead());
    dispatch_tile<16 / sizeof(T)>(c, [&](auto vec, auto nv) {
      constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
      auto kernel = kBackward ? softmax_bwd_kernel<T, VEC, NV> : softmax_fwd_kernel<T, VEC, NV>;
      const int blocks = args.ahead ? partial_blocks(kernel, rows, c, 0, rows) : row_blocks(rows, c);
      if constexpr (kBackward) {
        softmax_bwd_kernel<T, VEC, NV><<<blocks, block, 0, stream>>>(args, rows);
        status = launch_check(op, "softmax_bwd_kernel", c, blocks, 0);
      } else {
        softmax_fwd_kernel<T, VEC, NV><<<blocks, block, 0, stream>>>(args, rows);
        status = launch_check(op, "softmax_fwd_kernel", c, blocks, 0);
      }
    });
    return status;
  });
}

// scores: [B, H, Sq, Sk]; mask: [Bm, Hm, Sqm, Skm]; seed: [2] -> y: [B, H, Sq, Sk]; lse: [B, H, Sq].
ffi::Error SoftmaxDropoutFwd(cudaStream_t stream, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                             float keep_scale, ffi::AnyBuffer scores, ffi::AnyBuffer mask, ffi::Buffer<ffi::U32> seed,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> lse) {
  const char* op = "softmax_dropout_fwd";
  SoftmaxArgs a{};
  if (auto e = check_shapes(op, scores, mask, mask_kind, a); e.failure()) return e;
  a.scores = scores.untyped_data(), a.mask = mask.untyped_data(), a.seed = seed.typed_data();
  a.seed_offset = seed.element_count() == 4;
  a.out = y->untyped_data(), a.lse = data<float>(lse);
  a.scale = scale, a.causal = causal, a.threshold = threshold, a.keep_scale = keep_scale;
  return launch_softmax<false>(stream, op, scores.element_type(), a);
}

// dy, scores: [B, H, Sq, Sk]; lse: [B, H, Sq]; mask; seed: [2] -> dscores: [B, H, Sq, Sk].
ffi::Error SoftmaxDropoutBwd(cudaStream_t stream, float scale, bool causal, int32_t mask_kind, uint32_t threshold,
                             float keep_scale, ffi::AnyBuffer dy, ffi::AnyBuffer scores, ffi::AnyBuffer lse,
                             ffi::AnyBuffer mask, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> dscores) {
  const char* op = "softmax_dropout_bwd";
  SoftmaxArgs a{};
  if (auto e = check_shapes(op, scores, mask, mask_kind, a); e.failure()) return e;
  if (dy.element_count() != scores.element_count()) return invalid(op, "dy and scores shapes differ");
  a.dy = dy.untyped_data(), a.scores = scores.untyped_data(), a.mask = mask.untyped_data();
  a.seed_offset = seed.element_count() == 4;
  a.seed = seed.typed_data(), a.out = dscores->untyped_data(), a.lse = data<float>(lse);
  a.scale = scale, a.causal = causal, a.threshold = threshold, a.keep_scale = keep_scale;
  return launch_softmax<true>(stream, op, scores.element_type(), a);
}

}  // namespace
}  // namespace jaxsub

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_softmax_dropout_fwd, jaxsub::SoftmaxDropoutFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("mask_kind")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_softmax_dropout_bwd, jaxsub::SoftmaxDropoutBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("mask_kind")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
