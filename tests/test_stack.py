"""jaxsub.stack.scan: lax.scan's values and gradients, with each step's residuals in
buffers allocated once (uninitialized on GPU) instead of zero-filled stacked outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import jaxsub
from jaxsub import ops, stack
from jaxsub.testing import assert_close

L, N = 5, 7


def _body(c, h, x):
    """A layer with a parameter slice, a per-layer key, a float and a bool constant,
    a pytree carry and a pytree output per step."""
    y = jnp.tanh(h["a"] @ x["w"] + x["b"]) * c["s"]
    keep = jax.random.bernoulli(x["key"], 0.8, y.shape)
    a = jnp.where(c["m"], y * keep, h["a"])
    return {"a": a, "n": h["n"] + jnp.sum(a)}, {"y": jnp.sin(a), "z": a.sum(0)}


def _inputs(seed):
    r = np.random.default_rng(seed)
    xs = {"w": jnp.asarray(r.standard_normal((L, N, N)) / 3, jnp.float32),
          "b": jnp.asarray(r.standard_normal((L, N)), jnp.float32),
          "key": jax.random.split(jax.random.key(seed), L)}
    c = {"s": jnp.float32(1.3), "m": jnp.asarray(r.random(N) > 0.3)}
    h = {"a": jnp.asarray(r.standard_normal((4, N)), jnp.float32), "n": jnp.float32(0.5)}
    return c, h, xs


def _loss(scan_fn):
    def loss(c, h, xs):
        (carry, ys) = scan_fn(c, h, xs)
        return jnp.sum(carry["a"] ** 2) + carry["n"] + jnp.sum(ys["y"] ** 3) + jnp.sum(jnp.cos(ys["z"]))
    return loss


def _pair(reverse, unroll=1):
    ours = lambda c, h, xs: stack.scan(_body, h, xs, c, reverse=reverse, unroll=unroll)  # noqa: E731
    ref = lambda c, h, xs: lax.scan(lambda h, x: _body(c, h, x), h, xs, reverse=reverse)  # noqa: E731
    return ours, ref


def _assert_tree_close(got, want, what, grad=False):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        if jnp.issubdtype(a.dtype, jnp.inexact):
            assert_close(a, b, reduction=N * L, grad=grad, what=f"{what}{jax.tree_util.keystr(path)}")
        else:
            assert a.dtype == b.dtype, what


def _assert_matches_lax_scan(body, c, h, xs, loss_of):
    """stack.scan(body, h, xs, c): the loss loss_of((carry, ys)) and its gradients with
    respect to c, h and xs equal lax.scan's."""
    def loss(scan_fn):
        return lambda c, h, xs: loss_of(scan_fn(c, h, xs))

    ours = lambda c, h, xs: stack.scan(body, h, xs, c)  # noqa: E731
    ref = lambda c, h, xs: lax.scan(lambda h, x: body(c, h, x), h, xs)  # noqa: E731
    got = jax.jit(jax.value_and_grad(loss(ours), argnums=(0, 1, 2)))(c, h, xs)
    want = jax.jit(jax.value_and_grad(loss(ref), argnums=(0, 1, 2)))(c, h, xs)
    assert_close(got[0], want[0], reduction=N * L, what="loss")
    _assert_tree_close(got[1], want[1], "grad", grad=True)


@pytest.mark.parametrize("unroll", [1, 2, 5])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_values_and_gradients_match_lax_scan(reverse, unroll):
    """Also with several steps per loop iteration (L = 5: two of 2 and a remainder, or
    all five in one)."""
    c, h, xs = _inputs(seed=3 + reverse)
    ours, ref = _pair(reverse, unroll)
    _assert_tree_close(jax.jit(ours)(c, h, xs), ref(c, h, xs), "value")
    grad = lambda f: jax.jit(jax.grad(_loss(f), argnums=(0, 1, 2), allow_int=True))  # noqa: E731
    got, want = grad(ours)(c, h, xs), grad(ref)(c, h, xs)
    _assert_tree_close(got, want, "grad", grad=True)
    assert float(jnp.abs(got[2]["w"]).max()) > 0  # the parameters' gradients are not all zero


