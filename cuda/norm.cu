// Layer norm and bias + dropout + residual + layer norm (the paper's BDRLN forward and its
// BLNRD/BSB backward), CUDA. Contract: ABI.md. Launch shapes and the column partial sums:
// rows.cuh.
//
// One kernel template serves both ops (kResidual selects BDRLN): a row is read once into
// registers, statistics are two-pass on those registers, and the backward recomputes the
// BDRLN input h = residual + dropout(x + bias) instead of storing it, so the forward
// writes only y and the per-row (mean, rstd), and h itself only where the caller keeps it
// (a pre-LN layer's residual stream). Both backwards take an optional cotangent of h (of x
// for layer norm), added to the gradient they compute for it.
#include "common.h"
#include "philox.h"
#include "rows.cuh"

namespace jaxsub {
namespace {

struct NormPtrs {
  const void* dy;        // [R, N] T (backward)
  const void* x;         // [R, N] T
  const void* bias;      // [N] P: BDRLN bias added to x before dropout
  const void* residual;  // [R, N] T (BDRLN)
  const void* scale;     // [N] P
  const void* ln_bias;   // [N] P (forward)
  const uint32_t* seed;  // [2] or [4] (BDRLN; philox.h Seed)
  void* y;               // [R, N] T: forward output / backward dx
  void* dresidual;       // [R, N] T (BDRLN backward)
  float* mean;           // [R]
  float* rstd;           // [R]
  float* workspace;      // [C, K, N] f32 (backward)
  const void* dy2 = nullptr;  // [R, N] T or null (BDRLN backward): a second cotangent of y, added to dy
  void* h = nullptr;          // [R, N] T or null (BDRLN forward): h, the layer norm's input, written too
  const void* dh = nullptr;   // [R, N] T or null (backward): a cotangent of h itself (layer norm: of x),
                              // added to the layer norm's gradient of h
  bool seed_offset = false;   // the seed has four words: words 2-3 are the slice's offset
};

// BDRLN: h = residual + dropout(x + bias) for row r, in place of the x tile (layer norm:
// h = x, nothing to do). The bias is `bias` where the caller holds it (the backward at up
// to 8 elements per thread), else re-read per row (a few KB, L1/L2-resident): holding it
// for the whole kernel would cost occupancy at 16-32 elements per thread.
template <typename T, int VEC, int NV, bool kResidual>
__device__ __forceinline__ void add_residual(const NormPtrs& p, bool pf32, int64_t r, int64_t n, uint32_t threshold,
                                             float keep_scale, const Seed& seed,
                                             const Tile<VEC, NV>& res, Tile<VEC, NV>& h, uint32_t& keep,
                                             const Tile<VEC, NV>* bias = nullptr) {
  keep = 0xffffffffu;
  if constexpr (kResidual) {
    Tile<VEC, NV> xb;
    if (bias != nullptr) {
      xb = *bias;
    } else {
      load_param<T, VEC, NV>(p.bias, pf32, n, xb);
    }
    keep = keep_bits<VEC, NV>(seed, threshold, r, n);
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        h.v[v][e] = res.v[v][e] + (bit(keep, v * VEC + e) ? (h.v[v][e] + xb.v[v][e]) * keep_scale : 0.f);
  }
}

// h for row r. BDRLN loads x and the residual as T (half the registers of f32 tiles) and
// the bias one vector at a time: 106 registers at 32 elements per thread, was 125 (capped
// at 64 it spilled and ran twice as long: bench/NOTES.md v4).
template <typename T, int VEC, int NV, bool kResidual>
__device__ __forceinline__ void load_h(const NormPtrs& p, bool pf32, int64_t r, int64_t n, bool valid,
                                       uint32_t threshold, float keep_scale, const Seed& seed,
                                       Tile<VEC, NV>& h, uint32_t& keep) {
  keep = 0xffffffffu;
  if constexpr (kResidual) {
    RawTile<T, VEC, NV> x, res;
    load_raw<T, VEC, NV>(static_cast<const T*>(p.x) + r * n, n, valid, x);
    load_raw<T, VEC, NV>(static_cast<const T*>(p.residual) + r * n, n, valid, res);
    keep = keep_bits<VEC, NV>(seed, threshold, r, n);
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int64_t c = tile_col(v, VEC);
      float b[VEC];
      if (c < n && pf32) {
        load_elems<float, VEC>(static_cast<const float*>(p.bias) + c, b);
      } else if (c < n) {
        load_elems<T, VEC>(static_cast<const T*>(p.bias) + c, b);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) b[e] = 0.f;
      }
      float xf[VEC], rf[VEC];
      raw_floats<T, VEC>(x.v[v], xf);
      raw_floats<T, VEC>(res.v[v], rf);
#pragma unroll
      for (int e = 0; e < VEC; ++e) h.v[v][e] = rf[e] + (bit(keep, v * VEC + e) ? (xf[e] + b[e]) * keep_scale : 0.f);
    }
  } else {
    load_tile<T, VEC, NV>(static_cast<const T*>(p.x) + r * n, n, valid, h);
  }
}

