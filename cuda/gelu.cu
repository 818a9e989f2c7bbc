// Bias + GELU + dropout (the paper's BRD forward and BDRB backward), CUDA, and the same
// kernel without the GELU for the pre-LN residual, residual + dropout(x + bias), whose
// backward is dropout(dy) and its column sums. Contract: ABI.md; launch shapes and the
// fused bias-gradient reduction: rows.cuh. The backward recomputes v = x + bias and
// regenerates the mask, so the forward writes only y.
#include "common.h"
#include "gelu_math.h"
#include "philox.h"
#include "rows.cuh"

namespace jaxsub {
namespace {

struct GeluPtrs {
  const void* dy;        // [R, N] T (backward)
  const void* x;         // [R, N] T
  const void* bias;      // [N] P
  const uint32_t* seed;  // [2] or [4] (philox.h Seed)
  void* out;             // [R, N] T: y (forward) or dx (backward)
  float* workspace;      // [C, 1, N] f32 (backward)
  void* y = nullptr;     // [R, N] T or null (backward): the forward's y, recomputed
  const void* residual = nullptr;  // [R, N] T (identity forward): added after the dropout
  bool seed_offset = false;        // the seed has four words: words 2-3 are the slice's offset
};

// kStoreY (backward): also write the forward's y to p.y, for callers that keep x rather
// than y (a scanned stack need not store y then). kIdentity: no GELU; the forward writes
// residual + dropout(x + bias), the backward dropout(dy) and its column sums, reading
// neither x nor the bias.
// kAhead (the GELU forward): each row group loads its next row into registers, still in T,
// before it works on the current one (rows.cuh's RawTile), so that the loads of the next
// row are in flight while the group computes. It replaces the L2 prefetch, which on top of
// it (two rows ahead) measured slower than none. Its registers are held to 64 (two blocks
// of 512 threads, four of 256, per SM): unbounded, ptxas took 96 for 16 elements per thread,
// which left half the warps resident. [4096, 4096] bf16 on an H100: 29.7 -> 27.6 us,
// [12288, 4096] 80.9 -> 75.2 (bench/NOTES.md, sixty-ninth session).
// kTwo (the backward where a thread's part of a row is one 16-byte vector, 16-bit types'
// default): the same bound of 64 registers, two 512-thread blocks per SM where ptxas took
// 80 (107 writing y) unbounded, one block; no spill either way. [4096, 4096] bf16 on an
// H100, the kernel and its column sum without PDL: 46.5 -> 40.4 us, [12288, 4096] 126.4 ->
// 108.4 (bench/NOTES.md, sixty-ninth session).
template <typename T, int VEC, int NV, bool kBackward, bool kStoreY = false, bool kIdentity = false,
          bool kAhead = false, bool kTwo = false>
__global__ void __launch_bounds__(max_threads_for(VEC, NV), kAhead || kTwo ? 2 : 1)
    gelu_kernel(GeluPtrs p, bool pf32, int64_t rows, int64_t n, bool approximate, uint32_t threshold,
                float keep_scale, int ahead) {
  wait_for_previous_grid();  // launched dependent on the kernel before it (pdl.cuh)
  dependents_may_launch();  // the column sum after this kernel
  constexpr bool kMaskOnly = kBackward && kIdentity;  // dx = dropout(dy)
  extern __shared__ float smem[];
  Tile<VEC, NV> acc[1];
#pragma unroll
  for (int v = 0; v < NV; ++v)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[0].v[v][e] = 0.f;
  const Seed seed = load_seed(p.seed, p.seed_offset);
  Tile<VEC, NV> b;  // the thread's columns of the bias, for every row it visits
  if constexpr (!kMaskOnly) load_param<T, VEC, NV>(p.bias, pf32, n, b);
  static_assert(!kAhead || (!kBackward && !kIdentity), "kAhead: the GELU forward only");
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  RawTile<T, VEC, NV> next;  // kAhead: the x row of the group's next iteration
  if constexpr (kAhead) {
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
    load_raw<T, VEC, NV>(static_cast<const T*>(p.x) + r0 * n, n, r0 < rows, next);
  }
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows; base += stride) {
    const int64_t r = base + threadIdx.y;
    const bool valid = r < rows;  // predicated, so that the loop body stays convergent
    // The forward asks L2 for the x row it reads `ahead` iterations on (rows.cuh; 0 with
    // kAhead, whose host passes 0: compiled out with `!kAhead`, ptxas spilled 8 bytes).
    if (!kBackward && !kIdentity && ahead > 0 && r + ahead * stride < rows)
      prefetch_row_l2<T, VEC>(p.x, r + ahead * stride, n);
    Tile<VEC, NV> t, d;
    if constexpr (kAhead) {
      const RawTile<T, VEC, NV> cur = next;
      load_raw<T, VEC, NV>(static_cast<const T*>(p.x) + (r + stride) * n, n, r + stride < rows, next);
      unpack<T, VEC, NV>(cur, t);
    } else {
      load_tile<T, VEC, NV>(static_cast<const T*>(kMaskOnly ? p.dy : p.x) + r * n, n, valid, t);
    }
    if constexpr (kBackward && !kIdentity) load_tile<T, VEC, NV>(static_cast<const T*>(p.dy) + r * n, n, valid, d);
    if constexpr (!kBackward && kIdentity) load_tile<T, VEC, NV>(static_cast<const T*>(p.residual) + r * n, n, valid, d);
    // 16-bit types: the row's Philox calls side by side (tile_words); f32 per vector.
    constexpr bool kWords = VEC % 8 == 0;
    U32x4 w[kWords ? NV * VEC / 8 : 1];
    if constexpr (kWords) tile_words<VEC, NV>(seed, threshold, r, n, w);
    const uint32_t thr_hi = threshold << 16;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int64_t c = tile_col(v, VEC);
      float m[VEC];
      if constexpr (kWords) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) m[e] = lane_kept(w[(v * VEC + e) / 8], e % 8, thr_hi) ? keep_scale : 0.f;
      } else {
        keep_scales<VEC>(seed, threshold, keep_scale, static_cast<uint64_t>(r) * n + c, m);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if constexpr (kMaskOnly) {
          t.v[v][e] *= m[e];
          acc[0].v[v][e] += t.v[v][e];
          continue;
        }
        const float u = t.v[v][e] + b.v[v][e];
        if constexpr (kIdentity) {
          t.v[v][e] = fmaf(u, m[e], d.v[v][e]);
        } else if constexpr (kBackward) {
          float y;
          t.v[v][e] = d.v[v][e] * m[e] * gelu_and_grad(u, approximate, y);
          if constexpr (kStoreY) d.v[v][e] = y * m[e];  // dy is spent: d now holds the forward's y
          acc[0].v[v][e] += t.v[v][e];
        } else {
          t.v[v][e] = gelu(u, approximate) * m[e];
        }
      }
    }
    store_tile<T, VEC, NV>(static_cast<T*>(p.out) + r * n, n, valid, t);
    if constexpr (kStoreY) store_tile<T, VEC, NV>(static_cast<T*>(p.y) + r * n, n, valid, d);
  }
  if constexpr (kBackward) write_partials<1, VEC, NV>(acc, smem, p.workspace, n);
}

