"""attention: both implementations against a float64 reference (dropout mask from
dropout_mask), gradients, masks and causal alignment, fully masked rows, vmap, the fused
targets in the HLO, fused == unfused, validation, and the GPU fallback routing."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub import _C, _ffi
from jaxsub.ops.attn import reference_attention
from jaxsub.testing import assert_close, causal_rows_shifted

op = jaxsub.ops.attention
# The module, not the function: jaxsub.ops re-exports the function under the same name.
attention_module = importlib.import_module("jaxsub.ops.attn")
F32, BF16, F16, F64 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float64)
IMPLEMENTATIONS = ("fused", "unfused")


def normal(rng, shape, dtype=F32):
    """Fresh standard-normal draws (never zeros) in `dtype`."""
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


def qkv(seed, b, sq, sk, h, d, dtype):
    """q, k, v and an output cotangent; q is scaled up so that softmax rows are peaked
    rather than nearly uniform, which would hide errors in the probabilities."""
    rng = np.random.default_rng(seed)
    q = normal(rng, (b, sq, h, d), dtype) * jnp.asarray(2.0, dtype)
    k, v = normal(rng, (b, sk, h, d), dtype), normal(rng, (b, sk, h, d), dtype)
    return q, k, v, normal(rng, (b, sq, h, d), dtype)


def make_mask(kind, seed, b, h, sq, sk):
    """A mask of each accepted form; every row keeps at least one key, except where a
    test wants fully masked rows."""
    rng = np.random.default_rng(seed)
    if kind is None:
        return None
    if kind == "padding":  # [B, Sk], True = attend; key 0 always valid
        m = rng.random((b, sk)) < 0.7
        m[:, 0] = True
        return jnp.asarray(m)
    if kind == "bool4d":  # [B, 1, Sq, Sk]
        m = rng.random((b, 1, sq, sk)) < 0.6
        m[..., 0] = True
        return jnp.asarray(m)
    if kind == "batch":  # [B, 1, 1, 1]: every key of batch 1 hidden (its rows give zeros)
        return jnp.asarray(np.arange(b).reshape(b, 1, 1, 1) != 1)
    if kind == "headkeys":  # [1, H, 1, Sk]: key padding per head
        m = rng.random((1, h, 1, sk)) < 0.7
        m[..., 0] = True
        return jnp.asarray(m)
    if kind == "leftpad":  # [B, 1, 1, Sk] additive: example 0's first third of keys -1e9
        m = np.zeros((b, 1, 1, sk), np.float32)
        m[0, ..., :sk // 3] = -1e9
        return jnp.asarray(m)
    if kind in ("keybias", "headbias"):  # [B, 1, 1, Sk] / [1, H, 1, Sk] additive: a key bias
        shape = (b, 1, 1, sk) if kind == "keybias" else (1, h, 1, sk)
        m = rng.standard_normal(shape).astype(np.float32)
        m[rng.random(shape) < 0.2] = -np.inf
        m[rng.random(shape) < 0.2] = -1e4
        m[..., 0] = 0.5
        return jnp.asarray(m)
    if kind == "additive":  # [H, Sq, Sk] with some -inf
        m = rng.standard_normal((h, sq, sk)).astype(np.float32)
        m[rng.random((h, sq, sk)) < 0.2] = -np.inf
        m[..., -1] = 0.5
        return jnp.asarray(m)
    raise AssertionError(kind)


def run_vjp(q, k, v, dout, mask, key, *, causal, rate, implementation, scale=None, broadcast=False):
    f = lambda q, k, v: op(q, k, v, mask=mask, causal=causal, scale=scale, dropout_rate=rate, key=key,
                           implementation=implementation, broadcast_dropout=broadcast)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(dout))


# Jitted once: eager vjp compiles op by op, which would dominate the suite's time.
run_vjp_jit = jax.jit(run_vjp, static_argnames=("causal", "rate", "implementation", "scale", "broadcast"))


def _reference_vjp(q, k, v, dout, mask, keep, *, causal, rate, scale):
    f = lambda q, k, v: reference_attention(q, k, v, mask=mask, causal=causal, scale=scale, keep=keep, rate=rate)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(dout))


_reference_vjp_jit = jax.jit(_reference_vjp, static_argnames=("causal", "rate", "scale"))


def reference_vjp_f64(q, k, v, dout, mask, keep, *, causal, rate, scale=None):
    """The reference's output and VJP in float64, on the (exactly upcast) inputs."""
    with jax.enable_x64(True):
        up = lambda a: None if a is None or a.dtype == jnp.bool_ else jnp.asarray(np.asarray(a, np.float64))
        res = _reference_vjp_jit(up(q), up(k), up(v), up(dout), mask if mask is None or mask.dtype == jnp.bool_
                                 else up(mask), keep, causal=causal, rate=rate, scale=scale)
        return tuple(np.asarray(r, np.float64) for r in res)


def keep_mask(key, b, h, sq, sk, rate):
    return None if rate == 0.0 else jaxsub.ops.dropout_mask(key, (b, h, sq, sk), rate)


def check_against_reference(got, want, dtype, sq, sk, d):
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1:])
    n = max(sq, sk, d)
    assert_close(got[0], want[0], dtype, reduction=n, what="out")
    for name, g, w in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert_close(g, w, dtype, reduction=n, grad=True, what=name)


# (Sq, Sk, H, D, dtype, mask, causal, rate): every sequence length, head count, head dim,
# dtype, mask form, causal and dropout appear, with Sq != Sk both ways, without the full
# product (each case is one compilation per implementation).
CASES = [
    (1, 1, 1, 8, F32, None, False, 0.0),
    (7, 7, 3, 8, F32, "padding", True, 0.1),
    (128, 128, 1, 64, F32, "additive", False, 0.1),
    (130, 130, 3, 64, F32, None, True, 0.0),
    (7, 130, 3, 8, F32, "bool4d", True, 0.2),
    (130, 7, 1, 8, F32, "padding", True, 0.0),
    (1, 130, 3, 64, BF16, None, False, 0.1),
    (128, 128, 3, 64, BF16, "padding", True, 0.1),
    (130, 7, 3, 8, BF16, "additive", False, 0.0),
    (7, 128, 1, 64, F16, "additive", True, 0.1),
    (130, 130, 1, 8, F16, "bool4d", False, 0.1),
    (128, 1, 3, 64, F16, None, True, 0.0),
    (7, 130, 3, 8, BF16, "headkeys", True, 0.1),
    (130, 7, 1, 8, F32, "batch", False, 0.1),
]


@functools.cache
def case_data(sq, sk, h, d, dtype, mask_kind, causal, rate):
    """Inputs and the float64 reference of one CASES entry, shared by both implementations."""
    b = 2
    seed = sq * 1000 + sk * 10 + d
    q, k, v, dout = qkv(seed, b, sq, sk, h, d, dtype)
    mask = make_mask(mask_kind, seed + 1, b, h, sq, sk)
    key = jax.random.key(seed + 2)
    keep = keep_mask(key, b, h, sq, sk, rate)
    return (q, k, v, dout, mask, key), reference_vjp_f64(q, k, v, dout, mask, keep, causal=causal, rate=rate)


