"""jaxsub: fused, data-movement-minimizing transformer kernels for JAX."""

from jaxsub import layout, ops, stack
from jaxsub._ffi import cuda_available
from jaxsub.rewrite import explain, optimize
from jaxsub.analysis import analyze

__all__ = ["ops", "cuda_available", "optimize", "explain", "analyze", "layout", "stack", "flax"]
__version__ = "0.1.0"


def __getattr__(name):
    # jaxsub.flax imports flax, which users of the ops alone need not pay for.
    if name == "flax":
        import importlib

        return importlib.import_module("jaxsub.flax")
    raise AttributeError(f"module 'jaxsub' has no attribute {name!r}")
