"""Layer norm and BDRLN: fused ops against their pure-JAX references (CPU by default;
`-m gpu` compares the CUDA kernels with the CPU handlers)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub import _ffi, ops
from jaxsub.ops import norm
from jaxsub.ops.norm import reference_bdrln, reference_layer_norm
from jaxsub.testing import assert_close

# (leading shape, columns): every column count of interest, under 1-D and 2-D leads and
# without one (a single row).
SHAPES = [((7,), 1), ((2, 3), 1), ((7,), 3), ((2, 3), 130), ((), 130), ((7,), 1000), ((2, 3), 4096)]
# (activation dtype, parameter dtype): parameters come in float32 or in the activation dtype.
DTYPE_PAIRS = [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
               (jnp.float16, jnp.float32), (jnp.float16, jnp.float16)]
LN = "layer_norm"
BDRLN = "bias_dropout_residual_layer_norm"
RATE = 0.1
ACTIVATIONS = ("x", "residual")


def _seed(*case):
    """A fresh, reproducible seed per test case."""
    return zlib.crc32(repr(case).encode())


def _inputs(seed, shape, dtype, pdtype):
    """Non-trivial activations (nonzero mean), parameters and output cotangent, drawn with
    NumPy so that making inputs compiles nothing."""
    n = shape[-1]
    rng = np.random.default_rng(seed)

    def normal(shape, dtype, mean=0.0, std=1.0):
        return jnp.asarray((mean + std * rng.standard_normal(shape, np.float32)).astype(dtype))

    return dict(
        x=normal(shape, dtype, 0.5, 2.0),
        residual=normal(shape, dtype),
        bias=normal((n,), pdtype, std=0.5),
        scale=normal((n,), pdtype, 1.0, 0.5),
        ln_bias=normal((n,), pdtype, std=0.5),
        dy=normal(shape, dtype),
        dropout_key=jax.random.key(seed),
    )


def _values_and_vjps(fs, args, dy):
    """[(y, input cotangents)] of each function in `fs` at `args` for the output cotangent
    `dy`, all in one compile."""

    @jax.jit
    def run(args, dy):
        results = []
        for f in fs:
            y, vjp = jax.vjp(f, *args)
            results.append((y, vjp(dy)))
        return results

    return run(args, dy)


def _fused_and_reference(op, inp, rate=RATE):
    """(fused function, reference function, primal args, their names) for one op; the
    reference gets the kernel's mask through dropout_mask."""
    if op == LN:
        args = (inp["x"], inp["scale"], inp["bias"])
        return ops.layer_norm, reference_layer_norm, args, ("x", "scale", "bias")
    key = inp["dropout_key"]
    args = (inp["x"], inp["bias"], inp["residual"], inp["scale"], inp["ln_bias"])

    def fused(*a):
        return ops.bias_dropout_residual_layer_norm(*a, rate=rate, key=key)

    def reference(*a):
        return reference_bdrln(*a, keep=ops.dropout_mask(key, a[0].shape, rate), rate=rate)

    return fused, reference, args, ("x", "bias", "residual", "scale", "ln_bias")


def _assert_matches(op, inp, rate=RATE):
    fused, reference, args, names = _fused_and_reference(op, inp, rate)
    x = inp["x"]
    n, rows = x.shape[-1], x.size // x.shape[-1]
    (y, grads), (y_ref, grads_ref) = _values_and_vjps((fused, reference), args, inp["dy"])
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, y_ref, x.dtype, reduction=n, what=f"{op} y")
    for name, a, g, g_ref in zip(names, args, grads, grads_ref):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        # Activation gradients reduce over a row; parameter gradients over the rows.
        reduction = n if name in ACTIVATIONS else rows
        assert_close(g, g_ref, a.dtype, reduction=reduction, grad=True, what=f"{op} d{name}")


def _hlo(f, *args):
    return jax.jit(f).lower(*args).as_text()


# ---------------------------------------------------------------------------------------
# Forward and VJP against the references.