@pytest.mark.parametrize("sq,sk,h,d,dtype,mask_kind,causal,rate", CASES,
                         ids=[f"{c[0]}x{c[1]}-h{c[2]}-d{c[3]}-{c[4].name}-{c[5]}-{'causal' if c[6] else 'full'}-p{c[7]}"
                              for c in CASES])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fwd_and_vjp_match_f64_reference(implementation, sq, sk, h, d, dtype, mask_kind, causal, rate):
    args, want = case_data(sq, sk, h, d, dtype, mask_kind, causal, rate)
    got = run_vjp_jit(*args, causal=causal, rate=rate, implementation=implementation)
    check_against_reference(got, want, dtype, sq, sk, d)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_explicit_scale(implementation):
    q, k, v, dout = qkv(5, 2, 7, 130, 3, 8, F32)
    got = run_vjp_jit(q, k, v, dout, None, None, causal=False, rate=0.0, implementation=implementation, scale=0.9)
    want = reference_vjp_f64(q, k, v, dout, None, None, causal=False, rate=0.0, scale=0.9)
    check_against_reference(got, want, F32, 7, 130, 8)


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_check_grads_fused(rate):
    q, k, v, _ = qkv(11, 1, 3, 5, 2, 4, F32)
    mask = jnp.asarray([[True, False, True, True, True]])
    key = jax.random.key(12)
    f = lambda q, k, v: op(q, k, v, mask=mask, causal=True, dropout_rate=rate, key=key, implementation="fused")
    check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fully_masked_rows_give_zeros_and_zero_grads(implementation):
    # Batch 1 pads every key; with causal and Sq > Sk the first Sq - Sk queries see no key.
    b, sq, sk, h, d = 2, 9, 6, 3, 8
    q, k, v, dout = qkv(21, b, sq, sk, h, d, F32)
    pad = jnp.asarray(np.array([[True] * sk, [False] * sk]))
    got = run_vjp_jit(q, k, v, dout, pad, jax.random.key(22), causal=True, rate=0.2,
                      implementation=implementation)
    out, dq, dk, dv = (np.asarray(g) for g in got)
    assert all(np.isfinite(g).all() for g in (out, dq, dk, dv))
    blind = sq - sk
    assert (out[1] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (out[0, :blind] == 0).all() and (dq[0, :blind] == 0).all()
    assert (out[0, blind:] != 0).any() and (dk[0] != 0).any()
    keep = keep_mask(jax.random.key(22), b, h, sq, sk, 0.2)
    want = reference_vjp_f64(q, k, v, dout, pad, keep, causal=True, rate=0.2)
    check_against_reference(got, want, F32, sq, sk, d)


def test_additive_minus_inf_row_is_fully_masked():
    q, k, v, dout = qkv(23, 1, 4, 5, 1, 8, F32)
    mask = np.zeros((1, 1, 4, 5), np.float32)
    mask[..., 2, :] = -np.inf
    for implementation in IMPLEMENTATIONS:
        out, dq, dk, dv = run_vjp_jit(q, k, v, dout, jnp.asarray(mask), None, causal=False, rate=0.0,
                                      implementation=implementation)
        assert (np.asarray(out)[0, 2] == 0).all() and (np.asarray(dq)[0, 2] == 0).all()
        assert np.isfinite(np.asarray(dk)).all() and np.isfinite(np.asarray(dv)).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("fill", [-1e4, -1e9, -3e38])
def test_additive_rows_masked_by_large_values(implementation, fill):
    """BERT's additive padding mask (1 - valid) * fill with an example of padding only:
    every score of its rows is fill + s, and a softmax row does not change by a constant,
    so those rows are the example's unmasked attention (as in float64), forward and
    backward alike. The f32 log-sum-exp of fill + s, rounded to a multiple of 64 at -1e9,
    made the backward's probabilities 1 there (gradients Sk times too large) before
    masks._near shifted such rows."""
    b, sq, sk, h, d = 2, 7, 9, 3, 8
    q, k, v, dout = qkv(25, b, sq, sk, h, d, F32)
    valid = np.array([[True] * 5 + [False] * 4, [False] * sk])
    additive = jnp.asarray((1.0 - valid[:, None, None, :]) * fill, jnp.float32)
    got = run_vjp_jit(q, k, v, dout, additive, None, causal=False, rate=0.0, implementation=implementation)
    seen = jnp.asarray(valid | ~valid.any(-1, keepdims=True))  # example 1: every key
    want = reference_vjp_f64(q, k, v, dout, seen, None, causal=False, rate=0.0)
    check_against_reference(got, want, F32, sq, sk, d)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_additive_rows_whose_visible_keys_hold_large_values(implementation):
    """Under the causal rule a mask row's visible keys can all hold large negative values
    while a key the rule hides does not: those rows are shifted by their visible keys'
    maximum (masks._near), not left as they are (the rows' gradients were up to their
    visible keys' count too large) or shifted by a hidden key's value. Against the float64
    reference of the same mask with each row shifted in numpy."""
    b, sq, sk, h, d = 2, 7, 9, 3, 8
    q, k, v, dout = qkv(26, b, sq, sk, h, d, F32)
    vis = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    m = np.zeros((b, h, sq, sk), np.float32)
    m[0, 1, :4] = np.where(vis[:4], -1e9, 0.0)  # visible keys -1e9, hidden ones 0
    m[1, :, 2] = np.where(vis[2], -2e9, -1e9)   # visible keys -2e9, hidden ones -1e9
    got = run_vjp_jit(q, k, v, dout, jnp.asarray(m), None, causal=True, rate=0.0, implementation=implementation)
    want = reference_vjp_f64(q, k, v, dout, causal_rows_shifted(m, sq, sk), None, causal=True, rate=0.0)
    check_against_reference(got, want, F32, sq, sk, d)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_additive_mask_broadcast_over_queries_whose_first_queries_see_large_values(implementation):
    """A mask broadcast over the queries ([B, 1, 1, Sk]: a left-padded batch's `(1 - valid)
    * -1e9`) under the causal rule: a padded example's first queries see only padded keys.
    Each such query's row is shifted by its visible keys' maximum (masks.by_query expands
    the mask to a row per query); before, those rows' gradients were up to their visible
    keys' count too large. Example 1's keys hold -2e9 then -1e9 (shifted by -1e9 over
    every key, its first query still sees only large values); example 2 is padding only
    and example 3 has none (neither needs a row per query). Against the float64 reference
    of the mask expanded and shifted in numpy."""
    b, sq, sk, h, d = 4, 7, 9, 2, 8
    q, k, v, dout = qkv(27, b, sq, sk, h, d, F32)
    m = np.zeros((b, 1, 1, sk), np.float32)
    m[0, ..., :4] = -1e9
    m[1, ..., :3], m[1, ..., 3:] = -2e9, -1e9
    m[2] = -1e9
    got = run_vjp_jit(q, k, v, dout, jnp.asarray(m), None, causal=True, rate=0.0, implementation=implementation)
    want = reference_vjp_f64(q, k, v, dout, causal_rows_shifted(m, sq, sk), None, causal=True, rate=0.0)
    check_against_reference(got, want, F32, sq, sk, d)
    # Without a query that needs it, the mask stays broadcast: the same numbers as before.
    fine = jnp.asarray(m[2:])
    got = run_vjp_jit(q[2:], k[2:], v[2:], dout[2:], fine, None, causal=True, rate=0.0, implementation=implementation)
    want = reference_vjp_f64(q[2:], k[2:], v[2:], dout[2:], fine, None, causal=True, rate=0.0)
    check_against_reference(got, want, F32, sq, sk, d)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("sq, sk", [(7, 9), (9, 7)])
def test_additive_mask_broadcast_over_keys_under_the_causal_rule(implementation, sq, sk):
    """A mask with a row per query broadcast over the keys ([B, 1, Sq, 1]: query padding
    by `(1 - valid_q) * -1e9`) under the causal rule: a padded query's visible keys all
    hold its value, so its row is shifted (masks._near), as the same mask broadcast to
    [B, 1, Sq, Sk] is. Before, the visibility was taken over the mask's one key column,
    which only the last query sees: the other padded rows stayed unshifted, their outputs
    uniform over the visible keys and their gradients wrong (found by a probe). With
    Sq > Sk the first queries see no key. Against the float64 reference of the mask
    broadcast and shifted in numpy."""
    b, h, d = 2, 3, 8
    q, k, v, dout = qkv(29, b, sq, sk, h, d, F32)
    m = np.zeros((b, 1, sq, 1), np.float32)
    m[0, :, [1, 4, sq - 1]] = -1e9
    m[1, :, 2] = -2e9
    got = run_vjp_jit(q, k, v, dout, jnp.asarray(m), None, causal=True, rate=0.0, implementation=implementation)
    want = reference_vjp_f64(q, k, v, dout, causal_rows_shifted(m, sq, sk), None, causal=True, rate=0.0)
    check_against_reference(got, want, F32, sq, sk, d)


def test_needs_query_rows_is_whether_some_query_shift_is_not_zero():
    """masks.by_query decides by two reductions what query_shift's scan gives: on random
    masks over 0, -1, -300, -1e9, -2e9, -inf, NaN and 5 at small odd sizes."""
    from jaxsub.ops import masks
    rng = np.random.default_rng(28)
    values = np.array([0.0, -1.0, -300.0, -1e9, -2e9, -np.inf, np.nan, 5.0], np.float32)
    seen = set()
    for sq, sk in [(1, 1), (1, 5), (3, 9), (9, 3), (7, 7), (11, 2), (2, 11), (6, 10)]:
        rows = np.stack([rng.choice(values, size=sk, p=rng.dirichlet(np.ones(len(values)))) for _ in range(400)])
        m = jnp.asarray(rows[:, None, None, :])  # one mask row per example
        want = np.asarray(masks.query_shift(m, sq, sk) != 0).any(axis=(1, 2, 3))
        got = np.asarray(jax.vmap(lambda r: masks.needs_query_rows(r[None, None, None], sq, sk))(m[:, 0, 0]))
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (sq, sk, rows[bad[:3]])
        seen |= set(want.tolist())
    assert seen == {False, True}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal", [False, True])
def test_nan_rows_stay_nan(implementation, causal):
    """As in plain JAX: a NaN in a query row makes its output row NaN (it was a row of
    zeros, as one with no visible key), and the gradients of its (batch, head) NaN; every
    other (batch, head) as before."""
    b, s, h, d, rate = 2, 7, 2, 8, 0.2
    q, k, v, dout = qkv(71, b, s, s, h, d, F32)
    q = q.at[0, 2, 1].set(jnp.nan)  # (b 0, query 2, head 1)
    key = jax.random.key(72)
    keep = jaxsub.ops.dropout_mask(key, (b, h, s, s), rate)
    vis = jnp.tril(jnp.ones((s, s), bool)) if causal else True

    def plain(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        p = jax.nn.softmax(jnp.where(vis, scores, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / (1 - rate), 0.0), v)

    def ours(q, k, v):
        return jaxsub.ops.attention(q, k, v, causal=causal, dropout_rate=rate, key=key, implementation=implementation)

    want, want_g = jax.vjp(plain, q, k, v)[0], jax.vjp(plain, q, k, v)[1](dout)
    got, vjp = jax.vjp(jax.jit(ours), q, k, v)
    got_g = vjp(dout)
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))
    assert np.isnan(np.asarray(got[0, 2, 1])).all() and np.isnan(np.asarray(got)).sum() == d
    bad = np.zeros((b, h), bool)
    bad[0, 1] = True
    for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g):
        per_head = lambda a: np.isnan(np.asarray(a)).any(axis=(1, 3))  # noqa: E731 - [B, H]
        np.testing.assert_array_equal(per_head(g), per_head(w), err_msg=name)
        assert (per_head(g) == bad).all() or name == "dv", name  # dv: only keys with a NaN probability
        sel = lambda a: np.asarray(a)[:, :, 0]  # noqa: E731 - head 0 has no NaN
        assert_close(sel(g), sel(w), F32, reduction=s, grad=True, what=name)
    assert_close(np.asarray(got)[:, :, 0], np.asarray(want)[:, :, 0], F32, reduction=s, what="out")


