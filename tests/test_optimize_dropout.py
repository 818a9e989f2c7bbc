"""jaxsub.optimize on CPU: bias + dropout + residual + layer norm and bias + GELU +
dropout written by hand, and the dropout spellings, keys and seeds they take (conventions:
test_optimize.py)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import ops
from jaxsub.testing import assert_close
from optimize_helpers import N, RATE, assert_same, bdrln_block, bernoulli_dropout, expect, ffn_block, normal


# ---------------------------------------------------------------------------------------
# BDRLN and bias + GELU + dropout, hand-written.


def _bdrln_args():
    return (normal(0, (8, N)), normal(1, (N,)), normal(2, (8, N)), normal(3, (N,)), normal(4, (N,)),
            jax.random.key(5))


def test_bdrln_without_dropout_matches():
    f = functools.partial(bdrln_block, rate=0.0)
    assert_same(f, _bdrln_args(), argnums=(0, 1, 2, 3, 4))
    expect(f, _bdrln_args(), bdrln=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_bdrln_with_a_layer_norm_written_with_mean_and_var(dtype):
    """r + (x + b) under a layer norm written x.mean(-1) / x.var(-1): in bf16 only the layer
    norm fused, explained as the residual sum "also used elsewhere" (found by probing):
    jnp.var upcasts its 16-bit input inside, and that upcast was not the layer norm's."""
    def f(x, b, r, s, lb):
        h = r + (x + b)
        m, v = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        return (h - m) / jnp.sqrt(v + 1e-5) * s + lb

    args = tuple(a.astype(dtype) for a in _bdrln_args()[:5])
    assert_same(f, args, dtype, argnums=(0, 1, 2, 3, 4))
    expect(f, args, bdrln=1)
    assert jaxsub.explain(f, *args).totals == {"bias_dropout_residual_layer_norm": 1}


def test_bdrln_dropout_uses_the_users_key():
    x, b, r, s, lb, key = _bdrln_args()
    x = normal(0, (64, N))
    r = normal(2, (64, N))
    f = functools.partial(bdrln_block, rate=RATE)
    opt = jaxsub.optimize(f)
    expect(f, (x, b, r, s, lb, key), bdrln=1)
    np.testing.assert_array_equal(opt(x, b, r, s, lb, key), opt(x, b, r, s, lb, key))
    # Dropped elements of x + b get no gradient; the mask is the fused op's for the same key.
    dx = jax.grad(lambda x: jnp.sum(opt(x, b, r, s, lb, key) * normal(9, x.shape)))(x)
    kept = np.asarray(dx != 0)
    np.testing.assert_array_equal(kept, ops.dropout_mask(key, x.shape, RATE))
    sigma = np.sqrt(kept.size * RATE * (1 - RATE))
    assert abs((~kept).sum() - kept.size * RATE) < 5 * sigma
    other = opt(x, b, r, s, lb, jax.random.key(6))
    assert np.mean(np.asarray(other != opt(x, b, r, s, lb, key))) > 0.05


def residual_dropout_block(x, b, r, key, *, bias=True):
    """A pre-LN layer's second residual: r + dropout(x + b), no layer norm after it."""
    return r + bernoulli_dropout(key, x + b if bias else x, RATE)


@pytest.mark.parametrize("bias", [True, False])
def test_residual_dropout_without_layer_norm_uses_the_users_key(bias):
    _, b, _, _, _, key = _bdrln_args()
    x, r = normal(0, (64, N)), normal(2, (64, N))
    f = functools.partial(residual_dropout_block, bias=bias)
    opt = jaxsub.optimize(f)
    text = jax.jit(opt).lower(x, b, r, key).as_text()
    assert text.count("@jaxsub_bias_dropout_residual_fwd(") == 1 and "bernoulli" not in text
    assert jaxsub.explain(f, x, b, r, key).totals == {"bias_dropout_residual": 1}
    y = opt(x, b, r, key)
    np.testing.assert_array_equal(y, opt(x, b, r, key))
    keep = ops.dropout_mask(key, x.shape, RATE)
    want = ops.dropout.reference_residual_add(r, x, b if bias else jnp.zeros_like(b), keep=keep, rate=RATE)
    assert_close(y, want, what="value")
    # Dropped elements of x get no gradient (the fused op's mask for the user's key); r's
    # gradient is the cotangent; b's the column sums of the kept, scaled cotangent.
    ct = normal(9, x.shape)
    dx, db, dr = jax.grad(lambda x, b, r: jnp.sum(opt(x, b, r, key) * ct), (0, 1, 2))(x, b, r)
    np.testing.assert_array_equal(np.asarray(dx != 0), keep)
    np.testing.assert_array_equal(dr, ct)
    assert_close(db, jnp.sum(jnp.where(keep, ct / (1 - RATE), 0), 0) if bias else jnp.zeros_like(b), grad=True,
                 reduction=64, what="dbias")
    assert np.mean(np.asarray(opt(x, b, r, jax.random.key(6)) != y)) > 0.05


