"""Forward-mode and higher-order differentiation (jax.jvp, jacfwd, hessian, grad of grad)
of the fused ops and of optimized functions.

A custom_vjp has one reverse-mode derivative. Where an op's arguments are traced for more,
the op runs its jnp reference with the kernel's dropout mask (`_ffi.custom_vjp`), so the
derivatives are the reference's: each test compares them with jax's derivatives of the
public reference (or of the function before `optimize`) with `dropout_mask`'s mask.
First-order gradients keep the fused backward targets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import ops
from jaxsub.ops import attn as _attn
from jaxsub.ops.attn import reference_attention
from jaxsub.ops.dropout import residual_add
from jaxsub.ops.gelu import reference_bias_gelu_dropout
from jaxsub.ops.norm import reference_bdrln, reference_layer_norm
from jaxsub.ops.softmax import reference_softmax_dropout
from jaxsub.testing import causal_rows_shifted

TOL = dict(rtol=2e-5, atol=2e-5)


def _rand(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _assert_jvp(fn, reference, primals, seed=100):
    """jvp of fn equals jvp of reference at primals, tangents drawn at random; the jvp's
    primal output equals fn's."""
    tangents = tuple(_rand(seed + i, np.shape(p)) for i, p in enumerate(primals))
    out, tan = jax.jvp(fn, primals, tangents)
    out_ref, tan_ref = jax.jvp(reference, primals, tangents)
    for a, b in zip(jax.tree.leaves((out, tan)), jax.tree.leaves((out_ref, tan_ref))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(fn(*primals))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def _assert_second_order(fn, reference, x):
    """hessian-vector product (jvp of grad) and grad of grad of a scalar loss of fn equal
    the reference's."""
    loss = lambda f: (lambda x: jnp.sum(jnp.sin(f(x)) ** 2))
    t = _rand(7, x.shape)
    hvp = lambda f: jax.jvp(jax.grad(loss(f)), (x,), (t,))[1]
    gg = lambda f: jax.grad(lambda x: jnp.sum(jax.grad(loss(f))(x) * t))(x)
    np.testing.assert_allclose(hvp(fn), hvp(reference), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gg(fn), gg(reference), rtol=1e-4, atol=1e-4)


KEY = jax.random.key(42)


def test_layer_norm():
    x, g, b = _rand(0, (5, 33)), 1.0 + _rand(1, (33,), 0.1), _rand(2, (33,))
    _assert_jvp(lambda x, g, b: ops.layer_norm(x, g, b),
                lambda x, g, b: reference_layer_norm(x, g, b), (x, g, b))
    _assert_second_order(lambda x: ops.layer_norm(x, g, b), lambda x: reference_layer_norm(x, g, b), x)


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_bias_dropout_residual_layer_norm(rate):
    x, r = _rand(0, (2, 3, 40)), _rand(1, (2, 3, 40))
    bias, g, b = _rand(2, (40,)), 1.0 + _rand(3, (40,), 0.1), _rand(4, (40,))
    keep = ops.dropout_mask(KEY, x.shape, rate) if rate else None
    _assert_jvp(lambda x, r, bias: ops.bias_dropout_residual_layer_norm(x, bias, r, g, b, rate=rate, key=KEY),
                lambda x, r, bias: reference_bdrln(x, bias, r, g, b, keep=keep, rate=rate), (x, r, bias))
    _assert_second_order(lambda x: ops.bias_dropout_residual_layer_norm(x, bias, r, g, b, rate=rate, key=KEY),
                         lambda x: reference_bdrln(x, bias, r, g, b, keep=keep, rate=rate), x)


@pytest.mark.parametrize("approximate", [False, True])
def test_bias_gelu_dropout(approximate):
    x, bias = _rand(0, (6, 130)), _rand(1, (130,))
    keep = ops.dropout_mask(KEY, x.shape, 0.2)
    fused = lambda x, bias: ops.bias_gelu_dropout(x, bias, rate=0.2, key=KEY, approximate=approximate)
    ref = lambda x, bias: reference_bias_gelu_dropout(x, bias, keep=keep, rate=0.2, approximate=approximate)
    _assert_jvp(fused, ref, (x, bias))
    _assert_second_order(lambda x: fused(x, bias), lambda x: ref(x, bias), x)


def test_gelu_with_products():
    x, w, bias, w2 = _rand(0, (2, 5, 12)), _rand(1, (12, 24), 0.3), _rand(2, (24,)), _rand(3, (24, 7), 0.3)
    keep = ops.dropout_mask(KEY, (2, 5, 24), 0.25)
    gelu = lambda h: reference_bias_gelu_dropout(h, bias, keep=keep, rate=0.25)
    hi = jax.lax.Precision.HIGHEST
    _assert_jvp(lambda x, w: ops.dense_bias_gelu_dropout(x, w, bias, rate=0.25, key=KEY, out_kernel=w2),
                lambda x, w: jnp.matmul(gelu(jnp.matmul(x, w, precision=hi)), w2, precision=hi), (x, w))
    h = _rand(4, (2, 5, 24))
    _assert_jvp(lambda h, w2: ops.bias_gelu_dropout_dense(h, bias, w2, rate=0.25, key=KEY),
                lambda h, w2: jnp.matmul(gelu(h), w2, precision=hi), (h, w2))


def test_dense_and_bias_add():
    x, w, b = _rand(0, (3, 4, 8)), _rand(1, (8, 5)), _rand(2, (5,))
    hi = jax.lax.Precision.HIGHEST
    _assert_jvp(lambda x, w, b: ops.dense(x, w, b), lambda x, w, b: jnp.matmul(x, w, precision=hi) + b, (x, w, b))
    _assert_jvp(lambda x, b: ops.bias_add(x, b), lambda x, b: x + b, (x, b[:1] + _rand(3, (8,))))


# An additive key padding [B, Sk] whose example 0 is left-padded by -1e9: under the causal
# rule its first queries see only padded keys, so the ops take the mask as a row per query
# (masks.by_query: a lax.cond, which forward mode did not reach through; found by a probe).
LEFT_PAD = jnp.where(jnp.arange(9)[None, :] < jnp.array([[3], [0]]), -1e9, 0.0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", ["boolean", "left_pad"])
def test_softmax_dropout(causal, mask_kind):
    s = _rand(0, (2, 3, 7, 9), 2.0)
    mask = (jax.random.bernoulli(jax.random.key(5), 0.8, (2, 1, 7, 9)) if mask_kind == "boolean"
            else LEFT_PAD[:, None, None, :])
    # The documented shift (without the causal rule no row here has all its values below -256).
    seen = causal_rows_shifted(mask, 7, 9) if mask_kind == "left_pad" and causal else mask
    keep = ops.dropout_mask(KEY, s.shape, 0.1)
    _assert_jvp(lambda s: ops.softmax_dropout(s, scale=0.5, mask=mask, causal=causal, rate=0.1, key=KEY),
                lambda s: reference_softmax_dropout(s, scale=0.5, mask=seen, causal=causal, keep=keep, rate=0.1),
                (s,))


@pytest.mark.parametrize("implementation", ["fused", "unfused"])
@pytest.mark.parametrize("case", ["plain", "padding+causal", "additive", "left_pad+causal", "grouped",
                                  "broadcast_dropout"])
def test_attention(implementation, case):
    b, sq, sk, h, d = 2, 7, 9, 4, 8
    q, k, v = _rand(0, (b, sq, h, d)), _rand(1, (b, sk, h, d)), _rand(2, (b, sk, h, d))
    kw, keep_shape = dict(dropout_rate=0.2, key=KEY), (b, h, sq, sk)
    if case == "padding+causal":
        kw.update(mask=jnp.arange(sk)[None, :] < jnp.array([[6], [9]]), causal=True)
    elif case == "additive":
        kw.update(mask=_rand(3, (1, h, sq, sk)))
    elif case == "left_pad+causal":
        kw.update(mask=LEFT_PAD, causal=True)
    elif case == "grouped":
        k, v = k[:, :, :2], v[:, :, :2]
    elif case == "broadcast_dropout":
        kw.update(broadcast_dropout=True)
        keep_shape = (1, 1, sq, sk)
    keep = ops.dropout_mask(KEY, keep_shape, 0.2)
    ref_kw = {n: kw[n] for n in ("mask", "causal") if n in kw}
    _assert_jvp(lambda q, k, v: ops.attention(q, k, v, implementation=implementation, **kw),
                lambda q, k, v: reference_attention(q, k, v, keep=keep, rate=0.2, **ref_kw), (q, k, v))
    if case == "plain":
        _assert_second_order(lambda q: ops.attention(q, k, v, implementation=implementation, **kw),
                             lambda q: reference_attention(q, k, v, keep=keep, rate=0.2), q)


@pytest.mark.parametrize("left_pad", [False, True])
def test_attention_packed_and_projected(left_pad):
    b, s, e, h, d = 2, 9, 12, 3, 4
    x, w, bias = _rand(0, (b, s, e)), _rand(1, (e, 3, h, d), 0.3), _rand(2, (3, h, d))
    keep = ops.dropout_mask(KEY, (b, h, s, s), 0.1)
    hi = jax.lax.Precision.HIGHEST
    masks = dict(mask=LEFT_PAD, causal=True) if left_pad else {}

    def ref(x, w, bias):
        qkv = jnp.einsum("bse,ethd->bsthd", x, w, precision=hi) + bias
        return reference_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], keep=keep, rate=0.1, **masks)

    kw = dict(dropout_rate=0.1, key=KEY, **masks)
    _assert_jvp(lambda x, w, bias: ops.dense_attention_packed(x, w, bias, implementation="fused", **kw), ref,
                (x, w, bias))
    _assert_jvp(lambda x, w, bias: ops.attention_packed(jnp.einsum("bse,ethd->bsthd", x, w, precision=hi) + bias,
                                                        implementation="fused", **kw), ref, (x, w, bias))
    ws, bs = tuple(w[:, i] for i in range(3)), tuple(bias[i] for i in range(3))
    _assert_jvp(lambda x, w, bias: ops.attention_projected(x, tuple(w[:, i] for i in range(3)),
                                                           tuple(bias[i] for i in range(3)), implementation="fused",
                                                           **kw), ref, (x, w, bias))
    assert len(ws) == len(bs) == 3


