"""jaxsub.optimize / jaxsub.explain: the jaxpr pass on CPU. Here: layer norm from every
source, near-misses, and the API; test_optimize_dropout.py has the hand-written BDRLN,
GELU and dropout patterns, test_optimize_blocks.py the flax.linen blocks and the stacks,
test_optimize_attention.py attention (helpers: optimize_helpers.py).

Each source (hand-written jnp, flax.linen, flax.nnx) is optimized and compared with the
original: deterministic outputs and gradients within the jaxsub.testing tolerance, the
expected number of each fused target in the lowered HLO, and explain()'s report. With
dropout, the fused kernels draw different bits, so statistics and the mask itself (the
fused op's mask for the key the user's code used) are checked instead.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsub
from jaxsub.rewrite import match_norm
from jaxsub.testing import assert_close
from optimize_helpers import N, assert_same, expect, ln_two_pass, normal, target_counts


# ---------------------------------------------------------------------------------------
# Layer norm from every source.


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
    args = (normal(0, (6, N), dtype), normal(1, (N,)), normal(2, (N,)))
    assert_same(fn, args, dtype, argnums=(0, 1, 2))
    expect(fn, args, layer_norm=1)
    assert jaxsub.explain(fn, *args).totals == {"layer_norm": 1}


def test_explain_says_when_the_variance_formula_changes():
    """jax.nn.standardize's variance E[x^2] - mean^2 is computed two-pass by the kernels: the
    same function, exact where the original cancels (mean 100, spread 3e-3: the f32 original
    is off by ~1e4, the fused op by ~1e-3; found by probing). explain says so."""
    args = (normal(0, (6, N)), normal(1, (N,)), normal(2, (N,)))
    assert "taken as E[(x - mean)^2]" in str(jaxsub.explain(ln_fast_upcast, *args))
    assert "taken as" not in str(jaxsub.explain(ln_two_pass, *args))
    standardize = lambda x: jax.nn.standardize(x, axis=-1, epsilon=1e-5)  # noqa: E731
    assert "taken as E[(x - mean)^2]" in str(jaxsub.explain(standardize, args[0]))
    assert_same(standardize, args[:1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_jnp_var_layer_norm_in_every_dtype(dtype):
    """jnp.var of a 16-bit x squares the upcast x's deviations from its own f32 mean and
    rounds the variance back; the matcher took only jnp.mean's round trip, so this layer
    norm was fused in f32 alone, with no near-miss (found by probing)."""
    def ln(x, g, b):
        mu = jnp.mean(x, -1, keepdims=True)
        return (x - mu) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * g + b

    args = (normal(0, (6, N), dtype), normal(1, (N,), dtype), normal(2, (N,), dtype))
    assert jaxsub.explain(ln, *args).totals == {"layer_norm": 1}
    assert_same(ln, args, dtype, argnums=(0, 1, 2))


def test_layer_norm_without_parameters():
    x = normal(0, (2, 3, N))
    assert_same(ln_no_params, (x,))
    expect(ln_no_params, (x,), layer_norm=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_flax_linen_layer_norm(dtype):
    m = nn.LayerNorm(dtype=dtype, param_dtype=jnp.float32)
    x = normal(0, (6, N), dtype)
    params = m.init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: p + normal(3, p.shape), params)
    assert_same(m.apply, (params, x), dtype, argnums=(0, 1))
    expect(m.apply, (params, x), layer_norm=1)


def test_flax_nnx_layer_norm():
    layer = nnx.LayerNorm(N, rngs=nnx.Rngs(0))
    x = normal(0, (6, N))
    assert_same(lambda x: layer(x), (x,))
    expect(lambda x: layer(x), (x,), layer_norm=1)


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
    x = normal(0, (4, N))
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
    x, w = normal(0, (2, 8, N)), normal(1, (N, N)) * 0.1
    s, b, key = normal(2, (N,)), normal(3, (N,)), jax.random.key(4)

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

    x, s, b = normal(0, (6, N)), normal(1, (N,)), normal(2, (N,))
    cases = [(other_axis, (x,), "axes (0,)"), (normalized_escapes, (x, s, b), "returned as an output"),
             (residual_read_first, (x, b, x + 1, s, b), "residual sum")]
    for fn, args, reason in cases:
        report = jaxsub.explain(fn, *args)
        assert any(reason in m.detail for m in report.near_misses), (fn.__name__, str(report))
        out, ref = jaxsub.optimize(fn)(*args), fn(*args)
        for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            assert_close(o, r, reduction=N)
    expect(other_axis, (x,))
    # The normalized value is an output: the parameter-free layer norm producing it is
    # fused, the scale and bias stay outside.
    expect(normalized_escapes, (x, s, b), layer_norm=1)
    # The residual sum is needed before the layer norm, so only the layer norm itself is fused.
    expect(residual_read_first, (x, b, x + 1, s, b), layer_norm=1)
    # The mean returned here is a separate computation (no CSE in jaxprs): still a match.
    expect(mean_escapes, (x, s, b), layer_norm=1)


def test_pre_ln_block_hands_on_its_input_and_the_residual_sum(monkeypatch):
    """A pre-LN block: x feeds its layer norm and the first residual; the residual sum h
    feeds the second layer norm and the output (here also as an output of its own). Both
    layer norms are fused, each handing on the value it read (ops.norm.layer_norm_and_input,
    ops.norm.bdrln_and_sum), so the gradients of x's and h's other readers are added in the
    backward kernels: the gradient program has fewer [R, N] adds than with the hand-ons off
    (where the residual sum is a near-miss and x's gradients meet in an XLA add)."""
    w = normal(3, (N, N)) / np.sqrt(N)

    def block(x, b, s1, b1, s2, b2):
        a = ln_two_pass(x, s1, b1)
        h = x + (a @ w + b)
        return ln_two_pass(h, s2, b2) * 2.0 + h

    def block_and_sum(x, b, s1, b1, s2, b2):
        a = ln_two_pass(x, s1, b1)
        h = x + (a @ w + b)
        return ln_two_pass(h, s2, b2), h

    args = (normal(0, (6, N)), normal(1, (N,)), normal(2, (N,)), normal(4, (N,)), normal(5, (N,)),
            normal(6, (N,)))
    assert_same(block, args, argnums=tuple(range(6)), reduction=2 * N)
    expect(block, args, layer_norm=1, bdrln=1)
    expect(block_and_sum, args, layer_norm=1, bdrln=1)
    report = str(jaxsub.explain(block, *args))
    assert "residual sum written too" in report and "x handed on" in report, report

    def adds(f):
        grad = jax.grad(lambda *a: jnp.sum(jnp.square(f(*a))), argnums=tuple(range(6)))
        text = jax.jit(grad).lower(*args).as_text()
        return sum(1 for line in text.splitlines() if "stablehlo.add" in line and f"6x{N}xf32" in line)

    handing_on = adds(jaxsub.optimize(block))
    monkeypatch.setattr(match_norm, "read_after", lambda *a, **k: None)
    expect(block, args, layer_norm=2)
    assert handing_on + 2 <= adds(jaxsub.optimize(block))


def test_shared_mean_is_a_near_miss():
    def shared(x, s, b):
        m = jnp.mean(x, -1, keepdims=True)
        v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b, m

    args = (normal(0, (6, N)), normal(1, (N,)), normal(2, (N,)))
    report = jaxsub.explain(shared, *args)
    assert report.matches == [] and "mean" in report.near_misses[0].detail
    assert "returned as an output" in report.near_misses[0].detail
    expect(shared, args)


# ---------------------------------------------------------------------------------------
# API: composition, pytrees, options, explain's report.


def test_composes_with_jit_grad_vmap_and_keeps_pytrees():
    @jaxsub.optimize
    def f(inputs, params):
        y = ln_two_pass(inputs["x"], params[0], params[1])
        return {"y": y, "aux": (inputs["x"].sum(),)}

    inputs, params = {"x": normal(0, (6, N))}, (normal(1, (N,)), normal(2, (N,)))
    out = jax.jit(f)(inputs, params)
    assert set(out) == {"y", "aux"} and isinstance(out["aux"], tuple)
    assert_close(out["y"], ln_two_pass(inputs["x"], *params), reduction=N)
    batched = jax.vmap(f, in_axes=({"x": 0}, None))({"x": normal(3, (4, 6, N))}, params)
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
    x, s, b = normal(0, (2, 7, 24)), normal(1, (24,)), normal(2, (24,))

    def scaled(x, t):
        return x * (t + 1.0)

    def loss(x):
        return jnp.sum(x) + jnp.mean(x)

    def loop(x, s, b):
        return jax.lax.fori_loop(0, 3, lambda i, h: ln_two_pass(h, s, b) * (1.0 + i), x)

    assert_close(jaxsub.optimize(scaled)(x, jnp.float32(0.5)), scaled(x, jnp.float32(0.5)))
    assert_close(jaxsub.optimize(loss)(x), loss(x), reduction=x.size)
    assert jaxsub.explain(loop, x, s, b).totals == {"layer_norm": 1}
    assert_same(loop, (x, s, b), argnums=(0, 1, 2), reduction=24)


def test_closing_over_traced_values():
    """A function optimized inside an outer jit or grad that closes over the outer
    function's traced values: they are constants of the traced jaxpr whose values are
    tracers, never folded or read as masks (a TracerArrayConversionError before)."""
    x = normal(0, (2, 3))
    ref = lambda t: jnp.sum(x * (t * 2.0))  # noqa: E731
    opt = lambda t: jnp.sum(jaxsub.optimize(lambda x: x * (t * 2.0))(x))  # noqa: E731
    t = jnp.float32(0.5)
    assert_close(jax.jit(opt)(t), jax.jit(ref)(t))
    assert_close(jax.grad(opt)(t), jax.grad(ref)(t))

    q, k, v = (normal(i, (2, 7, 3, 24)) for i in (3, 4, 5))
    visible = normal(6, (7, 7)) > 0

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

    assert target_counts(f, normal(0, (2, N)))["jaxsub_layer_norm_fwd"] == 1
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

    args = (normal(0, (4, N)), normal(1, (N, N)) * 0.1, normal(2, (N,)), normal(3, (N,)), normal(4, (N,)))
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

    x, ws = normal(0, (4, N)), normal(1, (3, N, N)) * 0.1
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

    x = normal(3, (4, N))
    for eps in (1e-5, 1e-1):  # two instances, two traces
        want = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + eps)
        assert_close(Block(eps).norm(x), want, what=str(eps))
    assert target_counts(Block(1e-5).norm, x)["jaxsub_layer_norm_fwd"] == 1
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
    assert_same(f, (p, x), argnums=(0, 1), reduction=4 * e)


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
        Block(jnp.ones(N))(normal(3, (4, N)))