@pytest.mark.parametrize("spelling", ["u < keep", "u >= rate", "rate <= u"])
def test_dropout_from_a_uniform_draw(spelling):
    """Dropout written as a comparison of jax.random.uniform with a constant (what
    bernoulli computes) is the fused op's dropout for the user's key, as bernoulli's is
    (found by probing: only bernoulli was recognized). A uniform used otherwise stays."""
    x, b, key = normal(0, (64, N)), normal(1, (N,)), jax.random.key(8)
    keep_of = {"u < keep": lambda u: u < 1 - RATE, "u >= rate": lambda u: u >= RATE,
               "rate <= u": lambda u: RATE <= u}[spelling]

    def f(x, b, key):
        keep = keep_of(jax.random.uniform(key, x.shape))
        return jnp.where(keep, jax.nn.gelu(x + b, approximate=False) / (1 - RATE), 0)

    report = jaxsub.explain(f, x, b, key)
    assert report.totals == {"bias_gelu_dropout": 1} and f"dropout rate={RATE:g}" in str(report), str(report)
    y = jaxsub.optimize(f)(x, b, key)
    keep = ops.dropout_mask(key, x.shape, RATE)
    want = jnp.where(keep, jax.nn.gelu(x + b, approximate=False) / (1 - RATE), 0)
    assert_close(y, want, what="value")

    def noisy(x, b, key):
        return jax.nn.gelu(x + b, approximate=False) + jax.random.uniform(key, x.shape)

    assert_close(jaxsub.optimize(noisy)(x, b, key), noisy(x, b, key), what="uniform noise")


@pytest.mark.parametrize("scale", ["divide", "multiply"])
def test_dropout_selected_then_scaled(scale):
    """jnp.where(keep, h, 0) / (1 - rate), the scale after the select (missed until a probe
    round: only the select of h / (1 - rate) was recognized), is the fused op's dropout for
    the user's key."""
    x, b, key = normal(0, (64, N)), normal(1, (N,)), jax.random.key(8)

    def scaled(y):
        return y / (1 - RATE) if scale == "divide" else y * (1 / (1 - RATE))

    def f(x, b, key):
        keep = jax.random.bernoulli(key, 1 - RATE, x.shape)
        return scaled(jnp.where(keep, jax.nn.gelu(x + b, approximate=False), 0))

    report = jaxsub.explain(f, x, b, key)
    assert report.totals == {"bias_gelu_dropout": 1} and f"dropout rate={RATE:g}" in str(report), str(report)
    keep = ops.dropout_mask(key, x.shape, RATE)
    want = jnp.where(keep, jax.nn.gelu(x + b, approximate=False) / (1 - RATE), 0)
    assert_close(jaxsub.optimize(f)(x, b, key), want, what="value")


def _keep(key, h):
    return jax.random.bernoulli(key, 1 - RATE, h.shape)


def _drop(key, h):
    return jax.random.bernoulli(key, RATE, h.shape)


