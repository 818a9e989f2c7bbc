"""Softmax recognition, and the softmax(+dropout) matcher.

A softmax over axis a of x is recognized from its parts, whatever library wrote it:
  p = e / keepdims(reduce_sum(e, a)) (or e times its reciprocal),  e = exp(x - shift) or exp(x),
where `shift` is any value constant along a built from a reduce_max of x (or of a
transpose/reshape/convert of x) through max/broadcast/transpose/reshape/stop_gradient
and logsumexp's where(isfinite(m), m, 0).
Softmax is shift-invariant, so the shift only has to be constant along a; which row
statistic it is changes rounding, never the value. This covers jax.nn.softmax without
the `jax_softmax_custom_jvp` flag, written-out max/exp/sum/div, and the transposed chain
of jax.nn.dot_product_attention. In bf16/f16 the sum may be taken in f32,
e / downcast(reduce_sum(upcast(e))), as flax.linen attention does. In log space,
exp(x - logsumexp(x)) and exp(log_softmax(x)) are the same softmax (`_parse_logspace`).
With the flag, jax.nn.softmax is a `custom_jvp_call`; the whole call is matched when its
body is such a softmax of its first operand, of a transpose of it (`Softmax.perm`:
jax.nn.dot_product_attention's chain, or vmap over an axis other than the first), or of
where(mask, x, -inf) for `where=mask` (`Softmax.mask`, the call's second operand, of the
scores' rank or lower, broadcast and transposed to its axes as numpy or vmap does:
`Softmax.mask_axes`); its derivative rule is then replaced by the fused op's, which
computes the same derivative. In bf16/f16 a masked sum converts e before the where
(jax.nn.softmax(where=): sum(where(mask, upcast(e), 0))) or after it (jnp.sum).

`match_softmax_dropout` rewrites softmax (+ dropout on its output, see match_dropout)
over the last axis to `jaxsub.ops.softmax_dropout`. Masks and scales before the softmax
stay as they are, so the values are the original's (a row of -inf gives zeros instead of
NaN). Softmax over another axis is a near-miss: the kernel normalizes the last axis and
moving the axis costs a transpose of the scores in memory.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxsub import ops
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import labels as L
from jaxsub.rewrite import match_dropout
from jaxsub.rewrite.patterns import ACTIVATION_DTYPES, F32, Match, NearMiss, private_violation, shapes, unit_view

SOFTMAX = "softmax_dropout"
_SHIFT_OPS = ("broadcast_in_dim", "reshape", "transpose", "stop_gradient", "max", "convert_element_type")
_VIEW_OPS = ("transpose", "reshape", "convert_element_type")


@dataclasses.dataclass
class Softmax:
    x: G.Ref        # the scores
    axis: int       # normalized axis of x
    nodes: list     # the softmax's nodes, its output node first
    out: G.Ref
    zero_rows: bool = False  # jax.nn.softmax(where=): a row the mask hides everywhere is 0
    # jax.nn.softmax's custom_jvp_call (`_softmax_call`) only:
    mask: G.Ref | None = None  # where= inside the call: the softmax of where(mask, x, -inf)
    mask_axes: tuple | None = None  # the axis of `out` each mask axis is (None: a unit axis)
    perm: tuple | None = None  # a transpose inside the call: out = transpose(softmax(x), perm)

    def out_labels(self, labels):
        """The labels of `out`, given x's."""
        return labels if self.perm is None else tuple(labels[p] for p in self.perm)


def _keepdims(g: G.Graph, ref, shape, axis):
    """(row, node) when `ref` is `row` (shape without `axis`) with `axis` put back as 1."""
    node = g.op(ref, "broadcast_in_dim", "reshape")
    if node is None:
        return None
    row = node.ins[0]
    want = shape[:axis] + shape[axis + 1:]
    if row.shape != want or ref.shape[:axis] + ref.shape[axis + 1:] != want or ref.shape[axis] != 1:
        return None
    if node.prim == "broadcast_in_dim":
        dims = tuple(node.params["broadcast_dimensions"])
        if dims != tuple(i for i in range(len(shape)) if i != axis):
            return None
    return row, node


