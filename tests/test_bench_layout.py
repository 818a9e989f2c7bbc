"""bench/layout.py: the --small run end to end on CPU, and the reduced space it searches."""

from __future__ import annotations

import json
import math

import pytest

from jaxsub import layout
from jaxsub.layout import tuning

# `bench` is not part of the installed package (see test_bench.py).
from bench import layout as bench_layout


def test_reduced_space_is_every_consistent_path():
    spec = layout.LayerSpec(**bench_layout.FULL.cases["b8s512"])
    # The fused kernel is a candidate only where it runs; kernel configurations are left out.
    for platform, impls, configs in (("cpu", 2, False), ("tpu", 1, False), ("cpu", 2, True)):
        problem = layout.EncoderProblem(spec, platform=platform, kernel_configs=configs)
        paths = bench_layout.reduced_paths(problem, bench_layout.FULL.reduced)
        # 3 q/k/v layouts x impls x 2 context layouts x 2 FFN layouts.
        assert len(paths) == 3 * impls * 2 * 2
        assert len({tuple(c.key for c in p) for p in paths}) == len(paths)
        for p in paths:
            assert [c.in_layout for c in p[1:]] == [c.out_layout for c in p[:-1]]
            assert p[0].in_layout == "x:BSE" and p[-1].out_layout == "y:BSE"
    assert problem.default() in paths


def test_small_run_reports_default_selected_and_exhaustive_best(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    layout.clear_memo()
    out = tmp_path / "layout.json"
    assert bench_layout.main(["--small", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not (tmp_path / "xdg").exists()          # the benchmark bypasses the cache
    [case] = result["cases"]
    assert case["case"] == "tiny" and case["check"] == "ok" and case["tuning_s"] > 0
    spec = layout.LayerSpec(**bench_layout.SMALL.cases["tiny"])
    n = len(bench_layout.reduced_paths(layout.EncoderProblem(spec), bench_layout.SMALL.reduced))
    assert len(case["exhaustive"]) == n == 4
    assert all(c["seconds"] > 0 for c in case["exhaustive"])
    rows = {r["row"]: r for r in case["rows"]}
    assert set(rows) == {"default", "shortest-path", "selected", "exhaustive-best"}
    # Every finalist of the tuned tables (how many depends on what the tuning budget left
    # time for) was timed whole; the selection is the fastest of them.
    problem = layout.EncoderProblem(spec)
    finalists = tuning.finalists(problem, tuning.Tables.from_json(problem, case["tables"]))
    layers = case["tables"]["layers"]
    assert {tuple(map(tuple, r["path"])) for r in layers} == {p for p, _ in finalists}
    assert layers and all(r["seconds"] > 0 for r in layers)
    assert case["selection"]["layer_s"] == min(r["seconds"] for r in layers)
    assert case["selected_vs_exhaustive_best"] == pytest.approx(rows["selected"]["us"] / rows["exhaustive-best"]["us"])
    for r in rows.values():
        assert r["us"] > 0 and math.isfinite(r["us"])
        assert r["vs_default"] == pytest.approx(rows["default"]["us"] / r["us"])
    # The default path is always fully timed, so its prediction exists.
    assert rows["default"]["predicted_us"] > 0
    assert [c["stage"] for c in case["selection"]["choices"]] == list(layout.STAGE_NAMES)


def test_resume_reuses_tables_and_exhaustive_timings(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    layout.clear_memo()
    first = tmp_path / "first.json"
    assert bench_layout.main(["--small", "--json", str(first), "--finalists", "2"]) == 0
    done = json.loads(first.read_text())
    [case] = done["cases"]
    # What a run cut short after two exhaustive configurations leaves on disk.
    cut = {**done, "partial": True, "cases": [{**case, "partial": True, "exhaustive": case["exhaustive"][:2]}]}
    for key in ("rows", "check", "exhaustive_s"):
        cut["cases"][0].pop(key)
    (tmp_path / "cut.json").write_text(json.dumps(cut))

    def no_tuning(*a, **k):
        raise AssertionError("tuned again")

    monkeypatch.setattr(bench_layout.layout.select, "timed_tables", no_tuning)
    second = tmp_path / "second.json"
    assert bench_layout.main(["--small", "--json", str(second), "--finalists", "2",
                              "--resume", str(tmp_path / "cut.json")]) == 0
    [again] = json.loads(second.read_text())["cases"]
    assert again["resumed"] and again["check"] == "ok" and "partial" not in again
    assert again["tuning_s"] == case["tuning_s"] and again["tables"] == case["tables"]
    assert again["selection"] == case["selection"]
    assert again["exhaustive"][:2] == case["exhaustive"][:2]           # reused as measured
    assert len(again["exhaustive"]) == 4 and all(c["seconds"] > 0 for c in again["exhaustive"])
    assert {r["row"] for r in again["rows"]} == {"default", "shortest-path", "selected", "exhaustive-best"}


def test_partial_json_is_written_as_the_run_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    layout.clear_memo()
    out = tmp_path / "layout.json"
    seen = []
    measure = bench_layout.tuning.measure_layers

    def spy(*a, **k):
        if out.exists():
            seen.append(json.loads(out.read_text()))
        return measure(*a, **k)

    monkeypatch.setattr(bench_layout.tuning, "measure_layers", spy)
    monkeypatch.setattr(bench_layout, "EXHAUSTIVE_CHUNK", 1)
    assert bench_layout.main(["--small", "--json", str(out), "--finalists", "0"]) == 0
    partials = [s for s in seen if s.get("partial")]
    assert partials and all(s["cases"][0]["partial"] and s["cases"][0]["tables"] for s in partials)
    counts = [len(s["cases"][0]["exhaustive"]) for s in partials]
    assert counts == [0, 1, 2, 3, 4]       # a checkpoint after each chunk, then the rows
    assert "partial" not in json.loads(out.read_text())
