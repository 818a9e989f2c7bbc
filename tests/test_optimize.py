"""jaxsub.optimize / jaxsub.explain: the jaxpr pass on CPU.

Each source (hand-written jnp, flax.linen, flax.nnx) is optimized and compared with the
original: deterministic outputs and gradients within the jaxsub.testing tolerance, the
expected number of each fused target in the lowered HLO, and explain()'s report. With
dropout, the fused kernels draw different bits, so statistics and the mask itself (the
fused op's mask for the key the user's code used) are checked instead.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsub
from jaxsub import ops
from jaxsub.rewrite import match_norm
from jaxsub.testing import assert_close

N = 32
RATE = 0.25
TARGETS = ("jaxsub_layer_norm_fwd", "jaxsub_bdrln_fwd", "jaxsub_bias_gelu_dropout_fwd")


def _normal(i, shape, dtype=jnp.float32):
    # numpy draws: eager jax.random would compile a kernel per shape.
    return jnp.asarray(np.random.default_rng(i).standard_normal(shape, np.float32).astype(dtype))


def _counts(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return {t: text.count(f"@{t}(") for t in TARGETS}


def _expect(f, args, **counts):
    want = {t: 0 for t in TARGETS}
    want.update({f"jaxsub_{k}_fwd": v for k, v in counts.items()})
    assert _counts(jaxsub.optimize(f), *args) == want


def _assert_same(f, args, dtype=jnp.float32, argnums=(0,), reduction=N):
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
    dy = _normal(99, ref.shape)

    def loss(g):
        return lambda *a: jnp.sum(g(*a).astype(jnp.float32) * dy)

    grads = jax.jit(jax.grad(loss(opt), argnums))(*args)
    refs = jax.jit(jax.grad(loss(f), argnums))(*args)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(refs)):
        assert g.dtype == r.dtype
        assert_close(g, r, dtype, reduction=max(reduction, ref.size // N), grad=True, what="grad")


# ---------------------------------------------------------------------------------------
# Layer norm from every source.


def ln_two_pass(x, s, b):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b


def ln_fast_upcast(x, s, b):
    xf = x.astype(jnp.float32)
    m = xf.mean(-1, keepdims=True)
    v = jnp.mean(xf * xf, -1, keepdims=True) - m * m
    return ((xf - m) / jnp.sqrt(v + 1e-6) * s + b).astype(x.dtype)


def ln_var_recip(x, s, b):
    inv = 1.0 / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5)
    return s * ((x - x.mean(-1, keepdims=True)) * inv)


def ln_pow(x, s, b):
    """rsqrt as a power, (v + eps) ** -0.5 (found by probing: not matched)."""
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * (v + 1e-5) ** -0.5 * s + b


def ln_pow_div(x, s, b):
    """sqrt as a power, divided by."""
    m = x.mean(-1, keepdims=True)
    return (x - m) / jnp.power(jnp.var(x, -1, keepdims=True) + 1e-5, 0.5) * s + b


def ln_reciprocal_sum_times(x, s, b):
    """jnp.reciprocal(jnp.sqrt(var + eps)), and the mean as (1 / N) * sum (found by fuzzing:
    not matched)."""
    m = (1.0 / x.shape[-1]) * x.sum(-1, keepdims=True)
    return (x - m) * jnp.reciprocal(jnp.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)) * s + b


def ln_no_params(x):
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5)


@pytest.mark.parametrize("fn,dtype", [(ln_two_pass, jnp.float32), (ln_fast_upcast, jnp.bfloat16),
                                      (ln_fast_upcast, jnp.float32), (ln_var_recip, jnp.float32),
                                      (ln_pow, jnp.float32), (ln_pow_div, jnp.float32),
                                      (ln_reciprocal_sum_times, jnp.float32)],
                         ids=["two_pass", "fast_upcast_bf16", "fast_f32", "var_recip", "pow", "pow_div",
                              "reciprocal_sum_times"])
def test_hand_written_layer_norm(fn, dtype):
    args = (_normal(0, (6, N), dtype), _normal(1, (N,)), _normal(2, (N,)))
    _assert_same(fn, args, dtype, argnums=(0, 1, 2))
    _expect(fn, args, layer_norm=1)
    assert jaxsub.explain(fn, *args).totals == {"layer_norm": 1}


def test_explain_says_when_the_variance_formula_changes():
    """jax.nn.standardize's variance E[x^2] - mean^2 is computed two-pass by the kernels: the
    same function, exact where the original cancels (mean 100, spread 3e-3: the f32 original
    is off by ~1e4, the fused op by ~1e-3; found by probing). explain says so."""
    args = (_normal(0, (6, N)), _normal(1, (N,)), _normal(2, (N,)))
    assert "taken as E[(x - mean)^2]" in str(jaxsub.explain(ln_fast_upcast, *args))
    assert "taken as" not in str(jaxsub.explain(ln_two_pass, *args))
    standardize = lambda x: jax.nn.standardize(x, axis=-1, epsilon=1e-5)  # noqa: E731
    assert "taken as E[(x - mean)^2]" in str(jaxsub.explain(standardize, args[0]))
    _assert_same(standardize, args[:1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_jnp_var_layer_norm_in_every_dtype(dtype):
    """jnp.var of a 16-bit x squares the upcast x's deviations from its own f32 mean and
    rounds the variance back; the matcher took only jnp.mean's round trip, so this layer
    norm was fused in f32 alone, with no near-miss (found by probing)."""
    def ln(x, g, b):
        mu = jnp.mean(x, -1, keepdims=True)
        return (x - mu) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * g + b

    args = (_normal(0, (6, N), dtype), _normal(1, (N,), dtype), _normal(2, (N,), dtype))
    assert jaxsub.explain(ln, *args).totals == {"layer_norm": 1}
    _assert_same(ln, args, dtype, argnums=(0, 1, 2))


def test_layer_norm_without_parameters():
    x = _normal(0, (2, 3, N))
    _assert_same(ln_no_params, (x,))
    _expect(ln_no_params, (x,), layer_norm=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_flax_linen_layer_norm(dtype):
    m = nn.LayerNorm(dtype=dtype, param_dtype=jnp.float32)
    x = _normal(0, (6, N), dtype)
    params = m.init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: p + _normal(3, p.shape), params)
    _assert_same(m.apply, (params, x), dtype, argnums=(0, 1))
    _expect(m.apply, (params, x), layer_norm=1)


def test_flax_nnx_layer_norm():
    layer = nnx.LayerNorm(N, rngs=nnx.Rngs(0))
    x = _normal(0, (6, N))
    _assert_same(lambda x: layer(x), (x,))
    _expect(lambda x: layer(x), (x,), layer_norm=1)


class _NnxBlock(nnx.Module):
    """Post-LN residual block with dropout, as nnx users write one."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(N, N, rngs=rngs)
        self.norm = nnx.LayerNorm(N, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x):
        return self.norm(x + self.drop(self.dense(x)))


def test_nnx_module_argument_advances_its_rngs():
    """A train-mode nnx module passed to an optimized function (alone or inside nnx.jit /
    nnx.value_and_grad) kept its RNG count: every step drew the same dropout mask, without
    a word (found by probing; flattening the module as a pytree drops its updates, as
    jax.jit does). Modules among the arguments are now split into graph and state as
    nnx.jit does, and what fn changed in the state is written back."""
    x = _normal(0, (4, N))
    step = lambda m, x: m(x)  # noqa: E731
    for wrap in (lambda f: f, nnx.jit):
        outs = {}
        for name, f in (("plain", step), ("optimize", jaxsub.optimize(step))):
            block = _NnxBlock(nnx.Rngs(0, dropout=1))
            run = wrap(f)
            outs[name] = [np.asarray(run(block, x)) for _ in range(3)]
            assert int(block.drop.rngs.count[...]) == 3, name
            assert not np.allclose(outs[name][0], outs[name][1]), name
        for a, b in zip(outs["plain"], outs["optimize"]):  # statistics: same keep rate
            assert abs((a == 0).mean() - (b == 0).mean()) < 0.2
    block = _NnxBlock(nnx.Rngs(0, dropout=1))
    assert jaxsub.explain(step, block, x).totals == {"bias_dropout_residual_layer_norm": 1}
    # In eval mode the values and gradients are the plain module's; under jax.grad the module
    # (not differentiated) is left as it is: nothing in it changed.
    block.eval()
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(block, x)))  # noqa: E731
    assert_close(jaxsub.optimize(step)(block, x), step(block, x), jnp.float32, reduction=N)
    assert_close(jax.grad(loss(jaxsub.optimize(step)))(x), jax.grad(loss(step))(x), jnp.float32, reduction=N,
                 grad=True)
    block.train()
    value, grads = nnx.value_and_grad(lambda m, x: jnp.sum(jaxsub.optimize(step)(m, x) ** 2))(block, x)
    assert np.isfinite(float(value)) and int(block.drop.rngs.count[...]) == 1


