"""Layer norm and bias-dropout-residual-layer-norm (BDRLN) matchers, and the residual
with dropout that no layer norm follows (a pre-LN layer's second residual).

Layer norm is recognized from its parts rather than from one spelling:
  y = centered * rstd [* scale] [+ bias], optionally inside an f32 upcast/downcast, where
  centered = x - mean(x), mean = reduce_sum(x, last axis) / N,
  rstd     = rsqrt(var + eps) | 1 / sqrt(var + eps) | a division by sqrt(var + eps),
             with sqrt(v) also as v ** 0.5 and rsqrt(v) as v ** -0.5,
  var      = mean((x - mean)^2) | mean(x^2) - mean^2 (optionally max(0, .)) | jnp.var,
the product in any association and with unit-axis reshapes/broadcasts anywhere; scale
and bias may be bf16/f16 parameters upcast to f32 (flax.linen.LayerNorm). This
covers hand-written jnp, flax.linen.LayerNorm (fast variance or not, any dtype) and
flax.nnx.LayerNorm. eps is read from the constant. Reductions over another axis are
near-misses.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxsub import ops
from jaxsub.ops import dropout as _dropout
from jaxsub.ops import norm as _norm
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import match_dropout
from jaxsub.rewrite.patterns import (ACTIVATION_DTYPES, F32, Copies, Match, NearMiss, Rebound, consumers,
                                     private_violation, read_after, shapes, split_vec, strip_row, strip_vec)

LN = "layer_norm"
BDRLN = "bias_dropout_residual_layer_norm"
BDR = "bias_dropout_residual"


@dataclasses.dataclass
class _Stat:
    x: G.Ref
    axes: tuple
    nodes: list


def _mean(g, ref):
    base, row = strip_row(g, ref)
    # jnp.mean of a 16-bit x sums it in f32 and rounds the mean back: look through both
    # converts (the kernels keep their statistics in f32).
    down = g.op(base, "convert_element_type")
    trip = []
    if down is not None and base.dtype in ACTIVATION_DTYPES and down.ins[0].dtype == F32:
        base, row_f32 = strip_row(g, down.ins[0])
        trip = [down, *row_f32]
    div = g.op(base, "div", "mul")  # sum / N, or sum * (1 / N)
    if div is None:
        return None
    summed, factor = div.ins
    if div.prim == "mul" and g.scalar(summed) is not None:
        summed, factor = factor, summed
    total, row2 = strip_row(g, summed)
    red = g.op(total, "reduce_sum")
    if red is None:
        return None
    x, axes = red.ins[0], tuple(red.params["axes"])
    n, c = float(math.prod(x.shape[a] for a in axes)), g.scalar(factor)
    if c is None or (c != n if div.prim == "div" else abs(c * n - 1.0) > 1e-6):
        return None
    if trip:
        up = g.op(x, "convert_element_type")
        if up is not None and up.ins[0].dtype == ref.dtype:
            x = up.ins[0]
            trip.append(up)
        elif x.dtype != F32:
            return None
        # else a statistic of f32 values, rounded back: jnp.var of a 16-bit x squares the
        # upcast x's deviations from its f32 mean (the caller matches what x is).
    return _Stat(x, axes, [*row, *trip, div, *row2, red])


def _square(g, ref):
    node = g.op(ref, "square", "integer_pow", "mul", "pow")
    if node is None:
        return None
    a = node.ins[0]
    if (node.prim == "square"
            or (node.prim == "integer_pow" and node.params["y"] == 2)
            or (node.prim == "mul" and node.ins[1] is a)
            or (node.prim == "pow" and g.scalar(node.ins[1]) == 2.0)):
        return a, node
    return None


class _Parse:
    """Accumulates the nodes of one candidate layer norm and the x's they read."""

    def __init__(self, g):
        self.g = g
        self.nodes, self.roles, self.xs, self.stats = [], {}, [], []
        self.one_pass = False

    def take(self, nodes, role):
        for n in nodes:
            if n not in self.roles:
                self.roles[n] = role
                self.nodes.append(n)

    def mean(self, ref, role="mean"):
        st = _mean(self.g, ref)
        if st is None:
            return False
        self.take(st.nodes, role)
        self.xs.append(st.x)
        self.stats.append(st)
        return True

    def centered(self, ref):
        node = self.g.op(ref, "sub")
        if node is None or node.ins[0].shape != ref.shape or not self.mean(node.ins[1]):
            return False
        self.take([node], "centered input")
        self.xs.append(node.ins[0])
        return True

    def variance(self, ref):
        g = self.g
        ref, row = strip_row(g, ref)
        self.take(row, "variance")
        clamp = g.op(ref, "max")
        if clamp is not None:
            for v, z in (clamp.ins, clamp.ins[::-1]):
                if g.scalar(z) == 0.0:
                    self.take([clamp], "variance")
                    ref, row = strip_row(g, v)
                    self.take(row, "variance")
                    break
        select = g.op(ref, "select_n")  # jnp.var guards ddof >= N with a constant predicate
        if select is not None and len(select.ins) == 3 and g.scalar(select.ins[0]) is not None:
            self.take([select], "variance")
            ref = select.ins[2] if g.scalar(select.ins[0]) else select.ins[1]
        st = _mean(g, ref)
        if st is not None:
            sq = _square(g, st.x)
            if sq is None or not self.centered(sq[0]):
                return False
            self.take([*st.nodes, sq[1]], "variance")
            self.stats.append(st)
            return True
        sub = g.op(ref, "sub")
        if sub is None:
            return False
        st = _mean(g, sub.ins[0])
        sq_x = _square(g, st.x) if st is not None else None
        m_ref, row = strip_row(g, sub.ins[1])
        sq_m = _square(g, m_ref)
        if sq_x is None or sq_m is None or not self.mean(sq_m[0]):
            return False
        self.take([sub, *st.nodes, sq_x[1], *row, sq_m[1]], "variance")
        self.stats.append(st)
        self.xs.append(sq_x[0])
        self.one_pass = True
        return True