def test_stack_scan():
    ws, x = _rand(0, (3, 8, 8), 0.3), _rand(1, (4, 8))
    g = 1.0 + _rand(2, (8,), 0.1)

    def body(consts, h, w):
        return ops.layer_norm(jnp.tanh(h @ w), consts, None), None

    def ref_body(h, w):
        return reference_layer_norm(jnp.tanh(h @ w), g, None), None

    _assert_jvp(lambda x, ws: jaxsub.stack.scan(body, x, ws, g)[0], lambda x, ws: jax.lax.scan(ref_body, x, ws)[0],
                (x, ws))


def _jnp_layer(p, x, key):
    """A small post-LN encoder layer in jnp (attention, residual, layer norm, GELU MLP)."""
    b, s, e = x.shape
    h = 2
    qkv = (x @ p["wqkv"]).reshape(b, s, 3, h, e // h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(e // h)
    probs = jax.nn.softmax(scores, axis=-1)
    a = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, e)

    def ln(z, g, beta):
        m = z.mean(-1, keepdims=True)
        var = ((z - m) ** 2).mean(-1, keepdims=True)
        return (z - m) * jax.lax.rsqrt(var + 1e-5) * g + beta

    y = ln(x + a @ p["wo"] + p["bo"], p["g1"], p["b1"])
    f = jax.nn.gelu(y @ p["w1"] + p["b1f"], approximate=False) @ p["w2"]
    return ln(y + f + p["b2"], p["g2"], p["b2n"])