def test_two_dimensional_mask_where_batch_equals_sq_raises():
    """A 2-D mask is [B, Sk] key padding when it has that shape, else one over [Sq, Sk];
    where B == Sq it has both shapes and was read as key padding silently (an additive
    [Sq, Sk] bias applied per example: outputs off by 2.3). An additive one now raises,
    naming both explicit forms; a boolean one stays key padding (the documented form,
    which examples/flax_bert.py passes at B == S)."""
    b, s, h, d = 3, 3, 2, 8
    q, k, v, dout = qkv(27, b, s, s, h, d, F32)
    bias = jnp.asarray(np.random.default_rng(28).standard_normal((s, s)).astype(np.float32) * 3)
    for implementation in IMPLEMENTATIONS:
        with pytest.raises(ValueError, match=r"jaxsub.attention: a 2-D additive `mask` of shape \(3, 3\) is ambiguous"):
            op(q, k, v, mask=bias, implementation=implementation)
        # A boolean [B, Sk] mask is the documented key-padding form, also where B == Sq.
        keys = bias > 0
        assert_close(op(q, k, v, mask=keys, implementation=implementation),
                     op(q, k, v, mask=keys[:, None, None, :], implementation=implementation))
        got = run_vjp_jit(q, k, v, dout, bias[None, None], None, causal=False, rate=0.0,
                          implementation=implementation)
        want = reference_vjp_f64(q, k, v, dout, bias[None, None], None, causal=False, rate=0.0)
        check_against_reference(got, want, F32, s, s, d)
        # Unambiguous shapes keep their readings: [B, Sk] with B != Sq, [Sq, Sk] with B != Sq.
        assert op(q[:2], k[:2], v[:2], mask=bias[:2], implementation=implementation).shape == (2, s, h, d)
        assert op(q[:1], k[:1], v[:1], mask=bias, implementation=implementation).shape == (1, s, h, d)