// One row's backward inputs as loaded (BDRLN: the next row's, loaded while this one is worked on).
// kDh: the call passed a cotangent of h (p.dh); a template parameter, so that the kernels
// without one keep their registers (the raw tile would stay live across the prefetch).
template <typename T, int VEC, int NV, bool kResidual, bool kDh>
struct BwdRow {
  RawTile<T, VEC, NV> x, dy, dy2, res, dh;
  float mean = 0.f, rstd = 0.f;

  __device__ __forceinline__ void load(const NormPtrs& p, int64_t r, int64_t rows, int64_t n) {
    const bool valid = r < rows;
    load_raw<T, VEC, NV>(static_cast<const T*>(p.x) + r * n, n, valid, x);
    load_raw<T, VEC, NV>(static_cast<const T*>(p.dy) + r * n, n, valid, dy);
    if constexpr (kResidual) {
      load_raw<T, VEC, NV>(static_cast<const T*>(p.residual) + r * n, n, valid, res);
      if (p.dy2 != nullptr) load_raw<T, VEC, NV>(static_cast<const T*>(p.dy2) + r * n, n, valid, dy2);
    }
    if constexpr (kDh) load_raw<T, VEC, NV>(static_cast<const T*>(p.dh) + r * n, n, valid, dh);
    mean = valid ? p.mean[r] : 0.f, rstd = valid ? p.rstd[r] : 0.f;
  }

  // h's own cotangent (p.dh), or zeros without one.
  __device__ __forceinline__ void extra(Tile<VEC, NV>& t) const {
    if constexpr (kDh) {
      unpack(dh, t);
      return;
    }
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) t.v[v][e] = 0.f;
  }

  // The row's cotangent: dy, plus dy2 where the caller passed one.
  __device__ __forceinline__ void cotangent(const NormPtrs& p, Tile<VEC, NV>& d) const {
    unpack(dy, d);
    if constexpr (kResidual) {
      if (p.dy2 == nullptr) return;
      Tile<VEC, NV> d2;
      unpack(dy2, d2);
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) d.v[v][e] += d2.v[v][e];
    }
  }
};

// The forwards at their default elements per thread (layer norm 32, BDRLN 16) are capped
// at 64 registers (two 512-thread blocks per SM): layer norm keeps 32 rows of 1024
// resident per SM, so [4096, 1024] runs in one wave; BDRLN at 16 elements (59 registers
// instead of 90) ran 13.3 us against 14.9 at 32 elements uncapped ([4096, 1024] bf16,
// tools/sweep_rows.py). Capping the backward the same way spilled and ran 1.5x slower.
constexpr int norm_fwd_min_blocks(int vec, int nv, bool residual) {
  return vec * nv == (residual ? 16 : 32) && max_threads_for(vec, nv) == 512 ? 2 : 1;
}