_SPELLINGS = {
    # Equinox's nn.Dropout: the keep probability computed in the program
    "equinox": lambda h, key: (lambda q: jnp.where(jax.random.bernoulli(key, q, h.shape), h / q, 0))(
        1 - jax.lax.stop_gradient(RATE)),
    # a Python float scale: a weak-typed convert between the division and the product
    "h * (keep / p)": lambda h, key: h * (_keep(key, h) / (1 - RATE)),
    "h * where(keep, 1 / p, 0)": lambda h, key: h * jnp.where(_keep(key, h), 1 / (1 - RATE), 0),
    "where(keep, 1 / p, 0) * h": lambda h, key: jnp.where(_keep(key, h), 1 / (1 - RATE), 0.0) * h,
    # the dropped set drawn (drop = bernoulli(key, rate)) and negated or selected against
    "where(~drop, h / p, 0)": lambda h, key: jnp.where(~_drop(key, h), h / (1 - RATE), 0),
    "where(drop, 0, h / p)": lambda h, key: jnp.where(_drop(key, h), 0, h / (1 - RATE)),
    "where(drop, 0, h / p), drop = u < rate": lambda h, key: jnp.where(
        jax.random.uniform(key, h.shape) < RATE, 0, h / (1 - RATE)),
    "where(logical_not(drop), h, 0) / p": lambda h, key: jnp.where(
        jnp.logical_not(_drop(key, h)), h, 0) / (1 - RATE),
    "h * (1 - drop) / p": lambda h, key: h * (1 - _drop(key, h).astype(h.dtype)) / (1 - RATE),
    "h * where(drop, 0, 1 / p)": lambda h, key: h * jnp.where(_drop(key, h), 0.0, 1 / (1 - RATE)),
    # Praxis: a float mask floor(p + u)
    "h * floor(p + u) / p": lambda h, key: h * jnp.floor(1 - RATE + jax.random.uniform(key, h.shape)) / (1 - RATE),
}
_NOT_DROPOUT = {
    "where(keep, 1 / q, 0) * h, q != p": lambda h, key: jnp.where(_keep(key, h), 1 / (1 - 2 * RATE), 0.0) * h,
    "where(keep, 1 / p, 0.5) * h": lambda h, key: jnp.where(_keep(key, h), 1 / (1 - RATE), 0.5) * h,
    # the kept set selected as if dropped: keeps a fraction rate, scaled for 1 - rate
    "where(keep, 0, h / p)": lambda h, key: jnp.where(_keep(key, h), 0, h / (1 - RATE)),
    "h * (1 - keep) / p": lambda h, key: h * (1 - _keep(key, h).astype(h.dtype)) / (1 - RATE),
    "h * floor(q + u) / p, q != p": lambda h, key: h * jnp.floor(
        1 - 2 * RATE + jax.random.uniform(key, h.shape)) / (1 - RATE),
}


@pytest.mark.parametrize("spelling", [*_SPELLINGS, *_NOT_DROPOUT])
def test_dropout_spellings_of_other_libraries(spelling):
    """Dropout as Equinox, Praxis and hand-written code spell it, the mask of the dropped
    elements drawn included (missed until probe rounds), is the fused op's dropout for the
    user's key; a scale, fill or mask that is not dropout's stays the user's."""
    x, b, key = normal(0, (64, N)), normal(1, (N,)), jax.random.key(8)
    drop = {**_SPELLINGS, **_NOT_DROPOUT}[spelling]

    def f(x, b, key):
        return drop(jax.nn.gelu(x + b, approximate=False), key)

    report = jaxsub.explain(f, x, b, key)
    assert report.totals == {"bias_gelu_dropout": 1}, str(report)
    y = jaxsub.optimize(f)(x, b, key)
    if spelling in _NOT_DROPOUT:
        assert "dropout rate" not in str(report), str(report)
        assert_close(y, f(x, b, key), what="value")
        return
    assert f"dropout rate={RATE:g}" in str(report), str(report)
    keep = ops.dropout_mask(key, x.shape, RATE)
    assert_close(y, jnp.where(keep, jax.nn.gelu(x + b, approximate=False) / (1 - RATE), 0), what="value")


