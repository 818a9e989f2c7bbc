"""Bias + GELU (+ dropout) matcher; the bias may be absent (gelu(x @ w), a zero bias then).

GELU has many spellings (jax.nn.gelu's erfc form, 0.5*v*(1+erf(v/sqrt2)), the tanh
approximation with integer_pow or v*v*v, ...). Instead of one template per spelling, the
matcher takes the elementwise subgraph between the bias add v = x + bias and the
activation's output -- it must read nothing but v and scalar constants, use only
arithmetic, erf/erfc/tanh/sigmoid and float converts, and contain erf/erfc (exact) or
tanh/sigmoid (approximate: v sigmoid(2u) = v (1 + tanh u) / 2) -- and evaluates it in
float64 on probe points spanning the activation's curved region and both tails, out to
|v| = 1e4. It is accepted when it agrees with that GELU to 1e-6 everywhere (a test on
those points, not a proof); the two GELUs differ by up to 5e-4 there (relative to
1 + |gelu|), and a wrong constant or operator moves some probe by far more.

In bf16/f16 code the constants are roundings (sqrt(1/2) is 0.70703125 in bf16), which
moves the function by far more than 1e-6. Such a constant is evaluated as the GELU
constant it is the rounding of (see `_KNOWN`), only when it is exactly that rounding in
the dtype it is held in; any other narrow constant is evaluated as it is and then fails
the 1e-6 check unless it is exact (0.5, 1, 3). So in bf16 0.80078125 (0.8 rounded) is
not taken for sqrt(2/pi) (0.796875): it is the next value of bf16's grid.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxsub import ops
from jaxsub.rewrite import match_dropout
from jaxsub.rewrite.patterns import (ACTIVATION_DTYPES, F32, Match, NearMiss, narrow, private_violation,
                                     rounded, shapes, split_vec)

BGD = "bias_gelu_dropout"
_MAX_NODES = 24
# The curved region densely, and the tails out to 1e4 (a term that vanishes on [-6, 6] but
# not beyond, such as 0.1 v (1 + tanh(10 (v - 8))), was taken for GELU; found by probing).
_TAILS = np.geomspace(6.5, 1e4, 24)
_PROBES = np.concatenate([np.linspace(-6.0, 6.0, 97), [-0.3, 0.05, 0.7, 2.2], _TAILS, -_TAILS])
_erf = np.vectorize(math.erf)
_EVAL = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a ** b,
    "neg": lambda a: -a,
    "square": lambda a: a * a,
    "sqrt": np.sqrt,
    "tanh": np.tanh,
    "logistic": lambda a: 0.5 * (1.0 + np.tanh(0.5 * a)),  # sigmoid, without exp's overflow
    "erf": _erf,
    "erfc": lambda a: 1.0 - _erf(a),
    "copy": lambda a: a,
    "convert_element_type": lambda a: a,
}


# Irrational constants of GELU's spellings, which bf16/f16 code holds rounded.
_KNOWN = (math.sqrt(2.0), math.sqrt(0.5), math.sqrt(2.0 / math.pi), 0.044715,
          0.044715 * math.sqrt(2.0 / math.pi), math.sqrt(math.pi / 2.0), 1.0 / math.sqrt(math.pi),
          2.0 / math.sqrt(math.pi))


def _constant(g, ref):
    """The value a scalar constant of the subgraph is evaluated with: the GELU constant it
    is the bf16/f16 rounding of, else its own value."""
    c = g.scalar(ref)
    dtype = g.precision(ref)
    if c is None or not narrow(dtype):
        return c
    for k in _KNOWN:
        for value in (k, -k):
            if c in rounded(value, dtype):
                return value
    return c


def _exact(t):
    return 0.5 * t * (1.0 + _erf(t / math.sqrt(2.0)))


def _tanh(t):
    return 0.5 * t * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3)))


def _elementwise(g, node, shape):
    if node.prim not in _EVAL and node.prim != "integer_pow":
        return False
    if node.prim == "convert_element_type" and node.outs[0].dtype not in ACTIVATION_DTYPES:
        return False
    return node.outs[0].shape == shape


def _bias_add(g, ref, n):
    node = g.op(ref, "add")
    return (node, split_vec(g, node, n)) if node is not None else (None, None)


def _subgraph(g, out):
    """(v, bias add split, nodes in evaluation order) of the elementwise function ending at
    `out` whose single non-constant leaf is a bias add output v, or (v, None, nodes) where
    that leaf is any other value of out's shape (a GELU without a bias: gelu(x @ w));
    None otherwise."""
    n = out.shape[-1]
    leaf, split, seen, order = None, None, set(), []

    def visit(ref):
        nonlocal leaf, split
        if ref is leaf or g.scalar(ref) is not None:
            return True
        node, s = _bias_add(g, ref, n)
        if s is not None:
            if leaf is not None and leaf is not ref:
                return False
            leaf, split = ref, (node, s)
            return True
        node = g.producer.get(ref)
        if node is None or not _elementwise(g, node, out.shape):
            if ref.shape != out.shape or (leaf is not None and leaf is not ref):
                return False
            leaf, split = ref, None
            return True
        if len(seen) >= _MAX_NODES:
            return False
        if node in seen:
            return True
        seen.add(node)
        if not all(visit(r) for r in node.ins):
            return False
        order.append(node)
        return True

    if not visit(out) or leaf is None:
        return None
    return leaf, split, order


def _evaluate(g, order, leaf, out):
    vals = {leaf: _PROBES}
    for node in order:
        args = [vals[r] if r in vals else _constant(g, r) for r in node.ins]
        if node.prim == "integer_pow":
            vals[node.outs[0]] = args[0] ** node.params["y"]
        else:
            vals[node.outs[0]] = _EVAL[node.prim](*args)
    return np.broadcast_to(vals[out], _PROBES.shape)


def _gelu(g, out):
    """(x, bias, approximate, nodes) when `out` is gelu(x + bias)."""
    found = _subgraph(g, out)
    if found is None:
        return None
    leaf, split, order = found
    if split is None:  # no bias: the leaf itself is the GELU's input
        add, x, bias = None, leaf, None
    else:
        add, (x, bias) = split
    prims = {n.prim for n in order}
    if prims & {"erf", "erfc"}:
        approximate, want = False, _exact(_PROBES)
    elif prims & {"tanh", "logistic"}:  # v * sigmoid(2 c (v + 0.044715 v^3)) is the tanh form
        approximate, want = True, _tanh(_PROBES)
    else:
        return None
    with np.errstate(all="ignore"):
        got = _evaluate(g, order, leaf, out)
    if not np.all(np.abs(got - want) <= 1e-6 * (1.0 + np.abs(want))):
        return None
    return x, bias, approximate, [*order, add] if add is not None else order


def match_bias_gelu_dropout(g, anchor, options):
    """dropout(gelu(x + bias)) or gelu(x + bias) at `anchor`."""
    if len(anchor.outs) != 1 or not anchor.outs[0].shape:
        return None
    out = anchor.outs[0]
    drop, down = match_dropout.parse(g, out), []
    cast = g.op(out, "convert_element_type") if drop is None and out.dtype != F32 else None
    if cast is not None and cast.ins[0].dtype == F32:
        # The GELU of an upcast and its dropout both in float32, rounded once at the end,
        # as the fused op computes them (left unfused until a probe round).
        drop = match_dropout.parse(g, cast.ins[0])
        down = [cast] if drop is not None else []
    gelu = _gelu(g, drop.h if drop is not None else out)
    if gelu is None:
        return None
    x, bias, approximate, nodes = gelu
    if x.dtype not in ACTIVATION_DTYPES or x.dtype != out.dtype:
        return None
    if bias is not None and bias.dtype not in (x.dtype, F32):
        return None
    if not nodes:  # the GELU's input is its output: no GELU
        return None
    why = match_dropout.not_rewritten(options, drop)
    if why is not None:
        return NearMiss(BGD, anchor, why, key=("drop", id(drop.bernoulli)))
    if drop is not None:
        nodes = [*down, *drop.nodes, *nodes]
    why = private_violation(g, [anchor, *nodes] if anchor not in nodes else nodes, anchor)
    if why is not None:
        return NearMiss(BGD, anchor, why, key=("gelu", id(nodes[-1])))
    rate = drop.rate if drop is not None else 0.0

    def build(read):
        key = read(drop.key) if drop is not None else None
        xv = read(x)
        b = read(bias) if bias is not None else jnp.zeros(xv.shape[-1:], xv.dtype)
        return [ops.bias_gelu_dropout(xv, b, rate=rate, key=key, approximate=approximate)]

    kind = "tanh" if approximate else "exact"
    desc = (f"x {shapes(x)}, {kind} GELU" + (", no bias (a zero bias)" if bias is None else "")
            + (f", dropout rate={rate:g}{drop.note}" if drop else ", no dropout"))
    return Match(BGD, anchor, nodes if anchor in nodes else [anchor, *nodes],
                 dict(x=x, bias=bias, key=drop.key if drop else None), build, desc)
