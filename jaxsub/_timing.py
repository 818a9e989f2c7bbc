"""Wall-clock device timing shared by the library's own measurements (the layout tuner and
`analyze(time=True)`); the benchmarks' slope method lives in bench/timing.py."""

from __future__ import annotations

import statistics
import time

import jax


def median_time(fn, args, repeats: int, *, warmup: int = 0) -> float:
    """Median seconds of `fn(*args)` run to completion, after `warmup` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
