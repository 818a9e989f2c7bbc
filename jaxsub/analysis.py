"""`jaxsub.analyze`: the paper's dataflow analysis (flops, bytes moved, operator class).

Ivanov et al. classify a transformer's operators as tensor contractions, statistical
normalizations and element-wise operators, and count for each the flops it performs and
the bytes it must move: each input read once and each output written once. This module
does that for any JAX function, from its jaxpr, one row per equation; a fused jaxsub
kernel (an `ffi_call` of a `jaxsub_*` target) is one row, named by its target.

Counting rules (what an experienced reader would check first):

- Bytes are aval sizes: inputs read once per equation (an operand used twice is read
  once), outputs written once. Literal scalars and `iota` are free (immediates). Views
  (reshape, squeeze, expand_dims, broadcast_in_dim, stop_gradient, copy, a convert to the
  same dtype, key wrap/unwrap) are "structural": 0 flops, 0 bytes, and their consumers
  read the viewed source instead, so `x + bias` reads the [N] bias, not its broadcast
  (XLA fuses broadcasts into consumers).
- A jaxsub target moves the bytes of its operands and results as cuda/ABI.md lists
  them; its `workspace` results (GPU scratch) are not counted, as in bench/ops.py.
- Flops: dot_general 2·batch·M·N·K, convolution 2·outputs·(kernel elements per output
  feature); reductions (reduce_*, argmax/argmin, cumulative ops) the input's elements;
  element-wise ops the output's elements, a transcendental (exp, tanh, erf, rsqrt) or a
  comparison counting 1; data-layout ops (transpose, slice, concatenate, pad, gather, ...)
  0 flops but their bytes, in the element-wise class. Fused memory-bound targets count
  the unfused math of ABI.md per element (approximate; their bytes are exact); fused
  attention counts its dense matmuls: 4·B·H·Sq·Sk·D forward, 10· backward (scores
  recomputed).
- Classes: dot_general and convolution, and the jaxsub attention targets (fused,
  classified as the contraction they contain, their bytes kept), are tensor
  contractions. Reductions, the jaxsub norm and softmax targets, and the element-wise
  pieces of a normalization are statistical normalizations; a piece is an element-wise
  equation that uses a statistic (a reduction's output, or a value computed from one and
  no larger: mean, rstd, a softmax's max and sum) or that carries such a piece's output
  into a reduction (x−mean → square → sum; s−max → exp → sum). So softmax and layer norm
  written in jnp count as normalizations forward and backward, while bias, dropout,
  residual and activations stay element-wise. Everything else that computes is
  element-wise.
- Dead equations (results never used, e.g. a discarded softmax or forward values
  differentiation does not need) are skipped, as XLA drops them. Calls (jit,
  custom_jvp/custom_vjp, remat) are descended into; a scan's body is multiplied by its
  trip count; a cond counts its largest branch (by bytes) and a while loop counts its
  body once, each with a note saying so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time as _time
import warnings

import jax
import numpy as np

from jaxsub.rewrite import graph as G
from jaxsub.rewrite import interpreter
from jaxsub.rewrite import patterns as P

CONTRACTION = "tensor contraction"
NORMALIZATION = "statistical normalization"
ELEMENTWISE = "element-wise"
STRUCTURAL = "structural"
CLASSES = (CONTRACTION, NORMALIZATION, ELEMENTWISE, STRUCTURAL)

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin", "cumsum", "cumprod",
                         "cummax", "cummin", "cumlogsumexp"})
_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "stop_gradient",
                    "copy", "copy_p", "random_wrap", "random_unwrap", "sharding_constraint"})
_FREE = frozenset({"iota"})
_LAYOUT = frozenset({"transpose", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate",
                     "pad", "gather", "rev", "bitcast_convert_type"})
_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
# jaxsub target -> (class, flops per element of its first operand), from ABI.md's math.
_FUSED = {
    "jaxsub_dropout_mask": (ELEMENTWISE, 1),
    "jaxsub_layer_norm_fwd": (NORMALIZATION, 7),
    "jaxsub_layer_norm_bwd": (NORMALIZATION, 14),
    "jaxsub_bdrln_fwd": (NORMALIZATION, 10),
    "jaxsub_bdrln_bwd": (NORMALIZATION, 19),
    "jaxsub_bias_gelu_dropout_fwd": (ELEMENTWISE, 7),
    "jaxsub_bias_gelu_dropout_bwd": (ELEMENTWISE, 12),
    "jaxsub_softmax_dropout_fwd": (NORMALIZATION, 7),
    "jaxsub_softmax_dropout_bwd": (NORMALIZATION, 9),
    "jaxsub_attention_fwd": (CONTRACTION, None),
    "jaxsub_attention_bwd": (CONTRACTION, None),
}
_WORKSPACES = {"jaxsub_layer_norm_bwd": 1, "jaxsub_bdrln_bwd": 1, "jaxsub_bias_gelu_dropout_bwd": 1,
               "jaxsub_attention_bwd": 2}


@dataclasses.dataclass
class OpStat:
    """One equation (or fused kernel). flops and bytes include the `count` executions."""
    op: str
    cls: str
    shape: str
    flops: int
    bytes: int
    count: int = 1
    scope: str = ""      # enclosing scans/calls, e.g. "scan×12 > remat"
    source: str = ""     # file:line:col (function) of the code that emitted it


# ---------------------------------------------------------------------------------------
# Per-equation counting.


def _nbytes(aval) -> int:
    try:
        item = np.dtype(aval.dtype).itemsize
    except TypeError:  # PRNG key arrays: their key data (threefry: 2 x u32)
        item = 4 * math.prod(getattr(getattr(aval.dtype, "_impl", None), "key_shape", (2,)))
    return math.prod(aval.shape) * item


def _size(ref) -> int:
    return math.prod(ref.shape)


def _is_view(node) -> bool:
    if node.prim == "convert_element_type":
        return node.ins[0].dtype == node.outs[0].dtype
    return node.prim in _VIEWS and len(node.ins) >= 1


def _source(g, ref):
    """The Ref a reader of `ref` really reads, through views; None when it is free."""
    while True:
        node = g.producer.get(ref)
        if node is not None and _is_view(node):
            ref = node.ins[0]
        elif (node is not None and node.prim in _FREE) or (ref.value is not None and _size(ref) <= 1):
            return None
        else:
            return ref


def _contraction_flops(node) -> int:
    out = _size(node.outs[0])
    if node.prim == "dot_general":
        (lhs_c, _), _ = node.params["dimension_numbers"]
        return 2 * out * math.prod(node.ins[0].shape[d] for d in lhs_c)
    rhs = node.ins[1].shape
    return 2 * out * math.prod(rhs) // rhs[node.params["dimension_numbers"].rhs_spec[0]]


def _fused_row(node):
    target = node.params["target_name"]
    cls, per_element = _FUSED.get(target, (ELEMENTWISE, 0))
    results = node.outs[:len(node.outs) - _WORKSPACES.get(target, 0)]
    if per_element is None:  # attention: q [B, Sq, H, D], k [B, Sk, H, D]
        bwd = target.endswith("_bwd")
        q, k = node.ins[int(bwd)], node.ins[1 + int(bwd)]
        b, sq, h, d = q.shape
        flops = (10 if bwd else 4) * b * h * sq * k.shape[1] * d
    else:
        flops = per_element * (_size(node.ins[0]) if node.ins else _size(results[0]))
    moved = sum(_nbytes(r.aval) for r in node.ins) + sum(_nbytes(r.aval) for r in results)
    return target, cls, results, flops, moved


def _normalization_nodes(g, live) -> set:
    """Element-wise equations that are pieces of a normalization (module docstring)."""
    consumers = {}
    for n in live:
        for r in n.ins:
            consumers.setdefault(r, []).append(n)

    def feeds_reduction(ref):
        return any(c.prim in _REDUCTIONS or (_is_view(c) and feeds_reduction(c.outs[0]))
                   for c in consumers.get(ref, ()))

    stats, pieces, norm = set(), set(), set()
    for n in g.nodes:
        if n not in live:
            continue
        if n.prim in _REDUCTIONS:
            stats.update(n.outs)
            continue
        if _kind(n) != ELEMENTWISE or n.prim in _LAYOUT:
            continue
        srcs = {_source(g, r) for r in n.ins} - {None}
        used = [_size(s) for s in srcs if s in stats]
        if used:
            norm.add(n)
            (stats if _size(n.outs[0]) <= max(used) else pieces).update(n.outs)
        elif srcs & pieces and any(feeds_reduction(r) for r in n.outs):
            norm.add(n)
            pieces.update(n.outs)
    return norm


def _kind(node) -> str:
    if node.prim in ("dot_general", "conv_general_dilated"):
        return CONTRACTION
    if node.prim in _REDUCTIONS:
        return NORMALIZATION
    if _is_view(node) or node.prim in _FREE:
        return STRUCTURAL
    return ELEMENTWISE


def _row(g, node, norm, count, scope) -> OpStat:
    if node.prim == "ffi_call":
        op, cls, outs, flops, moved = _fused_row(node)
    else:
        op, cls, outs = node.prim, _kind(node), node.outs
        if cls == STRUCTURAL:
            flops = moved = 0
        else:
            if cls == ELEMENTWISE and node in norm:
                cls = NORMALIZATION
            if cls == CONTRACTION:
                flops = _contraction_flops(node)
            elif node.prim in _REDUCTIONS:
                flops = _size(node.ins[0])
            else:
                flops = 0 if node.prim in _LAYOUT else sum(_size(r) for r in outs)
            reads = {id(s): s for s in (_source(g, r) for r in node.ins) if s is not None}
            moved = sum(_nbytes(s.aval) for s in reads.values()) + sum(_nbytes(r.aval) for r in outs)
    shape = ", ".join(r.aval.str_short(short_dtypes=True) for r in outs)
    return OpStat(op, cls, shape, flops * count, moved * count, count, scope)


# ---------------------------------------------------------------------------------------
# Walking the graph: liveness, calls, scan, cond, while.


def _live(g, outs):
    """(live nodes, live refs) of g when `outs` are needed; effectful nodes always live."""
    refs, nodes = set(outs), set()
    for node in reversed(g.nodes):
        if node.eqn.effects or any(r in refs for r in node.outs):
            nodes.add(node)
            refs.update(node.ins)
    return nodes, refs


def _walk(g, outs, count, scope, notes, site=None) -> list[OpStat]:
    """Rows of g's live equations; calls are transparent, scan/cond/while extend `scope`.
    `site` (the enclosing call's source) stands in for equations without a source."""
    live, refs = _live(g, outs)
    norm = _normalization_nodes(g, live)
    inner = f"{scope} > " if scope else ""
    rows = []
    for node in g.nodes:
        if node not in live:
            continue
        p, prim, here = node.params, node.prim, G.source_line(node)
        here = site if here == "<unknown>" and site else here

        def needed(body):
            return [b for b, r in zip(body.outvars, node.outs) if r in refs]

        if prim == G.SCAN:
            rows += _walk(node.body, node.body.outvars, count * p["length"],
                          f"{inner}scan×{p['length']}", notes, here)
        elif prim in G.REMAT or prim in _CALLS or node.call_name is not None:
            body = node.body or G.build(*G._body(p))
            rows += _walk(body, needed(body), count, inner + "remat" if prim in G.REMAT else scope,
                          notes, here)
        elif prim == "cond":
            found = []
            for i, closed in enumerate(p["branches"]):
                body = G.build(closed.jaxpr, closed.consts)
                found.append(_walk(body, needed(body), count, f"{inner}cond[{i}]", notes, here))
            best = max(range(len(found)), key=lambda i: sum(r.bytes for r in found[i]))
            notes.append(f"cond at {here}: counted branch {best}, the largest of {len(found)} by bytes")
            rows += found[best]
        elif prim == "while":
            notes.append(f"while at {here}: body counted once (trip count unknown at trace time)")
            for key in ("cond_jaxpr", "body_jaxpr"):
                body = G.build(p[key].jaxpr, p[key].consts)
                rows += _walk(body, body.outvars, count, f"{inner}while.{key[:-6]}", notes, here)
        else:
            row = _row(g, node, norm, count, scope)
            row.source = here
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------
# The result.


def _mb(n) -> str:
    return f"{n / 1e6:,.3f} MB"


@dataclasses.dataclass
class Analysis:
    """Rows of one function's analysis; `print` it for a table, `to_dict`/`to_json` to keep
    it. `optimized` holds the analysis of `jaxsub.optimize(fn)` when it was compared."""
    ops: list
    notes: list = dataclasses.field(default_factory=list)
    optimized: Analysis | None = None
    timing: dict | None = None

    @property
    def flops(self) -> int:
        return sum(r.flops for r in self.ops)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.ops)

    @property
    def targets(self) -> set:
        """The jaxsub kernels the function runs."""
        return {r.op for r in self.ops if r.op.startswith("jaxsub_")}

    def by_class(self) -> dict:
        """{class: {"ops", "flops", "bytes", "bytes_pct"}} for every class in CLASSES."""
        total = self.bytes or 1
        out = {}
        for cls in CLASSES:
            rows = [r for r in self.ops if r.cls == cls]
            moved = sum(r.bytes for r in rows)
            out[cls] = {"ops": len(rows), "flops": sum(r.flops for r in rows), "bytes": moved,
                        "bytes_pct": 100.0 * moved / total}
        return out

    @property
    def bytes_reduction_pct(self) -> float | None:
        """How many percent fewer bytes the optimized function moves (None: not compared)."""
        if self.optimized is None or not self.bytes:
            return None
        return 100.0 * (1.0 - self.optimized.bytes / self.bytes)

    def to_dict(self) -> dict:
        return {"ops": [dataclasses.asdict(r) for r in self.ops], "notes": list(self.notes),
                "flops": self.flops, "bytes": self.bytes, "by_class": self.by_class(),
                "timing": self.timing, "bytes_reduction_pct": self.bytes_reduction_pct,
                "optimized": None if self.optimized is None else self.optimized.to_dict()}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict) -> Analysis:
        return cls([OpStat(**r) for r in d["ops"]], list(d["notes"]),
                   None if d["optimized"] is None else cls.from_dict(d["optimized"]), d["timing"])

    def table(self, structural: bool = False) -> str:
        """One line per operator; zero-cost structural rows only when `structural`."""
        rows = [r for r in self.ops if structural or r.cls != STRUCTURAL]
        cells = [("op", "class", "shape", "×", "flops", "bytes", "source")]
        for r in rows:
            op = f"{r.scope} > {r.op}" if r.scope else r.op
            src = r.source.rsplit("/", 1)[-1]
            cells.append((op, r.cls, r.shape, str(r.count), f"{r.flops:,}", f"{r.bytes:,}", src))
        widths = [max(len(c[i]) for c in cells) for i in range(6)]
        right = (False, False, False, True, True, True)
        lines = ["  ".join((c.rjust(w) if rj else c.ljust(w)) for c, w, rj in zip(row, widths, right))
                 + "  " + row[6] for row in cells]
        hidden = len(self.ops) - len(rows)
        if hidden:
            lines.append(f"({hidden} zero-cost structural equations not shown)")
        return "\n".join(lines)

    def totals(self) -> str:
        lines = [f"{'class':<27}{'ops':>5}{'flops':>18}{'bytes':>18}{'bytes %':>9}"]
        for cls, t in self.by_class().items():
            lines.append(f"{cls:<27}{t['ops']:>5}{t['flops']:>18,}{t['bytes']:>18,}{t['bytes_pct']:>8.1f}%")
        lines.append(f"{'total':<27}{len(self.ops):>5}{self.flops:>18,}{self.bytes:>18,}{100.0:>8.1f}%")
        return "\n".join(lines)

    def __str__(self):
        parts = ["jaxsub.analyze", self.table(), "", self.totals()]
        parts += [f"note: {n}" for n in self.notes]
        if self.timing is not None:
            t = self.timing
            parts.append(f"device time {t['time_s'] * 1e3:.3f} ms; bytes at {t['bandwidth_Bps'] / 1e9:.0f} GB/s "
                         f"take {t['floor_s'] * 1e3:.3f} ms: memory efficiency "
                         f"{100 * t['memory_efficiency']:.1f}% (not split by class)")
        if self.optimized is not None:
            opt = self.optimized
            parts += ["", "after jaxsub.optimize:", opt.totals(),
                      "fused kernels: " + (", ".join(sorted(opt.targets)) or "none")]
            parts += [f"note: {n}" for n in opt.notes]
            parts.append(f"data movement: {_mb(self.bytes)} -> {_mb(opt.bytes)}, "
                         f"{self.bytes_reduction_pct:.2f}% fewer bytes")
        return "\n".join(parts)


