"""jaxsub.optimize on attention: softmax(Q Kᵀ scale + mask) (dropout) V -> jaxsub.ops.attention.

Each source (hand-written jnp in both layouts, jax.nn.dot_product_attention, flax linen
and nnx attention) is optimized and compared with the original: outputs and gradients
within the jaxsub.testing tolerance, the number of attention/softmax forward targets
in the lowered HLO (`jaxsub_softmax_dropout_fwd` for the unfused path and lone softmaxes,
`jaxsub_attention_fwd` for the fused path, `jaxsub_attention_qkv_fwd` for it on q, k, v
sliced from one array: which one runs is the `layouts=` selection's choice), and
explain()'s report. With dropout,
the result is compared with jaxsub.ops.attention for the key the user's code used.
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
from test_optimize import _assert_same


B, S, H, D = 2, 8, 4, 16
E = H * D
RATE = 0.25
TARGETS = ("jaxsub_softmax_dropout_fwd", "jaxsub_attention_fwd", "jaxsub_attention_qkv_fwd")

# An attention output depends on a projection's sum over E and the probabilities' sum over
# S keys, chained: f32 rounding differences between the fused ops and XLA grow with both.
# On one CPU (AMD EPYC, XLA 0.10.2) the weight gradient of the packed projection missed
# the tolerance of a 32-element sum by 1.5% at one element of 12 288.
ATTENTION_REDUCTION = E * S


def assert_same(f, args, argnums=(0,)):
    _assert_same(f, args, argnums=argnums, reduction=ATTENTION_REDUCTION)


def _normal(i, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(i).standard_normal(shape, np.float32).astype(dtype))


def _qkv(layout="bshd"):
    shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    return tuple(_normal(i, shape) for i in range(3))


def _padding(seed=7):
    """[B, S] key padding with at least one visible key per row."""
    m = np.random.default_rng(seed).random((B, S)) > 0.4
    m[:, 0] = True
    return jnp.asarray(m)


def _count(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return sum(text.count(f"@{t}(") for t in TARGETS)


def _softmax_form(flag, f, args, report):
    """The program holds jax.nn.softmax's call exactly under the flag, and the pass saw into it."""
    assert ("custom_jvp_call" in str(jax.make_jaxpr(f)(*args))) == flag
    assert not report.unsearched, str(report)


def _check(f, args, totals, argnums=(0, 1, 2)):
    """optimize(f) == f in value and gradients; one fused attention or softmax per match;
    explain."""
    assert_same(f, args, argnums=argnums)
    opt = jaxsub.optimize(f)
    assert _count(opt, *args) == sum(totals.values())
    report = jaxsub.explain(f, *args)
    assert dict(report.totals) == totals, str(report)
    return report


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
    x, w = _normal(0, (B, S, E)), _normal(1, (E, 3, H, D)) * 0.2
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
    assert_same(swapped, (x, w), argnums=(0, 1))


def attn_packed_biased(x, w, b):
    """attn_packed_slices without dropout, with the projection's [3, H, D] bias added."""
    qkv = jnp.einsum("bse,ethd->bsthd", x, w) + b
    return attn_bshd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])


def _grad_text(f, args, argnums):
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * _normal(9, (B, S, H, D))), argnums)).lower(*args).as_text()


def test_packed_projection_bias_gradient_by_bias_add():
    """The bias of the packed q/k/v array goes through ops.bias_add: its gradient is the
    fused column sum (jaxsub_bias_grad); values and gradients as the original's."""
    x, w, b = _normal(0, (B, S, E)), _normal(1, (E, 3, H, D)) * 0.2, _normal(2, (3, H, D))
    report = _check(attn_packed_biased, (x, w, b), {"attention": 1})
    assert "its bias float32[3, 4, 16] added by ops.bias_add" in str(report), str(report)
    assert "@jaxsub_bias_grad(" in _grad_text(jaxsub.optimize(attn_packed_biased), (x, w, b), (2,))

    # Read by something else besides the slices: the add stays the user's.
    def also_returned(x, w, b):
        qkv = jnp.einsum("bse,ethd->bsthd", x, w) + b
        return attn_bshd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]) + qkv[:, :, 0]

    assert "ops.bias_add" not in str(jaxsub.explain(also_returned, x, w, b))
    assert_same(also_returned, (x, w, b), argnums=(0, 1, 2))


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


def test_hand_written_bshd():
    report = _check(attn_bshd, _qkv(), {"attention": 1})
    assert "scale=0.25" in str(report) and "no dropout" in str(report)


def test_hand_written_bhsd_with_where_mask():
    report = _check(attn_bhsd_written_out, (*_qkv("bhsd"), _padding()), {"attention": 1})
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

    args = tuple(a.astype(dtype) for a in _qkv("bhsd"))
    report = jaxsub.explain(f, *args)
    assert dict(report.totals) == {"attention": 1} and "causal" in str(report), str(report)
    _assert_same(f, args, dtype=dtype, argnums=(0, 1, 2), reduction=ATTENTION_REDUCTION)


def test_a_mask_added_after_a_where_must_not_lift_its_fill():
    """where(causal, s, -1e4) + where(causal, 0, 2e4) ends the hidden scores at +1e4: it was
    fused as causal attention, 2.9 off (found by probing). The added mask's bounds decide:
    lifted, or of unknown range after a -1e4 fill, it is a near-miss (the softmax alone
    fused); a padding mask built from booleans, or any mask after a -1e9 fill, is fused."""
    causal = jnp.tril(jnp.ones((S, S), bool))
    valid, extra = _padding(), _normal(5, (B, 1, 1, S))

    def attn(fill, added):
        def f(q, k, v, valid, extra):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(causal, s, fill) + added(valid, extra)), v)
        return f

    lifted = attn(-1e4, lambda valid, extra: jnp.where(causal, 0.0, 2e4))
    unknown = attn(-1e4, lambda valid, extra: extra)
    for f in (lifted, unknown):
        report = jaxsub.explain(f, *_qkv(), valid, extra)
        assert dict(report.totals) == {"softmax_dropout": 1}, str(report)
        assert "may lift the hidden scores" in str(report), str(report)
        assert_same(f, (*_qkv(), valid, extra), argnums=(0, 1, 2))
    padding = attn(-1e4, lambda valid, extra: (1.0 - valid[:, None, None, :]) * -1e9)
    far = attn(-1e9, lambda valid, extra: extra)
    for f in (padding, far):
        report = jaxsub.explain(f, *_qkv(), valid, extra)
        assert dict(report.totals) == {"attention": 1} and "causal" in str(report), str(report)
        assert_same(f, (*_qkv(), valid, extra), argnums=(0, 1, 2))


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

    assert dict(jaxsub.explain(f, *_qkv()).totals) == {"softmax_dropout": 1}
    assert_same(f, _qkv(), argnums=(0, 1, 2))


