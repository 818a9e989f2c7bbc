"""Which forms of a projection's bias does XLA fold into the cuBLAS GEMM's epilogue? (GPU)

Compiles the gradient of sum(y² · dy) for y = x·W + bias at the b8×s512 QKV projection's
shapes (x [8, 512, 1024], W [1024, 3, 16, 64], bf16), with the bias given in several
forms, and prints for each the epilogues of the compiled cuBLAS calls ("BIAS" when the
add rides in the GEMM) and the fusions that write the projection's output. On the H200
(jax 0.11.2) only a bias that is a parameter of the jitted function was folded; stacked,
concatenated, scaled or barrier-wrapped ones were a separate add (bench/NOTES.md,
"Packed projections"); three products of x get it only when barriers keep them apart
(NOTES, "Seventeenth session"). On CPU nothing is a cuBLAS call: the lists are empty.

Usage: python3 tools/bias_epilogue.py [--small]
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp


def forms(h: int, d: int):
    """name -> y(x, [w_q, w_k, w_v], [b_q, b_k, b_v], b_packed)."""
    def proj(x, w):
        return jnp.einsum("bse,ethd->bsthd", x, jnp.stack(w, 1))

    def one(x, w):
        return jnp.einsum("bse,ehd->bshd", x, w)

    def vec(b):
        return jnp.concatenate([bi.reshape(-1) for bi in b]).reshape(3, h, d)

    return {
        "parameter [3, H, D]": lambda x, w, b, bp: proj(x, w) + bp,
        "stack of three [H, D]": lambda x, w, b, bp: proj(x, w) + jnp.stack(b, 0),
        "concatenated vector": lambda x, w, b, bp: proj(x, w) + vec(b),
        "parameter * 1.5": lambda x, w, b, bp: proj(x, w) + bp * 1.5,
        "stack behind a barrier": lambda x, w, b, bp: proj(x, w) + jax.lax.optimization_barrier(jnp.stack(b, 0)),
        # Three products of x (ops.attention_projected's forward): as written, XLA's dot
        # merger joins them into one GEMM and adds the biases after it; each (x, W_i) behind
        # a barrier, they stay apart and each [H, D] parameter bias is folded.
        "three products": lambda x, w, b, bp: tuple(one(x, wi) + bi for wi, bi in zip(w, b)),
        "three products, barriers": lambda x, w, b, bp: tuple(
            one(*((x, wi) if i == 0 else jax.lax.optimization_barrier((x, wi)))) + bi
            for i, (wi, bi) in enumerate(zip(w, b))),
    }


def main(argv: list[str]) -> int:
    bsz, s, e, h, d = (2, 8, 32, 2, 16) if "--small" in argv else (8, 512, 1024, 16, 64)
    bf = jnp.bfloat16
    x = jnp.ones((bsz, s, e), bf)
    w = [jnp.ones((e, h, d), bf) for _ in range(3)]
    b = [jnp.ones((h, d), bf) for _ in range(3)]
    bp = jnp.ones((3, h, d), bf)
    dy = jnp.ones((bsz, s, 3, h, d), jnp.float32)
    out = re.compile(r"\s+(ROOT )?(%\S+) = \S*bf16\[(" + f"{bsz},{s},3,{h},{d}|{bsz * s},{3 * h * d}" + r")\]")
    for name, f in forms(h, d).items():
        def loss(x, w, b, bp, dy, f=f):
            y = f(x, w, b, bp)
            y = jnp.stack(y, axis=2) if isinstance(y, tuple) else y
            return jnp.sum(jnp.square(y.astype(jnp.float32)) * dy)

        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, w, b, bp, dy).compile().as_text()
        epilogues = re.findall(r'"epilogue":"([A-Z_]+)"', text)
        writers = [m.group(2) for line in text.splitlines() if (m := out.match(line))
                   and ("fusion(" in line or "custom-call(" in line)]
        print(f"{name:24s} epilogues {epilogues}  writers of y {writers}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
