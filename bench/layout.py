"""Layout selection (issue #6): is the selected configuration of the encoder layer as fast
as the best one, and faster than the default?

Run: `python -m bench.layout` (GPU; roughly 5-8 minutes per case, mostly compilation;
`--cases b8s512` or `--cases b96s128` runs one),
`python -m bench.layout --small` (a tiny layer, a CPU smoke run: its timings mean nothing).

Cases: the BERT-large layer (hidden 1024, 16 heads, FFN 4096, post-LN, dropout 0.1 on
the attention probabilities, after the projections and after GELU), bf16, batch 8 x
sequence 512 and batch 96 x sequence 128, no mask.

For each case:
1. Tuning: every candidate of every stage and every transpose timed forward + backward
   (`jaxsub.layout.tune`, the cache is bypassed unless --use-cache), the shortest path,
   then the finalists timed as whole layers — for every option of every stage the
   shortest path making it, and the default — and the fastest taken
   (`jaxsub.layout.tuning.verify`; what `layouts="auto"` does). Its wall time is the
   tuning time.
2. Exhaustive search over a reduced space: every full configuration (a path through
   the stages with matching layouts, no transposes) whose layouts are in REDUCED — all
   q/k/v layouts, both attention outputs, every attention implementation the platform
   has, both FFN activation layouts, [B·S, E] everywhere else, the row ops' default
   kernel configurations — timed as a whole layer, in chunks of EXHAUSTIVE_CHUNK timed
   together.
3. Rows, each the whole layer forward + backward (`jax.vjp` with a random cotangent;
   gradients of x and every parameter), all four timed together
   (`jaxsub.layout.tuning.measure_layers`: slope over two loop lengths of one jitted
   fori_loop, the longer about 50 ms, medians of interleaved repeats):
   - default: every stage's default candidate (layouts="none");
   - shortest-path: the shortest path through the stage tables alone (the paper's rule);
   - selected: the tuned selection (the fastest finalist);
   - exhaustive-best: the fastest configuration of step 2.
   Columns: measured µs; predicted µs (sum of the stage and transpose times the
   solver added up); vs default = t(default) / t(row).

Before timing, the selected configuration is checked against the default on one input
(output, dx and every parameter gradient within jaxsub.testing tolerance); a failed
check is printed, kept in the JSON, and makes the run exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

from bench import report
from jaxsub import layout, testing
from jaxsub.layout import encoder as enc
from jaxsub.layout import solver, tuning
from jaxsub.layout.problem import Selection, parse_config, parse_label
from jaxsub.ops.config import KERNEL_CONFIG_KEYS

DEFAULT_JSON = pathlib.Path("bench/results/layout.json")
BERT = dict(hidden=1024, heads=16, mlp_dim=4096, dtype="bfloat16", dropout_rate=0.1, attention_dropout_rate=0.1)
REDUCED = {"x": ("BSE",), "qkv": enc.QKV_LAYOUTS, "ctx": enc.CTX_LAYOUTS, "proj": ("BSE",), "h": ("BSE",),
           "a": ("BSE",), "hm": ("BSE",), "ffn": enc.FFN_LAYOUTS, "out": ("BSE",), "y": ("BSE",)}


@dataclasses.dataclass(frozen=True)
class Size:
    cases: dict
    reduced: dict
    budget_s: float
    repeats: int


FULL = Size(cases={"b8s512": dict(BERT, batch=8, seq=512), "b96s128": dict(BERT, batch=96, seq=128)},
            reduced=REDUCED, budget_s=900.0, repeats=5)
# Tiny, f32 (XLA:CPU compiles bf16 matmuls slowly), and a smaller reduced space (4
# configurations, both attention algorithms).
SMALL = Size(cases={"tiny": dict(BERT, batch=2, seq=8, hidden=16, heads=2, mlp_dim=32, dtype="float32")},
             reduced=dict(REDUCED, qkv=("BS3HD", "3BHSD"), ctx=("BSHD",), ffn=("BSF",)), budget_s=10.0, repeats=3)


EXHAUSTIVE_CHUNK = 8


def reduced_paths(problem, allowed: dict) -> list[list]:
    """Every path of candidates with each label's layouts in `allowed`, consecutive labels
    equal and no row-op kernel configuration (each would multiply the paths by 5)."""
    def ok(lab):
        return all(axes in allowed[name] for name, axes in parse_label(lab).items())

    def default_kernel(cand):
        return not set(parse_config(cand.config)) & set(KERNEL_CONFIG_KEYS)

    paths = [[]]
    for stage in problem.stages:
        paths = [p + [c] for p in paths for c in stage.candidates
                 if ok(c.in_layout) and ok(c.out_layout) and default_kernel(c)
                 and (not p or p[-1].out_layout == c.in_layout)]
    return paths


def _name(selection: Selection) -> str:
    """A short description: the labels handed on ("~label" after a transpose), each
    stage's non-empty config, a label repeated by a stage that keeps it shown once."""
    parts, prev = [], None
    for c in selection.choices:
        cand = c.candidate
        if prev is not None and cand.in_layout != prev:
            parts.append(f"~{cand.in_layout}")
        if cand.out_layout != prev or cand.config:
            parts.append(cand.out_layout + (f"[{cand.config}]" if cand.config else ""))
        prev = cand.out_layout
    return " > ".join(parts)


