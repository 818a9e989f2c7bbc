"""Attention and softmax(+dropout) matchers (issue #4, pattern 1).

Attention: softmax(Q·Kᵀ·scale [+ additive mask | where(mask, s, -big)] [causal]) [dropout] · V
becomes `jaxsub.ops.attention` whenever q, k and v can be viewed as [B, S, H, D] (einsum
'bqhd,bkhd->bhqk', 'bhqd,bhkd->bhqk', jax.nn.dot_product_attention's grouped form, flax
linen/nnx attention): the scale may sit on q, k or the logits, and is folded into
`scale`; masks may come before or after it. `where(mask, s, c)` with c <= -1e4 (-1e9,
finfo.min, -inf) is taken as a boolean mask: equal to the original on every row with at
least one visible key, because exp(c - max) underflows to exactly 0 there. On a fully
masked row the original averages v uniformly (finite c) or gives NaN (-inf), the fused
op gives 0; such rows carry no information, so the rewrite is made and explain() says so
("fully-masked rows give 0 instead of the mean of v"). An additive mask added after such
a where must leave c + mask a big negative (`_lifted`). A boolean mask that is a constant
(built from iota/ones, as jnp.tril and flax's make_causal_mask do) and equals jaxsub's
bottom-right lower triangle becomes `causal=True`; any other mask is passed as is.
Dropout on the probabilities (see match_dropout) becomes `dropout_rate` with the key that
fed bernoulli; a dropout mask broadcast over batch/heads (flax's default
`broadcast_dropout=True`) is a near-miss, since the kernel drops elements independently.

The softmax itself is recognized by match_softmax.
"""


from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import ops
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import match_dropout, projections
from jaxsub.rewrite.match_softmax import parse, shift_of
from jaxsub.rewrite.patterns import ACTIVATION_DTYPES, Match, NearMiss, narrow, private_violation, rounded, shapes

ATTN = "attention"

# ---------------------------------------------------------------------------------------
# Attention: softmax(scale * Q Kᵀ (+ masks)) (dropout) V.
#
# Every tensor on the path from the Q·K contraction to the ·V contraction gets a *label*
# per axis: "b" and "h" for the contraction's batch dims (first and second; absent ones
# have size 1), "L"/"R" for the free dim of its left/right operand (which one is the
# query side follows from the softmax axis, the key side), None for unit axes. Transposes
# permute labels, reshapes may only add or drop unit axes, elementwise steps keep them.
# q, k, v and the masks are then moved to [B, S, H, D] / [B, H, Sq, Sk] by one transpose
# and one unit reshape (XLA elides both), and the result is moved back to the ·V
# contraction's layout.

# Layout nodes: unit reshapes include a squeeze and a broadcast_in_dim that only adds unit
# axes (jnp.matmul squeezes a unit batch axis away and broadcasts it back).
_LAYOUT = ("transpose", "reshape", "squeeze", "broadcast_in_dim", "convert_element_type")
_UNIT_OPS = ("reshape", "squeeze", "broadcast_in_dim")
# where(mask, s, c) acts as a boolean mask when c is at most this (exp underflows to 0),
# or at most its rounding where c is a bf16/f16 constant (-1e4 is -9984 in bf16: HF GPT-2's
# `masked_bias`), `_big_negative`.
_BIG_NEGATIVE = -1e4
_MAX_CONSTANT = 1 << 22
_CONSTANT_OPS = frozenset({"iota", "broadcast_in_dim", "reshape", "transpose", "convert_element_type",
                           "ge", "gt", "le", "lt", "eq", "ne", "and", "or", "not", "select_n",
                           "add", "sub", "mul", "squeeze", "expand_dims"})


def _nonunit(shape):
    return tuple(d for d in shape if d != 1)


def _unit_reshape(node):
    if node.prim not in _UNIT_OPS:
        return True
    src, out = node.ins[0].shape, node.outs[0].shape
    return _nonunit(src) == _nonunit(out) and math.prod(src) == math.prod(out)


def _forward(node, labels):
    """The labels of a layout node's output, given its input's."""
    if node.prim == "transpose":
        return tuple(labels[p] for p in node.params["permutation"])
    if node.prim in _UNIT_OPS:  # a unit reshape (`_unit_reshape`)
        it = iter(l for l, d in zip(labels, node.ins[0].shape) if d != 1)
        return tuple(next(it) if d != 1 else None for d in node.outs[0].shape)
    return labels