def _views_of(g: G.Graph, x):
    """x and the values x is a transpose/reshape/convert of."""
    out = [x]
    node = g.op(x, *_VIEW_OPS)
    while node is not None and len(out) < 8:
        out.append(node.ins[0])
        node = g.op(node.ins[0], *_VIEW_OPS)
    return out


def shift_of(g: G.Graph, ref, x, axis):
    """The nodes computing `ref`, a row maximum of x constant along `axis`; None otherwise."""
    if len(ref.shape) != len(x.shape) or ref.shape[axis] != 1:
        return None
    nodes, sources = [], _views_of(g, x)
    while True:
        node = g.producer.get(ref)
        if node is None or len(nodes) > 12:
            return None
        nodes.append(node)
        if node.prim == "reduce_max":
            src = node.ins[0]
            if any(src is s for s in sources):
                return nodes
            for s in sources:
                if _same_value(g, src, s):  # a second computation of x, for the max
                    return [*nodes, *_copy_nodes(g, src, s)]
            return None
        if node.prim == "select_n":
            # jax.nn.logsumexp's where(isfinite(m), m, 0): a function of the row maximum
            finite = g.op(node.ins[0], "is_finite") if len(node.ins) == 3 else None
            if finite is None or finite.ins[0] is not node.ins[2] or g.scalar(node.ins[1]) != 0.0:
                return None
            nodes.append(finite)
            ref = node.ins[2]
            continue
        if node.prim not in _SHIFT_OPS:
            return None
        if node.prim == "max":
            # max(initial, row max): jax.nn.softmax's `initial=-inf`, a scalar.
            rest = [r for r in node.ins if r.shape != ()]
            if len(rest) != 1:
                return None
            ref = rest[0]
        else:
            ref = node.ins[0]


def _same_value(g: G.Graph, a, b, depth: int = 6) -> bool:
    """Whether a and b are the same value: one ref, equal scalar constants, or the same
    primitive with the same parameters on the same values (jax.nn.softmax(where=) masks
    the scores once for their maximum and once for the exponent, each time broadcasting
    the mask and the fill anew; `exp(s - m) / exp(s - m).sum()` exponentiates twice)."""
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    sa, sb = g.scalar(a), g.scalar(b)
    if sa is not None or sb is not None:
        return sa is not None and sb is not None and sa == sb
    na, nb = g.producer.get(a), g.producer.get(b)
    if (depth == 0 or na is None or nb is None or na.prim != nb.prim or len(na.outs) != 1 or len(nb.outs) != 1
            or len(na.ins) != len(nb.ins) or na.eqn.effects or nb.eqn.effects):
        return False
    try:
        same_params = na.params == nb.params
    except Exception:  # params that do not compare (arrays)
        return False
    return bool(same_params) and all(_same_value(g, x, y, depth - 1) for x, y in zip(na.ins, nb.ins))


def _copy_nodes(g: G.Graph, a, b) -> list:
    """The nodes of a's computation that b does not share, when _same_value(g, a, b)."""
    if a is b or g.scalar(a) is not None:
        return []
    na, nb = g.producer[a], g.producer[b]
    return [na, *(n for x, y in zip(na.ins, nb.ins) for n in _copy_nodes(g, x, y))]


def _where_zero(g: G.Graph, ref, pred=None):
    """(pred, value, node) when ref is where(pred, value, 0) (with `pred` given: the same
    predicate), else None."""
    node = g.op(ref, "select_n")
    if node is None or len(node.ins) != 3 or node.ins[0].dtype != jnp.bool_ or g.scalar(node.ins[1]) != 0.0:
        return None
    if pred is not None and not _same_value(g, node.ins[0], pred):
        return None
    return node.ins[0], node.ins[2], node


def _jax_rule(node, name: str, *modules) -> bool:
    """Whether a `custom_jvp_call`'s derivative rule is JAX's function `name` in one of
    `modules` (paths under jax/_src), told by the rule's source in its debug info."""
    rule = node.params.get("jvp_jaxpr_fun", node.params.get("jvp_jaxpr_thunk"))
    where = getattr(getattr(rule, "debug_info", None), "func_src_info", None) or ""
    found, _, path = where.partition(" at ")
    return found == name and any(os.path.join("jax", "_src", *m.split("/")) in path for m in modules)


