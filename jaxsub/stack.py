"""`lax.scan` over a stack of layers, its residuals written into buffers allocated once.

Under `jax.grad`, `lax.scan` saves each iteration's residuals as the scan's stacked
outputs, and JAX fills those outputs with zeros before the loop: for the 24-layer
BERT-large stack at batch 8 x 512 that is 3 GB written before the first layer runs. On
the H200 that step took 25.9 ms under `nn.scan` and 24.7 ms with this module
(bench/NOTES.md, eighteenth session).

`scan(body, init, xs, consts)` computes what

    lax.scan(lambda h, x: body(consts, h, x), init, xs)

computes, with a `custom_vjp` of its own:

- forward: the loop runs `jax.vjp(body, ...)` at each step and writes the pullback's
  residuals, and the step's outputs, into loop-carried buffers made by `lax.empty`
  (uninitialized on GPU: XLA's `AllocateBuffer`; zeros on CPU). Residuals that are the
  body's own inputs (a slice of xs such as the layer's parameters, or one of consts) are
  not stored: the backward passes them again. A carry leaf the pullback keeps (a layer's
  input) is not carried by value at all: it lives in a stack of length + 1 that the
  steps read their input from and write their output into, slot after slot, so that no
  step copies its input carry into a residual buffer.
- backward: a loop in the other direction calls each step's pullback on its stored
  residuals and writes the gradients of xs into buffers made the same way.
- small residuals (up to 1 MiB) of one dtype share one buffer, so a step writes them
  with one copy and reads them with one, not one each: a copy of a few KB costs about a
  microsecond of GPU time however small. Those one of jaxsub's custom calls makes (row
  statistics, log-sum-exps) get buffers of their own instead, which the calls write
  themselves (below); residuals that are constants (a placeholder mask, the seed of a
  dropout that is off) are not stored at all, nor are those that are slices or reshapes
  of the step's slice of xs (one op's quarter of its layer's row of dropout seeds): the
  backward makes them again from xs.
- a residual, or a gradient of xs, that is the result of one of jaxsub's custom calls is
  written into its buffer right after the call, bypassing the call's optimization
  barrier, and the rest of the step reads it back from the buffer. XLA's dynamic-slice
  fusion then has the call write it there itself instead of copying it: on the H200 the
  24-layer stack's copies fell from 1.36 to 0.11 ms per training step (bench/NOTES.md,
  twentieth session). Each step is traced to a jaxpr for this and evaluated equation by
  equation.
- two residuals holding the same elements in the same order (a value and, say, that
  value transposed twice, as an einsum's output layout can make it) are stored once.

Without differentiation it is the plain `lax.scan`. Under forward-mode or second-order
differentiation (`jax.jvp`, `jax.hessian`, grad of grad) it is `lax.scan` too, with every
fused op in the body as its jnp reference (`_ffi.references`), the body's checkpointed or
jitted parts included.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from jaxsub import _ffi, _partition
from jaxsub._jaxpr import bind, dense_cotangent, perturbed, primal_values
from jaxsub.ops import config as _config

_OP = "jaxsub.stack.scan"
_SMALL = 1 << 20  # bytes: residuals up to this size share one buffer per dtype


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One step's pullback: its tree, where each leaf comes from (("const", j), ("x", j)
    and ("carry", j): leaves of consts, of the step's slice of xs and of its input carry;
    ("res", j): the j-th stored residual), the stored residuals' and the step outputs'
    abstract values, the length and the direction. `same` pairs (j, i): residual j holds residual i's elements in
    the same order (a view of it), so only i is kept. `fixed`: residuals that are
    constants, the same at every step (a placeholder mask, the seed of a dropout that is
    off), kept as values rather than stored per step. `views`: residuals that are slices
    or reshapes of a leaf of the step's x (a quarter of a layer's row of dropout seeds),
    made again from xs in the backward rather than stored."""

    tree: Any
    sources: tuple
    stored: tuple
    ys: Any
    length: int
    reverse: bool
    groups: tuple = ()  # indices into stored, one tuple per shared buffer
    same: tuple = ()
    fixed: tuple = ()  # (j, value): residual j is a constant (value), not stored
    views: tuple = ()  # (j, k, make): residual j is make(leaf k of x), not stored
    unroll: int = 1  # steps per iteration of both loops (lax.scan's unroll)
    live: tuple = ()  # per leaf of consts: whether the step's pullback differentiates it
    closes_over_tracer: bool = False  # body reads a traced value it was not passed

    @property
    def held(self) -> tuple:
        """The carry leaves the pullback keeps (("carry", j) sources): the loop holds them
        in stacks of length + 1, each step reading its input from one slot and writing its
        output into the next, rather than carrying them and storing each step's input."""
        return tuple(sorted({j for kind, j in self.sources if kind == "carry"}))

    @property
    def alone(self) -> tuple:
        other = ({j for group in self.groups for j in group} | {j for j, _ in self.same}
                 | {j for j, _ in self.fixed} | {j for j, _, _ in self.views})
        return tuple(j for j in range(len(self.stored)) if j not in other)

    def buffers(self):
        """Abstract values of one step's stored residuals as they are written: those
        alone, then each group flattened and concatenated."""
        groups = [jax.ShapeDtypeStruct((sum(math.prod(self.stored[j].shape) for j in g),), self.stored[g[0]].dtype)
                  for g in self.groups]
        return [self.stored[j] for j in self.alone] + groups

    def pack(self, stored) -> list:
        return [stored[j] for j in self.alone] + [
            jnp.concatenate([jnp.ravel(stored[j]) for j in g]) for g in self.groups]

    def unpack(self, buffers, x_leaves) -> list:
        stored = [None] * len(self.stored)
        for j, b in zip(self.alone, buffers):
            stored[j] = b
        for g, b in zip(self.groups, buffers[len(self.alone):]):
            start = 0
            for j in g:
                shape = self.stored[j].shape
                stored[j] = lax.slice_in_dim(b, start, start + math.prod(shape)).reshape(shape)
                start += math.prod(shape)
        for j, i in self.same:
            stored[j] = stored[i].reshape(self.stored[j].shape)
        for j, value in self.fixed:
            stored[j] = value
        for j, k, make in self.views:
            stored[j] = make(x_leaves[k])
        return stored


