"""jaxsub.optimize on attention: softmax(Q Kᵀ scale + mask) (dropout) V -> jaxsub.ops.attention.

Each source (hand-written jnp in both layouts, jax.nn.dot_product_attention, flax linen
and nnx attention) is optimized and compared with the original: outputs and gradients
within the jaxsub.testing tolerance, the number of attention/softmax forward targets
in the lowered HLO (`jaxsub_softmax_dropout_fwd` for the unfused path and lone softmaxes,
`jaxsub_attention_fwd` for the fused path, `jaxsub_attention_qkv_fwd` for it on q, k, v
sliced from one array: which one runs is the `layouts=` selection's choice), and
explain()'s report. With dropout,
the result is compared with jaxsub.ops.attention for the key the user's code used. The
softmax's spellings are in test_optimize_softmax.py, scales and masks in
test_optimize_masks.py, the helpers in optimize_helpers.py.
"""

import functools
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsub
from jaxsub import ops
from jaxsub.ops import attn as attn_ops
from jaxsub.testing import assert_close
from optimize_helpers import (ATTENTION_REDUCTION, B, D, E, H, RATE, S, assert_attention_same, attention_counts,
                              attn_bhsd_written_out, attn_bshd, check_attention, key_padding, normal, qkv_inputs,
                              softmax_form)
import optimize_helpers


# ---------------------------------------------------------------------------------------
# Hand-written jnp.


def attn_packed_slices(x, w, key):
    """q, k, v sliced from one QKV projection [B, S, 3, H, D], dropout on the probabilities."""
    qkv = jnp.einsum("bse,ethd->bsthd", x, w)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D), axis=-1)
    keep = jax.random.bernoulli(key, 1.0 - RATE, p.shape)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / (1.0 - RATE), 0.0), v)


def test_qkv_slices_of_one_array_become_attention_packed():
    x, w = normal(0, (B, S, E)), normal(1, (E, 3, H, D)) * 0.2
    key = jax.random.key(3)
    report = jaxsub.explain(attn_packed_slices, x, w, key)
    assert dict(report.totals) == {"attention": 1} and "attention_packed, axis 2" in str(report), str(report)
    qkv = jnp.einsum("bse,ethd->bsthd", x, w)
    for impl in ("fused", "unfused"):
        # layouts="none": the implementation is the enclosing block's (a fresh function per
        # block: the rewritten function is cached per input shapes).
        opt = jaxsub.optimize(attn_packed_slices, layouts="none")
        with ops.config.use({"attention": {"impl": impl}}):
            got = opt(x, w, key)
            text = jax.jit(opt).lower(x, w, key).as_text()
            want = ops.attention_packed(qkv, dropout_rate=RATE, key=key, implementation=impl)
        assert_close(got, want, what=impl)
        # The fused kernel where this backend has one for f32 (the CPU handlers; CUDA's
        # take bf16/f16 and fall back to the unfused path, as `want` does).
        fused = impl == "fused" and attn_ops.fused_unsupported(attn_ops._platform(x), x.dtype, D) is None
        assert ("@jaxsub_attention_qkv_fwd(" in text) == fused, impl
    # Slices in another order (k first) are not the packed form: plain attention on them.
    swapped = lambda x, w: attn_bshd(*(jnp.einsum("bse,ethd->bsthd", x, w)[:, :, i] for i in (1, 0, 2)))
    assert "attention_packed" not in str(jaxsub.explain(swapped, x, w))
    assert_attention_same(swapped, (x, w), argnums=(0, 1))


def attn_packed_biased(x, w, b):
    """attn_packed_slices without dropout, with the projection's [3, H, D] bias added."""
    qkv = jnp.einsum("bse,ethd->bsthd", x, w) + b
    return attn_bshd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])


def _grad_text(f, args, argnums):
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * normal(9, (B, S, H, D))), argnums)).lower(*args).as_text()


def test_packed_projection_bias_gradient_by_bias_add():
    """The bias of the packed q/k/v array goes through ops.bias_add: its gradient is the
    fused column sum (jaxsub_bias_grad); values and gradients as the original's."""
    x, w, b = normal(0, (B, S, E)), normal(1, (E, 3, H, D)) * 0.2, normal(2, (3, H, D))
    report = check_attention(attn_packed_biased, (x, w, b), {"attention": 1})
    assert "its bias float32[3, 4, 16] added by ops.bias_add" in str(report), str(report)
    assert "@jaxsub_bias_grad(" in _grad_text(jaxsub.optimize(attn_packed_biased), (x, w, b), (2,))

    # Read by something else besides the slices: the add stays the user's.
    def also_returned(x, w, b):
        qkv = jnp.einsum("bse,ethd->bsthd", x, w) + b
        return attn_bshd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]) + qkv[:, :, 0]

    assert "ops.bias_add" not in str(jaxsub.explain(also_returned, x, w, b))
    assert_attention_same(also_returned, (x, w, b), argnums=(0, 1, 2))


