"""Recognizing user-written dropout so a fused kernel can take it over.

Recognized spellings of dropout(h) with keep probability p, mask = bernoulli(key, p, shape)
or a comparison of uniform(key, shape) (float32 on [0, 1)) with a constant, u < p or
u >= 1 - p (what bernoulli computes):
  select_n(mask, 0, h / p)        jnp.where(mask, h / p, 0) and flax.linen.Dropout
  select_n(mask, 0, h) / p        jnp.where(mask, h, 0) / p
  h * mask / p, h / p * mask      with the mask converted to h's dtype
  h * (mask / p)                  flax.linen attention's dropout
  h * select_n(mask, 0, 1 / p)    h * jnp.where(mask, 1 / p, 0)
The mask may also be the dropped set, drop = bernoulli(key, 1 - p) (or u < 1 - p):
~drop in place of mask, jnp.where(drop, 0, ...) in place of jnp.where(mask, ..., 0), and
1 - drop in place of the converted mask; or, as Praxis writes it, the float mask
floor(p + uniform(key)) (float32, kept where u >= 1 - p). Division by p may also be
multiplication by 1 / p. A bf16/f16 h converted to float32 for the dropout and the result
converted back is a dropout of h, and so is h times keep / p computed in float32 and
rounded to h's dtype (`h * (keep / p)` with a Python float p in bf16 code).

The mask must have h's shape; with `parse(..., broadcast=True)` (attention only) it may
also be broadcast to h's shape, of h's rank with 1 on some axes or through one
broadcast_in_dim (flax's `broadcast_dropout=True` mask [1, 1, Sq, Sk]): `Dropout.mask_shape`
says which, and the caller decides whether the fused op can draw it. A uniform drawn in
bf16/f16 is not taken: its steps of 2^-7 or 2^-10 make the keep probability a rounding of p.

The fused kernels draw their own mask from the *same key* that fed `bernoulli`, so every
call site keeps its own key (after the user's `split`/`fold_in`), the keep probability
is the same (rounded to 1/65536), but the bits differ from `jax.random.bernoulli`'s.

The rate comes from bernoulli's keep probability, a float32 scalar even in bf16/f16
code. The scale's constant (p divided by, or 1 / p multiplied by) must be that p's: to
1e-6 in float32, and in bf16/f16 (where `h / jnp.asarray(1 - rate, h.dtype)` divides by
0.8984375 for rate 0.1) exactly p or 1 / p rounded to that dtype. The fused op scales by 1 / p in float32 instead of the
rounded constant, a difference below the dtype's rounding of the result (0.17% for
bf16's 0.8984375 against its 0.39% half-ulp); `Dropout.note` says so in explain().
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub.ops import dropout as _dropout
from jaxsub.rewrite import graph as G
from jaxsub.rewrite.patterns import ACTIVATION_DTYPES, F32, same_constant, shapes

NOT_REWRITTEN = "dropout not rewritten (rewrite_dropout=False)"
SHARED_KEY = ("dropout not rewritten: its key also draws a mask that stays in XLA (in JAX the two draws share "
              "their bits; the fused op's own mask would not)")
MIXED_FORMS = ("dropout not rewritten: JAX relates the masks its key draws otherwise than the fused ops would "
               "(one keeps u < p, as bernoulli does, another u >= rate, as a dropped set drawn: they overlap less "
               "than the fused ops' nested masks; or, with jax_threefry_partitionable off, masks of two sizes)")


@dataclasses.dataclass
class Dropout:
    h: G.Ref          # the value dropped
    key: G.Ref        # the PRNG key that fed bernoulli
    rate: float
    nodes: list       # nodes of the dropout itself, mask generation included
    bernoulli: G.Node
    scale: float = 0.0        # the user's scale as the program holds it (1 / p rounded)
    scale_dtype: object = None
    mask_shape: tuple | None = None  # the mask's shape at h's rank (None: h's shape)

    @property
    def broadcast(self) -> bool:
        """Whether one mask element serves several of h's (a size-1 axis where h's is larger)."""
        return self.mask_shape is not None and tuple(self.mask_shape) != tuple(self.h.shape)

    @property
    def note(self) -> str:
        """For explain(): the user's scale when it is a bf16/f16 rounding of 1 / (1 - rate)."""
        exact = 1.0 / (1.0 - self.rate)
        if self.scale_dtype is None or abs(self.scale - exact) <= 1e-6 * exact:
            return ""
        return (f" (rate from bernoulli's keep probability; the program's scale {self.scale:.6g} is "
                f"1/(1-rate) through a {self.scale_dtype.name} constant, the fused op's {exact:.6g})")