def _factors(g, ref, sign, out, taken, depth=0):
    node = g.op(ref, "mul", "div")
    if node is None or depth > 4:
        out.append((ref, sign))
        return
    taken.append(node)
    _factors(g, node.ins[0], sign, out, taken, depth + 1)
    _factors(g, node.ins[1], -sign if node.prim == "div" else sign, out, taken, depth + 1)


def _inv_std(g, ref, sign):
    """(var + eps ref, nodes) when the factor is 1/sqrt(var + eps) in one of its spellings."""
    base, row = strip_row(g, ref)
    node = g.producer.get(base)
    if node is None:
        return None
    if sign > 0 and node.prim == "rsqrt":
        return node.ins[0], [*row, node]
    if sign < 0 and node.prim == "sqrt":
        return node.ins[0], [*row, node]
    if node.prim == "pow" and g.scalar(node.ins[1]) == -0.5 * sign:  # (var + eps) ** -0.5 or ** 0.5
        return node.ins[0], [*row, node]
    reciprocal = (node.prim == "div" and g.scalar(node.ins[0]) == 1.0) or (
        node.prim == "integer_pow" and node.params["y"] == -1)  # 1 / sqrt, jnp.reciprocal(sqrt)
    if sign > 0 and reciprocal:
        root = g.op(node.ins[-1], "sqrt", "pow")
        if root is not None and (root.prim == "sqrt" or g.scalar(root.ins[1]) == 0.5):
            return root.ins[0], [*row, node, root]
    return None


def _root(g, x):
    """(source, upcast node or None): looks through an f32 upcast of a float input."""
    conv = g.op(x, "convert_element_type")
    if conv is not None and x.dtype == F32 and conv.ins[0].dtype in ACTIVATION_DTYPES:
        return conv.ins[0], conv
    return x, None


@dataclasses.dataclass
class _LN:
    x: G.Ref
    scale: G.Ref | None
    bias: G.Ref | None
    eps: float
    nodes: list
    roles: dict
    upcast: bool
    core: G.Node   # the first reduction: identifies this layer norm across anchors
    one_pass: bool = False  # the program's variance is E[x^2] - mean^2


