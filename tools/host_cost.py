"""Is the encoder training step host-bound? (GPU; on CPU the numbers say nothing.)

For bench.encoder rows (default: plain XLA and jaxsub's EncoderLayer; b8s512-bf16 step,
heuristic layouts) it prints the host time to enqueue a step (10 steps dispatched back to
back, before waiting) beside the time per step including the wait, and the latency of a
single step on an idle device. Then the host cost of a custom call: chains of 50 calls of
one jaxsub target each (layer norm, bias + GELU + dropout, the GEMM target, the fused
attention) on tiny inputs against 50 chained XLA fusions. The jaxsub targets cost more host
time inside XLA's command buffers than outside them: recording a custom call into a CUDA
graph is part of a step's enqueue (bench/NOTES.md, forty-fourth session).
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
    """Host time per call of chains of `n` calls of one jaxsub target each (tiny inputs),
    against a chain of XLA fusions: what a custom call adds to a step's enqueue time."""
    x = jnp.ones((8, 128), jnp.bfloat16)
    p = jnp.ones((128,), jnp.float32)
    pb = jnp.zeros((128,), jnp.bfloat16)
    w = jnp.full((128, 128), 0.01, jnp.bfloat16)
    q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
    key = jax.random.key(0)

    def chain(step):
        def f(x, *rest):
            for _ in range(n):
                x = step(x, *rest)
            return x
        return f

    def fusion(x):
        m = x.astype(jnp.float32).mean(-1, keepdims=True)
        return ((x - m) * 1.01).astype(x.dtype)

    chains = (
        ("jaxsub layer_norm", chain(lambda x: jaxsub.ops.layer_norm(x, p, p)), (x,)),
        ("jaxsub bias_gelu_dropout", chain(lambda x, k: jaxsub.ops.bias_gelu_dropout(x, pb, rate=0.1, key=k)),
         (x, key)),
        ("jaxsub gemm", chain(lambda x: jaxsub.ops.gemm.gemm(x, w)), (x,)),
        ("jaxsub attention", chain(lambda q: jaxsub.ops.attention(q, q, q, implementation="fused")), (q,)),
        ("XLA fusions", chain(fusion), (x,)),
    )
    for label, f, args in chains:
        g = jax.jit(f).lower(*args).compile()
        enqueue, total = _enqueue_and_total(g, args)
        calls = "" if label.startswith("XLA") else " calls"
        print(f"{n} {label}{calls}: enqueue {enqueue:.0f} us, {total:.0f} us with the wait "
              f"({enqueue / n:.1f} us of host time each)")


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
