"""Self-attention fused with the q/k/v projection that computes its input.

`attention_projected` is self-attention on x's own three projections q = x·W_q + b_q, ...
(Flax's three DenseGenerals). Its fused path computes the three products apart, so that
each bias rides in its GEMM's epilogue, and its backward (`jaxsub_attention_bwd_dqkv`)
writes dq, dk, dv into one [B, S, 3, H, D] array, so that the input and weight gradients
are one product each, as for `attention_packed`.

`dense_attention_packed` is self-attention on one packed projection x·W + b, [B, S, 3, H,
D], by jaxsub's GEMM target (`ops.dense`, as a scanned layer runs its projections). Its
fused path is one custom_vjp over the product and the packed attention.

On their fused paths both take the projection's bias gradient from the attention's
backward, which returns the column sums of dq, dk and dv with them (the targets' dbias
result, cuda/ABI.md): no column sum reads the [B, S, 3, H, D] gradient again. Their other
paths are `attention_packed` on the product. Both run through `attn._attention`, as the
`source` of q, k and v there: the same implementation choice, masks, dropout and checks.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi
from jaxsub.ops import attn as _attn
from jaxsub.ops import attn_calls as _calls
from jaxsub.ops import bias as _bias
from jaxsub.ops import gemm as _gemm
from jaxsub.ops import masks as _masks


# ---------------------------------------------------------------------------------------
# custom_vjp for the fused paths (the seed a primal without a cotangent, an additive mask
# with one where the program differentiates it, the rest static, as in attn.py).


def _projections(x, weights, biases):
    """q, k, v = x·W_i (+ b_i), each product in x's dtype. The optimization barriers keep
    XLA's dot merger from joining the three products (they share x) into one, whose bias
    would then be a computed [3, H, D] array added by a kernel of its own; apart, each
    bias is added in its GEMM's epilogue (bench/NOTES.md, seventeenth session)."""
    outs = []
    for i, w in enumerate(weights):
        xi, wi = (x, w) if i == 0 else jax.lax.optimization_barrier((x, w))
        y = jax.lax.dot_general(xi, wi, (((2,), (0,)), ((), ())))
        outs.append(y if biases is None else y + biases[i])
    return outs


def _stacked_projection(x, weights, biases):
    """The three projections as one [B, S, 3, H, D] product (the paths that read q, k, v
    from one array): the weights stacked, the bias gradient by the fused column sum."""
    qkv = jax.lax.dot_general(x, jnp.stack(weights, axis=1), (((2,), (0,)), ((), ())))
    return qkv if biases is None else _bias.bias_add(qkv, jnp.stack(biases))


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _fused_projected(x, weights, biases, mask4d, seed, scale, causal, kind, rate, bcast):
    q, k, v = _projections(x, weights, biases)
    return _calls.fwd_call(q, k, v, mask4d, seed, scale, causal, kind, rate, bcast)[0]


def _fused_projected_fwd(x, weights, biases, mask4d, seed, scale, causal, kind, rate, bcast):
    grad_mask = _masks.differentiated(kind, mask4d)
    x, weights, biases, mask4d, seed = _masks.primals(x, weights, biases, mask4d, seed)
    if grad_mask:
        return _masks.switched("attention_projected", lambda x, w, b, m: _attn.unfused_source(
            _Projected(x, w, b), m, seed, kind, causal, scale, rate, op="attention_projected", bcast=bcast),
            x, weights, biases, mask4d)
    q, k, v = _projections(x, weights, biases)
    out, lse = _calls.fwd_call(q, k, v, mask4d, seed, scale, causal, kind, rate, bcast)
    return out, (x, weights, biases, q, k, v, out, lse, mask4d, seed)


def _fused_projected_bwd(scale, causal, kind, rate, bcast, res, dout):
    dout = _masks.cotangent(dout)
    if isinstance(res, _masks.Switched):
        return res.backward(dout)
    x, weights, biases, q, k, v, out, lse, mask4d, seed = res
    # The bias gradient: dqkv's column sums, taken by the backward itself.
    got = _calls.bwd_dqkv_call(dout, q, k, v, out, lse, mask4d, seed, scale, causal, kind, rate, bcast,
                               bias_grad=biases is not None)
    dqkv, db = got if biases is not None else (got, None)
    # The stacked product's gradients: one GEMM for dx, one for the three weights.
    dx = jax.lax.dot_general(dqkv, jnp.stack(weights, axis=1), (((2, 3, 4), (1, 2, 3)), ((), ())))
    dw = jax.lax.dot_general(x, dqkv, (((0, 1), (0, 1)), ((), ())))
    dws = tuple(dw[:, i] for i in range(3))  # x, the weights and the biases share one dtype
    dbs = None if db is None else tuple(db[i] for i in range(3))
    return dx, dws, dbs, None, None


