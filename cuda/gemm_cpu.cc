// CPU handler of the gemm target (ABI.md: gemm). Plain loops in f32 (each output a sum
// over k in order, the bias then c added before the one rounding): the results the cuBLASLt
// handler is compared against on any machine.
#include <vector>

#include "common.h"
#include "gemm.h"

namespace jaxsub {
namespace {

constexpr const char* kOp = "gemm";

ffi::Error GemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer bias, ffi::AnyBuffer c,
                   ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, bool trans_a, bool trans_b) {
  (void)workspace;  // GPU scratch, untouched here
  GemmShape g;
  if (ffi::Error e = check_gemm(kOp, a, b, bias, c, *d, trans_a, trans_b, g); e.failure()) return e;
  return dispatch_float<HostTypes>(a.element_type(), kOp, [&](auto tt) {
    using T = typename decltype(tt)::type;
    const T* as = data<T>(a);
    const T* bs = data<T>(b);
    const T* biases = data<T>(bias);
    const T* cs = data<T>(c);
    T* ds = data<T>(d);
    // b as f32 [k, n] once, so the inner loop runs over contiguous floats.
    std::vector<float> bf(static_cast<size_t>(g.k * g.n));
    for (int64_t p = 0; p < g.k; ++p)
      for (int64_t j = 0; j < g.n; ++j) bf[p * g.n + j] = to_float(trans_b ? bs[j * g.k + p] : bs[p * g.n + j]);
    std::vector<float> row(static_cast<size_t>(g.n));
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) row[j] = 0.f;
      for (int64_t p = 0; p < g.k; ++p) {
        const float x = to_float(trans_a ? as[p * g.m + i] : as[i * g.k + p]);
        const float* bp = bf.data() + p * g.n;
        for (int64_t j = 0; j < g.n; ++j) row[j] += x * bp[j];
      }
      for (int64_t j = 0; j < g.n; ++j) {
        float v = g.bias ? row[j] + to_float(biases[j]) : row[j];
        ds[i * g.n + j] = from_float<T>(g.c ? v + to_float(cs[i * g.n + j]) : v);
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxsub

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_gemm, jaxsub::GemmCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a
                                  .Arg<xla::ffi::AnyBuffer>()  // b
                                  .Arg<xla::ffi::AnyBuffer>()  // bias
                                  .Arg<xla::ffi::AnyBuffer>()  // c
                                  .Ret<xla::ffi::AnyBuffer>()  // d
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
