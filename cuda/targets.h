// The one table of FFI targets. Each entry NAME is registered as "jaxsub_NAME" for the
// "cpu" platform (handler JaxsubCpu_NAME) and, when CUDA is built, for "CUDA"
// (handler JaxsubCuda_NAME). Every op family defines both handlers for its entries.
#pragma once

#define JAXSUB_TARGETS(X)       \
  X(dropout_mask)               \
  X(layer_norm_fwd)             \
  X(layer_norm_bwd)             \
  X(bdrln_fwd)                  \
  X(bdrln_bwd)                  \
  X(bias_gelu_dropout_fwd)      \
  X(bias_gelu_dropout_bwd)      \
  X(bias_dropout_residual_fwd)  \
  X(bias_dropout_bwd)           \
  X(softmax_dropout_fwd)        \
  X(softmax_dropout_bwd)        \
  X(attention_fwd)              \
  X(attention_bwd)              \
  X(attention_bwd_dqkv)         \
  X(attention_qkv_fwd)          \
  X(attention_qkv_bwd)          \
  X(bias_grad)                  \
  X(gemm)                       \
  X(dense_gelu_fwd)

// Staged targets: always registered for "cpu"; their CUDA handlers are compiled and
// exported (cuda_staged_targets) but registered for "CUDA" only when the environment sets
// JAXSUB_STAGED_CUDA=1, so GPU tests and compute-sanitizer can run them before they are
// trusted. Without it Python routes GPU calls elsewhere (jaxsub._ffi.has_cuda_target) with
// a log line. Move an entry to JAXSUB_TARGETS once its GPU tests pass on the H200.
#define JAXSUB_STAGED_TARGETS(X)