def test_a_broadcast_dropout_before_the_residual_is_a_near_miss_saying_so():
    """A dropout whose mask is broadcast over the sequence (flax's nn.Dropout(broadcast_dims=
    (1,))) left the residual + layer norm unfused with no reason, or with "also used
    elsewhere" (found by probing): it is left as written, and explain says why."""
    x, w = _normal(0, (2, 8, N)), _normal(1, (N, N)) * 0.1
    s, b, key = _normal(2, (N,)), _normal(3, (N,)), jax.random.key(4)

    def drop(h):
        keep = jax.random.bernoulli(key, 0.9, (h.shape[0], 1, h.shape[2]))
        return jnp.where(jnp.broadcast_to(keep, h.shape), h / 0.9, 0.0)

    def post_ln(x, w):
        return ln_two_pass(x + drop(x @ w + b), s, b)

    def pre_ln(x, w):
        r = x + drop(x @ w + b)
        return r + ln_two_pass(r, s, b) @ w

    def residual(x, w):
        return x + drop(x @ w + b)

    why = f"dropout mask bool[2, 1, {N}] is broadcast over float32[2, 8, {N}]"
    for f, pattern in ((post_ln, "bias_dropout_residual_layer_norm"), (pre_ln, "bias_dropout_residual_layer_norm"),
                       (residual, "bias_dropout_residual")):
        report = jaxsub.explain(f, x, w)
        assert [e.pattern for e in report.near_misses] == [pattern], str(report)
        assert why in report.near_misses[0].detail and "Hint" not in str(report), str(report)
        assert float(jnp.abs(jaxsub.optimize(f)(x, w) - f(x, w)).max()) <= 1e-5

    # The mask broadcast by where itself (keep[:, None]), and by jax.vmap with a shared key:
    # the where's zero branch had used up the walk to the bernoulli (found by fuzzing).
    def by_where(x, w):
        keep = jax.random.bernoulli(key, 0.9, (x.shape[0], x.shape[2]))
        return ln_two_pass(x + jnp.where(keep[:, None], (x @ w + b) / 0.9, 0), s, b)

    def row(x, k):
        return ln_two_pass(x + jnp.where(jax.random.bernoulli(k, 0.9, x.shape[-1:]), x / 0.9, 0), s, b)

    by_vmap = lambda x, w: jax.vmap(row, in_axes=(0, None))(x[0], key)  # noqa: E731
    for f, shape in ((by_where, f"[2, {N}] is broadcast"), (by_vmap, f"bool[{N}] is broadcast")):
        report = jaxsub.explain(f, x, w)
        assert any(shape in e.detail for e in report.near_misses), str(report)


# ---------------------------------------------------------------------------------------
# BDRLN and bias + GELU + dropout, hand-written.


def _bernoulli_dropout(key, h, rate):
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
    return h * keep / (1.0 - rate)


def bdrln_block(x, b, r, s, lb, key, *, rate):
    h = x + b
    if rate:
        h = _bernoulli_dropout(key, h, rate)
    return ln_two_pass(r + h, s, lb)


def ffn_block(x, w, b, key, *, rate, approximate):
    h = jax.nn.gelu(x @ w + b, approximate=approximate)
    if rate:
        h = jnp.where(jax.random.bernoulli(key, 1.0 - rate, h.shape), h / (1.0 - rate), 0)
    return h


def _bdrln_args():
    return (_normal(0, (8, N)), _normal(1, (N,)), _normal(2, (8, N)), _normal(3, (N,)), _normal(4, (N,)),
            jax.random.key(5))


def test_bdrln_without_dropout_matches():
    f = functools.partial(bdrln_block, rate=0.0)
    _assert_same(f, _bdrln_args(), argnums=(0, 1, 2, 3, 4))
    _expect(f, _bdrln_args(), bdrln=1)


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
    _assert_same(f, args, dtype, argnums=(0, 1, 2, 3, 4))
    _expect(f, args, bdrln=1)
    assert jaxsub.explain(f, *args).totals == {"bias_dropout_residual_layer_norm": 1}


def test_bdrln_dropout_uses_the_users_key():
    x, b, r, s, lb, key = _bdrln_args()
    x = _normal(0, (64, N))
    r = _normal(2, (64, N))
    f = functools.partial(bdrln_block, rate=RATE)
    opt = jaxsub.optimize(f)
    _expect(f, (x, b, r, s, lb, key), bdrln=1)
    np.testing.assert_array_equal(opt(x, b, r, s, lb, key), opt(x, b, r, s, lb, key))
    # Dropped elements of x + b get no gradient; the mask is the fused op's for the same key.
    dx = jax.grad(lambda x: jnp.sum(opt(x, b, r, s, lb, key) * _normal(9, x.shape)))(x)
    kept = np.asarray(dx != 0)
    np.testing.assert_array_equal(kept, ops.dropout_mask(key, x.shape, RATE))
    sigma = np.sqrt(kept.size * RATE * (1 - RATE))
    assert abs((~kept).sum() - kept.size * RATE) < 5 * sigma
    other = opt(x, b, r, s, lb, jax.random.key(6))
    assert np.mean(np.asarray(other != opt(x, b, r, s, lb, key))) > 0.05


def residual_dropout_block(x, b, r, key, *, bias=True):
    """A pre-LN layer's second residual: r + dropout(x + b), no layer norm after it."""
    return r + _bernoulli_dropout(key, x + b if bias else x, RATE)


@pytest.mark.parametrize("bias", [True, False])
def test_residual_dropout_without_layer_norm_uses_the_users_key(bias):
    _, b, _, _, _, key = _bdrln_args()
    x, r = _normal(0, (64, N)), _normal(2, (64, N))
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
    ct = _normal(9, x.shape)
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
    x, b, key = _normal(0, (64, N)), _normal(1, (N,)), jax.random.key(8)
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
    x, b, key = _normal(0, (64, N)), _normal(1, (N,)), jax.random.key(8)

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
    x, b, key = _normal(0, (64, N)), _normal(1, (N,)), jax.random.key(8)
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
            return y, _bernoulli_dropout(key_of(), x + b, RATE)
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
    x, b, r = _normal(0, (64, N)), _normal(1, (N,)), _normal(2, (64, N))
    key = jax.random.key(3)

    def f(x, b, r, key):
        h = _bernoulli_dropout(key, jax.nn.gelu(x + b, approximate=False), RATE)
        return r + _bernoulli_dropout(key, h + b, RATE)

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
    x1, x2, b = _normal(0, (64, N)), _normal(1, (64, N)), _normal(2, (N,))
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
    x1, x2, b = _normal(0, (64, N)), _normal(1, (64, N)), _normal(2, (N,))
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
    x1, x2, b = _normal(0, (64, N)), _normal(1, (32, N)), _normal(2, (N,))

    def f(x1, x2, b, key):
        return tuple(_bernoulli_dropout(key, jax.nn.gelu(x + b, approximate=False), RATE) for x in (x1, x2))

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
    h = _bernoulli_dropout(keys[0], jax.nn.gelu(x + b, approximate=False), RATE)
    return r + _bernoulli_dropout(keys[1], h + b, RATE)


def _seed_operands(text):
    """The seed operand types of the fused forward calls in lowered text."""
    calls = [line for line in text.splitlines() if "custom_call @jaxsub_" in line and "_fwd(" in line]
    return [line[line.rfind(": ("):].split(") -> ")[0].split(", ")[-1] for line in calls]


