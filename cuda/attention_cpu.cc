// STUB: replaced by the family's real CPU handlers.
#include "common.h"
namespace jaxsub { namespace {
ffi::Error Stub() { return ffi::Error(ffi::ErrorCode::kUnimplemented, "not implemented"); }
} }
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_attention_fwd, jaxsub::Stub, xla::ffi::Ffi::Bind());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsubCpu_attention_bwd, jaxsub::Stub, xla::ffi::Ffi::Bind());