def _pullback(body, consts, carry, x, live):
    """Run body under jax.vjp with respect to the carry, x and the leaves of consts that
    `live` marks (the others are constants to it: an attention mask the program does not
    differentiate); return its (carry, y), the pullback's tree, each leaf's source and the
    leaves to store. The pullback gives (the live const leaves' gradients, dcarry, dx)."""
    const_leaves, const_tree = jax.tree.flatten(consts)

    def step(live_leaves, carry, x):
        it = iter(live_leaves)
        return body(jax.tree.unflatten(const_tree, [next(it) if d else c for c, d in zip(const_leaves, live)]),
                    carry, x)

    # The ops' rules run their kernels unwrapped (no custom_jvp around them for their
    # results' derivatives): `_writing` finds their custom calls in the step, and those
    # derivatives of the loop are its reference's (`_ffi.custom_vjp` around `_scan`).
    with _ffi.unwrapped_rules():
        out, pullback = jax.vjp(step, [c for c, d in zip(const_leaves, live) if d], carry, x)
    leaves, tree = jax.tree.flatten(pullback)
    inputs = (("const", const_leaves), ("x", jax.tree.leaves(x)), ("carry", jax.tree.leaves(carry)))
    sources, stored = [], []
    for leaf in leaves:
        source = next(((kind, j) for kind, group in inputs for j, a in enumerate(group) if a is leaf), None)
        if source is None:
            source = ("res", len(stored))
            stored.append(leaf)
        sources.append(source)
    return out, tree, tuple(sources), stored