def test_dropout_seeds_derived_in_the_program_share_one_row(monkeypatch):
    x, r = _normal(0, (64, N)), _normal(2, (64, N))
    b, key = _normal(1, (N,)), jax.random.key(5)
    f = gelu_then_residual_dropout
    opt = jaxsub.optimize(f)
    text = jax.jit(opt).lower(x, b, r, key).as_text()
    # Each fused op reads its seed from a 16-byte quarter of one row (one kernel on a GPU,
    # where 8-byte slices of the split took a copy kernel each).
    assert _seed_operands(text) == ["tensor<4xui32>"] * 2 and "bernoulli" not in text
    assert text.count("-> tensor<8xui32>") == 1
    ct = _normal(9, x.shape)

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
    x, r = _normal(0, (64, N)), _normal(2, (64, N))
    b = _normal(1, (N,))

    def f(x, b, r, k1, k2):
        h = _bernoulli_dropout(k1, jax.nn.gelu(x + b, approximate=False), RATE)
        return r + _bernoulli_dropout(k2, h + b, RATE)

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
        d = _bernoulli_dropout(key, x + b, RATE)
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
    args = (*_bdrln_args()[:5], _normal(7, (N, N)) / 4, jax.random.key(5))
    _assert_same(bdrln_two_consumers, args, argnums=(0, 1, 2, 3, 4, 5))
    assert "output returned twice" in str(jaxsub.explain(bdrln_two_consumers, *args))

    def grads(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * _normal(9, (8, N))), argnums=(0, 2))).lower(*args)

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
    x, w, b = _normal(0, (8, 16)), _normal(1, (16, N)) / 4, _normal(2, (N,))
    f = functools.partial(ffn_block, rate=0.0, approximate=approximate)
    args = (x, w, b, jax.random.key(3))
    _assert_same(f, args, argnums=(0, 1, 2))
    _expect(f, args, bias_gelu_dropout=1)
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

    args = (_normal(0, (8, N)), _normal(1, (N,)))
    for fn in (erf_gelu, tanh_gelu, sigmoid_gelu):
        _assert_same(fn, args, argnums=(0, 1))
        _expect(fn, args, bias_gelu_dropout=1)
    assert "tanh GELU" in str(jaxsub.explain(sigmoid_gelu, *args))
    _expect(not_gelu, args)
    _expect(quick_gelu, args)
    _expect(gelu_beyond_six, args)


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
    x, c = _normal(0, (3, 4)), _normal(1, (3, 1))
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
    x, w, w2 = _normal(0, (8, 16), dtype), _normal(1, (16, N), dtype) / 4, _normal(2, (N, 16), dtype) / 4

    def mlp(x, w, w2):
        return jax.nn.gelu(x @ w, approximate=False) @ w2

    def of_input(h):
        return 0.5 * h * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))

    _assert_same(mlp, (x, w, w2), dtype, argnums=(0, 1, 2))
    _expect(mlp, (x, w, w2), bias_gelu_dropout=1)
    assert "exact GELU, no bias" in str(jaxsub.explain(mlp, x, w, w2))
    _assert_same(of_input, (x @ w,), dtype)
    _expect(of_input, (x @ w,), bias_gelu_dropout=1)

    def dropped(x, w, key):
        h = jax.nn.gelu(x @ w)
        keep = jax.random.bernoulli(key, 1 - RATE, h.shape)
        return jnp.where(keep, h / (1 - RATE), 0)

    key = jax.random.key(3)
    got = jaxsub.optimize(dropped)(x, w, key)
    want = ops.bias_gelu_dropout(x @ w, jnp.zeros((N,), dtype), rate=RATE, key=key, approximate=True)
    assert_close(got, want, dtype)
    for not_gelu in (jax.nn.silu, lambda h: h * jax.nn.sigmoid(1.702 * h), jnp.tanh):
        _expect(lambda x, w, f=not_gelu: f(x @ w), (x, w))


@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
def test_ffn_dropout_statistics(approximate):
    x, w, b, key = _normal(0, (128, 16)), _normal(1, (16, N)) / 8, _normal(2, (N,)), jax.random.key(3)
    f = functools.partial(ffn_block, rate=RATE, approximate=approximate)
    opt = jaxsub.optimize(f)
    _expect(f, (x, w, b, key), bias_gelu_dropout=1)
    y = np.asarray(opt(x, w, b, key))
    np.testing.assert_array_equal(y, opt(x, w, b, key))
    clean = np.asarray(ffn_block(x, w, b, key, rate=0.0, approximate=approximate))
    mask = np.asarray(ops.dropout_mask(key, y.shape, RATE))
    # The fused op's mask for the user's key; GELU itself may underflow to an exact zero.
    np.testing.assert_array_equal((y != 0)[clean != 0], mask[clean != 0])
    sigma = np.sqrt(y.size * RATE * (1 - RATE))
    assert abs((~mask).sum() - y.size * RATE) < 5 * sigma
    assert abs(y.mean() - clean.mean()) < 5 * np.std(y) / np.sqrt(y.size)


# ---------------------------------------------------------------------------------------
# flax.linen blocks: Dropout, and a two-layer stack under scan.


class FlaxBlock(nn.Module):
    rate: float = RATE
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(2 * N)(x)
        h = nn.Dropout(self.rate, deterministic=self.deterministic)(nn.gelu(h, approximate=False))
        h = nn.Dropout(self.rate, deterministic=self.deterministic)(nn.Dense(N)(h))
        return nn.LayerNorm()(x + h)


def test_flax_linen_block_deterministic():
    m = FlaxBlock()
    x = _normal(0, (8, N))
    params = m.init(jax.random.key(0), x)
    _assert_same(m.apply, (params, x), argnums=(0, 1))
    _expect(m.apply, (params, x), bias_gelu_dropout=1, bdrln=1)


def _flax_dropout_block(rows):
    """(f, args): FlaxBlock with its two dropouts active, the key an argument."""
    m = FlaxBlock(deterministic=False)
    x = _normal(0, (rows, N))

    def f(params, x, key):
        return m.apply(params, x, rngs={"dropout": key})

    return f, (m.init(jax.random.key(0), x), x, jax.random.key(1))


def test_flax_linen_dropout_rewritten():
    f, args = _flax_dropout_block(64)
    _expect(f, args, bias_gelu_dropout=1, bdrln=1)
    opt = jaxsub.optimize(f)
    np.testing.assert_array_equal(opt(*args), opt(*args))
    assert np.isfinite(np.asarray(opt(*args))).all()
    report = jaxsub.explain(f, *args)
    assert report.totals == {"bias_gelu_dropout": 1, "bias_dropout_residual_layer_norm": 1}
    assert "rate=0.25" in str(report)


class FlaxPreLNBlock(nn.Module):
    """GPT style: h = x + dropout(Dense(LN(x))), out = h + dropout(MLP(LN(h)))."""
    rate: float = RATE
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        h = x + nn.Dropout(self.rate, deterministic=self.deterministic)(nn.Dense(N)(nn.LayerNorm()(x)))
        m = nn.gelu(nn.Dense(2 * N)(nn.LayerNorm()(h)), approximate=False)
        return h + nn.Dropout(self.rate, deterministic=self.deterministic)(nn.Dense(N)(m))


@pytest.mark.parametrize("deterministic", [True, False])
def test_flax_linen_pre_ln_block(deterministic):
    """Both layer norms fused and handing on what they read (the block input, the residual
    sum) to the residual adds after them."""
    m = FlaxPreLNBlock(deterministic=deterministic)
    x = _normal(0, (8, N))
    params = m.init(jax.random.key(0), x)

    def f(params, x, key):
        return m.apply(params, x, rngs={"dropout": key})

    args = (params, x, jax.random.key(1))
    _expect(f, args, layer_norm=1, bdrln=1, bias_gelu_dropout=1)
    report = str(jaxsub.explain(f, *args))
    assert "x handed on" in report and "residual sum written too" in report, report
    if deterministic:
        _assert_same(f, args, argnums=(0, 1))
    else:
        opt = jax.jit(jaxsub.optimize(f))
        np.testing.assert_array_equal(opt(*args), opt(*args))
        assert np.isfinite(np.asarray(opt(*args))).all()


