"""In a scan's body: bias + GELU + dropout and the product that consumes it, as one op.

Under `jax.grad` a scanned layer keeps the GELU output for the following product's weight
gradient, and a kept value is copied into the scan's residual stack and back out (32 MB
each way per BERT-large layer at 8 x 512). `ops.bias_gelu_dropout_dense` keeps the GELU's
input instead and has the backward kernel write its output again. In a single layer
nothing is copied, so this runs on scan bodies only (`patterns.plan`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxsub import ops
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import patterns as P


def _product(g: G.Graph, y) -> G.Node | None:
    """The one node reading `y`, when it is y [..., N] @ w [N, E] (contracting y's last
    axis with w's first, no batch axes, default precision, y's dtype throughout)."""
    if P.consumers(g, y) != 1 or g.uses[y] != 1 or g.is_output(y):
        return None
    node = next(n for n in g.nodes if any(r is y for r in n.ins))
    if node.prim != "dot_general" or node.ins[0] is not y or len(node.ins) != 2:
        return None
    w, out = node.ins[1], node.outs[0]
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    precision = node.params.get("precision")
    if (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) != ((len(y.shape) - 1,), (0,), (), ()) or len(w.shape) != 2:
        return None
    if precision not in (None, (None, None)) or w.dtype != y.dtype or out.dtype != y.dtype:
        return None
    preferred = node.params.get("preferred_element_type")
    if preferred is not None and jnp.dtype(preferred) != jnp.dtype(y.dtype):
        return None
    return node


def fuse(g: G.Graph, plan: P.Plan) -> P.Plan:
    """`plan` with each bias_gelu_dropout match whose output feeds only such a product
    replaced by one match of both, anchored at the product."""
    at, fused = dict(plan.at), set()
    for anchor, match in plan.at.items():
        if match.pattern != "bias_gelu_dropout" or not match.attrs:
            continue
        node = _product(g, anchor.outs[0])
        if node is None or node in plan.skip or node in at:
            continue
        x, bias, key = match.inputs["x"], match.inputs["bias"], match.inputs["key"]
        w, attrs = node.ins[1], match.attrs

        def build(read, x=x, bias=bias, key=key, w=w, attrs=attrs):
            return [ops.bias_gelu_dropout_dense(read(x), read(bias), read(w), rate=attrs["rate"],
                                                key=read(key) if key is not None else None,
                                                approximate=attrs["approximate"])]

        del at[anchor]
        fused.add(anchor)
        at[node] = dataclasses.replace(
            match, anchor=node, nodes=[*match.nodes, node], inputs={**match.inputs, "w": w}, build=build,
            description=f"{match.description}; with the product after it, whose backward writes the GELU "
                        "output again rather than keeping it in the scan (ops.bias_gelu_dropout_dense)")
    if not fused:
        return plan
    # The GELU matches' old anchors are consumed nodes now; the products are anchors.
    return dataclasses.replace(plan, at=at, skip=(plan.skip | fused) - set(at))
