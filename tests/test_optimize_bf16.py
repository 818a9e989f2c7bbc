"""jaxsub.optimize on the BERT encoder layer in bfloat16 and float16 (CPU).

Low-precision code spells the patterns differently from float32: constants are rounded to
the activation dtype (the dropout scale 1 / 0.8984375 for rate 0.1 in bf16, sqrt(1/2) as
0.70703125 in GELU), flax.linen.LayerNorm upcasts x, scale and bias to f32 for its
statistics, Flax's softmax sums exp(x) in f32 and divides in bf16. Each layer form --
bench/layers.py's hand-written jnp layer and jaxsub.flax.ReferenceEncoderLayer with
param_dtype equal to the compute dtype or float32 -- must still be matched whole: one
attention, two BDRLNs, one bias+GELU+dropout, forward and backward targets in the lowered
HLO, and the same values and gradients as the original in deterministic mode.
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from bench import layers as L
from jaxsub.flax import ReferenceEncoderLayer, to_flax_params
from jaxsub.rewrite import scan_products
from jaxsub.testing import assert_close

B, S, E, H, F = 2, 16, 64, 4, 128
DTYPES = [jnp.bfloat16, jnp.float16]
FORMS = ["jnp", "flax", "flax_f32_params"]
TOTALS = {"attention": 1, "bias_dropout_residual_layer_norm": 2, "bias_gelu_dropout": 1}
# On CPU ops.attention runs the unfused path: a softmax_dropout kernel between XLA matmuls.
FWD = {"attention_or_softmax": 1, "jaxsub_bdrln_fwd": 2, "jaxsub_bias_gelu_dropout_fwd": 1}


def _config(dtype):
    return L.Config("test", B, S, E, H, F, dtype)


def _layer(form, dtype, deterministic):
    """(f(params, x, key), params, x) for one form of the layer."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, S, E), np.float32), dtype)
    if form == "jnp":
        cfg = _config(dtype)
        return L.ROWS["xla"].forward(cfg, deterministic), L.init_params(cfg, 0), x
    param_dtype = jnp.float32 if form == "flax_f32_params" else dtype
    layer = ReferenceEncoderLayer(num_heads=H, mlp_dim=F, dropout_rate=0.1, attention_dropout_rate=0.1,
                                  dtype=dtype, param_dtype=param_dtype)

    def f(p, x, key):
        return layer.apply({"params": p}, x, deterministic=deterministic, rngs={"dropout": key})

    # Shared tree with biases and norm parameters off 0 / 1, in the parameter dtype.
    return f, to_flax_params(L.init_params(_config(param_dtype), 0)), x


def _targets(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return collections.Counter(re.findall(r"@(jaxsub_\w+)\(", text))


def _fwd_counts(c):
    return {"attention_or_softmax": c["jaxsub_attention_fwd"] + c["jaxsub_attention_qkv_fwd"]
            + c["jaxsub_softmax_dropout_fwd"],
            "jaxsub_bdrln_fwd": c["jaxsub_bdrln_fwd"],
            "jaxsub_bias_gelu_dropout_fwd": c["jaxsub_bias_gelu_dropout_fwd"]}


def _bwd_counts(c):
    return {"attention_or_softmax": c["jaxsub_attention_bwd"] + c["jaxsub_attention_bwd_dqkv"]
            + c["jaxsub_attention_qkv_bwd"] + c["jaxsub_softmax_dropout_bwd"],
            "jaxsub_bdrln_bwd": c["jaxsub_bdrln_bwd"],
            "jaxsub_bias_gelu_dropout_bwd": c["jaxsub_bias_gelu_dropout_bwd"]}


def _loss(f, dy):
    return lambda p, x, key: jnp.sum(f(p, x, key).astype(jnp.float32) * dy)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["dropout", "deterministic"])
