"""A dense product, x @ kernel (+ bias), as one of jaxsub's FFI targets (cuBLASLt on GPU).

What it is for: XLA's dynamic-slice fusion runs a custom call on dynamic slices of larger
buffers in place, and writes a custom call's result straight into a dynamic-update-slice
that is its only user. XLA's own GEMMs (cuBLAS and Triton) copy such a slice first. In a
scanned stack of layers every weight is a dynamic slice of the stacked parameters, every
residual the backward's GEMMs read is a dynamic slice of a residual stack, and every
weight gradient is written into the gradient stack: with this op those copies go (24
BERT-large layers at b8 x s512 bf16 on an H200: bench/NOTES.md, nineteenth session). In a
single layer the operands are whole arrays and XLA's autotuned GEMM is the better choice.

The arithmetic is cuBLASLt's (target `jaxsub_gemm`, ABI.md): f32 accumulation, the bias
added in f32 in the GEMM's epilogue, one rounding; on CPU plain loops in f32. The backward
is two more calls, dx = dy · kernelᵀ and dkernel = xᵀ · dy over x's rows flattened, and
the bias gradient by `bias_grad`'s column sum.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxsub import _ffi
from jaxsub.ops import bias as _bias

_OP = "dense"
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# cuBLASLt's scratch for one call: its Hopper kernels want up to 32 MiB (XLA gives its own
# cuBLASLt calls the same). A result of the call, so XLA places and reuses it.
WORKSPACE_BYTES = 32 << 20
_TARGET = "jaxsub_gemm"


# ---------------------------------------------------------------------------------------
# Reference.


def reference_dense(x, kernel, bias=None):
    """Pure-JAX x @ kernel (+ bias) over x's last axis: f32 products and sums, output in
    x.dtype."""
    y = jnp.einsum("...k,kn->...n", x, kernel, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


# ---------------------------------------------------------------------------------------
# FFI call.


def gemm(a, b, bias=None, *, trans_a=False, trans_b=False, barrier=True):
    """d = op(a) · op(b) (+ bias) through the `jaxsub_gemm` target: a [M, K] ([K, M] with
    trans_a), b [K, N] ([N, K] with trans_b), bias [N] or None, one dtype; d [M, N].
    `barrier=False` leaves out the optimization barrier of `_ffi.call`, so that XLA may
    write d straight into a dynamic-update-slice that is d's only user (a gradient
    written into a scan's gradient stack)."""
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    bias = jnp.zeros((0,), a.dtype) if bias is None else bias
    d, _ = _ffi.call(_TARGET, (jax.ShapeDtypeStruct((m, n), a.dtype),
                               jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)),
                     a, b, bias, trans_a=trans_a, trans_b=trans_b, barrier=barrier)
    return d


# ---------------------------------------------------------------------------------------
# custom_vjp over the [M, K] rows: the residuals are x and the kernel (live inputs anyway
# in a layer; in a scan, slices of the stacks that the backward reads in place).


def _backward(x2, kernel, bias, dy):
    dx = gemm(dy, kernel, trans_b=True, barrier=False)
    dkernel = gemm(x2, dy, trans_a=True, barrier=False)
    return dx, dkernel, (None if bias is None else _bias.bias_grad(dy, bias))


@jax.custom_vjp
def _dense(x2, kernel):
    return gemm(x2, kernel)


_dense.defvjp(lambda x2, kernel: (gemm(x2, kernel), (x2, kernel)),
              lambda res, dy: _backward(*res, None, dy)[:2])


@jax.custom_vjp
def _dense_bias(x2, kernel, bias):
    return gemm(x2, kernel, bias)


_dense_bias.defvjp(lambda x2, kernel, bias: (gemm(x2, kernel, bias), (x2, kernel, bias)),
                   lambda res, dy: _backward(*res, dy))


# ---------------------------------------------------------------------------------------
# Public function.


def _check_inputs(x, kernel, bias):
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    kernel = kernel if isinstance(kernel, jax.Array) else jnp.asarray(kernel)
    if x.ndim < 1:
        raise ValueError(f"jaxsub.{_OP}: `x` must have rank >= 1, got shape {x.shape}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"jaxsub.{_OP}: `x` must be float32, bfloat16 or float16, got {x.dtype}")
    if kernel.ndim != 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(f"jaxsub.{_OP}: `kernel` must have shape ({x.shape[-1]}, N), got {kernel.shape}")
    if kernel.dtype != x.dtype:
        raise TypeError(f"jaxsub.{_OP}: `kernel` must have x's dtype ({x.dtype}), got {kernel.dtype}")
    if bias is not None:
        bias = bias if isinstance(bias, jax.Array) else jnp.asarray(bias)
        if bias.shape != (kernel.shape[1],):
            raise ValueError(f"jaxsub.{_OP}: `bias` must have shape ({kernel.shape[1]},), got {bias.shape}")
        if bias.dtype != x.dtype:
            raise TypeError(f"jaxsub.{_OP}: `bias` must have x's dtype ({x.dtype}), got {bias.dtype}")
    return x, kernel, bias


def supported(x, kernel) -> bool:
    """Whether `dense` runs its target for these operands (else the reference, logged)."""
    reason = _unsupported(x, kernel)
    if reason is not None:
        _ffi.fallback(_OP, reason)
    return reason is None


def _unsupported(x, kernel) -> str | None:
    if x.size == 0 or kernel.size == 0:
        return "zero-size input"
    platform = jax.default_backend() if isinstance(x, jax.core.Tracer) else next(iter(x.devices())).platform
    if platform == "gpu" and not _ffi.has_cuda_target(_TARGET):
        return "no CUDA gemm target in this build"
    if platform not in ("cpu", "gpu"):
        return f"no gemm target for platform {platform!r}"
    return None


def dense(x, kernel, bias=None):
    """x @ kernel (+ bias) over x's last axis, through jaxsub's GEMM target.

    Args:
      x: [..., K], float32, bfloat16 or float16.
      kernel: [K, N], x's dtype.
      bias: None or [N], x's dtype.

    Returns:
      [..., N] in x's dtype: products and sums in f32, the bias added in f32, one
      rounding (`reference_dense`'s values up to summation order).

    On GPU the product is a cuBLASLt call of jaxsub's own (target `jaxsub_gemm`), which
    XLA runs in place on dynamic slices: use it where x, kernel or the gradients are slices
    of stacked arrays (a `lax.scan` over layers); elsewhere `x @ kernel` lets XLA choose
    and fuse its GEMM. The backward is two more such calls and `bias_grad`'s column sum.
    Composes with jit, grad, vjp and vmap (sequentially over the mapped axis). A zero-size
    operand, or a platform without the target, uses the reference (with a one-time log
    line).
    """
    x, kernel, bias = _check_inputs(x, kernel, bias)
    if not supported(x, kernel):
        return reference_dense(x, kernel, bias)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    y = _dense(x2, kernel) if bias is None else _dense_bias(x2, kernel, bias)
    return y.reshape(*x.shape[:-1], kernel.shape[1])