def _rate(p):
    """The drop rate of keep probability p, without the float32 literal's noise."""
    return round(1.0 - p, 7)


def not_rewritten(options, drop) -> str | None:
    """Why `drop` (a Dropout a matcher found) must stay the user's, else None (also for no
    dropout: `drop` None)."""
    if drop is None:
        return None
    if not options.rewrite_dropout:
        return NOT_REWRITTEN
    batched = batched_key(drop.bernoulli)
    if batched is not None:
        return batched
    if id(drop.bernoulli) in options.kept_draws:
        return SHARED_KEY
    return MIXED_FORMS if id(drop.bernoulli) in options.mixed_draws else None


# Ops that make the same key again from the same operands: a raw uint32 key is wrapped again
# at each draw, `split(key)[0]` written twice splits and slices twice, `jax.random.key(s)`
# written twice seeds twice.
_KEY_VIEWS = frozenset({"random_wrap", "random_unwrap", "random_split", "random_fold_in", "random_seed", "slice",
                        "squeeze", "reshape", *G.VARYING_CASTS})
# Ops whose result is their operand's key or key data: `jax.random.clone(key)`, and a key's
# data wrapped again (`wrap_key_data(key_data(key))`) or a wrapped key's data taken again.
_KEY_SAME = {"random_clone": None, "random_wrap": "random_unwrap", "random_unwrap": "random_wrap"}


def _key_identity(g: G.Graph, ref, depth: int = 0):
    """A value equal for two refs that hold the same key by construction: the ref itself,
    a constant's value, or the chain of ops (_KEY_VIEWS, with their parameters) from the
    same source, through the ops that return their operand's key (_KEY_SAME)."""
    value = G.known(ref)
    if value is not None and np.size(value) == 1:
        return ("constant", repr(value))
    node = g.producer.get(ref)
    if node is None or len(node.outs) != 1 or depth > 16:
        return ref
    if node.prim in _KEY_SAME:
        inner = g.producer.get(node.ins[0]) if _KEY_SAME[node.prim] is not None else node
        if inner is not None and (inner is node or inner.prim == _KEY_SAME[node.prim]) and \
                inner.ins[0].aval == ref.aval:
            return _key_identity(g, inner.ins[0], depth + 1)
    if node.prim not in _KEY_VIEWS:
        return ref
    return (node.prim, repr(sorted(node.params.items())), tuple(_key_identity(g, r, depth + 1) for r in node.ins))


def draws_sharing_a_key(g: G.Graph, claimed) -> tuple[set, set]:
    """ids of the mask draws in `claimed` (taken by fused ops) that must stay in XLA, where
    draws of one key share their bits: (those whose key also feeds a bernoulli or uniform
    draw that is not claimed, those of a key whose fused draws JAX relates otherwise than
    the fused ops would: `_forms_differ`)."""
    draws = [n for n in g.nodes if n.call_name in ("_bernoulli", "_uniform") and n.ins]
    left = {_key_identity(g, n.ins[0]) for n in draws if n not in claimed}
    by_key = {}
    for n in draws:
        if n in claimed:
            by_key.setdefault(_key_identity(g, n.ins[0]), []).append(n)
    shared = {id(n) for key, group in by_key.items() if key in left for n in group}
    mixed = {id(n) for key, group in by_key.items() if key not in left and _forms_differ(g, group, claimed)
             for n in group}
    return shared, mixed


def _forms_differ(g: G.Graph, group, claimed) -> bool:
    """Whether the fused draws `group` of one key would not relate as JAX's do. The fused
    ops keep element i where its 16 bits from (key, i) pass the rate's threshold, so their
    keep sets of one key are nested, larger for a larger keep probability. So are JAX's
    where every mask keeps u < p (bernoulli), or every one keeps u >= rate (the dropped set
    drawn, `uniform >= rate`, Praxis's floor): u is a function of (key, i) too, with the
    default partitionable threefry. A mask of each form makes JAX's sets overlap less
    (`where(keep, ...)` beside `where(drop, 0, ...)`: both kept at 0.8 for rate 0.1, where
    the fused ones are at 0.9). Without partitionable threefry, JAX's bits for one key also
    differ between sizes."""
    forms = {below for n in group for below, marker in g.draw_forms.get(n, ()) if marker in claimed}
    if len(forms) > 1:
        return True
    return (not jax.config.jax_threefry_partitionable
            and len({int(np.prod(n.outs[0].shape)) for n in group}) > 1)


