"""Evaluating a planned graph, and `optimize`.

The rewritten program is never materialized as a jaxpr: the graph is re-evaluated node by
node on whatever values arrive (concrete arrays or jit/grad/vmap tracers), and a matched
pattern's anchor calls the fused op instead of its nodes. Because the fused ops are
`jax.custom_vjp` functions, differentiating the optimized function uses their backward
kernels. Differentiate the optimized function (`jax.grad(jaxsub.optimize(f))`), not the
other way round: a gradient's jaxpr no longer contains the forward patterns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi, stack
from jaxsub.layout import select as _select
from jaxsub.ops import config as _config
from jaxsub.ops import dropout as _dropout
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import patterns as P


def _fuses(plan: P.Plan) -> bool:
    return bool(plan.at) or any(_fuses(sub) for sub in plan.sub.values())


def _scan(node, plan, vals):
    """A scan whose body runs fused ops goes through stack.scan (residuals in buffers
    allocated once, none zero-filled), with the scan's unroll; any other keeps lax.scan,
    and with it forward-mode differentiation."""
    p = node.params
    nc, nk = G.scan_counts(p)
    consts, init, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]

    def body(consts, carry, x):
        outs = run(node.body, plan, [*consts, *carry, *x])
        return outs[:nk], outs[nk:]

    if _fuses(plan):
        unroll = max(1, int(p["unroll"]))  # lax.scan's unroll=True is the length in the jaxpr
        carry, ys = stack.scan(body, list(init), list(xs), list(consts), length=p["length"], reverse=p["reverse"],
                               unroll=unroll)
    else:
        carry, ys = jax.lax.scan(lambda carry, x: body(consts, carry, x), list(init), list(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def _remat(node, plan, vals):
    p = node.params
    fn = jax.checkpoint(lambda *a: run(node.body, plan, list(a)),
                        prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))
    return fn(*vals)


def _seed_keys(g: G.Graph, plan: P.Plan):
    """(keys, nodes): the dropout keys of `plan`'s matches that `g` derives (a split's
    slices, Flax's `make_rng`s), in the order of their matches, and the nodes deriving
    them in graph order, when there are at least two such keys and every such node is a
    plain equation that no match took; else ([], [])."""
    keys = []
    for node in g.nodes:
        match = plan.at.get(node)
        key = match.inputs.get("key") if match is not None else None
        if key is not None and key.value is None and key in g.producer and not any(key is k for k in keys):
            keys.append(key)
    if len(keys) < 2:
        return [], []
    need, todo = set(), list(keys)
    while todo:
        node = g.producer.get(ref := todo.pop())
        if ref.value is not None or node is None or node in need:
            continue
        if node in plan.at or node in plan.skip or node.prim == G.SCAN or node.prim in G.REMAT:
            return [], []
        need.add(node)
        todo.extend(node.ins)
    return keys, [n for n in g.nodes if n in need]


def run(g: G.Graph, plan: P.Plan, args):
    """The outputs of `g` on `args`, with `plan`'s matches replaced by fused ops. A match
    output given as `P.Copies` hands one copy to each node that reads it, in order (the
    last copy to the rest); a match returning `P.Rebound` also rebinds refs it read."""
    env = {}
    typed = _ffi.inside_shard_map()

    def store(refs, values):
        """env[ref] = value, labelled by the checkpoint_names the graph left out (G.NAME)."""
        for ref, value in zip(refs, values):
            if not isinstance(value, P.Copies):
                for eqn in g.names.get(ref, ()):
                    value = G.bind(eqn, [value])[0]
            env[ref] = value

    store(g.invars, args)
    handed = {}  # (ref, reading node) -> the copy it got
    given = {}   # ref -> copies handed out so far

    def reader(node):
        def read(ref):
            value = env[ref] if ref in env else ref.value
            if not isinstance(value, P.Copies):
                return value
            if (ref, node) not in handed:
                i = given.get(ref, 0)
                given[ref] = i + 1
                handed[ref, node] = value[min(i, len(value) - 1)]
            return handed[ref, node]
        return read

    # The fused ops' dropout keys derived here are derived first, and the ops get their
    # seeds as quarters of one row (ops.dropout.shared_seeds: one kernel on a GPU).
    keys, early = _seed_keys(g, plan)
    for node in early:
        store(node.outs, G.bind(node.eqn, [reader(node)(r) for r in node.ins]))
    seeds = dict(zip(keys, _dropout.shared_seeds("optimize", [env[k] for k in keys])))
    early = set(early)

    for node in g.nodes:
        if node in plan.skip or node in early:
            continue
        match = plan.at.get(node)
        read = reader(node)
        vals = [read(r) for r in node.ins]
        if match is not None:
            outs = match.build(functools.partial(_seeded, seeds, read) if seeds else read)
            if isinstance(outs, P.Rebound):
                env.update(outs.values)
                outs = outs.outs
            if typed:
                outs = [_typed(v, r) for v, r in zip(outs, node.outs)]
        elif node.prim == G.SCAN:
            outs = _scan(node, plan.sub[node], vals)
        elif node.prim in G.REMAT:
            outs = _remat(node, plan.sub[node], vals)
        else:
            outs = G.bind(node.eqn, vals)
        store(node.outs, outs)
    read = reader(None)
    return [_as_array(read(r), r) for r in g.outvars]


def _as_array(value, ref):
    """An output as jit gives it: a literal or constant output (a Python scalar or JAX's
    typed literal) as an array of its aval's dtype, weakly typed where the aval is."""
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        return value
    value = np.asarray(value)
    if getattr(ref.aval, "weak_type", False) and value.ndim == 0:
        return jnp.asarray(value.item())  # a Python scalar: jnp's weak type, as jit's
    return jnp.asarray(value, ref.dtype)


