"""What the scan over layers costs: a stack's training step scanned against unrolled (GPU).

For a stack config of bench.encoder (default: the 24-layer b8×s512 bf16 stack, heuristic
layouts) it times one training step (value and gradients, as the encoder benchmark's) of
four forms: jaxsub's Encoder under nn.scan (the benchmark's row f), the same layers as a
Python loop of EncoderLayer (what `Encoder(scan_layers=False)` runs), plain XLA's jnp layer
under lax.scan (row a) and the same as a Python loop. Each form: the compile time, then
the slope between the medians of five 2-step and five 6-step samples. The loop forms slice
each layer's parameters from the same stacked tree. Dropout keys differ between jaxsub's
scan (Flax splits them) and its loop, so their losses differ; plain XLA's two forms draw
the same masks.

Usage: python3 tools/scan_cost.py [--config stack24-b8s512-bf16] [--rows jaxsub-loop,...];
the small stack config (small-stack2-b2s64-bf16) runs on CPU, where the times say nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax

from bench import encoder, layers, timing
from bench.layers import ROWS, jnp_layer
from jaxsub import _timing
from jaxsub.flax import EncoderLayer

FORMS = ("jaxsub-loop", "jaxsub-scan", "xla-loop", "xla-scan")


def _forms(cfg):
    one = dataclasses.replace(cfg, layers=1)
    layer = EncoderLayer(layouts=cfg.layouts, **layers._module_fields(one))

    def at(p, i):
        return jax.tree.map(lambda a: a[i], p)

    def xla_loop(p, x, key):
        keys = jax.random.split(key, cfg.layers)
        for i in range(cfg.layers):
            x = jnp_layer(at(p, i), x, keys[i], cfg=one, deterministic=False)
        return x

    def jaxsub_loop(p, x, key):
        keys = jax.random.split(key, cfg.layers)
        for i in range(cfg.layers):
            x = layer.apply({"params": at(p, i)}, x, deterministic=False, rngs={"dropout": keys[i]})
        return x

    return {"jaxsub-loop": (jaxsub_loop, ROWS["jaxsub"].to_row),
            "jaxsub-scan": (ROWS["jaxsub"].forward(cfg, False), ROWS["jaxsub"].to_row),
            "xla-loop": (xla_loop, ROWS["xla"].to_row),
            "xla-scan": (ROWS["xla"].forward(cfg, False), ROWS["xla"].to_row)}


def _ms_per_step(step, args) -> float:
    """The encoder benchmark's slope: 2- and 6-step samples alternating, five of each."""
    t2, t6 = timing.median_times([(encoder._repeat(step, 2), args), (encoder._repeat(step, 6), args)],
                                 repeats=5, warmup=1)
    return _timing.slope(t2, t6, 2, 6)[0] * 1e3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="stack24-b8s512-bf16")
    parser.add_argument("--rows", default=",".join(FORMS))
    args = parser.parse_args(argv)
    sizes = {**encoder.FULL.configs, **encoder.SMALL.configs}
    cfg = dataclasses.replace(sizes[args.config], layouts="heuristic")
    if not cfg.stack:
        parser.error(f"{args.config} is not a stack config")
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in FORMS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {FORMS}")
    params, x, dy, key = encoder.make_inputs(cfg, seed=0)
    forms = _forms(cfg)
    for name in rows:
        f, to_row = forms[name]
        step_args = (to_row(params), x, dy, key)
        t0 = time.perf_counter()
        step = jax.jit(encoder.make_step(f)).lower(*step_args).compile()
        compile_s = time.perf_counter() - t0
        loss = float(step(*step_args)[0])
        print(f"{cfg.name} {name}: {_ms_per_step(step, step_args):.3f} ms per step, compile {compile_s:.0f} s, "
              f"loss {loss:.6g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
