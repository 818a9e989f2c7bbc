"""The attention family's ffi_call wrappers (`ops.attn`, `ops.projected`), argument for
argument as cuda/ABI.md lists them, with the partitioning rules' letters
(jaxsub/_partition.py). q, k, v: [B, S, H, D] (k and v [B, Sk, H_kv, D]); a packed qkv
array has the 3 on axis 0 or 2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi
from jaxsub.ops import dropout as _dropout
from jaxsub.ops import masks as _masks

_F32 = jnp.dtype(jnp.float32)


def packed_dims(shape, axis):
    """(B, S, H, D) of a packed qkv array with the 3 on `axis` (0 or 2)."""
    return (shape[0], shape[1], shape[3], shape[4]) if axis == 2 else (shape[1], shape[2], shape[3], shape[4])


def kv_heads(q, k) -> str:
    """The partitioning rules' letter for k and v's heads: q's (h), or under grouped-query
    attention a dimension sliced as q's heads are (h~: each device's q heads read its own
    k/v heads; jaxsub/_partition.py)."""
    return "h" if k.shape[2] == q.shape[2] else "h~"


def _keep(rate, bcast, letters):
    """The calls' `keep` (jaxsub/_partition.py): "b h q k"'s letters, or without the batch
    and head letters under broadcast dropout (b and h then slice with no seed offset)."""
    return _dropout.keep(rate, " ".join(letters.split()[2:]) if bcast else letters)


def attrs(scale, causal, kind, rate, bcast):
    """The attributes every attention target takes (cuda/ABI.md)."""
    return dict(**_masks.attrs(scale, causal, kind, rate), dropout_bcast=bool(bcast))


def fwd_call(q, k, v, mask4d, seed, scale, causal, kind, rate, bcast):
    b, sq, h, _ = q.shape
    g = kv_heads(q, k)
    return _ffi.call(
        "jaxsub_attention_fwd",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), _F32)),
        q, k, v, mask4d, seed,
        rule=f"b q h d, b k {g} d, b k {g} e, b h q k, @ -> b q h e, b h q", shard="b h",
        keep=_keep(rate, bcast, "b h q k"),
        **attrs(scale, causal, kind, rate, bcast),
    )


def bwd_call(dout, q, k, v, out, lse, mask4d, seed, scale, causal, kind, rate, bcast):
    b, sq, h, _ = q.shape
    g = kv_heads(q, k)
    dq, dk, dv, _, _ = _ffi.call(
        "jaxsub_attention_bwd",
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((b, h, sq), _F32),
            jax.ShapeDtypeStruct(q.shape, _F32),
        ),
        dout, q, k, v, out, lse, mask4d, seed,
        rule=f"b q h e, b q h d, b k {g} d, b k {g} e, b q h e, b h q, b h q k, @ "
             f"-> b q h d, b k {g} d, b k {g} e, !b h q, !b q h d",
        shard="b h", keep=_keep(rate, bcast, "b h q k"), **attrs(scale, causal, kind, rate, bcast),
    )
    return dq, dk, dv


def _dbias(bias_grad, b, s, h, d, dtype):
    """The packed backward targets' dbias result and its workspace: dtype[3, H, D] (the column
    sums of dq, dk and dv, the q/k/v projection's bias gradient) and f32[B * ceil(S / 16), 3,
    H, D] (the GPU's row partials), or dtype[0] and f32[0] (none); with bias_grad "split"
    (attention_qkv_bwd only), dtype[H, D], q's part, whose k and v parts are two more
    results at the end (`_dbias_kv`)."""
    if not bias_grad:
        return jax.ShapeDtypeStruct((0,), dtype), jax.ShapeDtypeStruct((0,), _F32)
    return (jax.ShapeDtypeStruct((h, d) if bias_grad == "split" else (3, h, d), dtype),
            jax.ShapeDtypeStruct((b * -(-s // 16), 3, h, d), _F32))


# The dbias result (a sum over b and s: summed over devices where b is sliced) and its GPU
# workspace, whose rows are b * ceil(S / 16): as many fewer per device as b's slices.
def _dbias_rule(bias_grad):
    return ("h d" if bias_grad == "split" else "_ h d") + ", !b~ _ h d"


def _packed_rule(axis):
    """The letters of a packed qkv array with the 3 on `axis` (0 or 2)."""
    return "b s _ h d" if axis == 2 else "_ b s h d"


def _dbias_kv(bias_grad, h, d, dtype):
    """attention_qkv_bwd's remaining results: the k and v bias gradients dtype[H, D] with
    bias_grad "split", so that three separate parameters get theirs without slicing one
    [3, H, D] result (each slice a copy kernel on the GPU); else none."""
    return (jax.ShapeDtypeStruct((h, d), dtype),) * 2 if bias_grad == "split" else ()


def bwd_dqkv_call(dout, q, k, v, out, lse, mask4d, seed, scale, causal, kind, rate, bcast, bias_grad=False):
    b, s, h, d = q.shape
    dqkv, dbias, _, _, _ = _ffi.call(
        "jaxsub_attention_bwd_dqkv",
        (
            jax.ShapeDtypeStruct((b, s, 3, h, d), q.dtype),
            *_dbias(bias_grad, b, s, h, d, q.dtype),
            jax.ShapeDtypeStruct((b, h, s), _F32),
            jax.ShapeDtypeStruct(q.shape, _F32),
        ),
        dout, q, k, v, out, lse, mask4d, seed,
        rule=f"b s h d, b s h d, b s h d, b s h d, b s h d, b h s, b h q k, @ "
             f"-> b s _ h d, {_dbias_rule(bias_grad)}, !b h s, !b s h d",
        shard="b h", keep=_keep(rate, bcast, "b h s s"), **attrs(scale, causal, kind, rate, bcast),
    )
    return (dqkv, dbias) if bias_grad else dqkv


def fwd_packed_call(qkv, axis, mask4d, seed, scale, causal, kind, rate, bcast):
    b, s, h, d = packed_dims(qkv.shape, axis)
    return _ffi.call(
        "jaxsub_attention_qkv_fwd",
        (jax.ShapeDtypeStruct((b, s, h, d), qkv.dtype), jax.ShapeDtypeStruct((b, h, s), _F32)),
        qkv, mask4d, seed,
        rule=f"{_packed_rule(axis)}, b h q k, @ -> b s h d, b h s", shard="b h",
        keep=_keep(rate, bcast, "b h s s"),
        qkv_axis=np.int32(axis), **attrs(scale, causal, kind, rate, bcast),
    )


def bwd_packed_call(dout, qkv, axis, out, lse, mask4d, seed, scale, causal, kind, rate, bcast, bias_grad=False):
    """dqkv, and with bias_grad the bias gradient: one [3, H, D] array, or with "split" the
    three [H, D] arrays (q, k, v)."""
    b, s, h, d = packed_dims(qkv.shape, axis)
    dqkv, dbias, _, _, _, *dbias_kv = _ffi.call(
        "jaxsub_attention_qkv_bwd",
        (
            jax.ShapeDtypeStruct(qkv.shape, qkv.dtype),
            *_dbias(bias_grad, b, s, h, d, qkv.dtype),
            jax.ShapeDtypeStruct((b, h, s), _F32),
            jax.ShapeDtypeStruct((b, s, h, d), _F32),
            *_dbias_kv(bias_grad, h, d, qkv.dtype),
        ),
        dout, qkv, out, lse, mask4d, seed,
        rule=f"b s h d, {_packed_rule(axis)}, b s h d, b h s, b h q k, @ "
             f"-> {_packed_rule(axis)}, {_dbias_rule(bias_grad)}, !b h s, !b s h d"
             f"{', h d, h d' if bias_grad == 'split' else ''}",
        shard="b h", keep=_keep(rate, bcast, "b h s s"), qkv_axis=np.int32(axis),
        **attrs(scale, causal, kind, rate, bcast),
    )
    if bias_grad == "split":
        dbias = (dbias, *dbias_kv)
    return (dqkv, dbias) if bias_grad else dqkv