def _typed(value, ref):
    """A fused op's result typed as the output it replaces inside shard_map: varying over
    every mesh axis that output varies over. The matchers look through the casts of
    replicated constants and parameters to varying (graph.VARYING_CASTS), so the op may
    see fewer varying operands than the nodes it replaces did."""
    axes = _ffi.aval_varying_axes(ref.aval)
    if isinstance(value, P.Copies):
        return P.Copies(_ffi.varying(v, axes) for v in value)
    return _ffi.varying(value, axes)


def _seeded(seeds, read, ref):
    return seeds[ref] if ref in seeds else read(ref)


@dataclasses.dataclass
class Traced:
    """One specialization of the user's function: its graph, plan and output structure;
    `eager` (a jitted `run`) for calls outside any trace, made on the first such call."""
    graph: G.Graph
    plan: P.Plan
    out_tree: object
    closes_over_tracers: bool = False
    eager: object = None
    closes_over_derivatives: bool = False  # a closed-over tracer is traced beyond a first reverse derivative


def _rewrites(plan) -> bool:
    """Whether the plan rewrites anything, in the graph or in a scan/remat body."""
    return bool(plan.at) or any(_rewrites(sub) for sub in plan.sub.values())


def _abstract(leaf):
    aval = jax.typeof(leaf) if hasattr(jax, "typeof") else jax.core.get_aval(leaf)
    # Inside shard_map a value's type also says which mesh axes it varies over: the trace
    # keeps that, so that JAX types the replayed program as it would the original.
    manual = getattr(aval, "manual_axis_type", None)
    extra = {} if manual is None or not manual.varying else {"manual_axis_type": manual, "sharding": aval.sharding}
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False), **extra)


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _is_array(leaf):
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _split(args, kwargs):
    """(array leaves, cache key). Leaves that are not arrays (Python bools, numbers,
    strings: flags such as `deterministic`) are static, part of the key, like
    `jax.jit`'s static arguments."""
    leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    arrays = [x for x in leaves if _is_array(x)]
    static = tuple(None if _is_array(x) else x for x in leaves)
    # The key holds each static leaf with its type (1, 1.0 and True are equal, and hash
    # alike, but trace to different dtypes) and a float's sign (0.0 == -0.0).
    kinds = tuple(None if x is None else (type(x), math.copysign(1.0, x) if isinstance(x, float) else 0.0)
                  for x in static)
    # A trace made under one mesh (shard_map's, pmap's) does not run under another.
    return arrays, (in_tree, static, tuple(_abstract(x) for x in arrays), kinds, _ffi.context_mesh())


def _value(variable):
    """A flat nnx state entry's array (a Variable or its state, by flax version)."""
    get = getattr(variable, "get_value", None)
    return get() if get is not None else getattr(variable, "value", variable)


def _flat(nnx, state):
    return nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()


def _unflat(nnx, entries):
    return nnx.from_flat_state(entries) if hasattr(nnx, "from_flat_state") else nnx.State.from_flat_path(entries)


def _graph_nodes(tree) -> bool:
    """Whether a Flax nnx object (a Module, Rngs, a Variable) is among the arguments."""
    graph = sys.modules.get("flax.nnx.graph")  # only where the caller imported flax.nnx
    if graph is None:
        return False
    return any(graph.is_graph_node(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=graph.is_graph_node))


