"""Runs each fused op once (after a warm-up call) at BERT-large sizes, bf16, so `ncu` can
profile the kernels in a small program (ncu cannot profile while XLA compiles a full
training step). Usage: ncu --kernel-name regex:'norm_|gelu_|column_sum' ... python3 tools/profile_ops.py
[rows|attention|softmax] (default rows: the normalization and GELU families; attention: the
fused attention forward and backward with dropout 0.1, B 8, S 512, H 16, D 64; softmax:
softmax_dropout forward and backward at [8, 16, 512, 512], dropout 0.1)."""

import sys

import jax
import jax.numpy as jnp

import jaxsub


def attention_cases():
    kq, kk, kv, kd = jax.random.split(jax.random.key(1), 4)
    q, k, v = (jax.random.normal(kk_, (8, 512, 16, 64), jnp.bfloat16) for kk_ in (kq, kk, kv))

    def attn(q, k, v):
        return jaxsub.ops.attention(q, k, v, dropout_rate=0.1, key=kd, implementation="fused")

    def fwd_bwd(q, k, v):
        y, vjp = jax.vjp(attn, q, k, v)
        return y, vjp(y)

    return [(jax.jit(fwd_bwd), (q, k, v))]


def row_cases():
    bf = jnp.bfloat16
    k = jax.random.split(jax.random.key(0), 8)
    x = jax.random.normal(k[0], (4096, 1024), bf)
    r = jax.random.normal(k[1], (4096, 1024), bf)
    s = 1 + 0.1 * jax.random.normal(k[2], (1024,), jnp.float32)
    b = 0.1 * jax.random.normal(k[3], (1024,), jnp.float32)
    h = jax.random.normal(k[4], (4096, 4096), bf)
    hb = 0.1 * jax.random.normal(k[5], (4096,), jnp.float32)
    key = k[6]

    def ln(x, s, b):
        return jaxsub.ops.layer_norm(x, s, b)

    def bdrln(x, b1, r, s, b):
        return jaxsub.ops.bias_dropout_residual_layer_norm(x, b1, r, s, b, rate=0.1, key=key)

    def gelu(h, hb):
        return jaxsub.ops.bias_gelu_dropout(h, hb, rate=0.1, key=key)

    def fwd_bwd(f, *args):
        y, vjp = jax.vjp(f, *args)
        return y, vjp(y)

    return [
        (jax.jit(ln), (x, s, b)),
        (jax.jit(lambda *a: fwd_bwd(ln, *a)), (x, s, b)),
        (jax.jit(lambda *a: fwd_bwd(bdrln, *a)), (x, b, r, s, b)),
        (jax.jit(lambda *a: fwd_bwd(gelu, *a)), (h, hb)),
    ]


def softmax_cases():
    k = jax.random.split(jax.random.key(2), 2)
    scores = jax.random.normal(k[0], (8, 16, 512, 512), jnp.bfloat16)

    def sd(x):
        return jaxsub.ops.softmax_dropout(x, scale=0.125, rate=0.1, key=k[1])

    def fwd_bwd(x):
        y, vjp = jax.vjp(sd, x)
        return y, vjp(y)

    return [(jax.jit(fwd_bwd), (scores,))]


def main():
    family = sys.argv[1] if len(sys.argv) > 1 else "rows"
    cases = {"rows": row_cases, "attention": attention_cases, "softmax": softmax_cases}[family]()
    for f, args in cases:
        jax.block_until_ready(f(*args))
    for f, args in cases:
        jax.block_until_ready(f(*args))


if __name__ == "__main__":
    main()