_fused_projected.defvjp(_fused_projected_fwd, _fused_projected_bwd, symbolic_zeros=True)
# Forward-mode differentiation (`_ffi.custom_vjp`): the unfused structure, as for an additive
# mask's gradient above.
_fused_projected.defreference("attention_projected", lambda x, weights, biases, mask4d, seed, scale, causal, kind,
                              rate, bcast: _attn.unfused_source(_Projected(x, weights, biases), mask4d, seed, kind,
                                                                causal, scale, rate, op="attention_projected",
                                                                bcast=bcast))


# dense_attention_packed's fused path: the packed product by jaxsub's GEMM target, its bias
# in the epilogue, and the packed attention on it, as one custom_vjp, so that the
# attention's backward hands on dqkv's column sums, which are the bias gradient: no column
# sum reads dqkv again. `shared`: x is also returned, and the cotangent of that output
# (x's other uses) is added into dx by the dx product (ops.gemm.dense_and_input).
# `bias` is one [3, H, D] array or, for three separate parameters (a Flax layer's biases),
# a tuple of three [H, D]: the forward stacks them for the GEMM's epilogue and the backward
# gets their gradients as three results of the attention's backward (bias_grad "split"),
# not as slices of one, which XLA would copy out one kernel each.
# `three` (static) says which form `bias` has, so that the backward returns its gradient in
# that form without keeping the bias as a residual.
@functools.partial(_ffi.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11, 12))
def _fused_dense(x, kernel, bias, mask4d, seed, axes, shared, scale, causal, kind, rate, bcast, three):
    return _dense_attention(x, kernel, bias, mask4d, seed, axes, shared, scale, causal, kind, rate, bcast)[0]


def _dense_attention(x, kernel, bias, mask4d, seed, axes, shared, scale, causal, kind, rate, bcast):
    qkv = _gemm.forward(x, kernel, _stacked(bias), axes)
    out, lse = _calls.fwd_packed_call(qkv, 2, mask4d, seed, scale, causal, kind, rate, bcast)
    return ((out, x) if shared else out), (x, kernel, qkv, out, lse, mask4d, seed)


def _fused_dense_fwd(x, kernel, bias, mask4d, seed, axes, shared, scale, causal, kind, rate, bcast, three):
    grad_mask = _masks.differentiated(kind, mask4d)
    x, kernel, bias, mask4d, seed = _masks.primals(x, kernel, bias, mask4d, seed)
    if grad_mask:
        return _masks.switched("dense_attention_packed", lambda x, w, b, m: _attn.unfused_source(
            _DensePacked(x, w, b, axes, shared), m, seed, kind, causal, scale, rate, op="dense_attention_packed",
            bcast=bcast), x, kernel, bias, mask4d)
    return _dense_attention(x, kernel, bias, mask4d, seed, axes, shared, scale, causal, kind, rate, bcast)


def _fused_dense_bwd(axes, shared, scale, causal, kind, rate, bcast, three, res, ct):
    if isinstance(res, _masks.Switched):
        return res.backward(_masks.cotangent(ct))
    x, kernel, qkv, out, lse, mask4d, seed = res
    dout, dx_other = _masks.cotangent(ct) if shared else (_masks.cotangent(ct), None)
    dqkv, db = _calls.bwd_packed_call(dout, qkv, 2, out, lse, mask4d, seed, scale, causal, kind, rate, bcast,
                                      bias_grad="split" if three else True)
    dx, dkernel, _ = _gemm.backward(axes, x, kernel, None, dqkv, dx_other)
    return dx, dkernel, db, None, None


def _stacked(bias):
    """A [3, H, D] bias as it is, three [H, D] ones stacked."""
    return jnp.stack(bias) if isinstance(bias, tuple) else bias


_fused_dense.defvjp(_fused_dense_fwd, _fused_dense_bwd, symbolic_zeros=True)
_fused_dense.defreference("dense_attention_packed", lambda x, kernel, bias, mask4d, seed, axes, shared, scale, causal,
                          kind, rate, bcast, three: _attn.unfused_source(
                              _DensePacked(x, kernel, bias, axes, shared), mask4d, seed, kind, causal, scale, rate,
                              op="dense_attention_packed", bcast=bcast))


# ---------------------------------------------------------------------------------------
# Public functions.


def _check_sequence(op, name, group):
    if not isinstance(group, (tuple, list)) or len(group) != 3:
        length = f" of length {len(group)}" if isinstance(group, (tuple, list)) else ""
        raise TypeError(f"jaxsub.{op}: `{name}` must be a sequence of three arrays (for q, k and v), "
                        f"got {type(group).__name__}{length}")


