// The gradient of a plain bias add (y = x + bias), CUDA: dbias = column sums of dy.
// Contract: ABI.md (bias_grad); row tiles and the two-stage deterministic column sum:
// rows.cuh. The forward and dx = dy are not kernels (jaxsub/ops/bias.py says why).
#include "common.h"
#include "rows.cuh"

namespace jaxsub {
namespace {

// Rows each thread loads before summing any of them: NV * kRowsInFlight = 8 independent
// loads in flight per thread (16-byte on the vector path). The kernel does one add per
// element, so it runs at the rate its loads come back. The grid is at most the workspace's
// 256 rows of blocks: at [B·S, 3072] bf16, 256 blocks of 384 threads, two per SM, ~96 KB in
// flight per SM. With 4 loads per thread (~48 KB) it read 25 MB in 7.7 us and 75 MB in
// 24.5 us on the H200 (b8s512 and b96s128 layers: 3.1-3.3 TB/s, 0.75-0.8 of a copy);
// between one batch's adds and the next batch's first load a thread has nothing in flight.
template <int NV>
constexpr int kRowsInFlight = NV >= 8 ? 1 : 8 / NV;

template <typename T, int VEC, int NV>
__device__ __forceinline__ void add_tile(const RawTile<T, VEC, NV>& raw, Tile<VEC, NV>& acc) {
  Tile<VEC, NV> t;
  unpack<T, VEC, NV>(raw, t);
#pragma unroll
  for (int v = 0; v < NV; ++v)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc.v[v][e] += t.v[v][e];
}

// dy: [R, N] T; workspace: [gridDim.x, 1, N] f32 (this block's column sums in row blockIdx.x).
// Row group g of block b visits rows (b * TY + g) + k * stride, stride = gridDim.x * TY, in
// increasing k, so every partial is a fixed-order sum: the result is the same on every run.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(max_threads_for(VEC, NV))
    bias_grad_kernel(const T* __restrict__ dy, float* __restrict__ workspace, int64_t rows, int64_t n) {
  wait_for_previous_grid();  // launched dependent on the kernel before it (pdl.cuh)
  dependents_may_launch();  // the column sum after this kernel
  constexpr int U = kRowsInFlight<NV>;
  extern __shared__ float smem[];
  Tile<VEC, NV> acc[1];
#pragma unroll
  for (int v = 0; v < NV; ++v)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[0].v[v][e] = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  // All U rows' loads are issued before the first add uses one of them.
  for (; r + (U - 1) * stride < rows; r += U * stride) {
    RawTile<T, VEC, NV> raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) load_raw<T, VEC, NV>(dy + (r + u * stride) * n, n, true, raw[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) add_tile<T, VEC, NV>(raw[u], acc[0]);
  }
  for (; r < rows; r += stride) {
    RawTile<T, VEC, NV> raw;
    load_raw<T, VEC, NV>(dy + r * n, n, true, raw);
    add_tile<T, VEC, NV>(raw, acc[0]);
  }
  write_partials<1, VEC, NV>(acc, smem, workspace, n);
}

// dbias[c] = sum over r of dy[r, c]; `pf32`: dbias is f32 rather than T.
ffi::Error launch_bias_grad(cudaStream_t stream, const char* op, ffi::DataType t, bool pf32, const Rows& rc,
                            const void* dy, float* workspace, int64_t workspace_rows, void* dbias) {
  if (rc.cols == 0) return ffi::Error::Success();
  return dispatch_float<DeviceTypes>(t, op, [&](auto tt) {
    using T = typename decltype(tt)::type;
    if (rc.rows == 0) {
      const size_t item = pf32 ? sizeof(float) : sizeof(T);
      if (cudaMemsetAsync(dbias, 0, item * rc.cols, stream) != cudaSuccess) return launch_status(op);
      return ffi::Error::Success();
    }
    // Eight elements per thread (one 16-byte vector of 16-bit dy, two of f32): with eight
    // loads in flight that is 32 registers of loads beside 8 partials, where more columns
    // per thread would only lengthen the block's final reduction.
    const RowConfig c = choose_rows(rc.cols, sizeof(T), aligned16(dy), 8, 512);
    if (!c.ok) return invalid(op, "row too long for the kernel");
    ffi::Error status = invalid(op, "no kernel for this row length");
    dispatch_tile<16 / sizeof(T)>(c, [&](auto vec, auto nv) {
      constexpr int VEC = decltype(vec)::value, NV = decltype(nv)::value;
      const size_t smem = c.ty > 1 ? sizeof(float) * c.tx * c.ty * VEC * NV : 0;
      auto kernel = bias_grad_kernel<T, VEC, NV>;
      const int blocks = partial_blocks(kernel, rc.rows, c, smem, workspace_rows);
      launch_dependent(kernel, dim3(blocks), dim3(c.tx, c.ty), smem, stream, static_cast<const T*>(dy), workspace,
                       rc.rows, rc.cols);
      status = launch_check(op, "bias_grad_kernel", c, blocks, smem);
      if (status.failure()) return;
      void* outs[3] = {dbias, nullptr, nullptr};
      launch_column_sum<T>(workspace, blocks, 1, rc.cols, pf32, outs, stream);
      status = launch_check(op, "column_sum_kernel", c, blocks, 0);
    });
    return status;
  });
}

// dy: [R, N] -> dbias: [N]; workspace: [C, 1, N] f32.
ffi::Error BiasGrad(cudaStream_t stream, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dbias,
                    ffi::Result<ffi::AnyBuffer> workspace) {
  const char* op = "bias_grad";
  if (dy.dimensions().size() < 1) return invalid(op, "dy must have rank >= 1");
  const Rows rc = as_rows(dy);
  const ffi::DataType t = dy.element_type(), p = dbias->element_type();
  if (p != t && p != ffi::DataType::F32) return invalid(op, "dbias must have dy's dtype or float32");
  if (static_cast<int64_t>(dbias->element_count()) != rc.cols) return invalid(op, "dbias length != last dim of dy");
  auto ws = workspace->dimensions();
  if (workspace->element_type() != ffi::DataType::F32 || ws.size() != 3 || ws[0] < 1 || ws[1] != 1 ||
      ws[2] != rc.cols)
    return invalid(op, "workspace must be f32 [C, 1, N] with C >= 1");
  return launch_bias_grad(stream, op, t, p == ffi::DataType::F32, rc, dy.untyped_data(), data<float>(workspace),
                          ws[0], dbias->untyped_data());
}

}  // namespace
}  // namespace jaxsub

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_bias_grad, jaxsub::BiasGrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