@pytest.mark.parametrize("key_form", ["typed", "raw_sliced_twice"])
@pytest.mark.parametrize("other", ["bernoulli", "normal"])
def test_a_key_that_also_draws_outside_the_patterns_keeps_its_dropout(key_form, other):
    """A dropout whose key also draws a mask (or noise) that stays in XLA stays too: in JAX
    the two draws share their bits (the same mask, for the same shape), which a fused op
    drawing its own mask would break (found by probing). The layer norm is still fused.
    A raw key is wrapped again at each draw, and `keys[0]` written twice slices it twice:
    still one key."""
    x, b, r, s, lb, _ = _bdrln_args()

    def f(x, b, r, s, lb, key):
        key_of = (lambda: jax.random.split(key)[0]) if key_form == "raw_sliced_twice" else (lambda: key)
        y = bdrln_block(x, b, r, s, lb, key_of(), rate=RATE)
        if other == "bernoulli":
            return y, bernoulli_dropout(key_of(), x + b, RATE)
        return y, x + jax.random.normal(key_of(), x.shape)

    key = jax.random.PRNGKey(5) if key_form == "raw_sliced_twice" else jax.random.key(5)
    report = jaxsub.explain(f, x, b, r, s, lb, key)
    assert report.totals == {"layer_norm": 1}, str(report)
    assert "its key also draws a mask that stays in XLA" in str(report), str(report)
    for got, want in zip(jaxsub.optimize(f)(x, b, r, s, lb, key), f(x, b, r, s, lb, key)):
        assert_close(got, want, what="value")


def test_dropouts_sharing_a_key_are_fused_together():
    """Two dropouts of one key, both fused: each op draws `dropout_mask(key, shape)`, so
    same-shaped masks stay equal, as in JAX."""
    x, b, r = normal(0, (64, N)), normal(1, (N,)), normal(2, (64, N))
    key = jax.random.key(3)

    def f(x, b, r, key):
        h = bernoulli_dropout(key, jax.nn.gelu(x + b, approximate=False), RATE)
        return r + bernoulli_dropout(key, h + b, RATE)

    report = jaxsub.explain(f, x, b, r, key)
    assert report.totals == {"bias_gelu_dropout": 1, "bias_dropout_residual": 1}, str(report)
    keep = ops.dropout_mask(key, x.shape, RATE)
    h = jnp.where(keep, jax.nn.gelu(x + b, approximate=False) / (1 - RATE), 0)
    assert_close(jaxsub.optimize(f)(x, b, r, key), r + jnp.where(keep, (h + b) / (1 - RATE), 0), what="value")


_KEEP_FORMS = {  # keep masks of one key in JAX's two forms: u < p (bernoulli's) and u >= rate
    "bernoulli keep": ("below", lambda key, h, rate: jnp.where(jax.random.bernoulli(key, 1 - rate, h.shape),
                                                               h / (1 - rate), 0)),
    "uniform < p": ("below", lambda key, h, rate: jnp.where(jax.random.uniform(key, h.shape) < 1 - rate,
                                                            h / (1 - rate), 0)),
    "dropped set": ("above", lambda key, h, rate: jnp.where(jax.random.bernoulli(key, rate, h.shape), 0,
                                                            h / (1 - rate))),
    "uniform >= rate": ("above", lambda key, h, rate: jnp.where(jax.random.uniform(key, h.shape) >= rate,
                                                                h / (1 - rate), 0)),
    "praxis floor": ("above", lambda key, h, rate: h * jnp.floor(1 - rate + jax.random.uniform(key, h.shape))
                     / (1 - rate)),
}