def _check_three(op, name, group, shape, what, dtype):
    """Three arrays (for q, k and v) of `shape` and `dtype`, or a clear error."""
    _check_sequence(op, name, group)
    for i, a in enumerate(group):
        if a is None:
            raise TypeError(f"jaxsub.{op}: `{name}[{i}]` is None; pass three arrays (or {name}=None for none)")
    arrays = tuple(a if isinstance(a, jax.Array) else jnp.asarray(a) for a in group)
    for i, a in enumerate(arrays):
        if a.shape != shape:
            raise ValueError(f"jaxsub.{op}: `{name}[{i}]` must be {what} {shape}, got shape {a.shape}")
        if a.dtype != dtype:
            raise TypeError(f"jaxsub.{op}: `{name}[{i}]` must have x's dtype ({dtype}), got {a.dtype}")
    return arrays


def _check_projected(x, weights, biases):
    op = "attention_projected"
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"jaxsub.{op}: `x` must have rank 3 [B, S, E], got shape {x.shape}")
    if x.dtype not in _attn._DTYPES:
        raise TypeError(f"jaxsub.{op}: `x` must be float32, bfloat16 or float16, got {x.dtype}")
    _check_sequence(op, "weights", weights)
    first_shape = np.shape(weights[0])
    if len(first_shape) != 3 or first_shape[0] != x.shape[2]:
        raise ValueError(f"jaxsub.{op}: `weights[0]` must be [E, H, D] with E = x's last dim ({x.shape[2]}), "
                         f"got shape {first_shape}")
    weights = _check_three(op, "weights", weights, tuple(first_shape), "[E, H, D] like weights[0]:", x.dtype)
    if biases is not None:
        biases = _check_three(op, "biases", biases, weights[0].shape[1:], "[H, D], the weights' last two dims,",
                              x.dtype)
    return x, weights, biases


@dataclasses.dataclass(frozen=True)
class _Projected:
    """q, k, v as x's projections (attention_projected): a source for attn._attention."""
    x: jax.Array
    weights: tuple
    biases: tuple | None

    @property
    def data(self):
        return self.weights[0]

    def fused(self, mask4d, seed, scale, causal, kind, rate, bcast):
        return _fused_projected(self.x, self.weights, self.biases, mask4d, seed, scale, causal, kind, rate, bcast)

    def product(self):
        return _stacked_projection(self.x, self.weights, self.biases), 2, None

    def result(self, out, extra=None):
        return out


def attention_projected(x, weights, biases=None, *, mask=None, causal=False, scale=None, dropout_rate=0.0,
                        key=None, implementation=None, broadcast_dropout=False):
    """Self-attention on three projections of one input.

    The same function as ``attention(x·W_q + b_q, x·W_k + b_k, x·W_v + b_v, ...)`` (each
    product ``einsum("bse,ehd->bshd")`` in x's dtype, then its bias added), the same
    dropout masks and the same `implementation` choice, with gradients for x, the weights
    and the biases. This is the form of Flax's attention modules (three DenseGenerals),
    into which `jaxsub.optimize` rewrites them. The fused path computes the three products
    apart, so that on the GPU each bias is added in its GEMM's epilogue, and its backward
    writes dq, dk and dv into one [B, S, 3, H, D] array, so that the gradients of x and of
    the three weights are one product each. The other paths stack the weights and run
    `attention_packed` on the one product.

    Args:
      x: [B, S, E]; float32, bfloat16 or float16.
      weights: three arrays (W_q, W_k, W_v), each [E, H, D], x's dtype.
      biases: None, or three arrays (b_q, b_k, b_v), each [H, D], x's dtype.
      mask, causal, scale, dropout_rate, key, implementation, broadcast_dropout: as in
        `attention` (Sq = Sk = S).

    Returns:
      [B, S, H, D] in x's dtype.
    """
    x, weights, biases = _check_projected(x, weights, biases)
    like = jax.ShapeDtypeStruct((*x.shape[:2], *weights[0].shape[1:]), x.dtype)  # q's, k's and v's shape
    return _attn._attention("attention_projected", like, like, like, _Projected(x, weights, biases), mask, causal,
                            scale, dropout_rate, key, implementation, broadcast_dropout)