def test_layer_fully_matched(form, dtype, deterministic):
    f, params, x = _layer(form, dtype, deterministic)
    key = jax.random.key(1)
    report = jaxsub.explain(f, params, x, key)
    # On a GPU backend the three plain products (out-projection, both MLP products) also go
    # through jaxsub's GEMM target (rewrite.scan_products).
    assert dict(report.totals) == {**TOTALS, **({"dense": 3} if scan_products._library() else {})}, str(report)
    assert not report.near_misses, str(report)
    opt = jaxsub.optimize(f)
    assert _fwd_counts(_targets(opt, params, x, key)) == FWD
    dy = jnp.asarray(np.random.default_rng(9).standard_normal((B, S, E), np.float32))
    grads = _targets(jax.grad(_loss(opt, dy), (0, 1)), params, x, key)
    assert _bwd_counts(grads) == {"attention_or_softmax": 1, "jaxsub_bdrln_bwd": 2,
                                  "jaxsub_bias_gelu_dropout_bwd": 1}
    assert _fwd_counts(grads) == FWD
    if not deterministic:
        name = jnp.dtype(dtype).name
        # The rate is bernoulli's keep probability, not the rounded scale.
        assert all("dropout rate=0.1 " in m.detail and f"through a {name} constant" in m.detail
                   for m in report.matches if m.pattern != "dense"), str(report)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_layer_deterministic_values_and_gradients(form, dtype):
    f, params, x = _layer(form, dtype, True)
    key = jax.random.key(1)
    opt = jaxsub.optimize(f)
    out, ref = jax.jit(opt)(params, x, key), jax.jit(f)(params, x, key)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype, reduction=F, what="value")
    dy = jnp.asarray(np.random.default_rng(9).standard_normal((B, S, E), np.float32))
    grads = jax.jit(jax.grad(_loss(opt, dy), (0, 1)))(params, x, key)
    refs = jax.jit(jax.grad(_loss(f, dy), (0, 1)))(params, x, key)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), r in zip(flat, jax.tree.leaves(refs)):
        assert g.dtype == r.dtype and g.shape == r.shape, jax.tree_util.keystr(path)
        assert_close(g, r, dtype, reduction=B * S * F, grad=True, what=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------------------
# Rounded constants are taken only for what they are the rounding of.


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dropout_scale_one_step_off_is_not_dropout(dtype):
    """A scale constant one step of the dtype's grid away from 1 - rate is not 1 - rate."""
    x, b = (jnp.ones((8, E), dtype), jnp.ones((E,), dtype))
    keep = jnp.asarray(0.9, dtype)
    off = jnp.nextafter(keep, jnp.asarray(2.0, dtype))

    def block(scale):
        def f(x, b, key):
            h = jax.nn.gelu(x + b, approximate=False)
            mask = jax.random.bernoulli(key, 0.9, h.shape)
            return jnp.where(mask, h / scale, jnp.zeros((), dtype))
        return f

    key = jax.random.key(0)
    good = jaxsub.explain(block(keep), x, b, key)
    assert len(good.matches) == 1 and "dropout rate=0.1 " in good.matches[0].detail, str(good)
    bad = jaxsub.explain(block(off), x, b, key)
    # bias+GELU is still fused, without the dropout next to it.
    assert len(bad.matches) == 1 and bad.matches[0].detail.endswith("no dropout"), str(bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_gelu_rounded_constants(dtype):
    def tanh_gelu(x, b):
        v = x + b
        return (v * 0.5 * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v * v * v)))).astype(dtype)

    def erf_gelu(x, b):
        v = x + b
        return (0.5 * v * (1.0 + jax.lax.erf(v / jnp.asarray(np.sqrt(2.0), dtype)))).astype(dtype)

    def wrong_tanh(x, b):  # 0.8 for sqrt(2/pi): the next bf16 value, not its rounding
        v = x + b
        return (0.5 * v * (1.0 + jnp.tanh(jnp.asarray(0.8, dtype) * (v + 0.044715 * v ** 3)))).astype(dtype)

    def wrong_erf(x, b):
        v = x + b
        return (0.5 * v * (1.0 + jax.lax.erf(v / jnp.asarray(1.4, dtype)))).astype(dtype)

    x, b = jnp.ones((8, E), dtype), jnp.ones((E,), dtype)
    for fn in (tanh_gelu, erf_gelu, lambda x, b: jax.nn.gelu(x + b, approximate=True),
               lambda x, b: jax.nn.gelu(x + b, approximate=False)):
        assert dict(jaxsub.explain(fn, x, b).totals) == {"bias_gelu_dropout": 1}
    for fn in (wrong_tanh, wrong_erf):
        assert not jaxsub.explain(fn, x, b).matches


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_layer_norm_with_jnp_means_of_a_16_bit_x(dtype):
    """x.mean(-1) on a bf16/f16 x sums in f32 and rounds the mean back: a layer norm written
    so, with no upcast of x, is matched (found by probing: neither a match nor a near-miss),
    and the fused op is closer to the f32 layer norm than the 16-bit program is."""
    def ln(x, g, b):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b

    rng = np.random.default_rng(11)
    x32 = jnp.asarray(rng.standard_normal((4, 6, E)) * 3 + 1, jnp.float32)
    g32, b32 = (jnp.asarray(rng.standard_normal(E), jnp.float32) for _ in range(2))
    x, g, b = (a.astype(dtype) for a in (x32, g32, b32))
    assert dict(jaxsub.explain(ln, x, g, b).totals) == {"layer_norm": 1}
    assert "jaxsub_layer_norm_fwd" in jax.jit(jaxsub.optimize(ln)).lower(x, g, b).as_text()
    truth = ln(*(a.astype(jnp.float32) for a in (x, g, b)))
    got = np.abs(np.asarray(jax.jit(jaxsub.optimize(ln))(x, g, b), np.float32) - truth).max()
    plain = np.abs(np.asarray(jax.jit(ln)(x, g, b), np.float32) - truth).max()
    assert got <= plain, (got, plain)