def test_hand_written_bshd():
    report = check_attention(attn_bshd, qkv_inputs(), {"attention": 1})
    assert "scale=0.25" in str(report) and "no dropout" in str(report)


def test_hand_written_bhsd_with_where_mask():
    report = check_attention(attn_bhsd_written_out, (*qkv_inputs("bhsd"), key_padding()), {"attention": 1})
    assert "boolean mask" in str(report)
    assert "fully-masked rows give 0 instead of the mean of v" in str(report)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["float32", "bfloat16", "float16"])
def test_masked_bias_held_in_the_scores_dtype(dtype):
    """HF GPT-2's causal `masked_bias`: where(tril, s, -1e4) with the fill in the scores'
    dtype. In bfloat16 -1e4 is -9984, which the matcher's `fill <= -1e4` turned away
    without a word (found by probing): every rounding of -1e4 is a boolean mask now."""
    def f(q, k, v):
        s = q @ jnp.swapaxes(k, -1, -2) / float(np.sqrt(D))  # a Python float: s stays in q's dtype
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, jnp.asarray(-1e4, s.dtype))
        return jax.nn.softmax(s, -1) @ v

    args = tuple(a.astype(dtype) for a in qkv_inputs("bhsd"))
    report = jaxsub.explain(f, *args)
    assert dict(report.totals) == {"attention": 1} and "causal" in str(report), str(report)
    optimize_helpers.assert_same(f, args, dtype=dtype, argnums=(0, 1, 2), reduction=ATTENTION_REDUCTION)


def test_a_mask_added_after_a_where_must_not_lift_its_fill():
    """where(causal, s, -1e4) + where(causal, 0, 2e4) ends the hidden scores at +1e4: it was
    fused as causal attention, 2.9 off (found by probing). The added mask's bounds decide:
    lifted, or of unknown range after a -1e4 fill, it is a near-miss (the softmax alone
    fused); a padding mask built from booleans, or any mask after a -1e9 fill, is fused."""
    causal = jnp.tril(jnp.ones((S, S), bool))
    valid, extra = key_padding(), normal(5, (B, 1, 1, S))

    def attn(fill, added):
        def f(q, k, v, valid, extra):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(causal, s, fill) + added(valid, extra)), v)
        return f

    lifted = attn(-1e4, lambda valid, extra: jnp.where(causal, 0.0, 2e4))
    unknown = attn(-1e4, lambda valid, extra: extra)
    for f in (lifted, unknown):
        report = jaxsub.explain(f, *qkv_inputs(), valid, extra)
        assert dict(report.totals) == {"softmax_dropout": 1}, str(report)
        assert "may lift the hidden scores" in str(report), str(report)
        assert_attention_same(f, (*qkv_inputs(), valid, extra), argnums=(0, 1, 2))
    padding = attn(-1e4, lambda valid, extra: (1.0 - valid[:, None, None, :]) * -1e9)
    far = attn(-1e9, lambda valid, extra: extra)
    for f in (padding, far):
        report = jaxsub.explain(f, *qkv_inputs(), valid, extra)
        assert dict(report.totals) == {"attention": 1} and "causal" in str(report), str(report)
        assert_attention_same(f, (*qkv_inputs(), valid, extra), argnums=(0, 1, 2))


@pytest.mark.parametrize("twice", [
    lambda s, m: s + s,
    lambda s, m: jnp.where(m, s, -1e9) + s,
], ids=["sum", "where_plus_scores"])
def test_scores_added_to_themselves_are_no_mask(twice):
    """The scores reaching the softmax twice through an add were taken as an additive mask
    that the fused call never computed: optimize raised AttributeError (found by probing)."""
    causal = jnp.tril(jnp.ones((S, S), bool))

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(twice(s, causal)), v)

    assert dict(jaxsub.explain(f, *qkv_inputs()).totals) == {"softmax_dropout": 1}
    assert_attention_same(f, qkv_inputs(), argnums=(0, 1, 2))


@pytest.mark.parametrize("shape", [(1, H, S, D), (B, 1, S, D), (1, 1, S, D)], ids=["batch1", "head1", "both1"])
def test_matmul_attention_with_a_unit_batch_or_head(shape):
    """jnp.matmul squeezes a unit batch axis away and broadcasts it back around its
    dot_general, which the matcher did not look through: `@` attention at batch 1 (the
    usual inference shape) or one head fused only its softmax (found by probing)."""
    def f(q, k, v):
        s = q @ jnp.swapaxes(k, -1, -2) / float(np.sqrt(D))
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
        return jax.nn.softmax(s, -1) @ v

    args = tuple(normal(i, shape) for i in range(3))
    report = check_attention(f, args, {"attention": 1})
    assert "causal" in str(report)