def _dtype(a):
    return a.dtype if hasattr(a, "dtype") else jnp.result_type(a)


def _is_float(a) -> bool:
    return jnp.issubdtype(_dtype(a), jnp.inexact)


def _float_leaves(tree) -> tuple:
    return tuple(_is_float(a) for a in jax.tree.leaves(tree))


def _length(xs, length) -> int:
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in jax.tree.leaves(xs)}
    if length is not None:
        sizes.add(length)
    if not sizes:
        raise ValueError(f"{_OP}: `length` is needed when `xs` has no arrays")
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"{_OP}: every leaf of `xs` (and `length`, if given) needs one leading size, got "
                         f"{sorted('a scalar' if n is None else str(n) for n in sizes)}")
    return sizes.pop()


def _avals(tree):
    def aval(a):
        dtype = _dtype(a)  # a PRNG key's dtype is no NumPy dtype
        return tuple(jnp.shape(a)), dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jnp.dtype(dtype)

    return jax.tree.map(aval, tree)


def _plan(body, consts, carry, xs, length, reverse, unroll=1, live=None) -> _Plan:
    """The step's plan; `live`: which const leaves its pullback differentiates (default:
    every floating-point one)."""
    live = _float_leaves(consts) if live is None else live
    x0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], _dtype(a)), xs)
    found = {}

    def probe(consts, carry, x):
        out, tree, sources, stored = _pullback(body, consts, carry, x, live)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"{_OP}: `body` must return a pair (carry, y), got {type(out).__name__}")
        found.update(tree=tree, sources=sources)
        return out, stored

    closed, ((out_carry, ys), stored) = jax.make_jaxpr(probe, return_shape=True)(consts, carry, x0)
    if jax.tree.structure(out_carry) != jax.tree.structure(carry) or _avals(out_carry) != _avals(carry):
        raise TypeError(f"{_OP}: `body` must return a carry of the input carry's structure, shapes and dtypes; "
                        f"got {_avals(out_carry)} for {_avals(carry)}")
    stored_vars = closed.jaxpr.outvars[len(closed.jaxpr.outvars) - len(stored):]
    producer = _producers(closed.jaxpr)
    fixed = _fixed(closed, producer, stored_vars)
    x_vars = closed.jaxpr.invars[len(jax.tree.leaves(consts)) + len(jax.tree.leaves(carry)):]
    fixed_at = {j for j, _ in fixed}
    views = tuple((j, *view) for j, v in enumerate(stored_vars)
                  if j not in fixed_at and (view := _view_of_x(producer, v, x_vars)) is not None)
    constant = fixed_at | {j for j, _, _ in views}
    same = tuple((j, i) for j, i in _same(producer, stored_vars) if j not in constant and i not in constant)
    # A residual a jaxsub custom call makes is written into a buffer of its own by the call
    # itself (`_early`), whatever its size: sharing a buffer would take a copy per step.
    made = {j for j, v in enumerate(stored_vars) if _jaxsub_result(producer, v) is not None}
    skip = {j for j, _ in same} | constant | made
    closes = any(isinstance(c, jax.core.Tracer) for c in closed.consts)
    return _Plan(found["tree"], found["sources"], tuple(stored), ys, length, reverse, _groups(stored, skip), same,
                 fixed, views, unroll, live, closes)


def _groups(stored, skip) -> tuple:
    """Small residuals of one dtype, two or more, to share a buffer (those in `skip` are
    not stored or have buffers of their own). None where the process has several devices:
    a shared buffer is flat, and XLA gathers a sharded residual to flatten it (the
    residuals' own stacks keep their shardings)."""
    if jax.device_count() > 1:
        return ()
    by_dtype = {}
    for j, a in enumerate(stored):
        if (j not in skip and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
                and math.prod(a.shape) * a.dtype.itemsize <= _SMALL):
            by_dtype.setdefault(jnp.dtype(a.dtype), []).append(j)
    return tuple(tuple(g) for g in by_dtype.values() if len(g) > 1)