# ---------------------------------------------------------------------------------------
# Dropout computed in float32 on a 16-bit value and converted back, or its multiplier
# computed in float32 and rounded.

_UPCAST_DROPOUTS = {
    "where": lambda h, keep, p: jnp.where(keep, h.astype(jnp.float32) / p, 0).astype(h.dtype),
    "product": lambda h, keep, p: (h.astype(jnp.float32) * keep * (1 / p)).astype(h.dtype),
    "f32 mask": lambda h, keep, p: (h * keep.astype(jnp.float32) / p).astype(h.dtype),
    # the multiplier keep / p (Python float p) in float32, rounded to h's dtype
    "f32 multiplier": lambda h, keep, p: h * (keep / p),
    "f32 selected multiplier": lambda h, keep, p: h * jnp.where(keep, 1 / p, 0),
}


@pytest.mark.parametrize("spelling", _UPCAST_DROPOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dropout_computed_in_float32(dtype, spelling):
    """dropout(h.astype(f32)).astype(h.dtype) is a dropout of h (missed until a probe
    round): the fused ops compute in float32 and round once, as this program does; so is h
    times a float32 keep / p rounded to h's dtype (its scale a rounding of 1 / p). Fused in
    the GELU, the post-LN residual and attention, with the fused op's mask for the user's
    key; converted back to another dtype it is not a dropout of h."""
    rate, drop = 0.1, _UPCAST_DROPOUTS[spelling]
    rng = np.random.default_rng(3)
    x, r = (jnp.asarray(rng.standard_normal((8, E)), dtype) for _ in range(2))
    b, s, lb = (jnp.asarray(rng.standard_normal(E) * 0.1 + c, dtype) for c in (0.0, 1.0, 0.0))
    q, k, v = (jnp.asarray(rng.standard_normal((2, 8, 2, 16)), dtype) for _ in range(3))
    key = jax.random.key(4)

    def ln(t, g, bb):
        t = t.astype(jnp.float32)
        m = t.mean(-1, keepdims=True)
        var = ((t - m) ** 2).mean(-1, keepdims=True)
        return ((t - m) * jax.lax.rsqrt(var + 1e-5) * g + bb).astype(dtype)

    def probs(q, k):
        return jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(16.0, dtype)), axis=-1)

    def layers(dropout):
        return {
            "bias_gelu_dropout": (lambda x, key: dropout(jax.nn.gelu(x + b, approximate=False), key), (x,)),
            "bias_dropout_residual_layer_norm": (lambda x, key: ln(r + dropout(x + b, key), s, lb), (x,)),
            "attention": (lambda q, k, key: jnp.einsum("bhqk,bkhd->bqhd", dropout(probs(q, k), key), v), (q, k)),
        }

    def user(h, key):
        return drop(h, jax.random.bernoulli(key, 1 - rate, h.shape), 1 - rate)

    def reference(h, key):  # the fused op's mask, the dropout in float32 rounded once
        return drop(h, jaxsub.ops.dropout_mask(key, h.shape, rate), 1 - rate)

    for name, (f, args) in layers(user).items():
        report = jaxsub.explain(f, *args, key)
        assert dict(report.totals) == {name: 1} and "dropout rate=0.1" in str(report), (name, str(report))
        want = layers(reference)[name][0](*args, key)
        assert_close(jax.jit(jaxsub.optimize(f))(*args, key), want, dtype, reduction=E, what=name)

    other = jnp.float16 if dtype == jnp.bfloat16 else jnp.bfloat16

    def to_other(x, key):  # converted back to another dtype: not a dropout of h
        h = jax.nn.gelu(x + b, approximate=False)
        kept = jnp.where(jax.random.bernoulli(key, 1 - rate, h.shape), h.astype(jnp.float32) / (1 - rate), 0)
        return kept.astype(other)

    def upcast_kept(x, key):  # the float32 h also returned: the convert must stay
        h = jax.nn.gelu(x + b, approximate=False).astype(jnp.float32)
        return jnp.where(jax.random.bernoulli(key, 1 - rate, h.shape), h / (1 - rate), 0).astype(dtype), h

    for f in (to_other, upcast_kept):
        report = jaxsub.explain(f, x, key)
        assert not any("dropout rate" in m.detail for m in report.matches), str(report)
        # (to_other rounds to bf16 at the end, from either dtype: bf16's tolerance)
        for got, want in zip(jax.tree.leaves(jaxsub.optimize(f)(x, key)), jax.tree.leaves(f(x, key))):
            assert_close(got, want, jnp.bfloat16, reduction=E, what="unfused dropout")