def test_causal_is_bottom_right_aligned():
    # With Sq < Sk the last query sees every key and query i sees keys 0 .. i + Sk - Sq:
    # changing key j must not change any output row that may not see it.
    q, k, v, _ = qkv(25, 1, 3, 7, 1, 8, F32)
    f = jax.jit(lambda k, v: op(q, k, v, causal=True, implementation="fused"))
    base = np.asarray(f(k, v))
    for j in range(7):
        changed = np.asarray(f(k.at[:, j].add(1.0), v.at[:, j].add(1.0)))
        rows_that_see_j = [i for i in range(3) if j <= i + 4]
        for i in range(3):
            differs = not np.array_equal(changed[0, i], base[0, i])
            assert differs == (i in rows_that_see_j), (i, j)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_extra_leading_axis_matches_loop(implementation):
    n, b, sq, sk, h, d = 3, 2, 7, 130, 3, 8
    rng = np.random.default_rng(31)
    q, k, v, dout = (normal(rng, (n, b, s, h, d), BF16) for s in (sq, sk, sk, sq))
    key = jax.random.key(32)
    f = lambda q, k, v, dout: run_vjp(q, k, v, dout, None, key, causal=True, rate=0.1,
                                      implementation=implementation)
    got = jax.jit(jax.vmap(f))(q, k, v, dout)
    for i in range(n):
        want = jax.jit(f)(q[i], k[i], v[i], dout[i])
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(g[i], w, BF16, what=name)
            if implementation == "fused":  # the custom call is mapped sequentially: bit-exact
                np.testing.assert_array_equal(np.asarray(g[i], np.float32), np.asarray(w, np.float32))


def test_fused_targets_in_lowered_hlo():
    q, k, v, _ = qkv(41, 2, 7, 130, 3, 64, BF16)
    key = jax.random.key(42)
    f = lambda impl: lambda q, k, v: op(q, k, v, causal=True, dropout_rate=0.1, key=key, implementation=impl)
    loss = lambda impl: lambda q, k, v: f(impl)(q, k, v).astype(F32).sum()
    fwd = jax.jit(f("fused")).lower(q, k, v).as_text()
    bwd = jax.jit(jax.grad(loss("fused"), (0, 1, 2))).lower(q, k, v).as_text()
    assert "jaxsub_attention_fwd" in fwd and "jaxsub_softmax_dropout" not in fwd
    assert "jaxsub_attention_bwd" in bwd
    for impl in (None, "unfused"):
        hlo = jax.jit(jax.grad(loss(impl), (0, 1, 2))).lower(q, k, v).as_text()
        assert "jaxsub_attention" not in hlo
        assert "jaxsub_softmax_dropout_fwd" in hlo and "jaxsub_softmax_dropout_bwd" in hlo


def test_unfused_gemms_stay_in_the_input_dtype_forward_and_backward():
    """No f32 [B, H, Sq, Sk] tensor and no mixed-precision GEMM in the unfused path's
    gradient: every dot_general takes and gives bf16 for bf16 inputs."""
    q, k, v, _ = qkv(43, 2, 7, 9, 3, 8, BF16)
    loss = lambda q, k, v: op(q, k, v, dropout_rate=0.1, key=jax.random.key(44),
                              implementation="unfused").astype(F32).sum()
    dots = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                dots.append([v.aval.dtype for v in (*e.invars, *e.outvars)])
            for p in e.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr)
    assert len(dots) == 6 and all(d == BF16 for ds in dots for d in ds), dots


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_and_unfused_agree_with_dropout(dtype):
    b, sq, sk, h, d = 2, 130, 128, 3, 64
    q, k, v, dout = qkv(51, b, sq, sk, h, d, dtype)
    mask = make_mask("padding", 52, b, h, sq, sk)
    key = jax.random.key(53)
    fused = run_vjp_jit(q, k, v, dout, mask, key, causal=True, rate=0.5, implementation="fused")
    unfused = run_vjp_jit(q, k, v, dout, mask, key, causal=True, rate=0.5, implementation="unfused")
    for name, f, u in zip(("out", "dq", "dk", "dv"), fused, unfused):
        assert_close(f, u, dtype, reduction=sk, grad=name != "out", what=name)


def assert_kept_probabilities_are_dropout_mask(q, k, key, rate, implementation, broadcast=False):
    """Asserts that the forward and the backward keep exactly `dropout_mask`'s elements
    ([B, H, Sq, Sk], or with `broadcast` [1, 1, Sq, Sk] for every batch and head); returns
    the step's lowered HLO. With v's first Sk columns the identity (D >= Sk), out[b, i, h,
    j] is the dropped-out probability (b, h, i, j); with dout's first Sq columns the
    identity (D >= Sq), dv[b, j, h, i] is that probability times the keep scale. So the
    zeros of each are the elements that pass dropped."""
    (b, sq, h, d), sk = q.shape, k.shape[1]
    v = jnp.broadcast_to(jnp.eye(sk, d, dtype=q.dtype)[None, :, None, :], (b, sk, h, d))
    dout = jnp.broadcast_to(jnp.eye(sq, d, dtype=q.dtype)[None, :, None, :], (b, sq, h, d))

    def step(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: op(q, k, v, dropout_rate=rate, key=key, implementation=implementation,
                                              broadcast_dropout=broadcast), q, k, v)
        return out, vjp(dout)[2]

    run = jax.jit(step)
    out, dv = (np.asarray(x.astype(F32)) for x in run(q, k, v, dout))
    kept_fwd = np.transpose(out[..., :sk], (0, 2, 1, 3)) != 0
    kept_bwd = np.transpose(dv[..., :sq], (0, 2, 3, 1)) != 0
    shape = (1, 1, sq, sk) if broadcast else (b, h, sq, sk)
    mask = np.broadcast_to(np.asarray(jaxsub.ops.dropout_mask(key, shape, rate)), (b, h, sq, sk))
    assert mask.any() and (~mask).any()
    np.testing.assert_array_equal(kept_fwd, mask, err_msg="forward")
    np.testing.assert_array_equal(kept_bwd, mask, err_msg="backward")
    return run.lower(q, k, v, dout).as_text()


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dropped_probabilities_are_dropout_mask(implementation, broadcast):
    b, sq, sk, h, rate = 2, 7, 16, 3, 0.4
    q, k, _, _ = qkv(61, b, sq, sk, h, sk, F32)
    key = jax.random.key(62)
    assert_kept_probabilities_are_dropout_mask(q, k, key, rate, implementation, broadcast)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("sq,sk,h,h_kv,mask_kind,causal", [(7, 13, 3, 3, "padding", True),
                                                          (13, 9, 4, 2, "keybias", False)])
def test_broadcast_dropout_matches_f64_reference(implementation, sq, sk, h, h_kv, mask_kind, causal):
    """broadcast_dropout: one [Sq, Sk] keep mask for every batch and head (Flax's
    `broadcast_dropout=True`), the f64 reference given that mask broadcast; grouped-query
    heads included."""
    b, d, rate = 2, 8, 0.3
    q, k, v, dout = qkv(sq * 100 + sk, b, sq, sk, h, d, F32)
    k, v = k[:, :, :h_kv], v[:, :, :h_kv]
    mask = make_mask(mask_kind, 5, b, h, sq, sk)
    key = jax.random.key(sq + sk)
    f = jax.jit(lambda q, k, v, dout: jax.vjp(lambda q, k, v: op(
        q, k, v, mask=mask, causal=causal, dropout_rate=rate, key=key, implementation=implementation,
        broadcast_dropout=True), q, k, v)[1](dout))
    out = jax.jit(lambda q, k, v: op(q, k, v, mask=mask, causal=causal, dropout_rate=rate, key=key,
                                     implementation=implementation, broadcast_dropout=True))(q, k, v)
    keep = jaxsub.ops.dropout_mask(key, (1, 1, sq, sk), rate)
    want = reference_vjp_f64(q, k, v, dout, mask, keep, causal=causal, rate=rate)
    check_against_reference((out, *f(q, k, v, dout)), want, F32, sq, sk, d)
    # Not the per-element mask's result.
    other = op(q, k, v, mask=mask, causal=causal, dropout_rate=rate, key=key, implementation=implementation)
    assert np.abs(np.asarray(other) - np.asarray(out)).max() > 0.1