template <typename T, int VEC, int NV, bool kResidual>
__global__ void __launch_bounds__(max_threads_for(VEC, NV), norm_fwd_min_blocks(VEC, NV, kResidual))
    norm_fwd_kernel(NormPtrs p, bool pf32, int64_t rows, int64_t n, float eps, uint32_t threshold, float keep_scale) {
  wait_for_previous_grid();  // launched dependent on the kernel before it (pdl.cuh)
  __shared__ float scratch[32 * kMaxBlockRows];
  Seed seed;
  if constexpr (kResidual) seed = load_seed(p.seed, p.seed_offset);
  const float inv_n = 1.f / static_cast<float>(n);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows;
       base += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t r = base + threadIdx.y;
    const bool valid = r < rows;
    Tile<VEC, NV> h;
    uint32_t keep;
    load_h<T, VEC, NV, kResidual>(p, pf32, r, n, valid, threshold, keep_scale, seed, h, keep);
    if constexpr (kResidual) {
      if (p.h != nullptr) store_tile<T, VEC, NV>(static_cast<T*>(p.h) + r * n, n, valid, h);
    }
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += h.v[v][e];
    const float mean = row_group_sum(s, scratch) * inv_n;
    float q = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const bool in = tile_col(v, VEC) < n;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float d = h.v[v][e] - mean;
        q += in ? d * d : 0.f;
      }
    }
    const float rstd = rsqrtf(row_group_sum(q, scratch) * inv_n + eps);
    // One vector at a time: its scale and bias are loaded just before use (the store to y
    // in between keeps the compiler from hoisting all of them), so only one vector of
    // parameters is live beside h.
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int64_t c = tile_col(v, VEC);
      if (!valid || c >= n) continue;
      float g[VEC], b[VEC], out[VEC];
      if (pf32) {
        load_elems<float, VEC>(static_cast<const float*>(p.scale) + c, g);
        load_elems<float, VEC>(static_cast<const float*>(p.ln_bias) + c, b);
      } else {
        load_elems<T, VEC>(static_cast<const T*>(p.scale) + c, g);
        load_elems<T, VEC>(static_cast<const T*>(p.ln_bias) + c, b);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) out[e] = (h.v[v][e] - mean) * rstd * g[e] + b[e];
      store_elems<T, VEC>(static_cast<T*>(p.y) + r * n + c, out);
    }
    if (valid && threadIdx.x == 0) p.mean[r] = mean, p.rstd[r] = rstd;
  }
}

