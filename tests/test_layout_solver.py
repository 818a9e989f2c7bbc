"""jaxsub.layout.shortest_configuration against brute force on random layered graphs."""

import itertools
import math

import numpy as np
import pytest

from jaxsub.layout import NoConfigurationError, path_cost, shortest_configuration


def _brute_force(stages, transpose_cost):
    """Every combination of one entry per stage, in the order of the stages' entries;
    strictly smaller totals replace the best, so among ties the lexicographically first
    sequence of entry positions wins (the solver's documented rule)."""
    best = None
    for combo in itertools.product(*[list(s.items()) for s in stages]):
        total, prev, ok = 0.0, None, True
        for (key, seconds) in combo:
            if seconds is None or seconds == math.inf:
                ok = False
                break
            if prev is not None and prev != key[0]:
                t = transpose_cost(prev, key[0])
                if t is None or t == math.inf:
                    ok = False
                    break
                total += t
            total += seconds
            prev = key[1]
        if ok and (best is None or total < best[1]):
            best = ([k for k, _ in combo], total)
    return best


def _random_problem(rng, depth, width, integer, p_missing=0.0, p_no_transpose=0.0):
    """Layered graph: stage i's layouts drawn from a pool of `width` labels per boundary;
    integer costs (many exact ties) or real ones."""
    def cost():
        return float(rng.integers(0, 4)) if integer else float(rng.random())

    pools = [[f"L{b}_{j}" for j in range(width)] for b in range(depth + 1)]
    stages = []
    for i in range(depth):
        table = {}
        for _ in range(rng.integers(1, 2 * width + 2)):
            a, b = rng.choice(pools[i]), rng.choice(pools[i + 1])
            config = f"c{rng.integers(0, 2)}"
            table[(str(a), str(b), config)] = None if rng.random() < p_missing else cost()
        stages.append(table)
    # Transposes only between layouts of the same boundary (the labels carry it), fixed
    # per pair.
    costs = {}
    for b, pool in enumerate(pools):
        for x in pool:
            for y in pool:
                if x != y:
                    costs[(x, y)] = None if rng.random() < p_no_transpose else cost()

    def transpose_cost(a, b):
        return costs.get((a, b))

    return stages, transpose_cost


@pytest.mark.parametrize("integer", [True, False], ids=["ties", "real"])
@pytest.mark.parametrize("depth,width", [(1, 1), (1, 3), (2, 2), (3, 3), (5, 2), (6, 3), (8, 2)])
def test_matches_brute_force(depth, width, integer):
    rng = np.random.default_rng(depth * 100 + width * 10 + integer)
    checked = 0
    for trial in range(40):
        stages, tc = _random_problem(rng, depth, width, integer, p_missing=0.1, p_no_transpose=0.3)
        want = _brute_force(stages, tc)
        if want is None:
            with pytest.raises(NoConfigurationError):
                shortest_configuration(stages, tc)
            continue
        got = shortest_configuration(stages, tc)
        assert got.cost == pytest.approx(want[1])
        assert path_cost(stages, tc, got.path) == pytest.approx(got.cost)
        if integer:
            # Exact arithmetic: the tie rule picks the same path as brute force.
            assert got.path == want[0], trial
        checked += 1
    assert checked >= 10


def test_ties_prefer_earliest_listed_entries():
    stages = [
        {("x", "a", ""): 1.0, ("x", "b", ""): 1.0},
        {("b", "y", "fast"): 1.0, ("a", "y", "default"): 1.0, ("a", "y", "other"): 1.0},
    ]
    path, cost = shortest_configuration(stages, lambda a, b: None)
    assert path == [("x", "a", ""), ("a", "y", "default")] and cost == 2.0
    # Reordering the first stage flips the choice.
    stages[0] = dict(reversed(list(stages[0].items())))
    assert shortest_configuration(stages, lambda a, b: None).path == [("x", "b", ""), ("b", "y", "fast")]


def test_transposes_are_used_when_cheaper_and_equal_layouts_are_free():
    calls = []

    def tc(a, b):
        calls.append((a, b))
        return 0.5

    stages = [{("x", "a", ""): 1.0, ("x", "b", ""): 3.0}, {("b", "y", ""): 1.0, ("a", "y", ""): 5.0}]
    path, cost = shortest_configuration(stages, tc)
    assert path == [("x", "a", ""), ("b", "y", "")] and cost == 2.5
    assert all(a != b for a, b in calls) and len(calls) == len(set(calls))   # once per distinct pair


def test_first_input_and_last_output_are_free():
    stages = [{("p", "m", ""): 1.0, ("q", "m", ""): 2.0}, {("m", "r", ""): 1.0, ("m", "s", ""): 0.5}]
    assert shortest_configuration(stages, lambda a, b: None) == ([("p", "m", ""), ("m", "s", "")], 1.5)


def test_unreachable_layouts_name_the_stage():
    stages = [{("x", "a", ""): 1.0}, {("b", "y", ""): 1.0}, {("y", "z", ""): 1.0}]
    with pytest.raises(NoConfigurationError, match=r"stage 1 \('attention'\).*'b'"):
        shortest_configuration(stages, lambda a, b: math.inf, names=["qkv", "attention", "out"])
    # Only failed (None) entries: no candidate.
    with pytest.raises(NoConfigurationError, match="stage 0 has no candidate"):
        shortest_configuration([{("x", "a", ""): None}], lambda a, b: 0.0)
    # A dead end: stage 1 reachable only through an entry whose output feeds nothing.
    stages = [{("x", "a", ""): 1.0}, {("a", "b", ""): 1.0}, {("c", "z", ""): 1.0}]
    with pytest.raises(NoConfigurationError, match="stage 2"):
        shortest_configuration(stages, lambda a, b: None)


def test_bad_costs_and_trivial_inputs():
    assert shortest_configuration([], lambda a, b: 0.0) == ([], 0.0)
    with pytest.raises(ValueError, match="nan"):
        shortest_configuration([{("x", "y", ""): math.nan}], lambda a, b: 0.0)
    with pytest.raises(ValueError, match="not \\(in_layout, out_layout, config\\)"):
        shortest_configuration([{("x", "y"): 1.0}], lambda a, b: 0.0)


def test_linear_in_edges():
    """A long, wide chain: transpose_cost is called once per (out, in) pair of
    consecutive stages, never more (no path enumeration)."""
    depth, width = 200, 6
    rng = np.random.default_rng(0)
    stages = [{(f"{i}:{a}", f"{i + 1}:{b}", ""): float(rng.random()) for a in range(width) for b in range(width)}
              for i in range(depth)]
    calls = [0]

    def tc(a, b):
        calls[0] += 1
        return 0.1

    path, _ = shortest_configuration(stages, tc)
    assert len(path) == depth
    assert calls[0] <= (depth - 1) * width * width