@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_gelu_and_dropout_computed_in_float32(dtype, approximate):
    """The GELU of an upcast and its dropout both in float32, rounded once at the end: the
    fused op's own order. A probe round found nothing fused there, and no near-miss."""
    rate = 0.1
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, E)), dtype)
    b = jnp.asarray(rng.standard_normal(E) * 0.1, dtype)
    key = jax.random.key(6)

    def dropped(x, keep):
        h = jax.nn.gelu((x + b).astype(jnp.float32), approximate=approximate)
        return jnp.where(keep, h / (1 - rate), 0).astype(dtype)

    def f(x, key):
        return dropped(x, jax.random.bernoulli(key, 1 - rate, x.shape))

    report = jaxsub.explain(f, x, key)
    assert dict(report.totals) == {"bias_gelu_dropout": 1} and "dropout rate=0.1" in str(report), str(report)
    want = dropped(x, jaxsub.ops.dropout_mask(key, x.shape, rate))
    assert_close(jax.jit(jaxsub.optimize(f))(x, key), want, dtype, reduction=E, what="GELU and dropout in f32")
    # Under jax.vmap over per-example keys the dropout stays the user's (a fused op draws
    # from one key) and with it this GELU, whose f32 output it reads; explain says why
    # (found by probing: nothing fused and nothing said).
    xs, keys = jnp.stack([x, -x]), jax.random.split(key, 2)
    report = jaxsub.explain(jax.vmap(f), xs, keys)
    assert not report.matches and "is one key per example" in str(report), str(report)
    np.testing.assert_array_equal(jax.jit(jaxsub.optimize(jax.vmap(f)))(xs, keys), jax.jit(jax.vmap(f))(xs, keys))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_softmax_with_where_in_16_bit(dtype, softmax_flag):
    """jax.nn.softmax(s, where=mask) on a 16-bit s sums where(mask, upcast(exp), 0): the mask
    on the float32 copy, which the matcher did not take (found by probing: fused in float32
    only, under jax_softmax_custom_jvp or not); so does a softmax written out with jnp.sum of
    the 16-bit where (the convert after the where). Fused alone and in attention, a row the mask
    hides everywhere giving zeros; values and gradients as close to the float32 program as
    the 16-bit program's own."""
    rng = np.random.default_rng(9)
    Sq, Sk, D = 9, 11, 16
    s32 = jnp.asarray(rng.standard_normal((2, H, Sq, Sk)) * 2, jnp.float32)
    q32, k32, v32 = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                     for shape in ((2, Sq, H, D), (2, Sk, H, D), (2, Sk, H, D)))
    mask = rng.random((2, 1, Sq, Sk)) > 0.3
    mask[1, :, 4] = False  # a row hidden everywhere
    mask = jnp.asarray(mask)

    def alone(s):
        return jax.nn.softmax(s, where=mask)

    def attn(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5, where=mask)
        return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)

    def written(s):  # jnp.sum of the 16-bit where: sum(upcast(where(mask, e, 0)))
        x = jnp.where(mask, s, -jnp.inf)
        e = jnp.exp(x - jax.lax.stop_gradient(x.max(-1, keepdims=True)))
        return jnp.where(mask, e / jnp.where(mask, e, 0).sum(-1, keepdims=True), 0)

    cases = ((alone, (s32,), "softmax_dropout", Sk), (attn, (q32, k32, v32), "attention", D),
             (written, (s32,), "softmax_dropout", Sk))
    for f, args32, name, reduction in cases:
        args = tuple(a.astype(dtype) for a in args32)
        assert ("custom_jvp_call" in str(jax.make_jaxpr(f)(*args))) == (softmax_flag and f is not written)
        report = jaxsub.explain(f, *args)
        assert dict(report.totals) == {name: 1} and not report.unsearched, str(report)
        opt = jax.jit(jaxsub.optimize(f))
        dy = jnp.asarray(rng.standard_normal(f(*args32).shape), jnp.float32)
        argnums = tuple(range(len(args)))

        def loss(g):
            return lambda *a: jnp.sum(g(*a).astype(jnp.float32) * dy)

        got, want, own = opt(*args), f(*args32), f(*args)
        assert_close(got, want, dtype, reduction=reduction, what=f"{name} {dtype.__name__}")
        if name == "softmax_dropout":
            assert not np.asarray(got[1, :, 4], np.float32).any() and np.isfinite(np.asarray(got, np.float32)).all()
            # no further from the float32 program than the 16-bit program itself (+ one rounding)
            err = np.abs(np.asarray(got, np.float32) - want).max()
            assert err <= np.abs(np.asarray(own, np.float32) - want).max() + float(jnp.finfo(dtype).eps), err
        grads = jax.jit(jax.grad(loss(jaxsub.optimize(f)), argnums))(*args)
        for g, w in zip(grads, jax.grad(loss(f), argnums)(*args32)):
            assert_close(g, w, dtype, reduction=reduction, grad=True, what=f"{name} grad {dtype.__name__}")
