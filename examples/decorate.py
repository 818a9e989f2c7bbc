"""`@jaxsub.optimize` on a hand-written jnp encoder layer.

The layer below is ordinary JAX: einsums, a softmax, `jax.random.bernoulli` dropout, a
layer norm written out by hand. Decorating it with `jaxsub.optimize` makes jaxsub trace
it, find the attention, bias + dropout + residual + layer norm and bias + GELU + dropout
patterns, and run them as fused kernels; everything else runs as written.
`jaxsub.explain` prints what was matched (and what was left alone, and why).

This script prints that report, checks the decorated layer against the undecorated one
(`encoder_layer.__wrapped__`) without dropout — output and gradients — and runs one
training-style gradient with dropout. Runs on CPU in seconds:

    python examples/decorate.py              # f32 (default)
    python examples/decorate.py --dtype bf16

Dropout through a fused kernel uses the same key but jaxsub's own random bits, so with
dropout on, the two versions agree in distribution, not bit for bit.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxsub
from jaxsub.testing import assert_close

RATE = 0.1


def layer_norm(x, scale, bias, eps=1e-5):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def dropout(x, key, deterministic):
    if deterministic:
        return x
    keep = jax.random.bernoulli(key, 1.0 - RATE, x.shape)
    return jnp.where(keep, x / (1.0 - RATE), 0.0).astype(x.dtype)


@jaxsub.optimize
def encoder_layer(p, x, key, deterministic=False):
    """BERT's post-LN encoder layer. x [B, S, E]; p["wqkv"] [E, 3, H, D]."""
    k_attn, k_out, k_ffn, k_res = jax.random.split(key, 4)
    qkv = jnp.einsum("bse,ethd->bsthd", x, p["wqkv"]) + p["bqkv"]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(q.shape[-1]))
    probs = dropout(jax.nn.softmax(scores, axis=-1), k_attn, deterministic)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    h = jnp.einsum("bshd,hde->bse", attn, p["wo"]) + p["bo"]
    x = layer_norm(x + dropout(h, k_out, deterministic), p["ln1_scale"], p["ln1_bias"])
    f = dropout(jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False), k_ffn, deterministic)
    y = f @ p["w2"] + p["b2"]
    return layer_norm(x + dropout(y, k_res, deterministic), p["ln2_scale"], p["ln2_bias"])


def init(seed=0, hidden=128, heads=4, ffn=512, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    d = hidden // heads

    def w(*shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), dtype)

    def b(*shape):
        return jnp.asarray(0.1 * rng.standard_normal(shape), dtype)

    return {"wqkv": w(hidden, 3, heads, d, fan_in=hidden), "bqkv": b(3, heads, d),
            "wo": w(heads, d, hidden, fan_in=hidden), "bo": b(hidden),
            "ln1_scale": 1.0 + b(hidden), "ln1_bias": b(hidden),
            "w1": w(hidden, ffn, fan_in=hidden), "b1": b(ffn), "w2": w(ffn, hidden, fan_in=ffn), "b2": b(hidden),
            "ln2_scale": 1.0 + b(hidden), "ln2_bias": b(hidden)}


def compare(dtype=jnp.float32, batch=2, seq=64, seed=0, *, fast=encoder_layer,
            plain=encoder_layer.__wrapped__) -> dict:
    """The decorated layer against the undecorated one without dropout; returns the
    explain report, the largest errors and whether all are within tolerance."""
    params = init(seed, dtype=dtype)
    hidden, ffn = params["w1"].shape
    rng = np.random.default_rng(seed + 1)
    x = jnp.asarray(rng.standard_normal((batch, seq, hidden)), dtype)
    dy = jnp.asarray(rng.standard_normal((batch, seq, hidden)), dtype)
    key = jax.random.key(seed + 2)

    def out_and_grads(f):
        def run(p, x):
            y, vjp = jax.vjp(lambda p, x: f(p, x, key, deterministic=True), p, x)
            return (y, *vjp(dy))
        return jax.jit(run)(params, x)

    got, want = out_and_grads(fast), out_and_grads(plain)
    errors, failures = {}, []
    names = ["y", "dparams", "dx"]
    for name, g, w in zip(names, got, want):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(w)):
            what = name + jax.tree_util.keystr(path)
            diff = np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))
            errors[what] = float(diff.max())
            try:
                # As tests/test_flax.py: the layer chains reductions over E and F (and
                # the parameter gradients over every token).
                red = hidden * ffn if name == "y" else batch * seq * hidden * ffn
                assert_close(a, b, dtype, red, grad=name != "y", what=what)
            except AssertionError as e:
                failures.append(str(e))
    return {"explain": jaxsub.explain(fast, params, x, key), "errors": errors, "failures": failures,
            "ok": not failures, "params": params, "x": x, "key": key}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="jaxsub.optimize on a hand-written encoder layer")
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    args = p.parse_args(argv)
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]

    result = compare(dtype)
    print(result["explain"])
    worst = max(result["errors"], key=result["errors"].get)
    print(f"\nno dropout, decorated vs undecorated: largest difference {result['errors'][worst]:.2e} ({worst}); "
          f"{'numbers match' if result['ok'] else 'MISMATCH'} (jaxsub.testing tolerance, {args.dtype})")
    for failure in result["failures"]:
        print("  " + failure)

    # With dropout: a jitted gradient, as in training; the fused kernels show in the HLO.
    params, x, key = result["params"], result["x"], result["key"]

    def loss(p):
        return jnp.mean(encoder_layer(p, x, key).astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss))
    hlo = grad.lower(params).as_text()
    fused = sorted({t.split("(")[0] for t in hlo.split("@")[1:] if t.startswith("jaxsub_")})
    g = grad(params)
    finite = all(bool(jnp.isfinite(leaf.astype(jnp.float32)).all()) for leaf in jax.tree.leaves(g))
    print(f"with dropout {RATE}: gradient finite: {finite}; fused targets in the HLO: {', '.join(fused) or 'none'}")
    return 0 if result["ok"] and finite else 1


if __name__ == "__main__":
    sys.exit(main())