# ---------------------------------------------------------------------------------------
# analyze.


def _flat(fn, args, kwargs):
    """fn as a function of its array leaves (other leaves static, as optimize treats them)."""
    arrays, (in_tree, static, _) = interpreter._split(args, kwargs)

    def flat(*xs):
        it = iter(xs)
        a, k = jax.tree_util.tree_unflatten(in_tree, [next(it) if s is None else s for s in static])
        return fn(*a, **k)

    return flat, arrays


def _median_s(fn, args, repeats) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = _time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(_time.perf_counter() - start)
    return statistics.median(samples)


def _measure(fn, args, kwargs, moved: int, repeats: int = 20):
    """Median device time of jit(fn) and its memory efficiency, on a GPU; None elsewhere."""
    if jax.default_backend() != "gpu":
        warnings.warn("jaxsub.analyze(time=True) measures on a GPU only; no GPU backend here, "
                      "so the analysis is returned without timing", stacklevel=3)
        return None
    flat, arrays = _flat(fn, args, kwargs)
    seconds = _median_s(jax.jit(flat), arrays, repeats)
    buf = jax.numpy.zeros((64 << 20,), jax.numpy.float32)  # 256 MiB, far beyond L2
    bandwidth = 2 * buf.nbytes / _median_s(jax.jit(lambda x: -x), (buf,), repeats)
    floor = moved / bandwidth
    return {"time_s": seconds, "bandwidth_Bps": bandwidth, "floor_s": floor,
            "memory_efficiency": floor / seconds}


