// The row kernels (layer norm, BDRLN, bias + GELU + dropout, the pre-LN residual; forward
// and backward with the column sums, BDRLN's backward also with a second cotangent, both
// norm backwards with a cotangent of h, BDRLN's forward writing h and GELU's backward y;
// the bias gradient) launched
// straight from C++, without XLA, for compute-sanitizer: under the tool, runs through JAX
// crashed while XLA compiled (bench/NOTES.md v4). Odd and vector-aligned row lengths,
// misaligned pointers (the general path), parameters in the activation dtype and in
// float32, the default and the extreme kernel configurations.
// Inputs are initialized, outputs are allocated to their exact sizes, so memcheck sees
// any access outside them and initcheck any read of unwritten memory. Values are not
// checked here (the GPU tests compare with the CPU handlers); launch errors and CUDA
// errors are, and make the exit status 1. On a GPU machine:
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90,code=sm_90 \
//     -I$(python3 -c "import jax; print(jax.ffi.include_dir())") -Icuda tools/sanitize_rows.cu -o /tmp/sanitize_rows
//   compute-sanitizer --tool memcheck /tmp/sanitize_rows     (also racecheck, synccheck, initcheck)
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../cuda/bias.cu"
#include "../cuda/gelu.cu"
#include "../cuda/norm.cu"

