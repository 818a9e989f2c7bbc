"""A flat, rewritable view of a jaxpr.

`build` turns a ClosedJaxpr into a `Graph` of `Node`s connected by `Ref`s. Calls to
`jit`/`pjit`/`closed_call` are inlined (fresh `Ref`s per call site, so a sub-jaxpr shared
by several calls stays correct); `scan` and `remat` keep their own body `Graph`, searched
separately and re-wrapped at evaluation time. Everything else, including
`custom_jvp_call`/`custom_vjp_call`, `while` and `cond`, is an opaque node evaluated as
is. Scalar constants are folded so that matchers can read values such as `jnp.var`'s
normalizer, which arrives as a computation on a literal.
"""

from __future__ import annotations

import os
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxsub._jaxpr import bind  # noqa: F401 - the pass binds through graph.bind

_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call"})
# jit-wrapped library functions kept whole because matchers recognize the call itself.
_OPAQUE_CALLS = frozenset({"_bernoulli", "_uniform"})
SCAN = "scan"
REMAT = frozenset({"remat2", "checkpoint", "remat"})
# Bodies never searched; explain() lists them.
UNSEARCHED = frozenset({"while", "cond", "custom_jvp_call", "custom_vjp_call",
                        "custom_vjp_call_jaxpr", "custom_lin", "custom_vmap_call", "shard_map", "xla_pmap"})
_FOLDABLE = frozenset({"convert_element_type", "add", "sub", "mul", "div", "neg", "gt", "ge",
                       "lt", "le", "eq", "ne", "max", "min", "sqrt", "rsqrt", "select_n",
                       "reshape", "broadcast_in_dim", "and", "or", "not", "stop_gradient"})
UNIT_SHAPE_OPS = frozenset({"broadcast_in_dim", "reshape"})
# shard_map (with check_vma) casts a replicated value to varying before it meets a sharded
# one: constants and parameters reach the patterns through these. Matchers look through
# them (`Graph.op`, folded values); the fused op casts its operands again
# (`_ffi.custom_vjp`) and the interpreter types its results as the replaced outputs.
VARYING_CASTS = frozenset({"pvary"})
# checkpoint_name: a label for remat policies, the identity on values. The graph leaves it
# out (its output is its input's Ref) so that patterns see through it; `Graph.names` keeps
# the labels, and the interpreter labels each value again where it is computed.
NAME = "name"


class Ref:
    """One value of the graph; `value` is set for literals, constants and folded scalars.
    A constant may be a tracer of an enclosing transformation (a function that closes over
    a value traced by an outer `jit` or `grad`): evaluation reads it as it is, matchers
    read values through `known`."""

    __slots__ = ("aval", "value")

    def __init__(self, aval, value=None):
        self.aval = aval
        self.value = value

    @property
    def shape(self):
        return tuple(self.aval.shape)

    @property
    def dtype(self):
        return self.aval.dtype


def known(ref):
    """The value of `ref` when it is known while tracing (a literal, a concrete constant, a
    folded scalar), else None: a value computed at run time, or a closed-over tracer."""
    value = ref.value
    return None if value is None or isinstance(value, jax.core.Tracer) else value


class Node:
    __slots__ = ("eqn", "ins", "outs", "body", "sites")

    def __init__(self, eqn, ins, outs, body=None, sites=()):
        self.eqn = eqn
        self.sites = sites  # the inlined call equations around eqn, innermost first
        self.ins = ins
        self.outs = outs
        self.body = body

    @property
    def prim(self) -> str:
        return self.eqn.primitive.name

    @property
    def params(self):
        return self.eqn.params

    @property
    def call_name(self):
        return self.eqn.params.get("name") if self.prim in _INLINE else None


class Graph:
    def __init__(self):
        self.invars: list[Ref] = []
        self.outvars: list[Ref] = []
        self.nodes: list[Node] = []
        self.producer: dict[Ref, Node] = {}
        self.uses: Counter = Counter()
        self.names: dict[Ref, list] = {}  # a Ref -> the checkpoint_name equations applied to it
        # A dropout draw (a _bernoulli/_uniform call) -> {(below, the mask's first node)}:
        # the form of each mask the matchers took from it (rewrite.match_dropout).
        self.draw_forms: dict[Node, set] = {}

    # -- queries used by matchers -------------------------------------------------------

    def op(self, ref, *names):
        """The node producing `ref` when its primitive is one of `names`, else None; a
        cast to varying (shard_map) in between is looked through."""
        node = self.producer.get(ref)
        while node is not None and node.prim in VARYING_CASTS and node.prim not in names:
            node = self.producer.get(node.ins[0])
        return node if node is not None and node.prim in names else None

    def is_output(self, ref) -> bool:
        return any(r is ref for r in self.outvars)

    def scalar(self, ref):
        """The Python float of a one-element constant (after broadcasts/converts), else None."""
        while ref.value is None:
            node = self.op(ref, "broadcast_in_dim", "reshape", "convert_element_type", *VARYING_CASTS)
            if node is None:
                return None
            ref = node.ins[0]
        val = known(ref)
        if val is None or getattr(val, "size", 1) != 1:
            return None
        try:
            return float(np.asarray(val).reshape(()))
        except (TypeError, ValueError):
            return None

    def precision(self, ref):
        """The narrowest float dtype a constant passed through on its way to `ref` (its own
        dtype, or that of a literal it was converted from: a bf16 constant upcast to f32
        still only holds bf16's digits). Folded values hide such converts from `scalar`,
        so this walks the producers whatever their values."""
        best = None
        while True:
            if jnp.issubdtype(ref.dtype, jnp.floating) and (
                    best is None or jnp.finfo(ref.dtype).eps > jnp.finfo(best).eps):
                best = jnp.dtype(ref.dtype)
            node = self.op(ref, "broadcast_in_dim", "reshape", "convert_element_type")
            if node is None:
                return best if best is not None else jnp.dtype(jnp.float32)
            ref = node.ins[0]


