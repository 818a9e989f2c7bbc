// CPU handler for the public keep-mask (jaxsub.ops.dropout_mask).
#include "common.h"
#include "philox.h"

namespace jaxsub {
namespace {

// seed: u32[2]; mask: pred[...] (any shape; element i of the row-major flattening).
ffi::Error DropoutMaskCpu(uint32_t threshold, ffi::Buffer<ffi::U32> seed, ffi::Result<ffi::AnyBuffer> mask) {
  if (seed.element_count() != seed_words(seed.element_count())) return invalid("dropout_mask", "seed must have 2 words");
  if (mask->element_type() != ffi::DataType::PRED) return invalid("dropout_mask", "mask must be bool");
  bool* out = data<bool>(mask);
  const Seed s = cpu_seed(seed);
  const uint64_t n = mask->element_count();
  for (uint64_t q = 0; q * 8 < n; ++q) {
    U32x4 w = dropout_words(s, q);
    for (int i = 0; i < 8 && q * 8 + i < n; ++i) out[q * 8 + i] = threshold == 0 || lane16(w, i) >= threshold;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxsub

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_dropout_mask, jaxsub::DropoutMaskCpu,
                              xla::ffi::Ffi::Bind()
                                  .Attr<uint32_t>("threshold")
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::AnyBuffer>());