def _jax_softmax_rule(node) -> bool:
    """Whether a `custom_jvp_call`'s derivative rule is jax.nn.softmax's own (under
    jax_softmax_custom_jvp, the default from jax 0.12.1 on, which also moved the rule from
    nn/functions.py to ops/special.py). A user's custom_jvp around a softmax has a rule of
    its own, which the fused op would drop."""
    return _jax_rule(node, "_softmax_jvp", "nn/functions.py", "ops/special.py")


def _softmax_call(node):
    """The Softmax of jax.nn.softmax's `custom_jvp_call`: a softmax of its first operand,
    or of a transpose of it (jax.nn.dot_product_attention's chain), or with `where=`, the
    softmax of where(mask, x, -inf) with the hidden rows 0 (the mask its second operand)."""
    jaxpr, consts = G._body(node.params)
    if node.params.get("num_consts", 0) or len(node.outs) != 1 or jaxpr is None or not _jax_softmax_rule(node):
        return None
    # The scalar operands' values (the max's `initial`) are the body's to read.
    body = G.build(jaxpr, consts, [G.known(r) if r.shape == () else None for r in node.ins])
    found = parse(body, body.outvars[0])
    if found is None:
        return None
    x, claimed, mask, perm = found.x, set(found.nodes), None, None
    if found.zero_rows:  # x = where(mask, scores, -inf), as _where_softmax checked
        select = body.op(x, "select_n")
        pred = select.ins[0]
        # The mask operand, broadcast to the scores (numpy style, or under vmap more than
        # once and transposed, its axes then anywhere): `axes` labels each of its axes with
        # the masked scores' axis it becomes (None: a unit axis broadcast).
        src, axes = pred, tuple(range(len(x.shape)))
        while (view := body.op(src, "broadcast_in_dim", "transpose")) is not None and view.ins[0].shape != ():
            src, axes = view.ins[0], L.backward(view, axes)
        if not any(src is r for r in body.invars[1:]):
            return None
        mask = node.ins[body.invars.index(src)]
        claimed.add(select)
        x = select.ins[2]
    transpose = body.op(x, "transpose")
    if transpose is not None and transpose.ins[0] is body.invars[0]:
        perm = tuple(transpose.params["permutation"])
        claimed.add(transpose)
        x = transpose.ins[0]
    if x is not body.invars[0]:
        return None
    # Anything else in the body may only prepare scalars (the `initial` of the max) or
    # broadcast them and the mask to the scores' shape (vmap broadcasts them twice and may
    # transpose the mask).
    spread = {id(r) for r in body.invars[1:]}
    for n in body.nodes:
        if n in claimed or all(r.shape == () for r in n.outs):
            continue
        if (n.prim not in ("broadcast_in_dim", "transpose")
                or not all(r.shape == () or id(r) in spread for r in n.ins)):
            return None
        spread.update(id(r) for r in n.outs)
    if any(r.shape != () and r is not mask for r in node.ins[1:]):
        return None
    axis = found.axis if perm is None else perm[found.axis]
    return Softmax(node.ins[0], axis, [node], node.outs[0], zero_rows=found.zero_rows, mask=mask,
                   mask_axes=axes if mask is not None else None, perm=perm)


def _widening(node) -> bool:
    return jnp.finfo(node.outs[0].dtype).eps < jnp.finfo(node.ins[0].dtype).eps


def _narrowed(g: G.Graph, ref, dtype, casts):
    """The f32 value `ref` is a downcast of to `dtype` (recorded in `casts`), else `ref`."""
    node = g.op(ref, "convert_element_type")
    if node is None or ref.dtype != dtype or node.ins[0].dtype != F32 or dtype == F32:
        return ref
    casts.append(node)
    return node.ins[0]


def parse(g: G.Graph, ref):
    """The Softmax whose output is `ref`, or None."""
    node = g.producer.get(ref)
    if node is None:
        return None
    if node.prim == "custom_jvp_call":
        return _softmax_call(node)
    if node.prim == "select_n":
        return _where_softmax(g, ref)
    if node.prim == "exp":
        return _parse_logspace(g, ref, node)
    return _parse_div(g, ref, node)


