"""The gradient of an additive mask (a learned bias added to the attention scores) through
every op of the attention family and through `optimize`'s rewrite, against the float64
reference; and no extra work where the program does not differentiate the mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub.ops.attn import reference_attention
from jaxsub.ops.softmax import reference_softmax_dropout
from jaxsub.testing import assert_close

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
IMPLEMENTATIONS = ("fused", "unfused")


def normal(rng, shape, dtype=F32, scale=1.0):
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32), dtype)


def additive_mask(rng, shape, empty_row=False):
    """A learned-bias-like additive mask with some -inf (hidden keys); the last key stays
    visible so that no row is empty, unless `empty_row`: then query 0 sees no key."""
    m = rng.standard_normal(shape).astype(np.float32)
    m[rng.random(shape) < 0.15] = -np.inf
    m[..., -1] = 0.25
    if empty_row:
        m[..., 0, :] = -np.inf
    return jnp.asarray(m)


def f64(a):
    return None if a is None else jnp.asarray(np.asarray(a, np.float64))


def keep_mask(key, shape, rate):
    return None if rate == 0.0 else jaxsub.ops.dropout_mask(key, shape, rate)


def reference_grads(q, k, v, dout, mask, keep, *, causal, rate, scale=None):
    """d(q, k, v, mask) of the float64 reference."""
    with jax.enable_x64(True):
        f = lambda q, k, v, m: reference_attention(q, k, v, mask=m, causal=causal, scale=scale, keep=keep, rate=rate)
        _, vjp = jax.vjp(f, f64(q), f64(k), f64(v), f64(mask))
        return tuple(np.asarray(g, np.float64) for g in vjp(f64(dout)))


def check_grads_against(got, want, dtype, n, names=("dq", "dk", "dv", "dmask")):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert_close(g, w, dtype, reduction=n, grad=True, what=name)


# (B, Sq, Sk, H, D, dtype, mask shape, causal, rate)
CASES = [
    (2, 7, 7, 3, 8, F32, "hqk", False, 0.0),
    (2, 7, 130, 3, 8, F32, "hqk", True, 0.1),
    (2, 130, 7, 1, 16, F32, "b1qk", False, 0.1),
    (2, 16, 16, 2, 8, F32, "bk", True, 0.0),
    (1, 33, 33, 2, 64, BF16, "qk", False, 0.1),
    (2, 9, 12, 2, 32, BF16, "1h1k", True, 0.2),
    (2, 9, 5, 2, 8, F32, "hqk", True, 0.1),  # causal with Sq > Sk: queries 0-3 see no key
    (2, 7, 7, 3, 8, F32, "hqk-empty", False, 0.1),  # query 0 sees no key
]
SHAPES = {"hqk": lambda b, h, sq, sk: (h, sq, sk), "b1qk": lambda b, h, sq, sk: (b, 1, sq, sk),
          "bk": lambda b, h, sq, sk: (b, sk), "qk": lambda b, h, sq, sk: (sq, sk),
          "1h1k": lambda b, h, sq, sk: (1, h, 1, sk), "hqk-empty": lambda b, h, sq, sk: (h, sq, sk)}


def case_inputs(i, b, sq, sk, h, d, dtype, shape):
    rng = np.random.default_rng(400 + i)
    q = normal(rng, (b, sq, h, d), dtype, 2.0)
    k, v = normal(rng, (b, sk, h, d), dtype), normal(rng, (b, sk, h, d), dtype)
    dout = normal(rng, (b, sq, h, d), dtype)
    mask = additive_mask(rng, SHAPES[shape](b, h, sq, sk), empty_row=shape.endswith("empty"))
    return q, k, v, dout, mask, jax.random.key(500 + i)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_attention_mask_gradient_matches_reference(case, implementation, fallback_log):
    b, sq, sk, h, d, dtype, shape, causal, rate = CASES[case]
    q, k, v, dout, mask, key = case_inputs(case, b, sq, sk, h, d, dtype, shape)

    def f(q, k, v, m):
        return jaxsub.ops.attention(q, k, v, mask=m, causal=causal, dropout_rate=rate, key=key,
                                    implementation=implementation)

    got = jax.jit(lambda *a: jax.vjp(f, *a)[1](dout))(q, k, v, mask)
    want = reference_grads(q, k, v, dout, mask, keep_mask(key, (b, h, sq, sk), rate), causal=causal, rate=rate)
    assert all(np.isfinite(np.asarray(g, np.float64)).all() for g in got)
    check_grads_against(got, want, dtype, max(sq, sk, d))
    assert np.abs(np.asarray(got[3], np.float64)).max() > 0  # not the zero cotangent of a constant
    expect_route(fallback_log, "attention", implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_attention_mask_gradient_with_grouped_heads(implementation, fallback_log):
    """k and v with fewer heads than q (grouped-query) and the mask differentiated: the fused
    path's unfused structure takes k and v repeated, as the unfused path does (it raised an
    einsum shape error before); dk and dv have k's heads."""
    b, sq, sk, h, h_kv, d, rate = 2, 7, 9, 6, 2, 8, 0.1
    q, k, v, dout, mask, key = case_inputs(20, b, sq, sk, h, d, F32, "hqk")
    k, v = k[:, :, :h_kv], v[:, :, :h_kv]

    def f(q, k, v, m):
        return jaxsub.ops.attention(q, k, v, mask=m, causal=True, dropout_rate=rate, key=key,
                                    implementation=implementation)

    got = jax.jit(lambda *a: jax.vjp(f, *a)[1](dout))(q, k, v, mask)
    want = reference_grads(q, k, v, dout, mask, keep_mask(key, (b, h, sq, sk), rate), causal=True, rate=rate)
    check_grads_against(got, want, F32, max(sq, sk, d))
    expect_route(fallback_log, "attention", implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_attention_mask_gradient_where_first_queries_see_only_large_values(implementation, fallback_log):
    """A learned [B, 1, 1, Sk] bias under the causal rule whose first keys of example 0 hold
    -1e9 (example 1: -2e9 then -1e9), so its first queries see only values below -256: the op
    runs on the mask expanded to a row per query (masks.by_query) and the mask's gradient
    sums over the queries, as the float64 reference's (whose rows are shifted the same way)."""
    b, s, h, d, rate = 2, 11, 2, 8, 0.1
    q, k, v, dout, _, key = case_inputs(21, b, s, s, h, d, F32, "hqk")
    m = np.array(normal(np.random.default_rng(22), (b, 1, 1, s)))
    m[0, ..., :4] = -1e9
    m[1, ..., :2], m[1, ..., 2:5] = -2e9, -1e9
    mask = jnp.asarray(m)

    def f(q, k, v, m):
        return jaxsub.ops.attention(q, k, v, mask=m, causal=True, dropout_rate=rate, key=key,
                                    implementation=implementation)

    got = jax.jit(lambda *a: jax.vjp(f, *a)[1](dout))(q, k, v, mask)
    want = reference_grads(q, k, v, dout, mask, keep_mask(key, (b, h, s, s), rate), causal=True, rate=rate)
    check_grads_against(got, want, F32, s)
    expect_route(fallback_log, "attention", implementation)


def expect_route(log, op, implementation):
    """The mask's gradient from the softmax backward's dS: the fused path says it runs the
    unfused structure, and nothing computes dS again (`masks.mask_cotangent`)."""
    assert ((op, "gradient of an additive mask") in log) == (implementation == "fused"), log
    assert not any("at this scale" in reason for _, reason in log), log


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_attention_check_grads_wrt_mask(implementation):
    rng = np.random.default_rng(7)
    q, k, v = (normal(rng, (1, 5, 2, 8)) for _ in range(3))
    mask = normal(rng, (2, 5, 5))
    f = lambda m: jaxsub.ops.attention(q, k, v, mask=m, causal=True, implementation=implementation)
    check_grads(f, (mask,), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", ["packed", "projected", "dense"])
def test_packed_and_projected_mask_gradients(form, implementation, fallback_log):
    b, s, h, d, e, rate = 2, 12, 2, 8, 16, 0.1
    rng = np.random.default_rng(11)
    x = normal(rng, (b, s, e))
    ws = tuple(normal(rng, (e, h, d), scale=0.3) for _ in range(3))
    bs = tuple(normal(rng, (h, d), scale=0.1) for _ in range(3))
    dout = normal(rng, (b, s, h, d))
    mask = additive_mask(rng, (h, s, s))
    key = jax.random.key(12)
    kw = dict(mask=None, causal=True, dropout_rate=rate, key=key, implementation=implementation)

    def run(m, x, ws, bs):
        kw["mask"] = m
        if form == "packed":
            qkv = jnp.stack([jnp.einsum("bse,ehd->bshd", x, w) + bb for w, bb in zip(ws, bs)], axis=2)
            return jaxsub.ops.attention_packed(qkv, **kw)
        if form == "projected":
            return jaxsub.ops.attention_projected(x, ws, bs, **kw)
        return jaxsub.ops.dense_attention_packed(x, jnp.stack(ws, axis=1), bs, **kw)

    def plain(m, x, ws, bs):
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, w) + bb for w, bb in zip(ws, bs))
        return reference_attention(q, k, v, mask=m, causal=True, keep=keep_mask(key, (b, h, s, s), rate), rate=rate)

    got = jax.jit(lambda *a: jax.vjp(run, *a)[1](dout))(mask, x, ws, bs)
    want = jax.jit(lambda *a: jax.vjp(plain, *a)[1](dout))(mask, x, ws, bs)
    assert_close(got[0], want[0], F32, reduction=s, grad=True, what="dmask")
    assert_close(got[1], want[1], F32, reduction=s * e, grad=True, what="dx")
    for g, w in zip(jax.tree.leaves(got[2:]), jax.tree.leaves(want[2:])):
        assert_close(g, w, F32, reduction=b * s, grad=True, what="dparams")
    op = {"packed": "attention_packed", "projected": "attention_projected", "dense": "dense_attention_packed"}[form]
    expect_route(fallback_log, op, implementation)


