"""Shared by the optimize tests (test_optimize*.py): sizes, the fused targets counted in
lowered HLO, optimize(f) compared with f in value and gradient, and the small layers that
several of them build on."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsub
from jaxsub.testing import assert_close

N = 32
RATE = 0.25
TARGETS = ("jaxsub_layer_norm_fwd", "jaxsub_bdrln_fwd", "jaxsub_bias_gelu_dropout_fwd")


def normal(i, shape, dtype=jnp.float32):
    # numpy draws: eager jax.random would compile a kernel per shape.
    return jnp.asarray(np.random.default_rng(i).standard_normal(shape, np.float32).astype(dtype))


def target_counts(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return {t: text.count(f"@{t}(") for t in TARGETS}


def expect(f, args, **counts):
    want = {t: 0 for t in TARGETS}
    want.update({f"jaxsub_{k}_fwd": v for k, v in counts.items()})
    assert target_counts(jaxsub.optimize(f), *args) == want


def assert_same(f, args, dtype=jnp.float32, argnums=(0,), reduction=N):
    """optimize(f) == f in value and in the gradients of a random projection of the output;
    `reduction`: the length of the sums an output depends on (the tolerance grows with it).
    f32 products in full f32, as on the CPU: on a GPU backend XLA's default precision may
    round them to TF32, differently in the two programs (their fusions differ)."""
    if jnp.dtype(dtype) == jnp.float32:
        with jax.default_matmul_precision("highest"):
            return _assert_same_at(f, args, dtype, argnums, reduction)
    return _assert_same_at(f, args, dtype, argnums, reduction)


def _assert_same_at(f, args, dtype, argnums, reduction):
    opt = jaxsub.optimize(f)
    out, ref = jax.jit(opt)(*args), jax.jit(f)(*args)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert_close(out, ref, dtype, reduction=reduction, what="value")
    dy = normal(99, ref.shape)

    def loss(g):
        return lambda *a: jnp.sum(g(*a).astype(jnp.float32) * dy)

    grads = jax.jit(jax.grad(loss(opt), argnums))(*args)
    refs = jax.jit(jax.grad(loss(f), argnums))(*args)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(refs)):
        assert g.dtype == r.dtype
        assert_close(g, r, dtype, reduction=max(reduction, ref.size // N), grad=True, what="grad")


def ln_two_pass(x, s, b):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b


def bernoulli_dropout(key, h, rate):
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
    return h * keep / (1.0 - rate)


def bdrln_block(x, b, r, s, lb, key, *, rate):
    h = x + b
    if rate:
        h = bernoulli_dropout(key, h, rate)
    return ln_two_pass(r + h, s, lb)


def ffn_block(x, w, b, key, *, rate, approximate):
    h = jax.nn.gelu(x @ w + b, approximate=approximate)
    if rate:
        h = jnp.where(jax.random.bernoulli(key, 1.0 - rate, h.shape), h / (1.0 - rate), 0)
    return h


def gemm_c_types(text: str) -> list:
    """The c operand's type of each jaxsub_gemm call in lowered StableHLO text."""
    return [line.rsplit(" : (", 1)[1].split(") ->")[0].split(", ")[3]
            for line in text.splitlines() if "@jaxsub_gemm(" in line]


# ---------------------------------------------------------------------------------------
# Attention (test_optimize_attention.py, test_optimize_softmax.py, test_optimize_masks.py).

B, S, H, D = 2, 8, 4, 16
E = H * D
ATTENTION_TARGETS = ("jaxsub_softmax_dropout_fwd", "jaxsub_attention_fwd", "jaxsub_attention_qkv_fwd")

# An attention output depends on a projection's sum over E and the probabilities' sum over
# S keys, chained: f32 rounding differences between the fused ops and XLA grow with both.
# On one CPU (AMD EPYC, XLA 0.10.2) the weight gradient of the packed projection missed
# the tolerance of a 32-element sum by 1.5% at one element of 12 288.
ATTENTION_REDUCTION = E * S


def assert_attention_same(f, args, argnums=(0,)):
    assert_same(f, args, argnums=argnums, reduction=ATTENTION_REDUCTION)


def qkv_inputs(layout="bshd"):
    shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    return tuple(normal(i, shape) for i in range(3))


def key_padding(seed=7):
    """[B, S] key padding with at least one visible key per row."""
    m = np.random.default_rng(seed).random((B, S)) > 0.4
    m[:, 0] = True
    return jnp.asarray(m)


def attention_counts(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return sum(text.count(f"@{t}(") for t in ATTENTION_TARGETS)


def softmax_form(flag, f, args, report):
    """The program holds jax.nn.softmax's call exactly under the flag, and the pass saw into it."""
    assert ("custom_jvp_call" in str(jax.make_jaxpr(f)(*args))) == flag
    assert not report.unsearched, str(report)


def check_attention(f, args, totals, argnums=(0, 1, 2)):
    """optimize(f) == f in value and gradients; one fused attention or softmax per match;
    explain."""
    assert_attention_same(f, args, argnums=argnums)
    opt = jaxsub.optimize(f)
    assert attention_counts(opt, *args) == sum(totals.values())
    report = jaxsub.explain(f, *args)
    assert dict(report.totals) == totals, str(report)
    return report


def attn_bshd(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def attn_bhsd_written_out(q, k, v, mask):
    """Scale on q, where(mask, s, -1e9), softmax written as max/exp/sum/div."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q * (1.0 / np.sqrt(D)), k)
    s = jnp.where(mask[:, None, None, :], s, -1e9)
    e = jnp.exp(s - s.max(-1, keepdims=True))
    return jnp.einsum("bhqk,bhkd->bhqd", e / e.sum(-1, keepdims=True), v)


def attn_tril_additive(q, k, v, bias):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
    s = jnp.where(jnp.tril(jnp.ones((S, S))), s * 0.3, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
