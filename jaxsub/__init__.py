"""jaxsub: fused, data-movement-minimizing transformer kernels for JAX."""

from jaxsub import ops
from jaxsub._ffi import cuda_available

__all__ = ["ops", "cuda_available"]
__version__ = "0.1.0"