def _unit_views(g: G.Graph, ref) -> dict:
    """ref and the values it is a keepdims view of, each with the view nodes above it."""
    out, nodes = {ref: []}, []
    view = unit_view(g, ref)
    while view is not None and len(out) < 6:
        nodes = [*nodes, view[1]]
        out[view[0]] = nodes
        view = unit_view(g, view[0])
    return out


def _log_sum(g: G.Graph, ref):
    """(reduce_sum node, added ref or None, nodes) when `ref` is log(sum(e)) over one axis, the
    sum's abs taken or not, plus a value `added` (logsumexp's shift) or not, through keepdims
    views anywhere along the chain."""
    nodes, added, seen_log = [], None, False
    while len(nodes) < 10:
        view = unit_view(g, ref)
        if view is not None:
            nodes.append(view[1])
            ref = view[0]
            continue
        node = g.producer.get(ref)
        if node is None:
            return None
        if node.prim == "add" and not seen_log and added is None and len(node.ins) == 2:
            for i in (0, 1):
                inner = _log_sum(g, node.ins[i])
                if inner is not None and inner[1] is None:
                    return inner[0], node.ins[1 - i], [*nodes, node, *inner[2]]
            return None
        if node.prim == "log" and not seen_log:
            seen_log = True
        elif node.prim == "abs" and seen_log:
            pass
        elif (node.prim == "convert_element_type" and seen_log and node.ins[0].dtype == F32
              and node.outs[0].dtype != F32):  # a bf16/f16 logsumexp's f32 sum, narrowed before the log
            pass
        elif node.prim == "reduce_sum" and seen_log and len(node.params["axes"]) == 1:
            return node, None, [*nodes, node]
        else:
            return None
        nodes.append(node)
        ref = node.ins[0]
    return None


def _parse_logspace(g: G.Graph, ref, node):
    """The softmax in log space, exp(x - lse) with lse = log(sum(exp(x - m))) + m for a shift
    m of x's row maximum (jnp.exp(s - jax.nn.logsumexp(s, a, keepdims=True)); from jax
    0.12.1 on that logsumexp is a custom_jvp_call of the same body), or
    exp(y - log(sum(exp(y)))) with y = x - m or y = x (jnp.exp(jax.nn.log_softmax(s, a))).
    Both are exp(x - m) / sum(exp(x - m)) when the two m are one value; a row of -inf,
    whose original is NaN, gives zeros, as for the other forms."""
    diff = g.op(node.ins[0], "sub")
    if diff is None or diff.ins[0].shape != ref.shape or len(ref.shape) == 0:
        return None
    a, lse = diff.ins
    call = _logsumexp_call(g, lse, a)
    if call is not None:  # the checks on the call's body; the call is claimed whole
        call, views = call
        body = G.build(*G._body(call.params), [None])
        found = _log_sum_exp(body, body.outvars[0], body.invars[0], a.dtype)
        claimed = [*views, call]
    else:
        found = _log_sum_exp(g, lse, a, ref.dtype)
        claimed = found[1] if found is not None else []
    if found is None:
        return None
    axis, _, shifted = found
    if lse.shape != ref.shape[:axis] + (1,) + ref.shape[axis + 1:]:
        return None
    nodes = [node, diff, *claimed]
    return Softmax(a, axis, nodes, ref) if shifted else _unshifted(g, a, axis, nodes, ref)


def _logsumexp_call(g: G.Graph, lse, a):
    """(the call, the keepdims views after it) when `lse` is jax.nn.logsumexp(a) as a
    custom_jvp_call (jax >= 0.12.1) with no b= or where= operand, else None."""
    views, src = [], lse
    while (view := unit_view(g, src)) is not None and len(views) < 6:
        src, views = view[0], [*views, view[1]]
    call = g.op(src, "custom_jvp_call")
    if (call is None or len(call.ins) != 1 or call.ins[0] is not a or len(call.outs) != 1
            or call.params.get("num_consts", 0) or G._body(call.params)[0] is None
            or not _jax_rule(call, "_logsumexp_impl_jvp", "ops/special.py")):
        return None
    return call, views