def _fold(eqn, ins):
    if eqn.primitive.name in VARYING_CASTS and len(ins) == 1 and not eqn.primitive.multiple_results:
        value = known(ins[0])  # the value is the same on every device
        return None if value is None or getattr(value, "size", 1) != 1 else np.asarray(value)
    if eqn.primitive.name not in _FOLDABLE or eqn.primitive.multiple_results:
        return None
    values = [known(r) for r in ins]
    if any(v is None or getattr(v, "size", 1) != 1 for v in values):
        return None
    if any(np.prod(v.aval.shape, dtype=int) != 1 for v in eqn.outvars):
        return None
    with jax.ensure_compile_time_eval():
        return np.asarray(bind(eqn, values)[0])


def _body(params):
    """(Jaxpr, consts) of a scan/remat/jit body, whichever form the version uses."""
    body = params.get("jaxpr", params.get("call_jaxpr"))
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    return body, []


def scan_counts(params) -> tuple[int, int]:
    """(number of consts, number of carries) of a scan equation's operands: jax <= 0.10
    names them (num_consts, num_carry); jax 0.11 describes the operands by a flat tree,
    ft_in, of three groups (consts, carry, xs) whose leaves are the operands."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


class _Builder:
    def __init__(self, graph: Graph):
        self.g = graph

    def ref(self, env, atom):
        if isinstance(atom, jcore.Literal):
            return Ref(atom.aval, atom.val)
        return env[atom]

    def emit(self, jaxpr, consts, in_refs, sites=()):
        env = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = Ref(v.aval, c)
        for v, r in zip(jaxpr.invars, in_refs):
            env[v] = r
        for eqn in jaxpr.eqns:
            ins = [self.ref(env, a) for a in eqn.invars]
            name = eqn.primitive.name
            if name in _INLINE and eqn.params.get("name") not in _OPAQUE_CALLS:
                inner, inner_consts = _body(eqn.params)
                outs = self.emit(inner, inner_consts, ins, (eqn, *sites))
            elif name == NAME and len(ins) == 1 and len(eqn.outvars) == 1:
                outs = ins
                self.g.names.setdefault(ins[0], []).append(eqn)
            else:
                body = None
                if name == SCAN or name in REMAT:
                    inner, inner_consts = _body(eqn.params)
                    body = build(inner, inner_consts)
                outs = [Ref(v.aval) for v in eqn.outvars]
                node = Node(eqn, ins, outs, body, sites)
                folded = _fold(eqn, ins)
                if folded is not None:
                    outs[0].value = folded
                self.g.nodes.append(node)
                for r in outs:
                    self.g.producer[r] = node
                self.g.uses.update(ins)
            for v, r in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = r
        return [self.ref(env, a) for a in jaxpr.outvars]


def build(jaxpr, consts, values=None) -> Graph:
    """The Graph of an open jaxpr whose constvars take `consts`; `values`, where given,
    are the invars' known values (None where unknown), as `Ref.value`."""
    g = Graph()
    g.invars = [Ref(v.aval, val) for v, val in zip(jaxpr.invars, values or [None] * len(jaxpr.invars))]
    g.outvars = _Builder(g).emit(jaxpr, consts, g.invars)
    g.uses.update(g.outvars)
    _drop_dead(g)
    return g


def _drop_dead(g: Graph) -> None:
    """Removes the nodes whose outputs reach no output and that have no effects (what
    jit's dead-code elimination drops), so that the plan neither matches them (explain
    listed matches the compiled program had no call for) nor counts their uses."""
    live = set(g.outvars)
    kept = []
    for node in reversed(g.nodes):
        if node.eqn.effects or any(r in live for r in node.outs):
            live.update(node.ins)
            kept.append(node)
            continue
        g.uses.subtract(node.ins)
        for r in node.outs:
            del g.producer[r]
    g.nodes = kept[::-1]
    g.uses = +g.uses


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))


def _frames(siu, source_info):
    """User frames first; then library frames (flax), which JAX hides from user_frames and
    which are all that remains when its traceback depth limit cuts the user's off."""
    yield from siu.user_frames(source_info.traceback)
    if source_info.traceback is not None:
        code, lasti = source_info.traceback.raw_frames()
        for c, i in zip(code, lasti):
            if not os.path.abspath(c.co_filename).startswith(_JAX_DIR):
                yield siu.raw_frame_to_frame(c, i)


def source_line(node) -> str:
    """`file:line:col (function)` of the code that emitted `node`, when JAX can say.

    Frames inside jaxsub (the tracing wrapper) are skipped; an equation inlined from a
    library jit (jnp.where) falls back to its call sites, innermost first."""
    try:
        from jax._src import source_info_util as siu
        for eqn in (node.eqn, *node.sites):
            for frame in _frames(siu, eqn.source_info):
                if not os.path.abspath(frame.file_name).startswith(_PACKAGE_DIR):
                    return siu._summarize_frame(frame)
    except Exception:  # private API: a missing or changed helper only loses the location
        pass
    return "<unknown>"
