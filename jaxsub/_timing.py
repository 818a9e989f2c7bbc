"""Wall-clock device timing shared by the library's own measurements (the layout tuner,
`analyze(time=True)`) and the benchmarks (bench/timing.py builds its slope method on
`median_times` and `slope`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
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


def median_times(calls: Sequence[tuple[Callable, Sequence]], *, repeats: int, warmup: int = 2) -> list[float]:
    """Median wall time in seconds of each `fn(*args)` in `calls`, run to completion on
    the device; the calls are interleaved within each repeat."""
    for fn, args in calls:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, (fn, args) in enumerate(calls):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def slope(t1: float, t2: float, n1: int, n2: int) -> tuple[float, bool]:
    """(seconds per application, reliable) from the times of n1 and n2 applications: the
    slope (t2 - t1) / (n2 - n1), so launch and dispatch overhead cancel; when noise larger
    than the work makes it non-positive, t2 / n2 (an upper bound) and reliable False."""
    s = (t2 - t1) / (n2 - n1)
    return (s, True) if s > 0 else (t2 / n2, False)