def test_same_key_same_output_new_key_different():
    q, k, v, _ = qkv(71, 2, 7, 7, 3, 8, F32)
    k1, k2 = jax.random.split(jax.random.key(72))
    f = jax.jit(lambda key: op(q, k, v, dropout_rate=0.3, key=key, implementation="fused"))
    a, b, c = (np.asarray(f(x)) for x in (k1, k1, k2))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def _bad_cases():
    rng = np.random.default_rng(91)
    q, k = normal(rng, (2, 5, 3, 8)), normal(rng, (2, 6, 3, 8))
    ok = dict(q=q, k=k, v=k, dropout_rate=0.1, key=jax.random.key(92))
    return [
        ("q-rank3", dict(ok, q=q[0]), ValueError, "`q`"),
        ("k-rank5", dict(ok, k=k[None]), ValueError, "`k`"),
        ("k-batch", dict(ok, k=k[:1], v=k[:1]), ValueError, "`k`"),
        ("k-heads", dict(ok, k=k[:, :, :2], v=k[:, :, :2]), ValueError, "`k`"),
        ("k-headdim", dict(ok, k=k[..., :4], v=k[..., :4]), ValueError, "`k`"),
        ("v-seq", dict(ok, v=k[:, :5]), ValueError, "`v`"),
        ("v-headdim", dict(ok, v=k[..., :4]), ValueError, "`v`"),
        ("q-int", dict(ok, q=jnp.ones((2, 5, 3, 8), jnp.int32)), TypeError, "`q`"),
        ("k-dtype", dict(ok, k=k.astype(BF16)), TypeError, "`k`"),
        ("v-dtype", dict(ok, v=k.astype(F16)), TypeError, "`v`"),
        ("rate-one", dict(ok, dropout_rate=1.0), ValueError, "`dropout_rate`"),
        ("broadcast-str", dict(ok, broadcast_dropout="yes"), TypeError, "`broadcast_dropout`"),
        ("rate-negative", dict(ok, dropout_rate=-0.1), ValueError, "`dropout_rate`"),
        ("key-missing", dict(ok, key=None), ValueError, "`key`"),
        ("implementation", dict(ok, implementation="flash"), ValueError, "`implementation`"),
        ("mask-shape", dict(ok, mask=jnp.ones((2, 5), jnp.bool_)), ValueError, "`mask`"),
        ("mask-rank", dict(ok, mask=jnp.ones((1, 2, 3, 5, 6), jnp.bool_)), ValueError, "`mask`"),
        ("mask-int", dict(ok, mask=jnp.ones((2, 6), jnp.int32)), TypeError, "`mask`"),
        ("causal-str", dict(ok, causal="yes"), TypeError, "`causal`"),
        ("scale-nan", dict(ok, scale=float("nan")), ValueError, "`scale`"),
    ]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name,kwargs,exc,arg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_naming_op_and_argument(name, kwargs, exc, arg, implementation):
    kwargs = dict(kwargs)
    q, k, v = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v")
    kwargs.setdefault("implementation", implementation)
    with pytest.raises(exc, match="jaxsub.attention") as info:
        jax.jit(lambda q, k, v: op(q, k, v, **kwargs)).lower(q, k, v)
    assert arg in str(info.value)


@pytest.fixture(params=["grouped", "repeated"])
def gqa_backward(request, monkeypatch):
    """The fused backward under grouped-query attention both ways, whatever the shape: the
    grouped kernels (k and v with their own heads) or k and v repeated to q's heads."""
    monkeypatch.setattr(attention_module, "GROUPED_BWD_MIN_BLOCKS", 0 if request.param == "grouped" else 1 << 40)
    return request.param


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("h,h_kv,mask_kind,causal,rate", [
    (4, 2, None, False, 0.0), (6, 3, "padding", True, 0.1), (3, 1, "additive", False, 0.2),
    (4, 4, "headkeys", True, 0.1)])
def test_grouped_query_attention(h, h_kv, mask_kind, causal, rate, implementation, gqa_backward):
    """k and v with fewer heads than q (grouped-query; one: multi-query): output and
    gradients against jax.nn.dot_product_attention's grouping (no dropout, f32) and the
    float64 reference (dropout: `dropout_mask` over q's heads); dk and dv have k's heads.
    Products at full f32 precision, so that on a GPU backend (TF32 by default) it checks the
    same thing."""
    with jax.default_matmul_precision("float32"):
        _grouped_query_case(h, h_kv, mask_kind, causal, rate, implementation)


def _grouped_query_case(h, h_kv, mask_kind, causal, rate, implementation):
    b, sq, sk, d = 2, 7, 9, 8
    q, k, v, dout = qkv(311 + h * 10 + h_kv, b, sq, sk, h, d, F32)
    k, v = k[:, :, :h_kv], v[:, :, :h_kv]
    mask = make_mask(mask_kind, 5, b, h, sq, sk)
    key = jax.random.key(7)
    got = run_vjp_jit(q, k, v, dout, mask, key, causal=causal, rate=rate, implementation=implementation)
    assert [g.shape for g in got] == [q.shape, q.shape, k.shape, v.shape]
    want = reference_vjp_f64(q, k, v, dout, mask, keep_mask(key, b, h, sq, sk, rate), causal=causal, rate=rate)
    check_against_reference(got, want, F32, sq, sk, d)
    if rate == 0.0 and mask_kind is None:
        def dpa(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
        out, vjp = jax.vjp(dpa, q, k, v)
        for g, w in zip(got, (out, *vjp(dout))):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("sk,min_blocks,backward_heads", [(9, 0, 2), (9, 5, 6), (200, 5, 2)])
def test_grouped_query_kernels_get_the_key_heads(monkeypatch, sk, min_blocks, backward_heads):
    """The fused path hands k and v to its forward with their own heads (the kernels group
    the q heads), not repeated to q's; to its backward too, unless that would run fewer than
    GROUPED_BWD_MIN_BLOCKS blocks (B * H_kv * key blocks of 64: 2 * 2 * 1 at Sk 9, 2 * 2 * 4
    at Sk 200), where it takes them repeated."""
    monkeypatch.setattr(attention_module, "GROUPED_BWD_MIN_BLOCKS", min_blocks)
    q, k, v, dout = qkv(331, 2, 7, sk, 6, 8, F32)
    k, v = k[:, :, :2], v[:, :, :2]

    def loss(q, k, v):
        return jnp.sum(jaxsub.ops.attention(q, k, v, implementation="fused") * dout)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    calls = [line for line in hlo.splitlines() if "jaxsub_attention_" in line and "custom_call" in line]
    assert len(calls) == 2, calls
    for line in calls:
        heads = backward_heads if "jaxsub_attention_bwd" in line else 2
        assert f"tensor<2x{sk}x{heads}x8xf32>" in line and f"tensor<2x{sk}x{8 - heads}x8xf32>" not in line, line


def test_key_heads_must_divide_query_heads():
    q, k, v, _ = qkv(5, 2, 7, 7, 4, 8, F32)
    with pytest.raises(ValueError, match=r"jaxsub.attention: `k`'s heads \(3\) must divide q's \(4\)"):
        jaxsub.ops.attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match=r"jaxsub.attention: `v` must have k's shape"):
        jaxsub.ops.attention(q, k[:, :, :2], v)


