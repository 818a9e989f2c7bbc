"""jaxsub.optimize on CPU: the spellings of a softmax in attention and alone (where=,
log space, a reciprocal, a shift by hand, under vmap) and their look-alikes (conventions:
test_optimize_attention.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from optimize_helpers import (ATTENTION_REDUCTION, B, D, H, RATE, S, assert_attention_same, check_attention,
                              key_padding, normal, qkv_inputs, softmax_form)
import optimize_helpers


def test_softmax_with_where(softmax_flag):
    """jax.nn.softmax(s, where=mask) in attention and alone: nothing was matched (found by
    probing). It is the softmax of where(mask, s, -inf) whose hidden rows are zeros, as
    the fused ops give them, so even a row the mask hides everywhere agrees."""
    valid = np.array(key_padding())
    valid[1] = False  # a batch row whose keys are all hidden
    valid = jnp.asarray(valid)

    def attn(q, k, v, valid):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        p = jax.nn.softmax(s, -1, where=valid[:, None, None, :])
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    def alone(s, valid):
        return jax.nn.softmax(s, -1, where=valid[:, None, None, :])

    report = check_attention(attn, (*qkv_inputs(), valid), {"attention": 1})
    assert "boolean mask" in str(report) and "fully-masked rows give" not in str(report), str(report)
    softmax_form(softmax_flag, attn, (*qkv_inputs(), valid), report)
    scores = normal(4, (B, H, S, S))
    report = jaxsub.explain(alone, scores, valid)
    assert report.totals == {"softmax_dropout": 1}
    softmax_form(softmax_flag, alone, (scores, valid), report)
    assert_attention_same(alone, (scores, valid))
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
    padding = key_padding()[:, None, None, :]

    def attn(mask):
        def f(q, k, v):
            p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5, where=mask)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return f

    scores = normal(4, (B, H, S, S))
    for mask in (causal, keys):
        report = check_attention(attn(mask), qkv_inputs(), {"attention": 1})
        softmax_form(softmax_flag, attn(mask), qkv_inputs(), report)
        alone = functools.partial(jax.nn.softmax, where=mask)
        report = jaxsub.explain(alone, scores)
        assert report.totals == {"softmax_dropout": 1}, str(report)
        softmax_form(softmax_flag, alone, (scores,), report)
        assert_attention_same(alone, (scores,))
    stacked = tuple(jnp.stack([a, a[::-1] * 0.5]) for a in qkv_inputs())
    closed_over = jax.vmap(attn(padding))
    report = check_attention(closed_over, stacked, {"attention": 1})
    softmax_form(softmax_flag, closed_over, stacked, report)
    masks = jnp.stack([padding, padding[::-1]])

    def batched(q, k, v, m):
        return attn(m)(q, k, v)

    check_attention(jax.vmap(batched), (*stacked, masks), {"attention": 1})

    # One [S] key mask per example under vmap: broadcast inside the call to axes (0, 3)
    def one(q, k, v, m):
        p = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) * D ** -0.5, where=m)
        return jnp.einsum("hqk,khd->qhd", p, v)

    check_attention(jax.vmap(one), (*qkv_inputs(), key_padding()), {"attention": 1})
    # ... and with in_axes=1 on the mask (transposed inside the call)
    check_attention(jax.vmap(one, in_axes=(0, 0, 0, 1)), (*qkv_inputs(), key_padding().T), {"attention": 1})
    where = lambda s, m: jax.nn.softmax(s, where=m)  # noqa: E731
    odd = normal(5, (B, H, S - 1, S + 2))
    mask = jnp.asarray(rng.random((S - 1, S + 2)) > 0.3)
    for f, args in ((jax.vmap(where), (scores, key_padding())),
                    (jax.vmap(where, in_axes=(0, 1)), (scores, key_padding().T)),
                    # the scores transposed inside the call, then masked
                    (jax.vmap(functools.partial(jax.nn.softmax, where=mask), in_axes=1), (odd,))):
        report = jaxsub.explain(f, *args)
        assert report.totals == {"softmax_dropout": 1}, str(report)
        assert_attention_same(f, args)


def test_softmax_dropout_under_vmap_over_per_example_keys_is_a_near_miss():
    """softmax + dropout alone under jax.vmap over per-example keys: the softmax is fused,
    the dropout stays the user's and explain says why (found by probing: nothing said)."""
    def f(s, key):
        p = jax.nn.softmax(s, -1)
        return jnp.where(jax.random.bernoulli(key, 1.0 - RATE, p.shape), p / (1.0 - RATE), 0.0)

    scores, keys = normal(4, (3, H, S, S)), jax.random.split(jax.random.key(2), 3)
    report = jaxsub.explain(jax.vmap(f), scores, keys)
    assert report.totals == {"softmax_dropout": 1} and "no dropout" in report.matches[0].detail, str(report)
    assert any("is one key per example" in m.detail for m in report.near_misses), str(report)
    assert_attention_same(jax.vmap(f), (scores, keys))


