"""Kernel time of the fused attention (forward and backward, dropout 0.1, bf16, B 8,
S 512, D 64) against the number of heads, i.e. the size of the grid: does a partly
filled last wave of blocks cost a whole wave? (bench/NOTES.md, fifteenth session: no, the
backward's time is linear in its blocks.) GPU only.
Usage: python3 tools/attention_waves.py [12,16,18,20,24]"""

import sys

import jax
import jax.numpy as jnp

import jaxsub
from bench import trace

B, S, D = 8, 512, 64


def main(argv: list[str]) -> int:
    if jax.default_backend() != "gpu":
        sys.exit("attention_waves: needs a GPU (kernel times come from the device trace)")
    heads = [int(h) for h in (argv[0] if argv else "12,16,18,20,24").split(",")]
    for h in heads:
        ks = jax.random.split(jax.random.key(h), 5)
        q, k, v, do = (jax.random.normal(kk, (B, S, h, D), jnp.bfloat16) for kk in ks[:4])

        def f(q, k, v, do, key):
            y, vjp = jax.vjp(lambda q, k, v: jaxsub.ops.attention(
                q, k, v, dropout_rate=0.1, key=key, implementation="fused"), q, k, v)
            return y, vjp(do)

        times = trace.kernel_times(jax.jit(f), (q, k, v, do, ks[4]), repeats=20)
        bwd = sum(t for n, t in times.items() if "attention_bwd" in n)
        fwd = sum(t for n, t in times.items() if "attention_fwd" in n)
        blocks = B * h * (S // 64)  # the backward's grid: key blocks of 64 per (b, h)
        print(f"H {h:3d}  blocks {blocks:5d}  fwd {fwd:7.1f} us  bwd {bwd:7.1f} us  "
              f"bwd per 1024 blocks {bwd * 1024 / blocks:7.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
