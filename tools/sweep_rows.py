"""Kernel time of the row ops' CUDA kernels at BERT-large sizes for a list of kernel
configurations (`kernel_config`: threads per block, elements per thread), to check the
defaults in cuda/norm.cu and cuda/gelu.cu against their neighbours. Kernel time per
application from a profiler trace (bench/trace.py) over 8 distinct input sets (more
than the L2). GPU only. Usage: python3 tools/sweep_rows.py [bf16|fp16]"""

import sys

import jax
import jax.numpy as jnp

import jaxsub
from bench import timing, trace

DTYPE = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[sys.argv[1] if len(sys.argv) > 1 else "bf16"]
K = 8
CONFIGS = [None] + [dict(bwd_elems=e) for e in (4, 16)] + [dict(bwd_threads=t) for t in (128, 256, 1024)] \
    + [dict(fwd_elems=e) for e in (8, 16)] + [dict(fwd_threads=t) for t in (128, 512)]


def ops(key, kc):
    return {
        "layer_norm": (1024, 3, lambda a: jaxsub.ops.layer_norm(*a, kernel_config=kc)),
        "bdrln": (1024, 5, lambda a: jaxsub.ops.bias_dropout_residual_layer_norm(
            *a, rate=0.1, key=key, kernel_config=kc)),
        "bias_gelu_dropout": (4096, 2, lambda a: jaxsub.ops.bias_gelu_dropout(
            *a, rate=0.1, key=key, kernel_config=kc)),
    }


def main():
    if jax.default_backend() != "gpu":
        sys.exit("sweep_rows: needs a GPU (kernel times come from the device trace)")
    rows = 8 * 512
    key = jax.random.key(3)
    print(f"{'op':18} {'config':22} {'fwd us':>8} {'bwd us':>8}  (kernel time per application, {DTYPE.__name__})")
    for name in ("layer_norm", "bdrln", "bias_gelu_dropout"):
        cols, nargs, _ = ops(key, None)[name]
        specs = [((rows, cols), DTYPE) if i in (0, 2) and nargs == 5 or i == 0 else ((cols,), DTYPE)
                 for i in range(nargs)]
        sets, _, cots = timing.random_sets(specs, ((rows, cols), DTYPE), K, seed=1)
        for kc in CONFIGS:
            f = ops(key, kc)[name][2]

            def fwd(sets):
                return [f(s) for s in sets]

            def fwd_bwd(sets, cots):
                out = []
                for s, c in zip(sets, cots):
                    y, vjp = jax.vjp(lambda *a: f(a), *s)
                    out.append((y, vjp(c)))
                return out

            t_f, _ = trace.per_application(jax.jit(fwd), (sets,), K)
            t_fb, _ = trace.per_application(jax.jit(fwd_bwd), (sets, cots), K)
            print(f"{name:18} {str(kc or 'default'):22} {t_f:8.2f} {t_fb - t_f:8.2f}", flush=True)


if __name__ == "__main__":
    main()
