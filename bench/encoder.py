"""BERT-large encoder layer, forward + backward: jaxsub against plain XLA, Flax and cuDNN.

Run: `python -m bench` or `python -m bench.encoder` (GPU; a few minutes, mostly
compilation), `--configs`/`--rows` for a subset, `--small` (reduced sizes: a CPU smoke
run; its timings say nothing about GPU speed). Writes bench/results/encoder.json
(`--json PATH`) and, when matplotlib is installed, a PNG chart next to it (`--plot`).

What is timed: one training step, `jax.value_and_grad` of loss = sum(y * dy) (dy a fixed
random cotangent) with respect to the parameters and the input x, under jax.jit, with
dropout 0.1 (attention probabilities and both hidden dropouts; `bench/layers.py` has the
layer, the shared parameter tree and every row). Rows, all on the same parameters:
  a xla       plain XLA: the hand-written jnp layer, `jax.random.bernoulli` dropout. The
              baseline of "vs XLA".
  b flax      the Flax linen layer (jaxsub.flax.ReferenceEncoderLayer:
              nn.MultiHeadDotProductAttention, nn.Dense, nn.LayerNorm, nn.Dropout).
  c cudnn     the jnp layer with `jax.nn.dot_product_attention(implementation="cudnn")`,
              which has no dropout: no attention-prob dropout, dropout elsewhere. Where it
              cannot run (always on CPU) the error is recorded and the run goes on.
  d opt-jnp   `jaxsub.optimize(jnp layer)`; e opt-flax `jaxsub.optimize(Flax layer)`;
              "fused" lists what the pass matched (jaxsub.explain).
  f jaxsub    jaxsub.flax.EncoderLayer (the stack: jaxsub.flax.Encoder(scan_layers=True)).
  g flax-bcast  row b with Flax's default attention dropout (broadcast_dropout=True: one
              [S, S] keep mask for every batch element and head, fewer random bits than
              rows a-f draw); h opt-flax-bcast `jaxsub.optimize` of g's layer (compare h
              with g). Single layers only, as b and e.
Configs: hidden 1024, 16 heads, ffn 4096, post-LN; batch 8 x seq 512 and 96 x 128, bf16
and fp16; and the 24-layer stack at 8 x 512 bf16 (rows a, c, d as jnp `lax.scan` over
stacked parameters, f as the scanned Encoder).

Timing: each row's step is lowered and compiled once (`jax.jit(step).lower(...).compile()`,
which also gives XLA's cost analysis) and run once. Then each row is timed on its own, in
one block (`_time_rows`): warm-up samples, then `repeats` samples of n1 and of n2
back-to-back calls (`Size.steps`; the stacks' `Size.stack_steps`), each sample ended by
`block_until_ready`, n1 and n2 alternating; the median of each. The rows are visited in
two passes, in the table's order and then reversed, and a row's time is the mean of its
two passes (both are in the JSON as `ms_passes`). Blocks, not rows interleaved sample by
sample: interleaved, a row's time depended on the row before it. In one process at b96 x
s128 the same compiled `optimize(jnp)` step measured 1.87 ms right after plain XLA and
1.98-1.99 ms after another jaxsub row, against 1.97-1.99 ms on its own (bench/NOTES.md,
sixteenth session); that is how `EncoderLayer`, timed after `optimize(Flax)`, read 3-9%
slower than `optimize(jnp)` in every run from the tenth session to the fifteenth.
The step time is the slope (t(n2) - t(n1)) / (n2 - n1), the same method as the op
benchmarks: what a sample pays once, the host's dispatch of the first call before the
device has anything to run and the wait at the end, cancels. Host enqueue time per step
(0.2-0.6 ms) is shorter than the device time, so after the first call the queue stays
full and the slope is the device time of a training-loop step. A sample divided by its
step count, which keeps the once-per-sample cost, is in the JSON as `ms_burst` (n2
steps): in the run that introduced the slope (15 steps) it read 0 to 0.16 ms per step more
than the slope, by row (bench/NOTES.md, fifteenth session).

Columns: ms per step; vs XLA = t(a) / t(row), same config, same run; TFLOP/s = matmul flops
of the step / time, counted analytically (`Config.matmul_flops`: 3 x the forward's matmul
flops, 335 GFLOP for the layer at 8 x 512; the cuDNN row is credited the same); % floor =
(flops / matmul rate) / time, the matmul rate measured in this run with a chain of 8192^3
bf16 matmuls on a GPU (slope method), else the H200's 707 TFLOP/s from TARGETS.md (the
header says which); XLA GB = "bytes accessed" of the compiled step from XLA's
cost_analysis, which counts nothing for a custom call (a program of one jaxsub call
reports -1 bytes on CPU; the `EncoderLayer` step 0.017 GB on the H200), so for the jaxsub
rows it is the bytes of XLA's own kernels only; XLA counts a loop body once, whatever its
trip count, so for the scanned stacks it is about one layer plus what lies outside the
loop, not comparable with the single-layer rows. analyze GB = `jaxsub.analyze(step,
*args)`'s analytic bytes, each jaxpr equation (or fused op) counted by its operands and
results, so for row a the unfused program's, not what XLA's fusions move. The DRAM bytes a
step really moves: `tools/step_dram_bytes.py` (Nsight Compute).

Before timing, each config is spot-checked without dropout: output y and the gradients
(parameters, x) of every row against row a on the same parameters (Flax rows through
to_flax_params / from_flax_params), within `jaxsub.testing` tolerance for the config's
dtype. Each tensor is compared after dividing both sides by the RMS of row a's tensor:
a gradient summed over thousands of tokens can cancel to a small value while its rounding
error scales with the terms, so error relative to the tensor's scale is what is bounded;
reduction length ffn x layers (the error grows like a random walk over layers). Measured
on CPU at BERT-large width: max normalized error ~0.03 (y) to ~0.065 (gradients) in bf16,
~0.008 in fp16, ~1e-5 in f32, the same for every row, plain Flax against plain jnp
included. A failed check, or a row other than cudnn that fails to run, is printed, kept
in the JSON and makes the exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxsub
from bench import layers, report, timing
from bench.layers import BASELINE, ROWS, Config
from jaxsub import _ffi, _timing, testing

H200_MATMUL_FLOPS_PER_S = 707e12
DEFAULT_JSON = pathlib.Path(__file__).parent / "results" / "encoder.json"
_F32 = jnp.float32
_BERT = dict(hidden=1024, heads=16, ffn=4096)
_SMALL = dict(hidden=128, heads=4, ffn=512)
_SHORT = {"attention": "attn", "bias_dropout_residual_layer_norm": "bdrln", "bias_gelu_dropout": "gelu",
          "layer_norm": "ln", "softmax_dropout": "softmax", "bias_dropout_residual": "bdr"}


@dataclasses.dataclass(frozen=True)
class Size:
    configs: dict[str, Config]
    steps: tuple[int, int]        # (n1, n2) back-to-back steps per sample, single layer
    stack_steps: tuple[int, int]  # the same for the stacked configs (a step is ~25-60 ms)
    repeats: int
    warmup: int
    matmul_n: int


def _configs(*cs: Config) -> dict[str, Config]:
    return {c.name: c for c in cs}


FULL = Size(configs=_configs(
    Config("b8s512-bf16", 8, 512, dtype=jnp.bfloat16, **_BERT),
    Config("b8s512-fp16", 8, 512, dtype=jnp.float16, **_BERT),
    Config("b96s128-bf16", 96, 128, dtype=jnp.bfloat16, **_BERT),
    Config("b96s128-fp16", 96, 128, dtype=jnp.float16, **_BERT),
    Config("stack24-b8s512-bf16", 8, 512, dtype=jnp.bfloat16, layers=24, **_BERT),
    Config("preln-b8s512-bf16", 8, 512, dtype=jnp.bfloat16, pre_ln=True, **_BERT),
), steps=(10, 30), stack_steps=(2, 6), repeats=10, warmup=2, matmul_n=8192)
# The same code paths at sizes that keep a CPU run to a couple of minutes (compilation
# dominates). f32 is included because on CPU it shows what the pass fuses at full width.
SMALL = Size(configs=_configs(
    Config("small-b2s64-bf16", 2, 64, dtype=jnp.bfloat16, **_SMALL),
    Config("small-b2s64-f32", 2, 64, dtype=jnp.float32, **_SMALL),
    Config("small-stack2-b2s64-bf16", 2, 64, dtype=jnp.bfloat16, layers=2, **_SMALL),
    Config("small-preln-b2s64-bf16", 2, 64, dtype=jnp.bfloat16, pre_ln=True, **_SMALL),
), steps=(1, 3), stack_steps=(1, 3), repeats=3, warmup=1, matmul_n=512)


# ---------------------------------------------------------------------------------------
# Ceilings and byte counts.


def matmul_rate(backend: str, n: int, repeats: int) -> tuple[float, str]:
    """(flop/s, where it comes from): a chain of n^3 bf16 matmuls timed by the slope
    method on a GPU; on other backends the H200's rate from TARGETS.md."""
    if backend != "gpu":
        return H200_MATMUL_FLOPS_PER_S, "707 TFLOP/s, the H200's from TARGETS.md (not measured on this backend)"
    a = jax.random.normal(jax.random.key(0), (n, n), _F32).astype(jnp.bfloat16)
    # Scaled so the chain keeps its magnitude: each product has the variance of its input.
    b = (jax.random.normal(jax.random.key(1), (n, n), _F32) / np.sqrt(n)).astype(jnp.bfloat16)

    def build(k):
        return jax.jit(lambda c, w: jax.lax.fori_loop(0, k, lambda i, c: c @ w, c)), (a, b)

    t = timing.slope_time(build, 2, 10, repeats=repeats)
    rate = 2.0 * n ** 3 / t.per_call_s
    return rate, f"{rate / 1e12:.0f} TFLOP/s, measured in this run ({n}^3 bf16 matmul chain)"