def _backward(node, labels):
    """The labels of a layout node's input, given its output's; None if not a layout."""
    src, out = node.ins[0], node.outs[0]
    if node.prim == "transpose":
        res = [None] * len(labels)
        for i, p in enumerate(node.params["permutation"]):
            res[p] = labels[i]
        return tuple(res)
    if node.prim in ("reshape", "squeeze") and _unit_reshape(node):
        it = iter(l for l, d in zip(labels, out.shape) if d != 1)
        return tuple(next(it) if d != 1 else None for d in src.shape)
    if node.prim == "broadcast_in_dim":
        dims = node.params["broadcast_dimensions"]
        return tuple(labels[o] if src.shape[i] == out.shape[o] else None for i, o in enumerate(dims))
    return None


def _relayout(x, labels, target, sizes):
    """x (axes labelled `labels`, unlabelled ones of size 1) as the axes `target`; a target
    label x lacks becomes a unit axis."""
    order = [labels.index(t) for t in target if t in labels]
    order += [i for i in range(len(labels)) if i not in order]
    xp = np if isinstance(x, np.ndarray) else jnp  # constants stay numpy while tracing
    x = xp.transpose(x, order) if order != list(range(len(order))) else x
    return x.reshape(tuple(sizes[t] if t in labels else 1 for t in target))


def _constant(g: G.Graph, ref, memo):
    """The value of `ref` when it is computed from constants alone (iota, literals)."""
    if ref.value is not None:
        val = G.known(ref)
        return None if val is None else np.asarray(val)
    if ref in memo:
        return memo[ref]
    node = g.producer.get(ref)
    val = None
    if (node is not None and node.prim in _CONSTANT_OPS and len(node.outs) == 1
            and np.prod(ref.shape, dtype=np.int64) <= _MAX_CONSTANT):
        ins = [_constant(g, r, memo) for r in node.ins]
        if all(v is not None for v in ins):
            with jax.ensure_compile_time_eval():
                val = np.asarray(G.bind(node.eqn, ins)[0])
    memo[ref] = val
    return val


# Below this fill, an added mask of unknown range is taken not to lift hidden scores (`_lifted`).
_UNBOUNDED_FILL = -1e9
_BOUND_OPS = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "stop_gradient", *G.VARYING_CASTS)


def _bounds(g: G.Graph, ref, depth: int = 0):
    """(lo, hi) bounding every element of `ref` when the graph says so (constants, converts
    of booleans, selects, sums, products and scales of bounded values), else None."""
    val = _constant(g, ref, {})
    if val is not None:
        val = np.asarray(val, np.float64)
        return (float(val.min()), float(val.max())) if val.size else None
    node = g.producer.get(ref)
    if node is None or depth > 12 or len(node.outs) != 1:
        return None
    if node.prim == "convert_element_type" and node.ins[0].dtype == jnp.bool_:
        return 0.0, 1.0
    if node.prim in _BOUND_OPS or node.prim == "convert_element_type":
        return _bounds(g, node.ins[0], depth + 1)
    if node.prim == "neg":
        b = _bounds(g, node.ins[0], depth + 1)
        return None if b is None else (-b[1], -b[0])
    args = node.ins[1:] if node.prim == "select_n" else node.ins
    if node.prim not in ("select_n", "add", "sub", "mul", "max", "min") or len(args) < 1:
        return None
    bs = [_bounds(g, r, depth + 1) for r in args]
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


def _lifted(masks):
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
        if not later or m.fill <= -1e30:
            continue
        lift = 0.0
        for a in later:
            if a.bounds is None:
                lift = math.inf
                break
            lift += max(a.factor * a.bounds[0], a.factor * a.bounds[1])
        if math.isinf(lift) and m.fill <= _UNBOUNDED_FILL:
            continue
        if m.fill + lift > _big_negative(jnp.bfloat16):
            added = "of unknown range" if math.isinf(lift) else f"up to {lift:g}"
            return (f"where(mask, scores, {m.fill:g}) is followed by an additive mask {added}, which may lift the "
                    f"hidden scores back (fill with -inf or finfo.min, or bound the added mask, to fuse it)")
    return None


def _big_negative(dtype) -> float:
    """The largest fill that makes where(mask, s, fill) a boolean mask, for a fill held in
    `dtype`: _BIG_NEGATIVE, or the largest of its roundings to a narrower float (every
    such value is far below where exp underflows, so the masked probabilities are 0)."""
    if not jnp.issubdtype(dtype, jnp.floating) or not narrow(dtype):
        return _BIG_NEGATIVE
    return max(_BIG_NEGATIVE, *rounded(_BIG_NEGATIVE, dtype))


