"""Timing every candidate of a problem (or modelling it), and solving for a Selection.

Timing method (as bench/timing.py, DESIGN.md "Benchmarks"): a candidate's forward and
backward (`jax.vjp` with a random cotangent; gradients of every differentiated input) run
inside one jitted `fori_loop` over several distinct input sets, each iteration's results
(output and every gradient, in full) carried to the next and the last returned, so
nothing is skipped. Two loops, of n1 and n2
iterations (static trip counts on a GPU: no per-iteration host sync), are timed from the
host to completion after warm-up, median of `repeats` interleaved calls; the
per-application time is the slope (t(n2) - t(n1)) / (n2 - n1), so launch and dispatch
overhead cancel. Enough input sets are drawn that they do not all fit in a GPU's L2 cache.

All of it runs under `jax.ensure_compile_time_eval()`, so tuning started while the
caller is being traced (the first call of an optimized function under jit) executes
eagerly on the device instead of being staged into the caller's program.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Layout, with_layout_constraint

from jaxsub import _timing
from jaxsub.layout.problem import (Candidate, Choice, Problem, Selection, atomic_transposes, config_str, host_normal,
                                  parse_config)
from jaxsub.ops.config import KERNEL_CONFIG_KEYS
from jaxsub.layout.solver import NoConfigurationError, path_cost, shortest_configuration

log = logging.getLogger("jaxsub")
_L2_BYTES = 256 << 20     # input sets span at least this much (an H200's L2 is 60 MB)


@dataclasses.dataclass
class Tables:
    """Measured (or modelled) seconds: stages[i] {candidate key: seconds or None
    (failed)}, transposes {(src axes, dst axes): seconds}; `complete` is False when the
    time budget ran out before every candidate was timed. `layers` {path: seconds}: whole
    configurations (a path: one candidate key per stage) timed end to end by `verify`
    (in chunks timed together, the fastest few again together)."""

    stages: list
    transposes: dict
    complete: bool = True
    tuning_s: float = 0.0
    errors: dict = dataclasses.field(default_factory=dict)
    layers: dict = dataclasses.field(default_factory=dict)

    def to_json(self, problem: Problem) -> dict:
        return {
            "complete": self.complete, "tuning_s": self.tuning_s,
            "stages": [{"name": st.name, "candidates": [
                {"in": k[0], "out": k[1], "config": k[2], "seconds": s,
                 **({"error": self.errors[(i, k)]} if (i, k) in self.errors else {})}
                for k, s in table.items()]} for i, (st, table) in enumerate(zip(problem.stages, self.stages))],
            "transposes": [{"from": a, "to": b, "seconds": s} for (a, b), s in self.transposes.items()],
            "layers": [{"path": [list(k) for k in path], "seconds": s} for path, s in self.layers.items()],
        }

    @classmethod
    def from_json(cls, problem: Problem, data: dict) -> Tables:
        """Tables for `problem` from a cache entry; stages are matched by name and
        candidates the cache lacks are simply missing (to be timed)."""
        by_name = {st["name"]: st for st in data["stages"]}
        stages = []
        for st in problem.stages:
            rows = by_name.get(st.name, {}).get("candidates", [])
            stages.append({(r["in"], r["out"], r["config"]): r["seconds"] for r in rows})
        transposes = {(t["from"], t["to"]): t["seconds"] for t in data.get("transposes", [])}
        layers = {tuple(tuple(k) for k in r["path"]): r["seconds"] for r in data.get("layers", [])}
        return cls(stages, transposes, bool(data.get("complete", False)), float(data.get("tuning_s", 0.0)),
                   layers=layers)

    def missing(self, problem: Problem) -> int:
        n = sum(c.key not in t for st, t in zip(problem.stages, self.stages) for c in st.candidates)
        return n + sum(p not in self.transposes for p in needed_transposes(problem))


def needed_transposes(problem: Problem) -> list[tuple[str, str]]:
    """The single-array transposes any label change between consecutive stages needs."""
    pairs = {}
    for left, right in zip(problem.stages, problem.stages[1:]):
        outs = dict.fromkeys(c.out_layout for c in left.candidates)
        ins = dict.fromkeys(c.in_layout for c in right.candidates)
        for a in outs:
            for b in ins:
                for pair in (atomic_transposes(a, b) or []) if a != b else []:
                    pairs[pair] = None
    return list(pairs)


# ---------------------------------------------------------------------------------------
# Timing.


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")
               and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key))


def _row_major(x):
    """x, constrained to the row-major layout: a loop carry is otherwise free to take the
    layout a transpose produces, which turns the transpose into a plain copy."""
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def _loop(workload, k: int, n: int | None, result):
    """jit of run(diffs, auxs, cots[, n]): n applications of the workload's forward and
    backward, cycling through k stacked input sets. Each application's results (output
    and gradients, shapes `result`) become the loop carry and the last ones are returned:
    every application computes them in full (a loop that kept only an element of each
    would let XLA compute just that element) and in the row-major layout the next
    operator reads (unconstrained, XLA may skip a transpose by changing a layout). A static n gives
    XLA a known trip count (on a GPU a dynamic one costs a device-to-host copy of the loop
    predicate per iteration); n=None takes it as an argument: one compilation for both
    loop lengths."""
    def step(diff, aux, cot):
        out, vjp = jax.vjp(lambda d: workload.fn(d, aux), diff)
        return out, vjp(cot)

    def run(diffs, auxs, cots, count=n):
        def body(i, carry):
            j = i % k
            pick = lambda t: jax.tree.map(lambda a: a[j], t)  # noqa: E731
            return jax.tree.map(_row_major, step(pick(diffs), pick(auxs), pick(cots)))

        init = jax.tree.map(lambda r: jnp.zeros(r.shape, r.dtype), result)
        return jax.lax.fori_loop(0, count, body, init)

    if n is None:
        return jax.jit(run)
    return jax.jit(lambda diffs, auxs, cots: run(diffs, auxs, cots))


@dataclasses.dataclass
class Prepared:
    """A workload ready to time: its loop calls [(fn, args)] for n1 and, when known, n2."""

    calls: list
    n1: int
    n2: int | None
    loop: Callable  # n -> (fn, args), compiled on demand


def prepare(workload, *, n1: int = 2, n2: int | None = None, seed: int = 0, max_sets: int = 16,
            compile_now: bool = False) -> Prepared:
    """The inputs of `measure` (k stacked input sets and cotangents) and its loop calls
    for n1 and, if given, n2. `compile_now` compiles them ahead of time (`lower` +
    `compile`), so `prepare` can run in a worker thread while another workload is timed."""
    with jax.ensure_compile_time_eval():
        first = workload.make(seed)
        per_set = max(_nbytes(first), 1)
        k = max(2, min(max_sets, -(-_L2_BYTES // per_set)))
        made = [first] + [workload.make(seed + i) for i in range(1, k)]
        out = jax.eval_shape(lambda d, a: workload.fn(d, a), *first)
        # Cotangents drawn on the host: eager jax.random would compile a small program per
        # new shape (a third of a candidate's tuning time in a CPU profile).
        rng = np.random.default_rng(seed)
        leaves, tree = jax.tree.flatten(out)
        cots = [jax.tree.unflatten(tree, [host_normal(rng, o.shape, o.dtype) for o in leaves]) for _ in range(k)]
        args = (_stack([m[0] for m in made]), _stack([m[1] for m in made]), _stack(cots))
        result = jax.eval_shape(lambda d, a, c: (out, jax.vjp(lambda x: workload.fn(x, a), d)[1](c)),
                                first[0], first[1], cots[0])
    static = jax.default_backend() == "gpu"
    dynamic = []

    def loop(n):
        with jax.ensure_compile_time_eval():
            if static:
                fn = _loop(workload, k, n, result)
                return (fn.lower(*args).compile() if compile_now else fn), args
            if not dynamic:
                fn = _loop(workload, k, None, result)
                dynamic.append(fn.lower(*args, np.int32(n)).compile() if compile_now else fn)
            return dynamic[0], (*args, np.int32(n))

    calls = [loop(n1)] + ([loop(n2)] if n2 is not None else [])
    return Prepared(calls, n1, n2, loop)


def n2_for(seconds: float, *, n1: int = 2, target_s: float = 0.01, max_n: int = 1000) -> int:
    """The longer loop's length for work of about `seconds` per application: t(n2) - t(n1)
    near `target_s`, at least 10, at most `max_n`."""
    return int(min(max_n, max(10, n1 + target_s / max(seconds, 1e-7))))


class Compiler:
    """Runs thunks (typically `prepare(..., compile_now=True)`) in `workers` threads, one
    batch at a time: `batch(thunks)` returns, once every thunk has finished, each one's
    result or the exception it raised. Compiling and timing never overlap: compile
    threads competing for the host's cores delay its timing calls and bias the slope (an
    H200 run that timed while the next candidates compiled gave stage times below the
    matmul floor and others up to 7x too high). Use as a context manager (the threads end on
    exit)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxsub-tune")

    def batch(self, thunks) -> list:
        futures = [self.pool.submit(t) for t in thunks]
        concurrent.futures.wait(futures)
        return [f.exception() if f.exception() is not None else f.result() for f in futures]

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def measure(workload, *, repeats: int = 5, n1: int = 2, target_s: float = 0.01, max_n: int = 1000, seed: int = 0,
            max_sets: int = 16, prepared: Prepared | None = None) -> float:
    """Seconds of one forward + backward application of `workload` (slope method). The
    longer loop has n2 >= 10 iterations, more for small work, so that t(n2) - t(n1) is
    about `target_s` (capped at `max_n`): a 5 µs transpose is not lost in launch noise.
    n2 comes from a first timing of the n1 loop unless `prepared` (from `prepare`) already
    fixed it."""
    prepared = prepared or prepare(workload, n1=n1, seed=seed, max_sets=max_sets)
    n1 = prepared.n1
    with jax.ensure_compile_time_eval():
        calls = list(prepared.calls)
        if prepared.n2 is None:
            # t(n1) / n1 overestimates the work (it includes the launch), so n2 errs short.
            n2 = n2_for(_timing.median_time(*calls[0], 3, warmup=2) / n1, n1=n1, target_s=target_s, max_n=max_n)
            calls.append(prepared.loop(n2))
        else:
            n2 = prepared.n2
        t1, t2 = _timing.median_times(calls, repeats=repeats, warmup=2)
    # Noise larger than the work (tiny CPU problems): t(n2)/n2, an upper bound.
    return _timing.slope(t1, t2, n1, n2)[0]