@pytest.mark.parametrize("shape", [(1, H, S, D), (B, 1, S, D), (1, 1, S, D)], ids=["batch1", "head1", "both1"])
def test_matmul_attention_with_a_unit_batch_or_head(shape):
    """jnp.matmul squeezes a unit batch axis away and broadcasts it back around its
    dot_general, which the matcher did not look through: `@` attention at batch 1 (the
    usual inference shape) or one head fused only its softmax (found by probing)."""
    def f(q, k, v):
        s = q @ jnp.swapaxes(k, -1, -2) / float(np.sqrt(D))
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
        return jax.nn.softmax(s, -1) @ v

    args = tuple(_normal(i, shape) for i in range(3))
    report = _check(f, args, {"attention": 1})
    assert "causal" in str(report)


def test_softmax_with_where(softmax_flag):
    """jax.nn.softmax(s, where=mask) in attention and alone: nothing was matched (found by
    probing). It is the softmax of where(mask, s, -inf) whose hidden rows are zeros, as
    the fused ops give them, so even a row the mask hides everywhere agrees."""
    valid = np.array(_padding())
    valid[1] = False  # a batch row whose keys are all hidden
    valid = jnp.asarray(valid)

    def attn(q, k, v, valid):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        p = jax.nn.softmax(s, -1, where=valid[:, None, None, :])
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    def alone(s, valid):
        return jax.nn.softmax(s, -1, where=valid[:, None, None, :])

    report = _check(attn, (*_qkv(), valid), {"attention": 1})
    assert "boolean mask" in str(report) and "fully-masked rows give" not in str(report), str(report)
    _softmax_form(softmax_flag, attn, (*_qkv(), valid), report)
    scores = _normal(4, (B, H, S, S))
    report = jaxsub.explain(alone, scores, valid)
    assert report.totals == {"softmax_dropout": 1}
    _softmax_form(softmax_flag, alone, (scores, valid), report)
    assert_same(alone, (scores, valid))
    out = jaxsub.optimize(alone)(scores, valid)
    assert not np.asarray(out[1]).any() and np.isfinite(np.asarray(out)).all()


def test_softmax_with_where_of_lower_rank_or_under_vmap(softmax_flag):
    """where= with a mask of lower rank than the scores ([Sq, Sk] or [Sk] on [B, H, Sq, Sk],
    broadcast as numpy does), and where= under jax.vmap (the mask closed over or batched
    too). Under jax_softmax_custom_jvp the mask is broadcast inside the call, once or, under
    vmap, twice, or to axes not the trailing ones: found by probing, nothing was fused there."""
    rng = np.random.default_rng(12)
    causal = jnp.asarray(np.tril(np.ones((S, S), bool)))
    keys = jnp.asarray(rng.random(S) > 0.4).at[0].set(True)
    padding = _padding()[:, None, None, :]

    def attn(mask):
        def f(q, k, v):
            p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5, where=mask)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return f

    scores = _normal(4, (B, H, S, S))
    for mask in (causal, keys):
        report = _check(attn(mask), _qkv(), {"attention": 1})
        _softmax_form(softmax_flag, attn(mask), _qkv(), report)
        alone = functools.partial(jax.nn.softmax, where=mask)
        report = jaxsub.explain(alone, scores)
        assert report.totals == {"softmax_dropout": 1}, str(report)
        _softmax_form(softmax_flag, alone, (scores,), report)
        assert_same(alone, (scores,))
    stacked = tuple(jnp.stack([a, a[::-1] * 0.5]) for a in _qkv())
    closed_over = jax.vmap(attn(padding))
    report = _check(closed_over, stacked, {"attention": 1})
    _softmax_form(softmax_flag, closed_over, stacked, report)
    masks = jnp.stack([padding, padding[::-1]])

    def batched(q, k, v, m):
        return attn(m)(q, k, v)

    _check(jax.vmap(batched), (*stacked, masks), {"attention": 1})

    # One [S] key mask per example under vmap: broadcast inside the call to axes (0, 3)
    def one(q, k, v, m):
        p = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) * D ** -0.5, where=m)
        return jnp.einsum("hqk,khd->qhd", p, v)

    _check(jax.vmap(one), (*_qkv(), _padding()), {"attention": 1})
    # ... and with in_axes=1 on the mask (transposed inside the call)
    _check(jax.vmap(one, in_axes=(0, 0, 0, 1)), (*_qkv(), _padding().T), {"attention": 1})
    where = lambda s, m: jax.nn.softmax(s, where=m)  # noqa: E731
    odd = _normal(5, (B, H, S - 1, S + 2))
    mask = jnp.asarray(rng.random((S - 1, S + 2)) > 0.3)
    for f, args in ((jax.vmap(where), (scores, _padding())),
                    (jax.vmap(where, in_axes=(0, 1)), (scores, _padding().T)),
                    # the scores transposed inside the call, then masked
                    (jax.vmap(functools.partial(jax.nn.softmax, where=mask), in_axes=1), (odd,))):
        report = jaxsub.explain(f, *args)
        assert report.totals == {"softmax_dropout": 1}, str(report)
        assert_same(f, args)


def test_softmax_dropout_under_vmap_over_per_example_keys_is_a_near_miss():
    """softmax + dropout alone under jax.vmap over per-example keys: the softmax is fused,
    the dropout stays the user's and explain says why (found by probing: nothing said)."""
    def f(s, key):
        p = jax.nn.softmax(s, -1)
        return jnp.where(jax.random.bernoulli(key, 1.0 - RATE, p.shape), p / (1.0 - RATE), 0.0)

    scores, keys = _normal(4, (3, H, S, S)), jax.random.split(jax.random.key(2), 3)
    report = jaxsub.explain(jax.vmap(f), scores, keys)
    assert report.totals == {"softmax_dropout": 1} and "no dropout" in report.matches[0].detail, str(report)
    assert any("is one key per example" in m.detail for m in report.near_misses), str(report)
    assert_same(jax.vmap(f), (scores, keys))


@pytest.mark.parametrize("in_axes", [1, 3])
def test_vmapped_softmax_over_another_axis(softmax_flag, in_axes):
    """jax.vmap(jax.nn.softmax, in_axes=1) alone: the softmax of a transpose, which under
    jax_softmax_custom_jvp lies inside the call (found by probing: not fused with the flag).
    The fused op normalizes the transposed scores' last axis, as the program does."""
    scores = _normal(4, (B, H, S + 1, S + 3))
    f = jax.vmap(jax.nn.softmax, in_axes=in_axes)
    report = jaxsub.explain(f, scores)
    assert report.totals == {"softmax_dropout": 1}, str(report)
    _softmax_form(softmax_flag, f, (scores,), report)
    assert_same(f, (scores,))