def test_vmap_of_the_gradient():
    c, h, xs = _inputs(seed=5)
    hb = jax.tree.map(lambda a: jnp.stack([a, 2 * a, -a]), h)
    ours, ref = _pair(False)
    g = lambda f: jax.vmap(jax.grad(_loss(f), argnums=(1, 2), allow_int=True), in_axes=(None, 0, None))  # noqa: E731
    _assert_tree_close(g(ours)(c, hb, xs), g(ref)(c, hb, xs), "vmap grad", grad=True)


def test_check_grads():
    c, h, xs = _inputs(seed=6)
    f = lambda a, w: _loss(_pair(False)[0])(c, {"a": a, "n": h["n"]}, {**xs, "w": w})  # noqa: E731
    check_grads(f, (h["a"], xs["w"]), order=1, modes=["rev"], atol=5e-2, rtol=5e-2, eps=1e-2)


def test_inputs_are_not_stored_as_residuals():
    """The parameter slice and the constant the pullback needs come back as inputs, and
    the input carry it needs ("a", not "n") is held in a stack the steps read and write
    (`_Plan.held`); the stored residuals are the values the step computed."""
    c, h, xs = _inputs(seed=7)
    plan = stack._plan(_body, c, h, xs, L, False)
    x_leaves = jax.tree.leaves(jax.tree.map(lambda a: a[0], xs))
    w = next(j for j, a in enumerate(x_leaves) if a.shape == (N, N))
    assert ("x", w) in plan.sources
    assert all(s.shape != (N, N) for s in plan.stored)
    assert plan.held == (0,) and ("carry", 0) in plan.sources


def test_no_zero_filled_stacks_on_gpu():
    """Lowered for a GPU (no GPU needed to lower): lax.scan's gradient zero-fills its
    stacked residuals (broadcasts of [L, ...] zeros); ours allocates them with
    AllocateBuffer and broadcasts nothing of that size."""
    c, h, xs = _inputs(seed=8)
    ours, ref = _pair(False)

    def lowered(f):
        step = jax.jit(jax.grad(_loss(f), argnums=(1, 2), allow_int=True))
        return step.trace(c, h, xs).lower(lowering_platforms=("cuda",)).as_text()

    def zero_filled(text):
        found = []
        for func in text.split("func.func")[1:]:  # SSA names are local to a function
            lines = func.splitlines()
            zeros = {ln.split()[0] for ln in lines if "stablehlo.constant dense<0.000000e+00>" in ln}
            found += [ln for ln in lines if "broadcast_in_dim" in ln and f"-> tensor<{L}x4x{N}xf32>" in ln
                      and ln.split()[3].rstrip(",") in zeros]
        return found

    assert zero_filled(lowered(ref)), "lax.scan's gradient should zero-fill its residual stack"
    text = lowered(ours)
    assert not zero_filled(text)
    assert text.count("@AllocateBuffer") >= 3