// Whether the GELU forward loads each row group's next row ahead (kAhead):
// JAXSUB_GELU_AHEAD, read once; default on (bench/NOTES.md, sixty-ninth session).
inline bool gelu_ahead() {
  static const bool on = env_flag("JAXSUB_GELU_AHEAD", true);
  return on;
}

// Whether the GELU backward runs two blocks per SM (kTwo): JAXSUB_GELU_BWD_TWO, read once;
// default on (bench/NOTES.md, sixty-ninth session).
inline bool gelu_bwd_two() {
  static const bool on = env_flag("JAXSUB_GELU_BWD_TWO", true);
  return on;
}

template <bool kBackward>
ffi::Error launch_gelu(cudaStream_t stream, const char* op, ffi::DataType t, ffi::DataType prm, const Rows& rc,
                       const GeluPtrs& p, bool approximate, uint32_t threshold, float keep_scale,
                       const KernelConfig& kernel, int64_t workspace_rows, void* dbias, bool identity = false) {
  if (auto e = check_kernel_config(op, kernel); e.failure()) return e;
  if (rc.rows == 0 || rc.cols == 0) return ffi::Error::Success();
  if (prm != t && prm != ffi::DataType::F32) return invalid(op, "bias must have the activation dtype or float32");
  const bool pf32 = prm == ffi::DataType::F32;
  return dispatch_float<DeviceTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const bool aligned = aligned16(p.x) && aligned16(p.bias) && aligned16(p.out) && aligned16(p.residual) &&
                         (!kBackward || (aligned16(p.dy) && (p.y == nullptr || aligned16(p.y))));
    // Defaults. No row reductions here: forward up to 16 elements per thread, backward 8
    // (16-bit) / 16 (f32), since the column partials stay live beside x and dy.
    const int max_elems = kernel.elems_or(kBackward && sizeof(T) < 4 ? 8 : 16);
    const RowConfig c = choose_rows(rc.cols, sizeof(T), aligned, max_elems, kernel.threads_or(kBackward ? 512 : 256));
    if (!c.ok) return invalid(op, "row too long for the kernel");
    const dim3 block(c.tx, c.ty);
    ffi::Error status = invalid(op, "no kernel for this row length");
    dispatch_tile<16 / sizeof(T)>(c, [&](auto vec, auto nv) {
      constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
      if constexpr (kBackward) {
        const size_t smem = c.ty > 1 ? sizeof(float) * c.tx * c.ty * VEC * NV : 0;
        auto kernel = identity       ? gelu_kernel<T, VEC, NV, true, false, true>
                      : p.y != nullptr ? gelu_kernel<T, VEC, NV, true, true>
                                       : gelu_kernel<T, VEC, NV, true>;
        constexpr bool kTwoFits = VEC * NV <= 8 && VEC * sizeof(T) == 16;
        if constexpr (kTwoFits)
          if (!identity && gelu_bwd_two())
            kernel = p.y != nullptr ? gelu_kernel<T, VEC, NV, true, true, false, false, kTwoFits>
                                    : gelu_kernel<T, VEC, NV, true, false, false, false, kTwoFits>;
        const int blocks = partial_blocks(kernel, rc.rows, c, smem, workspace_rows);
        launch_dependent(kernel, dim3(blocks), block, smem, stream, p, pf32, rc.rows, rc.cols, approximate,
                         threshold, keep_scale, 0);
        status = launch_check(op, "gelu_kernel<bwd>", c, blocks, smem);
        if (status.failure()) return;
        void* outs[3] = {dbias, nullptr, nullptr};
        launch_column_sum<T>(p.workspace, blocks, 1, rc.cols, pf32, outs, stream);
        status = launch_check(op, "column_sum_kernel", c, blocks, 0);
      } else {
        // One wave of blocks, each walking many rows: a block that did one row spent ~15%
        // of its instructions on its prologue (the bias, the seed, the indices).
        // kAhead where the next row takes at most 8 registers (16-byte vectors): with more,
        // or on the scalar path, 64 registers spilled.
        constexpr bool kAheadFits = VEC * sizeof(T) == 16 && NV <= 2;
        auto kernel = identity ? gelu_kernel<T, VEC, NV, false, false, true> : gelu_kernel<T, VEC, NV, false>;
        bool ahead = false;
        if constexpr (kAheadFits) ahead = !identity && gelu_ahead();
        if (ahead) kernel = gelu_kernel<T, VEC, NV, false, false, false, kAheadFits>;
        const int blocks = partial_blocks(kernel, rc.rows, c, 0, rc.rows);
        launch_dependent(kernel, dim3(blocks), block, 0, stream, p, pf32, rc.rows, rc.cols, approximate, threshold,
                         keep_scale, identity || ahead ? 0 : l2_ahead());
        status = launch_check(op, "gelu_kernel<fwd>", c, blocks, 0);
      }
    });
    return status;
  });
}