@pytest.mark.parametrize("second", list(_KEEP_FORMS))
@pytest.mark.parametrize("first", ["bernoulli keep", "dropped set"])
def test_dropouts_of_one_key_in_two_forms(first, second):
    """JAX keeps u < p for a bernoulli keep mask and u >= rate for a dropped set drawn (or
    `uniform >= rate`, Praxis's floor), from one u per element. Masks of one key in one form
    are nested by their rates, as the fused ops' (each `dropout_mask(key, shape, rate)`), so
    both are fused; in two forms JAX's overlap less (found in review: 0.79 of the elements
    kept by both at rate 0.1, 0.90 fused), so both stay in XLA, with JAX's bits."""
    x1, x2, b = normal(0, (64, N)), normal(1, (64, N)), normal(2, (N,))
    key, rate1, rate2 = jax.random.key(4), RATE, 2 * RATE

    def f(x1, x2, b, key):
        gelu = lambda x: jax.nn.gelu(x + b, approximate=False)
        return _KEEP_FORMS[first][1](key, gelu(x1), rate1), _KEEP_FORMS[second][1](key, gelu(x2), rate2)

    report = jaxsub.explain(f, x1, x2, b, key)
    assert report.totals == {"bias_gelu_dropout": 2}, str(report)
    got = jaxsub.optimize(f)(x1, x2, b, key)
    if _KEEP_FORMS[first][0] != _KEEP_FORMS[second][0]:
        assert "dropout rate" not in str(report), str(report)
        assert str(report).count("relates the masks its key draws otherwise") == 2, str(report)
        for a, w in zip(got, f(x1, x2, b, key)):
            assert_close(a, w, what="value")
        return
    assert "relates the masks its key draws otherwise" not in str(report), str(report)
    keep1, keep2 = ops.dropout_mask(key, x1.shape, rate1), ops.dropout_mask(key, x2.shape, rate2)
    assert bool(jnp.all(keep1 | ~keep2))  # nested: the larger rate keeps a subset
    gelu = lambda x: jax.nn.gelu(x + b, approximate=False)
    assert_close(got[0], jnp.where(keep1, gelu(x1) / (1 - rate1), 0), what="value")
    assert_close(got[1], jnp.where(keep2, gelu(x2) / (1 - rate2), 0), what="value")


@pytest.mark.parametrize("derive", ["clone", "wrap_key_data", "key_of_seed_twice"])
def test_one_key_derived_twice_is_one_key(derive):
    """`jax.random.clone(key)`, `wrap_key_data(key_data(key))` and `jax.random.key(s)` written
    twice hold the same key: two dropouts of it in two forms stay in XLA (a probe found them
    fused, kept both at 0.80 of the elements where JAX keeps 0.71)."""
    x1, x2, b = normal(0, (64, N)), normal(1, (64, N)), normal(2, (N,))
    same = {"clone": jax.random.clone, "wrap_key_data": lambda k: jax.random.wrap_key_data(jax.random.key_data(k)),
            "key_of_seed_twice": None}[derive]

    def f(x1, x2, b, seed):
        key = jax.random.key(seed)
        other = jax.random.key(seed) if same is None else same(key)
        gelu = lambda x: jax.nn.gelu(x + b, approximate=False)
        return (_KEEP_FORMS["bernoulli keep"][1](key, gelu(x1), RATE),
                _KEEP_FORMS["dropped set"][1](other, gelu(x2), RATE))

    report = jaxsub.explain(f, x1, x2, b, 7)
    assert report.totals == {"bias_gelu_dropout": 2}, str(report)
    assert str(report).count("relates the masks its key draws otherwise") == 2, str(report)
    for a, w in zip(jaxsub.optimize(f)(x1, x2, b, 7), f(x1, x2, b, 7)):
        assert_close(a, w, what="value")


@pytest.mark.parametrize("partitionable", [True, False])
def test_dropouts_of_one_key_at_two_sizes(partitionable):
    """With partitionable threefry (JAX's default) element i's bits depend on (key, i) only,
    at any size, as the fused ops' do: masks of one key at two sizes are fused. Without it
    JAX's bits differ between sizes, so they stay in XLA."""
    x1, x2, b = normal(0, (64, N)), normal(1, (32, N)), normal(2, (N,))

    def f(x1, x2, b, key):
        return tuple(bernoulli_dropout(key, jax.nn.gelu(x + b, approximate=False), RATE) for x in (x1, x2))

    with jax.threefry_partitionable(partitionable):
        key = jax.random.key(4)
        report = jaxsub.explain(f, x1, x2, b, key)
        got, want = jaxsub.optimize(f)(x1, x2, b, key), f(x1, x2, b, key)
    assert report.totals == {"bias_gelu_dropout": 2}, str(report)
    assert (str(report).count(f"dropout rate={RATE:g}") == 2) == partitionable, str(report)
    if not partitionable:
        assert str(report).count("relates the masks its key draws otherwise") == 2, str(report)
        for a, w in zip(got, want):
            assert_close(a, w, what="value")


