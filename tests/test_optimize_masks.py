"""jaxsub.optimize on CPU: attention's scales and masks (run-time scales, causal
triangles and position biases at long sequences, additive and where masks, padding split
from a triangle, grouped-query attention, fully masked rows) (conventions:
test_optimize_attention.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import ops
from jaxsub.testing import assert_close
from optimize_helpers import (B, D, H, RATE, S, assert_attention_same, attention_counts, attn_bhsd_written_out,
                              attn_bshd, attn_tril_additive, check_attention, key_padding, normal, qkv_inputs,
                              softmax_form)
import optimize_helpers


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
    args = (*qkv_inputs(), jnp.linspace(0.2, 0.9, S + H))
    # The scale's gradient sums over every score: B·H·S·S products of D terms.
    optimize_helpers.assert_same(f, args, argnums=(0, 1, 2, 3), reduction=B * H * S * S * D)
    assert attention_counts(jaxsub.optimize(f), *args) == 1
    report = jaxsub.explain(f, *args)
    assert dict(report.totals) == {"attention": 1} and what in str(report), str(report)


def test_scores_scaled_at_run_time_over_both_sides_or_after_a_mask_are_near_misses():
    t = jnp.linspace(0.2, 0.9, S * S).reshape(S, S)
    both = _scores_times(lambda t: t)

    def after_mask(q, k, v, t):
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9) * t[0, 0]
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    for f, why in ((both, "varying over queries and keys"), (after_mask, "masked scores are scaled")):
        report = jaxsub.explain(f, *qkv_inputs(), t)
        assert dict(report.totals) == {"softmax_dropout": 1} and why in str(report), str(report)
        assert_attention_same(f, (*qkv_inputs(), t), argnums=(0, 1, 2, 3))


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

    args = qkv_inputs() if n == S else (jnp.zeros((1, n, heads, 8), jnp.bfloat16),) * 3
    report = jaxsub.explain(attn, *args)
    assert report.totals == {"attention": 1} and "causal" in report.matches[0].detail, str(report)
    assert "additive mask" in report.matches[0].detail, str(report)
    if n == S:
        assert_attention_same(attn, args, argnums=(0, 1, 2))


def test_lazy_triangle_check_decides_as_the_whole_one(monkeypatch):
    """The lazy comparison's per-query check, forced at a small S (every comparison lazy),
    decides as the whole-array one: values and gradients equal the original."""
    from jaxsub.rewrite import constants

    monkeypatch.setattr(constants, "_EAGER", 0)
    for name, causal in (("tril", True), ("flax", True), ("difference", True), ("shifted", False), ("window", True)):
        def attn(q, k, v, name=name):
            s = jnp.where(_LONG_MASKS[name](S), jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

        report = jaxsub.explain(attn, *qkv_inputs())
        assert ("causal" in report.matches[0].detail) == causal, (name, str(report))
        assert_attention_same(attn, qkv_inputs(), argnums=(0, 1, 2))


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

    report = str(jaxsub.explain(attn, *qkv_inputs()))
    assert dict(jaxsub.explain(attn, *qkv_inputs()).totals) == {"attention": 1}, report
    assert ("causal" in report) == causal and ("additive mask" in report) == (not causal), report
    assert_attention_same(attn, qkv_inputs(), argnums=(0, 1, 2))


def test_additive_mask_scaled_after_it_stays_finite():
    """(s + (1 - valid) * finfo.min) * 2: the scale after the mask is folded into the op's
    mask, ((1 - valid) * finfo.min) * 2, which XLA reassociates into (1 - valid) * -inf:
    NaN at every visible key (found by fuzzing). Zeros of the mask now stay zeros."""
    def attn(q, k, v, valid):
        add = (1.0 - valid.astype(jnp.float32)[:, None, None, :]) * jnp.finfo(jnp.float32).min
        s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5 / 2 + add) * 2.0  # logits as the others'
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    args = (*qkv_inputs(), key_padding())
    assert dict(jaxsub.explain(attn, *args).totals) == {"attention": 1}
    assert bool(jnp.isfinite(jaxsub.optimize(attn)(*args)).all())
    assert_attention_same(attn, args, argnums=(0, 1, 2))


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

    bias = normal(9, (1, H, S, S))
    for fill, later, causal in ((-1e4, lambda b: jnp.where(tril(), 0.0, 1e4), False), (-1e4, lambda b: b, False),
                                (-jnp.inf, lambda b: b, True)):
        f = lifted_by(fill, later)
        report = str(jaxsub.explain(f, *qkv_inputs(), bias))
        assert ("causal" in report) == causal, report
        if fill == -jnp.inf or later(bias) is bias:
            assert_attention_same(f, (*qkv_inputs(), bias), argnums=(0, 1, 2))


def test_fill_scaled_down_after_the_where_is_a_near_miss():
    """where(mask, s, -1e4) * 0.5 leaves the hidden keys at -5000: not a boolean mask, so
    only the softmax fuses; explain said nothing (found by fuzzing)."""
    def scaled(q, k, v, pad):
        s = jnp.where(pad[:, None, None, :], jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e4) * 0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    report = jaxsub.explain(scaled, *qkv_inputs(), key_padding())
    assert dict(report.totals) == {"softmax_dropout": 1}, str(report)
    assert "is scaled after it to a fill of -5000, above -1e4" in str(report), str(report)
    assert_attention_same(scaled, (*qkv_inputs(), key_padding()), argnums=(0, 1, 2))


@pytest.mark.parametrize("spelling", ["dpa-mask", "dpa-lengths", "where-and", "where-or-negated"])
def test_padding_and_triangle_are_split(spelling):
    """A causal triangle and-ed with a padding mask into one array (jax.nn.dot_product_attention
    with mask= or key_value_seq_lengths= and is_causal=True; hand-written pad & tril; a
    negated mask or-ed) went in as one [B, ..., S, S] boolean mask (found by fuzzing): the
    conjunction is now split, the triangle becomes causal=True and the padding stays a
    small mask. Values and gradients equal the original's."""
    pad, lengths = key_padding(), jnp.asarray([5, S], jnp.int32)
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

    report = jaxsub.explain(attn, *qkv_inputs())
    assert dict(report.totals) == {"attention": 1}, str(report)
    detail = report.matches[0].detail
    assert "causal" in detail and f"[{S}, {S}]" not in detail, str(report)
    assert_attention_same(attn, qkv_inputs(), argnums=(0, 1, 2))