def _layer_params(e=8, f=16):
    shapes = dict(wqkv=(e, 3 * e), wo=(e, e), bo=(e,), g1=(e,), b1=(e,), w1=(e, f), b1f=(f,), w2=(f, e), b2=(e,),
                  g2=(e,), b2n=(e,))
    p = {n: _rand(i, s, 0.3) for i, (n, s) in enumerate(shapes.items())}
    p["g1"], p["g2"] = p["g1"] + 1.0, p["g2"] + 1.0
    return p


def test_optimize_jvp_hessian_and_grad_of_grad():
    p, x = _layer_params(), _rand(20, (2, 5, 8))
    fast = jaxsub.optimize(_jnp_layer)
    assert jaxsub.explain(_jnp_layer, p, x, KEY).matches, "the layer's patterns must be rewritten for this test"
    _assert_jvp(lambda x: fast(p, x, KEY), lambda x: _jnp_layer(p, x, KEY), (x,))
    _assert_second_order(lambda x: fast(p, x, KEY), lambda x: _jnp_layer(p, x, KEY), x)
    # jacfwd and jacrev agree through the fused ops.
    jf = jax.jacfwd(lambda x: fast(p, x, KEY))(x[:1, :2])
    jr = jax.jacrev(lambda x: fast(p, x, KEY))(x[:1, :2])
    np.testing.assert_allclose(jf, jr, rtol=1e-4, atol=1e-5)
    # jvp traced inside jit (a jitted step with a Hessian-vector product) works too.
    t = _rand(21, x.shape)
    inside = jax.jit(lambda x, t: jax.jvp(lambda x: fast(p, x, KEY), (x,), (t,)))(x, t)
    np.testing.assert_allclose(inside[1], jax.jvp(lambda x: _jnp_layer(p, x, KEY), (x,), (t,))[1], **TOL)