def batched_key(bern) -> str | None:
    """Why a `_bernoulli` call cannot become a fused op's dropout when its key is a batch of
    keys (jax.vmap over per-example keys), else None."""
    key = bern.ins[0]
    if key.shape == ():
        return None
    return (f"dropout key {shapes(key)} is one key per example (jax.vmap over keys); a fused op draws its mask "
            "from one key: put jax.vmap outside jaxsub.optimize to fuse it")


def broadcast_mask(bern, value) -> str:
    """Why a dropout whose mask, drawn by `bern`, is broadcast over `value` stays the user's."""
    return (f"dropout mask {shapes(bern.outs[0])} is broadcast over {shapes(value)}; the fused op drops every "
            "element independently")


# uniform(key) compared with a constant c: the keep probability, c (u < c) or 1 - c
# (u >= c), by the comparison and the side the uniform is on.
_KEEP_BELOW = {("lt", 0): True, ("le", 0): True, ("gt", 1): True, ("ge", 1): True,
               ("gt", 0): False, ("ge", 0): False, ("lt", 1): False, ("le", 1): False}


def _draw(g: G.Graph, mask, depth: int = 0):
    """(the call that takes the key, keep probability p, the nodes drawing the mask, below)
    when the boolean `mask` is bernoulli(key, p), uniform(key) compared with a constant, or
    the negation of one (`~drop`, `jnp.logical_not(drop)`: p is 1 - the drop mask's), else
    None. `below`: the mask is JAX's u < p (bernoulli's form), else u >= 1 - p."""
    node = g.producer.get(mask)
    if node is None:
        return None
    if node.prim == "not" and len(node.ins) == 1 and node.ins[0].dtype == bool and depth < 4:
        found = _draw(g, node.ins[0], depth + 1)
        return (found[0], 1.0 - found[1], [node, *found[2]], not found[3]) if found is not None else None
    if node.call_name == "_bernoulli" and len(node.ins) == 2:
        p = g.scalar(node.ins[1])
        return (node, p, [node], True) if p is not None else None
    if node.prim in ("lt", "le", "gt", "ge") and len(node.ins) == 2:
        for side, (u, c) in enumerate((node.ins, node.ins[::-1])):
            call = g.producer.get(u)
            if _unit_uniform(g, call, u, mask.shape) and g.scalar(c) is not None:
                below = _KEEP_BELOW[node.prim, side]
                return call, g.scalar(c) if below else 1.0 - g.scalar(c), [node, call], below
    return None


def _unit_uniform(g: G.Graph, call, u, shape) -> bool:
    """Whether `u`, made by `call`, is jax.random.uniform(key, shape) in float32 on [0, 1)."""
    return (call is not None and call.call_name == "_uniform" and len(call.ins) == 3 and u.dtype == F32
            and u.shape == shape and g.scalar(call.ins[1]) == 0.0 and g.scalar(call.ins[2]) == 1.0)


def _bernoulli(g: G.Graph, mask, dropped: bool = False):
    """(the call that takes the key, keep probability p, the nodes drawing the mask) when
    `mask` is a keep mask (_draw), or with `dropped` the mask of the dropped elements, and
    the fused ops can draw it; else None."""
    return _usable(g, _draw(g, mask), dropped)


def _usable(g: G.Graph, found, dropped: bool = False):
    """(call, p, nodes) from `found` (call, p, nodes, below), p made the keep probability
    (1 - p with `dropped`), when the fused ops can draw its mask; else None. Records the
    mask's form for `draws_sharing_a_key`."""
    if found is None:
        return None
    # (a batch of keys, under jax.vmap over per-example keys, is taken here and refused by
    # not_rewritten, so that every matcher reports it: batched_key)
    call, p, nodes, below = found
    p, below = (1.0 - p, not below) if dropped else (p, below)
    # A rate the fused ops' 2^-16 steps would bias (ops.dropout.scale_error) stays the user's.
    if not (0.0 < p < 1.0 and _dropout.scale_error(_rate(p)) <= _dropout.MAX_SCALE_ERROR):
        return None
    g.draw_forms.setdefault(call, set()).add((below, nodes[0]))
    return call, p, nodes


