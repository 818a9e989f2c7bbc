"""Fused ops: differentiable, composable with jit / grad / vmap; CPU and CUDA."""

from jaxsub.ops.dropout import dropout_mask
from jaxsub.ops.norm import bias_dropout_residual_layer_norm, layer_norm
from jaxsub.ops.gelu import bias_gelu_dropout, bias_gelu_dropout_dense, dense_bias_gelu_dropout
from jaxsub.ops.bias import bias_add
from jaxsub.ops.gemm import dense
from jaxsub.ops.softmax import softmax_dropout
from jaxsub.ops.attn import attention, attention_packed
from jaxsub.ops.projected import attention_projected, dense_attention_packed

__all__ = [
    "dropout_mask",
    "layer_norm",
    "bias_dropout_residual_layer_norm",
    "bias_gelu_dropout",
    "bias_gelu_dropout_dense",
    "dense_bias_gelu_dropout",
    "bias_add",
    "dense",
    "softmax_dropout",
    "attention",
    "attention_packed",
    "attention_projected",
    "dense_attention_packed",
]