@dataclasses.dataclass
class _Mask:
    ref: G.Ref           # mask source, read at run time
    labels: tuple
    boolean: bool
    negate: bool = False     # select_n(m, s, -big): attend where m is False
    fill: float = 0.0        # the big negative of a boolean mask, after later scales
    factor: float = 1.0      # later scales an additive mask is multiplied by
    bounds: tuple | None = None  # an additive mask's (lo, hi), where the graph bounds it


def _all_true(g, ref):
    val = _constant(g, ref, {})
    return val is not None and val.dtype == np.bool_ and bool(val.all())


def _mask_source(g, ref, labels):
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
        back = _backward(node, labels) if node is not None else None
        if back is None:
            break
        ref, labels = node.ins[0], back
    return ref, labels


class _Scores:
    """Parse of the path from the Q·K dot_general to the softmax input, walked backwards."""

    def __init__(self, g, axis):
        self.g = g
        self.axis = axis     # the softmax axis of the walk's first value
        self.steps = []      # (node, kind, payload), from the softmax input back
        self.qk = None

    def _axis_here(self):
        """The softmax axis at the value the walk has reached (the layout steps undone)."""
        labels = None
        for node, kind, _ in self.steps:
            if kind != "layout":
                continue
            if labels is None:
                labels = tuple("a" if i == self.axis else None for i in range(len(node.outs[0].shape)))
            labels = _backward(node, labels)
            if labels is None:
                return None
        return self.axis if labels is None else (labels.index("a") if "a" in labels else None)

    def walk(self, ref, depth=0):
        g = self.g
        node = g.producer.get(ref)
        if node is None or depth > 16 or node.outs[0].shape != ref.shape:
            return False
        if node.prim == "dot_general":
            self.qk = node
            return True
        n = len(self.steps)
        if node.prim in _LAYOUT and _unit_reshape(node):
            if node.prim == "convert_element_type" and node.outs[0].dtype not in ACTIVATION_DTYPES:
                return False
            self.steps.append((node, "layout", None))
            if self.walk(node.ins[0], depth + 1):
                return True
        elif node.prim in ("mul", "div"):
            for s, c in (node.ins, node.ins[::-1]):
                k = g.scalar(c)
                if node.prim == "div" and c is not node.ins[1] or s.shape != ref.shape:
                    continue
                if k is None and _broadcasts(c, ref) and jnp.issubdtype(c.dtype, jnp.floating):
                    # A scale computed at run time (a temperature, a learned per-head scale):
                    # folded into q or k where it varies over one side only (`_Attn.chain`).
                    self.steps.append((node, "runtime scale", (c, node.prim == "div")))
                    if self.walk(s, depth + 1):
                        return True
                    del self.steps[n:]
                    continue
                if k is None or k == 0.0:
                    continue
                self.steps.append((node, "scale", 1.0 / k if node.prim == "div" else k))
                if self.walk(s, depth + 1):
                    return True
                del self.steps[n:]
        elif node.prim == "add":
            for s, m in (node.ins, node.ins[::-1]):
                if s.shape == ref.shape and jnp.issubdtype(m.dtype, jnp.floating):
                    self.steps.append((node, "add", m))
                    if self.walk(s, depth + 1):
                        return True
                    del self.steps[n:]
        elif node.prim == "sub":  # s - m: the additive mask -m (`s - 1e9 * (1 - valid)`)
            s, m = node.ins
            axis = self._axis_here()
            shift = shift_of(g, m, s, axis) if axis is not None and s.shape == ref.shape else None
            if shift is not None:  # s - max(s): a shift the softmax does not see
                self.steps.append((node, "shift", shift))
                if self.walk(s, depth + 1):
                    return True
                del self.steps[n:]
            elif s.shape == ref.shape and jnp.issubdtype(m.dtype, jnp.floating):
                self.steps.append((node, "sub", m))
                if self.walk(s, depth + 1):
                    return True
        elif node.prim == "select_n" and len(node.ins) == 3 and node.ins[0].dtype == jnp.bool_:
            pred, no, yes = node.ins
            for s, c, negate in ((yes, no, False), (no, yes, True)):
                fill = g.scalar(c)
                if fill is not None and fill <= _big_negative(c.dtype) and s.shape == ref.shape:
                    self.steps.append((node, "select", (pred, fill, negate)))
                    if self.walk(s, depth + 1):
                        return True
                    del self.steps[n:]
        del self.steps[n:]
        return False


def _broadcasts(c, ref) -> bool:
    """Whether c (a scalar, or of ref's rank with each axis 1 or ref's) broadcasts to ref."""
    return not c.shape or (len(c.shape) == len(ref.shape) and all(a in (1, n) for a, n in zip(c.shape, ref.shape)))