def test_softmax_with_its_numerator_computed_twice():
    """exp(s - m) / exp(s - m).sum(-1): two equal exponentials (found by probing: not
    matched); one softmax, alone and in attention."""
    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        m = s.max(-1, keepdims=True)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - m) / jnp.exp(s - m).sum(-1, keepdims=True), v)

    def alone(s):
        return jnp.exp(s - s.max(-1, keepdims=True)) / jnp.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)

    _check(attn, _qkv(), {"attention": 1})
    scores = _normal(4, (B, H, S, S))
    assert jaxsub.explain(alone, scores).totals == {"softmax_dropout": 1}
    assert_same(alone, (scores,))


LOG_SPACE = {
    "logsumexp": lambda s: jnp.exp(s - jax.nn.logsumexp(s, -1, keepdims=True)),
    "logsumexp_row": lambda s: jnp.exp(s - jax.nn.logsumexp(s, axis=3)[..., None]),
    "log_softmax": lambda s: jnp.exp(jax.nn.log_softmax(s)),
    "unshifted": lambda s: jnp.exp(s - jnp.log(jnp.exp(s).sum(-1, keepdims=True))),
    "max_twice": lambda s: jnp.exp(s - (jnp.log(jnp.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True))
                                        + s.max(-1, keepdims=True))),
}


@pytest.mark.parametrize("form", sorted(LOG_SPACE))
def test_softmax_in_log_space(form):
    """exp(s - logsumexp(s)), exp(log_softmax(s)) and their written-out forms are the
    softmax (found by probing: not matched); alone, in attention, and with a row whose
    keys are all hidden (NaN in the original, zeros fused, as for jax.nn.softmax)."""
    sm = LOG_SPACE[form]

    def attn(q, k, v):
        return jnp.einsum("bhqk,bkhd->bqhd", sm(jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5), v)

    _check(attn, _qkv(), {"attention": 1})
    scores = _normal(4, (B, H, S, S))
    assert jaxsub.explain(sm, scores).totals == {"softmax_dropout": 1}
    assert_same(sm, (scores,))
    hidden = scores.at[1, 2, 3].set(-jnp.inf)
    out = np.asarray(jaxsub.optimize(sm)(hidden))
    assert not out[1, 2, 3].any() and np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", sorted(LOG_SPACE))
def test_softmax_in_log_space_16_bit(form, dtype):
    """In bf16/f16, jax.nn.logsumexp and log_softmax sum the exponentials in f32 and narrow
    the sum before the log: those converts belong to the softmax (found by fuzzing: fused in
    f32 only, with no word in bf16)."""
    sm = LOG_SPACE[form]

    def attn(q, k, v):
        return jnp.einsum("bhqk,bkhd->bqhd", sm(jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5), v)

    args = tuple(a.astype(dtype) for a in _qkv())
    assert jaxsub.explain(attn, *args).totals == {"attention": 1}
    _assert_same(attn, args, dtype, argnums=(0, 1, 2), reduction=ATTENTION_REDUCTION)


def _times_reciprocal(s):
    e = jnp.exp(s - s.max(-1, keepdims=True))
    return e * (1.0 / e.sum(-1, keepdims=True))


def _reciprocal(s):
    e = jnp.exp(s)
    return e * jnp.reciprocal(e.sum(-1, keepdims=True))


def _shifted_by_hand(s):
    return jax.nn.softmax(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)), -1)


def _shifted_transposed(s):  # the shift on [B, H, Sk, Sq] scores, the softmax after a transpose
    st = jnp.swapaxes(s, -1, -2)
    return jax.nn.softmax(jnp.swapaxes(st - st.max(-2, keepdims=True), -1, -2), -1)


@pytest.mark.parametrize("sm", [_times_reciprocal, _reciprocal, _shifted_by_hand, _shifted_transposed],
                         ids=["times_reciprocal", "reciprocal", "shifted_by_hand", "shifted_transposed"])
def test_softmax_spelled_with_a_reciprocal_or_shifted_by_hand(sm):
    """e * (1 / sum(e)) was not a softmax, and jax.nn.softmax(s - max(s)) was an attention
    near-miss saying the scores were "also used elsewhere" (found by probing): the shift
    by the row maximum is one the softmax does not see."""
    def attn(q, k, v):
        return jnp.einsum("bhqk,bkhd->bqhd", sm(jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5), v)

    report = _check(attn, _qkv(), {"attention": 1})
    assert "1 match(es), 0 near-miss(es)" in str(report), str(report)
    scores = _normal(4, (B, H, S, S))
    assert_same(sm, (scores,))


@pytest.mark.parametrize("fn", [
    lambda s: jnp.exp(s - (jnp.log(jnp.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True))
                           + 0.5 * s.max(-1, keepdims=True))),  # another shift added back
    lambda s: jnp.exp(s - jnp.log(jnp.exp(s).sum(-1, keepdims=True) + 1.0)),  # not the sum's log
    lambda s: jnp.exp(s - jnp.log(jnp.exp(s + 1.0).sum(-1, keepdims=True))),  # another exponent
    lambda s: jnp.exp(s - jax.nn.logsumexp(s, axis=(2, 3), keepdims=True)),  # two axes
], ids=["shift", "plus_one", "exponent", "two_axes"])
def test_log_space_look_alikes_are_left_alone(fn):
    scores = _normal(4, (B, H, S, S))
    assert jaxsub.explain(fn, scores).totals == {}
    assert_same(fn, (scores,))


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
        _check(f, _qkv(), {"attention": 1})
    closed = jax.make_jaxpr(jaxsub.optimize(remat))(*_qkv())
    jaxpr = str(closed)
    assert "name=out" in jaxpr and "name=scores" not in jaxpr
    # the user's policy kept (jax 0.12.1's save_only_these_names is a closure, no
    # SaveOnlyTheseNames object, so it is compared itself)
    assert [e.params["policy"] for e in closed.jaxpr.eqns if "policy" in e.params] == [policy]

    def named_softmax(s):
        return jax.nn.softmax(checkpoint_name(s * 2.0, "s2"), -1), checkpoint_name(s, "raw")

    scores = _normal(4, (B, H, S, S))
    assert jaxsub.explain(named_softmax, scores).totals == {"softmax_dropout": 1}
    assert "name=raw" in str(jax.make_jaxpr(jaxsub.optimize(named_softmax))(scores))


def test_near_misses_say_why_rounding_head_dims_or_checkpoint():
    """Three attentions left alone without a word (found by probing): an f32 attention whose
    scores are rounded to bf16 (the fused op would not round them: dropping it changed the
    output by ~1e-2), v with another head dim than q and k, and a softmax checkpointed
    apart from the scores' product."""
    q, k, v = _qkv()

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
        assert_same(f, (q, k, v), argnums=(0, 1, 2))