def _float_mask(g: G.Graph, ref):
    """(the call that takes the key, keep probability p, nodes) when the float `ref` is 1
    where an element is kept and 0 where it is dropped: convert(keep), 1 - convert(drop), or
    Praxis's floor(p + uniform(key)) (a float32 uniform: kept where u >= 1 - p). Else None."""
    conv = g.op(ref, "convert_element_type")
    if conv is not None and conv.ins[0].dtype == bool and conv.ins[0].shape == ref.shape:
        found = _bernoulli(g, conv.ins[0])
        return (found[0], found[1], [conv, *found[2]]) if found is not None else None
    sub = g.op(ref, "sub")
    conv = g.op(sub.ins[1], "convert_element_type") if sub is not None and g.scalar(sub.ins[0]) == 1.0 else None
    if conv is not None and conv.ins[0].dtype == bool and conv.ins[0].shape == ref.shape:
        found = _bernoulli(g, conv.ins[0], dropped=True)
        return (found[0], found[1], [sub, conv, *found[2]]) if found is not None else None
    floor = g.op(ref, "floor")
    add = g.op(floor.ins[0], "add") if floor is not None else None
    for c, u in (add.ins, add.ins[::-1]) if add is not None else ():
        call = g.producer.get(u)
        if _unit_uniform(g, call, u, ref.shape) and g.scalar(c) is not None:
            found = _usable(g, (call, g.scalar(c), [floor, add, call], False))  # kept where u >= 1 - c
            if found is not None:
                return found
    return None


def _mask_operand(g: G.Graph, ref, shape, broadcast):
    """(ref, its shape at the rank of `shape`, the broadcast node in a list or []) for a
    mask operand of an elementwise op whose result has `shape`: ref as it is where its shape
    is `shape` (or, with `broadcast`, broadcasts to it at its rank), or with `broadcast` the
    operand of the broadcast_in_dim that makes ref (to `shape`, or to a shape that
    broadcasts to it: jnp's rank promotion of an [Sq, Sk] mask to [1, 1, Sq, Sk]); None
    otherwise."""
    def fits(m):
        return len(m) == len(shape) and (tuple(m) == tuple(shape) or (broadcast and all(
            a in (1, b) for a, b in zip(m, shape))))

    node = g.op(ref, "broadcast_in_dim") if broadcast and fits(ref.shape) else None
    if node is not None:
        src, dims = node.ins[0], node.params["broadcast_dimensions"]
        at = [1] * len(shape)
        for i, d in enumerate(dims):
            at[d] = src.shape[i]
        if fits(at):
            return src, tuple(at), [node]
    return (ref, tuple(ref.shape), []) if fits(ref.shape) else None


def _scaled(g: G.Graph, ref, p):
    """(h, node, scale, dtype) when ref = h / p or h * (1 / p), with the constant p or 1 / p
    as `ref`'s dtype (or a narrower one it was converted from) stores it."""
    node = g.op(ref, "div", "mul")
    if node is None:
        return None
    for h, c in (node.ins, node.ins[::-1]):
        k = g.scalar(c)
        if k is None or k == 0.0 or (node.prim == "div" and c is not node.ins[1]):
            continue
        dtype = g.precision(c)
        if node.prim == "div" and same_constant(k, p, dtype):
            return h, node, 1.0 / k, dtype
        if node.prim == "mul" and same_constant(k, 1.0 / p, dtype):
            return h, node, k, dtype
    return None


def _masked(g: G.Graph, ref, shape, broadcast):
    """(value, (the call taking the key, p, nodes), nodes, the mask's shape at ref's rank)
    when ref = value * mask with a float keep mask (_float_mask; broadcast: _mask_operand)."""
    node = g.op(ref, "mul")
    if node is None:
        return None
    for v, m in (node.ins, node.ins[::-1]):
        if v.shape != shape:
            continue
        op = _mask_operand(g, m, shape, broadcast)
        found = _float_mask(g, op[0]) if op is not None else None
        if found is not None:
            return v, found, [node, *op[2]], op[1]
    return None