def _operand_labels(shape, batch, contract, free_label):
    """Labels of a dot_general operand, or None when its free dims hold more than one
    non-unit dim."""
    labels = [None] * len(shape)
    for d, l in zip(batch, "bh"):
        labels[d] = l
    labels[contract[0]] = "d"
    free = [d for d in range(len(shape)) if d not in batch and d != contract[0]]
    big = [d for d in free if shape[d] != 1]
    if len(big) > 1:
        return None, free
    for d in big:
        labels[d] = free_label
    return tuple(labels), free


def _unscaled(g, ref):
    """(x, factor, node) when ref = x * c or x / c for a scalar c; else (ref, 1.0, None)."""
    node = g.op(ref, "mul", "div")
    if node is not None and node.ins[0].dtype == ref.dtype:
        for x, c in (node.ins, node.ins[::-1]):
            k = g.scalar(c)
            if k and x.shape == ref.shape and (node.prim == "mul" or c is node.ins[1]):
                return x, (1.0 / k if node.prim == "div" else k), node
    return ref, 1.0, None


def _strip_layout(g, ref, into):
    for _ in range(8):
        node = g.op(ref, *_LAYOUT)
        if node is None or not _unit_reshape(node) or node.outs[0].dtype not in ACTIVATION_DTYPES:
            break
        into.append(node)
        ref = node.ins[0]
    return ref


def _broadcast_dropout(g, ref):
    """The bernoulli node of a dropout on a softmax that match_dropout does not take (a mask
    broadcast over batch/heads, flax's default `broadcast_dropout=True`)."""
    node = g.op(ref, "mul", "select_n")
    if node is None:
        return None
    if not any(parse(g, _strip_layout(g, r, [])) for r in node.ins if r.shape == ref.shape):
        return None
    return match_dropout.drawn_mask(g, ref)


def _is(label, want, sizes):
    return label == want or (label is None and sizes.get(want, 1) == 1)