# (dtype, scale): the mask's gradient from the scores' (scale · dS), or where that cannot
# hold dS (scale 0; float16 below scale 1/16) by XLA again.
SOFTMAX_CASES = [(F32, 0.5), (BF16, 0.5), (jnp.dtype(jnp.float16), 0.125), (F32, 0.3), (F32, 0.0),
                 (jnp.dtype(jnp.float16), 0.03)]


@pytest.mark.parametrize("dtype, scale", SOFTMAX_CASES)
def test_softmax_dropout_mask_gradient(dtype, scale, fallback_log):
    rng = np.random.default_rng(21)
    scores = normal(rng, (2, 3, 7, 40), dtype, 2.0)
    dy = normal(rng, (2, 3, 7, 40), dtype)
    mask = additive_mask(rng, (3, 1, 40)).at[1].set(-jnp.inf)  # head 1: every row empty
    key, rate = jax.random.key(22), 0.1
    f = lambda s, m: jaxsub.ops.softmax_dropout(s, scale=scale, mask=m, causal=True, rate=rate, key=key)
    got = jax.jit(lambda s, m: jax.vjp(f, s, m)[1](dy))(scores, mask)
    keep = keep_mask(key, scores.shape, rate)
    with jax.enable_x64(True):
        g = lambda s, m: reference_softmax_dropout(s, scale=scale, mask=m, causal=True, keep=keep, rate=rate)
        want = jax.vjp(g, f64(scores), f64(mask))[1](f64(dy))
    assert all(np.isfinite(np.asarray(g, np.float64)).all() for g in got)
    assert_close(got[0], want[0], dtype, reduction=40, grad=True, what="dscores")
    assert_close(got[1], want[1], dtype, reduction=2 * 7 * 40, grad=True, what="dmask")
    assert np.abs(np.asarray(got[1], np.float64)).max() > 0
    again = scale == 0.0 or (dtype == jnp.float16 and scale < 0.0625)
    assert any("additive mask" in reason for _, reason in fallback_log) == again, fallback_log
    hlo = jax.jit(lambda s, m: jax.vjp(f, s, m)[1](dy)[1]).lower(scores, mask).as_text()
    assert ("jaxsub_dropout_mask" in hlo) == again  # the XLA way regenerates the keep-mask