def _zero_select(g: G.Graph, ref):
    """(the select_n making ref, its mask, the value selected, whether the mask is the
    dropped set) when ref is 0 where an element is dropped: select_n(keep, 0, v)
    (jnp.where(keep, v, 0)) or select_n(drop, v, 0) (jnp.where(drop, 0, v)); else None."""
    sel = g.op(ref, "select_n")
    if sel is None or len(sel.ins) != 3 or sel.ins[0].dtype != bool:
        return None
    if g.scalar(sel.ins[1]) == 0.0:
        return sel, sel.ins[0], sel.ins[2], False
    if g.scalar(sel.ins[2]) == 0.0:
        return sel, sel.ins[0], sel.ins[1], True
    return None


def _retyped(g: G.Graph, ref):
    """(the value, [the convert]) when ref is a convert_element_type of a float32 or ref-dtype
    value of its shape: a weak-type change (`h * (keep / p)` with a Python float p), or, in
    bf16/f16 code, a multiplier keep / p computed in float32 and rounded to ref's dtype;
    else (ref, [])."""
    node = g.op(ref, "convert_element_type")
    if (node is not None and node.ins[0].shape == ref.shape
            and (node.ins[0].dtype == ref.dtype or (node.ins[0].dtype == F32 and ref.dtype in ACTIVATION_DTYPES))):
        return node.ins[0], [node]
    return ref, []


def _rounded_scale(scale: float, dtype, ref):
    """(scale, dtype) of a multiplier whose value `scale` (held in `dtype`) reaches the
    product as ref's dtype: rounded to it where ref is narrower (_retyped)."""
    if ref.dtype == F32 or ref.dtype not in ACTIVATION_DTYPES or jnp.finfo(ref.dtype).eps <= jnp.finfo(dtype).eps:
        return scale, dtype
    return float(np.asarray(scale, ref.dtype)), ref.dtype


def _mask_over_p(g: G.Graph, ref, shape, broadcast):
    """(the call taking the key, p, nodes, _scaled's answer, the mask's shape at the rank of
    `shape`) when ref = mask / p (or * 1 / p) with a float keep mask (_float_mask), or a
    broadcast of it (broadcast: _mask_operand)."""
    op = _mask_operand(g, ref, shape, broadcast)
    inner, retyped = _retyped(g, op[0]) if op is not None else (None, [])
    node = g.op(inner, "div", "mul") if op is not None else None
    if node is None:
        return None
    for m in node.ins:
        found = _float_mask(g, m) if m.shape == inner.shape else None
        scaled = _scaled(g, inner, found[1]) if found is not None else None
        if scaled is not None and scaled[0] is m:
            scaled = (*scaled[:2], *_rounded_scale(*scaled[2:], op[0]))
            return found[0], found[1], [*op[2], *retyped, node, *found[2]], scaled, op[1]
    return None


def _selected_scale(g: G.Graph, ref, shape, broadcast):
    """(the call taking the key, p, nodes, the scale, its dtype, the mask's shape at the rank
    of `shape`) when ref = jnp.where(keep, 1 / p, 0) (or jnp.where(drop, 0, 1 / p)), or a
    broadcast of it (broadcast: _mask_operand)."""
    op = _mask_operand(g, ref, shape, broadcast)
    inner, retyped = _retyped(g, op[0]) if op is not None else (None, [])
    zs = _zero_select(g, inner) if op is not None else None
    if zs is None:
        return None
    sel, mask_ref, value, dropped = zs
    mask = _mask_operand(g, mask_ref, inner.shape, True)
    found = _bernoulli(g, mask[0], dropped) if mask is not None else None
    scale, dtype = g.scalar(value), g.precision(value)
    if found is None or mask[1] != tuple(inner.shape) or not same_constant(scale, 1.0 / found[1], dtype):
        return None
    return found[0], found[1], [*op[2], *retyped, sel, *mask[2], *found[2]], *_rounded_scale(scale, dtype, op[0]), op[1]


def drawn_mask(g: G.Graph, ref):
    """The `jax.random.bernoulli` call whose mask scales or selects `ref` (a mul or select_n
    of it, through converts, scales and broadcasts), whatever its shape: a dropout that
    `parse` does not take, such as one whose mask is broadcast (flax's
    `broadcast_dropout=True`, `nn.Dropout(broadcast_dims=...)`). None otherwise."""
    node = g.op(ref, "mul", "select_n")
    if node is None:
        return None
    todo = list(node.ins)
    for _ in range(32):  # jnp.where's zero branch (converts, broadcasts) is walked first
        if not todo:
            break
        n = g.producer.get(todo.pop())
        if n is not None and n.call_name == "_bernoulli":
            return n
        if n is not None and n.prim in ("convert_element_type", "div", "mul", "broadcast_in_dim", "reshape"):
            todo.extend(n.ins)
    return None