class _Attn:
    """One attention candidate ending at the ·V dot_general `anchor`, P = operand `pi`."""

    def __init__(self, g, anchor, pi):
        self.g, self.anchor, self.pi = g, anchor, pi
        self.nodes, self.roles, self.masks = [anchor], {}, []
        self.runtime_scales = []  # (source, labels, divides): scales of the scores computed at run time
        self.drop = self.sm = None
        self.near_miss = None

    def take(self, nodes, role):
        for n in nodes:
            if n not in self.roles:
                self.roles[n] = role
                self.nodes.append(n)

    def parse(self):
        g, anchor = self.g, self.anchor
        post = []
        ref = _strip_layout(g, anchor.ins[self.pi], post)
        drop = match_dropout.parse(g, ref)
        if drop is not None and drop.h.shape == ref.shape:
            self.drop = drop
            ref = _strip_layout(g, drop.h, post)
        elif drop is None:
            bern = _broadcast_dropout(g, ref)
            if bern is not None:
                if bern.outs[0].shape == ref.shape:
                    wrong = (f"dropout mask {shapes(bern.outs[0])} on the probabilities without its 1 / (1 - rate) "
                             f"scale on them (after the product with v, or none); the fused op scales the kept "
                             f"probabilities")
                else:
                    wrong = (f"dropout mask {shapes(bern.outs[0])} is broadcast over the probabilities {shapes(ref)}; "
                             f"the fused op drops every element independently")
                why = match_dropout.batched_key(bern) or wrong
                self.near_miss = why, ("drop", id(bern))
                return False
        sm = parse(g, ref)
        if sm is None:
            remat = g.producer.get(ref)
            if remat is not None and remat.prim in G.REMAT and remat.body is not None:
                out = remat.body.outvars[remat.outs.index(ref)]
                if parse(remat.body, out) is not None:
                    self.near_miss = ("the softmax is inside a jax.checkpoint without the scores' product: "
                                      "checkpoint the whole attention to fuse it", ("remat", id(remat)))
            return False
        self.sm, self.post = sm, post[::-1]
        scores = _Scores(g, sm.axis)
        if not scores.walk(sm.x):
            return False
        self.steps = scores.steps[::-1]
        return self.qk_labels(scores.qk) and self.chain() and self.pv()

    def qk_labels(self, qk):
        (lc, rc), (lb, rb) = qk.params["dimension_numbers"]
        lhs, rhs = qk.ins
        if len(lc) == 1 and len(lb) > 2 and lhs.dtype == rhs.dtype and lhs.dtype in ACTIVATION_DTYPES:
            # A vmapped attention (jax.vmap of a per-example function): more batch axes than
            # [batch, heads].
            self.near_miss = (f"the scores' product {shapes(lhs)} x {shapes(rhs)} has {len(lb)} batch axes; the "
                              f"fused op takes batch and heads: under jax.vmap, optimize the function vmap "
                              f"maps (jax.vmap(jaxsub.optimize(f)))", ("batch axes", id(qk)))
            return False
        if len(lc) != 1 or len(lb) > 2 or lhs.dtype != rhs.dtype or lhs.dtype not in ACTIVATION_DTYPES:
            return False
        ll, lfree = _operand_labels(lhs.shape, lb, lc, "L")
        rl, rfree = _operand_labels(rhs.shape, rb, rc, "R")
        if ll is None or rl is None:
            # Two non-unit free axes on one side: a head axis the other operand lacks
            # (grouped- or multi-query attention, k and v with fewer heads than q).
            self.near_miss = (f"the scores' product {shapes(lhs)} x {shapes(rhs)} has two free axes on one side, "
                              f"a head axis only one of q and k has (grouped- or multi-query attention): the "
                              f"fused op takes k and v with q's heads; repeat them to q's heads to fuse it",
                              ("gqa", id(qk)))
            return False
        self.sizes = {l: lhs.shape[d] for d, l in zip(lb, "bh")}
        self.sizes.update(d=lhs.shape[lc[0]], L=math.prod(lhs.shape[d] for d in lfree),
                          R=math.prod(rhs.shape[d] for d in rfree))
        self.operands = [[lhs, ll], [rhs, rl]]
        self.qk, self.labels = qk, (*"bh"[:len(lb)], *(ll[d] for d in lfree), *(rl[d] for d in rfree))
        return True

    def chain(self):
        g, labels, factor = self.g, self.labels, 1.0
        dtype = self.operands[0][0].dtype
        converts = [n for n, kind, _ in self.steps if kind == "layout"] + list(self.post)
        for n in converts:
            if n.prim == "convert_element_type" and jnp.finfo(n.outs[0].dtype).eps > jnp.finfo(dtype).eps:
                what = "scores" if n not in self.post else "probabilities"
                self.near_miss = (f"the {what} are rounded to {jnp.dtype(n.outs[0].dtype).name} in a "
                                  f"{jnp.dtype(dtype).name} attention; the fused op would not round them",
                                  ("narrowed", id(self.qk)))
                return False
        inside = {r for n, _, _ in self.steps for r in n.outs} | set(self.qk.outs)
        for node, kind, payload in self.steps:
            if kind == "layout":
                labels = _forward(node, labels)
            elif kind == "shift":
                continue
            elif kind == "runtime scale":
                c, div = payload
                if c in inside or self.masks:
                    if self.masks:
                        self.near_miss = ("the masked scores are scaled by a value computed at run time: scale "
                                          "before masking (or scale q) to fuse", ("runtime", id(node)))
                    return False
                cl = tuple(l if a == n else None for l, a, n in zip(labels, c.shape, node.outs[0].shape))
                self.runtime_scales.append((*_mask_source(g, c, cl), div))
            elif kind == "scale":
                factor *= payload
                for m in self.masks:
                    m.factor *= payload
                    m.fill *= payload
            else:
                m = payload[0] if kind == "select" else payload
                if m in inside:  # the scores added to themselves (`s + s`): no mask
                    return False
                chain_shape = node.outs[0].shape
                if len(m.shape) != len(chain_shape) or any(a not in (1, c) for a, c in zip(m.shape, chain_shape)):
                    return False
                ml = tuple(l if a == c else None for l, a, c in zip(labels, m.shape, chain_shape))
                src, sl = _mask_source(g, m, ml)
                if kind == "select":
                    self.masks.append(_Mask(src, sl, True, negate=payload[2], fill=payload[1]))
                else:
                    self.masks.append(_Mask(src, sl, False, factor=-1.0 if kind == "sub" else 1.0,
                                            bounds=_bounds(g, m)))
        why = _lifted(self.masks)
        if why is not None:
            self.near_miss = why, ("lifted", id(self.qk))
            return False
        query = {"L": "R", "R": "L"}.get(labels[self.sm.axis])
        if query is None or any(m.boolean and not m.fill <= _big_negative(jnp.bfloat16) for m in self.masks):
            return False
        rename = {query: "q", labels[self.sm.axis]: "k"}

        def ren(ls):
            return tuple(rename.get(l, l) for l in ls)

        self.sizes["q"], self.sizes["k"] = self.sizes.pop(query), self.sizes.pop(labels[self.sm.axis])
        for m in self.masks:
            m.labels = ren(m.labels)
        self.q_scales, self.k_scales = [], []
        for src, sl, div in self.runtime_scales:
            sl = ren(sl)
            side = {l for l in sl if l is not None} - {"b", "h"}
            if len(side) > 1:
                self.near_miss = (f"the scores are multiplied by {shapes(src)} computed at run time, varying over "
                                  f"queries and keys: not a scale of q or of k", ("runtime", id(src)))
                return False
            (self.k_scales if side == {"k"} else self.q_scales).append((src, sl, div))
        for op in self.operands:
            op[1] = ren(op[1])
        if query == "R":
            self.operands.reverse()
        self.prob_labels = ren(labels)
        for node in self.post:
            self.prob_labels = _forward(node, self.prob_labels)
        q, k = self.operands
        self.q, qf, qn = _unscaled(g, q[0])
        self.k, kf, kn = _unscaled(g, k[0])
        self.q_labels, self.k_labels = q[1], k[1]
        self.scale = factor * qf * kf
        self.take([n for n in (qn, kn) if n is not None and g.uses[n.outs[0]] == 1], "scaled q/k")
        return self.q.dtype == self.k.dtype

    def pv(self):
        anchor, sizes = self.anchor, self.sizes
        (c0, c1), (b0, b1) = anchor.params["dimension_numbers"]
        pc, vc, pb, vb = (c0, c1, b0, b1) if self.pi == 0 else (c1, c0, b1, b0)
        p, v = anchor.ins[self.pi], anchor.ins[1 - self.pi]
        pl = self.prob_labels
        if len(pc) != 1 or not _is(pl[pc[0]], "k", sizes) or v.dtype != self.q.dtype:
            return False
        pfree = [d for d in range(len(p.shape)) if d not in pb and d not in pc]
        if not all(pl[d] in ("b", "h", None) for d in pb) or not all(pl[d] in ("q", None) for d in pfree):
            return False
        vl = [None] * len(v.shape)
        for dp, dv in zip(pb, vb):
            vl[dv] = pl[dp]
        vl[vc[0]] = "k"
        vfree = [d for d in range(len(v.shape)) if d not in vb and d != vc[0]]
        big = [d for d in vfree if v.shape[d] != 1]
        if len(big) > 1:
            return False
        if math.prod(v.shape[d] for d in vfree) != sizes["d"]:
            self.near_miss = (f"v's head dim {math.prod(v.shape[d] for d in vfree)} differs from q and k's "
                              f"{sizes['d']}: the fused op takes one head dim", ("vdim", id(anchor)))
            return False
        for d in big:
            vl[d] = "e"
        sizes["e"] = sizes["d"]
        self.v, self.v_labels = v, tuple(vl)
        free = [pl[d] for d in pfree], [vl[d] for d in vfree]
        self.out_labels = (*(pl[d] for d in pb), *free[self.pi], *free[1 - self.pi])
        want = tuple(sizes.get(l, 1) if l else 1 for l in self.out_labels)
        bshk = tuple(sizes.get(l, 1) for l in "bkhd")
        return (want == anchor.outs[0].shape and math.prod(self.k.shape) == math.prod(bshk)
                and math.prod(self.q.shape) == math.prod(sizes.get(l, 1) for l in "bqhd"))

    def causal(self):
        """Take a constant bottom-right lower-triangular boolean mask as `causal=True`."""
        sq, sk = self.sizes["q"], self.sizes["k"]
        tril = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        memo = {}
        for m in self.masks:
            if not m.boolean:
                continue
            val = _constant(self.g, m.ref, memo)
            if val is None:
                continue
            vis = _relayout(val, m.labels, "bhqk", self.sizes)
            vis = ~vis if m.negate else vis
            if vis.shape[-2:] == (sq, sk) and np.array_equal(np.broadcast_to(tril, vis.shape), vis):
                self.masks.remove(m)
                self.causal_fill = m.fill
                return True
        return False


