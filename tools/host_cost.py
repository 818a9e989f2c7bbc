"""Is the encoder training step host-bound? (GPU; on CPU the numbers say nothing.)

For bench.encoder rows (default: plain XLA and jaxsub's EncoderLayer; b8s512-bf16 step,
heuristic layouts) it prints the host time to enqueue a step (10 steps dispatched back to
back, before waiting) beside the time per step including the wait, and the latency of a
single step on an idle device. Then the host cost of a custom call: 50 chained jaxsub
layer_norm calls on a tiny input against 50 chained XLA fusions of similar work.
A step is host-bound when its enqueue time approaches its time per step.

Usage: python3 tools/host_cost.py [--config b8s512-bf16] [--rows xla,jaxsub]; any bench.encoder
config (the small ones, e.g. small-b2s64-bf16, for a quick run on CPU) and rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxsub
from bench import encoder
from bench.layers import ROWS


def _enqueue_and_total(fn, args, calls: int = 10, repeats: int = 9) -> tuple[float, float]:
    """(host µs per call to enqueue, µs per call until the results are ready), medians."""
    enq, tot = [], []
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        t1 = time.perf_counter()
        jax.block_until_ready(outs)
        t2 = time.perf_counter()
        enq.append((t1 - t0) / calls * 1e6)
        tot.append((t2 - t0) / calls * 1e6)
    return statistics.median(enq), statistics.median(tot)


def steps(config: str, rows: list[str]) -> None:
    sizes = {**encoder.FULL.configs, **encoder.SMALL.configs}
    cfg = dataclasses.replace(sizes[config], layouts="heuristic")
    params, x, dy, key = encoder.make_inputs(cfg, seed=0)
    for name in rows:
        impl = ROWS[name]
        args = (impl.to_row(params), x, dy, key)
        step = jax.jit(encoder.make_step(impl.forward(cfg, False))).lower(*args).compile()
        enqueue, total = _enqueue_and_total(step, args)
        latency = []
        for _ in range(9):
            jax.block_until_ready(step(*args))
            t0 = time.perf_counter()
            jax.block_until_ready(step(*args))
            latency.append((time.perf_counter() - t0) * 1e6)
        print(f"{config} {name}: enqueue {enqueue:.0f} us/step, {total:.0f} us/step with the wait, "
              f"one step alone {statistics.median(latency):.0f} us")


def custom_calls(n: int = 50) -> None:
    x = jnp.ones((8, 128), jnp.bfloat16)
    p = jnp.ones((128,), jnp.float32)

    def chain_jaxsub(x):
        for _ in range(n):
            x = jaxsub.ops.layer_norm(x, p, p)
        return x

    def chain_xla(x):
        for _ in range(n):
            m = x.astype(jnp.float32).mean(-1, keepdims=True)
            x = ((x - m) * 1.01).astype(x.dtype)
        return x

    for label, f in ((f"{n} jaxsub layer_norm calls", chain_jaxsub), (f"{n} XLA fusions", chain_xla)):
        g = jax.jit(f).lower(x).compile()
        enqueue, total = _enqueue_and_total(g, (x,))
        print(f"{label}: enqueue {enqueue:.0f} us, {total:.0f} us with the wait ({enqueue / n:.1f} us of host time each)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="b8s512-bf16", help="a bench.encoder config name")
    p.add_argument("--rows", default="xla,jaxsub", help="bench.encoder rows, comma-separated")
    a = p.parse_args(argv)
    steps(a.config, a.rows.split(","))
    custom_calls()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
