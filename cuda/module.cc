// The Python extension: a table {target name: PyCapsule(XLA_FFI_Handler*)} per platform.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "targets.h"
#include "xla/ffi/api/api.h"

namespace py = pybind11;

#define JAXSUB_DECLARE_CPU(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsubCpu_##name);
JAXSUB_TARGETS(JAXSUB_DECLARE_CPU)
JAXSUB_STAGED_TARGETS(JAXSUB_DECLARE_CPU)
#ifdef JAXSUB_WITH_CUDA
#define JAXSUB_DECLARE_CUDA(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsubCuda_##name);
JAXSUB_TARGETS(JAXSUB_DECLARE_CUDA)
JAXSUB_STAGED_TARGETS(JAXSUB_DECLARE_CUDA)
#endif

namespace {

template <typename Fn>
py::capsule capsule(Fn* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

py::dict cpu_targets() {
  py::dict d;
#define JAXSUB_ADD_CPU(name) d["jaxsub_" #name] = capsule(JaxsubCpu_##name);
  JAXSUB_TARGETS(JAXSUB_ADD_CPU)
  JAXSUB_STAGED_TARGETS(JAXSUB_ADD_CPU)
  return d;
}

py::dict cuda_targets() {
  py::dict d;
#ifdef JAXSUB_WITH_CUDA
#define JAXSUB_ADD_CUDA(name) d["jaxsub_" #name] = capsule(JaxsubCuda_##name);
  JAXSUB_TARGETS(JAXSUB_ADD_CUDA)
#endif
  return d;
}

py::dict cuda_staged_targets() {
  py::dict d;
#ifdef JAXSUB_WITH_CUDA
  JAXSUB_STAGED_TARGETS(JAXSUB_ADD_CUDA)
#endif
  return d;
}

}  // namespace

#ifdef JAXSUB_WITH_CUDA
#include "gemm.h"
namespace jaxsub {
bool attention_sm90();   // attention.cu
bool dense_gelu_sm90();  // dense_gelu.cu
}
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "jaxsub native handlers (XLA FFI)";
  m.def("cpu_targets", &cpu_targets, "FFI handlers for the cpu platform");
  m.def("cuda_targets", &cuda_targets, "FFI handlers for the CUDA platform (empty if not built)");
  m.def("cuda_staged_targets", &cuda_staged_targets,
        "CUDA handlers not yet registered by default (targets.h: JAXSUB_STAGED_TARGETS)");
#ifdef JAXSUB_WITH_CUDA
  m.attr("built_with_cuda") = true;
  m.def("attention_sm90", &jaxsub::attention_sm90,
        "whether attention at head dim 64 or 128 runs the wgmma (sm_90a) kernels, forward and backward, on the "
        "current device now (JAXSUB_ATTENTION_SM90=0 turns them off)");
  m.def("dense_gelu_sm90", &jaxsub::dense_gelu_sm90,
        "whether the dense_gelu_fwd target (CUTLASS GEMM with the GELU epilogue) runs on the current device");
  m.def(
      "gemm_tune",
      [](const std::string& dtype, int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, bool bias, bool c,
         int64_t workspace_bytes) {
        jaxsub::GemmTuning r;
        {
          py::gil_scoped_release release;
          r = jaxsub::gemm_tune(dtype, m, n, k, trans_a, trans_b, bias, c, workspace_bytes);
        }
        return py::make_tuple(r.index, r.times_us);
      },
      py::arg("dtype"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("trans_a"), py::arg("trans_b"),
      py::arg("bias"), py::arg("c"), py::arg("workspace_bytes"),
      "the gemm target's cuBLASLt algorithm for a shape on the current device, timed once per process "
      "(gemm.h): (index in the heuristic's order or -1, each candidate's us or -1)");
#else
  m.attr("built_with_cuda") = false;
#endif
}