def _scaled(read, x, scales, target, sizes):
    """x (q or k in the `target` layout) times (or divided by) the run-time scales of its side."""
    for src, labels, div in scales:
        t = _relayout(read(src), labels, target, sizes)
        x = (x / t if div else x * t).astype(x.dtype)
    return x


def _mask_builder(masks, sizes):
    """read -> the one mask `attention` takes: booleans and-ed; additive masks summed, with
    any boolean mask folded in as -inf."""
    if not masks:
        return lambda read: None

    def value(read):
        vis, add = None, None
        for m in masks:
            val = _relayout(read(m.ref), m.labels, "bhqk", sizes)
            if m.boolean:
                val = jnp.logical_not(val) if m.negate else val
                vis = val if vis is None else vis & val
            else:
                val = val.astype(jnp.float32) * m.factor
                add = val if add is None else add + val
        return vis if add is None else add if vis is None else jnp.where(vis, add, -jnp.inf)

    return value


def _packed_source(g, att):
    """(qkv, axis) when q, k and v are slices 0, 1, 2 of one rank-5 array along its axis 0 or
    2, each squeezed to [B, S, H, D] exactly as the op takes it (one QKV projection's
    output: `qkv[:, :, i]`); `ops.attention_packed` then reads that array in place. Else None."""
    if (att.q_labels, att.k_labels, att.v_labels) != (tuple("bqhd"), tuple("bkhd"), tuple("bkhe")):
        return None
    src = axis = None
    for i, ref in enumerate((att.q, att.k, att.v)):
        sq = g.op(ref, "squeeze")
        sl = g.op(sq.ins[0], "slice") if sq is not None and len(sq.params["dimensions"]) == 1 else None
        if sl is None:
            return None
        a, x, p = sq.params["dimensions"][0], sl.ins[0], sl.params
        whole = all(d == a or (b == 0 and e == n) for d, (b, e, n) in
                    enumerate(zip(p["start_indices"], p["limit_indices"], x.shape)))
        if (len(x.shape) != 5 or a not in (0, 2) or x.shape[a] != 3 or not whole or p["start_indices"][a] != i
                or any(st != 1 for st in p["strides"] or ()) or (src is not None and (x is not src or a != axis))):
            return None
        src, axis = x, a
    return src, axis