def test_differentiated_mask_takes_the_unfused_structure():
    """With the mask differentiated, the fused path's forward rule runs the unfused
    structure (the softmax targets, no attention target, no keep-mask target); with it
    constant, the fused targets alone."""
    b, s, h, d = 2, 12, 2, 8
    rng = np.random.default_rng(23)
    q, k, v = (normal(rng, (b, s, h, d)) for _ in range(3))
    mask = additive_mask(rng, (h, s, s))
    key = jax.random.key(24)
    loss = lambda q, m: jaxsub.ops.attention(q, k, v, mask=m, dropout_rate=0.1, key=key,
                                             implementation="fused").sum()
    both = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, mask).as_text()
    assert "jaxsub_softmax_dropout_bwd" in both and "jaxsub_attention" not in both
    assert "jaxsub_dropout_mask" not in both
    q_only = jax.jit(jax.grad(loss)).lower(q, mask).as_text()
    assert "jaxsub_attention_bwd" in q_only and "jaxsub_softmax_dropout" not in q_only


def test_mask_not_differentiated_costs_nothing_more(fallback_log):
    """With the mask a constant of the differentiated program (a padding mask), the backward
    is what it was: no keep-mask target (the reference's dropout), no [B, H, Sq, Sk] f32
    array, no log line."""
    b, s, h, d = 2, 24, 3, 16
    rng = np.random.default_rng(31)
    q, k, v = (normal(rng, (b, s, h, d)) for _ in range(3))
    mask = additive_mask(rng, (b, 1, 1, s))
    key = jax.random.key(32)
    for implementation in IMPLEMENTATIONS:
        loss = lambda q, k, v, m: jaxsub.ops.attention(q, k, v, mask=m, dropout_rate=0.1, key=key,
                                                       implementation=implementation).sum()
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, mask).as_text()
        assert "jaxsub_dropout_mask" not in hlo, implementation
        if implementation == "fused":
            assert f"tensor<{b}x{h}x{s}x{s}xf32>" not in hlo
    assert not fallback_log


