"""Scaled, masked softmax + dropout over the last axis, fused (paper: SM forward, BS backward).

The attention probabilities of a transformer: y = dropout(softmax(scale * scores + mask)).
The fused kernels read the scores once and write the probabilities once; forward saves
only the log-sum-exp of each row (f32) besides the input, and backward recomputes the
probabilities from scores and lse and regenerates the dropout mask from the seed.

Layout of this module: reference, ffi_call wrappers, custom_vjp, public function.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi
from jaxsub.ops import dropout as _dropout
from jaxsub.ops import masks as _masks

_OP = "softmax_dropout"
_F32 = jnp.dtype(jnp.float32)
_DTYPES = (_F32, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---------------------------------------------------------------------------------------
# Reference: fp32 compute, output in scores.dtype. The test oracle and the fallback.


def reference_softmax_dropout(scores, *, scale=1.0, mask=None, causal=False, keep=None, rate=0.0):
    """Pure-JAX softmax(scale * scores (+ mask)) over the last axis, then dropout.

    `mask` broadcasts to scores: boolean (True = attend) or additive (floating, added to
    the scaled scores). `causal` hides keys j > i + (Sk - Sq). A row with no visible key
    gives zeros (and zero gradients). `keep` is the boolean keep-mask of scores' shape
    (None = no dropout); kept values are scaled by 1 / (1 - rate).
    """
    s = scores.astype(_F32) * jnp.float32(scale)
    visible = None
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype == jnp.bool_:
            visible = mask
        else:
            s = s + mask.astype(_F32)
    if causal:
        c = _masks.causal_visible(*scores.shape[-2:])
        visible = c if visible is None else visible & c
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    # Safe max and denominator: a fully masked row has max -inf and sum 0, and must give
    # zeros without a NaN in either pass. The max only shifts, so it carries no gradient.
    # A NaN or +inf score makes the row NaN, as jax.nn.softmax does.
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf))
    e = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total == 0.0, 1.0, total)
    return _dropout.apply_reference(p, keep, rate).astype(scores.dtype)


# ---------------------------------------------------------------------------------------
# ffi_call wrappers, argument for argument as cuda/ABI.md lists them. scores: [B, H, Sq, Sk].


def _fwd_call(scores, mask, seed, scale, causal, kind, rate):
    return _ffi.call(
        "jaxsub_softmax_dropout_fwd",
        (jax.ShapeDtypeStruct(scores.shape, scores.dtype), jax.ShapeDtypeStruct(scores.shape[:-1], _F32)),
        scores, mask, seed, rule="b h q k, b h q k, @ -> b h q k, b h q", shard="b h",
        keep=_dropout.keep(rate, "b h q k"),
        **_masks.attrs(scale, causal, kind, rate))


def _bwd_call(dy, scores, lse, mask, seed, scale, causal, kind, rate):
    return _ffi.call(
        "jaxsub_softmax_dropout_bwd", jax.ShapeDtypeStruct(scores.shape, scores.dtype),
        dy, scores, lse, mask, seed, rule="b h q k, b h q k, b h q, b h q k, @ -> b h q k",
        shard="b h", keep=_dropout.keep(rate, "b h q k"), **_masks.attrs(scale, causal, kind, rate))


# ---------------------------------------------------------------------------------------
# custom_vjp. The mask and the seed are primals so that they may be traced (jit, vmap over
# masks or keys); the seed gets no cotangent, an additive mask one only where the program
# differentiates it (masks.py: symbolic zeros). scale, causal, mask kind and rate are
# static.


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(scores, mask, seed, scale, causal, kind, rate):
    return _fwd_call(scores, mask, seed, scale, causal, kind, rate)[0]


def _fused_fwd(scores, mask, seed, scale, causal, kind, rate):
    grad_mask = _masks.differentiated(kind, mask)
    scores, mask, seed = _masks.primals(scores, mask, seed)
    y, lse = _fwd_call(scores, mask, seed, scale, causal, kind, rate)
    # The mask again where it is differentiated, else None: the residuals' structure tells
    # the backward rule (a Python bool among them would be an array there).
    return y, (scores, lse, mask, seed, mask if grad_mask else None)


def _fused_bwd(scale, causal, kind, rate, res, dy):
    scores, lse, mask, seed, grad_mask = res
    dy = _masks.cotangent(dy)
    dscores = _bwd_call(dy, scores, lse, mask, seed, scale, causal, kind, rate)
    dmask = None
    if grad_mask is not None and _mask_grad_from_scores(scores.dtype, scale):
        dmask = _masks.reduce_to(dscores.astype(_F32) / np.float32(scale), mask.shape)
    elif grad_mask is not None:
        dmask = _masks.mask_cotangent(_OP, scores.astype(_F32) * np.float32(scale) + mask, lse, dy.astype(_F32), seed,
                                      rate, causal, mask.shape)
    return dscores, dmask, None


def _mask_grad_from_scores(dtype, scale: float) -> bool:
    """Whether an additive mask's cotangent is taken from the scores' cotangent, which is
    scale · dS (dS the cotangent of scale · scores + mask) rounded to the scores' dtype:
    not at scale 0, nor for float16 below scale 1/16, where scale · dS would lose to
    float16's range what dS has. Elsewhere XLA computes dS again (`masks.mask_cotangent`)."""
    return scale != 0.0 and (jnp.dtype(dtype) != jnp.float16 or abs(scale) >= 0.0625)


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def _fused_reference(scores, mask, seed, scale, causal, kind, rate):
    """_fused in jnp (forward-mode differentiation: `_ffi.custom_vjp`), the kernel's mask."""
    keep = _dropout.seed_mask(seed, scores.shape, rate) if rate > 0.0 else None
    return reference_softmax_dropout(scores, scale=scale, mask=None if kind == _masks.NONE else mask, causal=causal,
                                     keep=keep, rate=rate)


