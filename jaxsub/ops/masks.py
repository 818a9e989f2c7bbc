"""Arguments shared by the attention family (softmax_dropout, attention): masks in the one
form the handlers read (cuda/ABI.md), the score scale, and the FFI attributes.

A user's mask — a boolean key-padding mask [B, Sk], or a boolean or additive mask
broadcastable to the probability tensor [..., Sq, Sk] — becomes a 4-D buffer
[Bm, Hm, Sqm, Skm] whose dims are each 1 (broadcast) or full, plus `mask_kind`
(0 none, 1 boolean with True = attend, 2 additive f32). Broadcast dims stay size 1, so a
[B, 1, 1, Sk] padding mask is never expanded to [B, H, Sq, Sk].

An additive mask is differentiable (a learned relative-position bias is one). The custom_vjp
rules of the family are defined with `symbolic_zeros=True`, which tells their forward rule
whether the program differentiates the mask (`differentiated` below); where it does not,
the rules save and compute nothing more. Where it does, the mask's cotangent is dS, the
cotangent of scale · scores + mask, summed over the mask's broadcast dims: softmax_dropout's
backward kernel writes scale · dS as the scores' cotangent (`reduce_to`), and the fused
attention kernels, which never write dS, give way to the unfused structure, whose softmax
is that op (`switched`). Only where scale · dS cannot hold dS (scale 0; float16 below
scale 1/16) does XLA compute it again from the forward's log-sum-exp (`mask_cotangent`,
[B, H, Sq, Sk] f32 in memory).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi, _jaxpr
from jaxsub.ops import dropout

NONE, BOOLEAN, ADDITIVE = 0, 1, 2
_DUMMY = np.zeros((1, 1, 1, 1), np.bool_)
# An additive mask's rows whose every value is below -_FAR are shifted up by their maximum
# (`_near`).
_FAR = 256.0


def normalize(op: str, mask, leading: tuple[int, ...], sq: int, sk: int, *, key_padding_ok: bool,
              causal: bool = False):
    """Returns (mask4d, kind) for a probability tensor of shape leading + (sq, sk), viewed
    as [B, H, Sq, Sk] with B = prod(leading[:-1]) and H = leading[-1] (1 when absent).

    `key_padding_ok`: a 2-D mask [B, Sk] is a key-padding mask (attention's q/k/v form,
    leading == (B, H)) rather than a mask over the last two axes; where B == Sq > 1 a 2-D
    additive mask could be either, and raises (a boolean one is key padding).
    `causal`: the scores are under the causal rule too (`_near`).
    """
    if mask is None:
        return _DUMMY, NONE
    mask = jnp.asarray(mask)
    if mask.dtype == jnp.bool_:
        kind = BOOLEAN
    elif jnp.issubdtype(mask.dtype, jnp.floating):
        kind = ADDITIVE
        mask = mask.astype(jnp.float32)
    else:
        raise TypeError(f"jaxsub.{op}: `mask` must be boolean or floating, got {mask.dtype}")
    full = tuple(leading) + (sq, sk)
    if key_padding_ok and mask.ndim == 2 and len(leading) == 2 and mask.shape == (leading[0], sk):
        if kind == ADDITIVE and leading[0] == sq and sq != 1:
            # [B, Sk] and [Sq, Sk] at once: either reading of a bias would be a guess (a
            # boolean 2-D mask is the documented key-padding form).
            raise ValueError(f"jaxsub.{op}: a 2-D additive `mask` of shape {tuple(mask.shape)} is ambiguous "
                             f"when B == Sq ({sq}): pass a key-padding mask as mask[:, None, None, :] or a mask over "
                             f"[Sq, Sk] as mask[None, None]")
        mask = mask[:, None, None, :]
    if mask.ndim > len(full):
        raise ValueError(f"jaxsub.{op}: `mask` has rank {mask.ndim}, more than the scores' {len(full)}")
    shape = (1,) * (len(full) - mask.ndim) + tuple(mask.shape)
    for have, want in zip(shape, full):
        if have not in (1, want):
            raise ValueError(f"jaxsub.{op}: `mask` of shape {tuple(mask.shape)} does not broadcast to {full}")
    mask = mask.reshape(shape)
    # Group the leading dims into (B, H); a group is kept as 1 only if every dim in it is.
    lead_m, lead_f = shape[:-2], full[:-2]
    b_dims_m, b_dims_f = lead_m[:-1], lead_f[:-1]
    h_m = lead_m[-1] if lead_m else 1
    if all(d == 1 for d in b_dims_m):
        bm = 1
    else:
        if tuple(b_dims_m) != tuple(b_dims_f):
            mask = jnp.broadcast_to(mask, tuple(b_dims_f) + tuple(mask.shape[len(b_dims_f):]))
        bm = math.prod(b_dims_f)
    mask = mask.reshape(bm, h_m, shape[-2], shape[-1])
    return (_near(mask, sk if causal and shape[-2] == sq else None) if kind == ADDITIVE else mask), kind


def _near(mask, causal_sk: int | None = None):
    """The additive mask with each row whose values are all below -_FAR (finite) shifted
    up by its maximum; every other row unchanged. A softmax row does not change when a
    constant is added to it, but its log-sum-exp does: for a row masked out by a large
    finite value (a padded example under `(1 - valid) * -1e9`) the f32 log-sum-exp that the
    attention kernels save is -1e9 + log(Sk) rounded to a multiple of 64, so the backward,
    which recomputes p = exp(s - lse), took every p there as 1 and returned gradients Sk
    times too large. Shifted, such a row's scores are those of the row unmasked (as a
    float64 program computes them). The maximum is taken over the mask's own keys; with
    `causal_sk` (a mask with a row per query, under the causal rule over Sk keys) over the
    keys each query sees, so that a row whose visible keys are all below -_FAR is shifted
    though a key the causal rule hides is not (its gradients were off by up to the visible
    keys' count). A row per query broadcast over the keys ([.., Sq, 1]) holds one value for
    every key its query sees: it is shifted where the query sees any key. A mask broadcast
    over the queries under the causal rule is shifted here by its maximum over every key;
    each query's own shift is `by_query`'s."""
    seen = mask
    if causal_sk is not None:
        visible = causal_visible(mask.shape[-2], causal_sk)
        if mask.shape[-1] == 1:
            visible = jnp.any(visible, axis=-1, keepdims=True)
        seen = jnp.where(visible, mask, -jnp.inf)
    return mask - _far_shift(jnp.max(seen, axis=-1, keepdims=True))


def _far_shift(top):
    """The shift of rows whose maximum is `top`: top where finite and below -_FAR, else 0;
    no gradient (a constant added to a softmax row)."""
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(top) & (top < -_FAR), top, 0.0))


def query_shift(mask, sq: int, sk: int):
    """[.., Sq, 1] for an additive mask broadcast over the queries ([.., 1, Sk]) under the
    causal rule: the maximum of the keys query i sees (j <= i + Sk - Sq, a prefix) where it
    is finite and below -_FAR, else 0; no gradient."""
    last = np.arange(sq) + (sk - sq)  # query i's last visible key
    top = jnp.take(jax.lax.cummax(mask, axis=mask.ndim - 1), np.clip(last, 0, sk - 1), axis=-1)
    return _far_shift(jnp.swapaxes(jnp.where(last >= 0, top, 0.0), -1, -2))


def by_query(mask, kind: int, sq: int, sk: int, causal: bool, call, operands=()):
    """call(mask): the rest of an op after `normalize`. Under the causal rule an additive
    mask broadcast over the queries has one row for queries that see different keys: a
    query whose visible keys all hold values below -_FAR (the first queries of a
    left-padded example under `(1 - valid) * -1e9`) needs its own shift (`_near`), and one
    shift per mask row cannot serve every query. Where some query needs one (decided on
    the device), `call` gets the mask expanded to a row per query, each row shifted by its
    query's `query_shift`; otherwise the mask as it is, so the expanded mask costs memory
    only where it changes a number.
    `operands`: the arrays `call` differentiates (a pytree). Where they or the mask are
    traced beyond a first reverse derivative (jax.jvp, jacfwd), the expanded rows are
    taken without the cond (the same numbers): the forward-mode trace would not reach the
    ops inside the cond's branches, which would run as custom_vjps there, and JAX refuses
    a custom_vjp's forward-mode derivative (found by a probe)."""
    if kind != ADDITIVE or not causal or mask.shape[-2] != 1 or sq == 1:
        return call(mask)
    if _ffi.beyond_first_reverse((mask, operands)):
        return call(mask - query_shift(mask, sq, sk))
    return jax.lax.cond(needs_query_rows(mask, sq, sk), lambda m: call(m - query_shift(m, sq, sk)), call, mask)


def needs_query_rows(mask, sq: int, sk: int):
    """Whether some query's `query_shift` is not 0, by two reductions over the keys
    (`by_query` runs it on every call, the scan only where it is true): the visible keys
    of query i are a prefix ending at key i + Sk - Sq, and its shift is not 0 where that
    prefix holds a finite value (from key `first_finite` on) and only values below -_FAR
    (before key `first_near`)."""
    keys = jnp.arange(sk)
    first_near = jnp.min(jnp.where(mask < -_FAR, sk, keys), axis=-1)
    first_finite = jnp.min(jnp.where(mask > -jnp.inf, keys, sk), axis=-1)
    return jnp.any(jnp.maximum(first_finite, max(0, sk - sq)) < first_near)


def causal_visible(sq: int, sk: int):
    """Bool [Sq, Sk]: query i sees key j when j <= i + (Sk - Sq) (causal, bottom-right
    aligned), for the references and the mask gradient."""
    return jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)


