"""The BERT encoder layer (and 24-layer stack) in every form the encoder benchmark times.

All forms compute the same post-LN layer (BERT):

    h = LN(x + dropout(Attn(x) W_o + b_o));   y = LN(h + dropout(dropout(GELU(h W_1 + b_1)) W_2 + b_2))

or, for a config with `pre_ln` (GPT style; single layers only), the pre-LN layer with the
same parameters (LN₁ = "attention_norm", LN₂ = "mlp_norm"):

    h = x + dropout(Attn(LN₁(x)) W_o + b_o);   y = h + dropout(dropout(GELU(LN₂(h) W_1 + b_1)) W_2 + b_2)

with dropout on the attention probabilities too, exact (erf) GELU, LN epsilon 1e-5 (the
default of jaxsub's ops and layers; BERT's 1e-12 changes nothing measured here).

One parameter tree serves every form: jaxsub.flax.EncoderLayer's (`qkv` kernel
[E, 3, H, D] and bias [3, H, D], `out`, `attention_norm`, `mlp_in`, `mlp_out`,
`mlp_norm`); the hand-written jnp layer reads it directly, the plain-Flax layer gets it
through `to_flax_params` and hands its gradients back through `from_flax_params`. For a
stack every leaf gains a leading layer axis (jaxsub.flax.Encoder(scan_layers=True)'s
layout under params["layers"]["layer"]). Parameters are kept in the compute dtype, so no
row pays for casting master weights.

`ROWS` maps each benchmark row to a builder `Impl`: `forward(deterministic)` returns
`f(params, x, key) -> y`, and `to_row` / `from_row` convert parameters (and gradients)
between the shared tree and the row's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxsub
from jaxsub.flax import Encoder, EncoderLayer, ReferenceEncoderLayer, from_flax_params, to_flax_params

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    batch: int
    seq: int
    hidden: int
    heads: int
    ffn: int
    dtype: Any
    layers: int = 1          # > 1: a stack scanned over layers
    rate: float = 0.1
    eps: float = 1e-5
    layouts: str = "none"    # jaxsub rows' layouts= (issue #6): "none", "heuristic" or "auto"
    pre_ln: bool = False     # GPT's pre-LN layer instead of BERT's post-LN one (single layers)

    @property
    def stack(self) -> bool:
        return self.layers > 1

    def describe(self) -> str:
        what = f"{self.layers}-layer stack" if self.stack else ("pre-LN layer" if self.pre_ln else "layer")
        return (f"{what} B={self.batch} S={self.seq} E={self.hidden} H={self.heads} F={self.ffn} "
                f"{jnp.dtype(self.dtype).name}")

    def matmul_flops(self) -> float:
        """Matmul flops of one training step (fwd + bwd): 3 x the forward's, because the
        backward of every matmul is two matmuls of the same size (grad of each operand;
        the input gradient is taken too). Forward per layer, T = B*S tokens:
        QKV 2*T*E*3E + scores 2*B*S*S*E + probs*V 2*B*S*S*E + out 2*T*E*E + FFN 2 * 2*T*E*F."""
        t, e, f, s = self.batch * self.seq, self.hidden, self.ffn, self.seq
        fwd = 2 * t * e * 3 * e + 4 * self.batch * s * s * e + 2 * t * e * e + 4 * t * e * f
        return 3.0 * fwd * self.layers


def _module_fields(cfg: Config) -> dict:
    return dict(num_heads=cfg.heads, mlp_dim=cfg.ffn, dropout_rate=cfg.rate, attention_dropout_rate=cfg.rate,
                epsilon=cfg.eps, dtype=cfg.dtype, param_dtype=cfg.dtype, pre_layer_norm=cfg.pre_ln)


def init_params(cfg: Config, seed: int):
    """The shared parameter tree (stacked for a stack), with biases and norm parameters
    moved off zero / one so a bias routed to the wrong place cannot go unnoticed."""
    x = jax.ShapeDtypeStruct((1, 8, cfg.hidden), cfg.dtype)
    # The parameter tree is the same whatever the layouts: "none" never starts tuning.
    module = (Encoder(num_layers=cfg.layers, scan_layers=True, layouts="none", **_module_fields(cfg)) if cfg.stack
              else EncoderLayer(layouts="none", **_module_fields(cfg)))
    params = jax.jit(module.init)(jax.random.key(seed), jnp.zeros(x.shape, x.dtype))["params"]
    params = params["layers"]["layer"] if cfg.stack else params
    rng = np.random.default_rng(seed)

    def perturb(path, a):
        if jax.tree_util.keystr(path).endswith("['kernel']"):
            return a
        return (a.astype(_F32) + jnp.asarray(0.1 * rng.standard_normal(a.shape), _F32)).astype(a.dtype)

    return jax.tree_util.tree_map_with_path(perturb, params)


# ---------------------------------------------------------------------------------------
# The hand-written jnp layer (rows a, c, d).


def layer_norm(x, scale, bias, eps):
    xf = x.astype(_F32)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def dropout(x, rate: float, key):
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def jnp_layer(p, x, key, *, cfg: Config, deterministic: bool, attention: str = "xla"):
    """One layer as a user writes it in jnp; attention "xla" (einsums, softmax in f32,
    bernoulli dropout on the probabilities) or "cudnn" (jax.nn.dot_product_attention,
    which has no dropout)."""
    rate = 0.0 if deterministic else cfg.rate
    keys = jax.random.split(key, 4) if rate else [None] * 4

    def drop(y, k):
        return dropout(y, rate, k) if rate else y

    def norm(name, a):
        return layer_norm(a, p[name]["scale"], p[name]["bias"], cfg.eps)

    a_in = norm("attention_norm", x) if cfg.pre_ln else x
    qkv = jnp.einsum("bse,ethd->bsthd", a_in, p["qkv"]["kernel"]) + p["qkv"]["bias"]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if attention == "cudnn":
        a = jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    else:
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(q.shape[-1]))
        probs = drop(jax.nn.softmax(scores.astype(_F32), axis=-1).astype(x.dtype), keys[0])
        a = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    proj = jnp.einsum("bshd,hde->bse", a, p["out"]["kernel"])
    h = x + drop(proj + p["out"]["bias"], keys[1])
    if not cfg.pre_ln:
        h = norm("attention_norm", h)
    m_in = norm("mlp_norm", h) if cfg.pre_ln else h
    g = jax.nn.gelu(m_in @ p["mlp_in"]["kernel"] + p["mlp_in"]["bias"], approximate=False)
    y = h + drop(drop(g, keys[2]) @ p["mlp_out"]["kernel"] + p["mlp_out"]["bias"], keys[3])
    return y if cfg.pre_ln else norm("mlp_norm", y)


def jnp_stack(p, x, key, *, cfg: Config, deterministic: bool, attention: str = "xla"):
    """`cfg.layers` jnp layers under `lax.scan` over the stacked parameters."""
    def body(h, layer):
        params, k = layer
        return jnp_layer(params, h, k, cfg=cfg, deterministic=deterministic, attention=attention), None

    y, _ = jax.lax.scan(body, x, (p, jax.random.split(key, cfg.layers)))
    return y


def _jnp(attention: str, optimized: bool):
    def forward(cfg: Config, deterministic: bool):
        body = jnp_stack if cfg.stack else jnp_layer

        def f(p, x, key):
            return body(p, x, key, cfg=cfg, deterministic=deterministic, attention=attention)

        return jaxsub.optimize(f, layouts=cfg.layouts) if optimized else f
    return forward


# ---------------------------------------------------------------------------------------
# Flax rows (b, e; g, h with Flax's default attention dropout) and jaxsub's module (f).


def _flax(optimized: bool, broadcast_dropout: bool = False):
    def forward(cfg: Config, deterministic: bool):
        layer = ReferenceEncoderLayer(**_module_fields(cfg), broadcast_dropout=broadcast_dropout)

        def f(p, x, key):
            return layer.apply({"params": p}, x, deterministic=deterministic, rngs={"dropout": key})

        return jaxsub.optimize(f, layouts=cfg.layouts) if optimized else f
    return forward


def _jaxsub_module(cfg: Config, deterministic: bool):
    if cfg.stack:
        module = Encoder(num_layers=cfg.layers, scan_layers=True, layouts=cfg.layouts, **_module_fields(cfg))

        def f(p, x, key):
            return module.apply({"params": {"layers": {"layer": p}}}, x, deterministic=deterministic,
                                rngs={"dropout": key})
    else:
        module = EncoderLayer(layouts=cfg.layouts, **_module_fields(cfg))

        def f(p, x, key):
            return module.apply({"params": p}, x, deterministic=deterministic, rngs={"dropout": key})
    return f


def _same(tree):
    return tree


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    letter: str
    label: str
    forward: Callable            # (cfg, deterministic) -> f(params, x, key) -> y
    to_row: Callable = _same     # shared parameter tree -> the row's
    from_row: Callable = _same   # the row's gradients -> the shared tree's layout
    stack: bool = True           # also timed on the stack configs
    optional: bool = False       # failing to run is recorded, not a failed benchmark
    attention_dropout: bool = True


ROWS = {
    i.name: i
    for i in (
        Impl("xla", "a", "plain XLA (jnp layer)", _jnp("xla", optimized=False)),
        Impl("flax", "b", "Flax linen layer", _flax(optimized=False), to_flax_params, from_flax_params,
             stack=False),
        Impl("cudnn", "c", "XLA + cuDNN attention, no attn dropout", _jnp("cudnn", optimized=False),
             optional=True, attention_dropout=False),
        Impl("opt-jnp", "d", "jaxsub.optimize(jnp layer)", _jnp("xla", optimized=True)),
        Impl("opt-flax", "e", "jaxsub.optimize(Flax linen layer)", _flax(optimized=True), to_flax_params,
             from_flax_params, stack=False),
        Impl("jaxsub", "f", "jaxsub.flax.EncoderLayer / Encoder(scan)", _jaxsub_module),
        # Flax's default attention dropout (broadcast_dropout=True: one [S, S] mask shared by
        # every batch element and head; rows b and e draw one per element, as a and d do).
        Impl("flax-bcast", "g", "Flax linen layer, broadcast attn dropout", _flax(False, True), to_flax_params,
             from_flax_params, stack=False),
        Impl("opt-flax-bcast", "h", "jaxsub.optimize(Flax linen layer), broadcast attn dropout", _flax(True, True),
             to_flax_params, from_flax_params, stack=False),
    )
}
BASELINE = "xla"