class _Progress:
    """A one-line progress bar on stderr (only when it is a terminal, unless forced)."""

    def __init__(self, title: str, total: int, enabled):
        self.title, self.total, self.done, self.start = title, total, 0, time.perf_counter()
        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.callback = enabled if callable(enabled) else None

    def step(self, what: str):
        self.done += 1
        if self.callback is not None:
            self.callback(self.done, self.total, what)
        elif self.enabled:
            width = 24
            fill = width * self.done // max(self.total, 1)
            sys.stderr.write(f"\rjaxsub.layout: tuning {self.title} [{'#' * fill}{'.' * (width - fill)}] "
                             f"{self.done}/{self.total} {time.perf_counter() - self.start:5.0f}s {what[:48]:<48}")
            sys.stderr.flush()

    def close(self):
        if self.enabled and self.callback is None:
            sys.stderr.write("\n")
            sys.stderr.flush()


def tune(problem: Problem, *, repeats: int = 5, budget_s: float | None = None, progress=None,
         known: Tables | None = None, seed: int = 0, measure_fn=None, compile_workers: int = 0) -> Tables:
    """Time every candidate of every stage and every needed transpose, forward and
    backward. Entries in `known` are reused, not timed again. Order: each stage's default
    candidate first, always timed (so a complete default path exists whatever the
    budget), then the other layout and algorithm candidates stage by stage, then the
    transposes, then the row ops' kernel configurations. Once
    `budget_s` is exceeded the rest is skipped and the tables are marked incomplete. A candidate that fails to
    run gets None (not selectable) and its error is kept. `progress`: None (a bar on an
    interactive stderr), True, False, or a callable (done, total, what). `measure_fn`
    replaces `measure` (same signature).

    `compile_workers` > 0 (with the built-in `measure`): candidates are prepared and
    compiled (`prepare`) in batches of 2 x compile_workers, in that many threads, then
    the batch is timed one by one with nothing compiling (`Compiler`); the longer loop's
    length comes from the problem's byte/flop model instead of a first timing."""
    compiler = Compiler(compile_workers) if compile_workers > 0 and measure_fn is None else None
    measure_fn = measure_fn or measure
    start = time.perf_counter()
    stages = [dict() for _ in problem.stages]
    transposes = dict(known.transposes) if known else {}
    errors = dict(known.errors) if known else {}
    todo = []          # (kind, ..., required): the defaults are timed whatever the budget
    # Order: each stage's default; the other layouts and algorithms; the transposes (which
    # make those usable); last the kernel configurations of the row ops.
    for rank in (0, 1, 2):
        if rank == 2:
            todo += [("transpose", a, b, False) for a, b in needed_transposes(problem) if (a, b) not in transposes]
        for i, st in enumerate(problem.stages):
            for j, c in enumerate(st.candidates):
                launch_shape = any(k in KERNEL_CONFIG_KEYS for k in parse_config(c.config))
                if (0 if j == 0 else 2 if launch_shape else 1) != rank:
                    continue
                if known is not None and c.key in known.stages[i]:
                    stages[i][c.key] = known.stages[i][c.key]
                else:
                    todo.append(("stage", i, c, rank == 0))

    def workload(item):
        return problem.stage_workload(item[1], item[2]) if item[0] == "stage" else \
            problem.transpose_workload(item[1], item[2])

    def prep(item):
        model = problem.model_stage(item[1], item[2]) if item[0] == "stage" else \
            problem.model_transpose(item[1], item[2])
        return prepare(workload(item), n2=n2_for(model), seed=seed, compile_now=True)

    def timed(item, prepared):
        if prepared is None:
            return measure_fn(workload(item), repeats=repeats, seed=seed)
        if isinstance(prepared, Exception):
            raise prepared
        return measure(None, repeats=repeats, seed=seed, prepared=prepared)

    def over_budget():
        return budget_s is not None and time.perf_counter() - start > budget_s

    bar = _Progress(problem.kind, len(todo), progress)
    complete = True
    size = 2 * compile_workers if compiler else 1
    try:
        for b in range(0, len(todo), size):
            items = todo[b:b + size]
            if over_budget() and not all(item[3] for item in items):
                # Past the budget only the defaults (first in the order) are still timed.
                complete = False
                items = [item for item in items if item[3]]
                if not items:
                    break
            prepared = compiler.batch([functools.partial(prep, item) for item in items]) if compiler else \
                [None] * len(items)
            for item, ready in zip(items, prepared):
                if item[0] == "stage":
                    _, i, c, _ = item
                    what = f"{problem.stages[i].name} {c}"
                    try:
                        stages[i][c.key] = timed(item, ready)
                    except Exception as e:  # noqa: BLE001 - a failing candidate is not selectable
                        stages[i][c.key] = None
                        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                        errors[(i, c.key)] = f"{type(e).__name__}: {first}"
                else:
                    _, a, b2, _ = item
                    what = f"transpose {a} -> {b2}"
                    try:
                        transposes[(a, b2)] = timed(item, ready)
                    except Exception as e:  # noqa: BLE001 - that layout change is then impossible
                        transposes[(a, b2)] = None
                        log.warning("jaxsub.layout: timing %s failed: %s: %s", what, type(e).__name__, e)
                bar.step(what)
    finally:
        bar.close()
        if compiler is not None:
            compiler.close()
    # Keep the problem's candidate order (defaults first): the solver breaks ties by it.
    ordered = [{c.key: st_t[c.key] for c in st.candidates if c.key in st_t}
               for st, st_t in zip(problem.stages, stages)]
    return Tables(ordered, transposes, complete, time.perf_counter() - start + (known.tuning_s if known else 0.0),
                  errors)


