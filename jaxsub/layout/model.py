"""The heuristic: a byte-count model of a GPU instead of timings.

time = bytes that must move / BANDWIDTH + matmul flops / MATMUL_RATE, forward and backward
together. Bytes count each tensor an operator reads or writes once per pass; a layout the
kernel or the matmul cannot use in place costs a *copy* (read + write, forward and again
for the cotangent in backward). The constants are an H200's (4.17 TB/s measured copy
bandwidth, about 600 TFLOP/s of dense bf16/fp16 matmul), but the model only ranks
candidates: its choices are what moves the fewest bytes, with the default winning ties.
It is what `layouts="heuristic"` (and "auto" without a GPU) uses; it knows nothing of
cache effects, kernel efficiency or what XLA fuses.

Copies assumed: the QKV matmul writes [B·S, 3E] rows (BS3HD) natively, other q/k/v layouts
cost one permutation of its output; the fused attention kernel reads and writes
[B,S,H,D] and takes q/k/v packed as BS3HD or 3BSHD in place (`attention_packed`), the
unfused path's batched matmuls [B,H,S,D] (other q/k/v layouts: slices, copied); an E- or F-wide matmul keeps the row order of its input
(BSE -> BSF, SBE -> SBF) and pays a copy to change it; the output projection contracts
(H, D) in place only from BSHD; row ops run in place unless dropout makes them transpose.
A row op's kernel configuration moves the same bytes as its default, so it costs the
same and the default, listed first, wins the tie (solver.shortest_configuration).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

BANDWIDTH = 4.17e12
MATMUL_RATE = {"bfloat16": 600e12, "float16": 600e12, "float32": 200e12}


def _seconds(nbytes: float, flops: float, dtype: str) -> float:
    return nbytes / BANDWIDTH + flops / MATMUL_RATE.get(dtype, 200e12)


def transpose(shape, dtype) -> float:
    """One copy of an array, forward and backward (read + write each)."""
    return _seconds(4 * math.prod(shape) * jnp.dtype(dtype).itemsize, 0.0, dtype)


def attention(b, s, h, d, itemsize, dtype, impl, copies) -> float:
    """Attention forward + backward; `copies` = [B,S,H,D]-sized arrays relaid out."""
    t = b * s * h * d
    bhss = b * h * s * s
    if impl == "fused":
        # fwd: read q,k,v, write o; bwd: read q,k,v,o,do, write dq,dk,dv, f32 dq accumulator.
        nbytes = 12 * t * itemsize + 2 * 4 * t
        flops = (4 + 10) * bhss * d        # backward recomputes QKᵀ (2.5x forward)
    else:
        # The [B,H,S,S] tensor: 4 passes forward (scores, softmax in/out, P·V), 7 backward.
        nbytes = 11 * bhss * itemsize + 12 * t * itemsize
        flops = (4 + 8) * bhss * d
    return _seconds(nbytes + 4 * copies * t * itemsize, flops, dtype)


def _order(axes: str) -> str:
    return "B" if axes.index("B") < axes.index("S") else "S"


def encoder_stage(problem, i: int, cand) -> float:
    from jaxsub.layout.encoder import STAGE_NAMES
    from jaxsub.layout.problem import parse_config, parse_label

    s = problem.spec
    dims = s.dims
    b, seq, e, h, d, f = (dims[c] for c in "BSEHDF")
    z = jnp.dtype(s.dtype).itemsize
    tok = b * seq
    te, tf = tok * e, tok * f
    src, dst = parse_label(cand.in_layout), parse_label(cand.out_layout)
    dropout = s.training and s.dropout_rate > 0
    name = STAGE_NAMES[i]
    copies = 0       # elements copied (each: read + write, forward and backward)
    if name == "qkv":
        nbytes, flops = (9 * te + 9 * e * e) * z, 18 * tok * e * e
        if s.pre_layer_norm:
            nbytes += 5 * te * z
        copies = 0 if dst["qkv"] == "BS3HD" else 3 * te
    elif name == "attention":
        impl = parse_config(cand.config).get("impl", "unfused")
        native = "BSHD" if impl == "fused" else "BHSD"
        in_place = ("BS3HD", "3BSHD") if impl == "fused" else ("3BHSD",)
        n = 0 if src["qkv"] in in_place else 3
        n += 0 if dst["ctx"] == native else 1
        return attention(b, seq, h, d, z, s.dtype, impl, n)
    elif name == "out_proj":
        nbytes, flops = (6 * te + 3 * e * e) * z, 6 * tok * e * e
        copies = te if (src["ctx"] == "BHSD" or dst["proj"] == "SBE") else 0
    elif name == "bdrln1":
        lay = src["proj"]
        nbytes = (8 * te + (7 * te if s.pre_layer_norm else 0)) * z
        flops = 0
        copies = 0 if lay == "BSE" else te * (3 if dropout else 1)
    elif name == "ffn_in":
        nbytes, flops = (3 * te + 2 * tf + 3 * e * f) * z, 6 * tok * e * f
        copies = tf if _order(src["h"]) != _order(dst["ffn"]) else 0
    elif name == "bias_gelu_dropout":
        nbytes, flops = 5 * tf * z, 0
        copies = 2 * tf if (dropout and src["ffn"] == "SBF") else 0
    elif name == "ffn_out":
        nbytes, flops = (3 * tf + 2 * te + 3 * e * f) * z, 6 * tok * e * f
        copies = te if _order(src["ffn"]) != _order(dst["out"]) else 0
    else:  # bdrln2
        out, res = src["out"], src["h"]
        nbytes, flops = 8 * te * z, 0
        if dropout and out == "SBE":
            copies = te * (1 + (res != "BSE"))
        else:
            copies = te * ((res != out) + (out == "SBE"))
    return _seconds(nbytes + 4 * copies * z, flops, s.dtype)