def test_checkpoint_names_are_seen_through_and_kept():
    """checkpoint_name on the scores and probabilities hid the softmax and the attention
    (found by probing); the labels stay on the values that are still computed, so a remat
    policy naming the output saves it as before."""
    from jax.ad_checkpoint import checkpoint_name

    def attn(q, k, v):
        s = checkpoint_name(jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5, "scores")
        p = checkpoint_name(jax.nn.softmax(s, -1), "probs")
        return checkpoint_name(jnp.einsum("bhqk,bkhd->bqhd", p, v), "out")

    policy = jax.checkpoint_policies.save_only_these_names("out", "scores")
    remat = jax.checkpoint(attn, policy=policy)
    for f in (attn, remat):
        check_attention(f, qkv_inputs(), {"attention": 1})
    closed = jax.make_jaxpr(jaxsub.optimize(remat))(*qkv_inputs())
    jaxpr = str(closed)
    assert "name=out" in jaxpr and "name=scores" not in jaxpr
    # the user's policy kept (jax 0.12.1's save_only_these_names is a closure, no
    # SaveOnlyTheseNames object, so it is compared itself)
    assert [e.params["policy"] for e in closed.jaxpr.eqns if "policy" in e.params] == [policy]

    def named_softmax(s):
        return jax.nn.softmax(checkpoint_name(s * 2.0, "s2"), -1), checkpoint_name(s, "raw")

    scores = normal(4, (B, H, S, S))
    assert jaxsub.explain(named_softmax, scores).totals == {"softmax_dropout": 1}
    assert "name=raw" in str(jax.make_jaxpr(jaxsub.optimize(named_softmax))(scores))


def test_near_misses_say_why_rounding_head_dims_or_checkpoint():
    """Three attentions left alone without a word (found by probing): an f32 attention whose
    scores are rounded to bf16 (the fused op would not round them: dropping it changed the
    output by ~1e-2), v with another head dim than q and k, and a softmax checkpointed
    apart from the scores' product."""
    q, k, v = qkv_inputs()

    def rounded(q, k, v):
        s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5).astype(jnp.bfloat16)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(jnp.float32), v)

    def narrow_v(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s, -1), v[..., : D // 2])

    def checkpointed_softmax(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.checkpoint(lambda s: jax.nn.softmax(s, -1))(s), v)

    for f, why in ((rounded, "scores are rounded to bfloat16 in a float32 attention"),
                   (narrow_v, f"v's head dim {D // 2} differs from q and k's {D}"),
                   (checkpointed_softmax, "softmax is inside a jax.checkpoint without the scores' product")):
        report = jaxsub.explain(f, q, k, v)
        assert dict(report.totals) == {"softmax_dropout": 1} and why in str(report), str(report)
    # (The rounded one's lone softmax computes in f32 and rounds once, unlike the original.)
    for f in (narrow_v, checkpointed_softmax):
        assert_attention_same(f, (q, k, v), argnums=(0, 1, 2))


def test_vmapped_attention_fuses_with_its_batch_axes_folded():
    """A per-example attention under jax.vmap inside the optimized function has three or
    four batch axes in its products: they fold into the op's batch (it had fused only the
    softmax, then been a near-miss), with a key padding mask that varies over one of them."""
    def one(q, k, v, m):
        s = jnp.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(jnp.where(m[None, None], s, -1e9), -1), v)

    qkv = tuple(a[None].repeat(3, 0) * (1 + 0.5 * np.arange(3)[:, None, None, None, None]) for a in qkv_inputs())
    mask = key_padding()  # [B, S]
    twice = jax.vmap(jax.vmap(one), in_axes=(0, 0, 0, None))  # [3, B, S, H, D], the mask over B only
    report = check_attention(twice, (*qkv, mask), {"attention": 1}, argnums=(0, 1, 2))
    assert "k float32[3, 2, 8, 4, 16]" in str(report) and "boolean mask bool[2, 8]" in str(report), str(report)
    thrice = jax.vmap(twice, in_axes=(0, 0, 0, None))
    args4 = (*(a[None].repeat(2, 0) for a in qkv), mask)
    check_attention(thrice, args4, {"attention": 1}, argnums=(0, 1, 2))