def test_vmapped_attention_fuses_with_its_batch_axes_folded():
    """A per-example attention under jax.vmap inside the optimized function has three or
    four batch axes in its products: they fold into the op's batch (it had fused only the
    softmax, then been a near-miss), with a key padding mask that varies over one of them."""
    def one(q, k, v, m):
        s = jnp.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(jnp.where(m[None, None], s, -1e9), -1), v)

    qkv = tuple(a[None].repeat(3, 0) * (1 + 0.5 * np.arange(3)[:, None, None, None, None]) for a in _qkv())
    mask = _padding()  # [B, S]
    twice = jax.vmap(jax.vmap(one), in_axes=(0, 0, 0, None))  # [3, B, S, H, D], the mask over B only
    report = _check(twice, (*qkv, mask), {"attention": 1}, argnums=(0, 1, 2))
    assert "k float32[3, 2, 8, 4, 16]" in str(report) and "boolean mask bool[2, 8]" in str(report), str(report)
    thrice = jax.vmap(twice, in_axes=(0, 0, 0, None))
    args4 = (*(a[None].repeat(2, 0) for a in qkv), mask)
    _check(thrice, args4, {"attention": 1}, argnums=(0, 1, 2))


def test_windowed_attention_with_three_batch_axes():
    """Windowed attention written on [B, W, H, N, D] (a Swin-style shifted-window mask, one
    additive [W, N, N] per window, broadcast over batch and heads), with a causal mask and
    dropout; the windows fold into the op's batch."""
    W, N = 3, 5
    q, k, v = (_normal(i, (B, W, H, N, D)) for i in range(3))
    shift = jnp.asarray(np.where(np.random.default_rng(3).random((W, N, N)) > 0.3, 0.0, -100.0), jnp.float32)
    causal = jnp.tril(jnp.ones((N, N), bool))

    def windows(q, k, v, shift):
        s = jnp.einsum("bwhqd,bwhkd->bwhqk", q, k) / np.sqrt(D) + shift[None, :, None]
        s = jnp.where(causal, s, -jnp.inf)
        return jnp.einsum("bwhqk,bwhkd->bwhqd", jax.nn.softmax(s, -1), v)

    report = _check(windows, (q, k, v, shift), {"attention": 1}, argnums=(0, 1, 2, 3))
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


def _scores_times(scale, div=False):
    def f(q, k, v, t):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = s / scale(t) if div else s * scale(t)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    return f


def _cosine(q, k, v, t):
    """Swin-v2's scaled cosine attention: a learned per-head logit scale on normalized q, k."""
    norm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    s = jnp.einsum("bqhd,bkhd->bhqk", norm(q), norm(k)) * jnp.exp(t[:H])[None, :, None, None]
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


RUNTIME_SCALES = {
    "temperature": (_scores_times(lambda t: t[0]), "q multiplied by float32[]"),
    "divided": (_scores_times(lambda t: t[0], div=True), "q divided by float32[]"),
    "dot_product_attention": (lambda q, k, v, t: jax.nn.dot_product_attention(q, k, v, scale=t[0]),
                              "q multiplied by float32[]"),
    "per_head": (_cosine, f"q multiplied by float32[{H}]"),
    "per_query": (_scores_times(lambda t: t[:S][None, None, :, None]), f"q multiplied by float32[{S}]"),
    "per_key": (_scores_times(lambda t: t[:S][None, None, None, :]), f"k multiplied by float32[{S}]"),
}


@pytest.mark.parametrize("case", sorted(RUNTIME_SCALES))
def test_scores_scaled_at_run_time_fold_into_q_or_k(case):
    """A temperature computed at run time (jax.nn.dot_product_attention(scale=tracer), a
    learned per-head scale) fused only the softmax, with no note (found by probing): the
    fused op's scale is a constant. A scale that varies over queries (or keys) alone is
    q's (or k's): it is applied to q (k) before the op; values and gradients, the scale's
    included, equal the original's."""
    f, what = RUNTIME_SCALES[case]
    args = (*_qkv(), jnp.linspace(0.2, 0.9, S + H))
    # The scale's gradient sums over every score: B·H·S·S products of D terms.
    _assert_same(f, args, argnums=(0, 1, 2, 3), reduction=B * H * S * S * D)
    assert _count(jaxsub.optimize(f), *args) == 1
    report = jaxsub.explain(f, *args)
    assert dict(report.totals) == {"attention": 1} and what in str(report), str(report)


def test_scores_scaled_at_run_time_over_both_sides_or_after_a_mask_are_near_misses():
    t = jnp.linspace(0.2, 0.9, S * S).reshape(S, S)
    both = _scores_times(lambda t: t)

    def after_mask(q, k, v, t):
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9) * t[0, 0]
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    for f, why in ((both, "varying over queries and keys"), (after_mask, "masked scores are scaled")):
        report = jaxsub.explain(f, *_qkv(), t)
        assert dict(report.totals) == {"softmax_dropout": 1} and why in str(report), str(report)
        assert_same(f, (*_qkv(), t), argnums=(0, 1, 2, 3))


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "gqa"])
def test_dot_product_attention_causal_at_large_shapes(kv_heads):
    """jax.nn.dot_product_attention(is_causal=True) with grouped k and v ands its triangle
    with an all-True broadcast of the scores' shape; past 2^22 elements that broadcast was
    not evaluated, so the triangle went in as a general boolean mask of that shape (found
    on the H200: B 4, S 2048 ran the masked path). The ungrouped form too. Only traced
    here (explain)."""
    shape = (4, 1024, 4, 8)
    args = (jnp.zeros(shape), jnp.zeros(shape[:2] + (kv_heads, 8)), jnp.zeros(shape[:2] + (kv_heads, 8)))
    report = jaxsub.explain(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                       implementation="xla"), *args)
    assert report.totals == {"attention": 1}, str(report)
    assert "causal" in str(report) and "boolean mask" not in str(report), str(report)


