"""How long `jaxsub.optimize` takes to trace and rewrite a 24-layer BERT-large model
(issue #4: under 1 s, XLA's compile excluded). Host time only, so any machine measures it;
exits 1 when the pass's own work ("match") reaches 1 s.

Run: `python -m bench.pass_time` (`--layers N`, `--repeats R`).

For the hand-written jnp layer of bench/layers.py with dropout 0.1, bf16, b8×s512, as a
training step (`jax.value_and_grad` of a scalar loss), two ways of stacking 24 layers:
`lax.scan` (the pass rewrites the scan body once) and a Python loop (24 unrolled layers,
the largest jaxpr a user would hand it). Timed: `jax.make_jaxpr` of the training step
without jaxsub (tracing alone), and with `jaxsub.optimize` on the loss (tracing the loss
to a jaxpr, matching, and evaluating the rewritten jaxpr under the step's trace: all the
pass adds before jit lowers and XLA compiles); "pass" is the difference. Inputs are
abstract (ShapeDtypeStruct), so nothing is allocated. Median of `--repeats` fresh
functions (each `optimize` starts with an empty cache). The pass's own work is also shown
apart: "match" = `Optimized.specialize` (trace the loss, build the graph, plan the
rewrites) minus tracing the loss alone. The optimized step can trace faster than the plain
one: the fused ops' custom_vjp backward is fewer equations than autodiff of the jnp ops.
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
from bench import layers


def _params(cfg: layers.Config):
    return jax.eval_shape(lambda: layers.init_params(cfg, 0))


def _stack_loss(cfg: layers.Config, unrolled: bool):
    def loss(p, x, key):
        if unrolled:
            keys = jax.random.split(key, cfg.layers)
            h = x
            for i in range(cfg.layers):
                h = layers.jnp_layer(jax.tree.map(lambda a: a[i], p), h, keys[i], cfg=cfg, deterministic=False)
        else:
            h = layers.jnp_stack(p, x, key, cfg=cfg, deterministic=False)
        return jnp.sum(h.astype(jnp.float32) ** 2)
    return loss


def trace_time(fn, args, grad: bool = True) -> float:
    start = time.perf_counter()
    jax.make_jaxpr(jax.value_and_grad(fn) if grad else fn)(*args)
    return time.perf_counter() - start


def specialize_time(fn, args) -> float:
    opt = jaxsub.optimize(fn, layouts="none")
    start = time.perf_counter()
    jax.make_jaxpr(lambda *a: (opt.specialize(a, {}), jnp.zeros(()))[1])(*args)
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pass_time", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    for name in ("layers", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    from bench import encoder

    cfg = dataclasses.replace(encoder.FULL.configs["b8s512-bf16"], layers=args.layers)
    params = _params(cfg)
    x = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.hidden), cfg.dtype)
    key = jax.random.key(0)
    print(f"{cfg.describe()}, training step, host: {jax.devices()[0].device_kind}")
    failed = False
    for name, unrolled in (("lax.scan", False), ("unrolled", True)):
        plain, optimized, fwd, spec = [], [], [], []
        for _ in range(args.repeats):
            loss = _stack_loss(cfg, unrolled)
            plain.append(trace_time(loss, (params, x, key)))
            optimized.append(trace_time(jaxsub.optimize(loss, layouts="none"), (params, x, key)))
            fwd.append(trace_time(loss, (params, x, key), grad=False))
            spec.append(specialize_time(loss, (params, x, key)))
        t_plain, t_opt = statistics.median(plain), statistics.median(optimized)
        match = statistics.median(spec) - statistics.median(fwd)
        print(f"  {name:9s} step trace: plain {t_plain:6.3f} s, with jaxsub.optimize {t_opt:6.3f} s; "
              f"match {match:6.3f} s {'(under 1 s)' if match < 1.0 else '(over the 1 s target)'}")
        failed |= match >= 1.0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