def _producers(jaxpr) -> dict:
    return {v: e for e in jaxpr.eqns for v in e.outvars}


def _fixed(closed, producer, stored_vars) -> tuple:
    """(j, value) for each stored residual that depends on none of the step's inputs,
    its value computed now (from literals and concrete constants only)."""
    known = {v: c for v, c in zip(closed.jaxpr.constvars, closed.consts) if not isinstance(c, jax.core.Tracer)}

    def value(v, depth=0):
        if isinstance(v, jcore.Literal):
            return v.val
        if v in known:
            return known[v]
        eqn = producer.get(v)
        # (pvary / pcast type a value for shard_map and evaluate only under it.)
        if eqn is None or depth > 32 or eqn.primitive.name in ("ffi_call", "custom_vjp_call", "custom_jvp_call",
                                                                  "pvary", "pcast", *_partition.WRAPPERS):
            return None
        ins = [value(u, depth + 1) for u in eqn.invars]
        if any(x is None for x in ins):
            return None
        with jax.ensure_compile_time_eval():
            outs = bind(eqn, ins)
        for u, out in zip(eqn.outvars, outs):
            known[u] = out
        return known[v]

    fixed = []
    for j, v in enumerate(stored_vars):
        c = value(v)
        if c is not None and not isinstance(c, jax.core.Tracer):
            fixed.append((j, c))
    return tuple(fixed)


_VIEWS = ("slice", "reshape", "squeeze")


def _view_of_x(producer, v, x_vars):
    """(k, make) when `v` is made from leaf k of the step's x by slices and reshapes
    alone (`make` makes it again from that leaf); else None."""
    chain = []
    while v not in x_vars:
        eqn = producer.get(v) if not isinstance(v, jcore.Literal) else None
        if eqn is None or eqn.primitive.name not in _VIEWS or len(eqn.invars) != 1:
            return None
        chain.append(eqn)
        v = eqn.invars[0]
    if not chain:
        return None  # the leaf itself: a ("x", k) source, never stored

    def make(leaf):
        for eqn in reversed(chain):
            leaf = bind(eqn, [leaf])[0]
        return leaf

    return x_vars.index(v), make


def _origin(producer, v):
    """The earliest value that `v` is a view of, holding the same elements in the same
    order: walking back through optimization barriers, copies, converts to the same
    dtype, reshapes, and runs of transposes that compose to no permutation."""
    root, perm = v, None  # perm: the transposes passed since the last point where they cancel
    while not isinstance(v, jcore.Literal) and v in producer:
        eqn = producer[v]
        name = eqn.primitive.name
        src = eqn.invars[eqn.outvars.index(v)] if name == "optimization_barrier" else eqn.invars[0]
        if name == "transpose":
            p = eqn.params["permutation"]
            perm = tuple(p[i] for i in perm) if perm is not None else tuple(p)
            perm = None if perm == tuple(range(len(p))) else perm
        elif name in ("reshape", "squeeze", "expand_dims"):
            if perm is not None or eqn.params.get("dimensions") is not None and name == "reshape":
                break
        elif not (name in ("optimization_barrier", "copy")
                  or (name == "convert_element_type" and eqn.params["new_dtype"] == src.aval.dtype)):
            break
        v = src
        if perm is None:
            root = v
    return root


def _same(producer, stored_vars) -> tuple:
    """Pairs (j, i), i < j, of stored residuals holding the same elements in the same
    order (e.g. a value and the result of transposing it twice): `_Plan.same`."""
    first, pairs = {}, []
    for j, v in enumerate(stored_vars):
        root = _origin(producer, v)
        if isinstance(root, jcore.Literal):
            continue
        key = (root, v.aval.dtype)
        if key in first:
            pairs.append((j, first[key]))
        else:
            first[key] = j
    return tuple(pairs)


