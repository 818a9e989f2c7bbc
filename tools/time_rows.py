"""Kernel time of the row ops' CUDA kernels at their default configurations, at the b8×s512
and b96×s128 layers' row counts (4096 and 12288), bf16, dropout 0.1: layer_norm and BDRLN
[R, 1024] (BDRLN also as `bdrln_pair`, the two-cotangent backward), bias_gelu_dropout
[R, 4096]; softmax_dropout at those layers' score shapes, [8·16·512, 512] and
[96·16·128, 128] (scale 1/8). Kernel µs per application from a profiler trace
(bench/trace.py) over 4 distinct input sets (bench/timing.py's `random_sets` and
`apply_k`); one line per op and size with the forward, the backward (fwd+bwd minus fwd)
and every kernel of the fwd+bwd program. GPU only.

To compare builds, run it once per build in alternating processes (the first argument
is a label printed on each line): `python3 tools/time_rows.py main layer_norm,bdrln`.
Usage: python3 tools/time_rows.py LABEL [op,op,...]"""

import sys

import jax
import jax.numpy as jnp

import jaxsub
from bench import timing, trace
from jaxsub.ops import norm

K = 4
ROWS = (4096, 12288)


def ops():
    """op -> ((rows, columns) per size, argument count, apply(args, key)); bdrln_pair's two
    outputs are summed as y1 + 0.5 y2, so its backward gets the two cotangents (c, 0.5 c)."""
    def pair(a, key):
        y1, y2 = norm.bdrln_pair(*a, rate=0.1, key=key)
        return y1 + 0.5 * y2

    layer = lambda cols: tuple((rows, cols) for rows in ROWS)  # noqa: E731
    return {
        "layer_norm": (layer(1024), 3, lambda a, key: jaxsub.ops.layer_norm(*a)),
        "bdrln": (layer(1024), 5, lambda a, key: jaxsub.ops.bias_dropout_residual_layer_norm(*a, rate=0.1, key=key)),
        "bdrln_pair": (layer(1024), 5, pair),
        "gelu": (layer(4096), 2, lambda a, key: jaxsub.ops.bias_gelu_dropout(*a, rate=0.1, key=key)),
        "softmax": (((8 * 16 * 512, 512), (96 * 16 * 128, 128)), 1,
                    lambda a, key: jaxsub.ops.softmax_dropout(a[0], scale=0.125, rate=0.1, key=key)),
    }


def main(argv: list[str]) -> int:
    if jax.default_backend() != "gpu":
        sys.exit("time_rows: needs a GPU (kernel times come from the device trace)")
    label = argv[0] if argv else "-"
    table = ops()
    want = argv[1].split(",") if len(argv) > 1 else list(table)
    for size in range(len(ROWS)):
        for name in want:
            sizes, nargs, apply = table[name]
            rows, cols = sizes[size]
            # x (and the BDRLN residual) [rows, cols]; bias, scale, ln_bias [cols].
            specs = [((rows, cols), jnp.bfloat16) if i == 0 or (i == 2 and nargs == 5) else ((cols,), jnp.bfloat16)
                     for i in range(nargs)]
            data = timing.random_sets(specs, ((rows, cols), jnp.bfloat16), K, seed=1)
            t_f, _ = trace.per_application(timing.apply_k(apply, "fwd"), data, K, repeats=5)
            t_fb, kernels = trace.per_application(timing.apply_k(apply, "fwd+bwd"), data, K, repeats=5)
            parts = "  ".join(f"{n.split('<')[0].split('::')[-1][:18]}={t:.2f}" for n, t in kernels.items() if t > 0.3)
            print(f"{label:6} {name:11} rows {rows:6d} fwd {t_f:7.2f} bwd {t_fb - t_f:7.2f}  [{parts}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
