"""flax.nnx versions of the encoder modules.

`EncoderLayer` and `Encoder` here are the linen modules of `jaxsub.flax` run through
`flax.nnx.bridge.ToNNX`: the same fused ops, fields, parameter tree (under `.module`) and
numbers, in nnx's object style. The hidden size is a constructor argument because nnx
creates parameters eagerly::

    layer = jaxsub.flax.nnx.EncoderLayer(1024, num_heads=16, mlp_dim=4096,
                                         dropout_rate=0.1, rngs=nnx.Rngs(0, dropout=1))
    y = layer(x, deterministic=False)          # draws from the 'dropout' stream of rngs
    layer.train(); y = layer(x)                # the same: nnx's train() / eval() switch it

Every keyword of the linen module is accepted (see `jaxsub.flax.EncoderLayer`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import bridge

from jaxsub.flax import encoder as _linen


def _true(flag) -> bool:
    return isinstance(flag, (bool, np.bool_)) and bool(flag)


class _Bridged(nnx.Module):
    _linen_cls: type

    def __init__(self, hidden: int, *, rngs: nnx.Rngs, deterministic: bool = True, **fields):
        self.module = bridge.ToNNX(self._linen_cls(**fields), rngs=rngs)
        # Parameters are created now, for an input of the layer's hidden size and dtype.
        dtype = fields.get("dtype") or jnp.float32
        bridge.lazy_init(self.module, jnp.zeros((1, 1, hidden), dtype))
        # nnx's switch: model.train() sets it False (dropout on), model.eval() True.
        self.deterministic = deterministic

    def __call__(self, x, mask=None, *, bias=None, deterministic: bool | None = None):
        """mask, bias: as the linen module's. deterministic: None takes the module's
        attribute (nnx's train() / eval())."""
        deterministic = self.deterministic if deterministic is None else deterministic
        # Without dropout no stream is drawn from: the bridge would otherwise advance every
        # stream's count, a mutation that plain jax.jit / grad / vmap of an eval-mode model
        # refuse (as an nnx.Dropout in eval mode draws nothing).
        return self.module(x, mask, deterministic=deterministic, bias=bias,
                           **({"rngs": {}} if _true(deterministic) else {}))


class EncoderLayer(_Bridged):
    """`jaxsub.flax.EncoderLayer` as an nnx module: `EncoderLayer(hidden, *, rngs, **fields)`."""

    _linen_cls = _linen.EncoderLayer


class Encoder(_Bridged):
    """`jaxsub.flax.Encoder` as an nnx module: `Encoder(hidden, *, rngs, **fields)`."""

    _linen_cls = _linen.Encoder