def test_rewrite_dropout_false_leaves_dropout_alone():
    f, args = _flax_dropout_block(8)
    opt = jaxsub.optimize(f, rewrite_dropout=False)
    # The user's own bernoulli bits are kept, so results agree with the original.
    assert_close(opt(*args), f(*args), reduction=N)
    counts = _counts(opt, *args)
    # Bias + GELU and the layer norm are still fused, each without the dropout next to it.
    assert counts == {"jaxsub_bdrln_fwd": 0, "jaxsub_layer_norm_fwd": 1, "jaxsub_bias_gelu_dropout_fwd": 1}
    report = jaxsub.explain(opt, *args)
    reasons = [m.detail for m in report.near_misses]
    assert reasons.count("dropout not rewritten (rewrite_dropout=False)") == 2


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_dropout_under_vmap_over_per_example_keys_is_left_as_written(raw):
    """jax.vmap over per-example keys batches the bernoulli call (a key array [E]): a fused
    op draws its mask from one key, so that dropout stays the user's, the rest is fused, and
    the numbers are plain JAX's (optimize raised "`key` must be a single PRNG key")."""
    block, args = _flax_dropout_block(8)
    params, x, _ = args
    split = jax.random.split(jax.random.PRNGKey(3) if raw else jax.random.key(3), 3)

    def f(params, xs, keys):
        return jax.vmap(block, in_axes=(None, 0, 0))(params, xs, keys)

    xs = jnp.stack([x, 2 * x, -x])
    opt = jaxsub.optimize(f)
    counts = _counts(opt, params, xs, split)
    assert counts == {"jaxsub_bdrln_fwd": 0, "jaxsub_layer_norm_fwd": 1, "jaxsub_bias_gelu_dropout_fwd": 1}
    # explain names both dropouts (found by probing: only attention's was reported)
    report = jaxsub.explain(f, params, xs, split)
    assert sum("is one key per example" in m.detail for m in report.near_misses) == 2, str(report)
    assert_close(jax.jit(opt)(params, xs, split), jax.jit(f)(params, xs, split), reduction=N)
    loss = lambda g: lambda p: jnp.sum(g(p, xs, split) ** 2)  # noqa: E731
    for got, want in zip(jax.tree.leaves(jax.grad(loss(opt))(params)), jax.tree.leaves(jax.grad(loss(f))(params))):
        assert_close(got, want, reduction=8 * N, grad=True)


@pytest.mark.parametrize("op", ["gelu", "softmax"])
def test_dropout_of_an_unbatched_value_under_vmap_over_keys_is_named(op):
    """jax.vmap over per-example keys of a value it does not batch (in_axes=None): the op is
    fused alone and its dropout, of the op's output broadcast to the keys' batch, stays the
    user's; explain names that dropout (it listed the op with "no dropout" and nothing
    else), and not where the value is batched (the matcher names that one itself)."""
    x = _normal(31, (8, N))
    b = _normal(32, (N,))
    keys = jax.random.split(jax.random.key(33), 3)

    def f(x, key):
        h = jax.nn.gelu(x + b, approximate=False) if op == "gelu" else jax.nn.softmax(x, axis=-1)
        return jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0)

    unbatched = jax.vmap(f, in_axes=(None, 0))
    report = jaxsub.explain(unbatched, x, keys)
    assert len(report.matches) == 1 and "no dropout" in report.matches[0].detail, str(report)
    named = [m for m in report.near_misses if m.detail.startswith("the dropout after it: ")]
    assert len(named) == 1 and "is one key per example" in named[0].detail, str(report)
    assert named[0].pattern == report.matches[0].pattern
    assert_close(jax.jit(jaxsub.optimize(unbatched))(x, keys), jax.jit(unbatched)(x, keys), reduction=N)
    batched = jaxsub.explain(jax.vmap(f), jnp.stack([x, -x, 2 * x]), keys)
    assert not any(m.detail.startswith("the dropout after it") for m in batched.near_misses), str(batched)
    assert sum("is one key per example" in m.detail for m in batched.near_misses) == 1, str(batched)


def test_dropout_with_a_mask_an_inner_vmap_shares_is_named():
    """A mask drawn once and shared by an inner jax.vmap's examples (broadcast over them):
    the GELU is fused alone, the dropout stays the user's, and explain names it."""
    b = _normal(34, (N,))

    def f(x, key):
        keep = jax.random.bernoulli(key, 0.9, x.shape[1:])
        drop = lambda h, keep: jnp.where(keep, h / 0.9, 0)  # noqa: E731
        return jax.vmap(drop, in_axes=(0, None))(jax.nn.gelu(x + b, approximate=False), keep)

    x, key = _normal(35, (3, 8, N)), jax.random.key(36)
    report = jaxsub.explain(f, x, key)
    assert len(report.matches) == 1 and "no dropout" in report.matches[0].detail, str(report)
    named = [m.detail for m in report.near_misses]
    assert named == [f"the dropout after it: dropout mask bool[8, {N}] is broadcast over float32[3, 8, {N}]; the "
                     "fused op drops every element independently"], str(report)
    np.testing.assert_array_equal(jax.jit(jaxsub.optimize(f))(x, key) == 0, jax.jit(f)(x, key) == 0)

    # Where the attention matcher names a broadcast mask on the probabilities itself (its
    # softmax then fused alone), the dropout is named once, not again after the softmax.
    def attention(q, k, v, key):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0, axis=-1)
        keep = jax.random.bernoulli(key, 0.9, (p.shape[0], 1, *p.shape[2:]))
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / 0.9, 0), v)

    q = _normal(37, (2, 8, 2, N))
    report = jaxsub.explain(attention, q, q, q, key)
    assert report.totals == {"softmax_dropout": 1}, str(report)
    assert [m.pattern for m in report.near_misses] == ["attention"], str(report)


@pytest.mark.parametrize("x_batched,residual_batched", [(False, False), (False, True), (True, False)])
def test_dropout_before_a_layer_norm_under_vmap_over_keys_is_named(x_batched, residual_batched):
    """LN(residual + dropout(x + bias)) under jax.vmap over per-example keys where x or the
    residual is not batched (Monte Carlo dropout of one input, say): the vmap broadcasts it,
    the BDRLN matcher finds no residual sum of x's shape (or no dropout), the layer norm is
    fused alone and the dropout stays the user's. explain names that dropout once (it listed
    the layer norm and nothing else); with both batched the matcher names it itself."""
    x, res = _normal(38, (8, N)), _normal(39, (8, N))
    bias, scale, offset = _normal(40, (N,)), 1 + _normal(41, (N,)), _normal(42, (N,))
    keys = jax.random.split(jax.random.key(43), 3)

    def f(x, key, res):
        h = jnp.where(jax.random.bernoulli(key, 0.9, x.shape), (x + bias) / 0.9, 0)
        s = res + h
        mean = s.mean(-1, keepdims=True)
        var = ((s - mean) ** 2).mean(-1, keepdims=True)
        return (s - mean) * jax.lax.rsqrt(var + 1e-5) * scale + offset

    batch = lambda a: jnp.stack([a, -a, 2 * a])  # noqa: E731
    g = jax.vmap(f, in_axes=(0 if x_batched else None, 0, 0 if residual_batched else None))
    args = (batch(x) if x_batched else x, keys, batch(res) if residual_batched else res)
    report = jaxsub.explain(g, *args)
    assert report.totals == {"layer_norm": 1}, str(report)
    assert [(m.pattern, m.detail.split(": ")[0]) for m in report.near_misses] == [
        ("bias_dropout_residual_layer_norm", "the dropout before it")], str(report)
    assert "is one key per example" in report.near_misses[0].detail
    assert_close(jax.jit(jaxsub.optimize(g))(*args), jax.jit(g)(*args), reduction=N)
    both = jaxsub.explain(jax.vmap(f), batch(x), keys, batch(res))
    assert [m.detail.split(": ")[0] for m in both.near_misses] == ["dropout key key<fry>[3] is one key per example "
                                                                   "(jax.vmap over keys); a fused op draws its mask "
                                                                   "from one key"], str(both)


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(N)(nn.gelu(nn.Dense(2 * N)(x), approximate=True))
        return nn.LayerNorm()(x + h), None


