"""STUB"""

def layer_norm(*a, **k):
    raise NotImplementedError


def bias_dropout_residual_layer_norm(*a, **k):
    raise NotImplementedError
