"""DRAM bytes of one encoder training step, measured by Nsight Compute (GPU).

`ncu` profiles small programs on the H200 but crashed while XLA compiled the BERT step
(issue #5). So the step is compiled in a first process without `ncu`, into JAX's
persistent compilation cache, and a second process under `ncu` loads it from there: it
compiles nothing, and only the one step between cudaProfilerStart and cudaProfilerStop is
profiled (`--profile-from-start off`), not the inputs' set-up or a first, warm-up step
(which times the GEMM target's algorithms).

    python3 tools/step_dram_bytes.py prepare --config b8s512-bf16 --rows xla,jaxsub --cache /tmp/cc
    for row in xla jaxsub; do
      XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --profile-from-start off --print-units base --csv \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum --log-file /tmp/$row.csv \\
        python3 tools/step_dram_bytes.py run --config b8s512-bf16 --rows $row --cache /tmp/cc
    done
    python3 tools/step_dram_bytes.py sum /tmp/xla.csv /tmp/jaxsub.csv

`ncu` flushes the L2 before each kernel by default (`--cache-control all`), so each kernel's
reads are what it fetches from a cold cache (`jaxsub.analyze`'s assumption), but what it
writes and leaves in the 50 MB L2 is counted nowhere. `--cache-control none` keeps the L2
as the step leaves it: a kernel's reads of what earlier ones left there cost nothing, and
their writes are counted when evicted, so the sum over the step is the step's DRAM traffic
(up to the dirty lines left in the L2 at its end). On the H200 the two differ by 5%
(bench/NOTES.md, twenty-sixth session). `prepare` also prints XLA's estimate and
`jaxsub.analyze`'s count for each row. Config and row names are bench.encoder's; the jaxsub
rows run with `--layouts` (the main job's "heuristic" by default); `run` takes one row
(one profile per file).
"""

from __future__ import annotations

import argparse
import dataclasses
import csv
import ctypes
import glob
import os
import sys
import time

_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "kibyte": 1024, "mibyte": 1024**2,
          "gibyte": 1024**3}


def _cudart():
    """The CUDA runtime, for cudaProfilerStart/Stop (ncu's profiling range), or None."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for site in sys.path:
        names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so*")))
        names += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            lib.cudaProfilerStart, lib.cudaProfilerStop  # noqa: B018 (both must exist)
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _use_cache(path: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _step(config: str, row: str, layouts: str):
    """The jitted step of bench.encoder's row at the config (the jaxsub rows with
    `layouts`, the main job's "heuristic" by default), and its arguments."""
    import jax

    from bench import encoder
    from bench.layers import ROWS

    sizes = {**encoder.FULL.configs, **encoder.SMALL.configs}
    if config not in sizes:
        raise SystemExit(f"step_dram_bytes: unknown --config {config!r}; one of {', '.join(sizes)}")
    if row not in ROWS:
        raise SystemExit(f"step_dram_bytes: unknown row {row!r}; one of {', '.join(ROWS)}")
    cfg = dataclasses.replace(sizes[config], layouts=layouts)
    params, x, dy, key = encoder.make_inputs(cfg, seed=0)
    impl = ROWS[row]
    step = jax.jit(encoder.make_step(impl.forward(cfg, False)))
    return step, (impl.to_row(params), x, dy, key)


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.1f} MB"


def prepare(config: str, rows: list[str], cache: str, layouts: str) -> None:
    import jax

    from bench import encoder

    _use_cache(cache)
    for row in rows:
        step, args = _step(config, row, layouts)
        t0 = time.perf_counter()
        compiled = step.lower(*args).compile()  # the executable `run` loads from the cache
        jax.block_until_ready(compiled(*args))
        print(f"{row}: compiled and ran in {time.perf_counter() - t0:.1f} s")
        # The two counts the measured bytes go beside (bench.encoder's columns).
        xla = encoder.cost_bytes(compiled)
        analytic, _ = encoder.analytic_bytes(step, args)
        print(f"{row}: bytes per step, XLA's estimate {_mb(xla)}, jaxsub.analyze {_mb(analytic)}")
    print(f"cache {cache}: {len(os.listdir(cache))} entries")