def _fused_body(c, h, x):
    """A layer of jaxsub ops: the GEMM's result is the GELU op's stored input, the GELU's
    result the next product's, the layer norm's statistics are its stored results."""
    y = ops.dense(h, x["w1"])
    g = ops.bias_gelu_dropout(y, x["b"], rate=0.0, key=None)
    return ops.layer_norm(h + g @ x["w2"] * c, x["s"], x["lb"]), g.sum(-1)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_fused_results_written_into_their_stacks_as_they_are_made(monkeypatch, reverse):
    """A residual or a parameter gradient that is a jaxsub custom call's result (as it
    is, reshaped, or behind the call's optimization barrier) is written into its stack
    right after the call, and the rest of the step reads it back from there (`_early`;
    with every residual stored alone here): the same values and gradients as lax.scan."""
    monkeypatch.setattr(stack, "_SMALL", 0)
    found, early = [], stack._early
    monkeypatch.setattr(stack, "_early", lambda jaxpr, wanted: found.append(early(jaxpr, wanted)) or found[-1])
    r = np.random.default_rng(11)
    xs = {"w1": jnp.asarray(r.standard_normal((L, N, 2 * N)) / 3, jnp.float32),
          "b": jnp.asarray(r.standard_normal((L, 2 * N)), jnp.float32),
          "w2": jnp.asarray(r.standard_normal((L, 2 * N, N)) / 4, jnp.float32),
          "s": jnp.asarray(r.standard_normal((L, N)), jnp.float32),
          "lb": jnp.asarray(r.standard_normal((L, N)), jnp.float32)}
    c, h = jnp.float32(0.7), jnp.asarray(r.standard_normal((3, 4, N)), jnp.float32)

    def loss(scan_fn):
        return lambda c, h, xs: jnp.sum(jnp.sin(scan_fn(c, h, xs)[0])) + jnp.sum(scan_fn(c, h, xs)[1] ** 2)

    ours = lambda c, h, xs: stack.scan(_fused_body, h, xs, c, reverse=reverse)  # noqa: E731
    ref = lambda c, h, xs: lax.scan(lambda h, x: _fused_body(c, h, x), h, xs, reverse=reverse)  # noqa: E731
    got = jax.jit(jax.value_and_grad(loss(ours), argnums=(0, 1, 2)))(c, h, xs)
    want = jax.jit(jax.value_and_grad(loss(ref), argnums=(0, 1, 2)))(c, h, xs)
    assert_close(got[0], want[0], reduction=N * L, what="loss")
    _assert_tree_close(got[1], want[1], "grad", grad=True)
    (forward, fwd_through), (backward, bwd_through) = found[0], found[-1]
    plan = stack._plan(_fused_body, c, h, xs, L, reverse)
    shapes = sorted(plan.stored[plan.alone[k]].shape for k in forward.values() if k < len(plan.alone))
    # the layer norm's two row statistics, the GEMM's and the GELU's results
    assert shapes == [(3, 4), (3, 4), (3, 4, 2 * N), (3, 4, 2 * N)], shapes
    # and the layer norm's output, the next step's input carry, which the GEMM keeps
    assert plan.held == (0,) and len(plan.alone) in forward.values()
    assert len(fwd_through) == 3  # the three calls' barriers
    # the gradients of w1 (the GEMM's), b (the GELU's), s and lb (the layer norm's), not
    # w2's (XLA's product)
    names = sorted(xs)
    assert sorted(names[k] for k in backward.values()) == ["b", "lb", "s", "w1"]
    assert bwd_through


def test_a_residual_stored_once_when_two_are_views_of_it():
    """Two residuals holding the same elements (a value and that value transposed twice,
    reshaped, behind a barrier) share one buffer: the plan keeps one (`_Plan.same`), and
    values and gradients match lax.scan. (y is a residual through y * h, whose gradient
    in h reads it: jax 0.11 keeps 1 - tanh² rather than tanh's output for tanh itself.)"""
    def body(c, h, x):
        y = jnp.tanh(h @ x["w"])
        z = lax.optimization_barrier(y.T.T.reshape(2, -1, N))  # the same elements as y
        return y * h * c, jnp.sum(z @ x["w"])

    r = np.random.default_rng(13)
    xs = {"w": jnp.asarray(r.standard_normal((L, N, N)) / 3, jnp.float32)}
    c, h = jnp.float32(0.9), jnp.asarray(r.standard_normal((6, N)), jnp.float32)
    plan = stack._plan(body, c, h, xs, L, False)
    assert len(plan.same) == 1, plan.same
    j, i = plan.same[0]
    assert plan.stored[j].shape == (2, 3, N) and plan.stored[i].shape == (6, N)
    assert len(plan.buffers()) == len(plan.stored) - 1 - sum(len(g) - 1 for g in plan.groups)

    _assert_matches_lax_scan(body, c, h, xs, lambda out: jnp.sum(out[0] ** 2) + jnp.sum(out[1]))

    def transposed(c, h, x):  # y and y transposed once: not the same elements in order
        y = jnp.tanh(h @ x["w"])
        return y * h * c, jnp.sum(x["w"] @ y.T)

    assert stack._plan(transposed, c, h, xs, L, False).same == ()