_LONG_MASKS = {
    "tril": lambda n: jnp.tril(jnp.ones((n, n), bool)),
    "flax": lambda n: nn.make_causal_mask(jnp.ones((1, n))),
    "iota-upper": lambda n: ~(jnp.arange(n)[None, :] > jnp.arange(n)[:, None]),
    "difference": lambda n: (jnp.arange(n)[None, :] - jnp.arange(n)[:, None]) <= 0,
    "shifted": lambda n: jnp.arange(n)[None, :] <= jnp.arange(n)[:, None] + 1,
    "window": lambda n: (jnp.arange(n)[None, :] <= jnp.arange(n)[:, None])
    & (jnp.arange(n)[None, :] > jnp.arange(n)[:, None] - n // 4),
}


@pytest.mark.parametrize("n", [4096, 32768])
@pytest.mark.parametrize("name", list(_LONG_MASKS))
def test_triangle_at_long_sequences(name, n):
    """Constant masks are evaluated in broadcast form, the triangle's comparison of a query
    iota with a key iota kept lazy and checked per query: jnp.tril, flax's causal mask and
    an iota comparison are causal at S 32768 (the whole-array evaluator stopped at 2^26
    elements, S 8192, and took ~1 s there: the triangle went in as a boolean mask), and so
    is a difference of positions, (k - q) <= 0 (kept lazy as a sum). A diagonal one off is
    not causal; a sliding window is the triangle and a band (the conjunction is split).
    Only traced here (explain)."""
    causal, rest = name != "shifted", name in ("shifted", "window")

    def attn(q, k, v):
        m = _LONG_MASKS[name](n)
        s = jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    a = jnp.zeros((1, n, 1, 8), jnp.bfloat16)
    report = jaxsub.explain(attn, a, a, a)
    detail = report.matches[0].detail
    assert report.totals == {"attention": 1} and ("causal" in detail) == causal, str(report)
    assert ("boolean mask" in detail) == rest, str(report)


@pytest.mark.parametrize("n", [S, 16384])
def test_position_bias_at_long_sequences(n, monkeypatch):
    """An ALiBi-style bias slope * (k - q) with a causal triangle: past 2^26 elements the
    position difference is a lazy sum, which the mask bounds read (they raised
    AttributeError: found in review). At S 8 with every sum and comparison lazy, values and
    gradients equal the original's."""
    from jaxsub.rewrite import constants

    if n == S:
        monkeypatch.setattr(constants, "_EAGER", 0)
    heads = H if n == S else 2

    def attn(q, k, v):
        rel = (jnp.arange(n)[None, :] - jnp.arange(n)[:, None]).astype(jnp.float32)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + (0.5 ** jnp.arange(1, heads + 1))[:, None, None] * rel
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    args = _qkv() if n == S else (jnp.zeros((1, n, heads, 8), jnp.bfloat16),) * 3
    report = jaxsub.explain(attn, *args)
    assert report.totals == {"attention": 1} and "causal" in report.matches[0].detail, str(report)
    assert "additive mask" in report.matches[0].detail, str(report)
    if n == S:
        assert_same(attn, args, argnums=(0, 1, 2))


def test_lazy_triangle_check_decides_as_the_whole_one(monkeypatch):
    """The lazy comparison's per-query check, forced at a small S (every comparison lazy),
    decides as the whole-array one: values and gradients equal the original."""
    from jaxsub.rewrite import constants

    monkeypatch.setattr(constants, "_EAGER", 0)
    for name, causal in (("tril", True), ("flax", True), ("difference", True), ("shifted", False), ("window", True)):
        def attn(q, k, v, name=name):
            s = jnp.where(_LONG_MASKS[name](S), jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

        report = jaxsub.explain(attn, *_qkv())
        assert ("causal" in report.matches[0].detail) == causal, (name, str(report))
        assert_same(attn, _qkv(), argnums=(0, 1, 2))


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("spelling", ["where-inf", "one-minus", "finfo-min", "small-fill", "shifted-values", "upper",
                                      "above-hidden"])
def test_additive_triangle_spellings(spelling, lazy, monkeypatch):
    """An additive mask that is 0 on the triangle and a big negative above it (where(tril,
    0, -inf), (1 - tril) * -1e9, HF's (1 - mask) * finfo.min) is causal=True; it went in as
    an additive [S, S] mask. A fill of -100 (hidden keys keep a weight), visible values of
    1 (not 0) and the upper triangle stay additive masks; where(triu(1), -1e9, 0) is causal
    (jnp.triu's select makes a negated comparison, which the lazy form read the wrong way
    round in a select: found by fuzzing). Values and gradients equal the original's, also with every comparison
    kept lazy (as past 2^20 elements)."""
    from jaxsub.rewrite import constants

    if lazy:
        monkeypatch.setattr(constants, "_EAGER", 0)
    tril = lambda: jnp.tril(jnp.ones((S, S), bool))  # noqa: E731
    masks = {
        "where-inf": lambda: jnp.where(tril(), 0.0, -jnp.inf),
        "one-minus": lambda: (1.0 - tril().astype(jnp.float32)) * -1e9,
        "finfo-min": lambda: (1.0 - tril().astype(jnp.float32)) * jnp.finfo(jnp.float32).min,
        "small-fill": lambda: jnp.where(tril(), 0.0, -100.0),
        "shifted-values": lambda: jnp.where(tril(), 1.0, -1e9),
        "upper": lambda: jnp.where(jnp.triu(jnp.ones((S, S), bool)), 0.0, -1e9),
        "above-hidden": lambda: jnp.where(jnp.triu(jnp.ones((S, S), bool), 1), -1e9, 0.0),
    }
    causal = spelling not in ("small-fill", "shifted-values", "upper")

    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5 + masks[spelling]()
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    report = str(jaxsub.explain(attn, *_qkv()))
    assert dict(jaxsub.explain(attn, *_qkv()).totals) == {"attention": 1}, report
    assert ("causal" in report) == causal and ("additive mask" in report) == (not causal), report
    assert_same(attn, _qkv(), argnums=(0, 1, 2))


def test_additive_mask_scaled_after_it_stays_finite():
    """(s + (1 - valid) * finfo.min) * 2: the scale after the mask is folded into the op's
    mask, ((1 - valid) * finfo.min) * 2, which XLA reassociates into (1 - valid) * -inf:
    NaN at every visible key (found by fuzzing). Zeros of the mask now stay zeros."""
    def attn(q, k, v, valid):
        add = (1.0 - valid.astype(jnp.float32)[:, None, None, :]) * jnp.finfo(jnp.float32).min
        s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5 / 2 + add) * 2.0  # logits as the others'
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    args = (*_qkv(), _padding())
    assert dict(jaxsub.explain(attn, *args).totals) == {"attention": 1}
    assert bool(jnp.isfinite(jaxsub.optimize(attn)(*args)).all())
    assert_same(attn, args, argnums=(0, 1, 2))


def test_additive_triangle_lifted_back_stays_a_mask():
    """s + where(tril, 0, -1e4) followed by another additive mask that may lift the hidden
    scores back (a constant +1e4 above the diagonal; an input bias) is not causal, as
    where(tril, s, -1e4) + bias is not fused (the additive spelling was taken as causal:
    1.8 off, found by fuzzing). With -inf the input bias cannot lift it."""
    tril = lambda: jnp.tril(jnp.ones((S, S), bool))  # noqa: E731

    def lifted_by(fill, later):
        def attn(q, k, v, bias):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5 + jnp.where(tril(), 0.0, fill)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s + later(bias), -1), v)
        return attn

    bias = _normal(9, (1, H, S, S))
    for fill, later, causal in ((-1e4, lambda b: jnp.where(tril(), 0.0, 1e4), False), (-1e4, lambda b: b, False),
                                (-jnp.inf, lambda b: b, True)):
        f = lifted_by(fill, later)
        report = str(jaxsub.explain(f, *_qkv(), bias))
        assert ("causal" in report) == causal, report
        if fill == -jnp.inf or later(bias) is bias:
            assert_same(f, (*_qkv(), bias), argnums=(0, 1, 2))