// Partials per block: layer norm (dscale, dbias); BDRLN (dbias, dscale, dln_bias). Each
// row group walks rows r, r + stride, ... BDRLN issues the next row's x, dy and residual
// loads before the current row's Philox calls and reduction, so they overlap (kernel time
// 25.0 -> 22.0 us at [4096, 1024] bf16, ncu). Layer norm loads each row when it gets to
// it: with the prefetch it needed more than 64 registers (two 512-thread blocks per SM)
// and ran slower (16.3 -> 17.8-18.3 us in two ncu runs); with the rows held as raw words
// it fit 64 registers at bf16 <8,1> with no spill and still ran 6-7% slower (H100,
// bench/NOTES.md, seventieth session).
template <typename T, int VEC, int NV, bool kResidual, bool kDh>
__global__ void __launch_bounds__(max_threads_for(VEC, NV))
    norm_bwd_kernel(NormPtrs p, bool pf32, int64_t rows, int64_t n, uint32_t threshold, float keep_scale) {
  wait_for_previous_grid();  // launched dependent on the kernel before it (pdl.cuh)
  dependents_may_launch();  // the column sum after this kernel
  constexpr int K = kResidual ? 3 : 2;
  extern __shared__ float smem[];
  __shared__ float scratch[64 * kMaxBlockRows];
  Seed seed;
  if constexpr (kResidual) seed = load_seed(p.seed, p.seed_offset);
  Tile<VEC, NV> acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[k].v[v][e] = 0.f;
  const float inv_n = 1.f / static_cast<float>(n);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  constexpr bool kPrefetch = kResidual;
  // BDRLN at up to 8 elements per thread (the default) holds the bias and the scale for
  // every row it visits: one 512-thread block per SM either way, where reloading them per
  // row cost two dependent loads and their conversions in each row's chain.
  constexpr bool kHoldParams = kResidual && VEC * NV <= 8;
  Tile<VEC, NV> held_bias, held_scale;
  if constexpr (kHoldParams) {
    load_param<T, VEC, NV>(p.bias, pf32, n, held_bias);
    load_param<T, VEC, NV>(p.scale, pf32, n, held_scale);
  }
  BwdRow<T, VEC, NV, kResidual, kDh> row;
  if constexpr (kPrefetch) row.load(p, static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y, rows, n);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows; base += stride) {
    const int64_t r = base + threadIdx.y;
    const bool valid = r < rows;
    if constexpr (!kPrefetch) row.load(p, r, rows, n);
    Tile<VEC, NV> h, d, g, res, dh_in;
    unpack(row.x, h);
    row.cotangent(p, d);
    row.extra(dh_in);
    if constexpr (kResidual) unpack(row.res, res);
    const float mean = row.mean, rstd = row.rstd;
    if constexpr (kPrefetch) row.load(p, r + stride, rows, n);
    uint32_t keep;
    add_residual<T, VEC, NV, kResidual>(p, pf32, r, n, threshold, keep_scale, seed, res, h, keep,
                                        kHoldParams ? &held_bias : nullptr);
    if constexpr (kHoldParams) {
      g = held_scale;
    } else {
      load_param<T, VEC, NV>(p.scale, pf32, n, g);
    }
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        h.v[v][e] = (h.v[v][e] - mean) * rstd;  // now xhat
        const float gg = d.v[v][e] * g.v[v][e];
        s1 += gg;
        s2 += gg * h.v[v][e];
      }
    row_group_sum2(s1, s2, scratch);
    s1 *= inv_n, s2 *= inv_n;
    Tile<VEC, NV> out;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float xhat = h.v[v][e], dyv = d.v[v][e];
        const float dh = rstd * (dyv * g.v[v][e] - s1 - xhat * s2) + dh_in.v[v][e];
        acc[K - 2].v[v][e] += dyv * xhat;
        acc[K - 1].v[v][e] += dyv;
        if constexpr (kResidual) {
          d.v[v][e] = dh;
          out.v[v][e] = bit(keep, v * VEC + e) ? dh * keep_scale : 0.f;
          acc[0].v[v][e] += out.v[v][e];
        } else {
          out.v[v][e] = dh;
        }
      }
    store_tile<T, VEC, NV>(static_cast<T*>(p.y) + r * n, n, valid, out);
    if constexpr (kResidual) store_tile<T, VEC, NV>(static_cast<T*>(p.dresidual) + r * n, n, valid, d);
  }
  write_partials<K, VEC, NV>(acc, smem, p.workspace, n);
}

template <bool kResidual>
struct NormArgs {
  const char* op;
  ffi::DataType t, prm;
  int64_t rows, cols;
  NormPtrs p;
  float eps = 0.f;
  uint32_t threshold = 0;
  float keep_scale = 1.f;
  int64_t workspace_rows = 0;  // backward only
  KernelConfig kernel;         // 0s: the defaults in launch_norm
  void* grads[3] = {nullptr, nullptr, nullptr};  // backward: column-sum outputs, in partial order
};

bool all_aligned(std::initializer_list<const void*> ptrs) {
  for (const void* q : ptrs)
    if (q != nullptr && !aligned16(q)) return false;
  return true;
}

