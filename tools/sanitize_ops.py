"""Runs every CUDA kernel of the op families once, fwd and bwd, at odd and vector-aligned
sizes, with dropout, and compares with the CPU handlers (the row ops, also at the extreme
kernel configuration EXTREME; softmax_dropout; fused attention; the projected attention
forms with biases). Meant to run under `compute-sanitizer` (memcheck, racecheck): small
sizes, one pass. Exits non-zero on a mismatch. Arguments: the families to run,
`attention`, `projected` and/or `rows` (default all three); `attention:N` (or
`projected:N`) runs only the family's N-th case (from 0), and `--cases attention projected`
prints how many each has: on the H200 in the forty-second session compute-sanitizer itself
segfaulted after a few compiled cases in one process (now and then also at start-up or at
exit), so tools/gpu_check.sh runs one case per process."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxsub
from jaxsub.testing import assert_close

CPU = jax.devices("cpu")[0]
# The row ops' most threads per row and most rows per block (kernel_config).
EXTREME = dict(fwd_threads=1024, bwd_threads=1024, fwd_elems=4, bwd_elems=4)


def ops(x, key, p32, kernel_config=None):
    n = x.shape[-1]
    pdt = jnp.float32 if p32 else x.dtype
    k1, k2, k3, k4 = jax.random.split(jax.random.key(7), 4)
    scale = (1 + 0.1 * jax.random.normal(k1, (n,))).astype(pdt)
    bias = (0.1 * jax.random.normal(k2, (n,))).astype(pdt)
    res = jax.random.normal(k3, x.shape).astype(x.dtype)
    b2 = (0.1 * jax.random.normal(k4, (n,))).astype(pdt)

    def f(x, scale, bias, res, b2):
        kc = kernel_config
        a = jaxsub.ops.layer_norm(x, scale, bias, kernel_config=kc)
        b = jaxsub.ops.bias_dropout_residual_layer_norm(x, b2, res, scale, bias, rate=0.1, key=key, kernel_config=kc)
        c = jaxsub.ops.bias_gelu_dropout(x, b2, rate=0.1, key=key, kernel_config=kc)
        # Two consumers with different cotangents: the backward's second cotangent operand.
        d1, d2 = jaxsub.ops.norm.bdrln_pair(x, b2, res, scale, bias, rate=0.1, key=key, kernel_config=kc)
        e = jaxsub.ops.bias_add(x * x, b2)  # its gradient: the bias_grad kernel
        # The second outputs (h, x) and their own cotangents: the kernels' h result and dh operands.
        f1, f2 = jaxsub.ops.norm.bdrln_and_sum(x, b2, res, scale, bias, rate=0.1, key=key, kernel_config=kc)
        g1, g2 = jaxsub.ops.norm.layer_norm_and_input(x, scale, bias, kernel_config=kc)
        return (a.astype(jnp.float32).sum() + b.astype(jnp.float32).sum() * 0.5
                + (f1.astype(jnp.float32) ** 2).sum() * 0.15 + (f2.astype(jnp.float32) ** 2).sum() * 0.25
                + (g1.astype(jnp.float32) ** 2).sum() * 0.35 + (g2.astype(jnp.float32) ** 3).sum() * 0.1
                + (c.astype(jnp.float32) ** 2).sum() * 0.1
                + d1.astype(jnp.float32).sum() * 0.3 + (d2.astype(jnp.float32) ** 2).sum() * 0.2
                + (e.astype(jnp.float32) ** 2).sum() * 0.05)

    return f, (x, scale, bias, res, b2)


def attention_ops(shape, d, dtype, key, projected=False):
    """softmax_dropout on [B, H, Sq, Sk] scores, fused attention on [B, Sq, H, D], and packed
    self-attention (attention_packed) on the first min(Sq, Sk) positions; with `projected`,
    only dense_attention_packed and attention_projected with biases on those positions."""
    b, h, sq, sk = shape
    ks = jax.random.split(jax.random.key(sq * sk + d), 8)
    scores = jax.random.normal(ks[0], shape).astype(dtype)
    q = jax.random.normal(ks[1], (b, sq, h, d)).astype(dtype)
    k = jax.random.normal(ks[2], (b, sk, h, d)).astype(dtype)
    v = jax.random.normal(ks[3], (b, sk, h, d)).astype(dtype)
    pad = jnp.arange(sk)[None, :] < jnp.array([[sk], [max(sk // 2, 1)]])[:b]
    n, e = min(sq, sk), 48  # the packed and projected forms' sequence and input width
    x = jax.random.normal(ks[4], (b, n, e)).astype(dtype)
    w = (jax.random.normal(ks[5], (e, 3, h, d)) / np.sqrt(e)).astype(dtype)
    bias = (0.1 * jax.random.normal(ks[6], (3, h, d))).astype(dtype)
    cts = jax.random.normal(ks[7], (2, b, n, h, d)).astype(dtype)  # the projected outputs' cotangents

    def f(scores, q, k, v, x, w, bias):
        fused = jnp.dtype(dtype) != jnp.float32 and d in (32, 64, 128)
        if projected:  # (16-bit, D 32/64/128 only)
            # The backward's q/k/v column sums: the tile kernel's dK/dV sums, the dq-bias
            # kernel, the column sum of the partials.
            o5 = jaxsub.ops.dense_attention_packed(x, w, bias, mask=pad[:, :n], dropout_rate=0.1, key=key,
                                                   implementation="fused")
            o6 = jaxsub.ops.attention_projected(x, tuple(w[:, i] for i in range(3)), tuple(bias), causal=True,
                                                dropout_rate=0.1, key=key, implementation="fused")
            # (A linear loss, as the tests' cotangents: the square's large cotangents left
            # dW elements that cancel to ~0 with bf16 noise above the elementwise tolerance.)
            return sum((o.astype(jnp.float32) * c.astype(jnp.float32)).sum() for o, c in zip((o5, o6), cts))
        y = jaxsub.ops.softmax_dropout(scores, scale=0.3, mask=pad[:, None, None, :], causal=True, rate=0.1, key=key)
        total = (y.astype(jnp.float32) ** 2).sum()
        if fused:
            o = jaxsub.ops.attention(q, k, v, mask=pad, causal=True, dropout_rate=0.1, key=key,
                                     implementation="fused")
            o2 = jaxsub.ops.attention(q, k, v, dropout_rate=0.1, key=key, implementation="fused")  # plain path
            total = total + (o.astype(jnp.float32) ** 2).sum() + (o2.astype(jnp.float32) ** 2).sum()
            # Packed self-attention on the first min(Sq, Sk) positions, both packings.
            parts = (q[:, :n], k[:, :n], v[:, :n])
            o3 = jaxsub.ops.attention_packed(jnp.stack(parts, 2), axis=2, mask=pad[:, :n], dropout_rate=0.1, key=key,
                                             implementation="fused")
            o4 = jaxsub.ops.attention_packed(jnp.stack(parts, 0), axis=0, causal=True, dropout_rate=0.1, key=key,
                                             implementation="fused")
            total = total + (o3.astype(jnp.float32) ** 2).sum() + (o4.astype(jnp.float32) ** 2).sum()
        return total

    return f, (scores, q, k, v, x, w, bias)


def compare(f, args, dtype, reduction, what):
    g = jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args)))))
    try:
        out_gpu = jax.block_until_ready(g(*args))
        out_cpu = g(*jax.device_put(args, CPU))
        for a, b in zip(jax.tree.leaves(out_gpu), jax.tree.leaves(out_cpu)):
            assert_close(np.asarray(a), np.asarray(b), dtype, reduction=reduction, grad=True, what=what)
        return 0
    except (AssertionError, jax.errors.JaxRuntimeError) as e:
        print("FAILED", what + ":", str(e).splitlines()[0][:400])
        return 1


# Key and query tiles of 64: one, two, three and five tiles (the copy pipelines).
_SHAPES = (((2, 3, 5, 7), 32), ((2, 2, 70, 130), 64), ((1, 2, 129, 64), 128), ((1, 1, 300, 260), 64))
_FAMILIES = {"attention": (jnp.bfloat16, jnp.float32), "projected": (jnp.bfloat16,)}


def cases(family):
    """The (dtype, shape, d) cases of an attention family, in the order `family:N` counts."""
    return [(dtype, shape, d) for dtype in _FAMILIES[family] for shape, d in _SHAPES]


def main(families):
    if families[:1] == ["--cases"]:  # how many cases each family named has (for one per process)
        print(" ".join(str(len(cases(f))) for f in families[1:]))
        return 0
    failures = 0
    key = jax.random.key(3)
    for family in _FAMILIES:
        only = [int(f.split(":")[1]) for f in families if f.startswith(family + ":")]
        if family not in families and not only:
            continue
        for i, (dtype, shape, d) in enumerate(cases(family)):
            if only and i not in only:
                continue
            f, args = attention_ops(shape, d, dtype, key, projected=family == "projected")
            # The projected forms' weight gradients reduce over B·S rows of E-wide products.
            reduction = max(shape[-2:]) if family == "attention" else min(shape[-2:]) * args[4].shape[-1]
            failures += compare(f, args, dtype, reduction, f"{family} {jnp.dtype(dtype).name} {shape} d={d}")
    for dtype in (jnp.bfloat16, jnp.float32) if "rows" in families else ():
        for rows, n in ((3, 1), (5, 130), (9, 1024), (3, 4096), (2, 6000)):
            for p32, kc in ((True, None), (False, None), (True, EXTREME)):
                x = jax.random.normal(jax.random.key(rows * n), (rows, n)).astype(dtype)
                f, args = ops(x, key, p32, kc)
                failures += compare(f, args, dtype, max(rows, n),
                                    f"{jnp.dtype(dtype).name} [{rows},{n}] p32={p32} kernel_config={kc}")
    print("sanitize_ops:", "FAILED" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["attention", "projected", "rows"]))
