"""Flax modules built on jaxsub's fused ops: flax.linen here, flax.nnx in `jaxsub.flax.nnx`."""

from jaxsub.flax.encoder import (
    Encoder,
    EncoderLayer,
    ReferenceEncoderLayer,
    from_flax_params,
    reference_layer,
    to_flax_params,
)

__all__ = [
    "EncoderLayer",
    "Encoder",
    "ReferenceEncoderLayer",
    "reference_layer",
    "to_flax_params",
    "from_flax_params",
]
