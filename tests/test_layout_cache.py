"""The layout cache (round trip, keys, corrupt files, concurrent writers), the timed
"auto" path on CPU at a tiny size, and what optimize(layouts=...) applies (the attention
algorithm, the row ops' kernel configurations)."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import layout
from jaxsub.layout import cache, select, tuning
from jaxsub.layout.problem import Selection
from jaxsub.testing import ffi_attributes

SPEC = dict(batch=1, seq=4, hidden=8, heads=2, mlp_dim=8, dtype="float32")


pytestmark = pytest.mark.usefixtures("fresh_layout")


def _problem(**kw):
    return layout.EncoderProblem(layout.LayerSpec(**{**SPEC, **kw}), platform="cpu")


def _fake_measure(workload, *, repeats, seed):
    """Deterministic 'timing' without running anything: a count of the arrays."""
    diff, _ = workload.make(seed)
    return 1e-6 * (1 + sum(x.size for x in jax.tree.leaves(diff)) % 7)


def _fake_layers(problem, paths, **kw):
    """Whole-layer 'timing' (tuning.measure_layers) without running anything: the
    prediction (test_layout_verify.py times real ones)."""
    return [predicted for _, predicted in paths]


def test_cache_dir_respects_xdg(tmp_path, monkeypatch):
    assert cache.cache_dir() == tmp_path / "xdg" / "jaxsub" / "layouts"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cache.cache_dir() == cache.pathlib.Path(os.path.expanduser("~")) / ".cache" / "jaxsub" / "layouts"
    assert cache.cache_dir(tmp_path / "x") == tmp_path / "x"


def test_key_changes_with_shape_dtype_and_device():
    device = cache.device_key()
    base = cache.make_key(_problem().key(), device)
    assert base["device"]["jax"] == jax.__version__ and base["device"]["device_kind"]
    paths = {cache.entry_path(base)}
    for other in (cache.make_key(_problem(batch=2).key(), device),
                  cache.make_key(_problem(dtype="bfloat16").key(), device),
                  cache.make_key(_problem(mask_shape=(1, 4), mask_dtype="bool").key(), device),
                  cache.make_key(_problem().key(), {**device, "device_kind": "NVIDIA H200"}),
                  cache.make_key(_problem().key(), {**device, "jax": "0.0.1"})):
        assert other != base
        paths.add(cache.entry_path(other))
    assert len(paths) == 6
    assert cache.entry_path(base) == cache.entry_path(json.loads(json.dumps(base)))


def test_round_trip_and_incremental_tuning(tmp_path):
    problem = _problem()
    tables = tuning.tune(problem, measure_fn=_fake_measure, progress=False)
    assert tables.complete and tables.missing(problem) == 0
    sel = tuning.solve(problem, tables, "timed")
    key = cache.make_key(problem.key())
    path = cache.store(key, tables.to_json(problem), sel.to_json())
    assert path.parent == tmp_path / "xdg" / "jaxsub" / "layouts" and path.name.startswith("encoder_layer-")
    entry = cache.load(key)
    text = path.read_text()
    assert '"stage": "attention"' in text and "\n" in text        # human-readable
    back = tuning.Tables.from_json(problem, entry["tables"])
    assert back.stages == tables.stages and back.transposes == tables.transposes
    assert tuning.solve(problem, back, "cache").choices == sel.choices
    assert Selection.from_json(entry["selection"]) == sel
    # A later jaxsub with a new candidate times only that one.
    data = entry["tables"]
    data["stages"][1]["candidates"].pop()
    partial = tuning.Tables.from_json(problem, data)
    assert partial.missing(problem) == 1
    timed = []
    tuning.tune(problem, known=partial, progress=False,
              measure_fn=lambda w, repeats, seed: timed.append(w) or 1e-6)
    assert len(timed) == 1


def test_budget_times_defaults_first_and_marks_incomplete():
    problem = _problem()
    tables = tuning.tune(problem, budget_s=0.0, measure_fn=_fake_measure, progress=False)
    # A zero budget still times every default (a complete default path), nothing else.
    assert not tables.complete and not tables.transposes
    assert [list(t) for t in tables.stages] == [[st.candidates[0].key] for st in problem.stages]
    sel = tuning.solve(problem, tables, "timed")
    assert [c.candidate for c in sel.choices] == problem.default()
    assert tables.missing(problem) == sum(len(st.candidates) - 1 for st in problem.stages) + len(
        tuning.needed_transposes(problem))


def test_a_failing_transpose_is_impossible_not_a_crash():
    problem = _problem()

    def measure_fn(workload, repeats, seed):
        if len(workload.make(seed)[0]) == 1:            # transposes differentiate one array
            raise RuntimeError("no")
        return _fake_measure(workload, repeats=repeats, seed=seed)

    tables = tuning.tune(problem, measure_fn=measure_fn, progress=False)
    assert tables.transposes and all(v is None for v in tables.transposes.values())
    sel = tuning.solve(problem, tables, "timed")
    assert all(c.transpose_s == 0.0 for c in sel.choices)      # no layout change chosen


def test_corrupt_and_foreign_files_are_ignored_with_a_warning(monkeypatch):
    problem = _problem()
    key = cache.make_key(problem.key())
    path = cache.entry_path(key)
    path.parent.mkdir(parents=True)
    for text in ("{not json", json.dumps({"format": 1, "key": {"other": 1}, "tables": {"stages": []}}),
                 json.dumps({"format": 1, "key": key, "tables": {"stages": [{"candidates": [{"in": "x"}]}]}})):
        path.write_text(text)
        with pytest.warns(RuntimeWarning, match="corrupt cache file"):
            assert cache.load(key) is None
    # Well-formed JSON with bad values (found by probing: errors from the solver and the
    # tables' reader where the file was taken as valid).
    good = tuning.model_tables(problem).to_json(problem)
    tamperings = [lambda t: t["stages"][0]["candidates"][0].update(seconds="abc"),
                  lambda t: t["stages"][0]["candidates"][0].update(seconds=float("nan")),
                  lambda t: t["stages"][0]["candidates"][0].update(seconds=-1.0),
                  lambda t: t["stages"][0].pop("name"),
                  lambda t: t.update(layers="zzz"),
                  lambda t: t.update(transposes=[{"from": "a"}]),
                  # probe round six: a string tuning time, a nested path, every candidate failed
                  lambda t: t.update(tuning_s="abc"),
                  lambda t: t.update(layers=[{"path": [[[1]]], "seconds": 1.0}]),
                  lambda t: [r.update(seconds=float("inf")) for r in t["stages"][0]["candidates"]]]
    for tamper in tamperings:
        tables = json.loads(json.dumps(good))
        tamper(tables)
        path.write_text(json.dumps({"format": cache.FORMAT, "key": key, "tables": tables}))
        with pytest.warns(RuntimeWarning, match="corrupt cache file"):
            assert cache.load(key) is None
    # Bytes that are no UTF-8 text (probe round 10: a UnicodeDecodeError from the layer).
    path.write_bytes(b"\xff\xfe{")
    with pytest.warns(RuntimeWarning, match="cannot read cache file"):
        assert cache.load(key) is None
    # The timed path treats it as a miss, re-times and replaces the file.
    monkeypatch.setattr(tuning, "measure", _fake_measure)
    monkeypatch.setattr(tuning, "measure_layers", _fake_layers)
    with pytest.warns(RuntimeWarning):
        sel = layout.resolve(layout.Auto(measure_without_gpu=True, repeats=1, progress=False), problem)
    assert sel.source == "timed"
    assert cache.load(key)["selection"]["source"] == "timed"


def test_an_unwritable_cache_warns_and_keeps_the_selection(tmp_path, monkeypatch):
    """A cache location that cannot be written (found by probing: the OSError came after
    the timing, which was lost): a warning, and the timed selection all the same."""
    problem = _problem()
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache directory would have to be inside a file
    monkeypatch.setattr(tuning, "measure", _fake_measure)
    monkeypatch.setattr(tuning, "measure_layers", _fake_layers)
    with pytest.warns(RuntimeWarning) as caught:  # cannot read it either
        sel = layout.resolve(layout.Auto(measure_without_gpu=True, repeats=1, progress=False,
                                         cache_dir=str(blocker / "sub")), problem)
    assert any("cannot write the layout cache" in str(w.message) for w in caught)
    assert sel.source == "timed"


def _writer(directory, i):
    problem = layout.EncoderProblem(layout.LayerSpec(**SPEC), platform="cpu")
    tables = tuning.model_tables(problem).to_json(problem)
    # Each writer knows a different subset of one stage; merging keeps all of them.
    tables["stages"][1]["candidates"] = [tables["stages"][1]["candidates"][i]]
    for _ in range(20):
        cache.store({"problem": "concurrency", "n": 1}, tables, None, directory)
    return i


def test_concurrent_writers_leave_a_valid_merged_file(tmp_path):
    # Threads: each store opens its own lock file description, so flock excludes them as
    # it excludes processes.
    with ThreadPoolExecutor(4) as pool:
        assert sorted(pool.map(_writer, [str(tmp_path)] * 4, range(4))) == [0, 1, 2, 3]
    entry = cache.load({"problem": "concurrency", "n": 1}, tmp_path)
    assert len(entry["tables"]["stages"][1]["candidates"]) == 4
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_auto_tunes_the_layer_inside_jit_then_reads_the_cache(tmp_path, monkeypatch):
    """The timed path started while the caller is traced (real timing is exercised by the
    attention test below; a fake measurement keeps this one short)."""
    calls = []
    monkeypatch.setattr(tuning, "measure", lambda w, repeats, seed: calls.append(w) or _fake_measure(
        w, repeats=repeats, seed=seed))
    monkeypatch.setattr(tuning, "measure_layers", _fake_layers)
    opts = layout.Auto(measure_without_gpu=True, repeats=1, cache_dir=str(tmp_path), progress=False)
    layer = jaxsub.flax.EncoderLayer(num_heads=2, mlp_dim=8, layouts=opts)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 8)), jnp.float32)
    params = layer.init(jax.random.key(0), x)
    y = jax.jit(lambda p, x: layer.apply(p, x))(params, x)
    problem = layout.EncoderProblem(layer._spec(x, None))
    expected = sum(len(st.candidates) for st in problem.stages) + len(tuning.needed_transposes(problem))
    assert np.isfinite(np.asarray(y)).all() and len(calls) == expected
    files = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    assert len(files) == 1
    entry = json.loads((tmp_path / files[0]).read_text())
    assert all(r["seconds"] is None or r["seconds"] > 0 for s in entry["tables"]["stages"] for r in s["candidates"])
    layout.clear_memo()
    assert layer.selection(x).source == "cache" and len(calls) == expected


def _attn(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _targets(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return {t: text.count(f"@{t}(") for t in ("jaxsub_attention_fwd", "jaxsub_softmax_dropout_fwd")}


def test_the_heuristic_takes_the_unfused_structure_for_a_query_varying_additive_mask():
    """The byte model charges the fused kernels the measured ratio under an additive mask
    that varies over the queries (a relative-position bias), as the default does; a
    key-padding-shaped additive mask stays fused."""
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 8, 2, 8)), jnp.float32) for i in range(3))
    runs = jaxsub.ops.attn.fused_unsupported(jax.default_backend(), q.dtype, q.shape[-1]) is None
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((1, 2, 8, 8)), jnp.float32)
    pad = jnp.asarray(np.random.default_rng(6).standard_normal((2, 1, 1, 8)), jnp.float32)

    def f(q, k, v, m):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]) + m
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    unfused = {"jaxsub_attention_fwd": 0, "jaxsub_softmax_dropout_fwd": 1}
    fused = {"jaxsub_attention_fwd": 1, "jaxsub_softmax_dropout_fwd": 0} if runs else unfused
    assert _targets(jaxsub.optimize(f, layouts="heuristic"), q, k, v, bias) == unfused
    assert _targets(jaxsub.optimize(f, layouts="heuristic"), q, k, v, pad) == fused


def test_optimize_layouts_choose_the_attention_algorithm(tmp_path):
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 8, 2, 8)), jnp.float32) for i in range(3))
    unfused = {"jaxsub_attention_fwd": 0, "jaxsub_softmax_dropout_fwd": 1}
    # Where the fused kernel cannot run (a GPU build without it, or f32 on a GPU) asking
    # for it runs the unfused path.
    runs = jaxsub.ops.attn.fused_unsupported(jax.default_backend(), q.dtype, q.shape[-1]) is None
    fused = {"jaxsub_attention_fwd": 1, "jaxsub_softmax_dropout_fwd": 0} if runs else unfused
    assert _targets(jaxsub.optimize(_attn, layouts="none"), q, k, v) == unfused
    # The byte model prefers the fused kernel wherever it runs (the CPU handler does).
    assert _targets(jaxsub.optimize(_attn, layouts="heuristic"), q, k, v) == fused
    if not layout.gpu_present():
        assert _targets(jaxsub.optimize(_attn), q, k, v) == fused      # "auto" = heuristic
    # A Selection applies its attention stage's config to every attention call.
    problem = _problem()
    default = problem.default()
    sel = Selection.of(problem, [c if i != 1 else problem.stages[1].candidates[1] for i, c in enumerate(default)])
    assert sel.config("attention") == {"impl": "fused"}
    assert _targets(jaxsub.optimize(_attn, layouts=sel), q, k, v) == fused
    assert _targets(jaxsub.optimize(_attn, layouts=Selection.of(problem, default)), q, k, v) == unfused
    # Timed per signature, stored as an "attention" problem.
    opts = layout.Auto(measure_without_gpu=True, repeats=1, cache_dir=str(tmp_path), progress=False)
    out = jax.jit(jaxsub.optimize(_attn, layouts=opts))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_attn(q, k, v)), rtol=1e-4, atol=1e-5)
    assert [p for p in os.listdir(tmp_path) if p.startswith("attention-") and p.endswith(".json")]
    # Outside optimize, ops.attention keeps its default.
    assert _targets(lambda q, k, v: jaxsub.ops.attention(q, k, v), q, k, v) == unfused


def _ln(x, s, b):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b


def _block(x, b, r, s, lb, w):
    """BDRLN without dropout, then bias + GELU: two row ops for the rewrite."""
    return jax.nn.gelu(_ln(r + (x + b), s, lb) @ w + b)


def _launches(f, target, *args):
    """[(block_threads, max_elems)] of the forward, then the backward call of `target`."""
    text = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a)))).lower(*args).as_text()
    return [(int(a["block_threads"]), int(a["max_elems"])) for d in ("_fwd", "_bwd")
            for a in ffi_attributes(text, target + d)]


def _choose(pre_layer_norm, **chosen):
    """A Selection of the default path with kernel configurations for some row stages."""
    problem = layout.EncoderProblem(layout.LayerSpec(**SPEC, pre_layer_norm=pre_layer_norm), platform="cpu",
                                    kernel_configs=True)
    return Selection.of(problem, [next(c for c in st.candidates if c.config == chosen[st.name])
                                  if st.name in chosen else st.candidates[0] for st in problem.stages])


def test_optimize_applies_a_selections_kernel_configurations():
    n = SPEC["hidden"]
    x, b, r, s, lb = (jnp.asarray(np.random.default_rng(i).standard_normal(shape), jnp.float32)
                      for i, shape in enumerate([(6, n), (n,), (6, n), (n,), (n,)]))
    w = jnp.eye(n)
    sel = _choose(False, bdrln2="bwd_threads=1024,fwd_threads=128", bias_gelu_dropout="bwd_threads=256,fwd_threads=512")
    # BDRLN takes bdrln2's configuration (bdrln1 kept the default); GELU its own.
    ops_configs = select.selection_op_configs(sel)
    assert ops_configs["bias_dropout_residual_layer_norm"] == {"kernel_config": {"fwd_threads": 128, "bwd_threads": 1024}}
    assert ops_configs["attention"] == {"impl": "unfused"}
    fast = jaxsub.optimize(_block, layouts=sel)
    assert _launches(fast, "jaxsub_bdrln", x, b, r, s, lb, w) == [(128, 0), (1024, 0)]
    assert _launches(fast, "jaxsub_bias_gelu_dropout", x, b, r, s, lb, w) == [(512, 0), (256, 0)]
    plain = jaxsub.optimize(_block, layouts="none")
    assert _launches(plain, "jaxsub_bdrln", x, b, r, s, lb, w) == [(0, 0), (0, 0)]
    np.testing.assert_array_equal(jax.jit(fast)(x, b, r, s, lb, w), jax.jit(plain)(x, b, r, s, lb, w))
    # Both BDRLN stages configured: the first one's configuration applies.
    both = _choose(False, bdrln1="bwd_threads=256,fwd_threads=512", bdrln2="bwd_threads=1024,fwd_threads=128")
    assert select.selection_op_configs(both)["bias_dropout_residual_layer_norm"] == {
        "kernel_config": {"fwd_threads": 512, "bwd_threads": 256}}
    # Pre-LN: bdrln1's configuration is the layer norm's.
    pre = _choose(True, bdrln1="bwd_threads=256,fwd_threads=128")
    assert _launches(jaxsub.optimize(_ln, layouts=pre), "jaxsub_layer_norm", x, s, lb) == [(128, 0), (256, 0)]


def test_tuning_order_defaults_layouts_transposes_then_kernel_configurations():
    # The row ops' launch shapes come last: under a budget, the layouts and the transposes
    # that make them usable are timed first.
    problem = layout.EncoderProblem(_problem().spec, platform="cpu", kernel_configs=True)
    whats = []
    tuning.tune(problem, measure_fn=lambda w, repeats, seed: 1e-6,
                progress=lambda done, total, what: whats.append(what))
    kinds = ["transpose" if w.startswith("transpose") else "config" if "threads=" in w else "stage" for w in whats]
    assert "config" not in kinds[:len(problem.stages)]
    first_transpose, first_config = kinds.index("transpose"), kinds.index("config")
    assert "stage" not in kinds[first_transpose:] and "transpose" not in kinds[first_config:]
    assert kinds.count("config") == sum("threads=" in c.config for st in problem.stages for c in st.candidates)


def test_compile_workers_time_every_candidate_like_the_sequential_tuner(monkeypatch):
    # Worker threads prepare and compile the next candidates (n2 from the byte model, here
    # fixed short: the model's GPU times would ask a CPU for long loops); every candidate
    # and transpose still gets a positive time, in the same order.
    monkeypatch.setattr(tuning, "n2_for", lambda seconds, **kw: 6)
    # Compiling and timing never overlap: a batch of 2 x workers compiles, then is timed.
    compiling, events = [0], []
    real_prepare, real_measure = tuning.prepare, tuning.measure

    def prepare(*a, **k):
        compiling[0] += 1
        try:
            return real_prepare(*a, **k)
        finally:
            compiling[0] -= 1
            events.append("compiled")

    def measure(*a, **k):
        assert compiling[0] == 0
        events.append("timed")
        return real_measure(*a, **k)

    monkeypatch.setattr(tuning, "prepare", prepare)
    monkeypatch.setattr(tuning, "measure", measure)
    problem = _problem()
    seen = []
    tables = tuning.tune(problem, repeats=1, progress=lambda d, t, what: seen.append(what), compile_workers=2)
    assert events[:8] == ["compiled"] * 4 + ["timed"] * 4
    assert tables.complete and tables.missing(problem) == 0 and not tables.errors
    assert all(v is not None and v > 0 for t in tables.stages for v in t.values())
    assert all(v > 0 for v in tables.transposes.values())
    monkeypatch.setattr(tuning, "measure", real_measure)
    order = []
    tuning.tune(problem, progress=lambda d, t, what: order.append(what), measure_fn=lambda w, repeats, seed: 1e-6)
    assert seen == order
    # Past the budget only the defaults are timed, with workers as without.
    short = tuning.tune(problem, repeats=1, budget_s=0.0, progress=False, compile_workers=2)
    assert not short.complete and [list(t) for t in short.stages] == [[st.candidates[0].key] for st in problem.stages]
    sel = tuning.solve(problem, tables, "timed")
    assert [c.candidate.key for c in sel.choices]


def test_prepare_fixes_n2_and_measure_uses_it():
    problem = _problem()
    wl = problem.stage_workload(0, problem.stages[0].candidates[0])
    prepared = tuning.prepare(wl, n2=12, compile_now=True)
    assert prepared.n2 == 12 and len(prepared.calls) == 2
    assert tuning.measure(None, repeats=1, prepared=prepared) > 0
    assert tuning.n2_for(1e-6) == 1000 and tuning.n2_for(1.0) == 10 and tuning.n2_for(1e-3) == 12


def test_compiler_batches_finish_before_returning_and_keep_errors():
    import threading
    import time as _time

    running, peak = [0], [0]
    lock = threading.Lock()

    def thunk(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        _time.sleep(0.02)
        with lock:
            running[0] -= 1
        if i == 3:
            raise ValueError("no")
        return i, threading.current_thread().name

    with tuning.Compiler(2) as compiler:
        got = compiler.batch([lambda i=i: thunk(i) for i in range(5)])
        assert running[0] == 0                      # nothing still compiling once it returns
    assert [g[0] for g in got if not isinstance(g, Exception)] == [0, 1, 2, 4]
    assert isinstance(got[3], ValueError)
    assert all(g[1].startswith("jaxsub-tune") for g in got if not isinstance(g, Exception))
    assert peak[0] == 2