def trace(fn, options: P.Options, args, kwargs):
    """Trace fn for the abstract values of (args, kwargs), build its graph and plan.
    Returns the Traced specialization and the array leaves it takes."""
    arrays, (in_tree, static, *_) = _split(args, kwargs)
    out_tree = []

    def flat(*xs):
        it = iter(xs)
        leaves = [next(it) if s is None else s for s in static]
        a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
        out, tree = jax.tree_util.tree_flatten(fn(*a, **k))
        for leaf in out:
            if not (hasattr(leaf, "dtype") or isinstance(leaf, (bool, int, float, complex))):
                name = getattr(fn, "__name__", type(fn).__name__)
                raise TypeError(f"jaxsub.optimize: {name} returned a {type(leaf).__name__} among its outputs; "
                                f"an optimized function returns arrays and numbers (as a jitted one)")
        out_tree.append(tree)
        return out

    closed = jax.make_jaxpr(flat)(*[_abstract(x) for x in arrays])
    graph = G.build(closed.jaxpr, closed.consts)
    tracers = any(isinstance(c, jax.core.Tracer) for c in closed.consts)
    return Traced(graph, P.plan(graph, options), out_tree[0], tracers,
                  closes_over_derivatives=_ffi.beyond_first_reverse(closed.consts)), arrays


class Optimized:
    """`fn` with its layer norm, BDRLN, bias+GELU(+dropout), attention and softmax(+dropout)
    patterns run as fused ops."""

    def __init__(self, fn, options: P.Options, layouts):
        self.fn = fn
        self.options = options
        self.layouts = layouts
        self._resolver = _select.op_resolver(layouts)
        self._cache = {}
        self._graph_cache = {}  # nnx graph definition -> the optimized pure function of its state
        functools.update_wrapper(self, fn)

    def specialize(self, args, kwargs):
        arrays, key = _split(args, kwargs)
        try:
            hash(key)
        except TypeError:
            bad = next((x for x in key[1] if x is not None and not _hashable(x)), None)
            what = f"a {type(bad).__name__}" if bad is not None else "a pytree node whose metadata is not"
            raise TypeError(
                f"jaxsub.optimize: a non-array argument is static (part of the trace's key, as jax.jit's static "
                f"arguments) and must be hashable; got {what}. On a method, `self` is such an "
                f"argument: optimize a function that takes the object's arrays (for a Flax module, the function "
                f"that calls `module.apply`)") from None
        traced = self._cache.get(key)
        if traced is None:
            traced, _ = trace(self.fn, self.options, args, kwargs)
            self._cache[key] = traced
        return traced, arrays

    def __getstate__(self):
        """For copy.deepcopy and pickle: fn and the options; the traces (jaxprs, which hold
        tracebacks) and the resolver are made again."""
        return {"fn": self.fn, "options": self.options, "layouts": self.layouts}

    def __setstate__(self, state):
        self.__init__(state["fn"], state["options"], state["layouts"])

    def __get__(self, obj, objtype=None):
        """As a method: `self` is bound as a static argument (non-array leaves are part of
        the trace's key, as jax.jit's static arguments; arrays it holds are constants of
        the trace)."""
        return self if obj is None else functools.partial(self, obj)

    def _call_graph(self, args, kwargs):
        """Flax nnx objects among the arguments, as nnx.jit takes them: split into a graph
        definition and state, the pure function of the state optimized, the new state
        written back (so RNG counts advance and dropout draws a new mask on every call,
        where flattening the module as a pytree would drop its updates, as jax.jit does)."""
        from flax import nnx

        tree = (args, kwargs)
        graphdef, state = nnx.split(tree)
        inner = self._graph_cache.get(graphdef)
        if inner is None:
            fn = self.fn

            def pure(state):
                before = {path: _value(v) for path, v in _flat(nnx, state)}  # (merge may share them)
                a, k = nnx.merge(graphdef, state)
                out = fn(*a, **k)
                # Only what fn changed goes back (an outer transform's trace may not write
                # the caller's parameters; nnx raises TraceContextError).
                changed = [(path, v) for path, v in _flat(nnx, nnx.state((a, k), nnx.Variable))
                           if path not in before or _value(v) is not before[path]]
                return out, _unflat(nnx, changed)

            inner = self._graph_cache[graphdef] = Optimized(pure, self.options, self.layouts)
        out, new_state = inner._call_flat((state,), {})
        nnx.update(tree, new_state)
        return out

    def _run(self, traced, leaves):
        if self._resolver is None:
            return run(traced.graph, traced.plan, leaves)
        with _config.use(self._resolver):
            return run(traced.graph, traced.plan, leaves)

    def __call__(self, *args, **kwargs):
        if _graph_nodes((args, kwargs)):
            return self._call_graph(args, kwargs)
        return self._call_flat(args, kwargs)

    def _call_flat(self, args, kwargs):
        traced, leaves = self.specialize(args, kwargs)
        if traced.closes_over_tracers or any(isinstance(x, jax.core.Tracer) for x in leaves):
            if not _rewrites(traced.plan):
                # Nothing to rewrite: fn itself, traced by the caller's transformation. The
                # replayed jaxpr would be the same program, but a custom_jvp rule in it that
                # closes over fn's traced values would meet stale tracers when differentiated
                # (as under jax.grad(jax.jit(fn))).
                return self.fn(*args, **kwargs)
            # Inside the caller's trace (jit, grad, vmap). Under jax.jvp, jacfwd, hessian or
            # grad of grad every op runs its jnp reference (the fused ops have one reverse
            # derivative), in scan and jit bodies too.
            beyond = traced.closes_over_derivatives or _ffi.beyond_first_reverse(leaves)
            with _ffi.references() if beyond else contextlib.nullcontext():
                outs = self._run(traced, leaves)
        else:
            # Called outside any trace: the rewritten program runs compiled, once per
            # specialization, as fn would under jax.jit (fn's own jit is inlined by the
            # trace; op by op, a loop's body compiled again on every call).
            if traced.eager is None:
                traced.eager = jax.jit(lambda *xs: self._run(traced, list(xs)))
            outs = traced.eager(*leaves)
        return jax.tree_util.tree_unflatten(traced.out_tree, outs)


