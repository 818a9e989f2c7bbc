// CUDA handler for the public keep-mask (jaxsub.ops.dropout_mask).
#include "common.h"
#include "philox.h"

namespace jaxsub {
namespace {

// One thread per group of eight elements (one Philox call). A whole group's eight bools
// leave as one 8-byte store when the mask starts on 8 bytes (XLA's buffers do); byte
// stores otherwise and for the last, partial group.
__global__ void dropout_mask_kernel(const uint32_t* __restrict__ seed, bool with_offset, uint32_t threshold,
                                    bool* __restrict__ out, uint64_t n, bool words) {
  const Seed s = load_seed(seed, with_offset);
  for (uint64_t q = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; q * 8 < n;
       q += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const U32x4 w = dropout_words(s, q);
    uint64_t packed = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      packed |= static_cast<uint64_t>(threshold == 0 || lane16(w, i) >= threshold) << (8 * i);
    if (words && q * 8 + 8 <= n) {
      *reinterpret_cast<uint64_t*>(out + q * 8) = packed;  // bool is one byte, 0 or 1: little-endian lanes
    } else {
      for (int i = 0; i < 8 && q * 8 + i < n; ++i) out[q * 8 + i] = (packed >> (8 * i)) & 1;
    }
  }
}

// seed: u32[2]; mask: pred[...].
ffi::Error DropoutMaskCuda(cudaStream_t stream, uint32_t threshold, ffi::Buffer<ffi::U32> seed,
                           ffi::Result<ffi::AnyBuffer> mask) {
  if (seed.element_count() != seed_words(seed.element_count())) return invalid("dropout_mask", "seed must have 2 words");
  if (mask->element_type() != ffi::DataType::PRED) return invalid("dropout_mask", "mask must be bool");
  const uint64_t n = mask->element_count();
  if (n == 0) return ffi::Error::Success();
  const uint64_t groups = (n + 7) / 8;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<uint64_t>((groups + threads - 1) / threads, 65535));
  bool* out = data<bool>(mask);
  const bool words = reinterpret_cast<uintptr_t>(out) % 8 == 0;
  dropout_mask_kernel<<<blocks, threads, 0, stream>>>(seed.typed_data(), seed.element_count() == 4, threshold, out,
                                                      n, words);
  return launch_status("dropout_mask");
}

}  // namespace
}  // namespace jaxsub

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCuda_dropout_mask, jaxsub::DropoutMaskCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<uint32_t>("threshold")
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