template <bool kResidual, bool kBackward>
ffi::Error launch_norm(cudaStream_t stream, const NormArgs<kResidual>& a) {
  if (auto e = check_kernel_config(a.op, a.kernel); e.failure()) return e;
  if (a.rows == 0 || a.cols == 0) return ffi::Error::Success();
  const NormPtrs& p = a.p;
  if (a.prm != a.t && a.prm != ffi::DataType::F32)
    return invalid(a.op, "parameters must have the activation dtype or float32");
  const bool pf32 = a.prm == ffi::DataType::F32;
  return dispatch_float<DeviceTypes>(a.t, a.op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const bool aligned =
        all_aligned({p.dy, p.dy2, p.dh, p.x, p.bias, p.residual, p.scale, p.ln_bias, p.y, p.dresidual, p.h});
    // Defaults. Forward: layer norm up to 32 elements per thread (a 16-bit row of 1024 is
    // one warp, 4 vectors per thread), BDRLN 16 (see norm_fwd_min_blocks). Backward: 8
    // (16-bit) / 16 (f32) as before; four or five [NV][VEC] f32 tiles (column partials,
    // xhat, dy) stay live, and at 16 16-bit elements ptxas needed 120-128 registers (no
    // more rows in flight per SM than at 8 elements and 64).
    const int max_elems = a.kernel.elems_or(kBackward ? (sizeof(T) == 4 ? 16 : 8) : (kResidual ? 16 : 32));
    const RowConfig c = choose_rows(a.cols, sizeof(T), aligned, max_elems, a.kernel.threads_or(kBackward ? 512 : 256));
    if (!c.ok) return invalid(a.op, "row too long for the kernel");
    const dim3 block(c.tx, c.ty);
    ffi::Error status = invalid(a.op, "no kernel for this row length");
    dispatch_tile<16 / sizeof(T)>(c, [&](auto vec, auto nv) {
      constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
      if constexpr (kBackward) {
        const size_t smem = c.ty > 1 ? sizeof(float) * c.tx * c.ty * VEC * NV : 0;
        auto kernel = p.dh != nullptr ? norm_bwd_kernel<T, VEC, NV, kResidual, true>
                                      : norm_bwd_kernel<T, VEC, NV, kResidual, false>;
        const int blocks = partial_blocks(kernel, a.rows, c, smem, a.workspace_rows);
        launch_dependent(kernel, dim3(blocks), block, smem, stream, p, pf32, a.rows, a.cols, a.threshold,
                         a.keep_scale);
        status = launch_check(a.op, "norm_bwd_kernel", c, blocks, smem);
        if (status.failure()) return;
        launch_column_sum<T>(p.workspace, blocks, kResidual ? 3 : 2, a.cols, pf32, a.grads, stream);
        status = launch_check(a.op, "column_sum_kernel", c, blocks, 0);
      } else {
        const int blocks = row_blocks(a.rows, c);
        launch_dependent(norm_fwd_kernel<T, VEC, NV, kResidual>, dim3(blocks), block, 0, stream, p, pf32, a.rows,
                         a.cols, a.eps, a.threshold, a.keep_scale);
        status = launch_check(a.op, "norm_fwd_kernel", c, blocks, 0);
      }
    });
    return status;
  });
}

ffi::Error check_rows(const char* op, const Rows& rc, std::initializer_list<const ffi::AnyBuffer*> same,
                      std::initializer_list<const ffi::AnyBuffer*> per_col) {
  for (auto* b : same)
    if (static_cast<int64_t>(b->element_count()) != rc.rows * rc.cols) return invalid(op, "tensor shapes differ");
  for (auto* b : per_col)
    if (static_cast<int64_t>(b->element_count()) != rc.cols) return invalid(op, "parameter length != last dim");
  return ffi::Error::Success();
}