@pytest.mark.parametrize("in_axes", [1, 3])
def test_vmapped_softmax_over_another_axis(softmax_flag, in_axes):
    """jax.vmap(jax.nn.softmax, in_axes=1) alone: the softmax of a transpose, which under
    jax_softmax_custom_jvp lies inside the call (found by probing: not fused with the flag).
    The fused op normalizes the transposed scores' last axis, as the program does."""
    scores = normal(4, (B, H, S + 1, S + 3))
    f = jax.vmap(jax.nn.softmax, in_axes=in_axes)
    report = jaxsub.explain(f, scores)
    assert report.totals == {"softmax_dropout": 1}, str(report)
    softmax_form(softmax_flag, f, (scores,), report)
    assert_attention_same(f, (scores,))


def test_softmax_with_its_numerator_computed_twice():
    """exp(s - m) / exp(s - m).sum(-1): two equal exponentials (found by probing: not
    matched); one softmax, alone and in attention."""
    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        m = s.max(-1, keepdims=True)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - m) / jnp.exp(s - m).sum(-1, keepdims=True), v)

    def alone(s):
        return jnp.exp(s - s.max(-1, keepdims=True)) / jnp.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)

    check_attention(attn, qkv_inputs(), {"attention": 1})
    scores = normal(4, (B, H, S, S))
    assert jaxsub.explain(alone, scores).totals == {"softmax_dropout": 1}
    assert_attention_same(alone, (scores,))


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

    check_attention(attn, qkv_inputs(), {"attention": 1})
    scores = normal(4, (B, H, S, S))
    assert jaxsub.explain(sm, scores).totals == {"softmax_dropout": 1}
    assert_attention_same(sm, (scores,))
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

    args = tuple(a.astype(dtype) for a in qkv_inputs())
    assert jaxsub.explain(attn, *args).totals == {"attention": 1}
    optimize_helpers.assert_same(attn, args, dtype, argnums=(0, 1, 2), reduction=ATTENTION_REDUCTION)


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

    report = check_attention(attn, qkv_inputs(), {"attention": 1})
    assert "1 match(es), 0 near-miss(es)" in str(report), str(report)
    scores = normal(4, (B, H, S, S))
    assert_attention_same(sm, (scores,))


@pytest.mark.parametrize("fn", [
    lambda s: jnp.exp(s - (jnp.log(jnp.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True))
                           + 0.5 * s.max(-1, keepdims=True))),  # another shift added back
    lambda s: jnp.exp(s - jnp.log(jnp.exp(s).sum(-1, keepdims=True) + 1.0)),  # not the sum's log
    lambda s: jnp.exp(s - jnp.log(jnp.exp(s + 1.0).sum(-1, keepdims=True))),  # another exponent
    lambda s: jnp.exp(s - jax.nn.logsumexp(s, axis=(2, 3), keepdims=True)),  # two axes
], ids=["shift", "plus_one", "exponent", "two_axes"])
def test_log_space_look_alikes_are_left_alone(fn):
    scores = normal(4, (B, H, S, S))
    assert jaxsub.explain(fn, scores).totals == {}
    assert_attention_same(fn, (scores,))
