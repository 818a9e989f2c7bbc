"""bench/layout.py: the --small run end to end on CPU, and the reduced space it searches."""

from __future__ import annotations

import json
import math

import pytest

from jaxsub import layout

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
    assert set(rows) == {"default", "selected", "exhaustive-best"}
    for r in rows.values():
        assert r["us"] > 0 and math.isfinite(r["us"])
        assert r["vs_default"] == pytest.approx(rows["default"]["us"] / r["us"])
    # The default path is always fully timed, so its prediction exists.
    assert rows["default"]["predicted_us"] > 0
    assert [c["stage"] for c in case["selection"]["choices"]] == list(layout.STAGE_NAMES)