def test_nn_scan_stack():
    stack = nn.scan(ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()
    x = _normal(0, (8, N))
    params = stack.init(jax.random.key(0), x, None)

    def f(params, x):
        return stack.apply(params, x, None)[0]

    _assert_same(f, (params, x), argnums=(0, 1))
    _expect(f, (params, x), bias_gelu_dropout=1, bdrln=1)
    report = jaxsub.explain(f, params, x)
    assert all(m.scope == "scan" for m in report.matches)
    # In a scan as in a single layer the GELU output is kept for the Dense product's
    # weight gradient (the scan's custom calls write their residuals into its stacks in
    # place), so the GELU backward does not write it again (an empty y result).
    assert "bias_gelu_dropout_dense" not in str(report)
    assert _gelu_writes_y(f, (params, x)) == [False]
    layer = ScanLayer()
    p1 = layer.init(jax.random.key(0), x, None)
    assert _gelu_writes_y(lambda p, x: layer.apply(p, x, None)[0], (p1, x)) == [False]


class BF16ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        dense = functools.partial(nn.Dense, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        h = dense(N)(nn.gelu(dense(2 * N)(x), approximate=True))
        return nn.LayerNorm(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x + h), None


def test_scan_products_through_the_gemm_target(monkeypatch):
    """On GPU (forced here) the bf16 products of a scanned body that runs fused ops go
    through ops.dense, the one after the GELU too: same values and gradients, the gemm
    target in the program (forward and both gradient products of each product). f32
    products stay XLA's."""
    from jaxsub.rewrite import scan_products

    stack = nn.scan(BF16ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()
    x = _normal(0, (8, N)).astype(jnp.bfloat16)
    params = stack.init(jax.random.key(0), x, None)

    def f(params, x):
        return stack.apply(params, x, None)[0]

    grad = lambda: jax.jit(jax.grad(lambda p, x: jnp.sum(jaxsub.optimize(f)(p, x) ** 2), (0, 1)))  # noqa: E731
    monkeypatch.setattr(scan_products, "LIBRARY", False)  # as on CPU: XLA's dots
    assert "jaxsub_gemm" not in grad().lower(params, x).as_text()
    monkeypatch.setattr(scan_products, "LIBRARY", True)
    _assert_same(f, (params, x), jnp.bfloat16, argnums=(0, 1))
    report = jaxsub.explain(f, params, x)
    assert report.totals.get("dense") == 2
    assert "ops.dense" in str(report)
    text = grad().lower(params, x).as_text()
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == 6
    f32 = nn.scan(ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()
    x32 = _normal(0, (8, N))
    p32 = f32.init(jax.random.key(0), x32, None)
    assert "dense" not in jaxsub.explain(lambda p, x: f32.apply(p, x, None)[0], p32, x32).totals


def _attention_layer(w, h):
    """One bf16 attention layer, written as einsums: a packed q/k/v product plus its bias,
    and an out-projection contracting two axes whose pairs einsum lists in reverse order."""
    qkv = jnp.einsum("bse,ethd->bsthd", h, w["qkv"]) + w["qkv_bias"]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32), -1).astype(h.dtype), v)
    return h + jnp.einsum("bshd,hde->bse", a, w["out"])


def _attention_stack(ws, x):
    """Two of _attention_layer under lax.scan."""
    return jax.lax.scan(lambda h, w: (_attention_layer(w, h), None), x, ws)[0]


def test_scan_attention_products_through_the_gemm_target(monkeypatch):
    """In a scanned attention layer (GPU forced): the q/k/v product and the bias the
    attention match adds become one ops.dense (the bias in the GEMM's epilogue), the
    out-projection another; same values and gradients."""
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    bf = jnp.bfloat16
    # Scores of order one: the original rounds them to bf16 before its f32 softmax.
    ws = {"qkv": (_normal(1, (2, 32, 3, 2, 16)) / 12).astype(bf), "qkv_bias": (_normal(2, (2, 3, 2, 16)) / 4).astype(bf),
          "out": (_normal(3, (2, 2, 16, 32)) / 6).astype(bf)}
    x = _normal(0, (2, 8, 32)).astype(bf)
    _assert_same(_attention_stack, (ws, x), bf, argnums=(0, 1))
    report = jaxsub.explain(_attention_stack, ws, x)
    assert report.totals.get("attention") == 1 and report.totals.get("dense") == 1
    assert "the q/k/v product and its bias as one ops.dense" in str(report)
    grad = jax.jit(jax.grad(lambda ws, x: jnp.sum(jaxsub.optimize(_attention_stack)(ws, x).astype(jnp.float32)),
                            (0, 1)))
    text = grad.lower(ws, x).as_text()
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == 6  # two products, forward and both gradients
    assert "@jaxsub_bias_add" not in text
    # The layer input h is also the residual: the product hands it on (ops.gemm.dense_and_input),
    # so the residual's gradient is added into dh by the dh product's c operand. The one
    # [2, 8, 32] add left is the forward's residual add.
    assert "its input's other uses read it from there" in str(report)
    assert gemm_c_types(text).count("tensor<16x32xbf16>") == 1
    assert len([ln for ln in text.splitlines() if "stablehlo.add" in ln and "tensor<2x8x32xbf16>" in ln]) == 1


# GEMM-target calls in the gradient: the q/k/v product's forward and two gradients; "all"
# adds the out-projection's two gradients (its forward feeds nothing the gradient needs).
@pytest.mark.parametrize("outside,gemms", [("attention", 3), ("all", 5), ("none", 0)])
def test_single_layer_attention_product_through_the_gemm_target(monkeypatch, outside, gemms):
    """Outside a scan (GPU forced): the q/k/v product, its bias and the attention as one
    ops.dense_attention_packed (the bias gradient from the attention's backward, the
    residual's gradient added by the dx product), as EncoderLayer runs them; with OUTSIDE
    "all" the out-projection through the GEMM target too, with "none" neither. Same values
    and gradients."""
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    monkeypatch.setattr(scan_products, "OUTSIDE", outside)
    bf = jnp.bfloat16
    # Head dim 32: one the CUDA attention kernels take too, so that on a GPU backend the
    # fused path runs as on CPU.
    w = {"qkv": (_normal(1, (32, 3, 2, 32)) / 12).astype(bf), "qkv_bias": (_normal(2, (3, 2, 32)) / 4).astype(bf),
         "out": (_normal(3, (2, 32, 32)) / 8).astype(bf)}
    x = _normal(0, (2, 8, 32)).astype(bf)
    _assert_same(_attention_layer, (w, x), bf, argnums=(0, 1))
    report = str(jaxsub.explain(_attention_layer, w, x))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jaxsub.optimize(_attention_layer)(w, x).astype(jnp.float32)),
                            (0, 1)))
    text = grad.lower(w, x).as_text()
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == gemms
    # x is also the residual. (The gradient alone needs no forward output, so the program
    # has no forward residual add.) Apart, XLA adds the residual's gradient to dx; through
    # the GEMM target the dx product adds it as its c operand.
    adds = [ln for ln in text.splitlines() if "stablehlo.add" in ln and "tensor<2x8x32xbf16>" in ln]
    if outside == "none":
        assert "ops.dense" not in report and len(adds) == 1
        return
    assert "one ops.dense_attention_packed" in report and "its input's other uses read it from there" in report
    assert "@jaxsub_bias_add" not in text and "@jaxsub_bias_grad" not in text
    assert text.count("@jaxsub_attention_qkv_bwd(") == 1
    assert gemm_c_types(text).count("tensor<16x32xbf16>") == 1 and not adds


@pytest.mark.parametrize("use_bias", [True, False])
def test_flax_projections_through_the_gemm_target(monkeypatch, use_bias):
    """Flax's three q/k/v DenseGenerals of a post-LN block's input (GPU forced): one
    ops.dense_attention_packed on the weights and biases stacked, as the packed q/k/v
    product runs (no attention_projected, no separate bias gradient, the residual's
    gradient added by the dx product); same values and gradients, the three kernels' and
    biases' included."""
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    bf = jnp.bfloat16
    m = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=64, out_features=32, use_bias=use_bias,
                                        dtype=bf, param_dtype=bf)
    x = _normal(0, (2, 8, 32)).astype(bf)
    params = jax.tree.map(lambda a: (a.astype(jnp.float32) / 2).astype(bf), m.init(jax.random.key(0), x))

    def f(params, x):
        return x + m.apply(params, x)

    _assert_same(f, (params, x), bf, argnums=(0, 1))
    report = str(jaxsub.explain(f, params, x))
    assert "one ops.dense_attention_packed on the weights and biases stacked" in report, report
    assert "its input's other uses read it from there" in report
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(jaxsub.optimize(f)(p, x).astype(jnp.float32)), (0, 1)))
    text = grad.lower(params, x).as_text()
    assert text.count("@jaxsub_attention_qkv_bwd(") == 1 and "@jaxsub_attention_bwd_dqkv(" not in text
    assert "@jaxsub_bias_grad" not in text and "@jaxsub_bias_add" not in text
    # The three biases' gradients are three results of the attention's backward, not
    # slices of one [3, H, D] result (each a copy kernel on the GPU).
    bwd = next(ln for ln in text.splitlines() if "@jaxsub_attention_qkv_bwd(" in ln).split("->")[1]
    assert bwd.count("tensor<2x32xbf16>") == 3 and "tensor<3x2x32xbf16>" not in bwd, bwd
    # The q/k/v product's forward and two gradients, the out-projection's two gradients.
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == 5
    assert gemm_c_types(text).count("tensor<16x32xbf16>") == 1