def test_windowed_attention_with_three_batch_axes():
    """Windowed attention written on [B, W, H, N, D] (a Swin-style shifted-window mask, one
    additive [W, N, N] per window, broadcast over batch and heads), with a causal mask and
    dropout; the windows fold into the op's batch."""
    W, N = 3, 5
    q, k, v = (normal(i, (B, W, H, N, D)) for i in range(3))
    shift = jnp.asarray(np.where(np.random.default_rng(3).random((W, N, N)) > 0.3, 0.0, -100.0), jnp.float32)
    causal = jnp.tril(jnp.ones((N, N), bool))

    def windows(q, k, v, shift):
        s = jnp.einsum("bwhqd,bwhkd->bwhqk", q, k) / np.sqrt(D) + shift[None, :, None]
        s = jnp.where(causal, s, -jnp.inf)
        return jnp.einsum("bwhqk,bwhkd->bwhqd", jax.nn.softmax(s, -1), v)

    report = check_attention(windows, (q, k, v, shift), {"attention": 1}, argnums=(0, 1, 2, 3))
    assert "causal" in str(report) and "additive mask float32[3, 5, 5]" in str(report), str(report)

    def dropped(q, k, v, key):
        s = jnp.einsum("bwhqd,bwhkd->bwhqk", q, k) / np.sqrt(D)
        p = jax.nn.softmax(s, -1)
        keep = jax.random.bernoulli(key, 1 - RATE, p.shape)
        return jnp.einsum("bwhqk,bwhkd->bwhqd", jnp.where(keep, p / (1 - RATE), 0), v)

    key = jax.random.PRNGKey(4)
    got = jaxsub.optimize(dropped)(q, k, v, key)
    fold = lambda x: x.reshape(B * W, H, N, D).transpose(0, 2, 1, 3)  # noqa: E731
    want = ops.attention(fold(q), fold(k), fold(v), scale=D ** -0.5, dropout_rate=RATE, key=key)
    assert_close(got, want.transpose(0, 2, 1, 3).reshape(B, W, H, N, D), jnp.float32, reduction=N)


# ---------------------------------------------------------------------------------------
# jax.nn.dot_product_attention.


@pytest.mark.parametrize("kind", ["plain", "mask", "causal"])
def test_dot_product_attention(kind, softmax_flag):
    mask = key_padding()[:, None, None, :]

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask if kind == "mask" else None,
                                            is_causal=kind == "causal", implementation="xla")

    report = check_attention(f, qkv_inputs(), {"attention": 1})
    softmax_form(softmax_flag, f, qkv_inputs(), report)
    detail = report.matches[0].detail
    assert ("causal" in detail) == (kind == "causal")
    assert ("boolean mask" in detail) == (kind == "mask")


# ---------------------------------------------------------------------------------------
# flax.


def _linen(**kw):
    m = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=E, **kw)
    x = normal(0, (B, S, E))
    return m, m.init(jax.random.key(0), x), x


def test_flax_linen_with_mask():
    m, params, x = _linen()
    mask = nn.make_attention_mask(jnp.ones((B, S), bool), key_padding())  # no fully masked query

    def f(params, x):
        return m.apply(params, x, mask=mask)

    check_attention(f, (params, x), {"attention": 1}, argnums=(0, 1))


def test_flax_linen_causal_mask():
    m, params, x = _linen()

    def f(params, x):
        return m.apply(params, x, mask=nn.make_causal_mask(jnp.ones((B, S))))

    assert "causal" in str(check_attention(f, (params, x), {"attention": 1}, argnums=(0, 1)))


PACKED = "computed as one product with the weights stacked (attention_packed, axis 2)"
APART = "as three products, their gradient packed (attention_projected)"


def _fused_text(f, args, grad=False):
    """The lowered HLO of optimize(f), or of its gradient in arguments 0 and 1, on the
    fused path. These f32 cases have fused kernels in the CPU handlers only (CUDA's take
    bf16/f16), so on any backend the path is chosen as for CPU arrays and lowered for it."""
    opt = jaxsub.optimize(f, layouts="none")
    fn = jax.grad(lambda *a: sum(jnp.sum(jnp.square(o)) for o in jax.tree.leaves(opt(*a))), (0, 1)) if grad else opt
    with ops.config.use({"attention": {"impl": "fused"}}), mock.patch.object(attn_ops, "_platform", lambda q: "cpu"):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()


def _packed_targets(f, *args):
    """The fused attention targets in the lowered HLO of optimize(f) on the fused path."""
    text = _fused_text(f, args)
    return {t: text.count(f"@{t}(") for t in ("jaxsub_attention_fwd", "jaxsub_attention_qkv_fwd")}


def _grad_targets(f, *args):
    """The attention backward and bias-gradient targets in the lowered HLO of the gradient
    of optimize(f) (argument 0 and 1) on the fused path."""
    text = _fused_text(f, args, grad=True)
    return {t: text.count(f"@{t}(") for t in ("jaxsub_attention_bwd", "jaxsub_attention_bwd_dqkv",
                                              "jaxsub_attention_qkv_bwd", "jaxsub_bias_grad")}


def _dbias_results(f, *args):
    """The dbias result type (the second) of each packed attention backward in the lowered
    gradient of optimize(f) on the fused path: [3, H, D], or [0] where there is none."""
    import re

    lines = [ln for ln in _fused_text(f, args, grad=True).splitlines() if "@jaxsub_attention_bwd_dqkv(" in ln]
    return [re.findall(r"tensor<[^>]*>", ln.rsplit("-> (", 1)[1])[1] for ln in lines]