def test_consts_the_program_does_not_differentiate_are_constants_to_the_step(fallback_log):
    """An additive attention mask in consts: where the program differentiates it, its
    gradient equals lax.scan's; where it does not (a padding mask), no step computes one
    (attention would take it from the reference, with a log line) and the loop carries none."""
    b, s, h, d = 2, 6, 2, 8
    rng = np.random.default_rng(17)
    x0 = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((3, d, d)) * 0.3, jnp.float32)
    mask = jnp.asarray(rng.standard_normal((h, s, s)), jnp.float32)

    def body(mask, x, w):
        y = jaxsub.ops.attention(x, x, x @ w, mask=mask, implementation="fused")
        return jnp.tanh(y), None

    def loss(scan_fn):
        return lambda mask, ws: jnp.sum(scan_fn(mask, ws) ** 2)

    ours = lambda mask, ws: stack.scan(body, x0, ws, mask)[0]  # noqa: E731
    ref = lambda mask, ws: lax.scan(lambda x, w: body(mask, x, w), x0, ws)[0]  # noqa: E731
    got = jax.jit(jax.grad(loss(ours), argnums=1))(mask, ws)
    assert not fallback_log
    assert "while" in jax.jit(jax.grad(loss(ours), argnums=1)).lower(mask, ws).as_text()
    want = jax.jit(jax.grad(loss(ref), argnums=1))(mask, ws)
    assert_close(got, want, reduction=N * L, grad=True, what="dws")
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(mask, ws)
    assert fallback_log and "additive mask" in fallback_log[0][1]
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(mask, ws)
    assert np.abs(np.asarray(want[0])).max() > 0
    for g, w, what in zip(got, want, ("dmask", "dws")):
        assert_close(g, w, reduction=N * L, grad=True, what=what)


def test_body_closing_over_traced_values_matches_lax_scan():
    """A body that closes over an enclosing function's arguments (a float under grad, an
    int under jit) gives lax.scan's value and gradient (the float was a tracer escaping
    the custom_vjp: JAX's UnexpectedTracerError under grad)."""
    x0 = jnp.asarray(np.random.default_rng(3).standard_normal((2, N)), jnp.float32)
    ws = jnp.asarray(np.random.default_rng(4).standard_normal((L, N)), jnp.float32)

    def loss(scan_fn):
        def f(t, n):
            body = lambda h, w: (jnp.sin(h * t + w) * n, jnp.sum(h) * t)  # noqa: E731
            carry, ys = scan_fn(body)
            return jnp.sum(carry ** 2) + jnp.sum(ys)
        return f

    ours = loss(lambda body: stack.scan(lambda c, h, w: body(h, w), x0, ws))
    ref = loss(lambda body: lax.scan(body, x0, ws))
    for fn in (jax.jit, lambda f: f):
        assert_close(fn(ours)(1.3, 2), fn(ref)(1.3, 2), reduction=N * L, what="value")
        assert_close(fn(jax.grad(ours))(1.3, 2), fn(jax.grad(ref))(1.3, 2), reduction=N * L, grad=True, what="dt")
    assert "while" in jax.jit(jax.grad(ours)).lower(1.3, 2).as_text()


def test_config_block_holds_under_checkpoint():
    """Under jax.checkpoint the rules trace the body after scan has returned, outside the
    caller's `ops.config.use` block (optimize's layouts): the body runs under the block
    scan was called in, so its ops choose as the plan did (a RuntimeError about other
    residuals before)."""
    from jaxsub.ops import config

    h = jnp.asarray(np.random.default_rng(5).standard_normal((2, 4, 2, 8)), jnp.float32)
    ws = jnp.asarray([1.0, 0.7], jnp.float32)
    body = lambda c, h, w: (h + jaxsub.ops.attention(h * w, h, h), None)  # noqa: E731 - implementation=None

    def f(h, ws):
        with config.use({"attention": {"impl": "fused"}}):
            return jnp.sum(stack.scan(body, h, ws)[0] ** 2)

    want = jax.grad(f)(h, ws)
    assert_close(jax.grad(jax.checkpoint(f))(h, ws), want, reduction=N * L, grad=True, what="dh")


def test_no_gradient_is_plain_lax_scan():
    c, h, xs = _inputs(seed=9)
    ours, ref = _pair(False)
    assert "AllocateBuffer" not in jax.jit(ours).trace(c, h, xs).lower(lowering_platforms=("cuda",)).as_text()
    np.testing.assert_array_equal(np.asarray(jax.jit(ours)(c, h, xs)[0]["a"]), np.asarray(jax.jit(ref)(c, h, xs)[0]["a"]))