namespace {

using jaxsub::KernelConfig;
using xla::ffi::DataType;

int failures = 0;

// A device buffer of exactly `bytes` (plus `offset` bytes in front when misaligned),
// filled with a byte pattern that decodes to small finite values in every dtype.
struct Buf {
  char* base = nullptr;
  void* p = nullptr;
  Buf(size_t bytes, size_t offset, int fill) {
    cudaMalloc(&base, bytes + offset);
    cudaMemset(base, fill, bytes + offset);
    p = base + offset;
  }
  ~Buf() { cudaFree(base); }
  template <typename X>
  X* as() const { return static_cast<X*>(p); }
};

size_t size_of(DataType t) { return t == DataType::F32 ? 4 : 2; }

void check(const char* what, const xla::ffi::Error& e, int64_t rows, int64_t cols, const KernelConfig& k) {
  const cudaError_t sync = cudaDeviceSynchronize();
  if (sync != cudaSuccess && cudaGetLastError() != cudaSuccess && cudaDeviceSynchronize() != cudaSuccess) {
    // A kernel fault poisons the context: every later launch would fail too.
    std::printf("FAILED %s [%lld, %lld] threads %d elems %d: %s (sticky; stopping)\n", what,
                static_cast<long long>(rows), static_cast<long long>(cols), k.block_threads, k.max_elems,
                cudaGetErrorString(sync));
    std::exit(1);
  }
  if (e.failure() || sync != cudaSuccess) {
    if (++failures > 20) return;  // the first ones say enough
    std::printf("FAILED %s [%lld, %lld] threads %d elems %d: %s %s\n", what, static_cast<long long>(rows),
                static_cast<long long>(cols), k.block_threads, k.max_elems, e.failure() ? e.message().c_str() : "",
                sync != cudaSuccess ? cudaGetErrorString(sync) : "");
  }
}

void run(DataType t, DataType prm, int64_t rows, int64_t cols, bool misalign, const KernelConfig& k) {
  const size_t act = rows * cols * size_of(t), par = cols * size_of(prm), stat = rows * sizeof(float);
  // Misaligned by one element of each buffer's own dtype: XLA never hands out a buffer
  // that is not aligned to its element size.
  const size_t off = misalign ? size_of(t) : 0, poff = misalign ? size_of(prm) : 0;
  const int64_t ws_rows = 1024;
  const size_t ws = ws_rows * 3 * cols * sizeof(float);
  Buf x(act, off, 0x3c), res(act, off, 0x3b), dy(act, off, 0x3a), y(act, off, 0xff), dx(act, off, 0xff),
      dres(act, off, 0xff);
  Buf scale(par, poff, 0x3c), bias(par, poff, 0x3b), ln_bias(par, poff, 0x3a);
  Buf dscale(par, poff, 0xff), dbias(par, poff, 0xff), dln_bias(par, poff, 0xff);
  Buf mean(stat, 0, 0xff), rstd(stat, 0, 0xff), workspace(ws, 0, 0xff), seed(8, 0, 0x5a);
  const uint32_t threshold = 6554;  // rate 0.1
  const float keep_scale = 1.f / 0.9f;
  cudaStream_t stream = nullptr;
  using jaxsub::NormArgs;
  using jaxsub::NormPtrs;

  {  // layer norm forward, then backward from its mean/rstd
    NormArgs<false> a{"layer_norm_fwd", t, prm, rows, cols};
    a.p = NormPtrs{nullptr, x.p, nullptr, nullptr, scale.p, bias.p, nullptr, y.p, nullptr,
                   mean.as<float>(), rstd.as<float>(), nullptr};
    a.eps = 1e-5f, a.kernel = k;
    check("layer_norm_fwd", jaxsub::launch_norm<false, false>(stream, a), rows, cols, k);
    NormArgs<false> b{"layer_norm_bwd", t, prm, rows, cols};
    b.p = NormPtrs{dy.p, x.p, nullptr, nullptr, scale.p, nullptr, nullptr, dx.p, nullptr,
                   mean.as<float>(), rstd.as<float>(), workspace.as<float>()};
    b.workspace_rows = ws_rows, b.kernel = k;
    b.grads[0] = dscale.p, b.grads[1] = dbias.p;
    check("layer_norm_bwd", jaxsub::launch_norm<false, true>(stream, b), rows, cols, k);
    b.p.dh = res.p;  // a cotangent of x itself (layer_norm_and_input): any initialized [R, N] buffer
    check("layer_norm_bwd dh", jaxsub::launch_norm<false, true>(stream, b), rows, cols, k);
  }
  {  // BDRLN
    NormArgs<true> a{"bdrln_fwd", t, prm, rows, cols};
    a.p = NormPtrs{nullptr, x.p, bias.p, res.p, scale.p, ln_bias.p, seed.as<uint32_t>(), y.p, nullptr,
                   mean.as<float>(), rstd.as<float>(), nullptr};
    a.eps = 1e-5f, a.threshold = threshold, a.keep_scale = keep_scale, a.kernel = k;
    check("bdrln_fwd", jaxsub::launch_norm<true, false>(stream, a), rows, cols, k);
    a.p.h = dres.p;  // h written too (bdrln_and_sum)
    check("bdrln_fwd h", jaxsub::launch_norm<true, false>(stream, a), rows, cols, k);
    NormArgs<true> b{"bdrln_bwd", t, prm, rows, cols};
    b.p = NormPtrs{dy.p, x.p, bias.p, res.p, scale.p, nullptr, seed.as<uint32_t>(), dx.p, dres.p,
                   mean.as<float>(), rstd.as<float>(), workspace.as<float>()};
    b.threshold = threshold, b.keep_scale = keep_scale, b.workspace_rows = ws_rows, b.kernel = k;
    b.grads[0] = dbias.p, b.grads[1] = dscale.p, b.grads[2] = dln_bias.p;
    check("bdrln_bwd", jaxsub::launch_norm<true, true>(stream, b), rows, cols, k);
    b.p.dy2 = res.p;  // a second cotangent (bdrln_pair): any initialized [R, N] buffer
    check("bdrln_bwd dy2", jaxsub::launch_norm<true, true>(stream, b), rows, cols, k);
    b.p.dy2 = nullptr, b.p.dh = x.p;  // h's own cotangent (bdrln_and_sum)
    check("bdrln_bwd dh", jaxsub::launch_norm<true, true>(stream, b), rows, cols, k);
  }
  for (bool approximate : {false, true}) {  // bias + GELU + dropout
    const jaxsub::Rows rc{rows, cols};
    jaxsub::GeluPtrs f{nullptr, x.p, bias.p, seed.as<uint32_t>(), y.p, nullptr};
    check("bias_gelu_dropout_fwd",
          jaxsub::launch_gelu<false>(stream, "bias_gelu_dropout_fwd", t, prm, rc, f, approximate, threshold,
                                     keep_scale, k, 0, nullptr),
          rows, cols, k);
    jaxsub::GeluPtrs g{dy.p, x.p, bias.p, seed.as<uint32_t>(), dx.p, workspace.as<float>()};
    check("bias_gelu_dropout_bwd",
          jaxsub::launch_gelu<true>(stream, "bias_gelu_dropout_bwd", t, prm, rc, g, approximate, threshold,
                                    keep_scale, k, ws_rows, dbias.p),
          rows, cols, k);
    g.y = y.p;  // the forward's output written again (dense_bias_gelu_dropout)
    check("bias_gelu_dropout_bwd y",
          jaxsub::launch_gelu<true>(stream, "bias_gelu_dropout_bwd", t, prm, rc, g, approximate, threshold,
                                    keep_scale, k, ws_rows, dbias.p),
          rows, cols, k);
  }
  {  // the pre-LN residual: residual + dropout(x + bias), and its backward from dy alone
    const jaxsub::Rows rc{rows, cols};
    jaxsub::GeluPtrs f{nullptr, x.p, bias.p, seed.as<uint32_t>(), y.p, nullptr};
    f.residual = res.p;
    check("bias_dropout_residual_fwd",
          jaxsub::launch_gelu<false>(stream, "bias_dropout_residual_fwd", t, prm, rc, f, false, threshold,
                                     keep_scale, k, 0, nullptr, true),
          rows, cols, k);
    jaxsub::GeluPtrs g{dy.p, nullptr, nullptr, seed.as<uint32_t>(), dx.p, workspace.as<float>()};
    check("bias_dropout_bwd",
          jaxsub::launch_gelu<true>(stream, "bias_dropout_bwd", t, prm, rc, g, false, threshold, keep_scale, k,
                                    ws_rows, dbias.p, true),
          rows, cols, k);
  }
  if (k.block_threads == 0 && k.max_elems == 0) {  // the bias gradient has one launch shape
    check("bias_grad",
          jaxsub::launch_bias_grad(stream, "bias_grad", t, prm == DataType::F32, jaxsub::Rows{rows, cols}, dy.p,
                                   workspace.as<float>(), ws_rows, dbias.p),
          rows, cols, k);
  }
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("sanitize_rows: no CUDA device\n");
    return 2;
  }
  // The last two: enough rows that every row group of the backwards walks several, with
  // one warp per row and (at the default configuration) with two or four.
  const int64_t shapes[][2] = {{1, 1},    {3, 7},    {5, 130},    {7, 1000},  {33, 1024},
                               {9, 4096}, {3, 4104}, {2, 16384}, {9000, 64}, {2000, 1024}};
  const KernelConfig configs[] = {{0, 0}, {1024, 4}, {32, 32}};
  int runs = 0;
  for (DataType t : {DataType::BF16, DataType::F16, DataType::F32})
    for (DataType prm : {t, DataType::F32})
      for (const auto& s : shapes)
        for (bool misalign : {false, true})
          for (const KernelConfig& k : configs) {
            run(t, prm, s[0], s[1], misalign, k);
            ++runs;
          }
  std::printf("sanitize_rows: %d configurations, %d failures\n", runs, failures);
  return failures == 0 ? 0 : 1;
}