def cost_bytes(compiled) -> float | None:
    """XLA's "bytes accessed" estimate of a compiled program (a dict, or a list of one
    dict per computation in older jax)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    value = cost.get("bytes accessed") if cost else None
    return None if value is None else float(value)


def analytic_bytes(step, args) -> tuple[float | None, object]:
    """`jaxsub.analyze(step, *args)`'s total bytes moved, and its totals or why there are
    none (an older jaxsub without `analyze`, or a failure). The total is read from the
    report's `to_dict()` under "totals" -> "bytes", or a top-level "total_bytes"/"bytes"."""
    analyze = getattr(jaxsub, "analyze", None)
    if analyze is None:
        return None, "jaxsub.analyze not available"
    try:
        d = analyze(step, *args).to_dict()
    except Exception as e:  # noqa: BLE001 - recorded with the row
        return None, f"failed: {report.reason(e)}"
    totals = d.get("totals", d) if isinstance(d, dict) else d
    return _total_bytes(d), totals


def _total_bytes(d) -> float | None:
    if not isinstance(d, dict):
        return None
    for found in (d.get("totals", {}).get("bytes") if isinstance(d.get("totals"), dict) else None,
                  d.get("total_bytes"), d.get("bytes")):
        if isinstance(found, (int, float)):
            return float(found)
    return None