def test_traced_scale_is_a_type_error():
    q, k, v, _ = qkv(95, 1, 2, 2, 1, 4, F32)
    with pytest.raises(TypeError, match="attention.*`scale`"):
        jax.jit(lambda s: op(q, k, v, scale=s))(0.5)


def test_zero_size_gives_zeros():
    q, k, v, dout = qkv(97, 2, 3, 4, 1, 8, F32)
    out, dq, dk, dv = run_vjp(q, k[:, :0], v[:, :0], dout, None, None, causal=False, rate=0.0,
                              implementation="fused")
    assert out.shape == q.shape and not np.asarray(out).any() and not np.asarray(dq).any()
    assert dk.shape == (2, 0, 1, 8) and dv.shape == (2, 0, 1, 8)
    # Head dim 0 (the default scale divided by zero before).
    for impl in IMPLEMENTATIONS:
        out = op(jnp.zeros((1, 2, 1, 0)), jnp.zeros((1, 3, 1, 0)), jnp.zeros((1, 3, 1, 0)), implementation=impl)
        assert out.shape == (1, 2, 1, 0)
    assert jaxsub.ops.attention_packed(jnp.zeros((1, 2, 3, 1, 0))).shape == (1, 2, 1, 0)


@pytest.mark.parametrize("has_kernel,dtype,d,why", [
    (False, BF16, 64, "no fused attention kernel"),
    (True, F32, 64, "float32"),
    (True, BF16, 8, "head dim"),
])
def test_fused_on_gpu_routes_unsupported_cases_to_unfused(monkeypatch, fallback_log, has_kernel, dtype, d, why):
    # Routing only (this machine has no GPU): the platform is made to read "gpu".
    monkeypatch.setattr(attention_module, "_platform", lambda q: "gpu")
    monkeypatch.setattr(_ffi, "has_cuda_target", lambda name: has_kernel)
    q, k, v, _ = qkv(101, 2, 7, 7, 3, d, dtype)
    hlo = jax.jit(lambda q, k, v: op(q, k, v, implementation="fused")).lower(q, k, v).as_text()
    assert "jaxsub_attention" not in hlo and "jaxsub_softmax_dropout_fwd" in hlo
    assert fallback_log and fallback_log[0][0] == "attention" and why in fallback_log[0][1]


def test_fused_on_gpu_with_kernel_and_supported_shape_is_fused(monkeypatch, fallback_log):
    monkeypatch.setattr(attention_module, "_platform", lambda q: "gpu")
    monkeypatch.setattr(_ffi, "has_cuda_target", lambda name: True)
    q, k, v, _ = qkv(103, 2, 7, 7, 3, 64, BF16)
    hlo = jax.jit(lambda q, k, v: op(q, k, v, implementation="fused")).lower(q, k, v).as_text()
    assert "jaxsub_attention_fwd" in hlo and not fallback_log


def test_unfused_wide_rows_fallback_logs_under_the_function_called(monkeypatch, fallback_log):
    """Found by probing: the unfused attention's rows wider than the softmax kernel takes
    fell back under softmax_dropout's name. (The width limit is lowered for the test.)"""
    monkeypatch.setattr(_ffi, "MAX_COLS", 2)
    q, k, v, _ = qkv(107, 2, 3, 7, 2, 8, F32)
    got = op(q, k, v, implementation="unfused")
    assert_close(got, reference_attention(q, k, v), what="wide-row fallback")
    jaxsub.ops.attention_packed(jnp.stack([q, q, q], axis=2), implementation="unfused")
    assert [name for name, _ in fallback_log] == ["attention", "attention_packed"]
    assert [why for _, why in fallback_log] == ["last dimension 7 > 2", "last dimension 3 > 2"]


@pytest.mark.parametrize("platform,has_kernel,sm90,dtype,d,want", [
    ("gpu", True, False, BF16, 64, "fused"), ("gpu", True, False, F16, 32, "fused"),
    ("gpu", True, False, BF16, 128, "unfused"), ("gpu", True, True, BF16, 128, "fused"),
    ("gpu", True, True, F32, 64, "unfused"), ("gpu", False, True, BF16, 64, "unfused"),
    ("cpu", True, True, BF16, 64, "unfused"), ("cpu", True, True, BF16, 128, "unfused")])
def test_default_implementation_is_fused_on_gpu_where_faster(monkeypatch, fallback_log, platform, has_kernel, sm90,
                                                             dtype, d, want):
    monkeypatch.setattr(attention_module, "_platform", lambda q: platform)
    monkeypatch.setattr(_ffi, "has_cuda_target", lambda name: has_kernel)
    monkeypatch.setattr(_ffi, "attention_sm90", lambda: sm90)
    q, k, v, _ = qkv(105, 2, 7, 7, 3, d, dtype)
    hlo = jax.jit(lambda q, k, v: op(q, k, v)).lower(q, k, v).as_text()
    assert ("jaxsub_attention_fwd" in hlo) == (want == "fused")
    assert ("jaxsub_softmax_dropout_fwd" in hlo) == (want == "unfused")
    assert not fallback_log  # the default is no request: nothing to log


@pytest.mark.parametrize("mask_shape,additive,want", [
    ((1, 3, 7, 7), True, "unfused"), ((2, 1, 7, 7), True, "unfused"), ((2, 1, 1, 7), True, "fused"),
    ((1, 3, 7, 7), False, "fused")])