def gelu_then_residual_dropout(x, b, r, key):
    """Two dropouts whose keys are the slices of one split (as a jnp layer draws them)."""
    keys = jax.random.split(key, 2)
    h = bernoulli_dropout(keys[0], jax.nn.gelu(x + b, approximate=False), RATE)
    return r + bernoulli_dropout(keys[1], h + b, RATE)


def _seed_operands(text):
    """The seed operand types of the fused forward calls in lowered text."""
    calls = [line for line in text.splitlines() if "custom_call @jaxsub_" in line and "_fwd(" in line]
    return [line[line.rfind(": ("):].split(") -> ")[0].split(", ")[-1] for line in calls]


def test_dropout_seeds_derived_in_the_program_share_one_row(monkeypatch):
    x, r = normal(0, (64, N)), normal(2, (64, N))
    b, key = normal(1, (N,)), jax.random.key(5)
    f = gelu_then_residual_dropout
    opt = jaxsub.optimize(f)
    text = jax.jit(opt).lower(x, b, r, key).as_text()
    # Each fused op reads its seed from a 16-byte quarter of one row (one kernel on a GPU,
    # where 8-byte slices of the split took a copy kernel each).
    assert _seed_operands(text) == ["tensor<4xui32>"] * 2 and "bernoulli" not in text
    assert text.count("-> tensor<8xui32>") == 1
    ct = normal(9, x.shape)

    def value_and_grads(g):
        return jax.value_and_grad(lambda x, b, r: jnp.sum(g(x, b, r, key) * ct), (0, 1, 2))(x, b, r)

    got = value_and_grads(opt)
    # The same seeds as each op given its own key: the user's split keys, bit for bit.
    monkeypatch.setattr(ops.dropout, "shared_seeds", lambda op, keys: list(keys))
    apart = jaxsub.optimize(f)
    assert _seed_operands(jax.jit(apart).lower(x, b, r, key).as_text()) == ["tensor<2xui32>"] * 2
    for a, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(value_and_grads(apart))):
        np.testing.assert_array_equal(a, w)


def test_dropout_keys_given_apart_are_read_in_place():
    """Keys that are the program's inputs are not copied into a row: their words are read
    where they are."""
    x, r = normal(0, (64, N)), normal(2, (64, N))
    b = normal(1, (N,))

    def f(x, b, r, k1, k2):
        h = bernoulli_dropout(k1, jax.nn.gelu(x + b, approximate=False), RATE)
        return r + bernoulli_dropout(k2, h + b, RATE)

    text = jax.jit(jaxsub.optimize(f)).lower(x, b, r, jax.random.key(1), jax.random.key(2)).as_text()
    assert _seed_operands(text) == ["tensor<2xui32>"] * 2 and "tensor<8xui32>" not in text


def test_shared_seeds_row():
    keys = [jax.random.key(3), None, jax.random.key(4)]
    words = ops.dropout.shared_seeds("t", keys)
    assert words[1] is None
    for k, w in zip((keys[0], keys[2]), (words[0], words[2])):
        np.testing.assert_array_equal(w.words, np.concatenate([jax.random.key_data(k), np.zeros(2, np.uint32)]))
    one = [None, jax.random.key(3)]
    assert ops.dropout.shared_seeds("t", one) == one


def test_residual_dropout_left_alone_when_not_private_or_not_rewritten():
    x, b, r, _, _, key = _bdrln_args()

    def shared(x, b, r, key):  # the dropped value is also returned
        d = bernoulli_dropout(key, x + b, RATE)
        return r + d, d

    report = jaxsub.explain(shared, x, b, r, key)
    assert "bias_dropout_residual" not in report.totals
    assert any(m.pattern == "bias_dropout_residual" for m in report.near_misses)
    f = residual_dropout_block
    opt = jaxsub.optimize(f, rewrite_dropout=False)
    assert "jaxsub_" not in jax.jit(opt).lower(x, b, r, key).as_text()
    # the user's own bits, as jax.jit(f) computes them (jax 0.12.1's eager ops round h * keep
    # / 0.75 by an ulp elsewhere than its compiled program does)
    np.testing.assert_array_equal(opt(x, b, r, key), jax.jit(f)(x, b, r, key))
    reasons = [m.detail for m in jaxsub.explain(opt, x, b, r, key).near_misses]
    assert reasons == ["dropout not rewritten (rewrite_dropout=False)"]