# ---------------------------------------------------------------------------------------
# Inputs, steps and the spot check.


def make_inputs(cfg: Config, seed: int):
    params = layers.init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    shape = (cfg.batch, cfg.seq, cfg.hidden)
    x = jnp.asarray(rng.standard_normal(shape, np.float32), cfg.dtype)
    dy = jnp.asarray(rng.standard_normal(shape, np.float32), cfg.dtype)
    return params, x, dy, jax.random.key(seed + 2)


def make_step(forward):
    """(loss, (dparams, dx)) of loss = sum(forward(params, x, key) * dy)."""
    def loss(params, x, dy, key):
        return jnp.sum(forward(params, x, key).astype(_F32) * dy.astype(_F32))
    return jax.value_and_grad(loss, argnums=(0, 1))


def _output_and_grads(forward):
    def run(params, x, dy, key):
        y, vjp = jax.vjp(lambda p, x: forward(p, x, key), params, x)
        return (y, *vjp(dy))
    return jax.jit(run)


def _assert_close_scaled(got, want, dtype, reduction: int, *, grad: bool, what: str) -> None:
    """`testing.assert_close` of got / rms(want) against want / rms(want)."""
    want = np.asarray(jnp.asarray(want, _F32), np.float64)
    scale = float(np.sqrt(np.mean(want * want))) or 1.0
    got = np.asarray(jnp.asarray(got, _F32), np.float64)
    testing.assert_close(got / scale, want / scale, dtype, reduction, grad=grad, what=f"{what} (/ rms {scale:.3g})")