def test_length_without_xs():
    def body(c, h, x):
        return h * c + 1.0, h
    got = stack.scan(body, jnp.float32(1.0), None, jnp.float32(2.0), length=4)
    want = lax.scan(lambda h, x: body(2.0, h, x), jnp.float32(1.0), None, length=4)
    _assert_tree_close(got, want, "value")
    g = jax.grad(lambda c: stack.scan(body, jnp.float32(1.0), None, c, length=4)[1].sum())(jnp.float32(2.0))
    assert_close(g, jax.grad(lambda c: lax.scan(lambda h, x: body(c, h, x), 1.0, None, length=4)[1].sum())(2.0),
                 what="dconst")


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "raw"])
def test_prng_key_in_the_carry(typed):
    """The `key, sub = split(key)` idiom with the key in the carry: a typed key raised
    "Cannot interpret 'key<fry>' as a data type" (probe round 10), with or without a
    gradient."""
    w = jax.random.normal(jax.random.key(0), (4, 6, 6)) * 0.3
    h0 = jax.random.normal(jax.random.key(2), (3, 6))
    k0 = jax.random.key(4) if typed else jax.random.PRNGKey(4)

    def body(c, carry, x):
        h, k = carry
        k, sub = jax.random.split(k)
        return (jnp.tanh(h @ x) + 0.1 * jax.random.normal(sub, h.shape), k), h.sum()

    run = lambda scan: lambda w: scan((h0, k0), w)  # noqa: E731
    ours = run(lambda c, w: stack.scan(body, c, w))
    ref = run(lambda c, w: lax.scan(lambda c, x: body(None, c, x), c, w))
    got, want = ours(w), ref(w)
    _assert_tree_close((got[0][0], got[1]), (want[0][0], want[1]), "value")
    np.testing.assert_array_equal(jax.random.key_data(got[0][1]), jax.random.key_data(want[0][1]))
    loss = lambda f: lambda w: f(w)[0][0].sum() + f(w)[1].sum()  # noqa: E731
    _assert_tree_close(jax.grad(loss(ours))(w), jax.grad(loss(ref))(w), "gradient")


def test_zero_steps_differentiate_as_lax_scan():
    """Found by probing: with no step (xs of length 0, or length=0) the forward ran but
    the gradient raised from a slice of the empty residual stacks."""
    w, c0 = jnp.zeros((0, 4, 4)), jnp.ones((3, 4))
    body = lambda k, h, x: (jnp.tanh(h @ x), h.sum())  # noqa: E731
    loss = lambda scan: lambda c, w: scan(c, w)[0].sum() + scan(c, w)[1].sum()  # noqa: E731
    got = jax.grad(loss(lambda c, w: stack.scan(body, c, w)), argnums=(0, 1))(c0, w)
    want = jax.grad(loss(lambda c, w: lax.scan(lambda h, x: body(None, h, x), c, w)), argnums=(0, 1))(c0, w)
    _assert_tree_close(got, want, "xs of length 0")
    g = jax.grad(lambda c: stack.scan(lambda k, h, x: (jnp.tanh(h), None), c, None, length=0)[0].sum())(c0)
    np.testing.assert_array_equal(np.asarray(g), np.ones((3, 4)))


def test_bad_input():
    c, h, xs = _inputs(seed=10)
    with pytest.raises(TypeError, match="jaxsub.stack.scan.*pair"):
        stack.scan(lambda c, h, x: h, h, xs, c)
    with pytest.raises(TypeError, match="jaxsub.stack.scan.*carry"):
        stack.scan(lambda c, h, x: ({"a": h["a"][:1], "n": h["n"]}, None), h, xs, c)
    with pytest.raises(ValueError, match="jaxsub.stack.scan.*leading"):
        stack.scan(_body, h, {**xs, "b": xs["b"][:2]}, c)
    with pytest.raises(ValueError, match="jaxsub.stack.scan.*length"):
        stack.scan(lambda c, h, x: (h, None), h, None, c)
    for unroll in (0, 1.5, True):
        with pytest.raises(ValueError, match="jaxsub.stack.scan.*unroll"):
            stack.scan(_body, h, xs, c, unroll=unroll)
    with pytest.raises(ValueError, match=r"leading size, got \['a scalar'\]"):  # "['None']" before
        stack.scan(lambda c, h, x: (h + x, None), 0.0, jnp.float32(1.0))