def _parse_ln(g, anchor):
    if len(anchor.outs) != 1 or not anchor.outs[0].shape:
        return None
    out = anchor.outs[0]
    n = out.shape[-1]
    p = _Parse(g)
    ref, node, down = out, anchor, None
    if node.prim == "convert_element_type":
        down = node
        p.take([node], "downcast")
        ref = node.ins[0]
        node = g.producer.get(ref)
    bias = scale = None
    if node is not None and node.prim == "add":
        split = split_vec(g, node, n, upcast=True)
        if split is not None:
            p.take([node], "normalized value")
            ref, bias = split
            node = g.producer.get(ref)
    if node is None or node.prim not in ("mul", "div"):
        return None
    factors, taken = [], []
    _factors(g, ref, 1, factors, taken)
    p.take(taken, "normalized value")
    var_eps, centered = None, 0
    for f, sign in factors:
        inv = _inv_std(g, f, sign) if var_eps is None else None
        if inv is not None:
            var_eps = inv[0]
            p.take(inv[1], "rstd")
        elif sign > 0 and centered == 0 and p.centered(f):
            centered = 1
        elif sign > 0 and g.scalar(f) == 1.0:
            continue
        elif sign > 0 and scale is None and strip_vec(g, f, n, upcast=True) is not None:
            scale = strip_vec(g, f, n, upcast=True)
        else:
            return None
    if var_eps is None or not centered:
        return None
    base, row = strip_row(g, var_eps)
    add = g.op(base, "add")
    if add is None:
        return None
    p.take([*row, add], "variance + eps")
    eps = None
    for v, e in (add.ins, add.ins[::-1]):
        e_val = g.scalar(e)
        if e_val is not None and e_val > 0 and math.isfinite(e_val) and p.variance(v):
            eps = e_val
            break
    if eps is None:
        return None
    for st in p.stats:
        if st.axes != (len(st.x.shape) - 1,):
            return NearMiss(LN, anchor, f"normalizes over axes {st.axes} of a rank-{len(st.x.shape)} "
                            "tensor; the fused layer norm reduces the last axis only",
                            key=("ln", id(p.stats[0].nodes[-1])))
    roots = [_root(g, x) for x in p.xs]
    if len({id(src) for src, _ in roots}) != 1 or any(x.shape != out.shape for x in p.xs):
        return None
    src = roots[0][0]
    upcasts = [c for _, c in roots if c is not None]
    if down is not None:
        if not upcasts or down.outs[0].dtype != src.dtype:
            return None
        p.take(upcasts, "upcast input")
        x = src
    else:
        x = p.xs[0]
        # A 16-bit layer norm whose statistics jnp.mean/jnp.var take in f32 upcasts x inside
        # them: those upcasts are its own (a BDRLN's residual sum is read by nothing else).
        if x is src:
            members = set(p.nodes)
            private = [c for c in upcasts
                       if g.uses[c.outs[0]] == sum(r is c.outs[0] for n in members for r in n.ins)]
            p.take(private, "upcast input")
    if x.dtype not in ACTIVATION_DTYPES or x.dtype != out.dtype:
        return None
    if any(v is not None and v.dtype not in ACTIVATION_DTYPES for v in (scale, bias)):
        return None
    return _LN(x, scale, bias, eps, p.nodes, p.roles, bool(upcasts), p.stats[0].nodes[-1], p.one_pass)


def _param(read, ref, x):
    """A scale/bias for the fused op, which takes x's dtype or float32. The matcher looks
    through exact bf16/f16 -> f32 upcasts of parameters (flax.linen.LayerNorm upcasts
    them for its f32 statistics), so a parameter of another dtype is upcast again here."""
    if ref is None:
        return None
    val = read(ref)
    return val if val.dtype in (x.dtype, F32) else val.astype(F32)


@dataclasses.dataclass
class _Residual:
    x: G.Ref
    residual: G.Ref
    bias: G.Ref | None
    drop: match_dropout.Dropout | None
    nodes: list


def _residual_candidates(g, x_ln):
    """Ways x_ln = residual + dropout(x + bias) (dropout and bias optional, not both absent)."""
    add = g.op(x_ln, "add")
    if add is None or not x_ln.shape:  # a scalar sum has no rows to normalize
        return
    n = x_ln.shape[-1]
    split = split_vec(g, add, n)
    if split is not None:  # (residual + x) + bias
        inner = g.op(split[0], "add")
        if inner is not None and all(r.shape == x_ln.shape for r in inner.ins):
            yield _Residual(inner.ins[1], inner.ins[0], split[1], None, [add, inner])
        return
    for res, t in (add.ins, add.ins[::-1]):
        drop = match_dropout.parse(g, t)
        h = drop.h if drop is not None else t
        biased = g.op(h, "add")
        split = split_vec(g, biased, n) if biased is not None else None
        if drop is None and split is None:
            continue
        x, bias = split if split is not None else (h, None)
        nodes = [add, *(drop.nodes if drop else []), *([biased] if split else [])]
        yield _Residual(x, res, bias, drop, nodes)