def _packed_projections(g, att):
    """(projections.Packed, None) when q, k and v are three projections of one input that
    only this attention uses (see projections.py); (None, the reason) when they are three
    projections of one input that cannot be packed; else (None, None)."""
    refs, unit = [], []
    for ref, labels, want in ((att.q, att.q_labels, "bqhd"), (att.k, att.k_labels, "bkhd"),
                              (att.v, att.v_labels, "bkhe")):
        node = g.op(ref, "reshape")  # nnx's grouped-query view [B, S, H, 1, D]
        if node is not None and _unit_reshape(node):
            ref, labels = node.ins[0], _backward(node, labels)
            unit.append(node)
        if labels != tuple(want):
            return None, None
        refs.append(ref)
    found = projections.pack(g, *refs)
    if not isinstance(found, projections.Packed):
        return None, found
    found = dataclasses.replace(found, nodes=[*unit, *found.nodes])
    members = {*att.nodes, *found.nodes}
    if any(g.producer.get(r) in members for r in found.inputs()):
        return None, "an input of a projection is computed inside the attention"
    roles = {**att.roles, **{n: "q/k/v projection" for n in found.nodes}}
    why = private_violation(g, list(members), att.anchor, roles)
    return (found, None) if why is None else (None, why)


def match_attention(g, anchor, options):
    """softmax(scale * Q Kᵀ (+ masks)) (dropout) · V ending at the dot_general `anchor`."""
    if anchor.prim != "dot_general":
        return None
    for pi in (0, 1):
        att = _Attn(g, anchor, pi)
        if att.parse():
            break
        if att.near_miss is not None:
            return NearMiss(ATTN, anchor, att.near_miss[0], key=att.near_miss[1])
    else:
        return None
    drop = att.drop
    if drop is not None and not options.rewrite_dropout:
        return NearMiss(ATTN, anchor, match_dropout.NOT_REWRITTEN, key=("drop", id(drop.bernoulli)))
    causal = att.causal()
    att.take([*att.post, *(drop.nodes if drop else []), *att.sm.nodes], "attention probabilities")
    att.take([n for n, _, _ in att.steps] + [att.qk], "attention scores")
    att.take([n for _, kind, shift in att.steps if kind == "shift" for n in shift], "the scores' row maximum")
    why = private_violation(g, att.nodes, anchor, att.roles)
    if why is not None:
        return NearMiss(ATTN, anchor, why, key=("attention", id(att.qk)))
    sizes, masks, scale = att.sizes, list(att.masks), att.scale
    rate = drop.rate if drop is not None else 0.0
    mask = _mask_builder(masks, sizes)
    out_dtype = anchor.outs[0].dtype

    runtime = att.q_scales or att.k_scales  # q and k are then scaled apart from any packing
    packed = _packed_source(g, att) if not runtime else None
    projected, unpacked = (None, None) if packed is not None or runtime else _packed_projections(g, att)
    if projected is not None:
        att.take(projected.nodes, "q/k/v projection")
    # The packed array x·W + bias, read only by the three slices: the same add through
    # ops.bias_add, whose bias gradient is a fused column sum. (The original add and
    # slices are left in place, unread, and dropped as dead code.)
    biased = projections.bias_add_of(g, packed[0]) if packed is not None and g.uses[packed[0]] == 3 else None

    def attend(read, qkv=None, dense=None):
        """The match's output; `qkv`, when given, is the packed array with its bias added
        (rewrite.scan_products computes it another way). `dense` = (x, w, bias, axes,
        shared): the packed array is that product (rewrite.scan_products), run with the
        attention as one ops.dense_attention_packed; with `shared`, the result is (the
        output, x handed on)."""
        kw = dict(mask=mask(read), causal=causal, scale=scale, dropout_rate=rate,
                  key=read(drop.key) if drop is not None else None)
        shared = dense is not None and dense[4]
        if dense is not None:
            x, w, bias, axes, _ = dense
            got = ops.dense_attention_packed(x, w, bias, axes=axes, with_input=shared, **kw)
            out, again = got if shared else (got, None)
        elif packed is not None:
            if qkv is None:
                qkv = ops.bias_add(read(biased[0]), read(biased[1])) if biased is not None else read(packed[0])
            out = ops.attention_packed(qkv, axis=packed[1], **kw)
        elif projected is not None and projected.apart:
            out = ops.attention_projected(*projected.operands(read), **kw)
        elif projected is not None:
            out = ops.attention_packed(projected.build(read), axis=2, **kw)
        else:
            q = _scaled(read, _relayout(read(att.q), att.q_labels, "bqhd", sizes), att.q_scales, "bqhd", sizes)
            k = _scaled(read, _relayout(read(att.k), att.k_labels, "bkhd", sizes), att.k_scales, "bkhd", sizes)
            v = _relayout(read(att.v), att.v_labels, "bkhe", sizes)
            out = ops.attention(q, k, v, **kw)
        outs = [_relayout(out, tuple("bqhe"), att.out_labels, sizes).astype(out_dtype)]
        return (outs, again) if shared else outs

    detail = _describe(att, causal, rate)
    if packed is not None:
        detail += f", q/k/v read in place from one {shapes(packed[0])} array (attention_packed, axis {packed[1]})"
        if biased is not None:
            detail += f", its bias {shapes(biased[1])} added by ops.bias_add"
    elif projected is not None:
        detail += f", {projected.describe()}"
    elif unpacked is not None:
        detail += f", q/k/v projections of one input not packed: {unpacked}"
    # For scan_products: the packed array's (product, bias) and the build taking it
    # (`dense` only where the product writes the [B, S, 3, H, D] layout), or Flax's three
    # projections (the Packed that attention_projected takes) and the build.
    if biased is not None:
        attrs = dict(biased=biased, attend=attend, dense_ok=packed[1] == 2)
    elif projected is not None and projected.apart:
        attrs = dict(projected=projected, attend=attend)
    else:
        attrs = {}
    return Match(ATTN, anchor, att.nodes, dict(q=att.q, k=att.k, v=att.v, key=drop.key if drop is not None else None),
                 attend, detail, attrs=attrs)