def test_flax_nnx(softmax_flag):
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=E, decode=False, rngs=nnx.Rngs(0))
    report = check_attention(lambda x: layer(x), (normal(0, (B, S, E)),), {"attention": 1}, argnums=(0,))
    softmax_form(softmax_flag, lambda x: layer(x), (normal(0, (B, S, E)),), report)
    assert APART in str(report), str(report)


def test_flax_nnx_default_dropout_is_broadcast_dropout():
    """nnx.MultiHeadAttention's dropout (broadcast_dropout=True by default) is fused whole."""
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=E, decode=False, dropout_rate=RATE,
                                   rngs=nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(layer)

    def f(state, x):
        return nnx.merge(graphdef, state)(x, deterministic=False)

    report = jaxsub.explain(f, state, normal(0, (B, S, E)))
    assert report.totals == {"attention": 1} and not report.near_misses, str(report)
    assert "broadcast_dropout" in str(report) and APART in str(report), str(report)


def test_flax_linen_projections_become_attention_projected():
    """MultiHeadDotProductAttention's three DenseGenerals (with biases) of one input:
    attention_projected, whose forward keeps the three products (each with its bias) and
    whose backward writes one packed gradient; values and gradients (the three kernels
    and biases included) as the original's."""
    m, params, x = _linen()

    def f(params, x):
        return m.apply(params, x)

    report = check_attention(f, (params, x), {"attention": 1}, argnums=(0, 1))
    assert APART in str(report) and "+ bias" in str(report), str(report)
    assert _packed_targets(f, params, x) == {"jaxsub_attention_fwd": 1, "jaxsub_attention_qkv_fwd": 0}
    # One packed gradient, and the three biases' gradient from the same backward (its dbias
    # result, [3, H, D]: the column sums of dq, dk, dv), not from a column sum of its own.
    assert _grad_targets(f, params, x) == {"jaxsub_attention_bwd": 0, "jaxsub_attention_bwd_dqkv": 1,
                                           "jaxsub_attention_qkv_bwd": 0, "jaxsub_bias_grad": 0}
    assert _dbias_results(f, params, x) == [f"tensor<3x{H}x{E // H}xf32>"]
    # Without biases as well.
    m2 = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=E, use_bias=False)
    p2 = m2.init(jax.random.key(0), x)
    report = check_attention(lambda p, x: m2.apply(p, x), (p2, x), {"attention": 1}, argnums=(0, 1))
    assert APART in str(report) and "+ bias" not in str(report), str(report)
    assert _grad_targets(lambda p, x: m2.apply(p, x), p2, x)["jaxsub_bias_grad"] == 0
    assert _dbias_results(lambda p, x: m2.apply(p, x), p2, x) == ["tensor<0xf32>"]


def _projected(x, y, w, b, i):
    return jnp.einsum("bse,ehd->bshd", (x, x, y)[i], w[i]) + b[i]


