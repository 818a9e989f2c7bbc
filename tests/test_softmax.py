"""softmax_dropout: the fused op against a float64 NumPy oracle and against its pure-JAX
reference (dropout mask from dropout_mask), masks and causal alignment, fully masked rows,
dropout semantics, gradients, transformations, validation and the fallback path."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub import _ffi
from jaxsub.ops.softmax import reference_softmax_dropout
from jaxsub.testing import assert_close, assert_vmap_matches_loop

op = jaxsub.ops.softmax_dropout
F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
DTYPES = (F32, BF16, F16)
LEADS = ((), (3,), (2, 3))
SIZES = ((1, 1), (1, 7), (7, 1), (7, 7), (128, 128), (130, 130), (7, 130), (130, 7), (128, 130), (1, 130))
MASKS = ("none", "padding", "full", "additive", "causal", "padding+causal", "additive+causal")


def normal(seed, shape, dtype=F32, scale=1.0):
    """Fresh standard-normal draws (never zeros) in `dtype`."""
    v = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(v.astype(np.float32), dtype)


def view4(shape):
    """The kernels' [B, H, Sq, Sk] view of scores of `shape`."""
    *lead, sq, sk = shape
    return (math.prod(lead[:-1]), lead[-1] if lead else 1, sq, sk)


def make_mask(seed, kind, shape):
    """A user mask for scores of `shape`: 'padding' is boolean over keys only (the
    [B, 1, 1, Sk] form when 4-D), 'full' boolean of scores' shape, 'additive' f32 of
    scores' shape with some -inf entries. Boolean masks leave key 0 visible, so only the
    causal rule or a dedicated test empties a row."""
    rng = np.random.default_rng(seed)
    *lead, sq, sk = shape
    if kind.startswith("padding"):
        m = rng.random(tuple(lead[:-1]) + (1,) * min(len(lead), 1) + (1, sk)) < 0.7
    elif kind.startswith("full"):
        m = rng.random(shape) < 0.6
    elif kind.startswith("additive"):
        m = (rng.standard_normal(shape) * 2.0).astype(np.float32)
        m[rng.random(shape) < 0.2] = -np.inf
        m[..., 0] = 0.0
        return jnp.asarray(m)
    else:
        return None
    m[..., 0] = True
    return jnp.asarray(m)


