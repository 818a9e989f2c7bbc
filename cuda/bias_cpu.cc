// CPU handler for the gradient of a plain bias add (ABI.md: bias_grad). Plain loops: they
// define the results the CUDA kernel is compared against on any machine.
#include <vector>

#include "common.h"

namespace jaxsub {
namespace {

constexpr const char* kOp = "bias_grad";

// dy: T[R, N]; dbias: P[N]; workspace: f32[C, 1, N] (GPU scratch, untouched here).
ffi::Error BiasGradCpu(ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dbias,
                       ffi::Result<ffi::AnyBuffer> workspace) {
  if (dy.dimensions().size() < 1) return invalid(kOp, "dy must have rank >= 1");
  const Rows d = as_rows(dy);
  if (static_cast<int64_t>(dbias->element_count()) != d.cols) return invalid(kOp, "dbias length != last dim of dy");
  auto ws = workspace->dimensions();
  if (workspace->element_type() != ffi::DataType::F32 || ws.size() != 3 || ws[0] < 1 || ws[1] != 1 ||
      ws[2] != d.cols)
    return invalid(kOp, "workspace must be f32 [C, 1, N] with C >= 1");
  return dispatch_float<HostTypes>(dy.element_type(), kOp, [&](auto tt) {
    using T = typename decltype(tt)::type;
    return dispatch_param<HostTypes, T>(dy.element_type(), dbias->element_type(), kOp, [&](auto pt) {
      using P = typename decltype(pt)::type;
      const T* dys = data<T>(dy);
      P* dbs = data<P>(dbias);
      // Rows are summed in a fixed order in double, so dbias is deterministic and its
      // rounding error does not grow with R.
      std::vector<double> acc(static_cast<size_t>(d.cols), 0.0);
      for (int64_t r = 0; r < d.rows; ++r) {
        const T* row = dys + r * d.cols;
        for (int64_t c = 0; c < d.cols; ++c) acc[c] += to_float(row[c]);
      }
      for (int64_t c = 0; c < d.cols; ++c) dbs[c] = from_float<P>(static_cast<float>(acc[c]));
      return ffi::Error::Success();
    });
  });
}

}  // namespace
}  // namespace jaxsub

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_bias_grad, jaxsub::BiasGradCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // dy
                                  .Ret<xla::ffi::AnyBuffer>()   // dbias
                                  .Ret<xla::ffi::AnyBuffer>());  // workspace