def test_optimize_jvp_through_scan_remat_and_jit_bodies():
    """A transformation's tracers do not reach into bodies that JAX traces (a scan's, a
    checkpoint's, a jit's): `optimize` runs every op in them as its reference too."""
    layers = [_layer_params() for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = _rand(30, (2, 5, 8))

    def model(stacked, x):
        step = jax.checkpoint(lambda h, p: (jax.jit(_jnp_layer)(p, h, KEY), None))
        return jax.lax.scan(step, x, stacked)[0]

    fast = jaxsub.optimize(model)
    assert jaxsub.explain(model, stacked, x).matches
    _assert_jvp(lambda x: fast(stacked, x), lambda x: model(stacked, x), (x,))
    _assert_second_order(lambda x: fast(stacked, x), lambda x: model(stacked, x), x)


@pytest.mark.parametrize("module", ["EncoderLayer", "Encoder"])
def test_flax_modules_jvp(module):
    kw = dict(num_heads=2, mlp_dim=16, dropout_rate=0.1, attention_dropout_rate=0.1)
    model = (jaxsub.flax.EncoderLayer(**kw) if module == "EncoderLayer"
             else jaxsub.flax.Encoder(num_layers=2, scan_layers=True, **kw))
    x = _rand(0, (2, 6, 8))
    params = model.init(jax.random.key(0), x, deterministic=True)
    rngs = {"dropout": jax.random.key(1)}
    f = lambda x: model.apply(params, x, deterministic=False, rngs=rngs)
    t = _rand(1, x.shape)
    out, tan = jax.jvp(f, (x,), (t,))
    np.testing.assert_allclose(out, f(x), **TOL)
    # The tangent is the derivative of the same (dropped) function: a finite difference.
    eps = 1e-3
    fd = (f(x + eps * t) - f(x - eps * t)) / (2 * eps)
    np.testing.assert_allclose(tan, fd, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_encoder_with_remat_jvp(scan_layers):
    """nn.remat's checkpointed layers: a body JAX traces (and caches) apart from the
    transformation's tracers; the Encoder runs them as references too (a probe found both
    forms raising JAX's custom_vjp error)."""
    encoder = jaxsub.flax.Encoder(num_layers=2, num_heads=2, mlp_dim=16, scan_layers=scan_layers, remat=True)
    x = _rand(0, (2, 6, 8))
    params = encoder.init(jax.random.key(0), x, deterministic=True)
    f = lambda x: encoder.apply(params, x, deterministic=True)
    jax.grad(lambda x: f(x).sum())(x)  # a first-order trace first: its cached bodies must not be reused
    t = _rand(1, x.shape)
    tan = jax.jvp(f, (x,), (t,))[1]
    eps = 1e-3
    np.testing.assert_allclose(tan, (f(x + eps * t) - f(x - eps * t)) / (2 * eps), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("wrap", ["checkpoint", "jit"])
def test_stack_scan_of_a_checkpointed_or_jitted_body(wrap):
    g = 1.0 + _rand(2, (8,), 0.1)
    step = lambda c, h, w: (ops.layer_norm(jnp.tanh(h @ w), g, None), None)
    body = jax.checkpoint(step) if wrap == "checkpoint" else jax.jit(step)
    ref_body = lambda h, w: (reference_layer_norm(jnp.tanh(h @ w), g, None), None)
    ws, x = _rand(0, (3, 8, 8), 0.3), _rand(1, (4, 8))
    jax.grad(lambda x: jaxsub.stack.scan(body, x, ws)[0].sum())(x)  # cached fused traces of the body
    _assert_jvp(lambda x: jaxsub.stack.scan(body, x, ws)[0], lambda x: jax.lax.scan(ref_body, x, ws)[0], (x,))


def test_gradient_penalty():
    """An outer grad over the parameters, an inner grad over the inputs: each argument is
    traced by one of them, the op by both (a probe found it raising)."""
    x, g, b = _rand(0, (5, 33)), 1.0 + _rand(1, (33,), 0.1), _rand(2, (33,))

    def penalty(g, ln):
        gx = jax.grad(lambda x: jnp.sum(jnp.sin(ln(x, g, b))))(x)
        return jnp.sum(gx ** 2)

    np.testing.assert_allclose(jax.grad(penalty)(g, ops.layer_norm), jax.grad(penalty)(g, reference_layer_norm),
                               rtol=1e-4, atol=1e-5)


def test_first_order_gradients_keep_the_fused_backward(fallback_log):
    x, g, b = _rand(0, (5, 33)), 1.0 + _rand(1, (33,), 0.1), _rand(2, (33,))
    loss = lambda x: jnp.sum(ops.bias_gelu_dropout(ops.layer_norm(x, g, b), b, rate=0.1, key=KEY) ** 2)
    xs = jnp.stack([x, 2 * x])
    for fn, arg in ((jax.grad(loss), x), (jax.vmap(jax.grad(loss)), xs),
                    (jax.grad(lambda xs: jax.vmap(loss)(xs).sum()), xs)):
        hlo = jax.jit(fn).lower(arg).as_text()
        assert "jaxsub_layer_norm_bwd" in hlo and "jaxsub_bias_gelu_dropout_bwd" in hlo
    assert not fallback_log
    # Beyond the first reverse derivative the references run, with a log line naming each op.
    hlo = jax.jit(jax.hessian(loss)).lower(x[:1]).as_text()
    assert "jaxsub_layer_norm" not in hlo and "jaxsub_bias_gelu_dropout" not in hlo
    assert {op for op, _ in fallback_log} == {"layer_norm", "bias_gelu_dropout"}
    assert all("forward-mode" in reason for _, reason in fallback_log)


def test_jvp_of_a_jitted_call_raises_jaxs_error():
    """The documented limit: a transformation applied to a jitted function sees the compiled
    custom_vjp (JAX's own error, as for any custom_vjp)."""
    x, g, b = _rand(0, (3, 16)), jnp.ones(16), jnp.zeros(16)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(jax.jit(lambda x: ops.layer_norm(x, g, b)), (x,), (x,))


# Derivatives of the custom_vjp rules' results: `jax.jvp` or `jax.vjp` of a `jax.vjp` pullback
# with respect to its cotangent (the "double-vjp" trick that gives a JVP from two VJPs), and
# grad of a grad taken inside jit, checkpoint or scan. The kernels have no derivative; each
# rule's kernels are a custom_jvp whose derivative is the reference's (`_ffi.custom_vjp.defvjp`).


def _assert_pullback_derivatives(fn, reference, primals, seed=200):
    """jvp and vjp of fn's pullback with respect to the cotangent, and the JVP of fn got by
    the double-vjp trick, equal the reference's; the pullback itself keeps its value."""
    out, pull = jax.vjp(fn, *primals)
    _, pull_ref = jax.vjp(reference, *primals)
    ct = jax.tree.map(lambda o: _rand(seed, o.shape), out)
    dct = jax.tree.map(lambda o: _rand(seed + 1, o.shape), out)
    w = tuple(_rand(seed + 2 + i, np.shape(p)) for i, p in enumerate(primals))
    close = lambda a, b: [np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-5)  # noqa: E731
                          for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    close(jax.jvp(pull, (ct,), (dct,)), jax.jvp(pull_ref, (ct,), (dct,)))
    close(jax.vjp(pull, ct)[1](w), jax.vjp(pull_ref, ct)[1](w))  # = jvp of fn with tangents w
    close(jax.vjp(pull, ct)[1](w), (jax.jvp(reference, primals, w)[1],))
    close(jax.jit(lambda c, d: jax.jvp(pull, (c,), (d,)))(ct, dct), jax.jvp(pull_ref, (ct,), (dct,)))
    close(pull(ct), pull_ref(ct))


@pytest.mark.parametrize("op", ["layer_norm", "bdrln", "gelu", "softmax", "attention_fused", "attention_unfused",
                                "attention_packed", "residual_add", "dense_bias_add"])
def test_pullback_differentiated_with_respect_to_its_cotangent(op, fallback_log):
    x, r = _rand(0, (2, 3, 40)), _rand(1, (2, 3, 40))
    bias, g, b = _rand(2, (40,)), 1.0 + _rand(3, (40,), 0.1), _rand(4, (40,))
    keep = ops.dropout_mask(KEY, x.shape, 0.3)
    hi = jax.lax.Precision.HIGHEST
    if op == "layer_norm":
        cases = (lambda x, g, b: ops.layer_norm(x, g, b), reference_layer_norm, (x, g, b))
    elif op == "bdrln":
        cases = (lambda x, r, g: ops.bias_dropout_residual_layer_norm(x, bias, r, g, b, rate=0.3, key=KEY),
                 lambda x, r, g: reference_bdrln(x, bias, r, g, b, keep=keep, rate=0.3), (x, r, g))
    elif op == "gelu":
        cases = (lambda x, bias: ops.bias_gelu_dropout(x, bias, rate=0.3, key=KEY),
                 lambda x, bias: reference_bias_gelu_dropout(x, bias, keep=keep, rate=0.3), (x, bias))
    elif op == "softmax":
        cases = (lambda s: ops.softmax_dropout(s, scale=0.5, causal=True, rate=0.3, key=KEY),
                 lambda s: reference_softmax_dropout(s, scale=0.5, causal=True, keep=keep, rate=0.3), (x,))
    elif op.startswith("attention"):
        q, k, v = _rand(5, (2, 7, 4, 8)), _rand(6, (2, 9, 4, 8)), _rand(7, (2, 9, 4, 8))
        mask = jnp.arange(9)[None, :] < jnp.array([[6], [9]])
        akeep = ops.dropout_mask(KEY, (2, 4, 7, 9), 0.2)
        ref = lambda q, k, v: reference_attention(q, k, v, mask=mask, keep=akeep, rate=0.2)  # noqa: E731
        if op == "attention_packed":
            qkv = _rand(8, (2, 9, 3, 4, 8))
            akeep = ops.dropout_mask(KEY, (2, 4, 9, 9), 0.2)
            cases = (lambda qkv: ops.attention_packed(qkv, mask=mask, dropout_rate=0.2, key=KEY,
                                                      implementation="fused"),
                     lambda qkv: reference_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask=mask, keep=akeep,
                                                     rate=0.2), (qkv,))
        else:
            cases = (lambda q, k, v: ops.attention(q, k, v, mask=mask, dropout_rate=0.2, key=KEY,
                                                   implementation=op.split("_")[1]), ref, (q, k, v))
    elif op == "residual_add":
        cases = (lambda x, r, bias: residual_add(x, r, bias, rate=0.3, key=KEY),
                 lambda x, r, bias: x + jnp.where(keep, (r + bias) / 0.7, 0.0), (x, r, bias))
    else:
        w = _rand(9, (40, 6), 0.3)
        cases = (lambda x, w, bias: ops.bias_add(ops.dense(x, w), bias[:6]),
                 lambda x, w, bias: jnp.matmul(x, w, precision=hi) + bias[:6], (x, w, bias))
    _assert_pullback_derivatives(*cases)
    # The first log line names the derivative (its reference's own ops follow it, as
    # references), after the fused attention's line where it takes the unfused path (float32
    # on a GPU: the unfused path's softmax_dropout then names it).
    unfused = _attn._fused_unsupported(cases[2][0]) if op in ("attention_fused", "attention_packed") else None
    lines = [reason for _, reason in fallback_log if reason != unfused]
    assert lines and "backward kernels" in lines[0], fallback_log


def test_stack_scan_pullback_differentiated():
    ws, x = _rand(0, (3, 8, 8), 0.3), _rand(1, (4, 8))
    g = 1.0 + _rand(2, (8,), 0.1)
    body = lambda c, h, w: (ops.layer_norm(jnp.tanh(h @ w), c, None), None)  # noqa: E731
    ref_body = lambda h, w: (reference_layer_norm(jnp.tanh(h @ w), g, None), None)  # noqa: E731
    _assert_pullback_derivatives(lambda x, ws: jaxsub.stack.scan(body, x, ws, g)[0],
                                 lambda x, ws: jax.lax.scan(ref_body, x, ws)[0], (x, ws))


def test_optimize_pullback_differentiated():
    p, x = _layer_params(), _rand(20, (2, 5, 8))
    fast = jaxsub.optimize(_jnp_layer)
    _assert_pullback_derivatives(lambda x: fast(p, x, KEY), lambda x: _jnp_layer(p, x, KEY), (x,))


def test_the_stacks_steps_run_the_rules_without_the_derivatives_wrappers():
    """Inside `jaxsub.stack.scan` the ops' rules run their kernels alone: the stack writes
    their results into its buffers by finding their custom calls in the step (a custom_jvp
    around them would hide them), and stores every residual of the step's pullback. The
    derivative of the stack's rules is the loop reference's (its own custom_vjp)."""
    from jaxsub import stack

    ws, x, bias = _rand(0, (3, 8, 8), 0.3), _rand(1, (4, 8)), _rand(2, (8,))
    body = lambda c, h, w: (ops.bias_gelu_dropout(h @ w, c, rate=0.2, key=KEY), None)  # noqa: E731
    wrappers = lambda f: str(jax.make_jaxpr(f)(x, ws[0])).count("custom_jvp_call")  # noqa: E731
    assert wrappers(lambda h, w: stack._pullback(body, bias, h, w, (True,))[3]) == 0
    # Outside a stack the rules' kernels are wrapped (forward and backward).
    assert wrappers(lambda h, w: jax.vjp(lambda h, w: body(bias, h, w)[0], h, w)[1](h)) == 2


@pytest.mark.parametrize("wrap", ["jit", "checkpoint", "scan"])
def test_second_derivatives_through_a_jitted_checkpointed_or_scanned_grad(wrap, fallback_log):
    """grad(jit(grad(f))), hessian(jit(f)) and the like: the inner grad runs the op's
    custom_vjp rules inside the traced body, and the outer derivative reaches their kernels'
    results; it is the reference's (the forward with the same dropout mask)."""
    x, g, b = _rand(0, (3, 24)), 1.0 + _rand(1, (24,), 0.1), _rand(2, (24,))
    fused = lambda x: jnp.sum(jnp.sin(ops.bias_gelu_dropout(ops.layer_norm(x, g, b), b, rate=0.2, key=KEY)))  # noqa

    def ref(x):  # the same function with the kernels' mask for x's shape
        keep = ops.dropout_mask(KEY, x.shape, 0.2)
        return jnp.sum(jnp.sin(reference_bias_gelu_dropout(reference_layer_norm(x, g, b), b, keep=keep, rate=0.2)))

    if wrap == "jit":
        inner = lambda f: jax.jit(jax.grad(f))  # noqa: E731
    elif wrap == "checkpoint":
        inner = lambda f: jax.checkpoint(jax.grad(f))  # noqa: E731
    else:
        inner = lambda f: (lambda x: jax.lax.scan(lambda c, _: (jax.grad(f)(c), None), x, None, length=2)[0])  # noqa
    outer = lambda f: jax.grad(lambda x: jnp.sum(inner(f)(x) ** 2))(x)  # noqa: E731
    np.testing.assert_allclose(outer(fused), outer(ref), rtol=1e-4, atol=1e-5)
    assert {op for op, _ in fallback_log} >= {"layer_norm", "bias_gelu_dropout"}
    if wrap == "jit":
        np.testing.assert_allclose(jax.hessian(jax.jit(fused))(x[:1]), jax.hessian(ref)(x[:1]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("wrap", ["jit", "checkpoint", "scan"])
def test_pullback_of_a_jitted_checkpointed_or_scanned_function(wrap):
    x, g, b = _rand(0, (3, 24)), 1.0 + _rand(1, (24,), 0.1), _rand(2, (24,))
    f = lambda x: jnp.tanh(ops.layer_norm(x, g, b))  # noqa: E731
    r = lambda x: jnp.tanh(reference_layer_norm(x, g, b))  # noqa: E731
    if wrap == "scan":
        w = lambda f: (lambda x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0])  # noqa: E731
    else:
        w = jax.jit if wrap == "jit" else jax.checkpoint
    _assert_pullback_derivatives(w(f), w(r), (x,))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_encoder_with_remat_pullback_differentiated(scan_layers):
    """nn.remat's layers are checkpointed: the pullback of the Encoder differentiated with
    respect to its cotangent (a probe found the unscanned form raising)."""
    encoder = jaxsub.flax.Encoder(num_layers=2, num_heads=2, mlp_dim=16, scan_layers=scan_layers, remat=True,
                                  dropout_rate=0.1, attention_dropout_rate=0.1)
    x = _rand(0, (2, 6, 8))
    params = encoder.init(jax.random.key(0), x, deterministic=True)
    f = lambda x: encoder.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})  # noqa: E731
    _, pull = jax.vjp(f, x)
    ct, t = _rand(1, x.shape), _rand(2, x.shape)
    # The pullback is linear in the cotangent: its JVP is itself at the tangent; and the
    # double-vjp trick gives f's JVP, compared with a finite difference.
    np.testing.assert_allclose(jax.jvp(pull, (ct,), (t,))[1][0], pull(t)[0], rtol=1e-5, atol=1e-6)
    jvp = jax.vjp(pull, ct)[1]((t,))[0]
    eps = 1e-3
    np.testing.assert_allclose(jvp, (f(x + eps * t) - f(x - eps * t)) / (2 * eps), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_wrappers_cost_no_memory_in_a_scan(checkpoint):
    """A `lax.scan` of layers of the ops under `jit(grad)`: the same temp bytes as with the
    rules' kernels unwrapped (`unwrapped_rules`, as in `jaxsub.stack.scan`). The
    residuals that are arguments must leave the forward rule's custom_jvp as the arguments
    themselves, or the scan stacks them as computed values (a first version did: +0.5%)."""
    from jaxsub import _ffi

    b, s, e, h = 2, 8, 16, 2
    ks = jax.random.split(KEY, 8)
    x = _rand(0, (b, s, e))
    p = dict(w=_rand(1, (3, e, 3, h, e // h), 0.2), bqkv=_rand(2, (3, 3, h, e // h), 0.1), wo=_rand(3, (3, e, e), 0.2),
             bo=_rand(4, (3, e)), g=1.0 + _rand(5, (3, e), 0.1), beta=_rand(6, (3, e)))

    def layer(c, p):
        a = ops.dense_attention_packed(c, p["w"], p["bqkv"], dropout_rate=0.1, key=ks[0]).reshape(b, s, e)
        y = ops.bias_dropout_residual_layer_norm(a @ p["wo"], p["bo"], c, p["g"], p["beta"], rate=0.1, key=ks[1])
        f = ops.bias_gelu_dropout(y, p["bo"], rate=0.1, key=ks[2])
        return ops.layer_norm(residual_add(y, f, p["bo"], rate=0.1, key=ks[3]), p["g"], p["beta"]), None

    step = jax.checkpoint(layer) if checkpoint else layer
    loss = lambda p, x: jnp.sum(jax.lax.scan(step, x, p)[0] ** 2)  # noqa: E731
    temp = lambda: jax.jit(jax.grad(loss)).lower(p, x).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
    wrapped = temp()
    with _ffi.unwrapped_rules():
        plain = temp()
    assert wrapped == plain