def _describe(att, causal, rate):
    parts = [f"q {shapes(att.q)}, k {shapes(att.k)}, v {shapes(att.v)}", f"scale={att.scale:.6g}"]
    for side, scales in (("q", att.q_scales), ("k", att.k_scales)):
        parts += [f"{side} {'divided' if div else 'multiplied'} by {shapes(src)} computed at run time"
                  for src, _, div in scales]
    if causal:
        parts.append("causal")
    for m in att.masks:
        parts.append(("boolean" if m.boolean else "additive") + f" mask {shapes(m.ref)}")
    parts.append(f"dropout rate={rate:g}{att.drop.note}" if rate else "no dropout")
    fills = [m.fill for m in att.masks if m.boolean] + ([att.causal_fill] if causal else [])
    if att.sm.zero_rows and len(fills) == 1:
        fills = []  # softmax(where=mask) gives hidden rows 0 as the fused op does
    if any(np.isfinite(f) for f in fills):
        parts.append("fully-masked rows give 0 instead of the mean of v")
    elif fills:
        parts.append("fully-masked rows give 0 instead of NaN")
    if any(not m.boolean for m in att.masks):
        parts.append("a row whose additive mask is below -256 everywhere gets its unmasked attention "
                     "(f32 code: the mean of v)")
    return ", ".join(parts)