def test_fill_scaled_down_after_the_where_is_a_near_miss():
    """where(mask, s, -1e4) * 0.5 leaves the hidden keys at -5000: not a boolean mask, so
    only the softmax fuses; explain said nothing (found by fuzzing)."""
    def scaled(q, k, v, pad):
        s = jnp.where(pad[:, None, None, :], jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e4) * 0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    report = jaxsub.explain(scaled, *_qkv(), _padding())
    assert dict(report.totals) == {"softmax_dropout": 1}, str(report)
    assert "is scaled after it to a fill of -5000, above -1e4" in str(report), str(report)
    assert_same(scaled, (*_qkv(), _padding()), argnums=(0, 1, 2))


@pytest.mark.parametrize("spelling", ["dpa-mask", "dpa-lengths", "where-and", "where-or-negated"])
def test_padding_and_triangle_are_split(spelling):
    """A causal triangle and-ed with a padding mask into one array (jax.nn.dot_product_attention
    with mask= or key_value_seq_lengths= and is_causal=True; hand-written pad & tril; a
    negated mask or-ed) went in as one [B, ..., S, S] boolean mask (found by fuzzing): the
    conjunction is now split, the triangle becomes causal=True and the padding stays a
    small mask. Values and gradients equal the original's."""
    pad, lengths = _padding(), jnp.asarray([5, S], jnp.int32)
    tril = lambda: jnp.tril(jnp.ones((S, S), bool))  # noqa: E731

    def attn(q, k, v):
        if spelling == "dpa-mask":
            return jax.nn.dot_product_attention(q, k, v, mask=pad[:, None, None, :], is_causal=True,
                                                implementation="xla")
        if spelling == "dpa-lengths":
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True,
                                                implementation="xla")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if spelling == "where-and":
            s = jnp.where(pad[:, None, None, :] & tril(), s, -1e9)
        else:
            s = jnp.where(~pad[:, None, None, :] | ~tril(), -jnp.inf, s)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    report = jaxsub.explain(attn, *_qkv())
    assert dict(report.totals) == {"attention": 1}, str(report)
    detail = report.matches[0].detail
    assert "causal" in detail and f"[{S}, {S}]" not in detail, str(report)
    assert_same(attn, _qkv(), argnums=(0, 1, 2))


def test_window_with_its_triangle_twice_keeps_one_mask():
    """dot_product_attention(is_causal=True, local_window_size=(w, 0)) ands the triangle twice
    (is_causal's and the window's k <= q half): both are causal=True, and only the window's
    band stays a mask (the second triangle had stayed an [S, S] mask: found by fuzzing)."""
    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 0), implementation="xla")

    report = jaxsub.explain(attn, *_qkv())
    detail = report.matches[0].detail
    assert "causal" in detail and detail.count("boolean mask") == 1, str(report)
    assert_same(attn, _qkv(), argnums=(0, 1, 2))


def test_relayout_broadcasts_only_the_folds_a_mask_varies_over():
    """A mask over the folded batch axes but not the heads stays a unit head axis (a
    shadowed name had broadcast every fold after the first; found by the GQA fuzzer); k,
    with `kv`, keeps its own heads (the op groups q's heads over them) and is broadcast over
    the folded batch axes it lacks."""
    from jaxsub.rewrite import labels

    sizes = {"a0": 2, "a1": 3, "hk": 3, "g": 2, "q": 4, "k": 5, "d": 8}
    mask = np.ones((2, 4, 5), bool)
    assert labels.relayout(mask, ("a0", "q", "k"), "bhqk", sizes).shape == (6, 1, 4, 5)
    k = np.arange(2 * 3 * 5 * 3 * 8).reshape(2, 3, 5, 3, 8)
    out = labels.relayout(k, ("a0", "a1", "k", "hk", "d"), "bkhd", sizes, kv=True)
    np.testing.assert_array_equal(out, k.reshape(6, 5, 3, 8))
    shared = labels.relayout(k[0], ("a1", "k", "hk", "d"), "bkhd", sizes, kv=True)  # the same k for each a0
    np.testing.assert_array_equal(shared, np.broadcast_to(k[0], (2, 3, 5, 3, 8)).reshape(6, 5, 3, 8))


def test_weak_where_fill_is_a_near_miss_saying_so():
    """where(mask, s, -5e3): the hidden keys keep a weight (the fill is not a boolean mask's),
    so only the softmax fuses; explain said nothing (found by fuzzing)."""
    def weak(q, k, v, pad):
        s = jnp.where(pad[:, None, None, :], jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5, -5e3)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    report = jaxsub.explain(weak, *_qkv(), _padding())
    assert dict(report.totals) == {"softmax_dropout": 1}, str(report)
    assert "where(mask, scores, -5000): a fill above -1e4" in str(report), str(report)
    assert_same(weak, (*_qkv(), _padding()), argnums=(0, 1, 2))


def test_grouped_query_attention_fuses(softmax_flag):
    """k and v with fewer heads than q (jax.nn.dot_product_attention's grouped form, a
    grouped einsum as MaxText writes it, multi-query): the op with k and v of their own
    heads (grouped-query `ops.attention`). They had been near-misses (before that, not
    fused without a word). q's two free axes are told apart by the masks: causal is found
    whichever of them comes first."""
    kv_heads = H // 2
    q = _normal(0, (B, S, H, D))
    k, v = _normal(1, (B, S, kv_heads, D)), _normal(2, (B, S, kv_heads, D))
    pad = _padding()

    def grouped(q, k, v):  # groups before queries in the scores
        qg = q.reshape(B, S, kv_heads, H // kv_heads, D)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) * D ** -0.5
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e10)
        return jnp.einsum("bhgqk,bkhd->bqhgd", jax.nn.softmax(s, -1), v).reshape(B, S, H, D)

    def multi_query(q, k, v):
        s = jnp.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) * D ** -0.5
        s = jnp.where(pad[:, None, None, :], s, -1e9)
        return jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(s, -1), v[:, :, 0])

    def dpa(q, k, v):  # queries before groups in the scores
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def dpa_unmasked(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="xla")

    for f, causal in ((grouped, True), (multi_query, False), (dpa, True), (dpa_unmasked, False)):
        report = _check(f, (q, k, v), {"attention": 1})
        _softmax_form(softmax_flag, f, (q, k, v), report)
        groups = H if f is multi_query else H // kv_heads
        want = f"grouped-query: {groups} query groups over k and v's heads (q's {H} heads)"
        assert want in str(report), str(report)
        assert ("causal" in str(report)) == causal, str(report)

    def dropped(q, k, v, key):
        qg = q.reshape(B, S, kv_heads, H // kv_heads, D)
        p = jax.nn.softmax(jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) * D ** -0.5, -1)
        p = jnp.where(jax.random.bernoulli(key, 1 - RATE, p.shape), p / (1 - RATE), 0)
        return jnp.einsum("bhgqk,bkhd->bqhgd", p, v).reshape(B, S, H, D)

    key = jax.random.PRNGKey(5)
    want = ops.attention(q, *(jnp.repeat(a, H // kv_heads, axis=2) for a in (k, v)), scale=D ** -0.5,
                         dropout_rate=RATE, key=key)
    assert_close(jaxsub.optimize(dropped)(q, k, v, key), want, jnp.float32, reduction=S)


def test_additive_mask_written_as_a_subtraction():
    """s - 1e9 * (1 - valid), and a learned bias subtracted from the scale-multiplied scores:
    additive masks of factor -1 (only `s + m` was taken; found by probing). The bias's
    gradient too."""
    valid = _padding().astype(jnp.float32)

    def padded(q, k, v, valid):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        s = s - 1e9 * (1.0 - valid[:, None, None, :])
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    def biased(q, k, v, bias):
        s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) - bias) * 0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    assert "additive mask" in str(_check(padded, (*_qkv(), valid), {"attention": 1}))
    _check(biased, (*_qkv(), _normal(9, (1, H, S, S))), {"attention": 1}, argnums=(0, 1, 2, 3))


