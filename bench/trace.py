"""Device time per kernel from a JAX profiler trace.

The slope method in `timing.py` measures what one more application of an op costs inside
a jitted program, launch gaps included. This module measures the kernels themselves: it
runs a function under `jax.profiler.trace`, reads the Perfetto (Chrome-format) trace, and
sums the durations of the events on the GPU device's stream threads, per kernel name.
Comparing the two tells launch overhead from slow kernels.

Usage: `kernel_times(fn, args, repeats=10)` -> {kernel name: µs per call}; empty where
the trace holds no device events (CPU). `trace_events` and `idle_gaps` give the raw events
and the device's idle stretches between kernels (launch gaps, host-bound stretches);
`step_gaps` the idle time between consecutive runs of a program dispatched back to back.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

import jax


def device_events(events) -> list[dict]:
    """The complete ('X') events on processes named '/device:GPU...', in trace order."""
    device_pids = {e["pid"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"
                   and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids]


def kernel_times_from_events(events, repeats: int) -> dict[str, float]:
    """µs per call of each event name on processes named '/device:GPU...'."""
    totals: dict[str, float] = collections.defaultdict(float)
    for e in device_events(events):
        totals[e["name"]] += float(e.get("dur", 0.0))
    return {name: us / repeats for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def trace_events(fn, args, *, repeats: int = 10, back_to_back: bool = False) -> list[dict]:
    """Runs fn(*args) once to warm up, then `repeats` times under the profiler; the
    trace's events ([] where it wrote none). Each call is waited for, unless
    `back_to_back`: then all are dispatched before one wait, as a training loop runs, so
    the device's time between calls is what a loop sees (`step_gaps`)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            if back_to_back:
                jax.block_until_ready([fn(*args) for _ in range(repeats)])
            else:
                for _ in range(repeats):
                    jax.block_until_ready(fn(*args))
        paths = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            return []
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def kernel_times(fn, args, *, repeats: int = 10) -> dict[str, float]:
    """µs per call of each kernel of fn(*args), over `repeats` traced calls."""
    return kernel_times_from_events(trace_events(fn, args, repeats=repeats), repeats)


def _runs(events, steps: int, who: str) -> list[list[dict]]:
    """The device events by start time, split into `steps` runs of equal length."""
    evs = sorted(device_events(events), key=lambda e: float(e["ts"]))
    if len(evs) % steps:
        raise ValueError(f"{who}: {len(evs)} device events do not split into {steps} equal steps")
    per_step = len(evs) // steps
    return [evs[k * per_step:(k + 1) * per_step] for k in range(steps)]


def idle_gaps(events, *, steps: int = 1, min_gap_us: float = 0.0) -> list[tuple[float, str, str]]:
    """The idle stretches between consecutive device events (by start time, all of the
    device's streams together): (µs, kernel before, kernel after), largest first. Work
    overlapping on two streams counts as busy. `steps`: the trace holds that many runs of
    one compiled program, each the same number of device events; the gaps between runs
    (the host waiting for each) are left out. ValueError when the events do not split
    evenly."""
    gaps = []
    for run in _runs(events, steps, "idle_gaps"):
        busy_until, last = None, None
        for e in run:
            ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
            if busy_until is not None and ts - busy_until > min_gap_us:
                gaps.append((ts - busy_until, last, e["name"]))
            if busy_until is None or end > busy_until:
                busy_until, last = end, e["name"]
    return sorted(gaps, key=lambda g: -g[0])


def step_gaps(events, *, steps: int) -> list[tuple[float, str, str]]:
    """The device's idle time between consecutive runs of one compiled program (the trace
    holds `steps` runs with the same number of device events, as `idle_gaps`): for each
    boundary, (µs from the end of the run's last busy stretch to the next run's first
    event, kernel before, kernel after), in trace order. ValueError when the events do not
    split evenly."""
    runs = _runs(events, steps, "step_gaps")
    gaps = []
    for run, nxt in zip(runs, runs[1:]):
        last = max(run, key=lambda e: float(e["ts"]) + float(e.get("dur", 0.0)))
        end = float(last["ts"]) + float(last.get("dur", 0.0))
        gaps.append((max(0.0, float(nxt[0]["ts"]) - end), last["name"], nxt[0]["name"]))
    return gaps


def per_application(fn, args, applications: int, *, repeats: int = 3) -> tuple[float | None, dict[str, float]]:
    """Kernel device time of one application when `fn(*args)` applies an op
    `applications` times: (µs summed over every kernel, {kernel: µs}); (None, {}) where
    the trace has no device events (CPU)."""
    times = kernel_times(fn, args, repeats=repeats)
    if not times:
        return None, {}
    per_app = {name: us / applications for name, us in times.items()}
    return sum(per_app.values()), per_app
