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


def __getattr__(name):
    # The nnx modules import flax.nnx, loaded on first use: `jaxsub.flax.nnx.EncoderLayer`
    # works after `import jaxsub` alone, as the README writes it.
    if name == "nnx":
        import importlib

        return importlib.import_module("jaxsub.flax.nnx")
    raise AttributeError(f"module 'jaxsub.flax' has no attribute {name!r}")