def test_small_residuals_share_a_buffer(monkeypatch):
    """Residuals up to stack._SMALL bytes share one buffer per dtype; the gradients are
    the same with and without sharing."""
    c, h, xs = _inputs(seed=11)
    plan = stack._plan(_body, c, h, xs, L, False)
    assert plan.groups and len(plan.buffers()) < len(plan.stored)
    assert all(len({plan.stored[j].dtype for j in g}) == 1 for g in plan.groups)
    grad = lambda: jax.jit(jax.grad(_loss(_pair(False)[0]), argnums=(1, 2), allow_int=True))(c, h, xs)  # noqa: E731
    shared = grad()
    monkeypatch.setattr(stack, "_SMALL", 0)
    assert not stack._plan(_body, c, h, xs, L, False).groups
    _assert_tree_close(shared, grad(), "grads, shared against separate buffers", grad=True)


def test_constant_residuals_and_jaxsub_results_are_not_packed():
    """A residual that is a constant (attention's placeholder for no mask, the seed of a
    dropout that is off) is kept as a value, not stored per step (`_Plan.fixed`); a small
    residual a jaxsub custom call makes (attention's log-sum-exp, the layer norm's row
    statistics) gets a buffer of its own, which the call writes itself (`_early`), rather
    than a share of a packed one. Values and gradients match lax.scan."""
    def body(c, h, x):
        q = (h @ x["w"]).reshape(2, 3, 1, N)
        a = ops.attention(q, q * c, q, implementation="fused").reshape(h.shape)
        g = ops.bias_gelu_dropout(a, x["b"], rate=0.0, key=None)
        return ops.layer_norm(h + g, x["s"], x["lb"]), None

    r = np.random.default_rng(13)
    xs = {"w": jnp.asarray(r.standard_normal((L, N, N)) / 3, jnp.float32),
          "b": jnp.asarray(r.standard_normal((L, N)), jnp.float32),
          "s": jnp.asarray(1 + r.standard_normal((L, N)) / 5, jnp.float32),
          "lb": jnp.asarray(r.standard_normal((L, N)), jnp.float32)}
    c, h = jnp.float32(0.8), jnp.asarray(r.standard_normal((6, N)), jnp.float32)
    plan = stack._plan(body, c, h, xs, L, False)
    fixed = {j: v for j, v in plan.fixed}
    # the placeholder mask, and the seed words of the dropouts that are off
    assert {(plan.stored[j].shape, str(plan.stored[j].dtype)) for j in fixed} == {((1, 1, 1, 1), "bool"),
                                                                                ((2,), "uint32")}
    for j, v in fixed.items():  # their values: no mask (all False), zero seed words
        np.testing.assert_array_equal(np.asarray(v), np.zeros(plan.stored[j].shape, plan.stored[j].dtype))
    made = [j for j, a in enumerate(plan.stored) if a.shape in ((2, 1, 3), (6,))]  # lse, the two statistics
    assert len(made) == 3 and set(made) <= set(plan.alone)
    assert all(j not in fixed for g in plan.groups for j in g)

    _assert_matches_lax_scan(body, c, h, xs, lambda out: jnp.sum(jnp.sin(out[0])))