def scan(body: Callable, init, xs=None, consts=None, *, length: int | None = None, reverse: bool = False,
         unroll: int = 1):
    """`lax.scan(lambda h, x: body(consts, h, x), init, xs, length, reverse)`, whose
    gradient keeps each step's residuals in buffers allocated once (module docstring).

    Args:
      body: (consts, carry, x) -> (carry, y), with x one step's slice of xs. Traced
        floating-point values it closes over (an enclosing jit's or grad's arguments) are
        made consts of their own by `jax.closure_convert`, so gradients reach them.
      init: the first carry, a pytree; each step returns a carry of its structure,
        shapes and dtypes.
      xs: a pytree of arrays with a leading (layer) axis, e.g. stacked parameters and
        per-layer dropout keys; None or empty with `length`.
      consts: a pytree every step reads, e.g. an attention mask.
      length, reverse: as lax.scan's.
      unroll: steps per iteration of the forward and backward loops, as lax.scan's
        (an int >= 1). Each iteration of a loop costs a little besides its steps: on the
        H200, XLA's counter increment (a kernel of its own) and 4-6 us of idle before the
        next iteration's first kernel (bench/NOTES.md, thirtieth session). But with
        several steps per iteration XLA makes the stack writes of every step but the
        last asynchronous copies, which jaxsub's custom calls cannot write in place:
        there, 2 ran the 24-layer BERT-large step 3.6% slower than 1 (thirty-first
        session; the cause: thirty-third).

    Returns (the last carry, the steps' ys stacked), differentiable with respect to
    consts, init and xs (their floating-point leaves).
    """
    if not callable(body):
        raise TypeError(f"{_OP}: `body` must be callable, got {type(body).__name__}")
    length = _length(xs, length)
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise ValueError(f"{_OP}: `unroll` must be an int >= 1, got {unroll!r}")
    typed = _ffi.inside_shard_map() and any(_ffi.varying_axes(a) for a in jax.tree.leaves((consts, init, xs)))
    if typed or length == 0:
        # No step: nothing to store. Inside shard_map (check_vma) the values are typed by
        # the mesh axes they vary over, which the step's buffers and the rules' traces
        # would have to keep.
        if typed:
            _ffi.fallback("stack.scan", "inside shard_map, on values varying over its mesh axes", "lax.scan")
        return lax.scan(lambda h, x: body(consts, h, x), init, xs, length=length, reverse=reverse, unroll=unroll)
    resolver = _config.current()
    if resolver is not None:
        # The rules trace body again, under jax.checkpoint after this call has returned:
        # without the enclosing `ops.config.use` block (optimize's layouts), its ops would
        # choose other implementations there, and other residuals, than the plan's.
        body = functools.partial(_in_config, resolver, body)
    plans = _Plans(body, length, reverse, unroll)
    if plans.get(_float_leaves(consts), consts, init, xs).closes_over_tracer:  # (this checks body now)
        # Traced values body closes over (a jit's or grad's arguments) become consts of
        # their own, so that the gradient reaches them, as through lax.scan's closures
        # (closed over, they would escape the custom_vjp: JAX's UnexpectedTracerError).
        x0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], _dtype(a)), xs)
        converted, hoisted = jax.closure_convert(body, consts, init, x0)
        if hoisted:
            consts = (consts, tuple(hoisted))
            body = functools.partial(_with_hoisted, converted)
            plans = _Plans(body, length, reverse, unroll)
            plans.get(_float_leaves(consts), consts, init, xs)
    return _scan(body, plans, consts, init, xs)


def _in_config(resolver, body, consts, carry, x):
    """body under the `ops.config` resolver in effect where scan was called."""
    with _config.use(resolver):
        return body(consts, carry, x)


def _with_hoisted(converted, consts, carry, x):
    """A closure-converted body on (the user's consts, the hoisted values)."""
    return converted(consts[0], carry, x, *consts[1])