def test_tril_is_causal_and_scale_after_additive_mask():
    bias = _normal(5, (1, H, S, S))
    report = _check(attn_tril_additive, (*_qkv(), bias), {"attention": 1})
    text = str(report)
    assert "causal" in text and "additive mask" in text and "scale=0.3" in text
    # The additive mask's own difference from f32 code on rows it hides everywhere (README).
    assert "additive mask is below -256 everywhere gets its unmasked attention" in text


class _SoftmaxCustomJvp:
    """jax_softmax_custom_jvp on: jax.nn.softmax becomes a custom_jvp_call."""

    def __enter__(self):
        self.old = jax.config.jax_softmax_custom_jvp
        jax.config.update("jax_softmax_custom_jvp", True)

    def __exit__(self, *exc):
        jax.config.update("jax_softmax_custom_jvp", self.old)


def test_softmax_custom_jvp_flag():
    with _SoftmaxCustomJvp():
        assert "custom_jvp_call" in str(jax.make_jaxpr(attn_bshd)(*_qkv()))
        report = _check(attn_bshd, _qkv(), {"attention": 1})
    assert not report.unsearched


def test_users_custom_jvp_softmax_is_left_alone():
    """Found by probing: a user's custom_jvp around a softmax, with a derivative rule of its
    own, was matched as jax.nn.softmax's and the rule silently dropped (gradients 10x off)."""

    @jax.custom_jvp
    def softmax(s):
        return jax.nn.softmax(s, axis=-1)

    @softmax.defjvp
    def _(primals, tangents):
        y, dy = jax.jvp(lambda s: jax.nn.softmax(s, axis=-1), primals, tangents)
        return y, 0.1 * dy

    def f(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        return jnp.einsum("bhqk,bkhd->bqhd", softmax(s), v)

    args = _qkv()
    report = jaxsub.explain(f, *args)
    assert not report.matches and [e.pattern for e in report.unsearched] == ["custom_jvp_call"]
    loss = lambda f: lambda *a: jnp.sin(f(*a)).sum()  # noqa: E731
    for got, want in zip(jax.grad(loss(jaxsub.optimize(f)), (0, 1, 2))(*args), jax.grad(loss(f), (0, 1, 2))(*args)):
        assert_close(got, want, what="user's rule")


def test_fully_masked_rows_differ_only_there():
    """The documented difference: rows without a visible key give 0, the original the mean of v."""
    q, k, v = _qkv("bhsd")
    mask = _padding().at[0].set(False)
    with jax.default_matmul_precision("highest"):  # f32 products in f32 on a GPU backend too
        out = jaxsub.optimize(attn_bhsd_written_out)(q, k, v, mask)
        ref = attn_bhsd_written_out(q, k, v, mask)
    np.testing.assert_array_equal(out[0], 0.0)
    assert_close(ref[0], jnp.broadcast_to(v[0].mean(1, keepdims=True), ref[0].shape), reduction=S)
    assert_close(out[1], ref[1], reduction=S * D)


# ---------------------------------------------------------------------------------------
# jax.nn.dot_product_attention.


@pytest.mark.parametrize("kind", ["plain", "mask", "causal"])
def test_dot_product_attention(kind, softmax_flag):
    mask = _padding()[:, None, None, :]

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask if kind == "mask" else None,
                                            is_causal=kind == "causal", implementation="xla")

    report = _check(f, _qkv(), {"attention": 1})
    _softmax_form(softmax_flag, f, _qkv(), report)
    detail = report.matches[0].detail
    assert ("causal" in detail) == (kind == "causal")
    assert ("boolean mask" in detail) == (kind == "mask")


# ---------------------------------------------------------------------------------------
# flax.


def _linen(**kw):
    m = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=E, **kw)
    x = _normal(0, (B, S, E))
    return m, m.init(jax.random.key(0), x), x


def test_flax_linen_with_mask():
    m, params, x = _linen()
    mask = nn.make_attention_mask(jnp.ones((B, S), bool), _padding())  # no fully masked query

    def f(params, x):
        return m.apply(params, x, mask=mask)

    _check(f, (params, x), {"attention": 1}, argnums=(0, 1))


def test_flax_linen_causal_mask():
    m, params, x = _linen()

    def f(params, x):
        return m.apply(params, x, mask=nn.make_causal_mask(jnp.ones((B, S))))

    assert "causal" in str(_check(f, (params, x), {"attention": 1}, argnums=(0, 1)))


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
    report = _check(lambda x: layer(x), (_normal(0, (B, S, E)),), {"attention": 1}, argnums=(0,))
    _softmax_form(softmax_flag, lambda x: layer(x), (_normal(0, (B, S, E)),), report)
    assert APART in str(report), str(report)


def test_flax_nnx_default_dropout_is_broadcast_dropout():
    """nnx.MultiHeadAttention's dropout (broadcast_dropout=True by default) is fused whole."""
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=E, decode=False, dropout_rate=RATE,
                                   rngs=nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(layer)

    def f(state, x):
        return nnx.merge(graphdef, state)(x, deterministic=False)

    report = jaxsub.explain(f, state, _normal(0, (B, S, E)))
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

    report = _check(f, (params, x), {"attention": 1}, argnums=(0, 1))
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
    report = _check(lambda p, x: m2.apply(p, x), (p2, x), {"attention": 1}, argnums=(0, 1))
    assert APART in str(report) and "+ bias" not in str(report), str(report)
    assert _grad_targets(lambda p, x: m2.apply(p, x), p2, x)["jaxsub_bias_grad"] == 0
    assert _dbias_results(lambda p, x: m2.apply(p, x), p2, x) == ["tensor<0xf32>"]


def _projected(x, y, w, b, i):
    return jnp.einsum("bse,ehd->bshd", (x, x, y)[i], w[i]) + b[i]