def model_tables(problem: Problem) -> Tables:
    """The heuristic's tables: modelled seconds for every candidate and transpose."""
    stages = [{c.key: problem.model_stage(i, c) for c in st.candidates} for i, st in enumerate(problem.stages)]
    transposes = {(a, b): problem.model_transpose(a, b) for a, b in needed_transposes(problem)}
    return Tables(stages, transposes)


def transpose_cost(tables: Tables):
    """transpose_cost(a, b) for the solver: the sum of the single-array transposes a
    label change needs; None where impossible or not measured."""
    def cost(a: str, b: str):
        pairs = atomic_transposes(a, b)
        if pairs is None:
            return None
        total = 0.0
        for p in pairs:
            t = tables.transposes.get(p)
            if t is None:
                return None
            total += t
        return total

    return cost


def _ordered(problem: Problem, tables: Tables) -> list[dict]:
    """The tables' stages for the solver, in the problem's candidate order (defaults first:
    ties go to them)."""
    return [{c.key: t[c.key] for c in st.candidates if c.key in t} for st, t in zip(problem.stages, tables.stages)]


def _selection(problem: Problem, tables: Tables, path, total, source: str, layer_s=None) -> Selection:
    cost_fn = transpose_cost(tables)
    choices, prev = [], None
    for st, key, table in zip(problem.stages, path, _ordered(problem, tables)):
        step = 0.0 if prev is None or prev == key[0] else cost_fn(prev, key[0])
        choices.append(Choice(st.name, Candidate(*key), table[key], step))
        prev = key[1]
    return Selection(problem.kind, tuple(choices), total, source, layer_s)


