"""The pattern registry and the search that places matches in a graph.

A matcher is `fn(graph, anchor, options) -> Match | NearMiss | None`. It is anchored at
the *last* node of its pattern and walks producers backwards. Anchors are tried from the
end of the graph to its start, so the largest pattern ending at a node wins (BDRLN before
its layer norm, bias+GELU+dropout before bias+GELU), and a node already claimed by a
match is never claimed again. Patterns register with `register`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxsub.rewrite import graph as G
from jaxsub.rewrite.labels import nonunit

ACTIVATION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Options:
    rewrite_dropout: bool = True
    # ids of mask draws (match_dropout.Dropout.bernoulli) left to XLA because their key
    # also draws a mask that stays there, or because the masks of their key that fused ops
    # would draw relate otherwise than JAX's (`plan`, match_dropout.not_rewritten).
    kept_draws: frozenset = frozenset()
    mixed_draws: frozenset = frozenset()


@dataclasses.dataclass
class Match:
    """`nodes` (anchor included) are replaced by `build(read)`, which returns the anchor's
    outputs from the values of `inputs` (`read` maps a Ref to its value)."""
    pattern: str
    anchor: G.Node
    nodes: list
    inputs: dict
    build: Callable
    description: str
    near_misses: list = dataclasses.field(default_factory=list)
    # What plan rewrites that build the op another way need (rewrite.scan_products: an
    # attention match's biased q/k/v product and its builder).
    attrs: dict = dataclasses.field(default_factory=dict)


class Copies(tuple):
    """A match output returned as several equal values (e.g. `ops.norm.bdrln_pair`): the
    interpreter hands one to each node that reads the output, so that their cotangents
    reach the fused op's backward separately instead of being added first."""


@dataclasses.dataclass
class Rebound:
    """What a match's build returns when it also hands on new values for refs it read:
    `outs`, the anchor's outputs, and `values` (ref -> value), which the nodes evaluated
    after the anchor read instead (equal values: `ops.gemm.dense_and_input`'s copy of its
    x, so that the gradients of x's later uses reach the product's backward)."""
    outs: list
    values: dict


def consumers(g: G.Graph, ref) -> int:
    """How many distinct nodes read `ref` (a graph output counts as one more): the copies
    the interpreter would hand out. `g.uses` counts reads, twice for a node reading it twice."""
    return sum(1 for n in g.nodes if any(r is ref for r in n.ins)) + g.is_output(ref)


@dataclasses.dataclass
class NearMiss:
    pattern: str
    anchor: G.Node
    reason: str
    # Several anchors can reach the same near-miss; it is reported once per key.
    key: object = None


_REGISTRY: list = []


def register(name: str, fn: Callable, *, priority: int = 0):
    """Add a matcher; lower priority values are tried first at each anchor."""
    _REGISTRY.append((priority, name, fn))
    _REGISTRY.sort(key=lambda t: t[0])


def registered() -> list[str]:
    return [name for _, name, _ in _REGISTRY]


@dataclasses.dataclass
class Plan:
    at: dict                 # anchor Node -> Match
    skip: set                # consumed Nodes other than anchors
    near_misses: list
    sub: dict                # scan/remat Node -> Plan of its body
    unsearched: list         # opaque Nodes with bodies (while, cond, custom_jvp/vjp)


def plan(g: G.Graph, options: Options, scan_body: bool = False) -> Plan:
    """The matches in `g` and, recursively, in its nodes' bodies; then its products
    (`rewrite.scan_products.fuse`: on GPU every plain 16-bit product, in scan bodies and,
    as `scan_products.OUTSIDE` says (by default), outside them)."""
    from jaxsub.rewrite import match_dropout  # it builds on this module

    searched = options
    while True:
        at, claimed, misses = _search(g, searched)
        # A fused op draws its own mask from the key; where the same key also draws a mask
        # that stays in XLA (the same bits in JAX), both draws stay there.
        kept, mixed = match_dropout.draws_sharing_a_key(g, claimed)
        if kept <= searched.kept_draws and mixed <= searched.mixed_draws:
            break
        searched = dataclasses.replace(searched, kept_draws=searched.kept_draws | kept,
                                       mixed_draws=searched.mixed_draws | mixed)
    sub = {n: plan(n.body, options, scan_body=n.prim == G.SCAN) for n in g.nodes if n.body is not None}
    # A matched call (softmax's custom_jvp_call) is replaced whole, not left unsearched.
    unsearched = [n for n in g.nodes if n.prim in G.UNSEARCHED and n not in claimed]
    from jaxsub.rewrite import scan_products  # it builds on this module's Match

    return scan_products.fuse(g, Plan(at, claimed - set(at), misses[::-1], sub, unsearched), scan=scan_body)


def _search(g: G.Graph, options: Options):
    """(anchor -> Match, the claimed nodes, the near-misses) of the registered matchers in
    `g` itself: anchors from the end, the first matcher that matches unclaimed nodes wins."""
    at, claimed, misses, seen = {}, set(), [], set()

    def note(miss):
        key = miss.key if miss.key is not None else id(miss.anchor)
        if key not in seen:
            seen.add(key)
            misses.append(miss)

    for node in reversed(g.nodes):
        if node in claimed:
            continue
        for _, _, fn in _REGISTRY:
            found = fn(g, node, options)
            if isinstance(found, NearMiss):
                note(found)
            elif isinstance(found, Match) and not claimed.intersection(found.nodes):
                for miss in found.near_misses:
                    note(miss)
                claimed.update(found.nodes)
                at[node] = found
                break
    return at, claimed, misses


# ---------------------------------------------------------------------------------------
# Helpers shared by matchers.