def test_default_implementation_with_a_mask(monkeypatch, mask_shape, additive, want):
    """An additive mask that varies over the queries (a learned relative-position bias)
    takes the unfused structure by default: the fused kernels' general score rule and
    serialized backward measured slower (H100, T5-like shape: 1 829 against 1 459 µs)."""
    monkeypatch.setattr(attention_module, "_platform", lambda q: "gpu")
    monkeypatch.setattr(_ffi, "has_cuda_target", lambda name: True)
    monkeypatch.setattr(_ffi, "attention_sm90", lambda: True)
    q, k, v, _ = qkv(106, 2, 7, 7, 3, 64, BF16)
    rng = np.random.default_rng(7)
    mask = (jnp.asarray(rng.standard_normal(mask_shape), F32) if additive
            else jnp.asarray(rng.random(mask_shape) < 0.7).at[..., 0].set(True))
    hlo = jax.jit(lambda q, k, v, m: op(q, k, v, mask=m)).lower(q, k, v, mask).as_text()
    assert ("jaxsub_attention_fwd" in hlo) == (want == "fused")
    assert ("jaxsub_softmax_dropout_fwd" in hlo) == (want == "unfused")


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
class TestCuda:
    """CUDA against the CPU handlers on the same inputs, key and mask: outputs and every
    gradient within tolerance, dropped probabilities identical (the CPU handler draws the
    same Philox mask). "fused" must run the CUDA fused kernel, not a fallback."""

    @staticmethod
    def _cuda_vs_cpu(b, sq, sk, h, d, *, causal, rate, implementation, dtype=BF16, mask_kind=None, seed=121,
                     h_kv=None, broadcast=False):
        q, k, v, dout = qkv(seed, b, sq, sk, h, d, dtype)
        k, v = k[:, :, :h_kv], v[:, :, :h_kv]  # grouped-query attention where h_kv < h
        groups = h // k.shape[2]  # dk and dv sum over the group's queries
        mask = make_mask(mask_kind, seed + 1, b, h, sq, sk)
        key = jax.random.key(seed + 2)
        run = jax.jit(lambda q, k, v, dout, mask, key: run_vjp(q, k, v, dout, mask, key, causal=causal, rate=rate,
                                                              implementation=implementation, broadcast=broadcast))
        args = (q, k, v, dout, mask, key)
        if implementation == "fused":
            hlo = run.lower(*args).as_text()
            assert "jaxsub_attention_fwd" in hlo and "jaxsub_attention_bwd" in hlo, "fused kernel did not run"
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        assert all(g.devices() == {jax.devices()[0]} for g in got)
        # out and dq reduce over keys, dk and dv over queries.
        for name, g, w, n in zip(("out", "dq", "dk", "dv"), got, want, (sk, sk, sq * groups, sq * groups)):
            assert g.shape == w.shape
            assert_close(g, w, dtype, reduction=n, grad=name != "out", what=f"{implementation} {name}")

    @pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
    def test_bert_large_dropout_matches_cpu(self, implementation):
        self._cuda_vs_cpu(8, 512, 512, 16, 64, causal=False, rate=0.1, implementation=implementation,
                          mask_kind="padding")

    @pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
    def test_long_causal_d128_matches_cpu(self, implementation):
        self._cuda_vs_cpu(1, 2048, 2048, 4, 128, causal=True, rate=0.1, implementation=implementation)

    def test_grouped_query_matches_cpu(self):
        """Eight q heads over two k/v heads, causal, dropout, D 128."""
        self._cuda_vs_cpu(2, 300, 300, 8, 128, causal=True, rate=0.1, implementation="fused", h_kv=2)

    @pytest.mark.parametrize("h,h_kv,d,sq,sk,causal,mask_kind,rate", [
        (6, 3, 64, 130, 200, False, "headkeys", 0.1),  # a key mask per q head: each head's own bits
        (4, 1, 64, 200, 130, True, "padding", 0.0),    # multi-query
        (6, 2, 128, 77, 300, True, None, 0.1),
        (6, 2, 32, 100, 100, False, "additive", 0.1),
        (6, 3, 64, 130, 200, True, "headbias", 0.1)])  # a key bias per q head: read again per head
    def test_grouped_query_kernels_match_cpu(self, h, h_kv, d, sq, sk, causal, mask_kind, rate, fwd_kernel,
                                             gqa_backward):
        """The kernels read k and v with their own heads: the forward each q head's k/v head,
        the backward's blocks walking the group's q heads in turn (dk, dv summed there)."""
        self._cuda_vs_cpu(2, sq, sk, h, d, causal=causal, rate=rate, implementation="fused", mask_kind=mask_kind,
                          h_kv=h_kv, seed=h * 100 + d)

    @pytest.fixture(params=["sm90", "mma"])
    def fwd_kernel(self, request, monkeypatch):
        """The kernels at D = 64 and 128: the wgmma ones where the build and the device
        have them (sm_90a), or the mma.sync ones (JAXSUB_ATTENTION_SM90=0, read by the
        handlers at each call); D = 32 always runs the mma.sync ones."""
        if request.param == "mma":
            monkeypatch.setenv("JAXSUB_ATTENTION_SM90", "0")
            assert not _C.attention_sm90()
        else:
            monkeypatch.delenv("JAXSUB_ATTENTION_SM90", raising=False)
            if jax.devices()[0].compute_capability != "9.0":
                pytest.skip("the wgmma kernels need compute capability 9.0")
            assert _C.attention_sm90(), "built without sm_90a device code"
        return request.param

    @pytest.mark.parametrize("d", [32, 64, 128])
    @pytest.mark.parametrize("sq,sk,mask_kind,causal", [
        (1, 7, None, False), (7, 130, "padding", True), (130, 128, "additive", False),
        (128, 1, "bool4d", False), (130, 130, "additive", True), (65, 200, None, True),
        (200, 65, None, True),  # Sq > Sk, causal: the first 135 queries see no key
        (7, 130, "headkeys", False), (130, 65, "batch", True),  # key masks: [1, H, 1, Sk], [B, 1, 1, 1]
        (257, 700, None, True),  # causal tiles the first row already sees take the unmasked rule
        (130, 130, "leftpad", True),  # its first queries see only -1e9: a row per query (masks.by_query)
        (7, 130, "keybias", True), (130, 65, "keybias", False), (77, 200, "headbias", True)])  # kKeyBias
    def test_fused_odd_sizes_match_cpu(self, sq, sk, mask_kind, causal, d, fwd_kernel):
        dtype = F16 if d == 32 or (d == 64 and sq % 2) else BF16
        self._cuda_vs_cpu(2, sq, sk, 3, d, causal=causal, rate=0.1, implementation="fused", dtype=dtype,
                          mask_kind=mask_kind, seed=sq * 1000 + sk + d)

    @pytest.mark.parametrize("broadcast", [False, True])
    @pytest.mark.parametrize("sq,sk", [(37, 45), (64, 64), (13, 7), (64, 33)])
    def test_dropped_probabilities_are_dropout_mask(self, sq, sk, broadcast, fwd_kernel):
        """The forward and the backward kernels drop exactly `dropout_mask`'s elements (the
        backward regenerates the same decisions), at D = 64; with broadcast_dropout, the
        [1, 1, Sq, Sk] mask's in every batch and head."""
        b, h, d, rate = 2, 3, 64, 0.4
        q, k, _, _ = qkv(171 + sq, b, sq, sk, h, d, BF16)
        hlo = assert_kept_probabilities_are_dropout_mask(q, k, jax.random.key(172 + sk), rate, "fused", broadcast)
        assert "jaxsub_attention_fwd" in hlo and "jaxsub_attention_bwd" in hlo, "fused kernel did not run"

    @pytest.mark.parametrize("b,sq,sk,h,h_kv,d,causal,mask_kind", [
        (8, 512, 512, 16, 16, 64, False, "keybias"),  # BERT-large with Flax's broadcast_dropout
        (2, 130, 77, 3, 3, 128, True, "padding"), (2, 77, 200, 6, 2, 64, True, None),
        (2, 100, 100, 3, 3, 32, False, "additive")])
    def test_broadcast_dropout_matches_cpu(self, b, sq, sk, h, h_kv, d, causal, mask_kind, fwd_kernel):
        """One [Sq, Sk] keep mask for every batch and head (drop_index without (b, h)):
        against the CPU handlers, wgmma and mma.sync kernels, grouped-query heads."""
        self._cuda_vs_cpu(b, sq, sk, h, d, causal=causal, rate=0.1, implementation="fused",
                          dtype=F16 if d == 32 else BF16, mask_kind=mask_kind, h_kv=h_kv, seed=sq + sk + d,
                          broadcast=True)

    def test_bert_large_dropout_matches_cpu_mma_kernels(self, monkeypatch):
        # test_bert_large_dropout_matches_cpu runs the default (sm90 where built) kernels.
        monkeypatch.setenv("JAXSUB_ATTENTION_SM90", "0")
        self._cuda_vs_cpu(8, 512, 512, 16, 64, causal=False, rate=0.1, implementation="fused", mask_kind="padding")

    @pytest.mark.parametrize("dtype", [BF16, F16])
    @pytest.mark.parametrize("d,causal,mask_kind", [(64, False, None), (64, True, "padding"), (128, False, "additive"),
                                                    (128, True, None)])
    def test_sm90_and_mma_kernels_agree(self, monkeypatch, d, causal, mask_kind, dtype):
        b, s, h = 2, 300, 4
        q, k, v, dout = qkv(141, b, s, s, h, d, dtype)
        mask = make_mask(mask_kind, 142, b, h, s, s)
        key = jax.random.key(143)
        run = jax.jit(lambda *args: run_vjp(*args, causal=causal, rate=0.1, implementation="fused"))
        if jax.devices()[0].compute_capability != "9.0":
            pytest.skip("the wgmma kernels need compute capability 9.0")
        monkeypatch.delenv("JAXSUB_ATTENTION_SM90", raising=False)
        assert _C.attention_sm90(), "built without sm_90a device code"
        sm90 = run(q, k, v, dout, mask, key)
        monkeypatch.setenv("JAXSUB_ATTENTION_SM90", "0")
        mma = run(q, k, v, dout, mask, key)
        for name, x, y in zip(("out", "dq", "dk", "dv"), sm90, mma):
            assert_close(x, y, dtype, reduction=s, grad=name != "out", what=name)

    @pytest.mark.parametrize("d,sq,sk,mask_kind", [(64, 128, 128, "padding"), (64, 64, 512, None),
                                                   (128, 100, 449, "additive"), (64, 7, 130, "headkeys"),
                                                   (64, 100, 600, None), (64, 130, 128, None)])
    def test_cluster_dq_matches_the_accumulator(self, monkeypatch, d, sq, sk, mask_kind):
        """Non-causal, Sq <= 128 and Sk <= 512 on the wgmma kernels: the key blocks of a (b, h)
        reduce dq in a thread block cluster (in rank order: the same bits on every run).
        Against the f32 accumulator and atomics (JAXSUB_ATTENTION_CLUSTER_DQ=0): out, dk and
        dv bitwise, dq within tolerance. Sk = 600 (10 key blocks) and Sq = 130 (3 query
        tiles) take the accumulator either way."""
        if jax.devices()[0].compute_capability != "9.0":
            pytest.skip("the wgmma kernels need compute capability 9.0")
        monkeypatch.delenv("JAXSUB_ATTENTION_SM90", raising=False)
        monkeypatch.delenv("JAXSUB_ATTENTION_CLUSTER_DQ", raising=False)
        q, k, v, dout = qkv(151, 2, sq, sk, 3, d, BF16)
        mask = make_mask(mask_kind, 152, 2, 3, sq, sk)
        key = jax.random.key(153)
        run = jax.jit(lambda *args: run_vjp(*args, causal=False, rate=0.1, implementation="fused"))
        cluster = run(q, k, v, dout, mask, key)
        if sq <= 128 and sk <= 512:
            np.testing.assert_array_equal(cluster[1], run(q, k, v, dout, mask, key)[1])
        monkeypatch.setenv("JAXSUB_ATTENTION_CLUSTER_DQ", "0")
        acc = run(q, k, v, dout, mask, key)
        for name, x, y in zip(("out", "dk", "dv"), (cluster[0], *cluster[2:]), (acc[0], *acc[2:])):
            np.testing.assert_array_equal(x, y, err_msg=name)
        assert_close(cluster[1], acc[1], BF16, reduction=sk, grad=True, what="dq")

    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("d", [32, 64])
    def test_nan_rows_match_cpu(self, d, causal, fwd_kernel):
        """A NaN query: its output row and its (batch, head)'s gradients NaN, as on the CPU
        handler and in plain JAX; every other (batch, head) within tolerance. The kernels'
        row max skipped NaN (fmaxf) and such a row's lse was stored as an empty row's, so
        its gradients came out finite."""
        b, s, h = 2, 70, 3
        q, k, v, dout = qkv(181 + d, b, s, s, h, d, F16 if d == 32 else BF16)
        q = q.at[0, 5, 1].set(jnp.nan)
        run = jax.jit(lambda *args: run_vjp(*args, causal=causal, rate=0.1, implementation="fused"))
        args = (q, k, v, dout, None, jax.random.key(182))
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        isnan = lambda a: np.isnan(np.asarray(a, np.float32))  # noqa: E731
        np.testing.assert_array_equal(isnan(got[0]), isnan(want[0]))
        assert isnan(want[0]).sum() == d
        bad = np.zeros((b, h), bool)
        bad[0, 1] = True
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            np.testing.assert_array_equal(isnan(g).any(axis=(1, 3)), bad, err_msg=name)
            np.testing.assert_array_equal(isnan(w).any(axis=(1, 3)), bad, err_msg=name)
            assert_close(np.asarray(g)[:, :, 0], np.asarray(w)[:, :, 0], q.dtype, reduction=s, grad=name != "out",
                         what=name)

    @pytest.mark.parametrize("d,causal", [(64, False), (64, True), (32, True)])
    def test_more_heads_than_a_grid_holds(self, d, causal):
        """B * H = 65552 (b, h) pairs, past the 65535 blocks a grid holds along y: the tile
        kernels launch in chunks of heads (the cluster-reduced backward at D 64 without the
        causal mask, the accumulator with it; the mma.sync kernels at D 32)."""
        self._cuda_vs_cpu(4097, 8, 8, 16, d, causal=causal, rate=0.1, implementation="fused",
                          dtype=F16 if d == 32 else BF16, seed=171 + d)

    @pytest.mark.parametrize("d", [64, 128])
    def test_fused_matches_unfused_on_gpu(self, d):
        b, s, h = 4, 512, 8
        q, k, v, dout = qkv(131, b, s, s, h, d, BF16)
        mask = make_mask("padding", 132, b, h, s, s)
        key = jax.random.key(133)
        fused = run_vjp_jit(q, k, v, dout, mask, key, causal=True, rate=0.1, implementation="fused")
        unfused = run_vjp_jit(q, k, v, dout, mask, key, causal=True, rate=0.1, implementation="unfused")
        for name, f, u in zip(("out", "dq", "dk", "dv"), fused, unfused):
            assert_close(f, u, BF16, reduction=s, grad=name != "out", what=name)


def test_float16_unfused_scales_before_its_scores_overflow():
    """Found by probing: float16 q.k of 102 400 (|q| = |k| = 40, D 64) overflowed in the
    unfused path's score product before its 1/8 scale, giving NaN where the fused kernel
    (f32 scores), jax.nn.dot_product_attention and f32 math are finite."""
    q = jnp.full((1, 4, 1, 64), 40.0, F16)
    v = jnp.asarray(np.random.default_rng(3).standard_normal((1, 4, 1, 64)), F16)
    want = reference_attention(*(a.astype(F32) for a in (q, q, v)))
    for impl in ("unfused", "fused"):
        out, vjp = jax.vjp(lambda q, v: op(q, q, v, implementation=impl), q, v)
        assert_close(out, want, F16, reduction=64, what=impl)
        assert all(bool(jnp.isfinite(g).all()) for g in vjp(jnp.ones_like(out)))