def solve(problem: Problem, tables: Tables, source: str) -> Selection:
    """The shortest path through `tables` as a Selection of `problem`."""
    names = [st.name for st in problem.stages]
    path, total = shortest_configuration(_ordered(problem, tables), transpose_cost(tables), names=names)
    return _selection(problem, tables, path, total, source)


# ---------------------------------------------------------------------------------------
# Verification: the finalist paths timed again as whole layers.


def _structure(key: tuple) -> tuple:
    """A candidate key without its row-op kernel configuration: the kernel configuration
    acts inside its op, so the stage tables alone choose it; layouts and algorithms act
    across stage boundaries (XLA fuses there) and are what whole-layer timing checks."""
    config = {k: v for k, v in parse_config(key[2]).items() if k not in KERNEL_CONFIG_KEYS}
    return (key[0], key[1], config_str(**config))


def finalists(problem: Problem, tables: Tables, limit: int | None = None) -> list[tuple[tuple, float]]:
    """[(path, predicted seconds)], cheapest prediction first: for every stage and every
    layout/algorithm choice of it, the shortest path through the tables that makes that
    choice (each with its best kernel configurations), distinct; at most `limit` of them;
    then the default path if it is not among them (and has a time). The shortest path is
    the first; every option of every stage is represented by its best completion, so a
    choice the stage tables misjudge (its isolated time is not its time inside the
    layer) still gets timed whole."""
    ordered, cost_fn = _ordered(problem, tables), transpose_cost(tables)
    names = [st.name for st in problem.stages]
    found: dict = {}
    for i, table in enumerate(ordered):
        groups: dict = {}
        for key, seconds in table.items():
            groups.setdefault(_structure(key), {})[key] = seconds
        for only in groups.values():
            try:
                path, cost = shortest_configuration(ordered[:i] + [only] + ordered[i + 1:], cost_fn, names=names)
            except NoConfigurationError:
                continue
            found.setdefault(tuple(path), cost)
    ranked = sorted(found.items(), key=lambda item: item[1])[:limit]
    default = tuple(c.key for c in problem.default())
    default_cost = path_cost(ordered, cost_fn, default)
    if default_cost is not None and all(p != default for p, _ in ranked):
        ranked.append((default, default_cost))
    return ranked