def test_window_with_its_triangle_twice_keeps_one_mask():
    """dot_product_attention(is_causal=True, local_window_size=(w, 0)) ands the triangle twice
    (is_causal's and the window's k <= q half): both are causal=True, and only the window's
    band stays a mask (the second triangle had stayed an [S, S] mask: found by fuzzing)."""
    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 0), implementation="xla")

    report = jaxsub.explain(attn, *qkv_inputs())
    detail = report.matches[0].detail
    assert "causal" in detail and detail.count("boolean mask") == 1, str(report)
    assert_attention_same(attn, qkv_inputs(), argnums=(0, 1, 2))


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

    report = jaxsub.explain(weak, *qkv_inputs(), key_padding())
    assert dict(report.totals) == {"softmax_dropout": 1}, str(report)
    assert "where(mask, scores, -5000): a fill above -1e4" in str(report), str(report)
    assert_attention_same(weak, (*qkv_inputs(), key_padding()), argnums=(0, 1, 2))


def test_grouped_query_attention_fuses(softmax_flag):
    """k and v with fewer heads than q (jax.nn.dot_product_attention's grouped form, a
    grouped einsum as MaxText writes it, multi-query): the op with k and v of their own
    heads (grouped-query `ops.attention`). They had been near-misses (before that, not
    fused without a word). q's two free axes are told apart by the masks: causal is found
    whichever of them comes first."""
    kv_heads = H // 2
    q = normal(0, (B, S, H, D))
    k, v = normal(1, (B, S, kv_heads, D)), normal(2, (B, S, kv_heads, D))
    pad = key_padding()

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
        report = check_attention(f, (q, k, v), {"attention": 1})
        softmax_form(softmax_flag, f, (q, k, v), report)
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
    valid = key_padding().astype(jnp.float32)

    def padded(q, k, v, valid):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        s = s - 1e9 * (1.0 - valid[:, None, None, :])
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    def biased(q, k, v, bias):
        s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) - bias) * 0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    assert "additive mask" in str(check_attention(padded, (*qkv_inputs(), valid), {"attention": 1}))
    check_attention(biased, (*qkv_inputs(), normal(9, (1, H, S, S))), {"attention": 1}, argnums=(0, 1, 2, 3))


def test_tril_is_causal_and_scale_after_additive_mask():
    bias = normal(5, (1, H, S, S))
    report = check_attention(attn_tril_additive, (*qkv_inputs(), bias), {"attention": 1})
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
        assert "custom_jvp_call" in str(jax.make_jaxpr(attn_bshd)(*qkv_inputs()))
        report = check_attention(attn_bshd, qkv_inputs(), {"attention": 1})
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

    args = qkv_inputs()
    report = jaxsub.explain(f, *args)
    assert not report.matches and [e.pattern for e in report.unsearched] == ["custom_jvp_call"]
    loss = lambda f: lambda *a: jnp.sin(f(*a)).sum()  # noqa: E731
    for got, want in zip(jax.grad(loss(jaxsub.optimize(f)), (0, 1, 2))(*args), jax.grad(loss(f), (0, 1, 2))(*args)):
        assert_close(got, want, what="user's rule")


def test_fully_masked_rows_differ_only_there():
    """The documented difference: rows without a visible key give 0, the original the mean of v."""
    q, k, v = qkv_inputs("bhsd")
    mask = key_padding().at[0].set(False)
    with jax.default_matmul_precision("highest"):  # f32 products in f32 on a GPU backend too
        out = jaxsub.optimize(attn_bhsd_written_out)(q, k, v, mask)
        ref = attn_bhsd_written_out(q, k, v, mask)
    np.testing.assert_array_equal(out[0], 0.0)
    assert_close(ref[0], jnp.broadcast_to(v[0].mean(1, keepdims=True), ref[0].shape), reduction=S)
    assert_close(out[1], ref[1], reduction=S * D)