def test_projections_that_differ_are_reported():
    x = _normal(0, (B, S, E))
    w = _normal(2, (3, E, H, D)) * 0.2
    wv = _normal(4, (E // 2, H, D)) * 0.2

    def f(x, w, wv):
        q, k = (jnp.einsum("bse,ehd->bshd", x, w[i]) for i in range(2))
        return attn_bshd(q, k, jnp.einsum("bse,ehd->bshd", x[..., : E // 2], wv))

    report = _check(f, (x, w, wv), {"attention": 1})
    assert "not packed" not in str(report)  # v projects another input (a slice of x)

    def g(x, w):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, w[i]) for i in range(3))
        return attn_bshd(q, k, v.astype(jnp.bfloat16).astype(jnp.float32))

    assert "not packed" not in str(jaxsub.explain(g, x, w))  # v is converted after its projection

    def h(x, w):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, w[i], precision=p)
                   for i, p in enumerate(("highest", None, None)))
        return attn_bshd(q, k, v)

    report = _check(h, (x, w), {"attention": 1}, argnums=(0, 1))
    assert "q/k/v projections of one input not packed: their dot_general parameters differ" in str(report)

    def k_biased_by_q(x, w, r):  # full-size "biases"; k's is q itself
        q = jnp.einsum("bse,ehd->bshd", x, w[0]) + r[0]
        k = jnp.einsum("bse,ehd->bshd", x, w[1]) + q
        return attn_bshd(q, k, jnp.einsum("bse,ehd->bshd", x, w[2]) + r[1])

    r = _normal(5, (2, B, S, H, D))
    report = jaxsub.explain(k_biased_by_q, x, w, r)
    assert report.totals == {"attention": 1}
    assert_close(jaxsub.optimize(k_biased_by_q)(x, w, r), k_biased_by_q(x, w, r), reduction=S * D)
    assert "not packed: an input of a projection is computed inside the attention" in str(report), str(report)


def test_jnp_projections_become_attention_projected():
    x = _normal(0, (B, S, E))
    w, b = _normal(2, (3, E, H, D)) * 0.2, _normal(3, (3, H, D))

    def self_attention(x, w, b):
        return attn_bshd(*(_projected(x, x, w, b, i) for i in range(3)))

    report = _check(self_attention, (x, w, b), {"attention": 1})
    assert APART in str(report), str(report)
    assert _packed_targets(self_attention, x, w, b) == {"jaxsub_attention_fwd": 1, "jaxsub_attention_qkv_fwd": 0}
    assert _grad_targets(self_attention, x, w, b)["jaxsub_attention_bwd_dqkv"] == 1


def test_projections_with_the_contraction_last_in_the_weights():
    """Weights [H, D, E] (contracted on their last axis): stacked on their first."""
    x = _normal(0, (B, S, E))
    w = _normal(2, (3, H, D, E)) * 0.2

    def f(x, w):
        return attn_bshd(*(jnp.einsum("bse,hde->bshd", x, w[i]) for i in range(3)))

    report = _check(f, (x, w), {"attention": 1}, argnums=(0, 1))
    assert PACKED in str(report) and f"w[{H}, {D}, {E}]" in str(report), str(report)


def test_projection_biases_broadcast_over_heads_or_head_dims():
    """Biases of shape [D] (shared by the heads) or [H, 1]: packed with the weights, the
    stacked bias [1, 1, 3, 1, D] is no suffix of the packed product's shape, so XLA adds
    it (ops.bias_add raised a ValueError on it)."""
    x, w = _normal(0, (B, S, E)), _normal(2, (3, E, H, D)) * 0.2
    for bias_shape in ((D,), (H, 1)):
        b = _normal(3, (3, *bias_shape))

        def layer(x, w, b):
            return attn_bshd(*(_projected(x, x, w, b, i) for i in range(3)))

        assert jaxsub.explain(layer, x, w, b).totals == {"attention": 1}
        assert_same(layer, (x, w, b), argnums=(0, 1, 2))


def test_projections_left_alone_when_not_one_input_or_not_private():
    """Cross-attention (v from another input), q returned beside the output (explain() says
    why those three projections were not packed), k changed after its projection:
    attention is fused on q, k, v as they are, not packed."""
    x, y = _normal(0, (B, S, E)), _normal(1, (B, S, E))
    w, b = _normal(2, (3, E, H, D)) * 0.2, _normal(3, (3, H, D))

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
    q, k, v = _qkv()
    key = jax.random.key(3)
    opt = jaxsub.optimize(attn_dropout)
    out = jax.jit(opt)(q, k, v, key)
    assert _count(opt, q, k, v, key) == 1
    assert "dropout rate=0.25" in str(jaxsub.explain(attn_dropout, q, k, v, key))
    assert_close(out, ops.attention(q, k, v, dropout_rate=RATE, key=key), reduction=S * D)
    np.testing.assert_array_equal(out, jax.jit(opt)(q, k, v, key))
    assert np.mean(np.asarray(out != jax.jit(opt)(q, k, v, jax.random.key(4)))) > 0.5
    kept = np.asarray(ops.dropout_mask(key, (B, H, S, S), RATE))
    sigma = np.sqrt(kept.size * RATE * (1 - RATE))
    assert abs((~kept).sum() - kept.size * RATE) < 5 * sigma


def test_rewrite_dropout_false_leaves_attention_alone():
    q, k, v = _qkv()
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
    assert _count(opt, *args) == 1
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
    assert _count(opt, *args) == 1
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
    q, k, v = _qkv()
    key = jax.random.key(3)
    f = functools.partial(flax_attention, broadcast=broadcast)
    opt = jaxsub.optimize(f)
    assert _count(opt, q, k, v, key) == 1
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

    q, k, v = _qkv()
    key = jax.random.key(5)
    opt = jaxsub.optimize(f)
    assert _count(opt, q, k, v, key) == 1
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

    args = (*_qkv(), jax.random.key(1))
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

    args = (*_qkv(), jax.random.key(1))
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

    _check(f, _qkv(), {"softmax_dropout": 1})


def test_probabilities_returned_is_a_near_miss():
    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p

    args = _qkv()
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

    args = _qkv()
    report = jaxsub.explain(f, *args)
    assert report.matches == [] and "not the last" in report.near_misses[0].detail
    assert _count(jaxsub.optimize(f), *args) == 0
    assert_close(jaxsub.optimize(f)(*args), f(*args), reduction=S * D)


def test_top_left_causal_is_a_generic_mask(softmax_flag):
    """jax's is_causal aligns the diagonal top-left; jaxsub's causal is bottom-right, so with
    Sq < Sk the constant mask is passed as a mask, not as causal=True."""
    def f(q, k, v):
        return jax.nn.dot_product_attention(q[:, :3], k, v, is_causal=True, implementation="xla")

    report = _check(f, _qkv(), {"attention": 1})
    _softmax_form(softmax_flag, f, _qkv(), report)
    detail = report.matches[0].detail
    assert "causal" not in detail and "boolean mask bool[3, 8]" in detail