def oracle(scores, dy, *, scale, mask, causal, keep, rate):
    """y and dscores in float64 NumPy from the same (rounded) inputs."""
    s = np.asarray(jnp.asarray(scores, F32), np.float64) * scale
    visible = np.ones(s.shape, bool)
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype == bool:
            visible = visible & m
        else:
            s = s + m.astype(np.float64)
    if causal:
        sq, sk = s.shape[-2:]
        visible = visible & (np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq))
    s = np.where(visible, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(mx), mx, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    kept = np.ones(s.shape, bool) if keep is None else np.asarray(keep)
    k = 1.0 / (1.0 - rate)
    y = np.where(kept, p * k, 0.0)
    g = np.where(kept, np.asarray(jnp.asarray(dy, F32), np.float64) * k, 0.0)
    ds = scale * p * (g - (g * p).sum(axis=-1, keepdims=True))
    return y, ds


def fused_vjp(scores, dy, mask, key, *, scale, causal, rate):
    y, vjp = jax.vjp(lambda s: op(s, scale=scale, mask=mask, causal=causal, rate=rate, key=key), scores)
    return y, vjp(dy)[0]


def reference_vjp(scores, dy, mask, keep, *, scale, causal, rate):
    f = lambda s: reference_softmax_dropout(s, scale=scale, mask=mask, causal=causal, keep=keep, rate=rate)
    y, vjp = jax.vjp(f, scores)
    return y, vjp(dy)[0]


# Jitted once each: eager vjp dispatches (and compiles) op by op, which is most of the
# suite's time otherwise.
fused_vjp_jit = jax.jit(fused_vjp, static_argnames=("scale", "causal", "rate"))
reference_vjp_jit = jax.jit(reference_vjp, static_argnames=("scale", "causal", "rate"))


def keep_mask(key, shape, rate):
    """The keep-mask the kernels use for scores of `shape` (general [B, H, Sq, Sk] view)."""
    if rate == 0.0:
        return None
    return jaxsub.ops.dropout_mask(key, view4(shape), rate).reshape(shape)


def check_against_oracles(scores, dy, mask, *, scale, causal, rate, key):
    dtype, sk = scores.dtype, scores.shape[-1]
    keep = keep_mask(key, scores.shape, rate)
    got = fused_vjp_jit(scores, dy, mask, key, scale=scale, causal=causal, rate=rate)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    assert got[0].shape == scores.shape and got[1].shape == scores.shape
    want64 = oracle(scores, dy, scale=scale, mask=mask, causal=causal, keep=keep, rate=rate)
    assert_close(got[0], want64[0], dtype, reduction=sk, what="y vs float64")
    assert_close(got[1], want64[1], dtype, reduction=sk, grad=True, what="dscores vs float64")
    want = reference_vjp_jit(scores, dy, mask, keep, scale=scale, causal=causal, rate=rate)
    assert_close(got[0], want[0], dtype, reduction=sk, what="y vs reference")
    assert_close(got[1], want[1], dtype, reduction=sk, grad=True, what="dscores vs reference")
    return got


# Every size once; mask kind, dtype and leading shape rotate with the case index (7 mask
# kinds against 3 dtypes cover every pair over 21 cases) without the full product, whose
# compilations would dominate the suite's runtime.
CASES = [
    (SIZES[i % len(SIZES)], DTYPES[i % 3], LEADS[(i // 3) % 3], MASKS[i % 7], 0.0 if i % 4 == 0 else 0.1)
    for i in range(21)
]


@pytest.mark.parametrize("size,dtype,lead,mask_kind,rate", CASES,
                         ids=[f"{s[0]}x{s[1]}-{d.name}-{l}-{m}-p{r}" for s, d, l, m, r in CASES])
def test_fwd_and_vjp_match_oracles(size, dtype, lead, mask_kind, rate):
    shape = lead + size
    seed = 1000 + 31 * CASES.index((size, dtype, lead, mask_kind, rate))
    scores = normal(seed, shape, dtype, scale=2.0)
    dy = normal(seed + 1, shape, dtype)
    mask = make_mask(seed + 2, mask_kind, shape)
    check_against_oracles(scores, dy, mask, scale=0.7, causal="causal" in mask_kind, rate=rate,
                          key=jax.random.key(seed + 3))


@pytest.mark.parametrize("sq,sk", [(3, 9), (9, 3)])
def test_causal_is_bottom_right_aligned(sq, sk):
    scores = normal(5, (2, sq, sk))
    y = np.asarray(op(scores, causal=True))
    visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    assert ((y != 0) == visible[None]).all()
    assert y[:, -1].min() > 0, "the last query sees every key"


@pytest.mark.parametrize("kind", ["boolean", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros_and_zero_grads(kind, causal):
    shape = (2, 3, 6, 130)
    scores, dy = normal(11, shape, BF16, scale=3.0), normal(12, shape, BF16)
    rng = np.random.default_rng(13)
    if kind == "boolean":
        mask = rng.random(shape) < 0.5
        mask[..., 0] = True
        mask[:, :, 1] = False
    else:
        mask = rng.standard_normal(shape).astype(np.float32)
        mask[:, :, 1] = -np.inf
    y, ds = fused_vjp_jit(scores, dy, jnp.asarray(mask), jax.random.key(14), scale=0.5, causal=causal, rate=0.1)
    y, ds = np.asarray(y, np.float32), np.asarray(ds, np.float32)
    assert np.isfinite(y).all() and np.isfinite(ds).all()
    assert (y[:, :, 1] == 0).all() and (ds[:, :, 1] == 0).all()
    others = np.delete(y, 1, axis=2)
    assert (others.sum(-1) > 0).all()


def nan_rows(y):
    """Per row (last axis): whether it holds a NaN."""
    return np.isnan(np.asarray(y, np.float32)).any(-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_nan_and_inf_scores_make_their_row_nan(causal, rate):
    """As in plain JAX: a NaN or +inf score a query sees makes its row's (kept)
    probabilities and its gradient NaN; a NaN at a key causal hides does not. The row max
    used to skip NaN: an all-NaN row came out as an empty row of zeros, and the reference
    (the wide-row fallback) left a row with one NaN unnormalized."""
    shape = (2, 3, 5, 9)
    s = np.array(normal(41, shape))
    s[0, 1, 2, :] = np.nan  # every score
    s[1, 0, 3, 4] = np.nan  # one score, visible under causal (key 4 <= 3 + 9 - 5)
    s[1, 2, 0, 0] = np.inf
    s[0, 2, 0, 8] = np.nan  # hidden under causal (key 8 > 0 + 4)
    scores, w = jnp.asarray(s), normal(43, shape)
    key = jax.random.key(42)
    keep = jaxsub.ops.dropout_mask(key, shape, rate) if rate else jnp.ones(shape, bool)
    vis = jnp.arange(9)[None, :] <= jnp.arange(5)[:, None] + 4 if causal else True

    def plain(s):
        p = jax.nn.softmax(jnp.where(vis, 0.5 * s, -jnp.inf), axis=-1)
        return jnp.where(keep, p / (1.0 - rate), 0.0)

    ref = lambda s: reference_softmax_dropout(s, scale=0.5, causal=causal, keep=keep if rate else None, rate=rate)
    fused = lambda s: op(s, scale=0.5, causal=causal, rate=rate, key=key)
    want_y, want_g = jax.vjp(plain, scores)[0], jax.vjp(plain, scores)[1](w)[0]
    rows = nan_rows(want_y)
    assert rows.sum() == (3 if causal else 4)
    for name, f in (("fused", fused), ("reference", ref)):
        y, vjp = jax.vjp(jax.jit(f), scores)
        g = vjp(w)[0]
        np.testing.assert_array_equal(np.isnan(np.asarray(y)), np.isnan(np.asarray(want_y)), err_msg=name)
        np.testing.assert_array_equal(nan_rows(g), rows, err_msg=name)
        np.testing.assert_array_equal(nan_rows(want_g), rows)
        assert_close(jnp.where(rows[..., None], 0.0, y), jnp.where(rows[..., None], 0.0, want_y), F32, what=name)
        assert_close(jnp.where(rows[..., None], 0.0, g), jnp.where(rows[..., None], 0.0, want_g), F32, grad=True,
                     what=name)


def test_causal_with_more_queries_than_keys_empties_the_first_rows():
    scores, dy = normal(15, (4, 10, 7), F16), normal(16, (4, 10, 7), F16)
    y, ds = fused_vjp_jit(scores, dy, None, None, scale=1.0, causal=True, rate=0.0)
    y, ds = np.asarray(y, np.float32), np.asarray(ds, np.float32)
    assert np.isfinite(ds).all()
    assert (y[:, :3] == 0).all() and (ds[:, :3] == 0).all()
    np.testing.assert_allclose(y[:, 3:].sum(-1), 1.0, atol=1e-2)


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_check_grads(rate):
    scores = normal(21, (2, 3, 5))
    mask = make_mask(22, "additive", (2, 3, 5))
    key = jax.random.key(23)
    f = lambda s: op(s, scale=0.8, mask=mask, causal=True, rate=rate, key=key)
    check_grads(f, (scores,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)


def test_additive_mask_gets_its_gradient():
    # A learned bias passed as the mask is trained like one (tests/test_mask_grad.py has
    # the attention family); its -inf entries get zero gradient.
    scores = normal(31, (2, 4, 7))
    mask = make_mask(32, "additive", (2, 4, 7))
    w = normal(34, (2, 4, 7))
    key = jax.random.key(35)
    loss = lambda s, m: (op(s, mask=m, rate=0.2, key=key) * w).sum()
    ds, dm = jax.jit(jax.grad(loss, (0, 1)))(scores, mask)
    keep = jaxsub.ops.dropout_mask(key, view4((2, 4, 7)), 0.2).reshape(2, 4, 7)
    ref = lambda s, m: (reference_softmax_dropout(s, mask=m, keep=keep, rate=0.2) * w).sum()
    want_ds, want_dm = jax.grad(ref, (0, 1))(scores, mask)
    assert np.asarray(dm).any() and not np.asarray(dm)[np.isneginf(np.asarray(mask))].any()
    assert_close(dm, want_dm, F32, reduction=7, grad=True, what="dmask")
    assert_close(ds, want_ds, F32, reduction=7, grad=True, what="dscores")


def test_causal_rows_whose_visible_keys_hold_large_values():
    """Under the causal rule, mask rows whose visible keys all hold large negative values
    (while a hidden key does not) are their scores' softmax, as in float64: the op shifts
    such a row by its visible keys' maximum (masks._near). Before, their f32 scores lost
    the scores' values to the mask's rounding (a uniform row)."""
    b, h, sq, sk = 2, 3, 7, 9
    scores, dy = normal(91, (b, h, sq, sk)), normal(92, (b, h, sq, sk))
    vis = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    m = np.zeros((b, h, sq, sk), np.float32)
    m[0, 1, :4] = np.where(vis[:4], -1e9, 0.0)
    m[1, :, 2] = np.where(vis[2], -2e9, -1e9)
    got = fused_vjp_jit(scores, dy, jnp.asarray(m), None, scale=0.5, causal=True, rate=0.0)
    want = oracle(scores, dy, scale=0.5, mask=m, causal=True, keep=None, rate=0.0)
    assert_close(got[0], want[0], F32, reduction=sk, what="y vs float64")
    assert_close(got[1], want[1], F32, reduction=sk, grad=True, what="dscores vs float64")


def test_causal_queries_of_a_broadcast_mask_that_see_large_values():
    """A mask broadcast over the queries ([B, 1, 1, Sk], left padding by -1e9) under the
    causal rule: the first queries of example 0 see only padded keys. Their rows are their
    scores' softmax, as in float64 (masks.by_query shifts each query's row); before, the
    mask's rounding made them uniform and their gradients too large."""
    b, h, sq, sk = 2, 3, 7, 9
    scores, dy = normal(93, (b, h, sq, sk)), normal(94, (b, h, sq, sk))
    m = np.zeros((b, 1, 1, sk), np.float32)
    m[0, ..., :4] = -1e9
    got = fused_vjp_jit(scores, dy, jnp.asarray(m), None, scale=0.5, causal=True, rate=0.0)
    want = oracle(scores, dy, scale=0.5, mask=m, causal=True, keep=None, rate=0.0)
    assert_close(got[0], want[0], F32, reduction=sk, what="y vs float64")
    assert_close(got[1], want[1], F32, reduction=sk, grad=True, what="dscores vs float64")


@pytest.mark.parametrize("mask_shape", [(2, 1, 7, 1), (7, 1)])
def test_causal_rows_broadcast_over_keys_that_hold_large_values(mask_shape):
    """A mask with a row per query broadcast over the keys ([.., Sq, 1], query padding by
    -1e9) under the causal rule: each padded row is its scores' softmax, as in float64
    (masks._near shifts it where its query sees a key). Before, only the last query's row
    was shifted: the others were uniform and their gradients did not sum to zero (found by
    a probe)."""
    b, h, sq, sk = 2, 3, 7, 9
    scores, dy = normal(95, (b, h, sq, sk)), normal(96, (b, h, sq, sk))
    m = np.zeros(mask_shape, np.float32)
    m[..., 1, :] = -1e9
    m[..., 5, :] = -2e9
    got = fused_vjp_jit(scores, dy, jnp.asarray(m), None, scale=0.5, causal=True, rate=0.0)
    want = oracle(scores, dy, scale=0.5, mask=np.broadcast_to(m, (b, h, sq, sk)), causal=True, keep=None, rate=0.0)
    assert_close(got[0], want[0], F32, reduction=sk, what="y vs float64")
    assert_close(got[1], want[1], F32, reduction=sk, grad=True, what="dscores vs float64")


def test_vmap_over_leading_axis_and_masks_matches_loop():
    shape = (3, 2, 4, 130)
    scores, dy = normal(41, shape, BF16), normal(42, shape, BF16)
    mask = make_mask(43, "padding", shape)
    key = jax.random.key(44)
    f = lambda s, dy, m: fused_vjp(s, dy, m, key, scale=0.5, causal=True, rate=0.2)
    got = jax.jit(jax.vmap(f))(scores, dy, mask)
    for i in range(shape[0]):
        want = jax.jit(f)(scores[i], dy[i], mask[i])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g[i], np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("make_keys", [
    lambda: jax.random.split(jax.random.key(51), 3),
    lambda: jax.random.split(jax.random.PRNGKey(51), 3),
], ids=["typed", "raw"])
def test_vmap_over_keys_matches_loop(make_keys):
    scores, dy = normal(52, (2, 5, 130)), normal(53, (2, 5, 130))
    keys = make_keys()
    f = lambda k: fused_vjp(scores, dy, None, k, scale=1.0, causal=False, rate=0.5)
    assert_vmap_matches_loop(f, keys)


def test_targets_in_lowered_hlo():
    scores = normal(61, (2, 3, 8, 16), BF16)
    mask = make_mask(62, "padding", scores.shape)
    f = lambda s: op(s, scale=0.125, mask=mask, causal=True, rate=0.1, key=jax.random.key(63))
    fwd = jax.jit(f).lower(scores).as_text()
    bwd = jax.jit(jax.grad(lambda s: f(s).astype(jnp.float32).sum())).lower(scores).as_text()
    assert "jaxsub_softmax_dropout_fwd" in fwd
    assert "jaxsub_softmax_dropout_bwd" in bwd


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_keep_fraction_and_mask(rate):
    shape = (2, 4, 64, 130)
    scores = normal(71, shape)
    key = jax.random.key(72)
    kept = np.asarray(op(scores, rate=rate, key=key)) != 0
    np.testing.assert_array_equal(kept, np.asarray(jaxsub.ops.dropout_mask(key, shape, rate)))
    n, p = kept.size, 1.0 - rate
    assert abs(kept.mean() - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_same_key_same_output_new_key_different():
    scores = normal(81, (3, 16, 130), F16)
    k1, k2 = jax.random.split(jax.random.key(82))
    a = np.asarray(op(scores, rate=0.3, key=k1), np.float32)
    b = np.asarray(op(scores, rate=0.3, key=k1), np.float32)
    c = np.asarray(op(scores, rate=0.3, key=k2), np.float32)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_cotangent_of_dropped_elements_does_not_reach_scores():
    # ds_j = scale * p_j * (g_j - sum_k g_k p_k) with g = dropout(dy): a dropped output
    # contributes nothing, so dy supported on dropped elements only gives ds == 0 exactly,
    # while the same dy on kept elements does not.
    shape = (2, 3, 16, 130)
    scores, dy = normal(91, shape, BF16), normal(92, shape, BF16)
    key = jax.random.key(93)
    keep = np.asarray(jaxsub.ops.dropout_mask(key, shape, 0.4))
    assert keep.any() and (~keep).any()
    _, ds_dropped = fused_vjp_jit(scores, jnp.where(keep, 0, dy), None, key, scale=1.0, causal=False, rate=0.4)
    _, ds_kept = fused_vjp_jit(scores, jnp.where(keep, dy, 0), None, key, scale=1.0, causal=False, rate=0.4)
    _, ds_all = fused_vjp_jit(scores, dy, None, key, scale=1.0, causal=False, rate=0.4)
    assert not np.asarray(ds_dropped, np.float32).any()
    assert (np.asarray(ds_kept, np.float32) != 0).mean() > 0.99
    np.testing.assert_array_equal(np.asarray(ds_kept, np.float32), np.asarray(ds_all, np.float32))


def test_rate_zero_needs_no_key_and_ignores_one():
    scores, dy = normal(101, (4, 7, 130), F16), normal(102, (4, 7, 130), F16)
    plain = fused_vjp_jit(scores, dy, None, None, scale=0.3, causal=True, rate=0.0)
    keyed = fused_vjp_jit(scores, dy, None, jax.random.key(103), scale=0.3, causal=True, rate=0.0)
    for p, k in zip(plain, keyed):
        np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(k, np.float32))


def _bad_cases():
    s = normal(111, (2, 4, 8))
    key = jax.random.key(112)
    ok = dict(scores=s, rate=0.1, key=key)
    return [
        ("scores-rank1", dict(ok, scores=normal(0, (8,))), ValueError, "`scores`"),
        ("scores-int", dict(ok, scores=jnp.ones((2, 4, 8), jnp.int32)), TypeError, "`scores`"),
        ("scores-complex", dict(ok, scores=jnp.ones((2, 4, 8), jnp.complex64)), TypeError, "`scores`"),
        ("mask-shape", dict(ok, mask=jnp.ones((3, 1, 8), bool)), ValueError, "`mask`"),
        ("mask-rank", dict(ok, mask=jnp.ones((1, 2, 4, 8), bool)), ValueError, "`mask`"),
        ("mask-int", dict(ok, mask=jnp.ones((8,), jnp.int32)), TypeError, "`mask`"),
        ("rate-one", dict(ok, rate=1.0), ValueError, "`rate`"),
        ("rate-negative", dict(ok, rate=-0.1), ValueError, "`rate`"),
        ("key-missing", dict(ok, key=None), ValueError, "`key`"),
        ("key-shape", dict(ok, key=jax.random.split(key, 2)), ValueError, "`key`"),
        ("scale-nan", dict(ok, scale=float("nan")), ValueError, "`scale`"),
        ("scale-inf", dict(ok, scale=float("inf")), ValueError, "`scale`"),
        ("scale-str", dict(ok, scale="1"), TypeError, "`scale`"),
        ("scale-bool", dict(ok, scale=True), TypeError, "`scale`"),
        ("causal-int", dict(ok, causal=1), TypeError, "`causal`"),
    ]


@pytest.mark.parametrize("name,kwargs,exc,arg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_naming_op_and_argument(name, kwargs, exc, arg):
    kwargs = dict(kwargs)
    scores = kwargs.pop("scores")
    with pytest.raises(exc, match="softmax_dropout") as info:
        jax.jit(lambda s: op(s, **kwargs)).lower(scores)
    assert arg in str(info.value)


@pytest.mark.parametrize("name", ["scale", "rate"])
def test_traced_static_argument_is_a_type_error(name):
    scores = normal(121, (2, 8))
    with pytest.raises(TypeError, match=f"softmax_dropout.*`{name}`"):
        jax.jit(lambda v: op(scores, key=jax.random.key(0), **{name: v}))(0.1)


def test_wide_rows_fall_back_to_reference(fallback_log):
    shape = (2, 3, _ffi.MAX_COLS + 1)
    scores, dy = normal(131, shape, BF16), normal(132, shape, BF16)
    mask = make_mask(133, "additive", shape)
    key = jax.random.key(134)
    f = lambda s, m: op(s, scale=0.5, mask=m, causal=True, rate=0.1, key=key)
    hlo = jax.jit(f).lower(scores, mask).as_text()
    assert "jaxsub_softmax_dropout" not in hlo
    assert "jaxsub_dropout_mask" in hlo
    assert fallback_log and fallback_log[0][0] == "softmax_dropout" and str(shape[-1]) in fallback_log[0][1]
    check_against_oracles(scores, dy, mask, scale=0.5, causal=True, rate=0.1, key=key)
    # The reference it falls back to differentiates the additive mask, as the kernels' path does.
    dm = jax.jit(jax.grad(lambda m: f(scores, m).astype(jnp.float32).sum()))(mask)
    keep = jaxsub.ops.dropout_mask(key, view4(shape), 0.1).reshape(shape)
    ref = lambda m: reference_softmax_dropout(scores, scale=0.5, mask=m, causal=True, keep=keep, rate=0.1)
    want = jax.jit(jax.grad(lambda m: ref(m).astype(jnp.float32).sum()))(mask)
    assert np.asarray(dm).any()
    assert_close(dm, want, F32, grad=True, what="dmask")


@pytest.mark.parametrize("shape", [(0, 4, 5), (2, 0, 5), (2, 3, 0)])
def test_zero_size_falls_back(shape, fallback_log):
    scores, dy = normal(141, shape), normal(142, shape)
    y, ds = fused_vjp_jit(scores, dy, None, jax.random.key(143), scale=1.0, causal=True, rate=0.1)
    assert y.shape == shape and ds.shape == shape
    assert fallback_log and "zero-size" in fallback_log[0][1]


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
class TestCuda:
    @staticmethod
    def compare(shape, dtype, mask, causal, seed):
        scores, dy = normal(seed, shape, dtype, scale=2.0), normal(seed + 1, shape, dtype)
        key = jax.random.key(seed + 2)
        run = jax.jit(lambda s, dy, m, k: fused_vjp(s, dy, m, k, scale=0.125, causal=causal, rate=0.1))
        args = (scores, dy, mask, key)
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        assert all(g.devices() == {jax.devices()[0]} for g in got)
        # Dropped and masked elements are exactly the zeros: the masks are bit-identical.
        np.testing.assert_array_equal(np.asarray(got[0], np.float32) == 0, np.asarray(want[0], np.float32) == 0)
        assert_close(got[0], want[0], dtype, reduction=shape[-1], what="y")
        assert_close(got[1], want[1], dtype, reduction=shape[-1], grad=True, what="dscores")

    @pytest.mark.parametrize("masking", ["padding", "causal"])
    @pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
    def test_bert_large_matches_cpu(self, dtype, masking):
        shape = (8, 16, 512, 512)
        mask = make_mask(151, "padding", shape) if masking == "padding" else None
        self.compare(shape, dtype, mask, masking == "causal", 152)

    @pytest.mark.parametrize("shape, dtype, masking", [
        ((4, 16, 600, 64), BF16, None),
        ((2, 16, 1100, 128), F16, "padding"),
        ((2, 16, 1030, 128), BF16, "causal"),
    ], ids=["64-bfloat16", "128-float16-padding", "128-bfloat16-causal"])
    def test_rows_over_several_iterations_match_cpu(self, shape, dtype, masking):
        """Row counts above one wave of row groups (the resident blocks walk the rows, each
        group asking L2 for its next one), the last iteration partly filled, on the
        16-bit paths whose dropout is the keep decision's select."""
        mask = make_mask(181, "padding", shape) if masking == "padding" else None
        self.compare(shape, dtype, mask, masking == "causal", 182)

    @pytest.mark.parametrize("sk", [9, 512, 1000])
    @pytest.mark.parametrize("rate", [0.0, 0.3])
    @pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
    def test_nan_and_inf_scores_match_cpu(self, dtype, rate, sk):
        """The CUDA kernels' NaN rows are the CPU handler's (and plain JAX's): a NaN or +inf
        score a query sees makes that row's kept probabilities and its gradient NaN, a
        dropped one stays 0, a NaN that causal hides changes nothing. The kernels' row max
        skipped NaN (fmaxf) and a NaN row's lse was stored as an empty row's, so its
        gradient came out as zeros."""
        shape = (2, 3, 5, sk)
        s = np.array(normal(171 + sk, shape))
        s[0, 1, 2, :] = np.nan
        s[1, 0, 3, 1] = np.nan
        s[1, 2, 0, 0] = np.inf
        s[0, 2, 0, sk - 1] = np.nan  # hidden under causal
        scores, dy = jnp.asarray(s, dtype), normal(172 + sk, shape, dtype)
        run = jax.jit(lambda s, dy, k: fused_vjp(s, dy, None, k, scale=0.5, causal=True, rate=rate))
        args = (scores, dy, jax.random.key(173))
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        rows = nan_rows(want[0])
        assert rows.sum() == 3
        np.testing.assert_array_equal(np.isnan(np.asarray(got[0], np.float32)), np.isnan(np.asarray(want[0], np.float32)))
        np.testing.assert_array_equal(nan_rows(got[1]), rows)
        for name, g, w in zip(("y", "dscores"), got, want):
            assert_close(jnp.where(rows[..., None], 0, g), jnp.where(rows[..., None], 0, w), dtype, reduction=sk,
                         grad=name != "y", what=name)

    @pytest.mark.parametrize("sk", [1, 7, 130, 1000, 4100])
    @pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["float32", "bfloat16", "float16"])
    def test_odd_sizes_match_cpu(self, dtype, sk):
        shape = (2, 3, 5, sk)
        self.compare(shape, dtype, make_mask(161 + sk, "full", shape), True, 162 + sk)