def test_nnx_projections_through_the_gemm_target(monkeypatch):
    """The same for flax.nnx.MultiHeadAttention (its q is viewed [B, S, H, 1, D]): one
    ops.dense_attention_packed on the stacked weights; values and the input's gradient."""
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    bf = jnp.bfloat16
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=64, decode=False, dtype=bf,
                                   param_dtype=bf, rngs=nnx.Rngs(0))
    x = _normal(0, (2, 8, 32)).astype(bf)

    def f(x):
        return x + layer(x)

    _assert_same(f, (x,), bf)
    assert "one ops.dense_attention_packed on the weights and biases stacked" in str(jaxsub.explain(f, x))
    text = jax.jit(jax.grad(lambda x: jnp.sum(jaxsub.optimize(f)(x).astype(jnp.float32)))).lower(x).as_text()
    assert text.count("@jaxsub_attention_qkv_bwd(") == 1 and "@jaxsub_attention_bwd_dqkv(" not in text


def test_outside_products_mode_is_checked(monkeypatch):
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    monkeypatch.setattr(scan_products, "OUTSIDE", "sometimes")
    x = _normal(0, (2, 8, 32)).astype(jnp.bfloat16)
    w = {"qkv": jnp.zeros((32, 3, 2, 16), jnp.bfloat16), "qkv_bias": jnp.zeros((3, 2, 16), jnp.bfloat16),
         "out": jnp.zeros((2, 16, 32), jnp.bfloat16)}
    with pytest.raises(ValueError, match="JAXSUB_OPTIMIZE_PRODUCTS.*sometimes"):
        jaxsub.optimize(_attention_layer)(w, x)


def gemm_c_types(text: str) -> list:
    """The c operand's type of each jaxsub_gemm call in lowered StableHLO text."""
    return [line.rsplit(" : (", 1)[1].split(") ->")[0].split(", ")[3]
            for line in text.splitlines() if "@jaxsub_gemm(" in line]


def _gelu_writes_y(f, args):
    """For each GELU backward call in the gradient of optimize(f): whether it writes y."""
    text = jax.jit(jax.grad(lambda *a: jnp.sum(jaxsub.optimize(f)(*a)))).lower(*args).as_text()
    return [not ln.rstrip().endswith("tensor<0xf32>)") for ln in text.splitlines()
            if "@jaxsub_bias_gelu_dropout_bwd" in ln]


def test_lax_scan_pre_ln_stack():
    """Pre-LN blocks in a scan (and under remat): the layer norms' hand-ons inside the body."""
    ws = {"w": _normal(1, (2, N, N)) / 6, "b": _normal(2, (2, N)), "s1": _normal(3, (2, N)),
          "b1": _normal(4, (2, N)), "s2": _normal(5, (2, N)), "b2": _normal(6, (2, N))}

    def f(ws, x):
        def layer(h, w):
            a = ln_two_pass(h, w["s1"], w["b1"])
            h2 = h + (a @ w["w"] + w["b"])
            return ln_two_pass(h2, w["s2"], w["b2"]) * 0.5 + h2, None
        return jax.lax.scan(jax.checkpoint(layer), x, ws)[0]

    x = _normal(0, (8, N))
    _assert_same(f, (ws, x), argnums=(0, 1))
    _expect(f, (ws, x), layer_norm=1, bdrln=1)


@pytest.mark.parametrize("unroll", [1, 2])
def test_lax_scan_stack(unroll):
    """Also a scan with two steps per loop iteration, which the pass keeps."""
    ws = {"w1": _normal(1, (3, N, 2 * N)) / 6, "b1": _normal(2, (3, 2 * N)), "w2": _normal(3, (3, 2 * N, N)) / 8,
          "b2": _normal(4, (3, N)), "s": _normal(5, (3, N)), "lb": _normal(6, (3, N))}

    def f(ws, x):
        def layer(h, w):
            a = ffn_block(h, w["w1"], w["b1"], None, rate=0.0, approximate=False)
            return bdrln_block(a @ w["w2"], w["b2"], h, w["s"], w["lb"], None, rate=0.0), None
        return jax.lax.scan(jax.checkpoint(layer), x, ws, unroll=unroll)[0]

    x = _normal(0, (8, N))
    _assert_same(f, (ws, x), argnums=(0, 1))
    assert jaxsub.explain(f, ws, x).totals == {"bias_gelu_dropout": 1, "bias_dropout_residual_layer_norm": 1}
    # In the lowered text each target appears once per copy of the body: once where JAX
    # lowers the checkpointed body as one function that the loop calls (0.10), once per
    # unrolled step and for the remainder where it inlines them (0.11: 2 + 1 of 3 steps).
    copies = (1,) if unroll == 1 else (1, 3)
    counts = _counts(jaxsub.optimize(f), ws, x)
    assert counts["jaxsub_bias_gelu_dropout_fwd"] == counts["jaxsub_bdrln_fwd"] in copies, counts
    assert sum(counts.values()) == 2 * counts["jaxsub_bdrln_fwd"], counts
    # A scan whose body runs fused ops goes through jaxsub.stack.scan: for a GPU its
    # gradient allocates the residual stacks (AllocateBuffer) rather than zero-filling them.
    grad = jax.jit(jax.grad(lambda ws, x: jnp.sum(jaxsub.optimize(f)(ws, x)), argnums=(0, 1)))
    text = grad.trace(ws, x).lower(lowering_platforms=("cuda",)).as_text()
    assert "@AllocateBuffer" in text
    assert "@AllocateBuffer" not in jax.jit(jax.grad(lambda ws, x: jnp.sum(f(ws, x)))).trace(ws, x).lower(
        lowering_platforms=("cuda",)).as_text()
    # (the stack's forward and backward loops, inside the custom_jvp calls of its rules)
    scans = [e for e in _equations(jax.make_jaxpr(grad)(ws, x).jaxpr) if e.primitive.name == "scan"]
    assert scans and all(e.params["unroll"] == unroll for e in scans)


