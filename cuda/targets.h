// The one table of FFI targets. Each entry NAME is registered as "jaxsub_NAME" for the
// "cpu" platform (handler JaxsubCpu_NAME) and, when CUDA is built, for "CUDA"
// (handler JaxsubCuda_NAME). Every op family defines both handlers for its entries.
#pragma once

#define JAXSUB_TARGETS(X)  \
  X(dropout_mask)          \
  X(layer_norm_fwd)        \
  X(layer_norm_bwd)        \
  X(bdrln_fwd)             \
  X(bdrln_bwd)             \
  X(bias_gelu_dropout_fwd) \
  X(bias_gelu_dropout_bwd) \
  X(softmax_dropout_fwd)   \
  X(softmax_dropout_bwd)

// Targets registered for "cpu" only; Python routes GPU calls elsewhere
// (jaxsub._ffi.has_cuda_target) with a log line. The fused attention CUDA handlers
// (cuda/attention.cu) are compiled but stay out of the table until their GPU tests and
// compute-sanitizer pass on the H200; then move the two entries to JAXSUB_TARGETS.
#define JAXSUB_CPU_ONLY_TARGETS(X) \
  X(attention_fwd)                 \
  X(attention_bwd)
