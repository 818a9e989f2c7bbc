"""Where the time of one encoder training step goes, kernel by kernel (GPU).

Runs the encoder benchmark's step (loss = sum(layer(params, x, key) * dy), value and
gradients) for each named row under the JAX profiler (bench.trace) and prints, per row,
the kernels' device time grouped into matmuls, jaxsub kernels and XLA's own kernels, then
the largest kernels, the largest idle stretches between kernels (launch gaps) and the
device's idle time between steps (the 10 traced steps are dispatched back to back).

Usage: python3 tools/profile_layer.py [--config b8s512-bf16] [--rows xla,jaxsub]
[--layouts none|heuristic|auto] [--top 14]; config and rows as bench.encoder's, and its
layouts by default ("heuristic", the main job's; a config's own default, "none", runs the
unfused attention and would profile a step the benchmark does not time). The small
configs run on CPU, where the trace holds no device events and nothing more is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax

from bench import encoder, trace
from bench.layers import ROWS

_MATMUL_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "dot")


def category(kernel: str) -> str:
    low = kernel.lower()
    if "jaxsub" in low:
        return "jaxsub"
    if any(m in low for m in _MATMUL_MARKS):
        return "matmul"
    return "xla"


def profile(config_name: str, row_names: list[str], top: int, layouts: str) -> None:
    sizes = {**encoder.FULL.configs, **encoder.SMALL.configs}
    cfg = dataclasses.replace(sizes[config_name], layouts=layouts)
    params, x, dy, key = encoder.make_inputs(cfg, seed=0)
    for name in row_names:
        impl = ROWS[name]
        step = jax.jit(encoder.make_step(impl.forward(cfg, False)))
        args = (impl.to_row(params), x, dy, key)
        jax.block_until_ready(step(*args))
        walls = []
        for _ in range(7):  # 10 steps dispatched back to back, as bench.encoder times them
            t0 = time.perf_counter()
            for _ in range(10):
                out = step(*args)
            jax.block_until_ready(out)
            walls.append((time.perf_counter() - t0) / 10 * 1e6)
        wall_us = statistics.median(walls)
        events = trace.trace_events(step, args, repeats=10, back_to_back=True)
        times = trace.kernel_times_from_events(events, 10)
        if not times:
            print(f"{name}: no device events in the trace (not a GPU run)")
            continue
        groups: dict[str, float] = {}
        for kernel, us in times.items():
            groups[category(kernel)] = groups.get(category(kernel), 0.0) + us
        total = sum(times.values())
        print(f"\n{cfg.name} {name}: kernels {total:.1f} us per step, wall {wall_us:.1f} us (median of 7), "
              f"{len(times)} distinct kernels; "
              + ", ".join(f"{g} {us:.1f}" for g, us in sorted(groups.items(), key=lambda kv: -kv[1])))
        for kernel, us in list(times.items())[:top]:
            print(f"  {us:8.1f} us  {category(kernel):6s}  {kernel[:110]}")
        # Idle time between kernels inside each of the 10 traced steps, per pair (kernel
        # before -> kernel after); the time between steps is printed on its own below.
        try:
            gaps = trace.idle_gaps(events, steps=10)
        except ValueError as e:
            print(f"  {e}: the gaps below include those between steps")
            gaps = trace.idle_gaps(events)
        pairs: dict[tuple[str, str], list[float]] = {}
        for us, before, after in gaps:
            pairs.setdefault((before, after), []).append(us)
        print(f"  idle between kernels: {sum(g[0] for g in gaps) / 10:.1f} us per step; largest (per step):")
        for (before, after), uss in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"  {sum(uss) / 10:8.1f} us  x{len(uss) / 10:g}  {before[:55]}  ->  {after[:55]}")
        # The steps were dispatched back to back, as a training loop runs them: the device's
        # idle time from one step's last kernel to the next step's first.
        try:
            boundary = trace.step_gaps(events, steps=10)
        except ValueError as e:
            print(f"  between steps: {e}")
            continue
        worst = max(boundary)
        print(f"  between steps: median {statistics.median(g[0] for g in boundary):.1f} us, largest {worst[0]:.1f} us "
              f"({worst[1][:45]}  ->  {worst[2][:45]})")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="b8s512-bf16", help="a bench.encoder config name")
    p.add_argument("--rows", default="xla,jaxsub", help="bench.encoder rows, comma-separated")
    p.add_argument("--layouts", choices=("none", "heuristic", "auto"), default="heuristic",
                   help="the jaxsub rows' layouts= (default: 'heuristic', as bench.encoder's)")
    p.add_argument("--top", type=int, default=14, help="lines of kernels and of gaps per row")
    a = p.parse_args(argv)
    profile(a.config, a.rows.split(","), a.top, a.layouts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