def _equations(jaxpr, depth=0):
    """jaxpr's equations and those of the calls in it (a jit's, a custom_jvp's), not of loops."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name != "scan" and depth < 8:
            for key in ("jaxpr", "call_jaxpr"):
                inner = e.params.get(key)
                if inner is not None:
                    yield from _equations(getattr(inner, "jaxpr", inner), depth + 1)


# ---------------------------------------------------------------------------------------
# Near-misses: left alone and reported.


def test_near_misses_are_left_alone_and_reported():
    def other_axis(x):
        m = jnp.mean(x, 0, keepdims=True)
        return (x - m) * jax.lax.rsqrt(jnp.var(x, 0, keepdims=True) + 1e-5)

    def mean_escapes(x, s, b):
        m = jnp.mean(x, -1, keepdims=True)
        return ln_two_pass(x, s, b), m * 2.0

    def normalized_escapes(x, s, b):
        m = jnp.mean(x, -1, keepdims=True)
        n = (x - m) * jax.lax.rsqrt(jnp.mean(jnp.square(x - m), -1, keepdims=True) + 1e-5)
        return n * s + b, n

    def residual_read_first(x, b, r, s, lb):
        h = r + (x + b)
        z = h * 3.0  # read before the layer norm: a fused op there would come too late for it
        return ln_two_pass(h, s, lb), z, h  # (also an output, which alone could be handed on)

    x, s, b = _normal(0, (6, N)), _normal(1, (N,)), _normal(2, (N,))
    cases = [(other_axis, (x,), "axes (0,)"), (normalized_escapes, (x, s, b), "returned as an output"),
             (residual_read_first, (x, b, x + 1, s, b), "residual sum")]
    for fn, args, reason in cases:
        report = jaxsub.explain(fn, *args)
        assert any(reason in m.detail for m in report.near_misses), (fn.__name__, str(report))
        out, ref = jaxsub.optimize(fn)(*args), fn(*args)
        for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            assert_close(o, r, reduction=N)
    _expect(other_axis, (x,))
    # The normalized value is an output: the parameter-free layer norm producing it is
    # fused, the scale and bias stay outside.
    _expect(normalized_escapes, (x, s, b), layer_norm=1)
    # The residual sum is needed before the layer norm, so only the layer norm itself is fused.
    _expect(residual_read_first, (x, b, x + 1, s, b), layer_norm=1)
    # The mean returned here is a separate computation (no CSE in jaxprs): still a match.
    _expect(mean_escapes, (x, s, b), layer_norm=1)


def test_pre_ln_block_hands_on_its_input_and_the_residual_sum(monkeypatch):
    """A pre-LN block: x feeds its layer norm and the first residual; the residual sum h
    feeds the second layer norm and the output (here also as an output of its own). Both
    layer norms are fused, each handing on the value it read (ops.norm.layer_norm_and_input,
    ops.norm.bdrln_and_sum), so the gradients of x's and h's other readers are added in the
    backward kernels: the gradient program has fewer [R, N] adds than with the hand-ons off
    (where the residual sum is a near-miss and x's gradients meet in an XLA add)."""
    w = _normal(3, (N, N)) / np.sqrt(N)

    def block(x, b, s1, b1, s2, b2):
        a = ln_two_pass(x, s1, b1)
        h = x + (a @ w + b)
        return ln_two_pass(h, s2, b2) * 2.0 + h

    def block_and_sum(x, b, s1, b1, s2, b2):
        a = ln_two_pass(x, s1, b1)
        h = x + (a @ w + b)
        return ln_two_pass(h, s2, b2), h

    args = (_normal(0, (6, N)), _normal(1, (N,)), _normal(2, (N,)), _normal(4, (N,)), _normal(5, (N,)),
            _normal(6, (N,)))
    _assert_same(block, args, argnums=tuple(range(6)), reduction=2 * N)
    _expect(block, args, layer_norm=1, bdrln=1)
    _expect(block_and_sum, args, layer_norm=1, bdrln=1)
    report = str(jaxsub.explain(block, *args))
    assert "residual sum written too" in report and "x handed on" in report, report

    def adds(f):
        grad = jax.grad(lambda *a: jnp.sum(jnp.square(f(*a))), argnums=tuple(range(6)))
        text = jax.jit(grad).lower(*args).as_text()
        return sum(1 for line in text.splitlines() if "stablehlo.add" in line and f"6x{N}xf32" in line)

    handing_on = adds(jaxsub.optimize(block))
    monkeypatch.setattr(match_norm, "read_after", lambda *a, **k: None)
    _expect(block, args, layer_norm=2)
    assert handing_on + 2 <= adds(jaxsub.optimize(block))


def test_shared_mean_is_a_near_miss():
    def shared(x, s, b):
        m = jnp.mean(x, -1, keepdims=True)
        v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b, m

    args = (_normal(0, (6, N)), _normal(1, (N,)), _normal(2, (N,)))
    report = jaxsub.explain(shared, *args)
    assert report.matches == [] and "mean" in report.near_misses[0].detail
    assert "returned as an output" in report.near_misses[0].detail
    _expect(shared, args)


# ---------------------------------------------------------------------------------------
# API: composition, pytrees, options, explain's report.


def test_composes_with_jit_grad_vmap_and_keeps_pytrees():
    @jaxsub.optimize
    def f(inputs, params):
        y = ln_two_pass(inputs["x"], params[0], params[1])
        return {"y": y, "aux": (inputs["x"].sum(),)}

    inputs, params = {"x": _normal(0, (6, N))}, (_normal(1, (N,)), _normal(2, (N,)))
    out = jax.jit(f)(inputs, params)
    assert set(out) == {"y", "aux"} and isinstance(out["aux"], tuple)
    assert_close(out["y"], ln_two_pass(inputs["x"], *params), reduction=N)
    batched = jax.vmap(f, in_axes=({"x": 0}, None))({"x": _normal(3, (4, 6, N))}, params)
    assert batched["y"].shape == (4, 6, N)
    val, grads = jax.value_and_grad(lambda p: jnp.sum(f(inputs, p)["y"] ** 2))(params)
    ref_val, ref_grads = jax.value_and_grad(lambda p: jnp.sum(ln_two_pass(inputs["x"], *p) ** 2))(params)
    assert_close(val, ref_val, reduction=6 * N)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, reduction=6, grad=True)
    assert f.__name__ == "f"


def test_scalar_arithmetic_and_fori_loop():
    """Sums of rank-0 values (a loss plus a regularizer, a scale computed from an
    argument, a fori_loop's counter) are no residual sums: optimize raised an IndexError
    on any of them."""
    x, s, b = _normal(0, (2, 7, 24)), _normal(1, (24,)), _normal(2, (24,))

    def scaled(x, t):
        return x * (t + 1.0)

    def loss(x):
        return jnp.sum(x) + jnp.mean(x)

    def loop(x, s, b):
        return jax.lax.fori_loop(0, 3, lambda i, h: ln_two_pass(h, s, b) * (1.0 + i), x)

    assert_close(jaxsub.optimize(scaled)(x, jnp.float32(0.5)), scaled(x, jnp.float32(0.5)))
    assert_close(jaxsub.optimize(loss)(x), loss(x), reduction=x.size)
    assert jaxsub.explain(loop, x, s, b).totals == {"layer_norm": 1}
    _assert_same(loop, (x, s, b), argnums=(0, 1, 2), reduction=24)


def test_closing_over_traced_values():
    """A function optimized inside an outer jit or grad that closes over the outer
    function's traced values: they are constants of the traced jaxpr whose values are
    tracers, never folded or read as masks (a TracerArrayConversionError before)."""
    x = _normal(0, (2, 3))
    ref = lambda t: jnp.sum(x * (t * 2.0))  # noqa: E731
    opt = lambda t: jnp.sum(jaxsub.optimize(lambda x: x * (t * 2.0))(x))  # noqa: E731
    t = jnp.float32(0.5)
    assert_close(jax.jit(opt)(t), jax.jit(ref)(t))
    assert_close(jax.grad(opt)(t), jax.grad(ref)(t))

    q, k, v = (_normal(i, (2, 7, 3, 24)) for i in (3, 4, 5))
    visible = _normal(6, (7, 7)) > 0

    def attention(q, k, v, mask):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.2
        s = jnp.where(mask, s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    with jax.default_matmul_precision("highest"):
        out = jax.jit(lambda m: jaxsub.optimize(lambda q, k, v: attention(q, k, v, m))(q, k, v))(visible)
        assert_close(out, attention(q, k, v, visible), reduction=7 * 24)


def test_decorator_options_and_layouts():
    @jaxsub.optimize(rewrite_dropout=False, layouts=None)
    def f(x):
        return ln_no_params(x)

    assert _counts(f, _normal(0, (2, N)))["jaxsub_layer_norm_fwd"] == 1
    with pytest.raises(ValueError, match="layouts='fastest'"):
        jaxsub.optimize(ln_no_params, layouts="fastest")
    with pytest.raises(TypeError, match="layouts must be"):
        jaxsub.optimize(ln_no_params, layouts=3)


def test_explain_hints_at_gradients_taken_inside():
    """optimize around a step that already holds value_and_grad fuses nothing: the backward
    reads every pattern's intermediates, each near-miss saying "also used elsewhere"
    without saying what to do (found by probing). The report now says it."""
    def loss(x, w, b, s, lb):
        return jnp.sum(ln_two_pass(jax.nn.gelu(x @ w + b), s, lb) ** 2)

    args = (_normal(0, (4, N)), _normal(1, (N, N)) * 0.1, _normal(2, (N,)), _normal(3, (N,)), _normal(4, (N,)))
    report = jaxsub.explain(jax.value_and_grad(loss, argnums=(0, 1)), *args)
    assert not report.matches and "Hint: if fn computes gradients itself" in str(report), str(report)
    assert "Hint" not in str(jaxsub.explain(loss, *args))


def test_a_call_outside_any_trace_runs_compiled_once():
    """optimize(jax.jit(step)) ran the step op by op: the trace inlines fn's own jit, and
    a scan in it was compiled again on every call (a 2-layer step 26 ms against 1.2 ms
    under jit, 930 ms with a scan over micro-batches; found by probing). Called outside
    any trace, the rewritten program now runs as one compiled function per
    specialization: later calls compile nothing. Inside a trace it is inlined as before."""
    import logging

    compiles = []

    class Record(logging.Handler):
        def emit(self, record):
            compiles.append(record.getMessage())

    def stack(x, ws):
        def body(h, w):
            h = h @ w
            m = h.mean(-1, keepdims=True)
            return (h - m) * jax.lax.rsqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5), None
        return jax.lax.scan(body, x, ws)[0]

    x, ws = _normal(0, (4, N)), _normal(1, (3, N, N)) * 0.1
    for f in (stack, jax.jit(stack)):
        opt = jaxsub.optimize(f)
        assert_close(opt(x, ws), stack(x, ws), jnp.float32, reduction=N)
        logger, handler = logging.getLogger("jax"), Record()
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        try:
            with jax.log_compiles():
                compiles.clear()
                opt(x, ws)
                opt(x, ws)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        assert not [c for c in compiles if "Compiling" in c], compiles[:4]
        assert jaxsub.explain(f, x, ws).totals == {"layer_norm": 1}
    # Inside a trace (grad), the same function is part of the caller's program.
    g = jax.jit(jax.grad(lambda x: jnp.sum(jaxsub.optimize(stack)(x, ws) ** 2)))(x)
    assert_close(g, jax.grad(lambda x: jnp.sum(stack(x, ws) ** 2))(x), jnp.float32, reduction=N, grad=True)


