"""From a `layouts=` argument to a Selection.

  "none" / None   the default candidate of every stage (today's layouts, unfused attention).
  "heuristic"     the byte-count model (jaxsub.layout.model), solved; no timing.
  "auto"          the on-disk cache for this GPU, jax version and problem; on a miss with a
                  GPU present, time the candidates (progress bar, time budget), solve and
                  store. Without a GPU, "heuristic".
  Auto(...)       "auto" with options (budget, repeats, cache directory, timing on CPU).
  a Selection     used as given (checked to fit the problem).

Results are also remembered in-process per (mode, problem, device), so tracing the same
shapes again costs nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings

import jax

from jaxsub.layout import cache, encoder, tuning
from jaxsub.layout.attention import AttentionProblem
from jaxsub.layout.problem import Problem, Selection, parse_config

log = logging.getLogger("jaxsub")

MODES = ("auto", "heuristic", "none")
# A first call should not stall a training script for long: each stage's default is timed
# whatever the budget, so a cut-short tuning still yields a complete path over the candidates
# it timed. `python -m jaxsub tune --budget ...` searches further ahead of time.
DEFAULT_BUDGET_S = 120.0


@dataclasses.dataclass(frozen=True)
class Auto:
    """Options of `layouts="auto"`.

    budget_s: wall-clock limit for timing one problem (compilation included); when it runs
      out the untimed candidates are left out (each stage's default is timed first) and
      the cache entry is marked incomplete, to be finished by a later tuning.
    repeats: timed calls per measurement (median).
    cache_dir: where the cache lives (default: jaxsub.layout.cache.cache_dir()).
    use_cache: read and write the cache.
    measure_without_gpu: time on whatever backend there is (CPU runs at tiny sizes, for
      tests and demos) instead of falling back to the heuristic.
    progress: None (a bar when stderr is a terminal), True, False or a callable
      (done, total, what).
    refresh: time every candidate again even when the cache has them.
    compile_workers: threads that compile candidates in batches, each batch timed after
      it has compiled (`jaxsub.layout.tune`, `tuning.Compiler`); None: half the host's
      cores, at most 8, on a GPU, and 0 (compile and time one by one) elsewhere.
    finalists: after the shortest path, whole configurations are timed end to end and the
      fastest is taken (`jaxsub.layout.tuning.verify`): for every option of every stage
      the shortest path making it, plus the default. None: all of them (about 30 for
      the encoder layer); n: the n with the shortest predicted times; 0: none (the
      shortest path as it is, the paper's rule).
    """

    budget_s: float | None = DEFAULT_BUDGET_S
    repeats: int = 5
    cache_dir: str | None = None
    use_cache: bool = True
    measure_without_gpu: bool = False
    progress: object = None
    refresh: bool = False
    compile_workers: int | None = None
    finalists: int | None = None

    def __post_init__(self):
        def count(name, least, none_ok):
            value = getattr(self, name)
            if value is None and none_ok:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"jaxsub.layout.Auto: {name} must be an int >= {least}"
                                 f"{' or None' if none_ok else ''}, got {value!r}")

        count("repeats", 1, False)
        count("compile_workers", 0, True)
        count("finalists", 0, True)
        if self.budget_s is not None and not (isinstance(self.budget_s, (int, float)) and self.budget_s >= 0):
            raise ValueError(f"jaxsub.layout.Auto: budget_s must be a number >= 0 or None, got {self.budget_s!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"jaxsub.layout.Auto: cache_dir must be a path or None, got {self.cache_dir!r}")


_MEMO: dict = {}


def clear_memo() -> None:
    """Forget the selections remembered in this process (the disk cache stays)."""
    _MEMO.clear()


def gpu_present() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def check_layouts(layouts, where: str = "jaxsub.optimize"):
    """`layouts` normalized ("none" for None), or ValueError/TypeError naming `where`."""
    if layouts is None:
        return "none"
    if isinstance(layouts, (Selection, Auto)):
        return layouts
    if isinstance(layouts, str):
        if layouts not in MODES:
            raise ValueError(f"{where}: layouts={layouts!r}; expected one of {MODES}, an Auto(...) or a Selection")
        return layouts
    raise TypeError(f"{where}: layouts must be 'auto', 'heuristic', 'none', jaxsub.layout.Auto(...) or a "
                    f"jaxsub.layout.Selection, got {type(layouts).__name__}")


def _memo_key(mode: str, problem: Problem, extra=()) -> str:
    # The candidates offered depend on the platform and, for the encoder layer, on whether
    # kernel configurations are (key() describes the workload, the same for both).
    offered = (getattr(problem, "platform", None), getattr(problem, "kernel_configs", None))
    return json.dumps([mode, problem.key(), *offered, *extra], sort_keys=True, default=str)


def default_selection(problem: Problem) -> Selection:
    return Selection.of(problem, problem.default(), source="default")


def heuristic_selection(problem: Problem) -> Selection:
    key = _memo_key("heuristic", problem)
    if key not in _MEMO:
        _MEMO[key] = tuning.solve(problem, tuning.model_tables(problem), "heuristic")
    return _MEMO[key]


def workers(options: Auto) -> int:
    """Auto.compile_workers, None resolved: on a GPU half the host's cores (at most 8); on
    other backends 0, since the loop lengths that compiling ahead fixes come from a GPU
    cost model and would be far too long there."""
    if options.compile_workers is not None:
        return options.compile_workers
    return min(8, (os.cpu_count() or 2) // 2) if jax.default_backend() == "gpu" else 0


def timed_tables(problem: Problem, options: Auto):
    """(tables, source, cache file or None): the cached tables when they cover every
    candidate ("cache"), else tables timed now ("timed"), stored when the cache is on.
    Measurements already on disk are reused; `options.refresh` times everything again."""
    key = cache.make_key(problem.key())
    known = None
    if options.use_cache and not options.refresh:
        entry = cache.load(key, options.cache_dir)
        if entry is not None:
            known = tuning.Tables.from_json(problem, entry["tables"])
            if known.missing(problem) == 0:
                return known, "cache", cache.entry_path(key, options.cache_dir)
    log.info("jaxsub.layout: timing %s candidates for %s", problem.kind, json.dumps(problem.key()))
    tables = tuning.tune(problem, repeats=options.repeats, budget_s=options.budget_s, progress=options.progress,
                         known=known, compile_workers=workers(options))
    path = None
    if options.use_cache:
        path = _store(problem, tables, tuning.solve(problem, tables, "timed"), options)
    return tables, "timed", path


def _store(problem: Problem, tables, selection: Selection, options: Auto):
    """The cache file written, or None (with a warning) where it cannot be: the timing
    already done still gives the selection."""
    try:
        path = cache.store(cache.make_key(problem.key()), tables.to_json(problem), selection.to_json(),
                           options.cache_dir)
    except OSError as e:
        warnings.warn(f"jaxsub.layout: cannot write the layout cache ({e}); using the selection without storing it",
                      RuntimeWarning, stacklevel=2)
        return None
    log.info("jaxsub.layout: stored %s", path)
    return path


def verifiable(problem: Problem) -> bool:
    """Whether the problem's configurations can be timed whole (`tuning.verify`)."""
    return problem.layer_workload(default_selection(problem)) is not None


def timed_choice(problem: Problem, options: Auto):
    """(selection, tables, source, cache file or None): `timed_tables`, then, with
    `options.finalists` != 0 and a problem that runs whole, the fastest of the finalists
    timed end to end (`tuning.verify`), its times stored with the tables."""
    tables, source, path = timed_tables(problem, options)
    if options.finalists != 0 and verifiable(problem):
        before = tables.layers
        log.info("jaxsub.layout: timing the finalist configurations whole")
        selection, tables = tuning.verify(problem, tables, source, limit=options.finalists, repeats=options.repeats,
                                          compile_workers=workers(options))
        if options.use_cache and tables.layers != before:
            path = _store(problem, tables, selection, options)
    else:
        selection = tuning.solve(problem, tables, source)
    return selection, tables, source, path


def timed_selection(problem: Problem, options: Auto) -> Selection:
    """The "auto" path with a device to time on: cached or freshly timed."""
    mkey = _memo_key("auto", problem, (cache.device_key(), options.cache_dir, options.use_cache, options.finalists))
    if mkey not in _MEMO or options.refresh:
        _MEMO[mkey] = timed_choice(problem, options)[0]
    return _MEMO[mkey]


def resolve(layouts, problem: Problem, where: str = "jaxsub.layout") -> Selection:
    """The Selection `layouts` (see the module docstring) gives for `problem`."""
    layouts = check_layouts(layouts, where)
    if isinstance(layouts, Selection):
        check = getattr(problem, "check", None)
        return check(layouts) if check is not None else layouts
    if layouts == "none" or all(len(st.candidates) == 1 for st in problem.stages):
        # Nothing to choose (e.g. attention where the fused kernel does not run): no timing.
        return default_selection(problem)
    if layouts == "heuristic":
        return heuristic_selection(problem)
    options = layouts if isinstance(layouts, Auto) else Auto()
    if not (gpu_present() or options.measure_without_gpu):
        return heuristic_selection(problem)
    return timed_selection(problem, options)


def selection_op_configs(selection: Selection) -> dict:
    """{op: {option: value}} that a Selection gives every call of an op: the config of the
    stage of that name (the attention stage's impl), and for a fused row op the
    `kernel_config` of the first row stage running it that chose one (BDRLN: bdrln1, else
    bdrln2)."""
    table = {}
    for c in selection.choices:
        op = encoder.row_op(c.stage, c.candidate) if selection.kind == encoder.EncoderProblem.kind else None
        if op is None:
            table[c.stage] = parse_config(c.candidate.config)
        elif c.candidate.config and op not in table:
            table[op] = {"kernel_config": encoder.kernel_config(c.candidate)}
    return table


def op_resolver(layouts):
    """For `jaxsub.ops.config.use`: per-op configurations from `layouts`. A Selection
    gives every call of an op what `selection_op_configs` says; a mode resolves each
    attention call's signature as a one-stage problem (the row ops keep their defaults)."""
    layouts = check_layouts(layouts)
    if layouts == "none":
        return None
    if isinstance(layouts, Selection):
        table = selection_op_configs(layouts)

        def from_selection(op, signature):
            return table.get(op, {})

        return from_selection

    def per_signature(op, signature):
        if op != "attention":
            return {}
        return resolve(layouts, AttentionProblem(signature)).config("attention")

    return per_signature