def parse(g: G.Graph, ref, broadcast: bool = False):
    """The Dropout whose output is `ref`, or None. With `broadcast`, its mask may also be
    broadcast to ref's shape (module docstring). A dropout computed in float32 on a bf16/f16
    value and converted back (`dropout(h.astype(f32)).astype(h.dtype)`) is a dropout of that
    value: the fused op computes in float32 and rounds once, as that program does."""
    down = g.op(ref, "convert_element_type")
    inner = parse(g, down.ins[0], broadcast) if down is not None and down.ins[0].dtype == F32 else None
    up = g.op(inner.h, "convert_element_type") if inner is not None else None
    if (up is not None and up.ins[0].dtype == ref.dtype and up.ins[0].shape == inner.h.shape
            and ref.dtype != F32 and ref.dtype in ACTIVATION_DTYPES):
        return dataclasses.replace(inner, h=up.ins[0], nodes=[down, *inner.nodes, up])
    return _parse(g, ref, broadcast)


def _parse(g: G.Graph, ref, broadcast: bool):
    node = g.producer.get(ref)
    if node is None:
        return None
    shape = ref.shape
    zs = _zero_select(g, ref)
    if zs is not None:
        # jnp.where(keep, h / p, 0), jnp.where(drop, 0, h / p)
        sel, mask_ref, kept, dropped = zs
        op = _mask_operand(g, mask_ref, shape, broadcast)
        found = _bernoulli(g, op[0], dropped) if op is not None else None
        scaled = _scaled(g, kept, found[1]) if found is not None else None
        if scaled is None:
            return None
        bern, p, drawn = found
        h, div = scaled[:2]
        return Dropout(h, bern.ins[0], _rate(p), [node, *op[2], div, *drawn], bern, *scaled[2:], op[1])
    if node.prim == "div" or node.prim == "mul":
        # jnp.where(keep, h, 0) / p, jnp.where(drop, 0, h) / p
        for inner_ref in node.ins:
            zs = _zero_select(g, inner_ref)
            if zs is None or zs[2].shape != shape:
                continue
            sel, mask_ref, h, dropped = zs
            op = _mask_operand(g, mask_ref, shape, broadcast)
            found = _bernoulli(g, op[0], dropped) if op is not None else None
            scaled = _scaled(g, ref, found[1]) if found is not None else None
            if scaled is None or scaled[0] is not inner_ref:
                continue
            bern, p, drawn = found
            return Dropout(h, bern.ins[0], _rate(p), [node, sel, *op[2], *drawn], bern, *scaled[2:], op[1])
        # (h * mask) / p
        for inner_ref in node.ins:
            masked = _masked(g, inner_ref, shape, broadcast)
            scaled = _scaled(g, ref, masked[1][1]) if masked is not None else None
            if scaled is None or scaled[0] is not inner_ref:
                continue
            h, (bern, p, drawn), mnodes, mshape = masked
            return Dropout(h, bern.ins[0], _rate(p), [node, *mnodes, *drawn], bern, *scaled[2:], mshape)
        # h * (mask / p), h * where(mask, 1 / p, 0)
        if node.prim == "mul":
            for h, m in (node.ins, node.ins[::-1]):
                found = _mask_over_p(g, m, shape, broadcast) if h.shape == shape else None
                if found is not None:
                    bern, p, mnodes, scaled, mshape = found  # mnodes: the mask's, its drawing included
                    return Dropout(h, bern.ins[0], _rate(p), [node, *mnodes], bern, *scaled[2:], mshape)
                found = _selected_scale(g, m, shape, broadcast) if h.shape == shape else None
                if found is not None:
                    bern, p, mnodes, scale, dtype, mshape = found
                    return Dropout(h, bern.ins[0], _rate(p), [node, *mnodes], bern, scale, dtype, mshape)
        # (h / p) * mask
        masked = _masked(g, ref, shape, broadcast)
        scaled = _scaled(g, masked[0], masked[1][1]) if masked is not None else None
        if scaled is not None:
            _, (bern, p, drawn), mnodes, mshape = masked
            return Dropout(scaled[0], bern.ins[0], _rate(p), [*mnodes, scaled[1], *drawn], bern, *scaled[2:], mshape)
    return None