def measure_layers(problem: Problem, paths, *, repeats: int = 5, seed: int = 0, compile_workers: int = 0,
                   target_s: float = 0.05) -> list[float | None]:
    """Seconds of one forward + backward application of the whole problem under each path
    (None where it failed), measured together: the loops of every path are compiled first
    (in `compile_workers` threads if > 0), then timed interleaved, so that clock and
    thermal drift hit them alike. Each longer loop runs about `target_s`, its length from
    the path's predicted seconds."""
    def prep(path, predicted):
        sel = Selection.of(problem, [Candidate(*k) for k in path], "verify")
        return prepare(problem.layer_workload(sel), n2=n2_for(predicted, target_s=target_s), seed=seed,
                       compile_now=True)

    thunks = [functools.partial(prep, path, predicted) for path, predicted in paths]
    if compile_workers > 0:
        with Compiler(compile_workers) as compiler:
            prepared = compiler.batch(thunks)
    else:
        prepared = []
        for thunk in thunks:
            try:
                prepared.append(thunk())
            except Exception as e:  # noqa: BLE001 - recorded below
                prepared.append(e)
    for i, p in enumerate(prepared):
        if isinstance(p, Exception):
            log.warning("jaxsub.layout: a configuration failed to compile: %s", p)
            prepared[i] = None
    ok = [p for p in prepared if p is not None]
    try:
        with jax.ensure_compile_time_eval():
            times = _timing.median_times([c for p in ok for c in p.calls], repeats=repeats, warmup=2)
    except Exception as e:  # noqa: BLE001 - e.g. out of device memory: nothing selectable, no crash
        log.warning("jaxsub.layout: timing whole configurations failed (%s: %s); keeping the shortest path",
                    type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
        return [None] * len(prepared)
    slopes = iter(_timing.slope(times[2 * i], times[2 * i + 1], p.n1, p.n2)[0] for i, p in enumerate(ok))
    return [None if p is None else next(slopes) for p in prepared]


def verify(problem: Problem, tables: Tables, source: str, *, limit: int | None = None, repeats: int = 5,
           seed: int = 0, compile_workers: int = 0, chunk: int = 8, final: int = 3,
           measure_fn=None) -> tuple[Selection, Tables]:
    """The fastest, timed as a whole layer, of `finalists(problem, tables, limit)`; and the
    tables with those whole-layer times (`layers`). Stage times measured apart do not add
    up to the layer's: XLA fuses and lays out across stage boundaries (on the H200 the
    sums were 11-22% above the whole layers' times, by a different amount for each
    configuration), so the shortest path by the tables can lose to another.

    The finalists are timed in chunks of `chunk` (each chunk together, interleaved; the
    loops of a chunk are held in device memory at once), then the `final` fastest again
    together, so that the last comparison is within one measurement. Finalists already
    timed (`tables.layers`, e.g. from the cache) are not timed again. `measure_fn`
    replaces `measure_layers` (same signature)."""
    found = finalists(problem, tables, limit)
    layers = dict(tables.layers)
    if not all(p in layers for p, _ in found):
        measure_fn = measure_fn or measure_layers
        start = time.perf_counter()
        layers = {}
        for i in range(0, len(found), chunk):
            part = found[i:i + chunk]
            layers.update(zip([p for p, _ in part], measure_fn(problem, part, repeats=repeats, seed=seed,
                                                               compile_workers=compile_workers)))
        best = sorted((t, i) for i, (p, _) in enumerate(found) if (t := layers[p]) is not None)[:final]
        if len(found) > chunk and len(best) > 1:
            again = [(found[i][0], t) for t, i in best]
            layers.update(zip([p for p, _ in again], measure_fn(problem, again, repeats=repeats, seed=seed,
                                                                compile_workers=compile_workers)))
        tables = dataclasses.replace(tables, layers=layers, tuning_s=tables.tuning_s + time.perf_counter() - start)
    timed = [(layers[p], i) for i, (p, _) in enumerate(found) if layers.get(p) is not None]
    if not timed:
        return solve(problem, tables, source), tables
    _, best_i = min(timed)
    path, predicted = found[best_i]
    return _selection(problem, tables, path, predicted, source, layers[path]), tables
