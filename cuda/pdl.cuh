// Programmatic dependent launch (sm_90).
//
// A kernel launched with `launch_dependent` may be scheduled while the kernel before it on
// the stream is still running: once every block of that kernel has started and called
// `dependents_may_launch()`, or has exited. Its blocks then wait in
// `wait_for_previous_grid()` until that kernel has finished and its writes are visible, so
// the launch and the blocks' start overlap the previous kernel's last blocks instead of
// following them. The row and attention kernels on the training path are launched this
// way: the first kernel of a call after whatever XLA ran before it (the attention
// backward's delta kernel excepted), the next ones (column sums, the attention backward's
// tile and dq kernels) after the kernel of the same call that triggers them early. Every
// kernel launched this way calls `wait_for_previous_grid()` before it reads or writes
// global memory that the kernel before it may touch (the backward tile kernel first issues
// the copies of its call's inputs, which the ordinarily launched delta kernel guarantees
// finished); for a kernel launched the ordinary way both calls do nothing. In a CUDA graph
// (XLA's command buffers capture the custom calls) the launch becomes a programmatic edge.
// JAXSUB_PDL=0 launches every kernel the ordinary way (comparisons), as do GPUs before
// compute capability 9.0.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <cuda_runtime.h>

namespace jaxsub {

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void dependents_may_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches on the current device are dependent: compute capability 9.0 or newer
// (asked once per device) and JAXSUB_PDL not 0.
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("JAXSUB_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  constexpr int kMaxDevices = 64;
  static std::atomic<int> capable[kMaxDevices];  // 0 unknown, 1 yes, -1 no
  int dev = 0;
  if (!on || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return false;
  int known = capable[dev].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess;
    known = ok && major >= 9 ? 1 : -1;
    capable[dev].store(known, std::memory_order_relaxed);
  }
  return known > 0;
}

// cudaLaunchKernelEx with the programmatic-serialization attribute (off where pdl_enabled
// says so); the caller checks cudaGetLastError as after <<<...>>>.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = smem, config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  config.attrs = attr, config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace jaxsub
