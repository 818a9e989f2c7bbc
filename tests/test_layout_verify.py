"""tuning.verify: the best few paths by the stage tables (and the default) re-timed as
whole layers, the fastest chosen; its times in the tables and the cache."""

import json

import jax
import pytest

from jaxsub import layout
from jaxsub.layout import cache, select, solver, tuning
from jaxsub.layout.problem import Selection

SPEC = dict(batch=1, seq=4, hidden=8, heads=2, mlp_dim=8, dtype="float32")


pytestmark = pytest.mark.usefixtures("fresh_layout")


def _problem():
    return layout.EncoderProblem(layout.LayerSpec(**SPEC), platform="cpu")


def _tables(problem):
    """Deterministic stage tables: the byte model's numbers."""
    return tuning.model_tables(problem)


def _default_key(problem):
    return tuple(c.key for c in problem.default())


def test_finalists_represent_every_option_of_every_stage():
    problem = _problem()
    tables = _tables(problem)
    ordered = tuning._ordered(problem, tables)
    cost = tuning.transpose_cost(tables)
    found = tuning.finalists(problem, tables)
    paths = [p for p, _ in found]
    assert len(set(paths)) == len(paths) > 5
    for p, predicted in found:
        assert solver.path_cost(ordered, cost, p) == pytest.approx(predicted)
    # The shortest path first, then by prediction; the default (last unless it is among them).
    assert paths[0] == tuple(c.candidate.key for c in tuning.solve(problem, tables, "t").choices)
    default = _default_key(problem)
    assert default in paths
    ranked = [c for p, c in found if p != default or found[-1][0] != default]
    assert ranked == sorted(ranked)
    # Every layout/algorithm option of every stage: its best completion is a finalist (the
    # best over its kernel configurations, each forced in turn).
    for i, table in enumerate(ordered):
        for group in {tuning._structure(k) for k in table}:
            best = min(solver.shortest_configuration(ordered[:i] + [{k: v}] + ordered[i + 1:], cost).cost
                       for k, v in table.items() if tuning._structure(k) == group)
            using = [c for p, c in found if tuning._structure(p[i]) == group]
            assert using and min(using) == pytest.approx(best), (i, group)
    # A limit keeps the best predictions, the default still added.
    limited = tuning.finalists(problem, tables, 2)
    assert [p for p, _ in limited[:2]] == paths[:2] and limited[-1][0] == default