def test_projections_that_differ_are_reported():
    x = normal(0, (B, S, E))
    w = normal(2, (3, E, H, D)) * 0.2
    wv = normal(4, (E // 2, H, D)) * 0.2

    def f(x, w, wv):
        q, k = (jnp.einsum("bse,ehd->bshd", x, w[i]) for i in range(2))
        return attn_bshd(q, k, jnp.einsum("bse,ehd->bshd", x[..., : E // 2], wv))

    report = check_attention(f, (x, w, wv), {"attention": 1})
    assert "not packed" not in str(report)  # v projects another input (a slice of x)

    def g(x, w):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, w[i]) for i in range(3))
        return attn_bshd(q, k, v.astype(jnp.bfloat16).astype(jnp.float32))

    assert "not packed" not in str(jaxsub.explain(g, x, w))  # v is converted after its projection

    def h(x, w):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, w[i], precision=p)
                   for i, p in enumerate(("highest", None, None)))
        return attn_bshd(q, k, v)

    report = check_attention(h, (x, w), {"attention": 1}, argnums=(0, 1))
    assert "q/k/v projections of one input not packed: their dot_general parameters differ" in str(report)

    def k_biased_by_q(x, w, r):  # full-size "biases"; k's is q itself
        q = jnp.einsum("bse,ehd->bshd", x, w[0]) + r[0]
        k = jnp.einsum("bse,ehd->bshd", x, w[1]) + q
        return attn_bshd(q, k, jnp.einsum("bse,ehd->bshd", x, w[2]) + r[1])

    r = normal(5, (2, B, S, H, D))
    report = jaxsub.explain(k_biased_by_q, x, w, r)
    assert report.totals == {"attention": 1}
    assert_close(jaxsub.optimize(k_biased_by_q)(x, w, r), k_biased_by_q(x, w, r), reduction=S * D)
    assert "not packed: an input of a projection is computed inside the attention" in str(report), str(report)


def test_jnp_projections_become_attention_projected():
    x = normal(0, (B, S, E))
    w, b = normal(2, (3, E, H, D)) * 0.2, normal(3, (3, H, D))

    def self_attention(x, w, b):
        return attn_bshd(*(_projected(x, x, w, b, i) for i in range(3)))

    report = check_attention(self_attention, (x, w, b), {"attention": 1})
    assert APART in str(report), str(report)
    assert _packed_targets(self_attention, x, w, b) == {"jaxsub_attention_fwd": 1, "jaxsub_attention_qkv_fwd": 0}
    assert _grad_targets(self_attention, x, w, b)["jaxsub_attention_bwd_dqkv"] == 1


def test_projections_with_the_contraction_last_in_the_weights():
    """Weights [H, D, E] (contracted on their last axis): stacked on their first."""
    x = normal(0, (B, S, E))
    w = normal(2, (3, H, D, E)) * 0.2

    def f(x, w):
        return attn_bshd(*(jnp.einsum("bse,hde->bshd", x, w[i]) for i in range(3)))

    report = check_attention(f, (x, w), {"attention": 1}, argnums=(0, 1))
    assert PACKED in str(report) and f"w[{H}, {D}, {E}]" in str(report), str(report)


def test_projection_biases_broadcast_over_heads_or_head_dims():
    """Biases of shape [D] (shared by the heads) or [H, 1]: packed with the weights, the
    stacked bias [1, 1, 3, 1, D] is no suffix of the packed product's shape, so XLA adds
    it (ops.bias_add raised a ValueError on it)."""
    x, w = normal(0, (B, S, E)), normal(2, (3, E, H, D)) * 0.2
    for bias_shape in ((D,), (H, 1)):
        b = normal(3, (3, *bias_shape))

        def layer(x, w, b):
            return attn_bshd(*(_projected(x, x, w, b, i) for i in range(3)))

        assert jaxsub.explain(layer, x, w, b).totals == {"attention": 1}
        assert_attention_same(layer, (x, w, b), argnums=(0, 1, 2))


def test_projections_left_alone_when_not_one_input_or_not_private():
    """Cross-attention (v from another input), q returned beside the output (explain() says
    why those three projections were not packed), k changed after its projection:
    attention is fused on q, k, v as they are, not packed."""
    x, y = normal(0, (B, S, E)), normal(1, (B, S, E))
    w, b = normal(2, (3, E, H, D)) * 0.2, normal(3, (3, H, D))

    def cross(x, y, w, b):
        return attn_bshd(*(_projected(x, y, w, b, i) for i in range(3)))

    def q_returned(x, w, b):
        q, k, v = (_projected(x, x, w, b, i) for i in range(3))
        return attn_bshd(q, k, v), q

    def k_unbiased(x, w, b):
        q, k, v = (_projected(x, x, w, b, i) for i in range(3))
        return attn_bshd(q, k - b[1], v)

    why = {cross: None, q_returned: "q/k/v projection float32[2, 8, 4, 16] (add) is returned as an output",
           k_unbiased: None}
    for f, args in ((cross, (x, y, w, b)), (q_returned, (x, w, b)), (k_unbiased, (x, w, b))):
        report = jaxsub.explain(f, *args)
        assert report.totals == {"attention": 1} and "attention_packed" not in str(report), str(report)
        # explain() says why three projections of one input were not packed.
        assert ("not packed" in str(report)) == (why[f] is not None), str(report)
        assert why[f] is None or f"not packed: {why[f]}" in str(report), str(report)
        assert _packed_targets(f, *args) == {"jaxsub_attention_fwd": 1, "jaxsub_attention_qkv_fwd": 0}
        outs, refs = jax.tree.leaves(jaxsub.optimize(f)(*args)), jax.tree.leaves(f(*args))
        for o, r in zip(outs, refs):
            assert_close(o, r, reduction=S * D)


# ---------------------------------------------------------------------------------------
# Dropout on the probabilities.


def attn_dropout(q, k, v, key):
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D))
    p = jnp.where(jax.random.bernoulli(key, 1.0 - RATE, p.shape), p / (1.0 - RATE), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def test_dropout_uses_the_users_key():
    q, k, v = qkv_inputs()
    key = jax.random.key(3)
    opt = jaxsub.optimize(attn_dropout)
    out = jax.jit(opt)(q, k, v, key)
    assert attention_counts(opt, q, k, v, key) == 1
    assert "dropout rate=0.25" in str(jaxsub.explain(attn_dropout, q, k, v, key))
    assert_close(out, ops.attention(q, k, v, dropout_rate=RATE, key=key), reduction=S * D)
    np.testing.assert_array_equal(out, jax.jit(opt)(q, k, v, key))
    assert np.mean(np.asarray(out != jax.jit(opt)(q, k, v, jax.random.key(4)))) > 0.5
    kept = np.asarray(ops.dropout_mask(key, (B, H, S, S), RATE))
    sigma = np.sqrt(kept.size * RATE * (1 - RATE))
    assert abs((~kept).sum() - kept.size * RATE) < 5 * sigma


def test_rewrite_dropout_false_leaves_attention_alone():
    q, k, v = qkv_inputs()
    key = jax.random.key(3)
    opt = jaxsub.optimize(attn_dropout, rewrite_dropout=False)
    assert_close(jax.jit(opt)(q, k, v, key), jax.jit(attn_dropout)(q, k, v, key), reduction=S * D)
    report = jaxsub.explain(opt, q, k, v, key)
    assert [m.detail for m in report.near_misses] == ["dropout not rewritten (rewrite_dropout=False)"]
    # The softmax before the user's dropout is still fused, without the dropout.
    assert report.totals == {"softmax_dropout": 1} and "no dropout" in str(report)


def _linen_dropout(broadcast):
    m, params, x = _linen(dropout_rate=RATE, deterministic=False, broadcast_dropout=broadcast)

    def f(params, x, key):
        return m.apply(params, x, rngs={"dropout": key})

    return f, (params, x, jax.random.key(1))


def test_flax_linen_dropout():
    f, args = _linen_dropout(broadcast=False)
    opt = jaxsub.optimize(f)
    assert attention_counts(opt, *args) == 1
    assert jaxsub.explain(f, *args).totals == {"attention": 1}
    out = jax.jit(opt)(*args)
    np.testing.assert_array_equal(out, jax.jit(opt)(*args))
    assert np.isfinite(np.asarray(out)).all()
    other = jax.jit(opt)(*args[:2], jax.random.key(2))
    assert np.mean(np.asarray(out != other)) > 0.5


def test_flax_linen_broadcast_dropout():
    """Flax's default, one [1, 1, Sq, Sk] dropout mask for every batch and head, becomes the
    op's broadcast_dropout (it was a near-miss that kept only the softmax fused)."""
    f, args = _linen_dropout(broadcast=True)
    report = jaxsub.explain(f, *args)
    assert report.totals == {"attention": 1} and not report.near_misses, str(report)
    assert "broadcast_dropout" in str(report)
    opt = jaxsub.optimize(f)
    assert attention_counts(opt, *args) == 1
    out = jax.jit(opt)(*args)
    np.testing.assert_array_equal(out, jax.jit(opt)(*args))
    assert np.isfinite(np.asarray(out)).all()


def flax_attention(q, k, v, key, broadcast=True):
    return nn.dot_product_attention(q, k, v, dropout_rng=key, dropout_rate=RATE, deterministic=False,
                                    broadcast_dropout=broadcast)


@pytest.mark.parametrize("broadcast", [True, False])
def test_flax_dot_product_attention_dropout_uses_the_users_key(broadcast):
    """nn.dot_product_attention with its dropout key: the op with that key and the same
    mask structure (shared by every batch and head, or one per element)."""
    q, k, v = qkv_inputs()
    key = jax.random.key(3)
    f = functools.partial(flax_attention, broadcast=broadcast)
    opt = jaxsub.optimize(f)
    assert attention_counts(opt, q, k, v, key) == 1
    want = ops.attention(q, k, v, dropout_rate=RATE, key=key, broadcast_dropout=broadcast)
    assert_close(jax.jit(opt)(q, k, v, key), want, reduction=S * D)
    other = ops.attention(q, k, v, dropout_rate=RATE, key=key, broadcast_dropout=not broadcast)
    assert np.abs(np.asarray(want, np.float32) - np.asarray(other, np.float32)).max() > 0.1


@pytest.mark.parametrize("spelling", ["where", "mul", "mul_scaled_mask", "scaled_mul", "where_then_scale"])
def test_dropout_with_a_two_dimensional_mask_is_broadcast_dropout(spelling):
    """A [Sq, Sk] mask that jnp.where broadcasts (a broadcast_in_dim to the probabilities'
    rank) is the same shared mask; so is one that a product promotes to [1, 1, Sq, Sk]
    (a broadcast_in_dim to that shape, after the mask's convert or its scale: missed until
    a probe round)."""
    def f(q, k, v, key):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(D)), -1)
        keep = jax.random.bernoulli(key, 1.0 - RATE, p.shape[2:])
        p = {"where": lambda: jnp.where(keep, p / (1.0 - RATE), 0.0),
             "mul": lambda: p * keep / (1.0 - RATE),
             "mul_scaled_mask": lambda: p * (keep.astype(p.dtype) / (1.0 - RATE)),
             "scaled_mul": lambda: p * (1.0 / (1.0 - RATE)) * keep,
             "where_then_scale": lambda: jnp.where(keep, p, 0.0) / (1.0 - RATE)}[spelling]()
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    q, k, v = qkv_inputs()
    key = jax.random.key(5)
    opt = jaxsub.optimize(f)
    assert attention_counts(opt, q, k, v, key) == 1
    assert "broadcast_dropout" in str(jaxsub.explain(f, q, k, v, key))
    want = ops.attention(q, k, v, dropout_rate=RATE, key=key, broadcast_dropout=True)
    assert_close(jax.jit(opt)(q, k, v, key), want, reduction=S * D)