def spot_check(cfg: Config, names, inputs, progress: report.Progress) -> dict[str, str]:
    """Per row (not the baseline): 'ok', 'FAILED: ...', or 'skipped: ...' for an optional
    row that cannot run."""
    params, x, dy, key = inputs

    def run(impl):
        y, dp, dx = _output_and_grads(impl.forward(cfg, True))(impl.to_row(params), x, dy, key)
        return y, impl.from_row(dp), dx

    progress.update(f"{cfg.name}: checking {BASELINE}")
    try:
        want = run(ROWS[BASELINE])
    except Exception as e:  # noqa: BLE001 - every check fails with the baseline's reason
        return {n: f"FAILED: baseline did not run: {report.reason(e)}" for n in names if n != BASELINE}
    reduction = cfg.ffn * cfg.layers
    results = {}
    for name in names:
        if name == BASELINE:
            continue
        impl = ROWS[name]
        progress.update(f"{cfg.name}: checking {name}")
        try:
            y, dp, dx = run(impl)
            _assert_close_scaled(y, want[0], cfg.dtype, reduction, grad=False, what="y")
            _assert_close_scaled(dx, want[2], cfg.dtype, reduction, grad=True, what="dx")
            for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(dp), jax.tree.leaves(want[1])):
                _assert_close_scaled(g, w, cfg.dtype, reduction, grad=True, what=f"d{jax.tree_util.keystr(path)}")
            results[name] = "ok"
        except AssertionError as e:
            results[name] = f"FAILED: {e}"
        except Exception as e:  # noqa: BLE001 - a crash is a failed check (or a skip when optional)
            results[name] = ("skipped: " if impl.optional else "FAILED: ") + report.reason(e)
        progress.note(f"  {cfg.name} check {name}: {results[name]}")
    return results


def fused_totals(forward, args) -> str:
    """What jaxsub.optimize matched in an optimized forward, e.g. 'attn1 bdrln2 gelu1'."""
    params, x, _, key = args
    try:
        totals = jaxsub.explain(forward, params, x, key).totals
    except Exception as e:  # noqa: BLE001 - informational only
        return f"explain failed: {report.reason(e)}"
    return " ".join(f"{_SHORT.get(k, k)}{v}" for k, v in sorted(totals.items())) or "nothing"


# ---------------------------------------------------------------------------------------
# Timing.


def _repeat(compiled, steps: int):
    def run(*args):
        out = None
        for _ in range(steps):
            out = compiled(*args)
        return out
    return run


def _new_row(cfg: Config, impl: layers.Impl, check: str) -> dict:
    return {
        "config": cfg.name, "shape": cfg.describe(), "dtype": jnp.dtype(cfg.dtype).name, "batch": cfg.batch,
        "seq": cfg.seq, "layers": cfg.layers, "row": impl.name, "letter": impl.letter, "label": impl.label,
        "attention_dropout": impl.attention_dropout, "optional": impl.optional, "check": check,
        "status": "not run", "ms": None, "ms_passes": None, "ms_burst": None, "speedup_vs_xla": None,
        "flops": cfg.matmul_flops(), "tflops": None, "pct_floor": None, "pct_floor_at_707": None,
        "xla_bytes": None, "analytic_bytes": None, "analysis": None, "fused": "",
    }


def _time_rows(timed: list, n1: int, n2: int, size: Size) -> None:
    """Times each (row, compiled, args) on its own block of samples (see the module
    docstring), in two passes, the table's order then reversed; fills the rows' ms (the
    mean of the passes' slopes), ms_passes, ms_burst, steps_per_sample, slope_reliable.
    A row whose timing raises (it ran once already, so this is rare: e.g. out of memory)
    is marked failed and left out of the second pass; the other rows are still timed."""
    passes: list[dict[int, tuple[float, bool, float]]] = [{}, {}]
    failed: set[int] = set()
    for p, order in enumerate((range(len(timed)), reversed(range(len(timed))))):
        for i in order:
            row, compiled, args = timed[i]
            if i in failed:
                continue
            try:
                t1, t2 = timing.median_times([(_repeat(compiled, n1), args), (_repeat(compiled, n2), args)],
                                             repeats=size.repeats, warmup=size.warmup)
            except Exception as e:  # noqa: BLE001 - recorded in the row; the others go on
                row["status"] = f"failed while timing: {report.reason(e)}"
                failed.add(i)
                continue
            passes[p][i] = (*_timing.slope(t1, t2, n1, n2), t2 / n2)
    for i, (row, _, _) in enumerate(timed):
        if i in failed:
            continue
        got = [passes[0][i], passes[1][i]]
        row["ms"], row["status"] = statistics.fmean(g[0] for g in got) * 1e3, "ok"
        row["ms_passes"] = [g[0] * 1e3 for g in got]
        row["ms_burst"] = statistics.fmean(g[2] for g in got) * 1e3
        row["steps_per_sample"], row["slope_reliable"] = [n1, n2], all(g[1] for g in got)


