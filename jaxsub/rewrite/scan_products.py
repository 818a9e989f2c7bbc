"""Products through jaxsub's GEMM target (`patterns.plan` runs `fuse` on every graph).

On GPU, in a scan body that runs fused ops (and so goes through `jaxsub.stack.scan`), every
plain bf16/f16 product x · w (x's last axes against w's first) as `ops.dense`: XLA reads a
custom call's operands in place when they are slices of the stacks (the layer's weights,
the residuals the backward's products read) and writes a weight gradient into its stack
in place, where it copies them for its own GEMMs (the scanned `jaxsub.flax.Encoder` does
the same: bench/NOTES.md, nineteenth session). A packed q/k/v product whose bias an
attention match adds takes the bias into the GEMM's epilogue (twentieth session), and runs
with the attention as one `ops.dense_attention_packed`, whose backward also returns the
bias gradient (fortieth and forty-first sessions).

Outside scan bodies (a single layer) nothing is copied, but the products still gain, as
`jaxsub.flax.EncoderLayer` runs them: the attention's q/k/v product takes its bias
gradient from the attention's backward instead of a column sum over the [B, S, 3, H, D]
gradient, and, where the product's input is read again (a post-LN layer's residual),
that read's gradient is added into dx by the dx product instead of by an XLA add.
`OUTSIDE` says what `fuse` takes outside scans: "all" (every plain product too, through
`ops.dense` as in a scan; the default), "attention" (only that product) or "none"; the
environment's JAXSUB_OPTIMIZE_PRODUCTS sets it at import. On the H200 "all" measured
fastest (b8×s512 layer: 0.729 and 0.746 ms in two runs against 0.765 for "none" and 0.775
for "attention"; fewer XLA kernels beside the products: bench/NOTES.md, forty-second
session).

(Until the thirty-first session a bias + GELU + dropout feeding a product also became one
`ops.bias_gelu_dropout_dense`, whose backward writes the GELU output again rather than the
scan keeping it. Since the custom calls write the scan's residuals into its stacks in
place, keeping it measured faster: bench/NOTES.md, thirty-first session.)
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jaxsub import ops
from jaxsub.ops import gemm as _gemm
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import patterns as P


# Whether products go through ops.dense: None means on GPU (on CPU XLA's dot is faster
# than the target's loops); tests set it.
LIBRARY: bool | None = None


def _library() -> bool:
    return jax.default_backend() == "gpu" if LIBRARY is None else bool(LIBRARY)


# What fuse takes outside scan bodies (module docstring).
OUTSIDE: str = os.environ.get("JAXSUB_OPTIMIZE_PRODUCTS", "all")
_OUTSIDE_MODES = ("all", "attention", "none")


def _plain(node, y, w) -> bool:
    """Default precision and one float dtype for y, w and the product."""
    precision = node.params.get("precision")
    if precision not in (None, (None, None)) or w.dtype != y.dtype or node.outs[0].dtype != y.dtype:
        return False
    preferred = node.params.get("preferred_element_type")
    return (preferred is None or jnp.dtype(preferred) == jnp.dtype(y.dtype)) and y.dtype in P.ACTIVATION_DTYPES


def dense_axes(node) -> int | None:
    """k when `node` is x [..., K1..Kk] · w [K1..Kk, N...], x's last k axes contracted with
    w's first k in order, no batch axes, at least one N axis (`ops.dense`'s form); else None."""
    if node.prim != "dot_general" or len(node.ins) != 2:
        return None
    x, w = node.ins
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    k = len(lc)
    if lb or rb or k < 1 or len(w.shape) <= k or not _plain(node, x, w):
        return None
    # The pairs may come in any order (einsum "bshd,hde->bse" lists them (3, 1), (2, 0)).
    pairs = sorted(zip(lc, rc))
    if pairs != list(zip(range(len(x.shape) - k, len(x.shape)), range(k))):
        return None
    return k


def _projected(g: G.Graph, match: P.Match) -> P.Match:
    """An attention match on Flax's three q/k/v projections (x [B, S, E] · w_i [E, H, D]
    + b_i, `ops.attention_projected`'s form) as one ops.dense_attention_packed on the
    weights and biases stacked, as the q/k/v product of a packed kernel runs: one product
    through the GEMM target instead of three of XLA's, the bias gradient from the
    attention's backward, and, where x is read again (a post-LN layer's residual), that
    read's gradient added into dx by the dx product instead of by an XLA add. The stack
    (6 MB for BERT-large) is the price; attention_projected stacks the weights in its
    backward too."""
    packed = match.attrs["projected"]
    x = packed.projections[0].x
    if not _gemm.in_place_pays(x.dtype):
        return match
    dots = {p.dot for p in packed.projections}
    shared = x.value is None and P.consumers(g, x) > len(dots)

    def build(read, attend=match.attrs["attend"]):
        xv, w, bias = packed.stacked(read)
        return _attend_dense(read, attend, x, (xv, w, bias, 1, shared))

    return dataclasses.replace(
        match, build=build,
        description=match.description.replace(packed.describe(), packed.describe(dense=True))
        + (_SHARED if shared else ""))


# explain's note for a product whose input is read again (`dense_and_input`'s hand-on).
_SHARED = "; its input's other uses read it from there (their gradient added in the product's backward)"


def _attend_dense(read, attend, x, dense):
    """The attention match's outputs with its packed q/k/v as the product `dense` = (x, w,
    bias, axes, shared), run as one ops.dense_attention_packed; with `shared`, x's later
    readers take the copy it hands on (their gradient added by the dx product)."""
    got = attend(read, dense=dense)
    if not dense[4]:
        return got
    outs, again = got
    return P.Rebound(outs, {x: again})


def fuse(g: G.Graph, plan: P.Plan, scan: bool) -> P.Plan:
    """`plan` with, on GPU and where the graph runs fused ops already (a scan body that
    does not keep lax.scan, and with it forward-mode differentiation): a packed q/k/v
    product whose bias an attention match adds as one ops.dense with the bias in the
    GEMM's epilogue (in a scan body the sum is then the custom call's result, which the
    scan writes into its residual stack in place (`jaxsub.stack`), where XLA's add wrote
    it and copied it there), run with the attention as one ops.dense_attention_packed
    where the match allows; and, in a scan body (`scan`) or with OUTSIDE "all", each
    other product of `ops.dense`'s form that no match has claimed as an ops.dense match.
    Outside scan bodies OUTSIDE "none" leaves `plan` as it is."""
    if scan:
        mode = "all"
    elif OUTSIDE in _OUTSIDE_MODES:
        mode = OUTSIDE
    else:
        raise ValueError(f"jaxsub.optimize: JAXSUB_OPTIMIZE_PRODUCTS (scan_products.OUTSIDE) must be one of "
                         f"{', '.join(_OUTSIDE_MODES)}, got {OUTSIDE!r}")
    if not _library() or not plan.at or mode == "none":
        return plan
    at, claimed = dict(plan.at), set()
    for anchor, match in plan.at.items():
        if match.pattern == "attention" and "projected" in match.attrs:
            at[anchor] = _projected(g, match)
            continue
        biased = match.attrs.get("biased") if match.pattern == "attention" else None
        node = g.op(biased[0], "dot_general") if biased is not None and g.uses[biased[0]] == 1 else None
        k = dense_axes(node) if node is not None else None
        if (k is None or node in at or node in plan.skip or biased[1].shape != node.ins[1].shape[k:]
                or not _gemm.in_place_pays(node.outs[0].dtype)):
            continue
        x, w, bias = node.ins[0], node.ins[1], biased[1]
        # x read again later (a post-LN layer's input, by the residual): those reads take
        # the copy dense_and_input hands on, so that their gradient is added into dx by
        # the dx product instead of by an XLA add.
        shared = x.value is None and P.consumers(g, x) > 1

        def build(read, x=x, w=w, bias=bias, k=k, attend=match.attrs["attend"], shared=shared,
                  together=match.attrs["dense_ok"]):
            if together:  # one ops.dense_attention_packed: the bias gradient from the attention's backward
                return _attend_dense(read, attend, x, (read(x), read(w), read(bias), k, shared))
            if not shared:
                return attend(read, ops.dense(read(x), read(w), read(bias), axes=k))
            y, again = _gemm.dense_and_input(read(x), read(w), read(bias), axes=k)
            return P.Rebound(attend(read, y), {x: again})

        claimed.add(node)
        at[anchor] = dataclasses.replace(
            match, build=build, inputs={**match.inputs, "x": x, "w": w, "bias": bias},
            description=f"{match.description}; the q/k/v product and its bias as one ops.dense"
                        + (" run with the attention as one ops.dense_attention_packed (the bias gradient from "
                           "the attention's backward)" if match.attrs["dense_ok"] else "")
                        + (_SHARED if shared else ""))
    for node in g.nodes if mode == "all" else ():
        k = dense_axes(node)
        if (k is None or node in at or node in claimed or node in plan.skip
                or not _gemm.in_place_pays(node.outs[0].dtype)):
            continue
        x, w = node.ins

        def build(read, x=x, w=w, k=k):
            return [ops.dense(read(x), read(w), axes=k)]

        at[node] = P.Match("dense", node, [node], {"x": x, "w": w}, build,
                           f"x·w ({P.shapes(x, w)}) through jaxsub's GEMM target"
                           + (", which XLA runs on the scan's slices in place" if scan else "") + " (ops.dense)")
    return dataclasses.replace(plan, at=at)