def test_entry_points_name_a_bad_argument():
    """Found by probing: explain and stack.scan of something not callable raised Python's
    bare "'int' object is not callable"; a flag given as a string ("no") counted as True."""
    x = normal(3, (4, N))
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

    x = normal(5, (3, N))
    opt = jaxsub.optimize(ln_no_params)
    want = opt(x)
    for again in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert_close(again(x), want, what="copy")
        assert target_counts(again, x)["jaxsub_layer_norm_fwd"] == 1


def test_explain_report_lists_matches_with_source():
    args = (normal(0, (6, N)), normal(1, (N,)), normal(2, (N,)))
    text = str(jaxsub.explain(ln_two_pass, *args))
    assert "layer_norm" in text and "float32[6, 32]" in text and "eps=1e-05" in text
    assert "optimize_helpers.py" in text and "ln_two_pass" in text
    assert "Totals: layer_norm x1" in text


def test_dead_code_is_neither_matched_nor_counted():
    """Found by probing: explain listed a layer norm whose result the function never
    returned (jit drops it; the compiled program had no call for it). A layer norm read
    only by an effect (a debug callback) stays, as it does under jit."""
    x, s, b = normal(0, (6, N)), normal(1, (N,)), normal(2, (N,))

    def dead(x, s, b):
        ln_two_pass(x, s, b)
        return x * 2

    def printed(x, s, b):
        jax.debug.callback(lambda y: None, ln_two_pass(x, s, b))
        return x * 2

    assert not jaxsub.explain(dead, x, s, b).matches
    assert_close(jaxsub.optimize(dead)(x, s, b), x * 2, what="dead")
    assert jaxsub.explain(printed, x, s, b).totals == {"layer_norm": 1}
    assert target_counts(jaxsub.optimize(printed), x, s, b)["jaxsub_layer_norm_fwd"] == 1


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