def bdrln_two_consumers(x, b, r, s, lb, w, key):
    """A post-LN block's h read twice: by a matmul and by the next residual add."""
    h = bdrln_block(x, b, r, s, lb, key, rate=0.0)
    return jnp.tanh(h @ w) + 0.5 * h


def test_bdrln_output_with_two_consumers_is_returned_twice():
    """Both consumers get their own output of the fused op (ops.norm.bdrln_pair): the
    backward has no add of their cotangents, and the gradients are the original's."""
    args = (*_bdrln_args()[:5], normal(7, (N, N)) / 4, jax.random.key(5))
    assert_same(bdrln_two_consumers, args, argnums=(0, 1, 2, 3, 4, 5))
    assert "output returned twice" in str(jaxsub.explain(bdrln_two_consumers, *args))

    def grads(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * normal(9, (8, N))), argnums=(0, 2))).lower(*args)

    def token_adds(f):
        return sum(1 for line in grads(f).as_text().splitlines()
                   if "stablehlo.add" in line and f"tensor<8x{N}xf32>" in line)

    assert "jaxsub_bdrln_bwd" in grads(jaxsub.optimize(bdrln_two_consumers)).as_text()
    # One add is the function's own `+`. The original also adds the two cotangents of h
    # (and the ones the layer norm's own backward sums); the rewritten one leaves them to
    # the kernel.
    assert token_adds(jaxsub.optimize(bdrln_two_consumers)) == 1 < token_adds(bdrln_two_consumers)


@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
def test_ffn_bias_gelu(approximate):
    x, w, b = normal(0, (8, 16)), normal(1, (16, N)) / 4, normal(2, (N,))
    f = functools.partial(ffn_block, rate=0.0, approximate=approximate)
    args = (x, w, b, jax.random.key(3))
    assert_same(f, args, argnums=(0, 1, 2))
    expect(f, args, bias_gelu_dropout=1)
    report = jaxsub.explain(f, *args)
    assert report.totals == {"bias_gelu_dropout": 1}
    assert ("tanh" if approximate else "exact") in str(report)


def test_hand_written_gelu_formulas():
    def erf_gelu(x, b):
        v = x + b
        return 0.5 * v * (1.0 + jax.lax.erf(v / np.sqrt(2.0)))

    def tanh_gelu(x, b):
        v = b + x
        return v * 0.5 * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v * v * v)))

    def sigmoid_gelu(x, b):  # the tanh form through sigmoid (found by probing: not matched)
        v = x + b
        return v * jax.nn.sigmoid(2.0 * np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3))

    def not_gelu(x, b):  # a wrong constant must not pass for GELU
        v = x + b
        return 0.5 * v * (1.0 + jnp.tanh(0.8 * (v + 0.044715 * v ** 3)))

    def quick_gelu(x, b):  # x sigmoid(1.702 x): another function
        v = x + b
        return v * jax.nn.sigmoid(1.702 * v)

    def gelu_beyond_six(x, b):  # GELU on [-6, 6], not beyond (found by probing)
        v = x + b
        return 0.5 * v * (1.0 + jax.lax.erf(v / np.sqrt(2.0))) + 0.1 * v * (1.0 + jnp.tanh(10.0 * (v - 8.0)))

    args = (normal(0, (8, N)), normal(1, (N,)))
    for fn in (erf_gelu, tanh_gelu, sigmoid_gelu):
        assert_same(fn, args, argnums=(0, 1))
        expect(fn, args, bias_gelu_dropout=1)
    assert "tanh GELU" in str(jaxsub.explain(sigmoid_gelu, *args))
    expect(not_gelu, args)
    expect(quick_gelu, args)
    expect(gelu_beyond_six, args)