@pytest.mark.parametrize("dtype,pdtype", DTYPE_PAIRS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("lead,n", SHAPES)
@pytest.mark.parametrize("op", [LN, BDRLN])
def test_matches_reference(op, lead, n, dtype, pdtype):
    _assert_matches(op, _inputs(_seed(op, lead, n, dtype, pdtype), lead + (n,), dtype, pdtype))


def test_layer_norm_params_may_be_none():
    inp = _inputs(_seed("none"), (5, 130), jnp.float32, jnp.float32)
    (y, (dx,)), (y_ref, (dx_ref,)) = _values_and_vjps(
        (lambda x: ops.layer_norm(x, None, None), lambda x: reference_layer_norm(x, None, None)), (inp["x"],),
        inp["dy"])
    assert_close(y, y_ref, reduction=130)
    assert_close(dx, dx_ref, reduction=130, grad=True)


def test_mixed_parameter_dtypes_get_gradients_in_their_own_dtype():
    inp = _inputs(_seed("mixed"), (4, 130), jnp.bfloat16, jnp.bfloat16)
    scale = inp["scale"].astype(jnp.float32)
    [(_, (dscale, dbias))] = _values_and_vjps([lambda s, b: ops.layer_norm(inp["x"], s, b)],
                                              (scale, inp["bias"]), inp["dy"])
    assert dscale.dtype == jnp.float32 and dbias.dtype == jnp.bfloat16


@pytest.mark.parametrize("op,rate", [(LN, 0.0), (BDRLN, 0.0), (BDRLN, 0.3)])
def test_check_grads_fp32(op, rate):
    inp = _inputs(_seed("check_grads", op, rate), (3, 5), jnp.float32, jnp.float32)
    fused, _, args, _ = _fused_and_reference(op, inp, rate)
    check_grads(fused, args, order=1, modes=["rev"])


# ---------------------------------------------------------------------------------------
# Composition: vmap, jit, and the targets in the lowered HLO.


def test_layer_norm_vmap_over_x_and_params():
    inp = _inputs(_seed("vmap-ln"), (4, 3, 130), jnp.float32, jnp.float32)
    x, scale, bias = inp["x"], inp["scale"], inp["bias"]
    layer_norm = jax.jit(ops.layer_norm)
    assert_close(jax.jit(jax.vmap(ops.layer_norm, in_axes=(0, None, None)))(x, scale, bias),
                 layer_norm(x, scale, bias), reduction=130)
    scales = jnp.stack([scale, 2.0 * scale, -scale, scale + 1.0])
    batched = jax.jit(jax.vmap(ops.layer_norm, in_axes=(0, 0, None)))(x, scales, bias)
    for i in range(4):
        np.testing.assert_array_equal(batched[i], layer_norm(x[i], scales[i], bias))

    def loss(x, s):
        return jnp.sum(ops.layer_norm(x, s, bias) ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    dx, ds = jax.jit(jax.vmap(grad))(x, scales)
    for i in range(4):
        dx_i, ds_i = jax.jit(grad)(x[i], scales[i])
        np.testing.assert_array_equal(dx[i], dx_i)
        np.testing.assert_array_equal(ds[i], ds_i)


def test_bdrln_vmap_over_x_and_keys():
    inp = _inputs(_seed("vmap-bdrln"), (4, 3, 130), jnp.float32, jnp.float32)
    x, bias, residual, scale, ln_bias = (inp[k] for k in ("x", "bias", "residual", "scale", "ln_bias"))
    keys = jax.random.split(inp["dropout_key"], 4)

    def f(x, residual, key):
        return ops.bias_dropout_residual_layer_norm(x, bias, residual, scale, ln_bias, rate=RATE, key=key)

    def loss(x, key):
        return jnp.sum(f(x, residual[0], key) * inp["dy"][0])

    batched = jax.jit(jax.vmap(f))(x, residual, keys)
    shared_key = jax.jit(jax.vmap(f, in_axes=(0, 0, None)))(x, residual, keys[0])
    dx = jax.jit(jax.vmap(jax.grad(loss)))(x, keys)
    for i in range(4):
        np.testing.assert_array_equal(batched[i], jax.jit(f)(x[i], residual[i], keys[i]))
        np.testing.assert_array_equal(dx[i], jax.jit(jax.grad(loss))(x[i], keys[i]))
    np.testing.assert_array_equal(shared_key[1], jax.jit(f)(x[1], residual[1], keys[0]))


def test_targets_in_lowered_hlo():
    inp = _inputs(_seed("hlo"), (4, 130), jnp.bfloat16, jnp.float32)
    for op in (LN, BDRLN):
        fused, _, args, _ = _fused_and_reference(op, inp)
        prefix = "jaxsub_layer_norm" if op == LN else "jaxsub_bdrln"
        fwd = _hlo(fused, *args)
        assert f"{prefix}_fwd" in fwd and f"{prefix}_bwd" not in fwd
        grad = _hlo(jax.grad(lambda *a: jnp.sum(fused(*a).astype(jnp.float32)), argnums=0), *args)
        assert f"{prefix}_fwd" in grad and f"{prefix}_bwd" in grad


# ---------------------------------------------------------------------------------------
# Dropout semantics.


_bdrln_jit = jax.jit(ops.bias_dropout_residual_layer_norm, static_argnames=("rate", "eps", "deterministic"))


def _bdrln(inp, rate=RATE, key="default", **kw):
    key = inp["dropout_key"] if key == "default" else key
    return _bdrln_jit(inp["x"], inp["bias"], inp["residual"], inp["scale"], inp["ln_bias"], rate=rate,
                      key=key, **kw)


def _bdrln_grads(inp, **kw):
    def loss(x, residual):
        return jnp.sum(ops.bias_dropout_residual_layer_norm(
            x, inp["bias"], residual, inp["scale"], inp["ln_bias"], **kw).astype(jnp.float32)
            * inp["dy"].astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(inp["x"], inp["residual"])


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_keep_rate_and_gradient_mask(rate):
    inp = _inputs(_seed("keep", rate), (64, 1000), jnp.float32, jnp.float32)
    dx, dresidual = _bdrln_grads(inp, rate=rate, key=inp["dropout_key"])
    kept = np.asarray(dx != 0)
    np.testing.assert_array_equal(kept, ops.dropout_mask(inp["dropout_key"], dx.shape, rate))
    n = kept.size
    sigma = np.sqrt(n * rate * (1 - rate))
    assert abs(kept.sum() - n * (1 - rate)) < 5 * sigma
    assert np.all(np.asarray(dresidual)[~kept] != 0)


def test_same_key_same_output_new_key_new_output():
    inp = _inputs(_seed("keys"), (16, 130), jnp.bfloat16, jnp.bfloat16)
    first, again = _bdrln(inp), _bdrln(inp)
    np.testing.assert_array_equal(first, again)
    other = _bdrln(inp, key=jax.random.fold_in(inp["dropout_key"], 1))
    assert np.mean(np.asarray(first != other)) > 0.1


def test_raw_uint32_key_is_accepted():
    inp = _inputs(_seed("raw key"), (4, 130), jnp.float32, jnp.float32)
    raw = jax.random.key_data(inp["dropout_key"])
    np.testing.assert_array_equal(_bdrln(inp, key=raw), _bdrln(inp))


def test_deterministic_and_rate_zero_equal_the_op_without_dropout():
    inp = _inputs(_seed("deterministic"), (6, 130), jnp.bfloat16, jnp.float32)
    plain = _bdrln(inp, rate=0.0, key=None)
    np.testing.assert_array_equal(_bdrln(inp, rate=0.3, deterministic=True), plain)
    np.testing.assert_array_equal(_bdrln(inp, rate=0.3, key=None, deterministic=True), plain)
    expected = jax.jit(reference_bdrln, static_argnames=("keep", "rate"))(
        inp["x"], inp["bias"], inp["residual"], inp["scale"], inp["ln_bias"], keep=None, rate=0.0)
    assert_close(plain, expected, jnp.bfloat16, reduction=130)
    grads_plain = _bdrln_grads(inp, rate=0.0, key=None)
    grads_det = _bdrln_grads(inp, rate=0.3, key=inp["dropout_key"], deterministic=True)
    for a, b in zip(grads_plain, grads_det):
        np.testing.assert_array_equal(a, b)
    # Without dropout, dx is the layer-norm gradient of h itself: equal to dresidual.
    np.testing.assert_array_equal(*grads_plain)


# ---------------------------------------------------------------------------------------
# Errors and the fallback.


def _bad_ln(**override):
    inp = _inputs(_seed("bad"), (4, 8), jnp.float32, jnp.float32)
    args = dict(x=inp["x"], scale=inp["scale"], bias=inp["bias"], eps=1e-5) | override
    return lambda: ops.layer_norm(**args)


def _bad_bdrln(**override):
    inp = _inputs(_seed("bad"), (4, 8), jnp.float32, jnp.float32)
    args = dict(x=inp["x"], bias=inp["bias"], residual=inp["residual"], scale=inp["scale"],
                ln_bias=inp["ln_bias"], rate=RATE, key=inp["dropout_key"]) | override
    return lambda: ops.bias_dropout_residual_layer_norm(**args)


f32 = jnp.float32
BAD_INPUTS = [
    (LN, "x", ValueError, _bad_ln(x=jnp.float32(1.0))),
    (LN, "x", TypeError, _bad_ln(x=jnp.ones((4, 8), jnp.int32))),
    (LN, "scale", ValueError, _bad_ln(scale=jnp.ones((9,), f32))),
    (LN, "bias", ValueError, _bad_ln(bias=jnp.ones((4, 8), f32))),
    (LN, "scale", TypeError, _bad_ln(scale=jnp.ones((8,), jnp.float16))),
    (LN, "bias", TypeError, _bad_ln(x=jnp.ones((4, 8), jnp.bfloat16), bias=jnp.ones((8,), jnp.float16))),
    (LN, "eps", ValueError, _bad_ln(eps=0.0)),
    (LN, "eps", ValueError, _bad_ln(eps=-1e-5)),
    (BDRLN, "x", ValueError, _bad_bdrln(x=jnp.float32(1.0), residual=jnp.float32(1.0))),
    (BDRLN, "x", TypeError, _bad_bdrln(x=jnp.ones((4, 8), jnp.int8))),
    (BDRLN, "residual", ValueError, _bad_bdrln(residual=jnp.ones((4, 9), f32))),
    (BDRLN, "residual", TypeError, _bad_bdrln(residual=jnp.ones((4, 8), jnp.bfloat16))),
    (BDRLN, "bias", ValueError, _bad_bdrln(bias=jnp.ones((7,), f32))),
    (BDRLN, "scale", TypeError, _bad_bdrln(scale=jnp.ones((8,), jnp.int32))),
    (BDRLN, "ln_bias", ValueError, _bad_bdrln(ln_bias=jnp.ones((1, 8), f32))),
    (BDRLN, "rate", ValueError, _bad_bdrln(rate=1.0)),
    (BDRLN, "rate", ValueError, _bad_bdrln(rate=-0.1)),
    (BDRLN, "key", ValueError, _bad_bdrln(key=None)),
    (BDRLN, "eps", ValueError, _bad_bdrln(eps=0.0)),
    # Strings and bools converted by float() were taken (found by probing): eps=True was 1.0.
    (BDRLN, "eps", TypeError, _bad_bdrln(eps=True)),
    (BDRLN, "eps", TypeError, _bad_bdrln(eps="1e-5")),
    (BDRLN, "rate", TypeError, _bad_bdrln(rate="0.1")),
    (BDRLN, "rate", TypeError, _bad_bdrln(rate=False)),
]


@pytest.mark.parametrize("op,arg,error,call", BAD_INPUTS,
                         ids=[f"{op}-{arg}-{err.__name__}-{i}" for i, (op, arg, err, _) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_naming_op_and_argument(op, arg, error, call):
    with pytest.raises(error) as info:
        call()
    assert f"jaxsub.{op}" in str(info.value) and f"`{arg}`" in str(info.value)


def test_handler_rejects_mixed_parameter_dtypes():
    x = jnp.ones((2, 8), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((2,), f32)
    with pytest.raises(Exception, match="layer_norm_fwd: parameters must be float32"):
        _ffi.call("jaxsub_layer_norm_fwd", (jax.ShapeDtypeStruct(x.shape, x.dtype), stats, stats),
                  x, jnp.ones((8,), jnp.float16), jnp.ones((8,), jnp.float16), eps=np.float32(1e-5),
                  block_threads=np.int32(0), max_elems=np.int32(0))


@pytest.mark.parametrize("op", [LN, BDRLN])
def test_wide_rows_fall_back_to_the_reference(op):
    inp = _inputs(_seed("fallback", op), (2, _ffi.MAX_COLS + 1), jnp.bfloat16, jnp.float32)
    fused, _, args, _ = _fused_and_reference(op, inp)
    assert "jaxsub_" + ("layer_norm" if op == LN else "bdrln") not in _hlo(fused, *args)
    _assert_matches(op, inp)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0)])
@pytest.mark.parametrize("op", [LN, BDRLN])
def test_zero_size_inputs(op, shape):
    inp = _inputs(_seed("empty"), shape, jnp.float32, jnp.float32)
    fused, _, args, _ = _fused_and_reference(op, inp)
    [(y, grads)] = _values_and_vjps([fused], args, inp["dy"])
    assert y.shape == shape
    assert all(g.shape == a.shape and np.all(np.asarray(g) == 0) for g, a in zip(grads, args))


# ---------------------------------------------------------------------------------------
# bdrln_pair: y returned twice; backward adds the two cotangents in the kernel.


def _pair_and_reference(inp, rate=RATE):
    key = inp["dropout_key"]
    args = (inp["x"], inp["bias"], inp["residual"], inp["scale"], inp["ln_bias"])

    def pair(*a):
        return norm.bdrln_pair(*a, rate=rate, key=key)

    def reference(*a):
        y = reference_bdrln(*a, keep=ops.dropout_mask(key, a[0].shape, rate), rate=rate)
        return y, y

    return pair, reference, args


def _second_cotangent(seed, like):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(like.shape, np.float32).astype(like.dtype))


@pytest.mark.parametrize("dtype,pdtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                          (jnp.float16, jnp.float16)], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("lead,n", [((7,), 3), ((2, 3), 130), ((5,), 1000)])
def test_pair_adds_both_cotangents(lead, n, dtype, pdtype):
    seed = _seed("pair", lead, n, dtype, pdtype)
    inp = _inputs(seed, lead + (n,), dtype, pdtype)
    pair, reference, args = _pair_and_reference(inp)
    cts = (inp["dy"], _second_cotangent(seed + 1, inp["dy"]))
    ((ya, yb), grads), ((y_ref, _), grads_ref) = _values_and_vjps((pair, reference), args, cts)
    np.testing.assert_array_equal(np.asarray(ya, np.float32), np.asarray(yb, np.float32))
    assert_close(ya, y_ref, dtype, reduction=n, what="bdrln_pair y")
    rows = inp["x"].size // n
    for name, a, g, g_ref in zip(("x", "bias", "residual", "scale", "ln_bias"), args, grads, grads_ref):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        assert_close(g, g_ref, a.dtype, reduction=n if name in ACTIVATIONS else rows, grad=True,
                     what=f"bdrln_pair d{name}")


def test_pair_backward_has_no_add_of_the_cotangents():
    """The point of the pair: no [R, N] add before the backward kernel. The same layer with
    one output used twice has that add (so the check can fail)."""
    inp = _inputs(_seed("pair-hlo"), (4, 130), jnp.bfloat16, jnp.bfloat16)
    pair, _, args = _pair_and_reference(inp)

    def single(*a):
        y = ops.bias_dropout_residual_layer_norm(*a, rate=RATE, key=inp["dropout_key"])
        return y, y

    def adds(f):
        def grads(args, dy, dy2):
            return jax.vjp(f, *args)[1]((dy, dy2))
        text = _hlo(grads, args, inp["dy"], inp["dy"])
        return sum(1 for line in text.splitlines() if "add" in line and "4x130xbf16" in line)

    assert "jaxsub_bdrln_bwd" in _hlo(lambda a, d: jax.vjp(pair, *a)[1]((d, d)), args, inp["dy"])
    assert adds(pair) == 0
    assert adds(single) >= 1


def test_bdrln_bwd_handler_rejects_a_second_cotangent_of_another_shape():
    inp = _inputs(_seed("pair-bad"), (4, 8), jnp.float32, jnp.float32)
    x, b, r, s = inp["x"], inp["bias"], inp["residual"], inp["scale"]
    stats = jnp.ones((4,), f32)
    kernel = norm._config.kernel_config(BDRLN, None, norm._config.row_signature(x, s.dtype, dropout_rate=RATE))
    with pytest.raises(Exception, match="bdrln_bwd"):
        jax.block_until_ready(norm._bdrln_bwd_call(inp["dy"], inp["dy"][:2], x, b, r, s, stats, stats,
                                                   jnp.zeros((2,), jnp.uint32), RATE, kernel))


# ---------------------------------------------------------------------------------------
# bdrln_and_sum: (y, h) from one kernel; layer_norm_and_input: (y, x). The backward kernels
# add the second output's cotangent to the gradient of h (of x).


def _with_sum_and_reference(inp, rate=RATE):
    key = inp["dropout_key"]
    args = (inp["x"], inp["bias"], inp["residual"], inp["scale"], inp["ln_bias"])

    def fused(*a):
        return norm.bdrln_and_sum(*a, rate=rate, key=key)

    def reference(x, bias, residual, scale, ln_bias):
        keep = ops.dropout_mask(key, x.shape, rate)
        h = residual.astype(f32) + ops.dropout.apply_reference(x.astype(f32) + bias.astype(f32), keep, rate)
        return reference_bdrln(x, bias, residual, scale, ln_bias, keep=keep, rate=rate), h.astype(x.dtype)

    return fused, reference, args


def _with_input_and_reference(inp):
    args = (inp["x"], inp["scale"], inp["ln_bias"])

    def fused(*a):
        return norm.layer_norm_and_input(*a)

    def reference(x, scale, bias):
        return reference_layer_norm(x, scale, bias), x

    return fused, reference, args


SECOND_OUTPUT = {"bdrln_and_sum": (_with_sum_and_reference, ("x", "bias", "residual", "scale", "ln_bias")),
                 "layer_norm_and_input": (_with_input_and_reference, ("x", "scale", "ln_bias"))}


@pytest.mark.parametrize("dtype,pdtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                          (jnp.float16, jnp.float16)], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("lead,n", [((7,), 3), ((2, 3), 130), ((5,), 1000), ((3,), 4096)])
@pytest.mark.parametrize("which", list(SECOND_OUTPUT))
def test_second_output_and_its_cotangent(which, lead, n, dtype, pdtype):
    make, names = SECOND_OUTPUT[which]
    seed = _seed(which, lead, n, dtype, pdtype)
    inp = _inputs(seed, lead + (n,), dtype, pdtype)
    fused, reference, args = make(inp)
    cts = (inp["dy"], _second_cotangent(seed + 1, inp["dy"]))
    ((y, h), grads), ((y_ref, h_ref), grads_ref) = _values_and_vjps((fused, reference), args, cts)
    assert y.dtype == h.dtype == dtype and y.shape == h.shape == inp["x"].shape
    assert_close(y, y_ref, dtype, reduction=n, what=f"{which} y")
    assert_close(h, h_ref, dtype, reduction=1, what=f"{which} h")
    rows = inp["x"].size // n
    for name, a, g, g_ref in zip(names, args, grads, grads_ref):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        assert_close(g, g_ref, a.dtype, reduction=n if name in ACTIVATIONS else rows, grad=True,
                     what=f"{which} d{name}")


@pytest.mark.parametrize("which", list(SECOND_OUTPUT))
def test_second_output_wide_rows_fall_back_to_the_reference(which):
    """Rows wider than the kernels take: the reference, with the second output too."""
    inp = _inputs(_seed("second-fallback", which), (2, _ffi.MAX_COLS + 1), jnp.bfloat16, jnp.float32)
    make, _ = SECOND_OUTPUT[which]
    fused, reference, args = make(inp)
    assert "jaxsub_" + ("bdrln" if which == "bdrln_and_sum" else "layer_norm") not in _hlo(fused, *args)
    (y, h), (y_ref, h_ref) = fused(*args), reference(*args)
    assert_close(y, y_ref, jnp.bfloat16, reduction=_ffi.MAX_COLS, what=f"{which} y")
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_ref, np.float32))


@pytest.mark.parametrize("which", list(SECOND_OUTPUT))
def test_second_output_needs_no_add_of_the_cotangents(which):
    """No [R, N] add before the backward kernel; the same outputs from the plain op (y, and
    h or x as jnp values beside it) have one, so the check can fail."""
    inp = _inputs(_seed("second-hlo", which), (4, 130), jnp.bfloat16, jnp.bfloat16)
    make, _ = SECOND_OUTPUT[which]
    fused, reference, args = make(inp)

    def plain(*a):  # the op's single output, and the second value from jnp
        _, h = reference(*a)
        if which == "layer_norm_and_input":
            return ops.layer_norm(*a), h
        return ops.bias_dropout_residual_layer_norm(*a, rate=RATE, key=inp["dropout_key"]), h

    def adds(f):
        text = _hlo(lambda a, d, d2: jax.vjp(f, *a)[1]((d, d2)), args, inp["dy"], inp["dy"])
        return sum(1 for line in text.splitlines() if "add" in line and "4x130xbf16" in line)

    assert adds(fused) == 0
    assert adds(plain) >= 1


@pytest.mark.parametrize("target", ["bdrln_bwd", "layer_norm_bwd"])
def test_bwd_handlers_reject_a_cotangent_of_h_of_another_shape(target):
    inp = _inputs(_seed("dh-bad", target), (4, 8), jnp.float32, jnp.float32)
    x, b, r, s = inp["x"], inp["bias"], inp["residual"], inp["scale"]
    stats = jnp.ones((4,), f32)
    op = BDRLN if target == "bdrln_bwd" else LN
    kernel = norm._config.kernel_config(op, None, norm._config.row_signature(x, s.dtype, dropout_rate=RATE))
    with pytest.raises(Exception, match=target):
        if target == "bdrln_bwd":
            jax.block_until_ready(norm._bdrln_bwd_call(inp["dy"], None, x, b, r, s, stats, stats,
                                                       jnp.zeros((2,), jnp.uint32), RATE, kernel, dh=inp["dy"][:2]))
        else:
            jax.block_until_ready(norm._layer_norm_bwd_call(inp["dy"], x, s, stats, stats, kernel, dh=inp["dy"][:2]))


# ---------------------------------------------------------------------------------------
# CUDA against the CPU handlers (pytest -m gpu, on a CUDA machine).


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs the CUDA targets and a GPU")
class TestCuda:
    ROWS = 8 * 512

    def _on(self, platform, op, inp):
        """[(y, grads)] of the fused op and of its reference, every input (the key too) on
        `platform`."""
        inp = jax.device_put(inp, jax.devices(platform)[0])
        fused, reference, args, names = _fused_and_reference(op, inp)
        return _values_and_vjps((fused, reference), args, inp["dy"]), names

    @pytest.mark.parametrize("n", [1024, 4096])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
    @pytest.mark.parametrize("op", [LN, BDRLN])
    def test_cuda_matches_cpu(self, op, dtype, n):
        inp = _inputs(_seed("gpu", op, dtype, n), (self.ROWS, n), dtype, dtype)
        [(y_gpu, g_gpu), _], names = self._on("gpu", op, inp)
        [(y_cpu, g_cpu), _], _ = self._on("cpu", op, inp)
        assert_close(y_gpu, y_cpu, dtype, reduction=n, what=f"{op} y")
        for name, g, g_ref in zip(names, g_gpu, g_cpu):
            reduction = n if name in ACTIVATIONS else self.ROWS
            assert_close(g, g_ref, dtype, reduction=reduction, grad=True, what=f"{op} d{name}")
        if op == BDRLN:
            # The mask is bit-identical: dx is exactly zero where it drops, on both platforms.
            keep = np.asarray(ops.dropout_mask(inp["dropout_key"], inp["x"].shape, RATE))
            for dx in (np.asarray(g_gpu[0]), np.asarray(g_cpu[0])):
                assert np.all(dx[~keep] == 0) and np.mean(dx[keep] == 0) < 1e-5

    @pytest.mark.parametrize("op", [LN, BDRLN])
    def test_cuda_writes_every_element(self, op):
        inp = _inputs(_seed("gpu-all", op), (self.ROWS, 1024), jnp.bfloat16, jnp.float32)
        [(y, grads), (y_ref, grads_ref)], names = self._on("gpu", op, inp)
        for name, a, b in zip(("y",) + names, (y, *grads), (y_ref, *grads_ref)):
            assert np.all(np.isfinite(np.asarray(a, np.float32))), name
            reduction = 1024 if name in ("y",) + ACTIVATIONS else self.ROWS
            assert_close(a, b, a.dtype, reduction=reduction, grad=name != "y", what=f"{op} {name}")

    def test_pair_cuda_matches_cpu(self):
        """bdrln_pair with two different cotangents: the CUDA kernel's second operand."""
        inp = _inputs(_seed("gpu-pair"), (self.ROWS, 1024), jnp.bfloat16, jnp.bfloat16)
        cts = (inp["dy"], _second_cotangent(_seed("gpu-pair-dy2"), inp["dy"]))
        out = {}
        for platform in ("gpu", "cpu"):
            dev = jax.devices(platform)[0]
            on = jax.device_put((inp, cts), dev)
            pair, _, args = _pair_and_reference(on[0])
            [out[platform]] = _values_and_vjps([pair], args, on[1])
        (ya, yb), g_gpu = out["gpu"]
        (y_cpu, _), g_cpu = out["cpu"]
        np.testing.assert_array_equal(np.asarray(ya, np.float32), np.asarray(yb, np.float32))
        assert_close(ya, y_cpu, jnp.bfloat16, reduction=1024, what="bdrln_pair y")
        for name, g, g_ref in zip(("x", "bias", "residual", "scale", "ln_bias"), g_gpu, g_cpu):
            reduction = 1024 if name in ACTIVATIONS else self.ROWS
            assert_close(g, g_ref, jnp.bfloat16, reduction=reduction, grad=True, what=f"bdrln_pair d{name}")

    @pytest.mark.parametrize("dtype,n", [(jnp.bfloat16, 64), (jnp.bfloat16, 200), (jnp.float32, 64),
                                         (jnp.float32, 1024)], ids=lambda v: getattr(v, "__name__", str(v)))
    @pytest.mark.parametrize("pair", [False, True], ids=["dy", "dy_dy2"])
    def test_bdrln_bwd_many_rows_per_group(self, dtype, n, pair):
        """Enough rows that every row group of the one-wave backward walks ~10 of them (the
        other GPU tests give most groups a few): one warp per row (64, 200: 200 leaves lanes
        past the row's end) and several (f32 1024), with and without the second cotangent."""
        rows = 20011
        inp = _inputs(_seed("gpu-many", jnp.dtype(dtype).name, n, pair), (rows, n), dtype, jnp.float32)
        cts = (inp["dy"], _second_cotangent(_seed("gpu-many-dy2", n), inp["dy"]))
        out = {}
        for platform in ("gpu", "cpu"):
            on = jax.device_put((inp, cts), jax.devices(platform)[0])
            if pair:
                fused, _, args = _pair_and_reference(on[0])
                [out[platform]] = _values_and_vjps([fused], args, on[1])
            else:
                fused, _, args, _ = _fused_and_reference(BDRLN, on[0])
                [out[platform]] = _values_and_vjps([fused], args, on[1][0])
        names = ("x", "bias", "residual", "scale", "ln_bias")
        for name, g, g_ref in zip(names, out["gpu"][1], out["cpu"][1]):
            assert np.all(np.isfinite(np.asarray(g, np.float32))), name
            reduction = n if name in ACTIVATIONS else rows
            assert_close(g, g_ref, g.dtype, reduction=reduction, grad=True, what=f"bdrln d{name}")

    @pytest.mark.parametrize("dtype,n", [(jnp.bfloat16, 1024), (jnp.bfloat16, 4096), (jnp.bfloat16, 1000),
                                         (jnp.float16, 1024)], ids=lambda v: getattr(v, "__name__", str(v)))
    def test_layer_norm_bwd_many_rows_per_group(self, dtype, n):
        """The layer norm backward over an odd number of rows that gives each row group of
        its one-wave grid several, the last pass part full (the other GPU tests give most
        groups a few): four rows per block (1024), one (4096), the general path (1000)."""
        rows = 5003
        inp = _inputs(_seed("gpu-ln-many", jnp.dtype(dtype).name, n), (rows, n), dtype, jnp.float32)
        out = {}
        for platform in ("gpu", "cpu"):
            on = jax.device_put(inp, jax.devices(platform)[0])
            fused, _, args, names = _fused_and_reference(LN, on)
            [out[platform]] = _values_and_vjps([fused], args, on["dy"])
        assert_close(out["gpu"][0], out["cpu"][0], dtype, reduction=n, what="layer_norm y")
        for name, g, g_ref in zip(names, out["gpu"][1], out["cpu"][1]):
            assert np.all(np.isfinite(np.asarray(g, np.float32))), name
            reduction = n if name in ACTIVATIONS else rows
            assert_close(g, g_ref, g.dtype, reduction=reduction, grad=True, what=f"layer_norm d{name}")

    @pytest.mark.parametrize("which", list(SECOND_OUTPUT))
    def test_second_output_cuda_matches_cpu(self, which):
        """bdrln_and_sum's h and both kernels' extra cotangent operand, against the CPU."""
        inp = _inputs(_seed("gpu-second", which), (self.ROWS, 1024), jnp.bfloat16, jnp.float32)
        cts = (inp["dy"], _second_cotangent(_seed("gpu-second-dh", which), inp["dy"]))
        make, names = SECOND_OUTPUT[which]
        out = {}
        for platform in ("gpu", "cpu"):
            on = jax.device_put((inp, cts), jax.devices(platform)[0])
            fused, _, args = make(on[0])
            [out[platform]] = _values_and_vjps([fused], args, on[1])
        (y, h), g_gpu = out["gpu"]
        (y_cpu, h_cpu), g_cpu = out["cpu"]
        assert_close(y, y_cpu, jnp.bfloat16, reduction=1024, what=f"{which} y")
        assert_close(h, h_cpu, jnp.bfloat16, reduction=1, what=f"{which} h")
        for name, g, g_ref in zip(names, g_gpu, g_cpu):
            assert np.all(np.isfinite(np.asarray(g, np.float32))), name
            reduction = 1024 if name in ACTIVATIONS else self.ROWS
            assert_close(g, g_ref, g.dtype, reduction=reduction, grad=True, what=f"{which} d{name}")
