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
added in f32 in the GEMM's epilogue, one rounding; on CPU plain loops in f32. Its
algorithm is tuned as XLA tunes its own GEMMs: when a product is traced on a GPU,
cuBLASLt's first eight candidates for the shape are timed once per process and the
fastest kept (`_ffi.gemm_tune`; `JAXSUB_GEMM_TUNE=0` keeps the heuristic's first). The backward
is two more calls, dx = dy · kernelᵀ and dkernel = xᵀ · dy over x's rows flattened, and
the bias gradient by `bias_grad`'s column sum.
"""

from __future__ import annotations

import functools
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


def reference_dense(x, kernel, bias=None, *, axes=1):
    """Pure-JAX x @ kernel (+ bias), x's last `axes` dims contracted with kernel's first:
    f32 products and sums, output in x.dtype."""
    y = jnp.tensordot(x, kernel, axes=axes, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


# ---------------------------------------------------------------------------------------
# FFI call.


def gemm(a, b, bias=None, c=None, *, trans_a=False, trans_b=False, barrier=True):
    """d = op(a) · op(b) (+ bias) (+ c) through the `jaxsub_gemm` target: a [M, K] ([K, M]
    with trans_a), b [K, N] ([N, K] with trans_b), bias [N] or None, c [M, N] or None
    (cuBLASLt's C operand: added in the epilogue, before the one rounding), one dtype;
    d [M, N]. `barrier=False` leaves out the optimization barrier of `_ffi.call`, so that
    XLA may write d straight into a dynamic-update-slice that is d's only user (a gradient
    written into a scan's gradient stack)."""
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    k = a.shape[0] if trans_a else a.shape[1]
    _ffi.gemm_tune(jnp.dtype(a.dtype).name, m, n, k, bool(trans_a), bool(trans_b), bias is not None,
                   c is not None, WORKSPACE_BYTES)
    bias = jnp.zeros((0,), a.dtype) if bias is None else bias
    c = jnp.zeros((0,), a.dtype) if c is None else c
    d, _ = _ffi.call(_TARGET, (jax.ShapeDtypeStruct((m, n), a.dtype),
                               jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)),
                     a, b, bias, c, rule=_rule(trans_a, trans_b), shard="m k n", trans_a=trans_a, trans_b=trans_b,
                     barrier=barrier)
    return d


def _rule(trans_a, trans_b):
    """The call's letters (jaxsub/_partition.py): a sliced k gives each device a partial
    product, summed over devices, to which only the first adds the bias and c."""
    return f"{'k m' if trans_a else 'm k'}, {'n k' if trans_b else 'k n'}, +n, +m n -> m n, !_"


# ---------------------------------------------------------------------------------------
# custom_vjp. x and the kernel keep their shapes as residuals (the views as [M, K] and
# [K, N] are taken inside): in a scan, a residual that is the body's own input (a weight
# sliced from the stack) or a value kept anyway (the attention output) is then the same
# array and is stored once, or not at all (jaxsub.stack.scan).


def _rows(x, kernel, axes):
    k = math.prod(kernel.shape[:axes])
    return x.reshape(-1, k), kernel.reshape(k, -1)


def _out_shape(x, kernel, axes):
    return (*x.shape[:x.ndim - axes], *kernel.shape[axes:])


def forward(x, kernel, bias, axes):
    """The product: x's last `axes` dims against kernel's first, bias (or None) in the
    epilogue. With `backward`, also the two halves of `projected.dense_attention_packed`'s
    fused path."""
    x2, k2 = _rows(x, kernel, axes)
    return gemm(x2, k2, None if bias is None else bias.reshape(-1)).reshape(_out_shape(x, kernel, axes))


def backward(axes, x, kernel, bias, dy, dx_other=None):
    """The gradients (dx, dkernel, dbias: None without a bias); dx_other (x's shape) is
    added into dx by its product."""
    x2, k2 = _rows(x, kernel, axes)
    d2 = dy.reshape(x2.shape[0], k2.shape[1])
    c = None if dx_other is None else dx_other.reshape(x2.shape)
    dx = gemm(d2, k2, None, c, trans_b=True, barrier=False).reshape(x.shape)
    dkernel = gemm(x2, d2, trans_a=True, barrier=False).reshape(kernel.shape)
    return dx, dkernel, (None if bias is None else _bias.bias_grad(dy, bias))


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(2,))
def _dense(x, kernel, axes):
    return forward(x, kernel, None, axes)


_dense.defvjp(lambda x, kernel, axes: (forward(x, kernel, None, axes), (x, kernel)),
              lambda axes, res, dy: backward(axes, *res, None, dy)[:2])
# Forward-mode differentiation (`_ffi.custom_vjp`): the reference, f32 products rounded once.
_dense.defreference(_OP, lambda x, kernel, axes: reference_dense(x, kernel, axes=axes))


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(3,))
def _dense_bias(x, kernel, bias, axes):
    return forward(x, kernel, bias, axes)


_dense_bias.defvjp(lambda x, kernel, bias, axes: (forward(x, kernel, bias, axes), (x, kernel, bias)),
                   lambda axes, res, dy: backward(axes, *res, dy))
_dense_bias.defreference(_OP, lambda x, kernel, bias, axes: reference_dense(x, kernel, bias, axes=axes))


