"""`jaxsub.explain`: what the pass would rewrite in a function, and what it left alone."""

from __future__ import annotations

import dataclasses
from collections import Counter

from jaxsub import _ffi
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import interpreter
from jaxsub.rewrite import match_dropout
from jaxsub.rewrite import patterns as P
from jaxsub.rewrite.match_gelu import BGD
from jaxsub.rewrite.match_norm import BDRLN, LN
from jaxsub.rewrite.match_softmax import SOFTMAX


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


# Ops a dropout's value or mask passes through between a matched op and the select or
# multiply that drops (the value scaled by 1 / p, retyped, broadcast).
_THROUGH = frozenset({"broadcast_in_dim", "convert_element_type", "copy", "div", "mul", "reshape", "not",
                      *G.VARYING_CASTS})


# The patterns whose fused op takes the dropout of its output.
_DROPOUT_AFTER = frozenset({BGD, SOFTMAX})


def _dropouts_left(g: G.Graph, plan: P.Plan):
    """(the match, the draw, "after" or "before", why) for each dropout that stays the
    user's where a matcher, finding no dropout it could take, fused an op alone and said
    nothing: jax.vmap over per-example keys (one key per example: `batched_key`) or a mask
    drawn for fewer elements and broadcast (a mask an inner jax.vmap shares,
    `broadcast_dims`).
    - after: a dropout of a GELU's or softmax's output; under a vmap over keys of a value it
      does not batch (`in_axes=None`), the op's output is broadcast to the keys' batch
      before the select, so the matcher finds no dropout at the op's output;
    - before: a dropout in the residual sum a layer norm normalizes (BDRLN's), the layer
      norm fused alone, where the value or the residual is not batched (the vmap broadcasts
      it, so the matcher finds no residual sum of x's shape, or no dropout at all)."""
    users = {}
    for node in g.nodes:
        for ref in node.ins:
            users.setdefault(ref, []).append(node)
    outputs = {ref: match for anchor, match in plan.at.items() if match.pattern in _DROPOUT_AFTER
               for ref in anchor.outs}
    normalized = {match.inputs["x"]: match for match in plan.at.values() if match.pattern == LN}
    named = {miss.key for miss in plan.near_misses}  # a matcher's reason for a draw: ("drop", id)
    found = []
    for draw in g.nodes:
        if draw.call_name not in ("_bernoulli", "_uniform") or not draw.ins or ("drop", id(draw)) in named:
            continue
        batched = match_dropout.batched_key(draw)
        todo, seen, hit = list(draw.outs), set(), None
        while todo and hit is None and len(seen) < 64:  # the mask, forward to its select or product
            ref = todo.pop()
            for user in users.get(ref, ()):
                if id(user) in seen:
                    continue
                seen.add(id(user))
                broadcast = draw.outs[0].shape != user.outs[0].shape
                if user.prim in ("select_n", "mul") and (batched or broadcast):
                    why = batched or match_dropout.broadcast_mask(draw, user.outs[0])
                    for value in (r for r in user.ins if r is not ref):
                        match = _matched_source(g, value, outputs, broadcast=broadcast)
                        if match is not None:
                            hit = (match, draw, "after", why)
                    match = _normalized_sum(users, user.outs[0], normalized)
                    if hit is None and match is not None:
                        hit = (match, draw, "before", why)
                if user.prim in _THROUGH or user.prim in ("lt", "le", "gt", "ge"):
                    todo.extend(user.outs)
        if hit is not None:
            found.append(hit)
    return found


def _normalized_sum(users, ref, normalized, depth: int = 0):
    """The layer-norm match whose x `ref` reaches through _THROUGH ops and adds (a residual
    sum), else None."""
    if ref in normalized:
        return normalized[ref]
    if depth > 8:
        return None
    for user in users.get(ref, ()):
        if user.prim in _THROUGH or user.prim in ("add", "add_any"):
            match = _normalized_sum(users, user.outs[0], normalized, depth + 1)
            if match is not None:
                return match
    return None


def _matched_source(g: G.Graph, ref, outputs, broadcast: bool = False, depth: int = 0):
    """The match whose output `ref` is, through _THROUGH ops with a broadcast among them (or
    none, where `broadcast` says the mask's was one)."""
    if broadcast and ref in outputs:
        return outputs[ref]
    node = g.producer.get(ref)
    if node is None or node.prim not in _THROUGH or depth > 8:
        return None
    for inner in node.ins:
        match = _matched_source(g, inner, outputs, broadcast or node.prim == "broadcast_in_dim", depth + 1)
        if match is not None:
            return match
    return None


def _collect(g: G.Graph, plan: P.Plan, scope: str, report: Report):
    for node in g.nodes:
        match = plan.at.get(node)
        if match is not None:
            report.matches.append(Entry(match.pattern, match.description, G.source_line(node), scope))
    for miss in plan.near_misses:
        report.near_misses.append(Entry(miss.pattern, miss.reason, G.source_line(miss.anchor), scope))
    for match, draw, where, why in _dropouts_left(g, plan):
        pattern = BDRLN if where == "before" else match.pattern
        report.near_misses.append(Entry(pattern, f"the dropout {where} it: " + why, G.source_line(draw), scope))
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
