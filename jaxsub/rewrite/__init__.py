"""The jaxpr pass: find transformer patterns in a traced function, run them as fused ops."""

from jaxsub.rewrite import patterns
from jaxsub.rewrite.explain import Report, explain
from jaxsub.rewrite.interpreter import optimize
from jaxsub.rewrite.match_attention import match_attention
from jaxsub.rewrite.match_gelu import match_bias_gelu_dropout
from jaxsub.rewrite.match_norm import match_bias_dropout_residual, match_layer_norm
from jaxsub.rewrite.match_softmax import match_softmax_dropout

# Layer norm first: at a shared anchor the normalization is the larger pattern.
patterns.register("layer_norm", match_layer_norm, priority=10)
patterns.register("bias_gelu_dropout", match_bias_gelu_dropout, priority=20)
# Attention (anchored at the ·V contraction) claims its softmax before the softmax-only
# matcher, anchored earlier in the graph, is tried.
patterns.register("attention", match_attention, priority=30)
patterns.register("softmax_dropout", match_softmax_dropout, priority=40)
# A residual with dropout that no layer norm follows (BDRLN, anchored at the layer norm
# later in the graph, has claimed the others by the time its add is tried).
patterns.register("bias_dropout_residual", match_bias_dropout_residual, priority=50)

__all__ = ["optimize", "explain", "Report", "patterns"]
