"""Does a row's step time depend on the row timed before it? (GPU)

Compiles the encoder benchmark's step for the given rows of one config (heuristic
layouts) and times them twice by the slope method (bench/encoder.py's n1 and n2 steps):
interleaved sample by sample, the way bench.encoder timed rows until the sixteenth
session, and each row alone in its own block, as bench.encoder does now (`_time_rows`:
two passes, the mean). The H200 runs at its power limit under
this load and its SM clock moves with what ran just before, so interleaved times depend
on the order: at b96×s128 the same compiled `optimize(jnp)` step read 1.87 ms right after
plain XLA and 1.98 ms after another jaxsub row, 1.97-1.99 ms alone (bench/NOTES.md,
sixteenth session). A row named twice is compiled twice, so the table also shows how
much one program's time moves with its position alone.

Usage: python3 tools/order_effect.py [--config b96s128-bf16] [--rows xla,opt-jnp,opt-jnp,jaxsub]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax

from bench import encoder, timing
from bench.layers import ROWS
from jaxsub import _timing


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="b96s128-bf16", help="a bench.encoder config name")
    p.add_argument("--rows", default="xla,opt-jnp,opt-jnp,jaxsub", help="bench.encoder rows, comma-separated")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("order_effect: needs a GPU (the effect is the card's clock)")
    size = encoder.FULL
    cfg = dataclasses.replace(size.configs[a.config], layouts="heuristic")
    n1, n2 = size.stack_steps if cfg.stack else size.steps
    params, x, dy, key = encoder.make_inputs(cfg, seed=0)
    names = a.rows.split(",")
    programs = []
    for name in names:
        impl = ROWS[name]
        args = (impl.to_row(params), x, dy, key)
        compiled = jax.jit(encoder.make_step(impl.forward(cfg, False))).lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        programs.append((compiled, args))

    def per_step(t1, t2):
        return _timing.slope(t1, t2, n1, n2)[0] * 1e3

    calls = [(encoder._repeat(c, n), args) for n in (n1, n2) for c, args in programs]
    for trial in range(2):
        t = timing.median_times(calls, repeats=a.repeats, warmup=size.warmup)
        print(f"interleaved, trial {trial}: " + "  ".join(
            f"{i}:{name} {per_step(t[i], t[len(names) + i]):.3f}" for i, name in enumerate(names)), flush=True)
    # Alone: the bench's own method (each row in its block, two passes).
    rows = [{} for _ in programs]
    encoder._time_rows([(r, c, args) for r, (c, args) in zip(rows, programs)], n1, n2,
                       dataclasses.replace(size, repeats=a.repeats))
    print("alone: " + "  ".join(f"{i}:{name} " + (f"{r['ms']:.3f}" if r.get("ms") else r.get("status", "?"))
                                 for i, (name, r) in enumerate(zip(names, rows))),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
