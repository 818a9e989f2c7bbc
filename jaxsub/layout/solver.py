"""The configuration selector's solver: a shortest path through a layered DAG.

The paper (Ivanov et al., §6) picks, for every operator of the layer, one candidate (input
layout, output layout, configuration) so that the layer's total time, operators plus the
layout changes between them, is smallest. Nodes of the DAG are (operator boundary, layout
handed on); a candidate of operator i is an edge from (i, its input layout) to (i + 1, its
output layout) weighted by its measured time; between operators, an edge from an output
layout of operator i to an input layout of operator i + 1 is weighted by the transpose
cost (zero where the layouts are equal). The first input layout and the last output
layout are free: any is a source, any is a sink.

The solver is pure (no JAX): stages are plain mappings {(in_layout, out_layout, config):
seconds}; layouts and configs are any hashable values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NamedTuple


class NoConfigurationError(ValueError):
    """No choice of one entry per stage is connected: some stage's input layouts are all
    unreachable from the previous stage's output layouts."""


class ShortestPath(NamedTuple):
    """`path[i]` is the key (in_layout, out_layout, config) chosen in stage i; `cost` the
    total: chosen entries plus the transposes between consecutive stages, summed left to
    right."""

    path: list
    cost: float


def _finite_or_none(value, what: str):
    """A cost as float; None and +inf mean 'no edge'; NaN and -inf are errors."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value) or value == -math.inf:
        raise ValueError(f"shortest_configuration: {what} is {value}")
    return None if value == math.inf else value


def _stage_name(names, i) -> str:
    return f"stage {i}" + (f" ({names[i]!r})" if names is not None else "")


def shortest_configuration(stages: Sequence[Mapping[tuple, float]],
                           transpose_cost: Callable[[Hashable, Hashable], float | None],
                           *, names: Sequence[str] | None = None) -> ShortestPath:
    """The cheapest choice of one entry per stage.

    Args:
      stages: per operator, {(in_layout, out_layout, config): seconds}. An entry of
        None or +inf seconds is not a candidate (e.g. it failed to run).
      transpose_cost: `transpose_cost(out_layout_of_stage_i, in_layout_of_stage_i+1)`,
        seconds to change layout between consecutive stages; called only for unequal
        layouts (equal layouts cost 0). None or +inf: the change is impossible.
      names: optional stage names for error messages.

    Returns:
      ShortestPath(path, cost): path[i] is the chosen key of stage i; cost is the sum of
      the chosen entries and the transposes between them. No stages: ([], 0.0).

    Ties: costs are compared exactly. Among paths of equal cost, the one whose sequence of
    entry positions (the order of each stage's mapping) is lexicographically smallest
    wins: the earliest-listed entry of stage 0 that starts an optimal path, then the
    earliest-listed entry of stage 1 that continues it, and so on. Listing a default
    candidate first therefore makes it win every tie.

    Work: each stage entry and each (out layout of i, in layout of i + 1) pair is looked at
    a constant number of times, and transpose_cost is called once per distinct pair: time
    linear in the DAG's edges.

    Raises:
      NoConfigurationError: a stage has no candidate, or none of its input layouts can be
        reached from the previous stage's output layouts.
      ValueError: a cost is NaN or -inf.
    """
    if names is not None and len(names) != len(stages):
        raise ValueError(f"shortest_configuration: {len(names)} names for {len(stages)} stages")
    n = len(stages)
    if n == 0:
        return ShortestPath([], 0.0)

    # entries[i]: [(position, key, in, out, seconds)] of the usable entries of stage i.
    entries = []
    for i, stage in enumerate(stages):
        usable = []
        for pos, (key, seconds) in enumerate(stage.items()):
            if not (isinstance(key, tuple) and len(key) == 3):
                raise ValueError(f"shortest_configuration: {_stage_name(names, i)} key {key!r} is not "
                                 "(in_layout, out_layout, config)")
            seconds = _finite_or_none(seconds, f"{_stage_name(names, i)} entry {key!r}")
            if seconds is not None:
                usable.append((pos, key, key[0], key[1], seconds))
        if not usable:
            raise NoConfigurationError(f"shortest_configuration: {_stage_name(names, i)} has no candidate "
                                       "with a finite cost")
        entries.append(usable)

    memo: dict = {}

    def between(a, b):
        if a == b:
            return 0.0
        if (a, b) not in memo:
            memo[(a, b)] = _finite_or_none(transpose_cost(a, b), f"transpose_cost({a!r}, {b!r})")
        return memo[(a, b)]

    def ordered(values):
        return list(dict.fromkeys(values))

    ins = [ordered(e[2] for e in es) for es in entries]
    outs = [ordered(e[3] for e in es) for es in entries]

    # Forward reachability only to name the stage where the graph breaks.
    reach = set(outs[0])
    for i in range(1, n):
        reach_in = {b for b in ins[i] if any(between(a, b) is not None for a in reach)}
        if not reach_in:
            raise NoConfigurationError(
                f"shortest_configuration: {_stage_name(names, i)}: none of its input layouts {ins[i]!r} can be "
                f"reached from the output layouts {sorted(reach, key=repr)!r} the previous stage can hand on "
                "(transpose_cost gives no edge)")
        reach = {e[3] for e in entries[i] if e[2] in reach_in}

    # Backward pass: to_go_in[i][layout] = cheapest completion entering stage i in `layout`;
    # to_go_out[i][layout] = cheapest completion leaving stage i in `layout`.
    inf = math.inf
    to_go_out: list[dict] = [dict() for _ in range(n)]
    to_go_in: list[dict] = [dict() for _ in range(n)]
    for i in range(n - 1, -1, -1):
        for o in outs[i]:
            if i == n - 1:
                to_go_out[i][o] = 0.0
                continue
            best = inf
            for b in ins[i + 1]:
                t = between(o, b)
                if t is not None:
                    best = min(best, t + to_go_in[i + 1][b])
            to_go_out[i][o] = best
        for e in entries[i]:
            val = e[4] + to_go_out[i][e[3]]
            if val < to_go_in[i].get(e[2], inf):
                to_go_in[i][e[2]] = val
            else:
                to_go_in[i].setdefault(e[2], inf)

    # Forward pass: the earliest-listed entry that stays on an optimal path.
    path, cost, prev_out = [], 0.0, None
    for i in range(n):
        best, pick = inf, None
        for e in entries[i]:
            step = 0.0 if prev_out is None else between(prev_out, e[2])
            if step is None:
                continue
            val = step + e[4] + to_go_out[i][e[3]]
            if val < best:
                best, pick = val, (e, step)
        if pick is None:  # pragma: no cover - reachability above rules this out
            raise NoConfigurationError(f"shortest_configuration: {_stage_name(names, i)} is unreachable")
        e, step = pick
        cost += step + e[4]
        path.append(e[1])
        prev_out = e[3]
    if cost == inf:
        raise NoConfigurationError("shortest_configuration: no connected choice of one entry per stage")
    return ShortestPath(path, cost)


def path_cost(stages: Sequence[Mapping[tuple, float]], transpose_cost, path: Sequence[tuple]) -> float | None:
    """The total cost of a given path (None if it uses a missing entry or an impossible
    transpose), summed left to right as shortest_configuration reports it."""
    if len(path) != len(stages):
        raise ValueError(f"path_cost: {len(path)} keys for {len(stages)} stages")
    total, prev = 0.0, None
    for stage, key in zip(stages, path):
        seconds = _finite_or_none(stage.get(key), f"entry {key!r}")
        if seconds is None:
            return None
        if prev is not None and prev != key[0]:
            t = _finite_or_none(transpose_cost(prev, key[0]), f"transpose_cost({prev!r}, {key[0]!r})")
            if t is None:
                return None
            total += t
        total += seconds
        prev = key[1]
    return total