// An optional [R, N] operand or result: empty ([0], none), or x's dtype and R * N elements.
ffi::Error check_optional_rows(const char* op, const char* what, const Rows& rc, ffi::DataType t,
                               const ffi::AnyBuffer& b) {
  if (b.element_count() == 0 ||
      (static_cast<int64_t>(b.element_count()) == rc.rows * rc.cols && b.element_type() == t))
    return ffi::Error::Success();
  return invalid(op, std::string(what) + " must be empty or have the dtype and shape of x");
}

// Its data, or null where it is empty.
void* optional_data(const ffi::AnyBuffer& b) { return b.element_count() ? b.untyped_data() : nullptr; }

// x: [R, N]; scale, bias: [N] -> y: [R, N], mean, rstd: [R].
ffi::Error LayerNormFwd(cudaStream_t stream, float eps, int32_t block_threads, int32_t max_elems, ffi::AnyBuffer x,
                        ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd) {
  const char* op = "layer_norm_fwd";
  const Rows rc = as_rows(x);
  if (auto e = check_rows(op, rc, {}, {&scale, &bias}); e.failure()) return e;
  NormArgs<false> a{op, x.element_type(), scale.element_type(), rc.rows, rc.cols};
  a.p = NormPtrs{nullptr, x.untyped_data(), nullptr, nullptr, scale.untyped_data(), bias.untyped_data(),
                 nullptr, y->untyped_data(), nullptr, data<float>(mean), data<float>(rstd), nullptr};
  a.eps = eps, a.kernel = {block_threads, max_elems};
  return launch_norm<false, false>(stream, a);
}

// dy: [R, N]; dh: [R, N] or [0] (a cotangent of x itself, added to dx); x: [R, N]; scale: [N];
// mean, rstd: [R] -> dx: [R, N]; dscale, dbias: [N]; workspace: [C, 2, N].
ffi::Error LayerNormBwd(cudaStream_t stream, int32_t block_threads, int32_t max_elems, ffi::AnyBuffer dy,
                        ffi::AnyBuffer dh, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer mean,
                        ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscale,
                        ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace) {
  const char* op = "layer_norm_bwd";
  const Rows rc = as_rows(x);
  if (auto e = check_rows(op, rc, {&dy}, {&scale}); e.failure()) return e;
  NormArgs<false> a{op, x.element_type(), scale.element_type(), rc.rows, rc.cols};
  a.p = NormPtrs{dy.untyped_data(), x.untyped_data(), nullptr, nullptr, scale.untyped_data(), nullptr, nullptr,
                 dx->untyped_data(), nullptr, data<float>(mean), data<float>(rstd), data<float>(workspace)};
  if (auto e = check_optional_rows(op, "dh", rc, x.element_type(), dh); e.failure()) return e;
  a.p.dh = optional_data(dh);
  a.workspace_rows = workspace->dimensions().size() ? workspace->dimensions()[0] : 0;
  a.grads[0] = dscale->untyped_data(), a.grads[1] = dbias->untyped_data();
  a.kernel = {block_threads, max_elems};
  return launch_norm<false, true>(stream, a);
}