def test_dropout_broadcast_over_the_batch_only_is_a_near_miss():
    """A mask [1, H, Sq, Sk] (shared by the batch, not by the heads) is neither of the op's
    two draws: the attention is left to XLA and explain says why."""
    def f(q, k, v, key):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(D)), -1)
        keep = jax.random.bernoulli(key, 1.0 - RATE, (1, *p.shape[1:]))
        return jnp.einsum("bhqk,bkhd->bqhd", p * keep / (1.0 - RATE), v)

    args = (*qkv_inputs(), jax.random.key(1))
    report = jaxsub.explain(f, *args)
    assert any("other than over every batch and head axis" in m.detail for m in report.near_misses), str(report)
    assert "attention" not in report.totals
    assert_close(jaxsub.optimize(f)(*args), f(*args), reduction=S * D)


def test_dropout_scaled_after_the_product_is_a_near_miss_saying_so():
    """A full-size keep mask on the probabilities whose 1 / (1 - rate) comes after the
    product with v: explain said the mask "is broadcast over the probabilities" while
    printing two equal shapes (found by probing)."""
    def f(q, k, v, key):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(D)), -1)
        keep = jax.random.bernoulli(key, 0.9, p.shape)
        return jnp.einsum("bhqk,bkhd->bqhd", p * keep, v) / 0.9

    args = (*qkv_inputs(), jax.random.key(1))
    report = jaxsub.explain(f, *args)
    details = [m.detail for m in report.near_misses]
    assert any("without its 1 / (1 - rate) scale" in d for d in details), str(report)
    assert not any("broadcast over" in d for d in details), str(report)
    assert_close(jaxsub.optimize(f)(*args), f(*args), reduction=S * D)