# x returned as a second output: the cotangent of that output (x's other uses, summed) is
# added into dx by the dx product's epilogue (cuBLASLt's C operand), not by an XLA add
# kernel that reads both gradients and writes their sum (a post-LN layer's input feeds the
# q/k/v projection and the first residual: ~6.5 µs per BERT-large layer at b8 x s512 on
# an H200, bench/NOTES.md). bias may be None.
@functools.partial(_ffi.custom_vjp, nondiff_argnums=(3,))
def _dense_input(x, kernel, bias, axes):
    return forward(x, kernel, bias, axes), x


def _dense_input_bwd(axes, res, ct):
    dy, dx_other = ct
    return backward(axes, *res, dy, dx_other)


_dense_input.defvjp(lambda x, kernel, bias, axes: ((forward(x, kernel, bias, axes), x), (x, kernel, bias)),
                    _dense_input_bwd)
_dense_input.defreference(_OP, lambda x, kernel, bias, axes: (reference_dense(x, kernel, bias, axes=axes), x))


# ---------------------------------------------------------------------------------------
# Public function.


def check_inputs(x, kernel, bias, axes, op=_OP):
    """(x, kernel, bias) as arrays, or a clear error naming `op` (the public function
    checked: `dense`, or one built on its product) and the argument."""
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    kernel = kernel if isinstance(kernel, jax.Array) else jnp.asarray(kernel)
    if not isinstance(axes, int) or isinstance(axes, bool) or axes < 1:
        raise ValueError(f"jaxsub.{op}: `axes` must be a positive int, got {axes!r}")
    if x.ndim < axes:
        raise ValueError(f"jaxsub.{op}: `x` must have rank >= axes ({axes}), got shape {x.shape}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"jaxsub.{op}: `x` must be float32, bfloat16 or float16, got {x.dtype}")
    lead = x.shape[x.ndim - axes:]
    if kernel.ndim <= axes or kernel.shape[:axes] != lead:
        raise ValueError(f"jaxsub.{op}: `kernel` must have shape ({', '.join(map(str, lead))}, N...) "
                         f"(x's last {axes} dims, then at least one), got {kernel.shape}")
    if kernel.dtype != x.dtype:
        raise TypeError(f"jaxsub.{op}: `kernel` must have x's dtype ({x.dtype}), got {kernel.dtype}")
    if bias is not None:
        bias = bias if isinstance(bias, jax.Array) else jnp.asarray(bias)
        if bias.shape != kernel.shape[axes:]:
            raise ValueError(f"jaxsub.{op}: `bias` must have shape {kernel.shape[axes:]}, got {bias.shape}")
        if bias.dtype != x.dtype:
            raise TypeError(f"jaxsub.{op}: `bias` must have x's dtype ({x.dtype}), got {bias.dtype}")
    return x, kernel, bias


def in_place_pays(dtype) -> bool:
    """Whether callers that choose between this op and XLA's product (a scanned layer's
    projections) should take this op for `dtype`: for bf16/f16. The target multiplies f32
    in full f32, where XLA's default precision may use TF32 on the GPU, several times
    faster."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def supported(x, kernel) -> bool:
    """Whether `dense` runs its target for these operands (else the reference, logged)."""
    reason = _unsupported(x, kernel)
    if reason is not None:
        _ffi.fallback(_OP, reason)
    return reason is None


def _unsupported(x, kernel) -> str | None:
    if x.size == 0 or kernel.size == 0:
        return "zero-size input"
    return _ffi.target_unsupported(x, _TARGET)


def dense(x, kernel, bias=None, *, axes=1):
    """x @ kernel (+ bias), contracting x's last `axes` dims with kernel's first, through
    jaxsub's GEMM target.

    Args:
      x: [..., *K] with K the kernel's first `axes` dims; float32, bfloat16 or float16.
      kernel: [*K, *N], x's dtype (e.g. [E, 3, H, D] for a packed q/k/v projection, or
        [H, D, E] with axes=2 for the attention output projection).
      bias: None or [*N], x's dtype.
      axes: how many of x's trailing dims are contracted (static int >= 1).

    Returns:
      [..., *N] in x's dtype: products and sums in f32, the bias added in f32, one
      rounding (`reference_dense`'s values up to summation order; on GPU a bias that is
      not 16-byte aligned is added after the rounded product: ABI.md).

    On GPU the product is a cuBLASLt call of jaxsub's own (target `jaxsub_gemm`), which
    XLA runs in place on dynamic slices: use it where x, kernel or the gradients are slices
    of stacked arrays (a `lax.scan` over layers); elsewhere `x @ kernel` lets XLA choose
    and fuse its GEMM. The backward is two more such calls and `bias_grad`'s column sum;
    x and the kernel are its residuals as given. Composes with jit, grad, vjp and vmap
    (sequentially over the mapped axis). A zero-size operand, or a platform without the
    target, uses the reference (with a one-time log line).
    """
    x, kernel, bias = check_inputs(x, kernel, bias, axes)
    if not supported(x, kernel):
        return reference_dense(x, kernel, bias, axes=axes)
    return _dense(x, kernel, axes) if bias is None else _dense_bias(x, kernel, bias, axes)


def dense_and_input(x, kernel, bias=None, *, axes=1):
    """(dense(x, kernel, bias, axes=axes), x): x handed on for its other uses, so that
    their gradient is added into dx by the backward's dx product (in its epilogue, one
    rounding) instead of by an add of XLA's after it. Internal to jaxsub's layers (a
    post-LN layer's input feeds the q/k/v projection and the first residual); the
    reference where `dense` would use it."""
    x, kernel, bias = check_inputs(x, kernel, bias, axes)
    if not supported(x, kernel):
        return reference_dense(x, kernel, bias, axes=axes), x
    return _dense_input(x, kernel, bias, axes)