def check_scale(op: str, scale) -> float:
    """A static, finite Python number (strings and booleans are not scales)."""
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (numbers.Real, np.ndarray, jax.Array)):
        raise TypeError(f"jaxsub.{op}: `scale` must be a Python number, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(f"jaxsub.{op}: `scale` must be a static Python number, got {scale!r}") from e
    if not math.isfinite(value):
        raise ValueError(f"jaxsub.{op}: `scale` must be finite, got {value}")
    return value


def attrs(scale: float, causal: bool, kind: int, rate: float) -> dict:
    """The FFI attributes every attention-family target takes (cuda/ABI.md)."""
    return dict(scale=np.float32(scale), causal=bool(causal), mask_kind=np.int32(kind), **dropout.attrs(rate))


# ---------------------------------------------------------------------------------------
# custom_vjp rules with symbolic zeros (the module docstring).

cotangent = _jaxpr.dense_cotangent


def primals(*args):
    """The values of a forward rule's primal arguments, as a tuple."""
    return _jaxpr.primal_values(args)


def differentiated(kind: int, mask) -> bool:
    """Whether the program differentiates an additive mask (then the forward rules choose
    their way and tell their backward rules by their residuals' structure). `mask`: the
    forward rule's primal (a CustomVJPPrimal)."""
    return kind == ADDITIVE and bool(_jaxpr.perturbed(mask)[0])


@jax.tree_util.register_pytree_node_class
class Switched:
    """A fused forward rule's residual where the program differentiates an additive mask:
    the rule ran the unfused structure instead (`switched`), and this holds that
    structure's vjp."""

    def __init__(self, op, vjp):
        self.op, self.vjp = op, vjp

    def tree_flatten(self):
        return (self.vjp,), self.op

    @classmethod
    def tree_unflatten(cls, op, children):
        return cls(op, *children)

    def backward(self, ct):
        """The cotangents of the rule's differentiable primals, and None for the seed. The
        log line is here, where the gradient is taken: a forward traced only to look at its
        structure (`jaxsub.stack.scan` checks its body so) says nothing."""
        _ffi.fallback(self.op, "gradient of an additive mask",
                      instead="the unfused path, whose softmax backward gives it")
        return (*self.vjp(ct), None)


def switched(op, fn, *primals):
    """(out, Switched residual): a fused path's forward rule where the program
    differentiates an additive mask. The mask's cotangent is dS (the scores' cotangent)
    summed over the mask's broadcast dims; the fused kernels never write dS, and computing
    it again beside them took two f32 [B, H, Sq, Sk] products and two passes over them
    (1 077 µs on top of the fused kernels' 1 753 fwd+bwd at a T5-like shape on the H200,
    bench/NOTES.md, forty-ninth session). The unfused structure's softmax backward kernel
    writes scale · dS anyway (`softmax._fused_bwd`); its whole fwd+bwd is expected below
    that (not yet measured, NOTES, fiftieth session). `fn`: the unfused structure on
    `primals` (the rule's differentiable primals, mask last)."""
    out, vjp = jax.vjp(fn, *primals)
    return out, Switched(op, vjp)


def reduce_to(ds, mask_shape):
    """ds [B, H, Sq, Sk] summed over the dims where `mask_shape` (4-D) is 1."""
    return jnp.sum(ds, axis=tuple(i for i, m in enumerate(mask_shape) if m == 1), keepdims=True)


def mask_cotangent(op: str, s, lse, dy, seed, rate: float, causal: bool, mask_shape):
    """The cotangent of an additive mask of `mask_shape` (4-D, broadcasting to s's
    [B, H, Sq, Sk]): dS = P (g - rowsum(P g)) summed over the mask's broadcast dims, with
    P = exp(s - lse) from the forward's log-sum-exp (natural log, -inf for a row with no
    visible key, whose P is 0) and g the cotangent of P: dy, the cotangent of the dropped
    probabilities, through the kernels' keep-mask of `seed` (kept: scaled by 1 / (1 - rate);
    dropped: 0). s: the scaled scores plus the mask, f32 (-inf where hidden); dy: f32.
    softmax_dropout's way where its scores' cotangent scale · dS cannot hold dS (scale 0;
    float16 at small scales), with a one-time log line."""
    _ffi.fallback(op, "gradient of an additive mask at this scale and dtype",
                  instead="XLA for it ([B, H, Sq, Sk] f32 in memory)")
    g = dy
    if rate > 0.0:
        g = jnp.where(dropout.seed_mask(seed, s.shape, rate), dy * dropout.keep_scale(rate), 0.0)
    if causal:
        s = jnp.where(causal_visible(*s.shape[-2:]), s, -jnp.inf)
    empty = jnp.isneginf(lse)[..., None]
    p = jnp.where(empty, 0.0, jnp.exp(s - jnp.where(empty, 0.0, lse[..., None])))
    return reduce_to(p * (g - jnp.sum(p * g, axis=-1, keepdims=True)), mask_shape)