def test_verify_takes_the_fastest_whole_layer_and_keeps_the_times():
    problem = _problem()
    tables = _tables(problem)
    found = tuning.finalists(problem, tables)
    n = len(found)
    # Round one (chunks of 3): reversed order, the last finalists fastest. Round two (the
    # three fastest again, together): the second of them wins.
    first = {p: 1e-3 * (n - i) for i, (p, _) in enumerate(found)}
    top3 = [p for p, _ in found[::-1][:3]]
    second = {top3[0]: 3e-3, top3[1]: 1e-3, top3[2]: 2e-3}
    calls = []

    def measure_fn(problem_, paths, **kw):
        calls.append([p for p, _ in paths])
        table = second if len(calls) > -(-n // 3) else first
        return [table[p] for p, _ in paths]

    sel, timed = tuning.verify(problem, tables, "timed", chunk=3, measure_fn=measure_fn)
    assert [len(c) for c in calls[:-1]] == [len(found[i:i + 3]) for i in range(0, n, 3)]
    assert calls[-1] == top3                                        # the final round, fastest first
    winner = top3[1]
    predicted = dict(found)[winner]
    assert tuple(c.candidate.key for c in sel.choices) == winner
    assert sel.layer_s == 1e-3 and sel.cost_s == pytest.approx(predicted) and sel.source == "timed"
    assert timed.layers == {**first, **second} and tables.layers == {}    # the input tables are left alone
    assert [c.seconds for c in sel.choices] == [tables.stages[i][c.candidate.key] for i, c in enumerate(sel.choices)]
    # Known times are not measured again.
    again, _ = tuning.verify(problem, timed, "cache", chunk=3, measure_fn=measure_fn)
    assert len(calls) == -(-n // 3) + 1 and again.choices == sel.choices
    # A failed finalist (None) is never chosen; with every one failed, the shortest path.
    fails = {p: None if i % 2 else 1e-3 * (i + 1) for i, (p, _) in enumerate(found)}
    pick, _ = tuning.verify(problem, tables, "timed", measure_fn=lambda p, paths, **kw: [fails[q] for q, _ in paths])
    assert tuple(c.candidate.key for c in pick.choices) == found[0][0]
    none, _ = tuning.verify(problem, tables, "timed", measure_fn=lambda p, paths, **kw: [None] * len(paths))
    assert none == tuning.solve(problem, tables, "timed")


def test_layers_round_trip_and_merge_newest_set_wins(tmp_path):
    problem = _problem()
    tables = _tables(problem)
    path = _default_key(problem)
    tables.layers = {path: 2e-3}
    back = tuning.Tables.from_json(problem, json.loads(json.dumps(tables.to_json(problem))))
    assert back.layers == {path: 2e-3}
    key = {"problem": "layers"}
    cache.store(key, tables.to_json(problem), None, tmp_path)
    # A later store without whole-layer times keeps the old ones; one with times replaces them.
    tables.layers = {}
    cache.store(key, tables.to_json(problem), None, tmp_path)
    assert tuning.Tables.from_json(problem, cache.load(key, tmp_path)["tables"]).layers == {path: 2e-3}
    other = tuning.finalists(problem, back)[1][0]
    tables.layers = {other: 1e-3}
    cache.store(key, tables.to_json(problem), None, tmp_path)
    assert tuning.Tables.from_json(problem, cache.load(key, tmp_path)["tables"]).layers == {other: 1e-3}


def test_measure_layers_times_real_layers_and_marks_failures(monkeypatch):
    problem = _problem()
    found = tuning.finalists(problem, _tables(problem), 2)
    assert len(found) == 3
    broken = found[1][0]
    real = problem.layer_workload

    def layer_workload(sel):
        if tuple(c.candidate.key for c in sel.choices) == broken:
            raise RuntimeError("does not compile")
        return real(sel)

    monkeypatch.setattr(problem, "layer_workload", layer_workload)
    times = tuning.measure_layers(problem, found, repeats=2)
    assert times[0] > 0 and times[1] is None and all(t > 0 for t in times[2:])

    # Running them fails (e.g. out of device memory): nothing timed, no exception.
    def oom(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(tuning._timing, "median_times", oom)
    assert tuning.measure_layers(problem, found, repeats=2) == [None] * len(found)


def test_timed_choice_verifies_stores_and_reads_back(tmp_path, monkeypatch):
    problem = _problem()
    monkeypatch.setattr(tuning, "measure", lambda w, repeats, seed: 1e-6 * (1 + len(jax.tree.leaves(w.make(seed)))))
    measured = []

    def measure_layers(problem_, paths, **kw):
        measured.append(len(paths))
        return [1e-3 * (1 + (p == _default_key(problem))) for p, _ in paths]    # the default is slower

    monkeypatch.setattr(tuning, "measure_layers", measure_layers)
    opts = layout.Auto(measure_without_gpu=True, repeats=1, cache_dir=str(tmp_path), progress=False, finalists=3)
    sel, tables, source, path = select.timed_choice(problem, opts)
    assert source == "timed" and measured == [len(tables.layers)] and len(tables.layers) in (3, 4)
    assert _default_key(problem) in tables.layers
    assert sel.layer_s == 1e-3
    entry = cache.load(cache.make_key(problem.key()), tmp_path)
    assert Selection.from_json(entry["selection"]) == sel and len(entry["tables"]["layers"]) == len(tables.layers)
    # From the cache: nothing timed, the same selection.
    layout.clear_memo()
    again = layout.resolve(opts, problem)
    assert again.source == "cache" and again.choices == sel.choices and measured == [len(tables.layers)]
    # finalists=0: the shortest path as it is, no whole-layer timing.
    plain, *_ = select.timed_choice(problem, layout.Auto(measure_without_gpu=True, repeats=1, cache_dir=str(tmp_path),
                                                         progress=False, finalists=0))
    assert plain.layer_s is None and plain == tuning.solve(problem, tables, "cache")


def test_only_problems_with_a_whole_workload_are_verified(tmp_path, monkeypatch):
    class NoWhole(layout.EncoderProblem):
        def layer_workload(self, selection):
            return None

    problem = NoWhole(layout.LayerSpec(**SPEC), platform="cpu")
    assert select.verifiable(_problem()) and not select.verifiable(problem)
    monkeypatch.setattr(tuning, "measure", lambda w, repeats, seed: 1e-6)
    monkeypatch.setattr(tuning, "measure_layers", lambda *a, **k: pytest.fail("timed whole"))
    sel, tables, _, _ = select.timed_choice(problem, layout.Auto(measure_without_gpu=True, repeats=1,
                                                                 cache_dir=str(tmp_path), progress=False))
    assert sel.layer_s is None and not tables.layers and sel == tuning.solve(problem, tables, "timed")


def test_compile_workers_default_by_backend(monkeypatch):
    assert select.workers(layout.Auto(compile_workers=3)) == 3
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(select.os, "cpu_count", lambda: 16)
    assert select.workers(layout.Auto()) == 8
    monkeypatch.setattr(select.os, "cpu_count", lambda: 2)
    assert select.workers(layout.Auto()) == 1
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert select.workers(layout.Auto()) == 0


def test_measure_layers_runs_eagerly_inside_a_trace():
    # layouts="auto" tunes on the first call of an optimized function, often under jit.
    problem = _problem()
    found = tuning.finalists(problem, _tables(problem), 1)
    seen = []

    @jax.jit
    def step(x):
        seen.append(tuning.measure_layers(problem, found, repeats=1))
        return x * 2

    assert float(step(1.0)) == 2.0
    assert len(seen) == 1 and all(isinstance(t, float) and t > 0 for t in seen[0])