def run(config: str, row: str, cache: str, layouts: str) -> None:
    import jax

    _use_cache(cache)
    step, args = _step(config, row, layouts)
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()  # from the cache: seconds here mean it compiled
    print(f"{row}: lowered and loaded in {time.perf_counter() - t0:.1f} s")
    # One step outside the profiled range: jaxsub's GEMM target times cuBLASLt's candidate
    # algorithms on its first call for each shape (cuda/gemm.cu), and those runs are not
    # the step's traffic.
    jax.block_until_ready(compiled(*args))
    lib = _cudart()
    if lib is None:
        print("step_dram_bytes: no CUDA runtime found for cudaProfilerStart; ncu sees the whole process")
    elif lib.cudaProfilerStart() != 0:
        print("step_dram_bytes: cudaProfilerStart failed (no GPU?)")
    jax.block_until_ready(compiled(*args))
    if lib is not None:
        lib.cudaProfilerStop()
    print(f"{row}: one step run")


def read_profile(path: str) -> dict[str, float]:
    """Bytes read and written (summed over the profiled kernels) and the kernel count, from
    `ncu --csv` output: the lines that are not CSV (ncu's ==PROF== messages, the program's
    own prints) are skipped."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    totals = {m: 0.0 for m in _METRICS}
    kernels = set()
    for rec in csv.DictReader(lines):
        name = rec.get("Metric Name")
        if name not in totals:
            continue
        unit = (rec.get("Metric Unit") or "byte").strip().lower()
        if unit not in _UNITS:
            raise ValueError(f"step_dram_bytes: {path}: unknown unit {unit!r} for {name}")
        totals[name] += float(rec["Metric Value"].replace(",", "")) * _UNITS[unit]
        kernels.add(rec.get("ID"))
    if not kernels:
        raise ValueError(f"step_dram_bytes: {path}: no {' or '.join(_METRICS)} rows (ncu --csv output expected)")
    return {"read": totals[_METRICS[0]], "write": totals[_METRICS[1]], "kernels": len(kernels)}


def summarize(paths: list[str]) -> str:
    out = [f"{'profile':30s} {'kernels':>8s} {'read MB':>10s} {'write MB':>10s} {'total MB':>10s} {'vs first':>9s}"]
    first = None
    for path in paths:
        p = read_profile(path)
        total = p["read"] + p["write"]
        first = total if first is None else first
        out.append(f"{os.path.basename(path):30s} {p['kernels']:8d} {p['read'] / 1e6:10.1f} {p['write'] / 1e6:10.1f} "
                   f"{total / 1e6:10.1f} {total / first if first else float('nan'):9.3f}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "run"):
        s = sub.add_parser(name)
        s.add_argument("--config", default="b8s512-bf16")
        s.add_argument("--rows", default="xla,jaxsub" if name == "prepare" else "xla")
        s.add_argument("--cache", required=True, help="the persistent compilation cache's directory")
        s.add_argument("--layouts", choices=("none", "heuristic", "auto"), default="heuristic",
                       help="the jaxsub rows' layouts= (bench.encoder's default: heuristic)")
    s = sub.add_parser("sum")
    s.add_argument("profiles", nargs="+", help="ncu --csv --print-units base output files")
    a = p.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.config, a.rows.split(","), a.cache, a.layouts)
    elif a.cmd == "run":
        if "," in a.rows:
            raise SystemExit("step_dram_bytes run: one row per profile")
        run(a.config, a.rows, a.cache, a.layouts)
    else:
        print(summarize(a.profiles))
    return 0


if __name__ == "__main__":
    # bench/ from this tree, at the end of the path: an installed jaxsub comes first (a
    # fresh clone's jaxsub/ has no built extension), as the Makefile runs bench.
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))
