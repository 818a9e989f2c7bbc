"""`jaxsub.explain`: what the pass would rewrite in a function, and what it left alone."""

from __future__ import annotations

import dataclasses
from collections import Counter

from jaxsub import _ffi
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import interpreter
from jaxsub.rewrite import patterns as P


@dataclasses.dataclass(frozen=True)
class Entry:
    pattern: str
    detail: str      # shapes and parameters for a match, the reason for a near-miss
    source: str      # file:line (function) of the user code at the pattern's end
    scope: str       # "" at top level, else e.g. "scan" for a scan body


@dataclasses.dataclass
class Report:
    matches: list
    near_misses: list
    unsearched: list     # Entry(pattern=primitive, detail=why, ...)

    @property
    def totals(self) -> Counter:
        return Counter(m.pattern for m in self.matches)

    def __str__(self):
        lines = [f"jaxsub.explain: {len(self.matches)} match(es), "
                 f"{len(self.near_misses)} near-miss(es)"]
        sections = (("Matches", self.matches), ("Near-misses (left alone)", self.near_misses),
                    ("Not searched", self.unsearched))
        for title, entries in sections:
            if not entries:
                continue
            lines.append(f"{title}:")
            for e in entries:
                scope = f" [in {e.scope}]" if e.scope else ""
                lines.append(f"  {e.pattern}: {e.detail}{scope}  at {e.source}")
        if self.matches:
            lines.append("Totals: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.totals.items())))
        if not self.matches and sum("also used elsewhere" in e.detail for e in self.near_misses) >= 2:
            lines.append(_SHARED_HINT)
        return "\n".join(lines)


# A function that differentiates inside (jax.grad, value_and_grad) hands the backward pass
# the forward's intermediates: every pattern then has an intermediate "also used elsewhere".
_SHARED_HINT = ("Hint: if fn computes gradients itself (jax.grad, jax.value_and_grad), the backward pass reads "
                "the forward's intermediates; optimize the function being differentiated instead, e.g. "
                "jax.value_and_grad(jaxsub.optimize(loss)).")


_UNSEARCHED_WHY = {
    "while": "loop body not searched",
    "cond": "branches not searched",
    "shard_map": "body not searched: optimize the function shard_map runs (shard_map(jaxsub.optimize(f)))",
    "xla_pmap": "body not searched: optimize the function pmap runs (jax.pmap(jaxsub.optimize(f)))",
    "custom_vmap_call": "opaque call with its own batching rule, run as is",
}


def _collect(g: G.Graph, plan: P.Plan, scope: str, report: Report):
    for node in g.nodes:
        match = plan.at.get(node)
        if match is not None:
            report.matches.append(Entry(match.pattern, match.description, G.source_line(node), scope))
    for miss in plan.near_misses:
        report.near_misses.append(Entry(miss.pattern, miss.reason, G.source_line(miss.anchor), scope))
    for node in plan.unsearched:
        why = _UNSEARCHED_WHY.get(node.prim, "opaque call with its own differentiation rule, run as is")
        report.unsearched.append(Entry(node.prim, why, G.source_line(node), scope))
    for node, sub in plan.sub.items():
        inner = node.prim if not scope else f"{scope} > {node.prim}"
        _collect(node.body, sub, inner, report)


def explain(fn, *args, rewrite_dropout=True, **kwargs) -> Report:
    """What `jaxsub.optimize(fn)` rewrites for these arguments; `print` it to read it.

    fn may itself be an optimized function, whose options are then used."""
    if isinstance(fn, interpreter.Optimized):
        options, fn = fn.options, fn.fn
    elif not callable(fn):
        raise TypeError(f"jaxsub.explain: `fn` must be callable, got {type(fn).__name__}")
    else:
        options = P.Options(rewrite_dropout=_ffi.check_bool("explain", "rewrite_dropout", rewrite_dropout))
    traced, _ = interpreter.trace(fn, options, args, kwargs)
    report = Report([], [], [])
    _collect(traced.graph, traced.plan, "", report)
    return report
