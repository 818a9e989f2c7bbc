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
  X(bias_gelu_dropout_bwd)