def test_flax_linen_dropout_under_vmap_over_keys_is_a_near_miss():
    """Per-example keys (jax.vmap over keys): the attention's dropout stays the user's and
    explain says why, where optimize raised "`key` must be a single PRNG key"."""
    f, (params, x, _) = _linen_dropout(broadcast=False)
    keys = jax.random.split(jax.random.key(4), 2)
    g = jax.vmap(f, in_axes=(None, 0, 0))
    xs = jnp.stack([x, -x])
    report = jaxsub.explain(g, params, xs, keys)
    assert any("one key per example" in m.detail for m in report.near_misses), str(report)
    assert_close(jax.jit(jaxsub.optimize(g))(params, xs, keys), jax.jit(g)(params, xs, keys), reduction=S * D)


# ---------------------------------------------------------------------------------------
# Partial matches and near-misses.


def test_softmax_only_when_scores_are_not_a_contraction():
    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.tanh(s)), v)

    check_attention(f, qkv_inputs(), {"softmax_dropout": 1})


def test_probabilities_returned_is_a_near_miss():
    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p

    args = qkv_inputs()
    report = jaxsub.explain(f, *args)
    assert any("attention probabilities" in m.detail and "returned as an output" in m.detail
               for m in report.near_misses), str(report)
    assert report.totals == {"softmax_dropout": 1}
    for o, r in zip(jaxsub.optimize(f)(*args), f(*args)):
        assert_close(o, r, reduction=S * D)


def test_softmax_over_another_axis_is_a_near_miss():
    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-2)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    args = qkv_inputs()
    report = jaxsub.explain(f, *args)
    assert report.matches == [] and "not the last" in report.near_misses[0].detail
    assert attention_counts(jaxsub.optimize(f), *args) == 0
    assert_close(jaxsub.optimize(f)(*args), f(*args), reduction=S * D)


def test_top_left_causal_is_a_generic_mask(softmax_flag):
    """jax's is_causal aligns the diagonal top-left; jaxsub's causal is bottom-right, so with
    Sq < Sk the constant mask is passed as a mask, not as causal=True."""
    def f(q, k, v):
        return jax.nn.dot_product_attention(q[:, :3], k, v, is_causal=True, implementation="xla")

    report = check_attention(f, qkv_inputs(), {"attention": 1})
    softmax_form(softmax_flag, f, qkv_inputs(), report)
    detail = report.matches[0].detail
    assert "causal" not in detail and "boolean mask bool[3, 8]" in detail
