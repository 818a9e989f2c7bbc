"""Masks of the attention matcher (match_attention.py): which values on the scores' path are
masks, their sources, the bounds the graph gives them, and the one mask `ops.attention` takes.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxsub.rewrite import constants as C
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import labels as L
from jaxsub.rewrite.patterns import narrow, rounded

# where(mask, s, c) acts as a boolean mask when c is at most this (exp underflows to 0),
# or at most its rounding where c is a bf16/f16 constant (-1e4 is -9984 in bf16: HF GPT-2's
# `masked_bias`), `big_negative`.
_BIG_NEGATIVE = -1e4


# Below this fill, an added mask of unknown range is taken not to lift hidden scores (`lifted`).
_UNBOUNDED_FILL = -1e9
_BOUND_OPS = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "stop_gradient", *G.VARYING_CASTS)


def bounds(g: G.Graph, ref, depth: int = 0):
    """(lo, hi) bounding every element of `ref` when the graph says so (constants, converts
    of booleans, selects, sums, products and scales of bounded values), else None."""
    val = C.value(g, ref, {})
    if val is not None:
        ends = C.span(val)
        return None if ends is None else (float(ends[0]), float(ends[1]))
    node = g.producer.get(ref)
    if node is None or depth > 12 or len(node.outs) != 1:
        return None
    if node.prim == "convert_element_type" and node.ins[0].dtype == jnp.bool_:
        return 0.0, 1.0
    if node.prim in _BOUND_OPS or node.prim == "convert_element_type":
        return bounds(g, node.ins[0], depth + 1)
    if node.prim == "neg":
        b = bounds(g, node.ins[0], depth + 1)
        return None if b is None else (-b[1], -b[0])
    args = node.ins[1:] if node.prim == "select_n" else node.ins
    if node.prim not in ("select_n", "add", "sub", "mul", "max", "min") or len(args) < 1:
        return None
    bs = [bounds(g, r, depth + 1) for r in args]
    if any(b is None for b in bs):
        return None
    if node.prim == "select_n":
        return min(b[0] for b in bs), max(b[1] for b in bs)
    (a0, a1), (b0, b1) = bs
    if node.prim == "add":
        out = a0 + b0, a1 + b1
    elif node.prim == "sub":
        out = a0 - b1, a1 - b0
    elif node.prim == "max":
        out = max(a0, b0), max(a1, b1)
    elif node.prim == "min":
        out = min(a0, b0), min(a1, b1)
    else:
        with np.errstate(invalid="ignore"):
            ends = [x * y for x in (a0, a1) for y in (b0, b1)]
        if any(math.isnan(e) for e in ends):  # 0 * inf
            return None
        out = min(ends), max(ends)
    return None if any(math.isnan(v) for v in out) else out


def lifted(masks):
    """None when every boolean mask's fill stays a boolean mask after the additive masks
    that come after it: where(m, s, c) + a hides m's elements only if c + a does. Where the
    graph bounds a (a constant, a mask built from booleans), c + max(a) must be a big
    negative as c alone must be; c at most -1e30 (-inf, finfo(float32).min) is past any
    logit. An added value the graph does not bound (an input, a learned bias) is taken
    not to lift a fill of -1e9 or below by more than 1e9 - 1e4, as the visible scores are
    taken to be above the fill (exp(c - max) underflows); a smaller fill such as -1e4 is
    then a near-miss. Else the reason."""
    for i, m in enumerate(masks):
        if not m.boolean:
            continue
        later = [a for a in masks[i + 1:] if not a.boolean]
        lift = lift_of(later)
        if later and not hides(m.fill, lift):
            added = "of unknown range" if math.isinf(lift) else f"up to {lift:g}"
            return (f"where(mask, scores, {m.fill:g}) is followed by an additive mask {added}, which may lift the "
                    f"hidden scores back (fill with -inf or finfo.min, or bound the added mask, to fuse it)")
    return None


def lift_of(additive) -> float:
    """The most the additive masks `additive` add to a score (inf where one is unbounded)."""
    lift = 0.0
    for a in additive:
        if a.bounds is None:
            return math.inf
        lift += max(a.factor * a.bounds[0], a.factor * a.bounds[1])
    return lift


def hides(fill, lift) -> bool:
    """Whether a score at `fill` stays hidden after masks adding up to `lift` (`lifted`)."""
    return fill <= -1e30 or (fill <= _UNBOUNDED_FILL if math.isinf(lift) else fill + lift <= big_negative(jnp.bfloat16))


def big_negative(dtype) -> float:
    """The largest fill that makes where(mask, s, fill) a boolean mask, for a fill held in
    `dtype`: _BIG_NEGATIVE, or the largest of its roundings to a narrower float (every
    such value is far below where exp underflows, so the masked probabilities are 0)."""
    if not jnp.issubdtype(dtype, jnp.floating) or not narrow(dtype):
        return _BIG_NEGATIVE
    return max(_BIG_NEGATIVE, *rounded(_BIG_NEGATIVE, dtype))


@dataclasses.dataclass
class Mask:
    ref: G.Ref           # mask source, read at run time
    labels: tuple
    boolean: bool
    negate: bool = False     # select_n(m, s, -big): attend where m is False
    fill: float = 0.0        # the big negative of a boolean mask, after later scales
    factor: float = 1.0      # later scales an additive mask is multiplied by
    bounds: tuple | None = None  # an additive mask's (lo, hi), where the graph bounds it


def _all_true(g, ref):
    """Whether ref is a constant all-True mask (a broadcast one is evaluated in compact
    form: jax.nn.dot_product_attention's [B, H, Sq, Sk] ones at any size)."""
    val = C.value(g, ref, {})
    return val is not None and C.all_true(val)


def mask_source(g, ref, labels):
    """Walk a mask operand back through layout/broadcast nodes, and `and`s with a constant
    all-True (dot_product_attention's), to its smallest source."""
    for _ in range(8):
        node = g.op(ref, "transpose", "reshape", "broadcast_in_dim", "and")
        if node is not None and node.prim == "and":
            rest = [r for r in node.ins if not _all_true(g, r)]
            if len(rest) != 1 or len(rest[0].shape) != len(ref.shape):
                break
            ref, labels = rest[0], tuple(l if a == b else None
                                         for l, a, b in zip(labels, rest[0].shape, ref.shape))
            continue
        back = L.backward(node, labels) if node is not None else None
        if back is None:
            break
        ref, labels = node.ins[0], back
    return ref, labels


def conjuncts(g, ref, labels, negate, depth=0):
    """[(source, labels)] of the masks whose conjunction `ref` is (for a negated mask, which
    hides where it is True: its disjunction): an `and` (`or`) of masks of its shape is split
    and each part walked back to its source (`mask_source`), so that a constant part, such
    as the causal triangle jax.nn.dot_product_attention ands with a padding mask, is seen
    apart. where(a & b, s, c) is where(a, where(b, s, c), c): the same function."""
    node = g.op(ref, "or" if negate else "and")
    if (node is None or depth > 8 or ref.dtype != np.bool_
            or any(len(r.shape) != len(ref.shape) or not L.broadcasts(r, ref) for r in node.ins)):
        return [(ref, labels)]
    parts = []
    for r in node.ins:  # (an operand may be 1 where the result is not)
        rl = tuple(l if a == n else None for l, a, n in zip(labels, r.shape, ref.shape))
        parts += conjuncts(g, *mask_source(g, r, rl), negate, depth + 1)
    return parts


def builder(masks, sizes):
    """read -> the one mask `attention` takes: booleans and-ed; additive masks summed, with
    any boolean mask folded in as -inf."""
    if not masks:
        return lambda read: None

    def value(read):
        vis, add = None, None
        for m in masks:
            val = L.relayout(read(m.ref), m.labels, "bhqk", sizes)
            if m.boolean:
                val = jnp.logical_not(val) if m.negate else val
                vis = val if vis is None else vis & val
            else:
                val = val.astype(jnp.float32)
                if m.factor != 1.0:  # 0 stays 0: XLA folds (x * finfo.min) * 2 into x * -inf, NaN at x = 0
                    val = jnp.where(val == 0, 0.0, val * m.factor)
                add = val if add is None else add + val
        return vis if add is None else add if vis is None else jnp.where(vis, add, -jnp.inf)

    return value
