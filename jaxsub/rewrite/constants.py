"""Values computed from constants alone (iotas, literals), evaluated in broadcast form.

A mask such as a causal triangle is built from iotas, broadcasts, comparisons and selects.
Evaluated element by element it costs the whole [B, H, Sq, Sk] (and at S 8192 the iotas
alone are 256 MB each), so `value` keeps each array *compact*: the value's rank, with size
1 on every axis it does not vary over (numpy broadcasting does the rest). An iota is then a
vector, and only a comparison of a query vector with a key vector would grow to Sq × Sk:
past `_EAGER` elements it stays a `Compare`, a two-valued array `where(a OP b, t, f)` over
its compact operands, which layout and element-wise steps keep lazy and which
`qk_prefix` checks against a triangle in O(S).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxsub.rewrite import graph as G

# Compact arrays up to this many elements (their varying axes' product) are computed; a
# value past it is unknown, unless it is lazy (`Compare`, `Sum`).
LIMIT = 1 << 26
# Comparisons and integer sums whose compact result would exceed this stay lazy.
_EAGER = 1 << 20

_COMPARE = {"ge": np.greater_equal, "gt": np.greater, "le": np.less_equal, "lt": np.less,
            "eq": np.equal, "ne": np.not_equal}
_ELEMENTWISE = {**_COMPARE, "add": np.add, "sub": np.subtract, "mul": np.multiply,
                "and": np.bitwise_and, "or": np.bitwise_or, "not": np.invert}
_LAYOUT = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims"})
OPS = frozenset({"iota", "convert_element_type", "select_n", *_ELEMENTWISE, *_LAYOUT})


@dataclasses.dataclass(frozen=True)
class Compare:
    """where(op(a, b), true, false): a and b compact (the value's rank), true and false
    scalars of the value's dtype."""
    op: str
    a: np.ndarray
    b: np.ndarray
    true: np.ndarray
    false: np.ndarray

    def scalars(self):
        return self.true, self.false


@dataclasses.dataclass(frozen=True)
class Sum:
    """a + b: integer compact a and b (the value's rank) whose sum would be large, such as
    a key position minus a query position (`k - q <= 0` is then `k <= q`, a `Compare`)."""
    a: np.ndarray
    b: np.ndarray


_LAZY = (Compare, Sum)
_SMALL_INT = 1 << 30  # integer operands of a Sum, and its shifts, stay below this (no overflow)


def _small_ints(*xs) -> bool:
    return all(np.issubdtype(x.dtype, np.integer)
               and (x.size == 0 or int(np.abs(x.astype(np.int64)).max()) < _SMALL_INT) for x in xs)


def value(g: G.Graph, ref, memo):
    """The compact value of `ref` (a numpy array broadcastable to ref.shape, or a lazy
    `Compare` or `Sum`) when it is computed from constants alone, else None."""
    if ref.value is not None:
        val = G.known(ref)
        return None if val is None else np.asarray(val)
    if ref in memo:
        return memo[ref]
    memo[ref] = None  # (a graph has no cycles; this only bounds the work on failure)
    node = g.producer.get(ref)
    val = None
    if node is not None and node.prim in OPS and len(node.outs) == 1:
        if math.prod(ref.shape) == 0:
            val = np.zeros(ref.shape, ref.dtype)
        else:
            ins = [value(g, r, memo) for r in node.ins]
            if all(v is not None for v in ins):
                val = _apply(node, ins, ref)
    memo[ref] = val
    return val


def dense(val, shape):
    """val broadcast to `shape` (a read-only view), or None past LIMIT for a lazy value."""
    if isinstance(val, _LAZY):
        if math.prod(np.broadcast_shapes(val.a.shape, val.b.shape)) > LIMIT:
            return None
        val = (np.where(_COMPARE[val.op](val.a, val.b), val.true, val.false) if isinstance(val, Compare)
               else val.a + val.b)
    return np.broadcast_to(val, shape)


def span(val):
    """(min, max) over the elements of a compact value (for a `Compare`, over both its
    values: a superset), or None when it has none."""
    if isinstance(val, Compare):
        val = np.asarray(val.scalars())
    elif isinstance(val, Sum):  # the terms' extremes added (a superset)
        ends = span(val.a), span(val.b)
        return None if None in ends else (ends[0][0] + ends[1][0], ends[0][1] + ends[1][1])
    if val.size == 0:
        return None
    return val.min(), val.max()


def all_true(val) -> bool:
    if isinstance(val, Sum):
        return False
    if isinstance(val, Compare):
        return bool(val.true) and bool(val.false) if val.true.dtype == np.bool_ else False
    return val.dtype == np.bool_ and bool(val.all())


def _uniform(x):
    """x's one value where all its elements are equal, else None."""
    if x.size == 0:
        return None
    first = x.reshape(-1)[0]
    return first if x.size == 1 or bool(np.all(x == first)) else None


def _apply(node, ins, ref):
    prim, params, dtype = node.prim, node.params, ref.dtype
    if any(isinstance(v, Sum) for v in ins):
        return _sum_step(prim, params, ins, node, ref)
    lazy = [i for i, v in enumerate(ins) if isinstance(v, Compare)]
    if prim in _LAYOUT:
        x = ins[0]
        if lazy:
            a, b = (_layout(prim, params, y, node.ins[0].shape, ref.shape) for y in (x.a, x.b))
            return None if a is None or b is None else dataclasses.replace(x, a=a, b=b)
        return _layout(prim, params, x, node.ins[0].shape, ref.shape)
    if prim == "iota":
        dim = params["dimension"]
        shape = [1] * len(ref.shape)
        shape[dim] = ref.shape[dim]
        return np.arange(ref.shape[dim]).astype(dtype).reshape(shape)
    if prim == "convert_element_type":
        if lazy:
            x = ins[0]
            return dataclasses.replace(x, true=x.true.astype(dtype), false=x.false.astype(dtype))
        return ins[0].astype(dtype)
    if lazy:
        return _two_valued(node, ins, lazy, ref)
    size = math.prod(np.broadcast_shapes(*(v.shape for v in ins)))
    if prim in _COMPARE and size > _EAGER and len(ins) == 2:
        return Compare(prim, ins[0], ins[1], np.asarray(True), np.asarray(False))
    if prim in ("add", "sub") and size > _EAGER and _small_ints(*ins):
        return Sum(ins[0].astype(dtype), (ins[1] if prim == "add" else -ins[1]).astype(dtype))
    if size > LIMIT:
        return None
    with np.errstate(all="ignore"):
        if prim == "select_n":
            pred, cases = ins[0], ins[1:]
            out = np.where(pred, cases[1], cases[0]) if pred.dtype == np.bool_ else np.choose(pred, cases)
        else:
            out = _ELEMENTWISE[prim](*ins)
    return np.asarray(out).astype(dtype)


def _sum_step(prim, params, ins, node, ref):
    """A step on a `Sum`: layout steps on both terms; a shift or an integer scale of it;
    a comparison with a compact value c, as a `Compare` of one term with c minus the
    other (exact in integers of at most 2^30); anything else materialized if small."""
    x = next(v for v in ins if isinstance(v, Sum))
    if prim in _LAYOUT:
        a, b = (_layout(prim, params, y, node.ins[0].shape, ref.shape) for y in (x.a, x.b))
        return None if a is None or b is None else Sum(a, b)
    if prim == "convert_element_type" and np.issubdtype(ref.dtype, np.integer) and _small_ints(x.a, x.b):
        return Sum(x.a.astype(ref.dtype), x.b.astype(ref.dtype))
    other = [v for v in ins if v is not x]
    if (len(ins) == 2 and len(other) == 1 and not isinstance(other[0], _LAZY) and _small_ints(other[0])
            and math.prod(np.broadcast_shapes(x.a.shape, other[0].shape)) <= LIMIT):
        c, first = other[0], ins[0] is x
        with np.errstate(all="ignore"):
            if prim == "add":
                return Sum((x.a + c).astype(ref.dtype), x.b)
            if prim == "sub":
                return Sum((x.a - c).astype(ref.dtype), x.b) if first else Sum((c - x.a).astype(ref.dtype), -x.b)
            if prim == "mul" and _uniform(c) is not None and _small_ints(x.a.astype(np.int64) * c,
                                                                         x.b.astype(np.int64) * c):
                return Sum((x.a * c).astype(ref.dtype), (x.b * c).astype(ref.dtype))
            if prim in _COMPARE and _small_ints(c - x.b):
                t, f = np.asarray(True), np.asarray(False)
                return Compare(prim, x.a, c - x.b, t, f) if first else Compare(prim, c - x.b, x.a, t, f)
    return _materialized(node, ins, ref)


def _materialized(node, ins, ref):
    """The step on its lazy operands made dense, where their values fit LIMIT, else None."""
    shape = np.broadcast_shapes(*(np.broadcast_shapes(v.a.shape, v.b.shape) if isinstance(v, _LAZY) else v.shape
                                  for v in ins))
    if math.prod(shape) > LIMIT:
        return None
    return _apply(node, [np.ascontiguousarray(dense(v, shape)) if isinstance(v, _LAZY) else v for v in ins], ref)


def _two_valued(node, ins, lazy, ref):
    """An element-wise step on one `Compare` and operands of one value each: applied to
    the Compare's two values. select_n on a Compare predicate picks between two such
    operands. Anything else is materialized if small enough."""
    prim = node.prim
    if len(lazy) == 1:
        x = ins[lazy[0]]
        rest = [None if i in lazy else _uniform(v) for i, v in enumerate(ins)]
        if all(r is not None for i, r in enumerate(rest) if i not in lazy):
            if prim == "select_n" and lazy[0] == 0 and x.true.dtype == np.bool_ and len(ins) == 3:
                # select_n picks its second case where the predicate's value is True
                true, false = (rest[2] if bool(t) else rest[1] for t in x.scalars())
            elif prim != "select_n":
                with np.errstate(all="ignore"):
                    true, false = (_ELEMENTWISE[prim](*[s if r is None else r for r in rest])
                                   for s in x.scalars())
            else:
                true = None
            if true is not None:
                return dataclasses.replace(x, true=np.asarray(true).astype(ref.dtype),
                                           false=np.asarray(false).astype(ref.dtype))
    return _materialized(node, ins, ref)


def _layout(prim, params, x, in_shape, out_shape):
    """A layout step on a compact array x of a value shaped in_shape."""
    if x.ndim != len(in_shape):  # a literal scalar operand
        x = x.reshape((1,) * len(in_shape))
    if prim == "transpose":
        return np.transpose(x, params["permutation"])
    if prim == "reshape" and params.get("dimensions") is not None:
        return None
    if prim == "broadcast_in_dim":
        shape = [1] * len(out_shape)
        for i, d in enumerate(params["broadcast_dimensions"]):
            shape[d] = x.shape[i] if in_shape[i] == out_shape[d] else 1
        return x.reshape(shape)
    return _reshape(x, in_shape, out_shape)


def _reshape(x, in_shape, out_shape):
    """Reshape of a compact array: each group of axes that the reshape merges or splits
    keeps the compact form where its axes all vary or none does; else the whole value is
    materialized (up to LIMIT)."""
    shape, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        if i >= len(in_shape) or j >= len(out_shape):  # trailing unit axes
            if i < len(in_shape):
                i += 1
            else:
                shape.append(1)
                j += 1
            continue
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                gj.append(j)
                pj *= out_shape[j]
        i, j = i + 1, j + 1
        varies = {x.shape[a] != 1 for a in gi if in_shape[a] != 1}
        if len(varies) > 1:
            if math.prod(in_shape) > LIMIT:
                return None
            return np.broadcast_to(x, in_shape).reshape(out_shape)
        shape += [out_shape[b] if varies == {True} else 1 for b in gj]
    return x.reshape(shape)


def qk_prefix(val, labels, sq, sk, offset):
    """Whether a compact boolean value with axes `labels` is, over its "q" and "k" axes
    and equal along the others, `k <= q + offset` (a bottom-right causal triangle for
    offset Sk - Sq). A `Compare` of a query vector with a key vector is checked as a
    threshold per query (O(S)); a compact array, against the triangle."""
    def squeeze(x):
        for ax in reversed(range(x.ndim)):
            if labels[ax] in ("q", "k"):
                continue
            if x.shape[ax] != 1:
                if not np.all(x == np.take(x, [0], axis=ax)):
                    return None
                x = np.take(x, [0], axis=ax)
            x = np.squeeze(x, ax)
        keep = [l for l in labels if l in ("q", "k")]
        x = x.reshape(x.shape + (1,) * (2 - x.ndim)) if len(keep) < 2 else x
        if keep == ["k", "q"]:
            x = x.T
        elif keep == ["k"]:
            x = x.reshape(1, -1)
        elif not keep:
            x = x.reshape(1, 1)
        return x

    if [l for l in labels if l in ("q", "k")] not in (["q", "k"], ["k", "q"], ["q"], ["k"], []):
        return False
    rows = np.arange(sq)[:, None]
    if not isinstance(val, Compare):
        v = squeeze(val)
        if v is None or v.dtype != np.bool_ or math.prod(np.broadcast_shapes(v.shape, (sq, sk))) > LIMIT:
            return False
        return bool(np.array_equal(np.broadcast_to(v, (sq, sk)), np.arange(sk)[None, :] <= rows + offset))
    if val.true.dtype != np.bool_:
        return False
    a, b = squeeze(val.a), squeeze(val.b)
    flat = bool(val.true) == bool(val.false) or val.op in ("eq", "ne") or a is None or b is None
    op = val.op if flat or bool(val.true) else {"ge": "lt", "gt": "le", "le": "gt", "lt": "ge"}[val.op]
    # op(a, b) with one side over the queries only and the other over the keys only, as
    # key_value OP' threshold[q].
    if not flat and a.shape[1] == 1 and b.shape[0] == 1:
        x, thr, op = b[0], a[:, 0], {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt"}[op]
    elif not flat and a.shape[0] == 1 and b.shape[1] == 1:
        x, thr = a[0], b[:, 0]
    else:  # not a query vector against a key vector: element by element, if small enough
        full = dense(val, np.broadcast_shapes(val.a.shape, val.b.shape))
        return full is not None and qk_prefix(np.ascontiguousarray(full), labels, sq, sk, offset)
    x = np.broadcast_to(x, (sk,)).astype(np.float64)
    thr = np.broadcast_to(thr, (sq,)).astype(np.float64)
    if np.isnan(x).any() or np.isnan(thr).any() or max(np.abs(x).max(initial=0), np.abs(thr).max(initial=0)) >= 2 ** 53:
        return False
    lengths = np.clip(np.arange(sq) + offset + 1, 0, sk)  # visible keys per query: a prefix
    inf = np.array([np.inf])
    hi_pre = np.concatenate([-inf, np.maximum.accumulate(x)])[lengths]          # max of x[:L]
    lo_pre = np.concatenate([inf, np.minimum.accumulate(x)])[lengths]           # min of x[:L]
    hi_post = np.concatenate([np.maximum.accumulate(x[::-1])[::-1], -inf])[lengths]  # max of x[L:]
    lo_post = np.concatenate([np.minimum.accumulate(x[::-1])[::-1], inf])[lengths]   # min of x[L:]
    ok = {"le": (hi_pre <= thr) & (lo_post > thr), "lt": (hi_pre < thr) & (lo_post >= thr),
          "ge": (lo_pre >= thr) & (hi_post < thr), "gt": (lo_pre > thr) & (hi_post <= thr)}[op]
    return bool(ok.all())


def visible(val, factor, hidden_below):
    """An additive mask's compact value (times `factor`) as (a boolean compact value, True
    where it is 0, and the largest of its other values) when each of those is at most
    `hidden_below`; else (None, None)."""
    if isinstance(val, Sum):
        return None, None
    if isinstance(val, Compare):
        ends = [float(v) * factor for v in val.scalars()]
        if not all(e == 0 or e <= hidden_below for e in ends):
            return None, None
        hidden = [e for e in ends if e != 0]
        vis = dataclasses.replace(val, true=np.asarray(ends[0] == 0), false=np.asarray(ends[1] == 0))
        return vis, max(hidden, default=-math.inf)
    with np.errstate(all="ignore"):
        w = val.astype(np.float64) * factor
    if not bool(np.all((w == 0) | (w <= hidden_below))):
        return None, None
    return w == 0, float(w[w != 0].max(initial=-math.inf))


def invert(val):
    """not val, for a compact boolean value."""
    if isinstance(val, Compare):
        return dataclasses.replace(val, true=val.false, false=val.true)
    return np.invert(val)