class _Plans:
    """The step's plan for each set of live const leaves (`_Plan.live`), made once. Which
    leaves of consts the program differentiates is known only in the forward rule
    (`_scan` has symbolic zeros): a float leaf it does not differentiate (an additive
    padding mask) is a constant to the step's pullback, so that no op in the step
    computes a gradient for it (for an additive attention mask, the fused attention
    gives way to the unfused structure: jaxsub/ops/masks.py) only for the loop to drop it."""

    def __init__(self, body, length, reverse, unroll):
        self.body, self.length, self.reverse, self.unroll = body, length, reverse, unroll
        self._made = {}

    def get(self, live, consts, init, xs) -> _Plan:
        if live not in self._made:
            self._made[live] = _plan(self.body, consts, init, xs, self.length, self.reverse, self.unroll, live)
        return self._made[live]

    def made(self, live) -> _Plan:
        return self._made[live]


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(0, 1))
def _scan(body, plans, consts, init, xs):
    return lax.scan(lambda h, x: body(consts, h, x), init, xs, length=plans.length, reverse=plans.reverse,
                    unroll=plans.unroll)


def _empty_stack(length, a):
    return lax.empty((length, *jnp.shape(a)), _dtype(a))


def _slice(tree, at):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, at, 0, keepdims=False), tree)


# Both loops count i = 0, 1, ... and address layer `at` = i or n - 1 - i, slicing and
# updating their stacks themselves: every offset is then a function of the loop's own
# induction variable, which XLA's dynamic-slice fusion needs to run a custom call on a
# stack's slice, or write its result into one, in place. (A second counter running the
# other way, as `lax.scan(reverse=True)` beside a carried index would give, is not one.)


def _jaxsub_result(producer, v):
    """(root, call) when `v` is a view (`_origin`) of the result `root` of a jaxsub
    custom call `call`; else None."""
    root = _origin(producer, v)
    call = None if isinstance(root, jcore.Literal) else producer.get(root)
    inner = None if call is None else _partition.inner_call(call)
    if inner is None or not str(inner.params.get("target_name", "")).startswith("jaxsub_"):
        return None
    return root, call


def _early(jaxpr, wanted):
    """Which of a step's outputs to write into their stacks as soon as they are made:
    {var: k} for each output `wanted` maps to a stack k that is a view (`_origin`) of a
    jaxsub custom call's result (var: that result); and the ids of those calls' own
    optimization barriers (`_ffi.call`'s), to pass through.

    XLA's dynamic-slice fusion writes a custom call's result straight into a stack when
    a dynamic-update-slice is its only user; the step's other readers then read the
    layer's slice of the stack. Behind the barrier, or with other readers, XLA copies the
    result into the stack instead (bench/NOTES.md, twentieth session)."""
    producer = _producers(jaxpr)
    barriers = {tuple(e.invars): e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
                and not any(isinstance(v, jcore.Literal) for v in e.invars)}
    early, through = {}, set()
    for i, k in wanted.items():
        found = _jaxsub_result(producer, jaxpr.outvars[i])
        if found is None or found[0] in early:
            continue
        root, call = found
        early[root] = k
        own = barriers.get(tuple(call.outvars))
        if own is not None:
            through.add(id(own))
    return early, through