def _analyze_one(fn, args, kwargs, time) -> Analysis:
    traced, _ = interpreter.trace(fn, P.Options(), args, kwargs)
    notes = []
    rows = _walk(traced.graph, traced.graph.outvars, 1, "", notes)
    result = Analysis(rows, notes)
    if time:
        result.timing = _measure(fn, args, kwargs, result.bytes)
    return result


def analyze(fn, *args, compare_optimized=True, grad=False, argnums=0, time=False, **kwargs) -> Analysis:
    """Flops, bytes moved and operator class of every equation of fn(*args, **kwargs).

    The counting rules are in this module's docstring. Arguments that are not arrays
    (flags such as `deterministic`) are static, as for `jaxsub.optimize`; `kwargs` go to
    fn.

    compare_optimized: also analyze `jaxsub.optimize(fn)` on the same arguments into
      `.optimized`; `.bytes_reduction_pct` is then the paper's data-movement reduction.
      When fn is itself an optimized function, its original is the baseline.
    grad: analyze a training step, `jax.value_and_grad(fn, argnums)` (fn returns a scalar
      loss), against `jax.value_and_grad(jaxsub.optimize(fn), argnums)`, so the backward
      kernels are counted. Pass the loss, not its gradient: the pass matches forward
      patterns, and `optimize(jax.value_and_grad(loss))` finds few.
    time: on a GPU, also time the jitted function (median of 20 calls after a warm-up)
      and set `.timing` = {time_s, bandwidth_Bps (copy bandwidth measured here), floor_s
      (bytes / bandwidth), memory_efficiency (floor_s / time_s)}. The time is not split by
      operator class: XLA fuses element-wise ops into reductions and matmul epilogues, so
      its kernels do not map onto the classes. Without a GPU it warns and leaves
      `.timing` None.
    """
    base = fn.fn if isinstance(fn, interpreter.Optimized) else fn
    opt = fn if isinstance(fn, interpreter.Optimized) else interpreter.optimize(fn)
    if grad:
        base, opt = (jax.value_and_grad(f, argnums) for f in (base, opt))
    result = _analyze_one(base, args, kwargs, time)
    if compare_optimized:
        result.optimized = _analyze_one(opt, args, kwargs, time)
    return result
