"""Packing the q, k and v projections of self-attention into one (the paper's algebraic
fusion of the QKV projections), for the attention matcher.

Flax's `MultiHeadDotProductAttention` and `nnx.MultiHeadAttention` project the input with
three `DenseGeneral`s: q = x·W_q + b_q, k = x·W_k + b_k, v = x·W_v + b_v, each a
dot_general of the same x (and a bias add). When the three agree in everything but the
weights, their results are the slices of one product with the weights stacked:
x·[W_q | W_k | W_v] + [b_q | b_k | b_v], each output element the same dot product over the
same contraction. That product has the [B, S, 3, H, D] layout `ops.attention_packed`
reads in place, so the fused kernels take q, k and v from it without copies, and the
backward has one input-gradient product and one bias reduction instead of three of each
and the additions between them (bench/NOTES.md, "Packed projections and short-sequence
dQ").

Where the three have Flax's form (x [B, S, E] · w [E, H, D] + bias), the matcher calls
`ops.attention_projected` instead: the same packed gradient, but three products in the
forward, each adding its own bias in its GEMM's epilogue, where the stacked bias is a
kernel of its own (bench/NOTES.md, seventeenth session).

Taken only when the projections are private to the attention (each product used only by
its bias add, each q/k/v only by the attention), which the matcher checks with the
nodes returned here.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxsub import ops
from jaxsub.rewrite import graph as G


@dataclasses.dataclass(frozen=True)
class Projection:
    x: G.Ref
    w: G.Ref
    bias: G.Ref | None
    dot: G.Node
    add: G.Node | None


def _projection(g: G.Graph, ref) -> Projection | None:
    """ref = dot_general(x, w) [+ bias], no batch dims, bias of the product's rank and dtype."""
    add = g.op(ref, "add")
    if add is None:
        dot = g.op(ref, "dot_general")
        return Projection(dot.ins[0], dot.ins[1], None, dot, None) if dot is not None else None
    for prod, bias in (add.ins, add.ins[::-1]):
        dot = g.op(prod, "dot_general")
        if (dot is not None and prod is not bias and prod.shape == ref.shape and prod.dtype == ref.dtype
                and bias.dtype == ref.dtype and len(bias.shape) == len(ref.shape)
                and all(b in (1, r) for b, r in zip(bias.shape, ref.shape))):
            return Projection(dot.ins[0], dot.ins[1], bias, dot, add)
    return None


@dataclasses.dataclass(frozen=True)
class Packed:
    """q, k and v as one projection; `build(read)` gives the [B, S, 3, H, D] array, and
    where `apart` holds, `operands(read)` gives `ops.attention_projected`'s arguments."""
    projections: tuple
    nodes: list
    w_axis: int      # where the weights are stacked
    dims: tuple      # the packed product's dimension numbers
    apart: bool = False  # x [B, S, E] · w [E, H, D] (+ bias [1, 1, H, D]), all of one dtype

    def operands(self, read):
        """(x, the three weights, the three biases [H, D] or None) for attention_projected."""
        first = self.projections[0]
        weights = tuple(read(p.w) for p in self.projections)
        if first.bias is None:
            return read(first.x), weights, None
        return read(first.x), weights, tuple(read(p.bias).reshape(p.bias.shape[2:]) for p in self.projections)

    def stacked(self, read):
        """(x, the weights stacked [E, 3, H, D], the three biases [H, D]) of the `apart` form,
        for ops.dense_attention_packed (zero biases where the projections have none), which
        stacks the biases for the GEMM's epilogue and gives their gradients apart."""
        x, weights, biases = self.operands(read)
        if biases is None:
            biases = (jnp.zeros(weights[0].shape[1:], weights[0].dtype),) * 3
        return x, jnp.stack(weights, axis=1), tuple(biases)

    def build(self, read):
        first = self.projections[0]
        w = jnp.stack([read(p.w) for p in self.projections], axis=self.w_axis)
        params = {**first.dot.params, "dimension_numbers": self.dims}
        out = first.dot.eqn.primitive.bind(read(first.x), w, **params)
        if first.bias is None:
            return out
        # Each bias has the product's rank (unit or full dims): stacked on the new axis,
        # it broadcasts against the packed product as each did against its own. (XLA runs
        # this add as a kernel of its own: it folds only a bias that is a parameter of the
        # jitted function into the GEMM's epilogue; tools/bias_epilogue.py.)
        bias = jnp.stack([read(p.bias) for p in self.projections], axis=2)
        if bias.shape == (1, 1, *out.shape[2:]) and bias.dtype == out.dtype:
            # [1, 1, 3, H, D]: its gradient by the fused column sum (a bias broadcast over
            # heads or head dims, e.g. [1, 1, 3, 1, D], stays XLA's add)
            return ops.bias_add(out, bias.reshape(bias.shape[2:]))
        return out + bias

    def inputs(self) -> list:
        """The values `build` reads: x, the weights and the biases."""
        return [self.projections[0].x, *(r for p in self.projections for r in (p.w, p.bias) if r is not None)]

    def describe(self, dense: bool = False) -> str:
        """How the match runs the projections; `dense`: as rewrite.scan_products runs the
        `apart` form on the GPU (`stacked`)."""
        p = self.projections[0]
        head = f"q/k/v projections x{list(p.x.shape)} @ w{list(p.w.shape)}" + (" + bias" if p.bias is not None else "")
        if dense:
            return (f"{head} as one ops.dense_attention_packed on the weights and biases stacked (the bias gradient "
                    f"from the attention's backward)")
        if self.apart:
            return f"{head} as three products, their gradient packed (attention_projected)"
        return f"{head} computed as one product with the weights stacked (attention_packed, axis 2)"


