"""jaxsub: fused, data-movement-minimizing transformer kernels for JAX."""

from jaxsub import ops
from jaxsub._ffi import cuda_available
from jaxsub.rewrite import explain, optimize

__all__ = ["ops", "cuda_available", "optimize", "explain"]
__version__ = "0.1.0"