def optimize(fn=None, *, rewrite_dropout=True, layouts="auto"):
    """Rewrite fn's transformer patterns into jaxsub's fused ops; usable as a decorator.

    The result has fn's signature and pytree structure and composes with jit, grad,
    value_and_grad and vmap, and with jax.jvp, jacfwd, hessian and grad of grad applied
    around it (every fused op then runs its jnp reference, with the same dropout masks:
    the kernels have one reverse derivative; not through a jit boundary, as for any
    custom_vjp). On a method, `self` is bound as a static argument (non-array
    arguments are part of the trace's key, as jax.jit's static arguments, so a mutated
    object is not traced again). fn is traced once per input structure/shape/dtype; matched
    patterns (layer norm, bias+dropout+residual+layer norm, bias+dropout+residual with no
    layer norm after it, bias+GELU+dropout, attention, softmax+dropout) call the fused
    ops, everything else runs exactly as before. See `jaxsub.explain`. Called outside any
    trace, the rewritten program runs compiled (jax.jit, once per specialization); inside
    one (jit, grad, vmap) it becomes part of the caller's program. A jax.jit around fn is
    inlined by the trace: its donate_argnums do not apply.

    When attention's q, k and v are three projections x·W_i (+ b_i) of one x used only by
    the attention (Flax's MultiHeadDotProductAttention, nnx.MultiHeadAttention), the three
    weights are stacked into one product, which the fused attention reads in place. The
    bias of such a packed product (or of a packed array x·W + b the attention slices q, k
    and v from) is added by `ops.bias_add`, whose gradient is a fused column sum. A BDRLN
    whose output is read by two or more operations (a post-LN layer's h) hands each its
    own copy, so its backward kernel adds their gradients instead of an XLA add before it.

    Attention masked with `where(mask, scores, big_negative)` is rewritten as a boolean
    mask: equal wherever a query sees at least one key; a fully masked query row gives 0
    where the original gives the mean of v (explain() says so per match).

    With rewrite_dropout=True, user dropout inside a matched pattern is replaced by the
    kernel's in-kernel dropout, keyed by the same JAX key that fed `jax.random.bernoulli`:
    same keep probability, different random bits. With rewrite_dropout=False such
    patterns are left alone (bias+GELU without its dropout may still be fused).

    `layouts` selects configurations for the fused ops the rewrite produces: "auto"
    (default; per attention signature, the on-disk cache or, on a miss with a GPU present,
    timing of the candidates before the first run of those shapes; without a GPU the
    byte-count heuristic), "heuristic", "none" or None (each op's built-in default),
    `jaxsub.layout.Auto(...)` or a `jaxsub.layout.Selection`. What it can change in an
    arbitrary function is only what the ops leave open, read from the `jaxsub.ops.config`
    context this function runs in: the attention algorithm (fused or unfused,
    `ops.attention(implementation=None)`; tuned per call signature) and the row ops'
    kernel configurations (`kernel_config=None`; only a Selection sets them, the modes
    keep the defaults). The layouts of your tensors are your code's: the full
    per-operator layout choice applies to `jaxsub.flax.EncoderLayer`, which builds its
    operators from a Selection. A Selection passed here gives every attention call its
    "attention" stage's config, and every layer norm, BDRLN and bias-GELU call the kernel
    configuration its encoder stage chose (`jaxsub.layout.select.selection_op_configs`).
    """
    layouts = _select.check_layouts(layouts)
    if fn is None:
        return functools.partial(optimize, rewrite_dropout=rewrite_dropout, layouts=layouts)
    if not callable(fn):
        raise TypeError(f"jaxsub.optimize: `fn` must be callable, got {type(fn).__name__}")
    options = P.Options(rewrite_dropout=_ffi.check_bool("optimize", "rewrite_dropout", rewrite_dropout))
    return Optimized(fn, options, layouts)