def _suffix(shape, of) -> bool:
    return 0 < len(shape) < len(of) and tuple(shape) == tuple(of[len(of) - len(shape):])


def bias_add_of(g: G.Graph, ref):
    """(product, bias) when `ref` = add(product, bias broadcast over leading axes), with
    bias a suffix of ref's shape (as `ops.bias_add` takes it) of ref's dtype; else None.
    The bias may arrive broadcast (broadcast_in_dim onto the trailing axes) or reshaped
    with leading unit axes."""
    add = g.op(ref, "add")
    if add is None:
        return None
    for prod, bias in (add.ins, add.ins[::-1]):
        while not _suffix(bias.shape, ref.shape):
            node = g.op(bias, "broadcast_in_dim", "reshape")
            if node is None:
                break
            src = node.ins[0]
            if node.prim == "broadcast_in_dim":
                trailing = range(len(bias.shape) - len(src.shape), len(bias.shape))
                ok = tuple(node.params["broadcast_dimensions"]) == tuple(trailing)
            else:
                ok = tuple(d for d in bias.shape if d != 1) == tuple(d for d in src.shape if d != 1)
            if not ok:
                break
            bias = src
        if (prod is not bias and prod.shape == ref.shape and prod.dtype == ref.dtype == bias.dtype
                and _suffix(bias.shape, ref.shape)):
            return prod, bias
    return None


def pack(g: G.Graph, q, k, v) -> Packed | str | None:
    """The packed form of q, k, v ([B, S, H, D] each) when each is x·W_i (+ b_i) of one x,
    with the same dimension numbers, dtypes and parameters. When they are three
    projections of one x that cannot be packed, the reason (for explain()); else None."""
    projs = [_projection(g, r) for r in (q, k, v)]
    if (any(p is None for p in projs) or len({id(r) for r in (q, k, v)}) != 3
            or any(p.x is not projs[0].x for p in projs)):
        return None
    first = projs[0]
    (lc, rc), (lb, rb) = first.dot.params["dimension_numbers"]
    if lb or rb or len(first.x.shape) - len(lc) != 2 or len(first.dot.outs[0].shape) != 4:
        return "the products are not [B, S, E] x weights -> [B, S, H, D]"
    for p in projs:
        if p.w.shape != first.w.shape or p.w.dtype != first.w.dtype:
            return "their weights differ in shape or dtype"
        if dict(p.dot.params) != dict(first.dot.params) or p.dot.outs[0].shape != first.dot.outs[0].shape:
            return "their dot_general parameters differ"
        if (p.bias is None) != (first.bias is None) or (p.bias is not None and p.bias.shape != first.bias.shape):
            return "their biases differ (present in some only, or in shape)"
    # Stack the weights on a new axis before their first free dim: the product's output
    # is (x's free dims, w's free dims in order), so the new axis lands right after x's
    # two free dims, at position 2 of [B, S, 3, H, D].
    free = [d for d in range(len(first.w.shape)) if d not in rc]
    axis = free[0]
    dims = ((tuple(lc), tuple(c + (c >= axis) for c in rc)), ((), ()))
    nodes = [n for p in projs for n in (p.dot, p.add) if n is not None]
    return Packed(tuple(projs), nodes, axis, dims, _apart(first))


def _apart(p: Projection) -> bool:
    """Whether the projections have attention_projected's form: x [B, S, E] · w [E, H, D]
    contracting E, default precision, x, w, the product and a [1, 1, H, D] bias of one dtype."""
    params = p.dot.params
    out = p.dot.outs[0]
    return (tuple(map(tuple, params["dimension_numbers"][0])) == ((2,), (0,)) and len(p.w.shape) == 3
            and params.get("precision") is None and params.get("preferred_element_type") in (None, out.dtype)
            and p.x.dtype == p.w.dtype == out.dtype
            and (p.bias is None or tuple(p.bias.shape) == (1, 1, *p.w.shape[1:])))