def bench_config(cfg: Config, names, size: Size, rate: float, seed: int, progress: report.Progress) -> list[dict]:
    inputs = make_inputs(cfg, seed)
    params, x, dy, key = inputs
    checks = spot_check(cfg, names, inputs, progress)
    rows, timed = [], []
    for name in names:
        impl = ROWS[name]
        progress.update(f"{cfg.name}: compiling {name}")
        row = _new_row(cfg, impl, checks.get(name, "baseline"))
        forward = impl.forward(cfg, False)
        step = make_step(forward)
        args = (impl.to_row(params), x, dy, key)
        if name.startswith("opt-"):
            row["fused"] = fused_totals(forward, args)
        try:
            compiled = jax.jit(step).lower(*args).compile()
            row["xla_bytes"] = cost_bytes(compiled)
            jax.block_until_ready(compiled(*args))
            timed.append((row, compiled, args))
        except Exception as e:  # noqa: BLE001 - recorded in the row; the run goes on
            row["status"] = f"failed: {report.reason(e)}"
            progress.note(f"  {cfg.name} {name}: {row['status']}")
        row["analytic_bytes"], row["analysis"] = analytic_bytes(step, args)
        rows.append(row)
    progress.update(f"{cfg.name}: measuring {len(timed)} rows")
    n1, n2 = size.stack_steps if cfg.stack else size.steps
    _time_rows(timed, n1, n2, size)
    base = next((r["ms"] for r in rows if r["row"] == BASELINE), None)
    for r in rows:
        r["speedup_vs_xla"] = report.ratio(base, r["ms"])
        if r["ms"] is not None:
            r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
            r["pct_floor"] = 100.0 * r["flops"] / rate / (r["ms"] * 1e-3)
            r["pct_floor_at_707"] = 100.0 * r["flops"] / H200_MATMUL_FLOPS_PER_S / (r["ms"] * 1e-3)
        progress.note(f"  {cfg.name} {r['letter']} {r['row']:8s} {report.fmt(r['ms'], '.3f'):>9s} ms"
                      f"  vs XLA {report.fmt(r['speedup_vs_xla'], '.2f')}"
                      + (f"  fused: {r['fused']}" if r["fused"] else ""))
    return rows


def format_table(rows: list[dict]) -> str:
    header = ("row", "config", "check", "ms", "vs XLA", "TFLOP/s", "% floor", "XLA GB", "analyze GB", "fused")
    f = report.fmt

    def gb(v):
        return f(None if v is None else v / 1e9, ".3f")

    lines = [[f"{r['letter']} {r['row']}", r["config"], r["check"].split(":")[0], f(r["ms"], ".3f"),
              f(r["speedup_vs_xla"], ".2f"), f(r["tflops"], ".3g"), f(r["pct_floor"], ".3g"),
              gb(r["xla_bytes"]), gb(r["analytic_bytes"]), r["fused"]] for r in rows]
    return report.format_table(header, lines, text_columns=3, trailing_text_columns=1)


def plot(rows: list[dict], path: pathlib.Path, device: str) -> None:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    names = list(dict.fromkeys(r["row"] for r in rows))
    by = {(r["config"], r["row"]): r["speedup_vs_xla"] for r in rows}
    series = {f"{ROWS[n].letter} {ROWS[n].label}": [by.get((c, n)) for c in configs] for n in names}
    report.bar_chart(path, configs, series, ylabel="speedup vs plain XLA (higher is better)",
                     title=f"BERT encoder fwd+bwd, dropout 0.1 — {device}", baseline=1.0)