_fused.defreference(_OP, _fused_reference)


# ---------------------------------------------------------------------------------------
# Public function.


def _check_scores(scores):
    scores = scores if isinstance(scores, jax.Array) else jnp.asarray(scores)
    if scores.ndim < 2:
        raise ValueError(f"jaxsub.{_OP}: `scores` must have rank >= 2 [..., Sq, Sk], got shape {scores.shape}")
    if scores.dtype not in _DTYPES:
        raise TypeError(f"jaxsub.{_OP}: `scores` must be float32, bfloat16 or float16, got {scores.dtype}")
    return scores


def softmax_dropout(scores, *, scale=1.0, mask=None, causal=False, rate=0.0, key=None):
    """dropout(softmax(scale * scores (+ mask))) over the last axis, fused.

    Args:
      scores: [..., Sq, Sk] (rank >= 2), float32, bfloat16 or float16; for attention
        [B, H, Sq, Sk].
      scale: static finite Python number multiplying the scores before the mask.
      mask: None, or an array broadcastable to scores: boolean (True = attend) or
        floating (additive, added to the scaled scores in f32). An additive mask that the
        program differentiates (a learned bias) gets its gradient: the backward kernel's
        scores cotangent, scale · dS, divided by scale and summed over the mask's
        broadcast dims (at scale 0, and for float16 below scale 1/16, XLA computes dS
        again, [B, H, Sq, Sk] f32, with a one-time log line). A row whose mask values are
        all below -256 is shifted up by its maximum (the same softmax: `masks._near`);
        with `causal`, each query's row whose visible keys' values are all below -256 (by
        their maximum; a mask broadcast over the queries is then expanded to a row per
        query, only where some query needs it: `masks.by_query`).
      causal: query i sees keys j <= i + (Sk - Sq), i.e. bottom-right aligned, so with
        Sq < Sk the last query sees every key (decoding with a cache). Combines with mask.
      rate: dropout probability, a static float in [0, 1).
      key: a JAX PRNG key (typed or raw), required when rate > 0; it may be traced.

    Returns:
      The probabilities after dropout, of scores' shape and dtype. Softmax is computed in
      f32 and rounded once. A row with no visible key is all zeros, with zero gradient.

    Dropout is generated in the kernel with Philox4x32-10 from a seed derived from `key`:
    scores is viewed as [B, H, Sq, Sk] with H = scores.shape[-3] (1 for rank 2) and B the
    product of the dims before it, and element (b, h, i, j) is kept by its row-major index
    ((b * H + h) * Sq + i) * Sk + j, as in fused attention. For 4-D scores
    `jaxsub.ops.dropout_mask(key, scores.shape, rate)` returns exactly the keep-mask used
    (for other ranks, that of shape (B, H, Sq, Sk) reshaped to scores.shape), so
    `reference_softmax_dropout(scores, ..., keep=mask, rate=rate)` reproduces the result.
    Backward recomputes the probabilities from the scores and the saved per-row
    log-sum-exp and regenerates the mask; nothing else is stored.
    """
    scores = _check_scores(scores)
    scale = _masks.check_scale(_OP, scale)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"jaxsub.{_OP}: `causal` must be a Python bool, got {causal!r}")
    causal = bool(causal)
    rate = _dropout.check_rate(_OP, rate)
    *leading, sq, sk = scores.shape
    b, h = math.prod(leading[:-1]), (leading[-1] if leading else 1)
    mask4, kind = _masks.normalize(_OP, mask, tuple(leading), sq, sk, key_padding_ok=False, causal=causal)
    seed = _dropout.seed_from_key(_OP, key) if rate > 0.0 else _dropout.NO_SEED
    scores4 = scores.reshape(b, h, sq, sk)
    out = _masks.by_query(mask4, kind, sq, sk, causal,
                          lambda m: softmax_4d(scores4, m, seed, scale, causal, kind, rate), scores4)
    return out.reshape(scores.shape)


def softmax_4d(scores, mask4d, seed, scale, causal, kind, rate, op=_OP):
    """`softmax_dropout` after its checks: scores [B, H, Sq, Sk], the mask as
    `masks.normalize` returns it, the seed words (`dropout.seed_from_key`; NO_SEED when
    rate is 0). The unfused attention's middle step (`op`: the public function called,
    for the fallback's log line)."""
    if scores.shape[-1] > _ffi.MAX_COLS or scores.size == 0:
        _ffi.fallback(op, "zero-size input" if scores.size == 0
                      else f"last dimension {scores.shape[-1]} > {_ffi.MAX_COLS}")
        keep = _dropout.seed_mask(seed, scores.shape, rate) if rate > 0.0 and scores.size else None
        return reference_softmax_dropout(scores, scale=scale, mask=None if kind == _masks.NONE else mask4d,
                                         causal=causal, keep=keep, rate=rate)
    return _fused(scores, jnp.asarray(mask4d), jnp.asarray(seed), scale, causal, kind, rate)