def _writing(fn, args, wanted, stacks, at):
    """fn(*args), and `stacks` with the outputs `_early` picks from `wanted(out)` ({index
    into fn's flat outputs: index into stacks}; `out`: fn's outputs as shapes) written at
    index `at` (or at[k] for stack k), each right after the call that makes it; the rest
    of fn reads such a value back from its stack. fn is traced to a jaxpr and evaluated
    equation by equation. Returns (fn's outputs, the stacks, the indices of those
    written)."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    avals = [v.aval for v in jaxpr.outvars]
    early, through = _early(jaxpr, {i: k for i, k in wanted(shape).items()
                                    if (avals[i].shape, avals[i].dtype) == (stacks[k].shape[1:], stacks[k].dtype)})
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, jax.tree.leaves(args)))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
    stacks = list(stacks)
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = ins if id(eqn) in through else bind(eqn, ins)
        for v, out in zip(eqn.outvars, outs):
            k = early.get(v)
            if k is not None:
                slot = at[k] if isinstance(at, list) else at
                stacks[k] = lax.dynamic_update_index_in_dim(stacks[k], out.reshape(stacks[k].shape[1:]), slot, 0)
                out = lax.dynamic_index_in_dim(stacks[k], slot, 0, keepdims=False).reshape(out.shape)
            env[v] = out
    outs = jax.tree.unflatten(jax.tree.structure(shape), [read(v) for v in jaxpr.outvars])
    return outs, stacks, set(early.values())


def _scan_fwd(body, plans, consts, init, xs):
    live = tuple(p and _is_float(a) for p, a in zip(perturbed(consts), jax.tree.leaves(primal_values(consts))))
    consts, init, xs = primal_values((consts, init, xs))
    plan = plans.get(live, consts, init, xs)
    n = plan.length
    buffers = [_empty_stack(n, a) for a in plan.buffers()]
    ys = jax.tree.map(lambda a: _empty_stack(n, a), plan.ys)
    found = {}
    # The held carry leaves (plan.held): layer `at`'s input in slot at + off of a stack of
    # n + 1, its output in the slot of the layer after it; the last output in the extra slot.
    off = 1 if plan.reverse else 0
    carry_leaves, carry_tree = jax.tree.flatten(init)
    held = plan.held
    first = n - 1 if plan.reverse else 0
    inputs = [lax.dynamic_update_index_in_dim(_empty_stack(n + 1, carry_leaves[j]), carry_leaves[j], first + off, 0)
              for j in held]
    free = [None if j in held else a for j, a in enumerate(carry_leaves)]

    def fn(consts, h, x):
        out, _, found["sources"], stored = _pullback(body, consts, h, x, live)
        return out, stored

    def step(state, _):
        i, free, inputs, buffers, ys = state
        at = n - 1 - i if plan.reverse else i
        nxt = (at - 1 if plan.reverse else at + 1) + off
        h = jax.tree.unflatten(carry_tree, [
            lax.dynamic_index_in_dim(inputs[held.index(j)], at + off, 0, keepdims=False) if j in held else a
            for j, a in enumerate(free)])
        # fn's flat outputs: the carry's and y's leaves, then the stored residuals; stacks:
        # the residual buffers, then the held carry leaves' (written at the next slot)
        wanted = lambda out: {**{len(jax.tree.leaves(out[0])) + j: k for k, j in enumerate(plan.alone)},  # noqa: E731
                              **{j: len(buffers) + m for m, j in enumerate(held)}}
        ((h, y), stored), stacks, written = _writing(fn, (consts, h, _slice(xs, at)), wanted, buffers + inputs,
                                                    [at] * len(buffers) + [nxt] * len(inputs))
        if found["sources"] != plan.sources or _avals(stored) != _avals(list(plan.stored)):
            raise RuntimeError(f"{_OP}: `body` traced to other residuals inside the loop than outside it; "
                               "it must be a pure function of its arguments")
        buffers = [b if k in written else lax.dynamic_update_index_in_dim(b, r, at, 0)
                   for k, (b, r) in enumerate(zip(stacks[:len(buffers)], plan.pack(stored)))]
        h_leaves = jax.tree.leaves(h)
        inputs = [b if len(buffers) + m in written else lax.dynamic_update_index_in_dim(b, h_leaves[j], nxt, 0)
                  for m, (j, b) in enumerate(zip(held, stacks[len(buffers):]))]
        free = [None if j in held else a for j, a in enumerate(h_leaves)]
        ys = jax.tree.map(lambda b, r: lax.dynamic_update_index_in_dim(b, r, at, 0), ys, y)
        return (i + 1, free, inputs, buffers, ys), None

    (_, free, inputs, buffers, ys), _ = lax.scan(step, (jnp.int32(0), free, inputs, buffers, ys), None, length=n,
                                                 unroll=plan.unroll)
    last = 0 if plan.reverse else n  # the slot of the last layer's output
    carry = jax.tree.unflatten(carry_tree, [
        lax.dynamic_index_in_dim(inputs[held.index(j)], last, 0, keepdims=False) if j in held else a
        for j, a in enumerate(free)])
    # `live` travels as the residuals' structure (no leaves): () for a live leaf, else None.
    return (carry, ys), (consts, xs, buffers, inputs, tuple(() if d else None for d in live))


def _scan_bwd(body, plans, residuals, cotangents):
    consts, xs, buffers, inputs, marks = residuals
    plan = plans.made(tuple(m is not None for m in marks))
    dcarry, dys = dense_cotangent(cotangents)
    off = 1 if plan.reverse else 0  # the held carry leaves: layer at's input in slot at + off
    n = plan.length
    const_leaves, const_tree = jax.tree.flatten(consts)
    x_leaves, x_tree = jax.tree.flatten(xs)
    grads = [lax.empty(jnp.shape(a), _dtype(a)) if _is_float(a) else None for a in x_leaves]
    dconsts = [jnp.zeros(jnp.shape(a), _dtype(a)) for a, d in zip(const_leaves, plan.live) if d]
    floats = [k for k, g in enumerate(grads) if g is not None]

    def fn(leaves, dh, dy):
        return jax.tree.unflatten(plan.tree, leaves)((dh, dy))

    def step(state, _):
        i, dh, dconsts, grads = state
        at = i if plan.reverse else n - 1 - i  # the forward's layers, last first
        x, dy = _slice(xs, at), _slice(dys, at)
        x_at = jax.tree.leaves(x)
        stored = plan.unpack(_slice(buffers, at), x_at)
        carry_at = [lax.dynamic_index_in_dim(b, at + off, 0, keepdims=False) for b in inputs]
        leaves = [const_leaves[j] if kind == "const" else x_at[j] if kind == "x"
                  else carry_at[plan.held.index(j)] if kind == "carry" else stored[j]
                  for kind, j in plan.sources]
        # fn's flat outputs: the live const leaves' gradients, dh's, then d_x's (x_leaves' order)
        wanted = lambda out: {len(jax.tree.leaves(out[:2])) + k: j for j, k in enumerate(floats)}  # noqa: E731
        (d_consts, dh, d_x), written_grads, written = _writing(
            fn, (leaves, dh, dy), wanted, [grads[k] for k in floats], at)
        dconsts = [acc + d for acc, d in zip(dconsts, d_consts)]
        # d_x has x's leaves (float0 arrays for the integer ones), in x_leaves' order.
        d_leaves = jax.tree.leaves(d_x)
        if len(d_leaves) != len(grads):
            raise RuntimeError(f"{_OP}: the pullback gave {len(d_leaves)} gradients for {len(grads)} leaves of xs")
        grads = list(grads)
        for j, k in enumerate(floats):
            grads[k] = (written_grads[j] if j in written
                        else lax.dynamic_update_index_in_dim(grads[k], d_leaves[k], at, 0))
        return (i + 1, dh, dconsts, grads), None

    state = (jnp.int32(0), dcarry, dconsts, grads)
    (_, dinit, dconsts, grads), _ = lax.scan(step, state, None, length=n, unroll=plan.unroll)
    it = iter(dconsts)
    dconsts = jax.tree.unflatten(const_tree, [next(it) if d else None for d in plan.live])
    return dconsts, dinit, jax.tree.unflatten(x_tree, grads)


_scan.defvjp(_scan_fwd, _scan_bwd, symbolic_zeros=True)


def _scan_reference(body, plans, consts, init, xs):
    """Forward-mode differentiation (`_ffi.custom_vjp`): the loop itself, its body traced with
    every op's jnp reference (the transformation's tracers do not reach into the body)."""
    with _ffi.references():
        return _scan.__wrapped__(body, plans, consts, init, xs)


_scan.defreference("stack.scan", _scan_reference)