def test_views_of_xs_are_made_again_not_stored():
    """A residual that is a slice or reshape of the step's x (an op's quarter of its
    layer's row of seed words; the lower rows of a weight) is made again from xs in the
    backward (`_Plan.views`), not stored; values and gradients match lax.scan."""
    from jaxsub.ops.dropout import Words

    def body(c, h, x):
        w = x["w"][: N - 2].reshape(N - 2, N)  # h * w keeps w: a slice of x["w"]
        g = ops.bias_gelu_dropout(h[:, : N - 2] @ w, x["b"], rate=0.3, key=Words(x["seeds"][4:8]))
        return h + g * c, None

    r = np.random.default_rng(14)
    xs = {"w": jnp.asarray(r.standard_normal((L, N, N)) / 3, jnp.float32),
          "b": jnp.asarray(r.standard_normal((L, N)), jnp.float32),
          "seeds": jnp.asarray(r.integers(0, 2**32, (L, 16)), jnp.uint32)}
    c, h = jnp.float32(0.8), jnp.asarray(r.standard_normal((6, N)), jnp.float32)
    plan = stack._plan(body, c, h, xs, L, False)
    viewed = {(plan.stored[j].shape, str(plan.stored[j].dtype)) for j, _, _ in plan.views}
    assert viewed == {((N - 2, N), "float32"), ((4,), "uint32")}, viewed
    assert all(a.dtype != jnp.uint32 and a.shape != (N - 2, N) for a in plan.buffers())

    def loss(scan_fn):
        return lambda c, h, xs: jnp.sum(jnp.sin(scan_fn(c, h, xs)[0]))

    ours = lambda c, h, xs: stack.scan(body, h, xs, c)  # noqa: E731
    ref = lambda c, h, xs: lax.scan(lambda h, x: body(c, h, x), h, xs)  # noqa: E731
    grad = lambda f: jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1, 2), allow_int=True))(c, h, xs)  # noqa: E731
    got, want = grad(ours), grad(ref)
    assert_close(got[0], want[0], reduction=N * L, what="loss")
    _assert_tree_close(got[1], want[1], "grad", grad=True)


def test_none_and_integer_leaves_anywhere_in_xs():
    """xs with None and integer leaves between the floating ones (as the Encoder's
    (params, None) without dropout): each gradient lands on its own leaf."""
    c, h, xs = _inputs(seed=12)
    xs2 = {"a": None, "b": xs["b"], "k": jnp.arange(L), "w": xs["w"], "key": xs["key"]}

    def body(c, h, x):
        return _body(c, h, {"w": x["w"], "b": x["b"] + x["k"][None].astype(jnp.float32), "key": x["key"]})

    ours = lambda c, h, xs: stack.scan(body, h, xs, c)  # noqa: E731
    ref = lambda c, h, xs: lax.scan(lambda h, x: body(c, h, x), h, xs)  # noqa: E731
    grad = lambda f: jax.jit(jax.grad(_loss(f), argnums=2, allow_int=True))(c, h, xs2)  # noqa: E731
    _assert_tree_close(grad(ours), grad(ref), "grad", grad=True)


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
@pytest.mark.parametrize("unroll", [1, 2])
def test_fused_results_written_in_place_on_gpu(unroll):
    """On the GPU, XLA's dynamic-slice fusion writes the GEMM's and the GELU's results
    (2 MiB per layer each, stored alone) straight into their residual stacks: each
    target's call sits inside a fusion together with a dynamic-update-slice, and the
    gradients match lax.scan's; also with two layers per loop iteration."""
    bf = jnp.bfloat16
    r = np.random.default_rng(12)
    n, f, rows = 256, 1024, 1024
    xs = {"w1": jnp.asarray(r.standard_normal((L, n, f)) / 16, bf), "b": jnp.asarray(r.standard_normal((L, f)), bf),
          "w2": jnp.asarray(r.standard_normal((L, f, n)) / 32, bf),
          "s": jnp.asarray(r.standard_normal((L, n)), bf), "lb": jnp.asarray(r.standard_normal((L, n)), bf)}
    c, h = jnp.asarray(0.7, bf), jnp.asarray(r.standard_normal((rows, n)), bf)

    def loss(scan_fn):
        return lambda h, xs: jnp.sum(scan_fn(c, h, xs)[0].astype(jnp.float32) ** 2)

    ours = lambda c, h, xs: stack.scan(_fused_body, h, xs, c, unroll=unroll)  # noqa: E731
    ref = lambda c, h, xs: lax.scan(lambda h, x: _fused_body(c, h, x), h, xs)  # noqa: E731
    step = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))
    got, want = step(h, xs), jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(h, xs)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert_close(a, b, bf, reduction=f, grad=True, what=f"grad{jax.tree_util.keystr(path)}")
    text = step.lower(h, xs).compile().as_text()
    fused = [comp for comp in text.split("\n\n") if "dynamic-slice-fusion" in comp.split("\n")[0]
             and " dynamic-update-slice(" in comp]
    for target in ("jaxsub_gemm", "jaxsub_bias_gelu_dropout_fwd"):
        assert any(f'custom_call_target="{target}"' in comp for comp in fused), target