# ---------------------------------------------------------------------------------------
# Command line.


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.encoder", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true",
                   help="reduced sizes: a CPU smoke run (a couple of minutes); its timings mean nothing")
    every = {**FULL.configs, **SMALL.configs}
    p.add_argument("--configs", type=report.csv_choices(every), default=None,
                   help=f"comma-separated; default all of {','.join(FULL.configs)} "
                        f"(with --small: {','.join(SMALL.configs)})")
    p.add_argument("--rows", type=report.csv_choices(ROWS), default=list(ROWS),
                   help=f"comma-separated subset of {','.join(ROWS)} ({BASELINE} is always run: the baseline)")
    p.add_argument("--layouts", choices=("none", "heuristic", "auto"), default="heuristic",
                   help="layouts= of the jaxsub rows (d, e, f, h): 'heuristic' (default: the byte-count "
                        "model's layouts and attention algorithm, what 'auto' uses without a GPU), 'none' "
                        "(each op's default: unfused attention), or 'auto' (times candidates on a cache "
                        "miss: minutes per shape)")
    p.add_argument("--plot", type=pathlib.Path, default=None, help="chart path (default: the JSON path, .png)")
    report.add_run_arguments(p, DEFAULT_JSON, FULL.repeats, SMALL.repeats)
    args = report.parse_run_args(p, argv)
    size = SMALL if args.small else FULL
    args.configs = args.configs or list(size.configs)
    wrong = [c for c in args.configs if c not in size.configs]
    if wrong:
        p.error(f"--configs {','.join(wrong)} not in this run's set ({','.join(size.configs)}); "
                + ("the full-size set runs without --small, which is added where there is no GPU"
                   if args.small else "add --small"))
    args.rows = [BASELINE, *[r for r in args.rows if r != BASELINE]]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    size = SMALL if args.small else FULL
    repeats = args.repeats or size.repeats
    backend = report.print_run_header()
    if args.small:
        print("note: --small uses reduced sizes (not BERT-large); its timings and ratios mean nothing")
    rate, rate_source = matmul_rate(backend, size.matmul_n, repeats)
    print(f"matmul rate for '% floor': {rate_source}", flush=True)
    configs = [dataclasses.replace(size.configs[c], layouts=args.layouts) for c in args.configs]
    plan = [(c, [n for n in args.rows if ROWS[n].stack or not c.stack]) for c in configs]
    progress = report.Progress(sum(2 * len(names) + 1 for _, names in plan))
    rows = []
    for cfg, names in plan:
        progress.note(f"{cfg.name}: {cfg.describe()}, {cfg.matmul_flops() / 1e9:.1f} GFLOP of matmul per step")
        rows += bench_config(cfg, names, dataclasses.replace(size, repeats=repeats), rate, args.seed, progress)
    progress.close()

    result = {
        **report.run_metadata(backend, args.small, repeats),
        "steps_per_sample": {"layer": list(size.steps), "stack": list(size.stack_steps)},
        "warmup_samples": size.warmup, "matmul_rate_flops_per_s": rate, "matmul_rate_source": rate_source,
        "jaxsub_analyze": hasattr(jaxsub, "analyze"),
        "configs": {c.name: {**dataclasses.asdict(c), "dtype": jnp.dtype(c.dtype).name} for c in configs},
        "rows_legend": {n: f"{ROWS[n].letter}: {ROWS[n].label}" for n in args.rows},
        "method": __doc__, "rows": rows,
        # The GEMM algorithms jaxsub's rows timed and picked in this process (empty without
        # a GPU): what to compare first when two runs of the same code differ.
        "gemm_tunings": _ffi.gemm_tunings(),
    }
    report.write_json(args.json, result)
    plot(rows, args.plot or args.json.with_suffix(".png"), timing.describe_device())
    print()
    print("rows: " + "; ".join(f"{ROWS[n].letter} {n} = {ROWS[n].label}" for n in args.rows)
          + f" (rows d, e, f, h with layouts={args.layouts!r})")
    print(f"% floor: matmul flops at {rate_source}")
    print(format_table(rows))
    if any(c.stack for c in configs):
        print("note: XLA GB of the stacks counts the scanned layer body once (XLA's cost analysis "
              "ignores trip counts)")
    tunings = result["gemm_tunings"]
    if tunings:
        moved = sum(t["index"] > 0 for t in tunings)
        print(f"gemm algorithms: {len(tunings)} shapes timed, {moved} picked other than cuBLASLt's first "
              f"(the picks are in the JSON)")
    failed = [f"{r['config']} {r['row']}" for r in rows if r["check"].startswith("FAILED")]
    errors = [f"{r['config']} {r['row']}" for r in rows if r["ms"] is None and not r["optional"]]
    if failed:
        print(f"correctness check FAILED for: {', '.join(failed)}", file=sys.stderr)
    if errors:
        print(f"timing failed for: {', '.join(errors)}", file=sys.stderr)
    if backend == "cpu":
        print("note: CPU run; CPU timings say nothing about GPU speed")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