def test_custom_jvp_closing_over_a_traced_value_with_nothing_matched():
    """A custom_jvp whose rule closes over fn's traced argument, or takes an array as a
    nondiff argument: jax.grad(optimize(fn)) raised UnexpectedTracerError, replaying the
    jaxpr's call whose rule held the trace's tracers (found by both fuzzers; JAX's own
    grad(jit(fn)) fails too). With nothing to rewrite, fn itself runs in the transform."""
    def closing(x, c):
        @jax.custom_jvp
        def f(x):
            return jnp.sin(x) * c

        @f.defjvp
        def f_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return f(x), jnp.cos(x) * c * t

        return f(x)

    nondiff = jax.custom_jvp(lambda x, m: jnp.sin(x) * m, nondiff_argnums=(1,))
    nondiff.defjvp(lambda m, p, t: (nondiff(p[0], m), jnp.cos(p[0]) * m * t[0]))
    x, c = normal(0, (3, 4)), normal(1, (3, 1))
    for fn in (closing, nondiff):
        assert not jaxsub.explain(fn, x, c).matches
        want = jax.grad(lambda *a: fn(*a).sum())(x, c)
        for got in (jax.grad(lambda *a: jaxsub.optimize(fn)(*a).sum())(x, c),
                    jax.jit(jax.grad(lambda *a: jaxsub.optimize(fn)(*a).sum()))(x, c)):
            np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_without_a_bias(dtype):
    """gelu(x @ w) with no bias (nanoGPT's bias=False MLP), with and without dropout after it,
    and a GELU of a function's input: the op with a zero bias. Not matched before."""
    x, w, w2 = normal(0, (8, 16), dtype), normal(1, (16, N), dtype) / 4, normal(2, (N, 16), dtype) / 4

    def mlp(x, w, w2):
        return jax.nn.gelu(x @ w, approximate=False) @ w2

    def of_input(h):
        return 0.5 * h * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))

    assert_same(mlp, (x, w, w2), dtype, argnums=(0, 1, 2))
    expect(mlp, (x, w, w2), bias_gelu_dropout=1)
    assert "exact GELU, no bias" in str(jaxsub.explain(mlp, x, w, w2))
    assert_same(of_input, (x @ w,), dtype)
    expect(of_input, (x @ w,), bias_gelu_dropout=1)

    def dropped(x, w, key):
        h = jax.nn.gelu(x @ w)
        keep = jax.random.bernoulli(key, 1 - RATE, h.shape)
        return jnp.where(keep, h / (1 - RATE), 0)

    key = jax.random.key(3)
    got = jaxsub.optimize(dropped)(x, w, key)
    want = ops.bias_gelu_dropout(x @ w, jnp.zeros((N,), dtype), rate=RATE, key=key, approximate=True)
    assert_close(got, want, dtype)
    for not_gelu in (jax.nn.silu, lambda h: h * jax.nn.sigmoid(1.702 * h), jnp.tanh):
        expect(lambda x, w, f=not_gelu: f(x @ w), (x, w))


@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
def test_ffn_dropout_statistics(approximate):
    x, w, b, key = normal(0, (128, 16)), normal(1, (16, N)) / 8, normal(2, (N,)), jax.random.key(3)
    f = functools.partial(ffn_block, rate=RATE, approximate=approximate)
    opt = jaxsub.optimize(f)
    expect(f, (x, w, b, key), bias_gelu_dropout=1)
    y = np.asarray(opt(x, w, b, key))
    np.testing.assert_array_equal(y, opt(x, w, b, key))
    clean = np.asarray(ffn_block(x, w, b, key, rate=0.0, approximate=approximate))
    mask = np.asarray(ops.dropout_mask(key, y.shape, RATE))
    # The fused op's mask for the user's key; GELU itself may underflow to an exact zero.
    np.testing.assert_array_equal((y != 0)[clean != 0], mask[clean != 0])
    sigma = np.sqrt(y.size * RATE * (1 - RATE))
    assert abs((~mask).sum() - y.size * RATE) < 5 * sigma
    assert abs(y.mean() - clean.mean()) < 5 * np.std(y) / np.sqrt(y.size)