def _log_sum_exp(g: G.Graph, lse, a, dtype):
    """(axis, nodes, shifted) when lse = log(sum(exp(a - m))) + m for a shift m of a's row
    maximum (shifted), or log(sum(exp(a))) (not), over one axis of a, through keepdims
    views, else None."""
    found = _log_sum(g, lse)
    if found is None:
        return None
    red, added, nodes = found
    axis = int(red.params["axes"][0])
    if red.ins[0].shape != a.shape:
        return None
    summed, up = red.ins[0], g.op(red.ins[0], "convert_element_type")
    if up is not None and summed.dtype == F32 and up.ins[0].dtype == dtype != F32:
        summed, nodes = up.ins[0], [*nodes, up]  # the bf16/f16 exponentials summed in f32
    exp = g.op(summed, "exp")
    if exp is None:
        return None
    nodes = [*nodes, exp]
    if added is None:  # log_softmax: y - log(sum(exp(y)))
        return (axis, nodes, False) if exp.ins[0] is a else None
    inner = g.op(exp.ins[0], "sub")  # logsumexp: exp(a - m) summed, m added back
    if inner is None or inner.ins[0] is not a:
        return None
    m = inner.ins[1]
    shift = shift_of(g, m, a, axis)
    if shift is None:
        return None
    views_m, views_added = _unit_views(g, m), _unit_views(g, added)
    common = next((r for r in views_m if r in views_added), None)
    if common is not None:
        return axis, [*nodes, inner, *shift, *views_added[common]], True
    if _same_value(g, added, m):  # the maximum computed twice
        return axis, [*nodes, inner, *shift, *_copy_nodes(g, added, m)], True
    return None


def _unshifted(g: G.Graph, x, axis, nodes, ref):
    """The Softmax of x, or of y where x = y - shift (the shift's nodes then belong to it)."""
    sub = g.op(x, "sub")
    if sub is not None and sub.ins[0].shape == x.shape:
        shift = shift_of(g, sub.ins[1], sub.ins[0], axis)
        if shift is not None:
            return Softmax(sub.ins[0], axis, [*nodes, sub, *shift], ref)
    return Softmax(x, axis, nodes, ref)


def _where_softmax(g: G.Graph, ref):
    """jax.nn.softmax(x, where=w): where(w, e / sum(where(w, e, 0)), 0) with
    e = exp(where(w, x, -inf) - shift). That is the softmax of where(w, x, -inf), a row
    that w hides everywhere giving zeros, as the fused ops give it: the Softmax of the
    masked scores."""
    outer = _where_zero(g, ref)
    if outer is None:
        return None
    pred, inner, select = outer
    div = g.producer.get(inner)
    sm = _parse_div(g, inner, div, pred) if div is not None else None
    if sm is None:
        return None
    masked = g.op(sm.x, "select_n")
    if (masked is None or len(masked.ins) != 3 or not _same_value(g, masked.ins[0], pred)
            or g.scalar(masked.ins[1]) != float("-inf")):
        return None
    return Softmax(sm.x, sm.axis, [select, *sm.nodes], ref, zero_rows=True)