@dataclasses.dataclass(frozen=True)
class _DensePacked:
    """qkv = x·kernel + bias, [B, S, 3, H, D], by ops.dense (dense_attention_packed): a
    source for attn._attention; with `shared`, x is handed on too (ops.gemm.dense_and_input)."""
    x: jax.Array
    kernel: jax.Array
    bias: jax.Array | tuple  # [3, H, D], or three [H, D] (q, k, v)
    axes: int
    shared: bool

    @property
    def data(self):
        return self.kernel

    def fused(self, mask4d, seed, scale, causal, kind, rate, bcast):
        return _fused_dense(self.x, self.kernel, self.bias, mask4d, seed, self.axes, self.shared, scale, causal, kind,
                            rate, bcast, isinstance(self.bias, tuple))

    def product(self):
        """(qkv, its axis, x handed on or None) for the paths that attend to qkv itself."""
        if self.shared:
            qkv, again = _gemm.dense_and_input(self.x, self.kernel, _stacked(self.bias), axes=self.axes)
            return qkv, 2, again
        return _gemm.dense(self.x, self.kernel, _stacked(self.bias), axes=self.axes), 2, None

    def result(self, out, again=None):
        return (out, self.x if again is None else again) if self.shared else out


def dense_attention_packed(x, kernel, bias, *, axes=1, with_input=False, mask=None, causal=False, scale=None,
                           dropout_rate=0.0, key=None, implementation=None, broadcast_dropout=False):
    """``attention_packed(ops.dense(x, kernel, bias, axes=axes), axis=2, ...)``: self-attention
    on one packed q/k/v projection with a bias (a post-LN layer's first two stages).

    The same values, gradients, dropout masks and `implementation` choice as those two ops.
    On the fused path both run as one custom_vjp, whose attention backward also returns the
    column sums of dq, dk and dv: those are the bias gradient, which the product's backward
    would otherwise take by a column sum over the whole [B, S, 3, H, D] gradient.

    Args:
      x: [B, S, *K]; float32, bfloat16 or float16.
      kernel: [*K, 3, H, D] (K the `axes` dims contracted), x's dtype.
      bias: [3, H, D], x's dtype; or three [H, D] arrays (q's, k's and v's, separate
        parameters as in a Flax layer), whose gradients the fused path's backward writes
        as three results, where slices of one [3, H, D] gradient would be three copies.
      axes: how many of x's trailing dims are contracted (static int >= 1).
      with_input: also return x, as `ops.gemm.dense_and_input` does, so that the gradient of
        x's other uses is added into dx by the dx product.
      mask, causal, scale, dropout_rate, key, implementation, broadcast_dropout: as in
        `attention`.

    Returns:
      [B, S, H, D] in x's dtype; with `with_input`, (that, x).
    """
    op = "dense_attention_packed"
    three = isinstance(bias, (tuple, list))
    x, kernel, _ = _gemm.check_inputs(x, kernel, None, axes, op=op)
    # The shapes first, so that a kernel without its q/k/v axis of 3 is named as such
    # rather than as a bias that does not fit it.
    if x.ndim - axes != 2 or kernel.ndim - axes != 3 or kernel.shape[axes] != 3:
        raise ValueError(f"jaxsub.{op}: `x` must be [B, S, *K] and `kernel` [*K, 3, H, D] with K {axes} dims "
                         f"(axes), got shapes {x.shape} and {kernel.shape}")
    if not three:
        _, _, bias = _gemm.check_inputs(x, kernel, bias, axes, op=op)
    if bias is None:
        raise TypeError(f"jaxsub.{op}: `bias` must be an array [3, H, D] or three [H, D], got None")
    if three:
        bias = _check_three(op, "bias", bias, tuple(kernel.shape[axes + 1:]), "[H, D], the kernel's last two dims,",
                            x.dtype)
    if not isinstance(with_input, (bool, np.bool_)):
        raise TypeError(f"jaxsub.{op}: `with_input` must be a Python bool, got {with_input!r}")
    packed = _DensePacked(x, kernel, bias, axes, bool(with_input))
    if os.environ.get("JAXSUB_QKV_BIAS_FROM_ATTENTION") == "0":  # the two ops apart (for comparisons)
        qkv, _, again = packed.product()
        return packed.result(_attn.attention_packed(qkv, axis=2, mask=mask, causal=causal, scale=scale,
                                                    dropout_rate=dropout_rate, key=key, implementation=implementation,
                                                    broadcast_dropout=broadcast_dropout), again)
    if not _gemm.supported(x, kernel):
        y = _gemm.reference_dense(x, kernel, _stacked(bias), axes=axes)
        return packed.result(_attn.attention_packed(y, axis=2, mask=mask, causal=causal, scale=scale,
                                                    dropout_rate=dropout_rate, key=key, implementation=implementation,
                                                    broadcast_dropout=broadcast_dropout))
    like = jax.ShapeDtypeStruct((*x.shape[:2], *kernel.shape[axes + 1:]), x.dtype)  # q's, k's and v's shape
    return _attn._attention(op, like, like, like, packed, mask, causal, scale, dropout_rate, key, implementation,
                            broadcast_dropout)