def _broadcast_masks(g, anchor, out, pattern):
    """Near-misses for a dropout on an operand of the residual add `out` whose mask is
    broadcast (flax's nn.Dropout(broadcast_dims=...)): left as written."""
    add = g.op(out, "add")
    misses = []
    for t in add.ins if add is not None else ():
        bern = match_dropout.drawn_mask(g, t)
        if bern is not None and bern.outs[0].shape != t.shape and match_dropout.parse(g, t) is None:
            misses.append(NearMiss(pattern, anchor, match_dropout.broadcast_mask(bern, t), key=("drop", id(bern))))
    return misses


def _extend(g, anchor, ln, options):
    """The BDRLN Match that grows `ln` backwards, and the near-misses met on the way."""
    broadcast = _broadcast_masks(g, anchor, ln.x, BDRLN)
    misses = list(broadcast)
    for c in _residual_candidates(g, ln.x):
        if (c.x.shape != ln.x.shape or c.residual.shape != ln.x.shape
                or c.x.dtype != ln.x.dtype or c.residual.dtype != ln.x.dtype
                or (c.bias is not None and c.bias.dtype not in (c.x.dtype, F32))):
            continue
        why = match_dropout.not_rewritten(options, c.drop)
        if why is not None:
            misses.append(NearMiss(BDRLN, anchor, why, key=("drop", id(c.drop.bernoulli))))
            continue
        roles = {**ln.roles, **{n: "residual sum" for n in c.nodes}}
        nodes = ln.nodes + c.nodes
        why = private_violation(g, nodes, anchor, roles)
        # The residual sum h read again after the layer norm (a pre-LN layer's residual
        # stream): the fused op hands it on (ops.norm.bdrln_and_sum).
        h = c.nodes[0].outs[0]
        after = read_after(g, h, anchor, nodes)
        with_sum = (why is not None and after is not None and bool(after or g.is_output(h))
                    and private_violation(g, nodes, anchor, roles, exempt=(h,)) is None)
        if why is not None and not with_sum:
            if not broadcast:  # (else the broadcast mask is the reason, not this reading's)
                misses.append(NearMiss(BDRLN, anchor, why, key=("bdrln", id(c.nodes[0]))))
            continue
        # Another reading matched this layer norm: the readings turned away before it are
        # no near-miss of it (a post-LN layer's previous LN bias taken for the residual's
        # bias, found by probing); a dropout left as written still is.
        kept = [m for m in misses if m.key is not None and m.key[0] == "drop"]
        return _bdrln_match(g, anchor, ln, c, with_sum), kept
    return None, misses


def _describe(ln, x, extra=""):
    parts = [f"x {shapes(x)}", f"eps={ln.eps:g}",
             "scale" if ln.scale is not None else "no scale",
             "bias" if ln.bias is not None else "no bias"]
    if ln.upcast:
        parts.append("f32 upcast")
    if ln.one_pass:  # the kernels' two-pass variance, exact where E[x^2] - mean^2 cancels
        parts.append("variance E[x^2] - mean^2 taken as E[(x - mean)^2]")
    return ", ".join(parts) + extra


def _bdrln_match(g, anchor, ln, c, with_sum=False):
    rate = c.drop.rate if c.drop is not None else 0.0
    # Read by two or more nodes (a post-LN layer's h: the next matmul and the next
    # residual): two outputs, so the backward kernel adds their cotangents itself.
    pair = consumers(g, anchor.outs[0]) >= 2 and not with_sum

    def build(read):
        key = read(c.drop.key) if c.drop is not None else None
        x = read(c.x)
        args = (x, read(c.bias) if c.bias is not None else None, read(c.residual),
                _param(read, ln.scale, x), _param(read, ln.bias, x))
        if with_sum:  # the later readers of the residual sum get the kernel's h
            y, h = _norm.bdrln_and_sum(*args, rate=rate, key=key, eps=ln.eps)
            return Rebound([y], {c.nodes[0].outs[0]: h})
        if pair:
            return [Copies(_norm.bdrln_pair(*args, rate=rate, key=key, eps=ln.eps))]
        return [ops.bias_dropout_residual_layer_norm(*args, rate=rate, key=key, eps=ln.eps)]

    inputs = dict(x=c.x, bias=c.bias, residual=c.residual, scale=ln.scale, ln_bias=ln.bias,
                  key=c.drop.key if c.drop is not None else None)
    extra = f", dropout rate={rate:g}{c.drop.note}" if c.drop is not None else ", no dropout"
    if pair:
        extra += ", output returned twice for its consumers (their gradients added in the kernel)"
    if with_sum:
        extra += (", the residual sum written too for its later readers (pre-LN; their gradient added "
                  "in the kernel)")
    return Match(BDRLN, anchor, ln.nodes + c.nodes, inputs, build, _describe(ln, c.x, extra))