// x: [R, N]; bias: [N]; seed: [2] -> y: [R, N].
ffi::Error BiasGeluDropoutFwd(cudaStream_t stream, bool approximate, uint32_t threshold, float keep_scale,
                              int32_t block_threads, int32_t max_elems, ffi::AnyBuffer x, ffi::AnyBuffer bias,
                              ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "bias_gelu_dropout_fwd";
  const Rows rc = as_rows(x);
  if (static_cast<int64_t>(bias.element_count()) != rc.cols) return invalid(op, "bias length != last dim");
  GeluPtrs p{nullptr, x.untyped_data(), bias.untyped_data(), seed.typed_data(), y->untyped_data(), nullptr};
  p.seed_offset = seed.element_count() == 4;
  return launch_gelu<false>(stream, op, x.element_type(), bias.element_type(), rc, p, approximate, threshold,
                            keep_scale, {block_threads, max_elems}, 0, nullptr);
}

// dy, x: [R, N]; bias: [N]; seed: [2] -> dx: [R, N]; dbias: [N]; workspace: [C, 1, N];
// y: [R, N] (the forward's output, written again) or empty (not written).
ffi::Error BiasGeluDropoutBwd(cudaStream_t stream, bool approximate, uint32_t threshold, float keep_scale,
                              int32_t block_threads, int32_t max_elems, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                              ffi::AnyBuffer bias, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> dx,
                              ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
                              ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "bias_gelu_dropout_bwd";
  const Rows rc = as_rows(x);
  if (static_cast<int64_t>(bias.element_count()) != rc.cols) return invalid(op, "bias length != last dim");
  if (dy.element_count() != x.element_count()) return invalid(op, "dy and x shapes differ");
  if (y->element_count() != 0 && (y->element_count() != x.element_count() || y->element_type() != x.element_type()))
    return invalid(op, "y must be empty or match x in dtype and size");
  GeluPtrs p{dy.untyped_data(), x.untyped_data(), bias.untyped_data(), seed.typed_data(), dx->untyped_data(),
             data<float>(workspace), y->element_count() ? y->untyped_data() : nullptr};
  p.seed_offset = seed.element_count() == 4;
  const int64_t ws_rows = workspace->dimensions().size() ? workspace->dimensions()[0] : 0;
  return launch_gelu<true>(stream, op, x.element_type(), bias.element_type(), rc, p, approximate, threshold,
                           keep_scale, {block_threads, max_elems}, ws_rows, dbias->untyped_data());
}