def combo_keys(combo: dict) -> list:
    return [(c["in"], c["out"], c["config"]) for c in combo["selection"]["choices"]]


def check(problem, selection, default) -> str:
    """'ok', or why the selected layer differs from the default one."""
    wl = problem.layer_workload(default)
    diff, aux = wl.make(123)

    def run(sel):
        fn = problem.layer_workload(sel).fn

        def go(diff, aux):
            out, vjp = jax.vjp(lambda d: fn(d, aux), diff)
            return out, vjp(jnp.cos(out))

        # The inputs are arguments: closed over, they became constants and XLA spent
        # ~18 s constant-folding each attention matmul (H200, b8s512).
        return jax.jit(go)(diff, aux)

    s = problem.spec
    try:
        (want, gw), (got, gg) = run(default), run(selection)
        testing.assert_close(got, want, s.dtype, reduction=s.hidden * s.mlp_dim, what="output")
        for w, g in zip(jax.tree.leaves(gw), jax.tree.leaves(gg)):
            testing.assert_close(g, w, s.dtype, reduction=s.batch * s.seq * s.hidden * s.mlp_dim, grad=True,
                                 what="gradient")
    except AssertionError as e:
        return f"mismatch: {str(e).splitlines()[0]}"
    return "ok"


def run_case(name: str, spec: layout.LayerSpec, size: Size, args, earlier: dict | None = None,
             checkpoint=lambda partial: None) -> dict:
    """One case. `earlier`: this case's (partial) result from an interrupted run; its tuned
    tables (finalists' times included), tuning time and exhaustive timings are reused.
    `checkpoint(partial)` is called after tuning and after every chunk of the exhaustive
    search."""
    problem = layout.EncoderProblem(spec)
    repeats = args.repeats or size.repeats
    print(f"\n== {name}: {spec.batch}x{spec.seq}, hidden {spec.hidden}, {spec.heads} heads, ffn {spec.mlp_dim}, "
          f"{spec.dtype}", flush=True)
    options = layout.Auto(budget_s=args.budget if args.budget is not None else size.budget_s, repeats=repeats,
                          use_cache=args.use_cache, measure_without_gpu=True, progress=None,
                          compile_workers=args.compile_workers, finalists=args.finalists)
    if earlier is not None and earlier.get("tables") is not None:
        tables, source = tuning.Tables.from_json(problem, earlier["tables"]), earlier["tables_source"]
        tuning_s = earlier["tuning_s"]
        print(f"tables ({source}) and tuning time ({tuning_s:.1f} s) from the earlier run")
        selected = tuning.solve(problem, tables, source)
        if args.finalists != 0:
            selected, tables = tuning.verify(problem, tables, source, limit=args.finalists, repeats=repeats,
                                             seed=args.seed, compile_workers=layout.select.workers(options))
    else:
        start = time.perf_counter()
        selected, tables, source, _ = layout.select.timed_choice(problem, options)
        tuning_s = time.perf_counter() - start
    shortest = tuning.solve(problem, tables, source)
    print(selected.describe())
    timed_n = sum(v is not None for t in tables.stages for v in t.values())
    print(f"tuning: {tuning_s:.1f} s, {timed_n} candidates and {len(tables.transposes)} transposes "
          f"({source}{'' if tables.complete else '; the budget ran out before the rest'}), "
          f"{len(tables.layers)} finalists timed whole", flush=True)

    default = Selection.of(problem, problem.default(), "default")
    ordered = [{c.key: t[c.key] for c in st.candidates if c.key in t} for st, t in zip(problem.stages, tables.stages)]
    cost = tuning.transpose_cost(tables)

    def predicted(sel):
        return solver.path_cost(ordered, cost, [c.candidate.key for c in sel.choices])

    def measure(sels, estimates=None):
        """Whole-layer seconds of each Selection, timed together (interleaved)."""
        paths = [(tuple(c.candidate.key for c in sel.choices), est or predicted(sel) or 1e-3)
                 for sel, est in zip(sels, estimates or [None] * len(sels))]
        return tuning.measure_layers(problem, paths, repeats=repeats, seed=args.seed,
                                     compile_workers=layout.select.workers(options))

    partial = {"case": name, "spec": spec.to_json(), "partial": True, "tuning_s": tuning_s,
               "tuning_complete": tables.complete, "tables_source": source, "tables": tables.to_json(problem),
               "selection": selected.to_json(), "shortest_path": shortest.to_json(), "exhaustive": []}
    checkpoint(partial)
    status = check(problem, selected, default)
    print(f"check selected vs default: {status}", flush=True)

    start = time.perf_counter()
    combos = partial["exhaustive"]
    done = {tuple(map(tuple, combo_keys(c))): c for c in (earlier or {}).get("exhaustive", [])
            if c.get("seconds") is not None}
    sels = []
    for path in reduced_paths(problem, size.reduced):
        sel = Selection.of(problem, path, "exhaustive")
        key = tuple(c.candidate.key for c in sel.choices)
        if key in done:
            combos.append(done[key])
        else:
            sels.append(sel)
    if done:
        print(f"exhaustive search: {len(combos)} configurations timed by the earlier run, {len(sels)} to go")
    # In chunks timed together: consistent within a chunk, and a checkpoint after each.
    for i in range(0, len(sels), EXHAUSTIVE_CHUNK):
        chunk = sels[i:i + EXHAUSTIVE_CHUNK]
        for sel, seconds in zip(chunk, measure(chunk)):
            failed = {} if seconds else {"error": "failed to compile or run (see the log)"}
            combos.append({"config": _name(sel), "seconds": seconds, "predicted_s": predicted(sel),
                           "selection": sel.to_json(), **failed})
        checkpoint(partial)
    exhaustive_s = time.perf_counter() - start
    timed = [c for c in combos if c["seconds"] is not None]
    best = min(timed, key=lambda c: c["seconds"])
    keys = [c.candidate.key for c in selected.choices]
    in_reduced = any([tuple(c) for c in combo_keys(x)] == keys for x in combos)
    # The rows are measured again, together: the search's minimum is biased low by noise,
    # and these are what the table compares.
    row_sels = {"default": default, "shortest-path": shortest, "selected": selected,
                "exhaustive-best": Selection.from_json(best["selection"])}
    seconds = dict(zip(row_sels, measure(list(row_sels.values()),
                                         [None, None, selected.layer_s, best["seconds"]])))
    out_rows = []
    for row, sel in row_sels.items():
        out_rows.append({"case": name, "row": row, "config": _name(sel), "us": seconds[row] * 1e6,
                         "predicted_us": None if predicted(sel) is None else predicted(sel) * 1e6,
                         "vs_default": report.ratio(seconds["default"], seconds[row])})
    print(f"exhaustive search: {len(combos)} configurations in {exhaustive_s:.1f} s (fastest there "
          f"{best['seconds'] * 1e6:.1f} us); selected is {'inside' if in_reduced else 'outside'} the reduced space")
    partial.pop("partial")
    return {**partial, "check": status, "exhaustive_s": exhaustive_s, "resumed": bool(earlier),
            "selected_in_reduced_space": in_reduced, "rows": out_rows,
            "selected_vs_exhaustive_best": seconds["selected"] / seconds["exhaustive-best"],
            "errors": [f"{problem.stages[i].name} {k}: {v}" for (i, k), v in tables.errors.items()]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a tiny layer (CPU smoke run)")
    p.add_argument("--cases", type=report.csv_choices(list(FULL.cases) + list(SMALL.cases)), default=None)
    p.add_argument("--budget", type=float, default=None, help="tuning budget per case in seconds")
    p.add_argument("--compile-workers", type=int, default=None,
                   help="threads compiling candidates in batches (default: layout.Auto's, half the "
                        "cores, at most 8, on a GPU)")
    p.add_argument("--finalists", type=int, default=None,
                   help="whole layers timed after the shortest-path solve (default: all finalists; 0: none)")
    p.add_argument("--resume", type=pathlib.Path, default=None,
                   help="the JSON of an interrupted run: its tuned tables, tuning time and exhaustive "
                        "timings are reused (the rows are measured again)")
    p.add_argument("--use-cache", action="store_true", help="read/write the layout cache (tuning time then "
                                                              "means little)")
    report.add_run_arguments(p, DEFAULT_JSON, FULL.repeats, SMALL.repeats)
    args = report.parse_run_args(p, argv)
    size = SMALL if args.small else FULL
    names = args.cases or list(size.cases)
    unknown = [n for n in names if n not in size.cases]
    if unknown:
        p.error(f"cases {unknown} are not in the {'small' if args.small else 'full'} set {list(size.cases)}")
    backend = report.print_run_header()
    meta = report.run_metadata(backend, args.small, args.repeats or size.repeats)
    earlier = {}
    if args.resume is not None:
        earlier = {c["case"]: c for c in json.loads(args.resume.read_text())["cases"]}
    results = []

    def checkpoint(partial):
        # Written as it goes, so that a run cut short keeps what it measured (--resume).
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**meta, "partial": True, "cases": results + [partial]}, indent=2))

    for n in names:
        results.append(run_case(n, layout.LayerSpec(**size.cases[n]), size, args, earlier.get(n), checkpoint))

    rows = [r for res in results for r in res["rows"]]
    header = ["case", "row", "config", "µs fwd+bwd", "predicted µs", "vs default"]
    lines = [[r["case"], r["row"], r["config"], report.fmt(r["us"]), report.fmt(r["predicted_us"]),
              report.fmt(r["vs_default"], ".3f") + "x" if r["vs_default"] else "n/a"] for r in rows]
    print("\n" + report.format_table(header, lines, text_columns=3))
    for res in results:
        print(f"{res['case']}: tuning {res['tuning_s']:.1f} s, exhaustive search {res['exhaustive_s']:.1f} s "
              f"({len(res['exhaustive'])} configurations), check {res['check']}")
    report.write_json(args.json, {**meta, "cases": results, "rows": rows})
    return 0 if all(r["check"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