// x, residual: [R, N]; bias, scale, ln_bias: [N]; seed: [2] -> y: [R, N]; mean, rstd: [R];
// h: [R, N] (h = residual + dropout(x + bias) written too) or [0] (not written).
ffi::Error BdrlnFwd(cudaStream_t stream, float eps, uint32_t threshold, float keep_scale, int32_t block_threads,
                    int32_t max_elems, ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::AnyBuffer residual,
                    ffi::AnyBuffer scale, ffi::AnyBuffer ln_bias, ffi::Buffer<ffi::U32> seed,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                    ffi::Result<ffi::AnyBuffer> h) {
  const char* op = "bdrln_fwd";
  const Rows rc = as_rows(x);
  if (auto e = check_rows(op, rc, {&residual}, {&bias, &scale, &ln_bias}); e.failure()) return e;
  if (residual.element_type() != x.element_type() || bias.element_type() != scale.element_type() ||
      ln_bias.element_type() != scale.element_type())
    return invalid(op, "dtype mismatch");
  NormArgs<true> a{op, x.element_type(), scale.element_type(), rc.rows, rc.cols};
  a.p = NormPtrs{nullptr, x.untyped_data(), bias.untyped_data(), residual.untyped_data(), scale.untyped_data(),
                 ln_bias.untyped_data(), seed.typed_data(), y->untyped_data(), nullptr, data<float>(mean),
                 data<float>(rstd), nullptr};
  if (auto e = check_optional_rows(op, "h", rc, x.element_type(), *h); e.failure()) return e;
  a.p.h = optional_data(*h);
  a.p.seed_offset = seed.element_count() == 4;
  a.eps = eps, a.threshold = threshold, a.keep_scale = keep_scale, a.kernel = {block_threads, max_elems};
  return launch_norm<true, false>(stream, a);
}

// dy, x, residual: [R, N]; dy2: [R, N] or [0] (none); dh: [R, N] (a cotangent of h itself) or [0];
// bias, scale: [N]; mean, rstd: [R]; seed: [2]
//   -> dx: [R, N]; dbias: [N]; dresidual: [R, N]; dscale, dln_bias: [N]; workspace: [C, 3, N].
ffi::Error BdrlnBwd(cudaStream_t stream, uint32_t threshold, float keep_scale, int32_t block_threads,
                    int32_t max_elems, ffi::AnyBuffer dy, ffi::AnyBuffer dy2, ffi::AnyBuffer dh, ffi::AnyBuffer x,
                    ffi::AnyBuffer bias, ffi::AnyBuffer residual, ffi::AnyBuffer scale, ffi::AnyBuffer mean,
                    ffi::AnyBuffer rstd, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> dx,
                    ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dresidual,
                    ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dln_bias,
                    ffi::Result<ffi::AnyBuffer> workspace) {
  const char* op = "bdrln_bwd";
  const Rows rc = as_rows(x);
  if (auto e = check_rows(op, rc, {&dy, &residual}, {&bias, &scale}); e.failure()) return e;
  if (bias.element_type() != scale.element_type()) return invalid(op, "dtype mismatch");
  if (auto e = check_optional_rows(op, "dy2", rc, x.element_type(), dy2); e.failure()) return e;
  if (auto e = check_optional_rows(op, "dh", rc, x.element_type(), dh); e.failure()) return e;
  NormArgs<true> a{op, x.element_type(), scale.element_type(), rc.rows, rc.cols};
  a.p = NormPtrs{dy.untyped_data(), x.untyped_data(), bias.untyped_data(), residual.untyped_data(),
                 scale.untyped_data(), nullptr, seed.typed_data(), dx->untyped_data(), dresidual->untyped_data(),
                 data<float>(mean), data<float>(rstd), data<float>(workspace),
                 optional_data(dy2)};
  a.p.dh = optional_data(dh);
  a.p.seed_offset = seed.element_count() == 4;
  a.threshold = threshold, a.keep_scale = keep_scale, a.kernel = {block_threads, max_elems};
  a.workspace_rows = workspace->dimensions().size() ? workspace->dimensions()[0] : 0;
  a.grads[0] = dbias->untyped_data(), a.grads[1] = dscale->untyped_data(), a.grads[2] = dln_bias->untyped_data();
  return launch_norm<true, true>(stream, a);
}

}  // namespace
}  // namespace jaxsub

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;
constexpr auto kCmdBuffer = ffi::Traits::kCmdBufferCompatible;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_layer_norm_fwd, jaxsub::LayerNormFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_layer_norm_bwd, jaxsub::LayerNormBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_bdrln_fwd, jaxsub::BdrlnFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Attr<float>("eps")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_bdrln_bwd, jaxsub::BdrlnBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {kCmdBuffer});