def test_vmap_over_masks_with_their_gradients():
    rng = np.random.default_rng(41)
    q, k, v = (normal(rng, (1, 6, 2, 8)) for _ in range(3))
    masks = normal(rng, (3, 2, 6, 6))
    loss = lambda m, impl: (jaxsub.ops.attention(q, k, v, mask=m, implementation=impl) ** 2).sum()
    ref = lambda m: (reference_attention(q, k, v, mask=m) ** 2).sum()
    want = jax.vmap(jax.grad(ref))(masks)
    for impl in IMPLEMENTATIONS:
        got = jax.jit(jax.vmap(jax.grad(lambda m: loss(m, impl))))(masks)
        assert_close(got, want, F32, reduction=6, grad=True, what=impl)


def test_optimize_keeps_a_learned_relative_bias_trainable():
    """`optimize` rewrites attention whose scores get a learned bias (T5, Swin) into the
    fused op with that bias as its additive mask: the bias's gradient must survive."""
    b, s, h, d = 2, 8, 2, 16
    rng = np.random.default_rng(51)
    q, k, v = (normal(rng, (b, s, h, d)) for _ in range(3))
    params = {"rel_bias": normal(rng, (h, s, s))}

    def loss(params, q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d) + params["rel_bias"][None]
        p = jax.nn.softmax(scores, axis=-1)
        return (jnp.einsum("bhqk,bkhd->bqhd", p, v) ** 2).sum()

    assert "attention" in str(jaxsub.explain(loss, params, q, k, v))
    want = jax.grad(loss, argnums=(0, 1))(params, q, k, v)
    got = jax.jit(jax.grad(jaxsub.optimize(loss), argnums=(0, 1)))(params, q, k, v)
    assert np.abs(np.asarray(want[0]["rel_bias"])).max() > 0
    assert_close(got[0]["rel_bias"], want[0]["rel_bias"], F32, reduction=s * b, grad=True, what="rel_bias")
    assert_close(got[1], want[1], F32, reduction=s, grad=True, what="dq")


@pytest.mark.gpu
class TestCuda:
    def test_fused_bf16_mask_gradient_matches_cpu(self):
        b, s, h, d, rate = 2, 128, 4, 64, 0.1
        rng = np.random.default_rng(61)
        q, k, v = (normal(rng, (b, s, h, d), BF16) for _ in range(3))
        dout = normal(rng, (b, s, h, d), BF16)
        mask = additive_mask(rng, (h, s, s))
        key = jax.random.key(62)

        def grads(q, k, v, m, dout, key):
            f = lambda q, k, v, m: jaxsub.ops.attention(q, k, v, mask=m, dropout_rate=rate, key=key,
                                                        implementation="fused")
            return jax.vjp(f, q, k, v, m)[1](dout)

        run = jax.jit(grads)
        args = (q, k, v, mask, dout, key)
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        for name, g, w in zip(("dq", "dk", "dv", "dmask"), got, want):
            assert_close(g, w, BF16, reduction=s, grad=True, what=name)
