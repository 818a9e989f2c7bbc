"""Runs every CUDA kernel of the op families once, fwd and bwd, at odd and vector-aligned
sizes, with dropout, and compares with the CPU handlers. Meant to run under
`compute-sanitizer` (memcheck, racecheck): small sizes, one pass. Exits non-zero on a
mismatch."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxsub
from jaxsub.testing import assert_close

CPU = jax.devices("cpu")[0]


def ops(x, key, p32):
    n = x.shape[-1]
    pdt = jnp.float32 if p32 else x.dtype
    k1, k2, k3, k4 = jax.random.split(jax.random.key(7), 4)
    scale = (1 + 0.1 * jax.random.normal(k1, (n,))).astype(pdt)
    bias = (0.1 * jax.random.normal(k2, (n,))).astype(pdt)
    res = jax.random.normal(k3, x.shape).astype(x.dtype)
    b2 = (0.1 * jax.random.normal(k4, (n,))).astype(pdt)

    def f(x, scale, bias, res, b2):
        a = jaxsub.ops.layer_norm(x, scale, bias)
        b = jaxsub.ops.bias_dropout_residual_layer_norm(x, b2, res, scale, bias, rate=0.1, key=key)
        c = jaxsub.ops.bias_gelu_dropout(x, b2, rate=0.1, key=key)
        return (a.astype(jnp.float32).sum() + b.astype(jnp.float32).sum() * 0.5
                + (c.astype(jnp.float32) ** 2).sum() * 0.1)

    return f, (x, scale, bias, res, b2)


def main():
    failures = 0
    key = jax.random.key(3)
    for dtype in (jnp.bfloat16, jnp.float32):
        for rows, n in ((3, 1), (5, 130), (9, 1024), (3, 4096), (2, 6000)):
            for p32 in (True, False):
                x = jax.random.normal(jax.random.key(rows * n), (rows, n)).astype(dtype)
                f, args = ops(x, key, p32)
                g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4)))
                try:
                    out_gpu = jax.block_until_ready(g(*args))
                    out_cpu = g(*jax.device_put(args, CPU))
                    for a, b in zip(jax.tree.leaves(out_gpu), jax.tree.leaves(out_cpu)):
                        assert_close(np.asarray(a), np.asarray(b), dtype, reduction=max(rows, n), grad=True,
                                     what=f"{jnp.dtype(dtype).name} [{rows},{n}] p32={p32}")
                except (AssertionError, jax.errors.JaxRuntimeError) as e:
                    failures += 1
                    print("FAILED", jnp.dtype(dtype).name, (rows, n), f"p32={p32}:", str(e).splitlines()[0][:400])
    print("sanitize_ops:", "FAILED" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