def private_violation(g: G.Graph, nodes, anchor, roles=None, exempt=()):
    """None when every value produced inside `nodes` (the anchor's outputs and the refs in
    `exempt` excepted) is used only inside `nodes`; else the reason the rewrite would
    change the program."""
    members = set(nodes)
    inside = {}
    for n in members:
        for r in n.ins:
            inside[r] = inside.get(r, 0) + 1
    for n in nodes:
        if n is anchor:
            continue
        for r in n.outs:
            if g.uses[r] == inside.get(r, 0) or any(r is e for e in exempt):
                continue
            role = (roles or {}).get(n, "intermediate")
            where = "returned as an output" if g.is_output(r) else "also used elsewhere"
            return f"{role} {r.dtype}{list(r.shape)} ({n.prim}) is {where}"
    return None


def read_after(g: G.Graph, ref, anchor, nodes=()) -> list | None:
    """The nodes outside `nodes` that read `ref`: [] when there are none, None when one of
    them comes before `anchor` in the graph (it would be evaluated before a match at the
    anchor could hand it a value)."""
    members = set(nodes)
    where = {n: i for i, n in enumerate(g.nodes)}
    readers = [n for n in g.nodes if n not in members and any(r is ref for r in n.ins)]
    if any(where[n] < where[anchor] for n in readers):
        return None
    return readers


def narrow(dtype) -> bool:
    """Whether `dtype` holds fewer digits than float32 (bf16, f16): constants in it are
    roundings of the values the user wrote."""
    return jnp.finfo(dtype).eps > jnp.finfo(F32).eps


def rounded(value: float, dtype) -> set:
    """`value` as a constant of `dtype` can hold it: rounded directly, or through float32
    first (np.float32(v).astype(bf16), or a float32 literal that JAX converts)."""
    return {float(np.asarray(value, dtype)), float(np.asarray(np.float32(value), dtype))}


def same_constant(c: float, value: float, dtype) -> bool:
    """Whether the constant `c`, held in `dtype`, is `value` as that dtype stores it.

    float32 (and wider) constants must agree to 1e-6, relative; a bf16/f16 constant must be
    exactly `value` rounded to that dtype, so a value one step away on the dtype's grid
    (the rounding of another number) is never taken for it."""
    if c is None or not math.isfinite(c):
        return False
    if not narrow(dtype):
        return abs(c - value) <= 1e-6 * abs(value)
    return c in rounded(value, dtype)


def unit_view(g: G.Graph, ref):
    """(source, node) when `ref` is a reshape or broadcast_in_dim of `source` that only adds
    or drops axes of length 1, in order (keepdims and its inverse), else None."""
    node = g.op(ref, *G.UNIT_SHAPE_OPS)
    if node is None or len(node.ins) != 1:
        return None
    src = node.ins[0]
    if nonunit(src.shape) != nonunit(ref.shape):
        return None
    dims = node.params.get("broadcast_dimensions") if node.prim == "broadcast_in_dim" else None
    if dims is not None and list(dims) != sorted(dims):
        return None
    return src, node


def strip_row(g: G.Graph, ref):
    """Follow reshapes/broadcasts that only add or drop unit axes, or broadcast a row
    statistic [..., 1] along the last axis, back to the statistic itself."""
    nodes = []
    while True:
        view = unit_view(g, ref)
        node = view[1] if view is not None else g.op(ref, "broadcast_in_dim")
        if node is None:
            return ref, nodes
        src, out = node.ins[0], node.outs[0]
        along_last = (node.prim == "broadcast_in_dim" and len(out.shape) >= 1
                      and nonunit(src.shape) == nonunit(out.shape[:-1])
                      and tuple(node.params["broadcast_dimensions"]) == tuple(range(len(src.shape)))
                      and src.shape[-1:] == (1,))
        if view is None and not along_last:
            return ref, nodes
        nodes.append(node)
        ref = src


def _upcast(node) -> bool:
    """An exact widening convert: bf16/f16 to float32."""
    return (node.prim == "convert_element_type" and node.outs[0].dtype == F32
            and node.ins[0].dtype in ACTIVATION_DTYPES)


def strip_vec(g: G.Graph, ref, n: int, upcast: bool = False):
    """The [n] vector behind `ref` when `ref` is that vector reshaped/broadcast along the
    last axis (with `upcast`, also converted from bf16/f16 to float32, which is exact);
    None otherwise."""
    while True:
        if ref.shape == (n,) and not (upcast and g.op(ref, "convert_element_type")
                                      and _upcast(g.producer[ref])):
            return ref
        prims = (*G.UNIT_SHAPE_OPS, "convert_element_type") if upcast else G.UNIT_SHAPE_OPS
        node = g.op(ref, *prims)
        if node is None or not ref.shape or ref.shape[-1] != n:
            return ref if ref.shape == (n,) else None
        if node.prim == "convert_element_type":
            if not _upcast(node):
                return ref if ref.shape == (n,) else None
            ref = node.ins[0]
            continue
        src = node.ins[0]
        if not src.shape or src.shape[-1] != n or nonunit(src.shape) != (n,):
            return None
        if node.prim == "broadcast_in_dim" and node.params["broadcast_dimensions"][-1] != len(ref.shape) - 1:
            return None
        ref = src


def split_vec(g: G.Graph, node, n: int, upcast: bool = False):
    """For a binary `node` with one operand an [n] vector along the last axis and the other
    a full tensor of the node's shape: (full operand, vector). Else None."""
    if len(node.ins) != 2:
        return None
    for full, other in (node.ins, node.ins[::-1]):
        if full.shape != node.outs[0].shape:
            continue
        vec = strip_vec(g, other, n, upcast)
        if vec is not None and vec is not full:
            return full, vec
    return None


def shapes(*refs) -> str:
    return ", ".join(f"{r.dtype}{list(r.shape)}" for r in refs if r is not None)