def test_decorated_method_binds_self_and_fn_must_be_callable():
    """@optimize on a method: `self` is bound (a static argument), as a user decorating a
    method expects (a missing-argument TypeError before); a non-callable is refused at once."""
    class Block:
        def __init__(self, eps):
            self.eps = eps

        @jaxsub.optimize
        def norm(self, x):
            mean = jnp.mean(x, -1, keepdims=True)
            var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
            return (x - mean) * jax.lax.rsqrt(var + self.eps)

    x = _normal(3, (4, N))
    for eps in (1e-5, 1e-1):  # two instances, two traces
        want = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + eps)
        assert_close(Block(eps).norm(x), want, what=str(eps))
    assert _counts(Block(1e-5).norm, x)["jaxsub_layer_norm_fwd"] == 1
    with pytest.raises(TypeError, match="optimize: `fn` must be callable"):
        jaxsub.optimize(3)


def test_a_matched_layer_norm_is_no_near_miss():
    """Post-LN: the second LN(o + x) is a BDRLN; the reading tried first (the previous LN's
    bias taken for the residual's bias) was listed as a near-miss of the same layer norm
    (found by probing)."""
    e = 32
    rng = np.random.default_rng(11)
    p = {name: jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32) for name, shape in (
        ("wo", (e, e)), ("bo", (e,)), ("g1", (e,)), ("b1", (e,)), ("w1", (e, 4 * e)), ("b1f", (4 * e,)),
        ("w2", (4 * e, e)), ("b2", (e,)), ("g2", (e,)), ("b2ln", (e,)))}

    def ln(x, g, b):
        u = x.mean(-1, keepdims=True)
        return g * ((x - u) / jnp.sqrt(((x - u) ** 2).mean(-1, keepdims=True) + 1e-12)) + b

    def f(p, x):
        x = ln(x @ p["wo"] + p["bo"] + x, p["g1"], p["b1"])
        o = jax.nn.gelu(x @ p["w1"] + p["b1f"], approximate=False) @ p["w2"] + p["b2"]
        return ln(o + x, p["g2"], p["b2ln"])

    x = jnp.asarray(rng.standard_normal((2, 8, e)), jnp.float32)
    report = jaxsub.explain(f, p, x)
    assert report.totals["bias_dropout_residual_layer_norm"] == 2 and not report.near_misses, str(report)
    _assert_same(f, (p, x), argnums=(0, 1), reduction=4 * e)


def test_a_method_of_an_unhashable_object_names_the_static_argument():
    """Found by probing: optimize on a method of a dataclass holding arrays raised Python's
    bare "unhashable type" from the trace cache."""
    import dataclasses

    @dataclasses.dataclass
    class Block:
        g: jax.Array

        @jaxsub.optimize
        def __call__(self, x):
            return x * self.g

    with pytest.raises(TypeError, match="jaxsub.optimize: a non-array argument is static .* got a Block"):
        Block(jnp.ones(N))(_normal(3, (4, N)))


def test_entry_points_name_a_bad_argument():
    """Found by probing: explain and stack.scan of something not callable raised Python's
    bare "'int' object is not callable"; a flag given as a string ("no") counted as True."""
    x = _normal(3, (4, N))
    with pytest.raises(TypeError, match="jaxsub.explain: `fn` must be callable"):
        jaxsub.explain(3, x)
    with pytest.raises(TypeError, match="jaxsub.stack.scan: `body` must be callable"):
        jaxsub.stack.scan(3, x, None, length=2)
    with pytest.raises(TypeError, match="jaxsub.optimize: `rewrite_dropout` must be a Python bool, got 'no'"):
        jaxsub.optimize(lambda x: x, rewrite_dropout="no")
    with pytest.raises(TypeError, match="jaxsub.explain: `rewrite_dropout` must be a Python bool"):
        jaxsub.explain(lambda x: x, x, rewrite_dropout=None)
    for flag in ("grad", "time", "compare_optimized"):
        with pytest.raises(TypeError, match=f"jaxsub.analyze: `{flag}` must be a Python bool"):
            jaxsub.analyze(lambda x: x.sum(), x, **{flag: "yes"})
    assert jaxsub.optimize(lambda x: x, rewrite_dropout=np.bool_(False)).options.rewrite_dropout is False


def test_deepcopy_and_pickle_after_a_call():
    """A called optimized function copies and pickles (found by probing: its traces hold
    jaxprs, whose tracebacks cannot be pickled); the copy traces again and computes the same."""
    import copy
    import pickle

    x = _normal(5, (3, N))
    opt = jaxsub.optimize(ln_no_params)
    want = opt(x)
    for again in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert_close(again(x), want, what="copy")
        assert _counts(again, x)["jaxsub_layer_norm_fwd"] == 1


def test_explain_report_lists_matches_with_source():
    args = (_normal(0, (6, N)), _normal(1, (N,)), _normal(2, (N,)))
    text = str(jaxsub.explain(ln_two_pass, *args))
    assert "layer_norm" in text and "float32[6, 32]" in text and "eps=1e-05" in text
    assert "test_optimize.py" in text and "ln_two_pass" in text
    assert "Totals: layer_norm x1" in text


def test_dead_code_is_neither_matched_nor_counted():
    """Found by probing: explain listed a layer norm whose result the function never
    returned (jit drops it; the compiled program had no call for it). A layer norm read
    only by an effect (a debug callback) stays, as it does under jit."""
    x, s, b = _normal(0, (6, N)), _normal(1, (N,)), _normal(2, (N,))

    def dead(x, s, b):
        ln_two_pass(x, s, b)
        return x * 2

    def printed(x, s, b):
        jax.debug.callback(lambda y: None, ln_two_pass(x, s, b))
        return x * 2

    assert not jaxsub.explain(dead, x, s, b).matches
    assert_close(jaxsub.optimize(dead)(x, s, b), x * 2, what="dead")
    assert jaxsub.explain(printed, x, s, b).totals == {"layer_norm": 1}
    assert _counts(jaxsub.optimize(printed), x, s, b)["jaxsub_layer_norm_fwd"] == 1


def test_static_scalars_that_compare_equal_trace_apart():
    """Found by probing: the trace cache keyed static leaves by == and hash, so 1, 1.0 and
    True shared one trace (x * 1.0 after x * 1 came back int32), as did 0.0 and -0.0."""
    f = jaxsub.optimize(lambda x, s: x * s)
    xi = jnp.arange(4)
    for a, b in [(1, 1.0), (1.0, True), (True, 1)]:
        f(xi, a)
        assert f(xi, b).dtype == (xi * b).dtype
    g = jaxsub.optimize(lambda x, s: x / s)
    g(jnp.ones(2), 0.0)
    np.testing.assert_array_equal(np.asarray(g(jnp.ones(2), -0.0)), [-np.inf, -np.inf])


def test_constant_outputs_are_arrays_as_under_jit():
    """Found by probing: an output that is a literal or constant (jnp.asarray(True), a
    Python 3.0) came back as a Python bool or JAX's internal typed literal, without
    .dtype or .block_until_ready()."""
    x = jnp.ones(3)
    for f in (lambda x: jnp.asarray(True), lambda x: 3.0, lambda x: jnp.zeros(()), lambda x: (x.sum(), 2),
              lambda x: jnp.float32(3.0)):
        got, want = jaxsub.optimize(f)(x), jax.jit(f)(x)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert isinstance(g, jax.Array) and (g.dtype, g.weak_type) == (w.dtype, w.weak_type)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