def match_layer_norm(g, anchor, options):
    """Layer norm at `anchor`, grown into BDRLN when a residual add (with dropout and/or a
    bias) feeds it."""
    ln = _parse_ln(g, anchor)
    if not isinstance(ln, _LN):
        return ln
    why = private_violation(g, ln.nodes, anchor, ln.roles)
    if why is not None:
        return NearMiss(LN, anchor, why, key=("ln", id(ln.core)))
    bdrln, misses = _extend(g, anchor, ln, options)
    if bdrln is not None:
        bdrln.near_misses = misses
        return bdrln

    # x read again after the layer norm (a pre-LN layer's input, also its first residual):
    # the later readers get x from the fused op (ops.norm.layer_norm_and_input), whose
    # backward adds their gradient to dx.
    again = bool(read_after(g, ln.x, anchor, ln.nodes))

    def build(read):
        x = read(ln.x)
        scale, bias = _param(read, ln.scale, x), _param(read, ln.bias, x)
        if again:
            y, copy = _norm.layer_norm_and_input(x, scale, bias, eps=ln.eps)
            return Rebound([y], {ln.x: copy})
        return [ops.layer_norm(x, scale, bias, eps=ln.eps)]

    extra = ", x handed on to its later readers (their gradient added in the kernel)" if again else ""
    return Match(LN, anchor, ln.nodes, dict(x=ln.x, scale=ln.scale, bias=ln.bias), build,
                 _describe(ln, ln.x, extra), near_misses=misses)


def match_bias_dropout_residual(g, anchor, options):
    """residual + dropout(x [+ bias]) at `anchor` (the add) with no layer norm after it (a
    layer norm after it makes it BDRLN's, anchored later in the graph and so tried first):
    `ops.dropout.residual_add`, one kernel each way that draws the mask in the kernel and
    again in the backward, where XLA would generate bernoulli's bits and keep the mask.
    Without dropout there is nothing to fuse: XLA fuses the adds itself."""
    if anchor.prim != "add":
        return None
    out = anchor.outs[0]
    for c in _residual_candidates(g, out):
        if (c.drop is None or c.x.shape != out.shape or c.residual.shape != out.shape
                or c.x.dtype != out.dtype or c.residual.dtype != out.dtype or out.dtype not in ACTIVATION_DTYPES
                or (c.bias is not None and c.bias.dtype not in (c.x.dtype, F32))):
            continue
        why = match_dropout.not_rewritten(options, c.drop)
        if why is not None:
            return NearMiss(BDR, anchor, why, key=("drop", id(c.drop.bernoulli)))
        why = private_violation(g, c.nodes, anchor, {n: "residual sum" for n in c.nodes})
        if why is not None:
            return NearMiss(BDR, anchor, why, key=("bdr", id(anchor)))
        return _bdr_match(anchor, c)
    broadcast = _broadcast_masks(g, anchor, out, BDR)
    return broadcast[0] if broadcast else None


def _bdr_match(anchor, c):
    rate = c.drop.rate

    def build(read):
        x = read(c.x)
        bias = read(c.bias) if c.bias is not None else jnp.zeros(x.shape[-1:], x.dtype)
        return [_dropout.residual_add(read(c.residual), x, bias, rate=rate, key=read(c.drop.key))]

    inputs = dict(x=c.x, bias=c.bias, residual=c.residual, key=c.drop.key)
    detail = (f"x {shapes(c.x)}, " + ("bias" if c.bias is not None else "no bias")
              + f", dropout rate={rate:g}{c.drop.note}")
    return Match(BDR, anchor, c.nodes, inputs, build, detail)