def _parse_div(g: G.Graph, ref, node, pred=None):
    """The Softmax e / keepdims(sum(e)) at `node` (with `pred`: the sum of where(pred, e, 0)),
    also written e * (1 / keepdims(sum(e))) or with jnp.reciprocal."""
    recip = []
    if node.prim == "mul" and len(node.ins) == 2:
        for e, inverse in (node.ins, node.ins[::-1]):
            inv = g.op(inverse, "div", "integer_pow")
            if inv is None or e.shape != ref.shape:
                continue
            if inv.prim == "div" and g.scalar(inv.ins[0]) == 1.0:
                denom, recip = inv.ins[1], [inv]
                break
            if inv.prim == "integer_pow" and inv.params["y"] == -1:
                denom, recip = inv.ins[0], [inv]
                break
        else:
            return None
    elif node.prim != "div" or node.ins[0].shape != ref.shape:
        return None
    else:
        e, denom = node.ins
    exp = g.op(e, "exp")
    # A softmax in bf16/f16 may sum in f32: e / downcast(sum(upcast(e))), the downcast
    # before or after the keepdims broadcast. The fused op does exactly that (f32 sum,
    # output in e's dtype), so the two converts belong to the softmax.
    casts = []
    denom = _narrowed(g, denom, e.dtype, casts)
    bcast = g.producer.get(denom)
    if exp is None or bcast is None or not bcast.ins:
        return None
    red = g.op(_narrowed(g, bcast.ins[0], e.dtype, casts), "reduce_sum")
    if red is None or len(red.params["axes"]) != 1 or len(casts) > 1:
        return None
    summed, masked_sum, up = red.ins[0], [], None
    if pred is not None:
        # On bf16/f16 the sum is sum(where(pred, upcast(e), 0)) (jax.nn.softmax(where=)) or
        # sum(upcast(where(pred, e, 0))) (jnp.sum of a 16-bit where): either converts e.
        up = g.op(summed, "convert_element_type")
        up = up if up is not None and casts and _widening(up) else None
        where = _where_zero(g, up.ins[0] if up is not None else summed, pred)
        if where is None:
            return None
        summed, masked_sum = where[1], [where[2]]
    elif summed is not e and g.op(summed, "exp") is not None and _same_value(g, summed, e):
        # exp(s - m) / exp(s - m).sum(): the numerator computed twice
        summed, masked_sum = e, _copy_nodes(g, summed, e)
    if summed is not e and up is None:
        up = g.op(summed, "convert_element_type")
        if up is None or up.ins[0] is not e or not casts or not _widening(up):
            return None
    elif summed is not e or bool(casts) != (up is not None):
        return None
    casts += [up] if up is not None else []
    axis = int(red.params["axes"][0])
    kept = _keepdims(g, denom, e.shape, axis)
    if kept is None or kept[0] is not bcast.ins[0]:
        return None
    return _unshifted(g, exp.ins[0], axis, [node, *recip, kept[1], red, exp, *casts, *masked_sum], ref)


def match_softmax_dropout(g, anchor, options):
    """dropout(softmax(x)) or softmax(x) over x's last axis at `anchor`."""
    if len(anchor.outs) != 1:
        return None
    drop = match_dropout.parse(g, anchor.outs[0])
    sm = parse(g, drop.h if drop is not None else anchor.outs[0])
    if sm is None:
        return None
    x, rank = sm.x, len(sm.x.shape)
    # jax.nn.softmax's call on a transpose of its operand (vmap with in_axes other than 0):
    # the softmax of that transpose, normalizing the output's axis
    axis = sm.axis if sm.perm is None else sm.perm.index(sm.axis)
    if rank < 2 or x.dtype not in ACTIVATION_DTYPES or sm.out.dtype != x.dtype:
        return None
    why = match_dropout.not_rewritten(options, drop)
    if why is not None:
        return NearMiss(SOFTMAX, anchor, why, key=("drop", id(drop.bernoulli)))
    if axis != rank - 1:
        return NearMiss(SOFTMAX, anchor, f"softmax over axis {axis} of {shapes(sm.out)}, not the last: "
                        "the kernel normalizes the last axis", key=("softmax", id(sm.nodes[0])))
    nodes = sm.nodes + (drop.nodes if drop is not None else [])
    if anchor not in nodes:
        return None
    why = private_violation(g, nodes, anchor)
    if why is not None:
        return NearMiss(SOFTMAX, anchor, why, key=("softmax", id(sm.nodes[0])))
    rate = drop.rate if drop is not None else 0.0

    def build(read):
        key = read(drop.key) if drop is not None else None
        scores = read(x) if sm.perm is None else jnp.transpose(read(x), sm.perm)
        if sm.mask is not None:  # (the mask's axes at theirs in the scores, 1 elsewhere)
            axes = sm.mask_axes
            mask = L.arrange(read(sm.mask), axes, tuple(range(rank)), dict(zip(axes, sm.mask.shape)))
            scores = jnp.where(mask, scores, -jnp.inf)
        return [ops.softmax_dropout(scores, rate=rate, key=key)]

    desc = f"scores {shapes(sm.out)}" + (f", dropout rate={rate:g}{drop.note}" if drop else ", no dropout")
    return Match(SOFTMAX, anchor, nodes, dict(x=x, key=drop.key if drop else None), build, desc)
