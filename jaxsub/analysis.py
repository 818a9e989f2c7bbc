"""`jaxsub.analyze`: the paper's dataflow analysis (flops, bytes moved, operator class).

Ivanov et al. class a transformer's operators as tensor contractions, statistical
normalizations and element-wise operators, and count the flops each performs and the
bytes it must move: each input read once, each output written once. This module does so
for any JAX function, one row per jaxpr equation; a fused kernel (an `ffi_call` of a
`jaxsub_*` target) is one row, named by its target.

- Bytes are aval sizes; an operand used twice is read once. Literal scalars and `iota`
  are free. Views (reshape, squeeze, expand_dims, broadcast_in_dim, stop_gradient, copy,
  a convert to the same dtype, key wrap/unwrap) are "structural", 0 flops and 0 bytes,
  and their readers read the viewed source: `x + bias` reads the [N] bias, not its
  broadcast (XLA fuses broadcasts into consumers). A jaxsub target moves its operands
  and results (cuda/ABI.md) except its GPU-scratch `workspace` results, as bench/ops.py.
- Flops: dot_general 2·batch·M·N·K, convolution 2·outputs·(kernel elements per output
  feature); reductions (reduce_*, argmax/argmin, cumulative) the input's elements;
  element-wise ops the output's elements, a transcendental or comparison counting 1;
  data-layout ops (transpose, slice, concatenate, pad, gather, ...) 0, but their bytes
  count, in the element-wise class; a slice or dynamic_slice moves its window (read,
  written) and a dynamic_update_slice its update (read, written in place), not the
  whole array (a scan's stacked buffers). Fused memory-bound targets count ABI.md's unfused
  math per element (approximate; their bytes are exact); fused attention its dense
  matmuls, 4·B·H·Sq·Sk·D forward and 10· backward (scores recomputed).
- Classes: dot_general, convolution and the jaxsub attention targets (the contraction
  they contain; their bytes kept) are tensor contractions. Reductions, the jaxsub norm
  and softmax targets and the element-wise pieces of a normalization are statistical
  normalizations: a piece uses a statistic (a reduction's output, or a value computed
  from one and no larger: mean, rstd, a softmax's max and sum) or carries a piece into a
  reduction (x−mean → square → sum; s−max → exp → sum). So jnp softmax and layer norm
  count as normalizations forward and backward, while bias, dropout, residual and
  activations stay element-wise, as does everything else that computes.
- Dead equations (e.g. a discarded softmax, forward values the backward does not need)
  are skipped, as XLA drops them. Calls (jit, custom_jvp/vjp, remat) are descended into;
  a scan body counts its trip count times; a cond counts its largest branch (by bytes)
  and a while loop its body once; other primitives with bodies (custom_linear_solve,
  shard_map) count as one operator. Each such choice adds a note.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import warnings

import jax
import numpy as np
from jax.extend import core as jcore

from jaxsub import _ffi, _partition
from jaxsub import _timing
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
# Slicing ops that touch only their window: a slice reads it, a dynamic_update_slice
# writes it into its operand in place (a scan's stacked buffers: not the whole stack).
_WINDOWS = frozenset({"slice", "dynamic_slice", "dynamic_update_slice"})
_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
# jaxsub target -> (class, flops per element of its first operand), from ABI.md's math.
_FUSED = {
    "jaxsub_dropout_mask": (ELEMENTWISE, 1),
    "jaxsub_layer_norm_fwd": (NORMALIZATION, 7), "jaxsub_layer_norm_bwd": (NORMALIZATION, 14),
    "jaxsub_bdrln_fwd": (NORMALIZATION, 10), "jaxsub_bdrln_bwd": (NORMALIZATION, 19),
    "jaxsub_bias_gelu_dropout_fwd": (ELEMENTWISE, 7), "jaxsub_bias_gelu_dropout_bwd": (ELEMENTWISE, 12),
    # x + dropout(y + bias): the bias add, the scale, the residual add; backward the scale
    # and the column sum's add.
    "jaxsub_bias_dropout_residual_fwd": (ELEMENTWISE, 3), "jaxsub_bias_dropout_bwd": (ELEMENTWISE, 2),
    "jaxsub_softmax_dropout_fwd": (NORMALIZATION, 7), "jaxsub_softmax_dropout_bwd": (NORMALIZATION, 9),
    "jaxsub_attention_fwd": (CONTRACTION, None), "jaxsub_attention_bwd": (CONTRACTION, None),
    "jaxsub_attention_bwd_dqkv": (CONTRACTION, None),
    "jaxsub_attention_qkv_fwd": (CONTRACTION, None), "jaxsub_attention_qkv_bwd": (CONTRACTION, None),
    "jaxsub_bias_grad": (NORMALIZATION, 1),  # a column sum, classed like XLA's reduce_sum
    "jaxsub_gemm": (CONTRACTION, None),
    "jaxsub_dense_gelu_fwd": (CONTRACTION, None),  # the product, then 7 per element of y
}
# Positions of each target's scratch results (ABI.md), not counted as moved bytes.
_WORKSPACES = {"jaxsub_layer_norm_bwd": (-1,), "jaxsub_bdrln_bwd": (-1,), "jaxsub_bias_gelu_dropout_bwd": (2,),
               "jaxsub_bias_dropout_bwd": (-1,),
               "jaxsub_attention_bwd": (-2, -1), "jaxsub_attention_bwd_dqkv": (-3, -2, -1),
               # after its five results, the k and v bias gradients where the biases are apart
               "jaxsub_attention_qkv_bwd": (2, 3, 4), "jaxsub_bias_grad": (-1,),
               "jaxsub_gemm": (-1,)}


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
    source: str = ""     # file:line:col (function) [name scope] of the code that emitted it


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
    if node.prim == "optimization_barrier":  # an identity on each operand (jaxsub._ffi.call's)
        return len(node.ins) == len(node.outs) >= 1
    return node.prim in _VIEWS and len(node.ins) >= 1


def _viewed(node, ref):
    """The operand of view `node` that its result `ref` shows."""
    return node.ins[node.outs.index(ref)] if node.prim == "optimization_barrier" else node.ins[0]


def _source(g, ref):
    """The Ref a reader of `ref` really reads, through views; None when it is free."""
    while True:
        node = g.producer.get(ref)
        if node is not None and _is_view(node):
            ref = _viewed(node, ref)
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


def _fused_row(node, call):
    """call: the ffi_call equation that node is or wraps (_partition.inner_call)."""
    target = call.params["target_name"]
    cls, per_element = _FUSED.get(target, (ELEMENTWISE, 0))
    scratch = {i % len(node.outs) for i in _WORKSPACES.get(target, ())}
    results = [r for i, r in enumerate(node.outs) if i not in scratch]
    if target == "jaxsub_gemm":  # d [M, N] from a contraction over K
        a, trans_a = node.ins[0].shape, dict(call.params.get("attributes", ())).get("trans_a", False)
        flops = 2 * _size(results[0]) * (a[0] if trans_a else a[1])
    elif target == "jaxsub_dense_gelu_fwd":  # y, h [M, N] from x [M, K]: the product and the GELU
        flops = (2 * node.ins[0].shape[1] + _FUSED["jaxsub_bias_gelu_dropout_fwd"][1]) * _size(results[0])
    elif per_element is None:  # attention: q [B, Sq, H, D], k [B, Sk, H, D]; packed: out [B, S, H, D]
        bwd = "_bwd" in target
        if "_qkv_" in target:
            b, sq, h, d = (node.ins[0] if bwd else results[0]).shape
            sk = sq
        else:
            q, k = node.ins[int(bwd)], node.ins[1 + int(bwd)]
            (b, sq, h, d), sk = q.shape, k.shape[1]
        flops = (10 if bwd else 4) * b * h * sq * sk * d
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
        if n not in live or not n.outs:  # no outputs: an effect (debug.print of a sum) feeds nothing
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
    call = _partition.inner_call(node.eqn)
    if call is not None:
        op, cls, outs, flops, moved = _fused_row(node, call)
    else:
        op, cls, outs, flops, moved = node.prim, _kind(node), node.outs, 0, 0
        if cls != STRUCTURAL:
            cls = NORMALIZATION if node in norm else cls
            if cls == CONTRACTION:
                flops = _contraction_flops(node)
            elif node.prim not in _LAYOUT:
                flops = _size(node.ins[0]) if node.prim in _REDUCTIONS else sum(_size(r) for r in outs)
            if node.prim in _WINDOWS:  # reads (writes, in place) the window only
                window = node.ins[1] if node.prim == "dynamic_update_slice" else outs[0]
                moved = 2 * _nbytes(window.aval)
            else:
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
        p, prim, line = node.params, node.prim, G.source_line(node)
        line = site if line == "<unknown>" and site else line
        names = str(node.eqn.source_info.name_stack)  # flax module path, jax.named_scope
        here = f"{line} [{names}]" if names else line

        def needed(body):
            return [b for b, r in zip(body.outvars, node.outs) if r in refs]

        if prim == G.SCAN:
            rows += _walk(node.body, node.body.outvars, count * p["length"],
                          f"{inner}scan×{p['length']}", notes, line)
        elif prim in G.REMAT or prim in _CALLS or node.call_name is not None:
            body = node.body or G.build(*G._body(p))
            rows += _walk(body, needed(body), count, inner + "remat" if prim in G.REMAT else scope,
                          notes, line)
        elif prim == "cond":
            found = []
            for i, closed in enumerate(p["branches"]):
                body = G.build(closed.jaxpr, closed.consts)
                found.append(_walk(body, needed(body), count, f"{inner}cond[{i}]", notes, line))
            best = max(range(len(found)), key=lambda i: sum(r.bytes for r in found[i]))
            notes.append(f"cond at {here}: counted branch {best}, the largest of {len(found)} by bytes")
            rows += found[best]
        elif prim == "while":
            notes.append(f"while at {here}: body counted once (trip count unknown at trace time)")
            for key in ("cond_jaxpr", "body_jaxpr"):
                body = G.build(p[key].jaxpr, p[key].consts)
                rows += _walk(body, body.outvars, count, f"{inner}while.{key[:-6]}", notes, line)
        else:
            if any(isinstance(x, (jcore.Jaxpr, jcore.ClosedJaxpr))
                   for v in p.values() for x in (v if isinstance(v, tuple) else (v,))):
                notes.append(f"{prim} at {here}: body not descended, counted as one operator")
            row = _row(g, node, norm, count, scope)
            row.source = here
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------
# The result.


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
        out = {}
        for cls in CLASSES:
            rows = [r for r in self.ops if r.cls == cls]
            moved = sum(r.bytes for r in rows)
            out[cls] = {"ops": len(rows), "flops": sum(r.flops for r in rows), "bytes": moved,
                        "bytes_pct": 100.0 * moved / (self.bytes or 1)}
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
        cells = [("op", "class", "shape", "×", "flops", "bytes")] + [
            (f"{r.scope} > {r.op}" if r.scope else r.op, r.cls, r.shape, str(r.count), f"{r.flops:,}",
             f"{r.bytes:,}") for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(6)]
        sources = ["source"] + [os.path.basename(f) + sep + at for f, sep, at in
                                (r.source.partition(":") for r in rows)]
        lines = ["  ".join([*(c.ljust(w) for c, w in zip(row[:3], widths)),
                            *(c.rjust(w) for c, w in zip(row[3:], widths[3:])), src])
                 for row, src in zip(cells, sources)]
        if len(rows) < len(self.ops):
            lines.append(f"({len(self.ops) - len(rows)} zero-cost structural equations not shown)")
        return "\n".join(lines)

    def class_table(self) -> str:
        """Flops and bytes per operator class, and the total."""
        rows = [(c, t["ops"], t["flops"], t["bytes"], t["bytes_pct"]) for c, t in self.by_class().items()]
        rows.append(("total", len(self.ops), self.flops, self.bytes, 100.0))
        return "\n".join([f"{'class':<27}{'ops':>5}{'flops':>18}{'bytes':>18}{'bytes %':>9}"] + [
            f"{c:<27}{n:>5}{f:>18,}{b:>18,}{pct:>8.1f}%" for c, n, f, b, pct in rows])

    def __str__(self):
        parts = ["jaxsub.analyze", self.table(), "", self.class_table()]
        parts += [f"note: {n}" for n in self.notes]
        if self.timing is not None:
            t = self.timing
            parts.append(f"device time {t['time_s'] * 1e3:.3f} ms; its bytes take {t['floor_s'] * 1e3:.3f} ms "
                         f"at {t['bandwidth_Bps'] / 1e9:.0f} GB/s: memory efficiency "
                         f"{100 * t['memory_efficiency']:.1f}% (not split by class)")
        if self.optimized is not None:
            opt = self.optimized
            parts += ["", "after jaxsub.optimize:", opt.class_table(),
                      "fused kernels: " + (", ".join(sorted(opt.targets)) or "none")]
            parts += [f"note: {n}" for n in opt.notes]
            pct = self.bytes_reduction_pct
            parts.append(f"data movement: {self.bytes:,} -> {opt.bytes:,} bytes"
                         + ("" if pct is None else f", {pct:.2f}% fewer"))
        return "\n".join(parts)


# ---------------------------------------------------------------------------------------
# analyze.


def _flat(fn, args, kwargs):
    """fn as a function of its array leaves (other leaves static, as optimize treats them)."""
    arrays, (in_tree, static, *_) = interpreter._split(args, kwargs)

    def flat(*xs):
        it = iter(xs)
        a, k = jax.tree_util.tree_unflatten(in_tree, [next(it) if s is None else s for s in static])
        return fn(*a, **k)

    return flat, arrays


def _median_s(fn, args, repeats: int = 20) -> float:
    """Median wall time of fn(*args) run to completion, after a warm-up call."""
    return _timing.median_time(fn, args, repeats, warmup=1)


@functools.cache
def _copy_bandwidth() -> float:
    """Bytes read + written per second negating 256 MiB (far beyond L2), on this device."""
    buf = jax.numpy.zeros((64 << 20,), jax.numpy.float32)
    return 2 * buf.nbytes / _median_s(jax.jit(lambda x: -x), (buf,))


def _measure(fn, args, kwargs, moved: int):
    """Device time of jit(fn) and its memory efficiency, on a GPU; None elsewhere."""
    if jax.default_backend() != "gpu":
        warnings.warn("jaxsub.analyze(time=True) measures on a GPU only; no GPU backend here, "
                      "so the analysis is returned without timing", stacklevel=3)
        return None
    flat, arrays = _flat(fn, args, kwargs)
    seconds, bandwidth = _median_s(jax.jit(flat), arrays), _copy_bandwidth()
    return {"time_s": seconds, "bandwidth_Bps": bandwidth, "floor_s": moved / bandwidth,
            "memory_efficiency": moved / bandwidth / seconds}


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
    if not callable(fn):
        raise TypeError(f"jaxsub.analyze: `fn` must be callable, got {type(fn).__name__}")
    for name, flag in (("compare_optimized", compare_optimized), ("grad", grad), ("time", time)):
        _ffi.check_bool("analyze", name, flag)
    base = fn.fn if isinstance(fn, interpreter.Optimized) else fn
    opt = fn if isinstance(fn, interpreter.Optimized) else interpreter.optimize(fn)
    if grad:
        base, opt = (jax.value_and_grad(f, argnums) for f in (base, opt))
    result = _analyze_one(base, args, kwargs, time)
    if compare_optimized:
        result.optimized = _analyze_one(opt, args, kwargs, time)
    return result