// y: [R, N]; bias: [N]; residual: [R, N]; seed: [2] -> out: [R, N] = residual + dropout(y + bias).
ffi::Error BiasDropoutResidualFwd(cudaStream_t stream, uint32_t threshold, float keep_scale, int32_t block_threads,
                                  int32_t max_elems, ffi::AnyBuffer y, ffi::AnyBuffer bias, ffi::AnyBuffer residual,
                                  ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> out) {
  const char* op = "bias_dropout_residual_fwd";
  const Rows rc = as_rows(y);
  if (static_cast<int64_t>(bias.element_count()) != rc.cols) return invalid(op, "bias length != last dim");
  if (residual.element_count() != y.element_count() || residual.element_type() != y.element_type())
    return invalid(op, "residual must match y in dtype and size");
  GeluPtrs p{nullptr, y.untyped_data(), bias.untyped_data(), seed.typed_data(), out->untyped_data(), nullptr};
  p.seed_offset = seed.element_count() == 4;
  p.residual = residual.untyped_data();
  return launch_gelu<false>(stream, op, y.element_type(), bias.element_type(), rc, p, false, threshold, keep_scale,
                            {block_threads, max_elems}, 0, nullptr, true);
}

// dy: [R, N]; seed: [2] -> dx: [R, N] = dropout(dy); dbias: [N] (its column sums);
// workspace: [C, 1, N].
ffi::Error BiasDropoutBwd(cudaStream_t stream, uint32_t threshold, float keep_scale, int32_t block_threads,
                          int32_t max_elems, ffi::AnyBuffer dy, ffi::Buffer<ffi::U32> seed,
                          ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dbias,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  const char* op = "bias_dropout_bwd";
  const Rows rc = as_rows(dy);
  if (static_cast<int64_t>(dbias->element_count()) != rc.cols) return invalid(op, "dbias length != last dim");
  if (dx->element_count() != dy.element_count() || dx->element_type() != dy.element_type())
    return invalid(op, "dx must match dy in dtype and size");
  GeluPtrs p{dy.untyped_data(), nullptr, nullptr, seed.typed_data(), dx->untyped_data(), data<float>(workspace)};
  p.seed_offset = seed.element_count() == 4;
  const int64_t ws_rows = workspace->dimensions().size() ? workspace->dimensions()[0] : 0;
  return launch_gelu<true>(stream, op, dy.element_type(), dbias->element_type(), rc, p, false, threshold, keep_scale,
                           {block_threads, max_elems}, ws_rows, dbias->untyped_data(), true);
}

}  // namespace
}  // namespace jaxsub

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_bias_gelu_dropout_fwd, jaxsub::BiasGeluDropoutFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<bool>("approximate")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_bias_gelu_dropout_bwd, jaxsub::BiasGeluDropoutBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<bool>("approximate")
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()   // dx
                                  .Ret<ffi::AnyBuffer>()   // dbias
                                  .Ret<ffi::AnyBuffer>()   // workspace
                                  .Ret<ffi::AnyBuffer>(),  // y, or empty
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_bias_dropout_residual_fwd, jaxsub::BiasDropoutResidualFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<ffi::AnyBuffer>()   // y
                                  .Arg<ffi::AnyBuffer>()   // bias
                                  .Arg<ffi::AnyBuffer>()   // residual
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>(),  // out
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_bias_dropout_bwd, jaxsub::BiasDropoutBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<uint32_t>("threshold")
                                  .Attr<float>("keep_scale")
                                  .Attr<int32_t>("block_threads")
                                  .Attr<int32_t>("max_elems")
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()   // dx
                                  .Ret<ffi::AnyBuffer>()   // dbias
                                  .Ret<ffi::AnyBuffer>(),  // workspace
                              {ffi::Traits::kCmdBufferCompatible});
