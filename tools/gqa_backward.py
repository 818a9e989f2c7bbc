"""Grouped-query attention's fused backward both ways: the grouped kernels (k and v with
their own heads) against k and v repeated to q's heads (`jaxsub.ops.attn`,
GROUPED_BWD_MIN_BLOCKS). Slope time of one fwd+bwd application (bf16, dropout 0.1), the two
ways alternated twice, per shape; for the first shape also the kernels of each (with PDL a
kernel launched early counts its wait, so the sums exceed the wall time). GPU only.
Usage: python3 tools/gqa_backward.py [indices of SHAPES, e.g. 0,4]"""

import sys

import jax
import jax.numpy as jnp

import jaxsub
from bench import timing
from jaxsub.ops import attn

# (B, S, H, H_kv, D, causal)
SHAPES = [(2, 2048, 32, 8, 128, True), (2, 2048, 32, 8, 128, False), (8, 512, 16, 4, 64, False),
          (1, 4096, 32, 8, 128, True), (2, 2048, 32, 1, 128, True), (4, 2048, 32, 8, 64, True),
          (16, 1024, 32, 8, 128, True), (16, 2048, 32, 8, 128, True)]
WAYS = (("grouped", 0), ("repeated", 1 << 40))


def main(argv: list[str]) -> int:
    if jax.default_backend() != "gpu":
        sys.exit("gqa_backward: needs a GPU")
    only = {int(x) for x in argv[0].split(",")} if argv else None
    for si, (b, s, h, h_kv, d, causal) in enumerate(SHAPES):
        if only is not None and si not in only:
            continue
        k2 = 4 if b * s * h * d < 2 ** 25 else 2
        bf = jnp.bfloat16
        sets, keys, cots = timing.random_sets((((b, s, h, d), bf), ((b, s, h_kv, d), bf), ((b, s, h_kv, d), bf)),
                                              ((b, s, h, d), bf), k2, si)
        # One function per way: apply_k caches its jitted function per apply, and the way
        # is read when it traces.
        applies = {way: (lambda a, key: jaxsub.ops.attention(*a, causal=causal, dropout_rate=0.1, key=key,
                                                             implementation="fused")) for way, _ in WAYS}
        fns = {}
        for way, min_blocks in WAYS:
            attn.GROUPED_BWD_MIN_BLOCKS = min_blocks
            fns[way] = timing.apply_k(applies[way], "fwd+bwd")
            for n in (1, k2 // 2, k2):
                jax.block_until_ready(fns[way](sets[:n], keys[:n], cots[:n]))
        us = {way: [] for way in fns}
        for _ in range(2):
            for way, fn in fns.items():
                t = timing.slope_time(lambda n: (fn, (sets[:n], keys[:n], cots[:n])), k2 // 2, k2, repeats=5)
                us[way].append(t.per_call_s * 1e6)
        blocks = b * h_kv * -(-s // 64)
        print(f"B{b} S{s} H{h}/{h_kv} D{d} {'causal' if causal else 'full'} blocks {blocks}: "
              + " ".join(f"{way} {' '.join(f'{x:.1f}' for x in xs)}" for way, xs in us.items())
              + f" us -> grouped / repeated {min(us['grouped']) / min(us['repeated']):.3f}", flush=True)
        if si == 0:
            for way, min_blocks in WAYS:
                attn.GROUPED_BWD_MIN_BLOCKS = min_blocks
                total, per = timing.kernel_time_applications(applies[way], "fwd+bwd", sets, keys, cots, k2)
                if total is not None:
                    top = sorted(per.items(), key=lambda kv: -kv[1])[:6]
                    print(f"  {way} kernels {total:.1f} us: " + "; ".join(f"{n[:60]} {t:.1f}" for n, t in top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
