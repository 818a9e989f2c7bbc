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
from jaxsub.ops.norm import reference_bdrln, reference_layer_norm
from jaxsub.testing import assert_close

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (leading shape, columns): every column count of interest under a 1-D and a 2-D lead,
# plus one unbatched row.
SHAPES = [(lead, n) for n in (1, 3, 130, 1000, 4096) for lead in ((7,), (2, 3))] + [((), 130)]
LN = "layer_norm"
BDRLN = "bias_dropout_residual_layer_norm"
RATE = 0.1
ACTIVATIONS = ("x", "residual")


def _key(*case):
    """A fresh, reproducible key per test case."""
    return jax.random.key(zlib.crc32(repr(case).encode()))


def _inputs(key, shape, dtype, pdtype):
    """Non-trivial activations (nonzero mean), parameters and output cotangent."""
    n = shape[-1]
    k = jax.random.split(key, 7)
    normal = jax.random.normal
    return dict(
        x=(2.0 * normal(k[0], shape) + 0.5).astype(dtype),
        residual=normal(k[1], shape).astype(dtype),
        bias=(0.5 * normal(k[2], (n,))).astype(pdtype),
        scale=(1.0 + 0.5 * normal(k[3], (n,))).astype(pdtype),
        ln_bias=(0.5 * normal(k[4], (n,))).astype(pdtype),
        dy=normal(k[5], shape).astype(dtype),
        dropout_key=k[6],
    )


def _value_and_vjp(f, args, dy):
    @jax.jit
    def run(args, dy):
        y, vjp = jax.vjp(f, *args)
        return y, vjp(dy)

    return run(args, dy)


def _fused_and_reference(op, inp, rate=RATE):
    """(fused function, reference function, primal args, their names) for one op; the
    reference gets the kernel's mask through dropout_mask."""
    if op == LN:
        args = (inp["x"], inp["scale"], inp["bias"])
        return ops.layer_norm, reference_layer_norm, args, ("x", "scale", "bias")
    key = inp["dropout_key"]
    keep = ops.dropout_mask(key, inp["x"].shape, rate)
    args = (inp["x"], inp["bias"], inp["residual"], inp["scale"], inp["ln_bias"])

    def fused(*a):
        return ops.bias_dropout_residual_layer_norm(*a, rate=rate, key=key)

    def reference(*a):
        return reference_bdrln(*a, keep=keep, rate=rate)

    return fused, reference, args, ("x", "bias", "residual", "scale", "ln_bias")


def _assert_matches(op, inp, rate=RATE):
    fused, reference, args, names = _fused_and_reference(op, inp, rate)
    x = inp["x"]
    n, rows = x.shape[-1], x.size // x.shape[-1]
    y, grads = _value_and_vjp(fused, args, inp["dy"])
    y_ref, grads_ref = _value_and_vjp(reference, args, inp["dy"])
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


@pytest.mark.parametrize("params", ["f32", "same"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("lead,n", SHAPES)
@pytest.mark.parametrize("op", [LN, BDRLN])
def test_matches_reference(op, lead, n, dtype, params):
    pdtype = jnp.float32 if params == "f32" else dtype
    _assert_matches(op, _inputs(_key(op, lead, n, dtype, params), lead + (n,), dtype, pdtype))


def test_layer_norm_params_may_be_none():
    inp = _inputs(_key("none"), (5, 130), jnp.float32, jnp.float32)
    x = inp["x"]
    assert_close(ops.layer_norm(x, None, None), reference_layer_norm(x, None, None), reduction=130)
    dx = jax.grad(lambda x: jnp.sum(ops.layer_norm(x, None, None) * inp["dy"]))(x)
    dx_ref = jax.grad(lambda x: jnp.sum(reference_layer_norm(x, None, None) * inp["dy"]))(x)
    assert_close(dx, dx_ref, reduction=130, grad=True)


def test_mixed_parameter_dtypes_get_gradients_in_their_own_dtype():
    inp = _inputs(_key("mixed"), (4, 130), jnp.bfloat16, jnp.bfloat16)
    scale = inp["scale"].astype(jnp.float32)
    dscale, dbias = jax.grad(lambda s, b: jnp.sum(ops.layer_norm(inp["x"], s, b).astype(jnp.float32)),
                             argnums=(0, 1))(scale, inp["bias"])
    assert dscale.dtype == jnp.float32 and dbias.dtype == jnp.bfloat16


@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("op", [LN, BDRLN])
def test_check_grads_fp32(op, rate):
    inp = _inputs(_key("check_grads", op, rate), (3, 5), jnp.float32, jnp.float32)
    fused, _, args, _ = _fused_and_reference(op, inp, rate)
    check_grads(fused, args, order=1, modes=["rev"])


# ---------------------------------------------------------------------------------------
# Composition: vmap, jit, and the targets in the lowered HLO.


def test_layer_norm_vmap_over_x_and_params():
    inp = _inputs(_key("vmap-ln"), (4, 3, 130), jnp.float32, jnp.float32)
    x, scale, bias = inp["x"], inp["scale"], inp["bias"]
    assert_close(jax.vmap(ops.layer_norm, in_axes=(0, None, None))(x, scale, bias),
                 ops.layer_norm(x, scale, bias), reduction=130)
    scales = jnp.stack([scale, 2.0 * scale, -scale, scale + 1.0])
    batched = jax.jit(jax.vmap(ops.layer_norm, in_axes=(0, 0, None)))(x, scales, bias)
    looped = jnp.stack([ops.layer_norm(x[i], scales[i], bias) for i in range(4)])
    assert_close(batched, looped, reduction=130)
    loss = lambda x, s: jnp.sum(ops.layer_norm(x, s, bias) ** 2)  # noqa: E731
    dx, ds = jax.vmap(jax.grad(loss, argnums=(0, 1)))(x, scales)
    for i in range(4):
        dx_i, ds_i = jax.grad(loss, argnums=(0, 1))(x[i], scales[i])
        assert_close(dx[i], dx_i, reduction=130, grad=True)
        assert_close(ds[i], ds_i, reduction=3, grad=True)


def test_bdrln_vmap_over_x_and_keys():
    inp = _inputs(_key("vmap-bdrln"), (4, 3, 130), jnp.float32, jnp.float32)
    x, bias, residual, scale, ln_bias = (inp[k] for k in ("x", "bias", "residual", "scale", "ln_bias"))
    keys = jax.random.split(inp["dropout_key"], 4)

    def f(x, residual, key):
        return ops.bias_dropout_residual_layer_norm(x, bias, residual, scale, ln_bias, rate=RATE, key=key)

    batched = jax.jit(jax.vmap(f))(x, residual, keys)
    looped = jnp.stack([f(x[i], residual[i], keys[i]) for i in range(4)])
    np.testing.assert_array_equal(batched, looped)
    shared_key = jax.vmap(f, in_axes=(0, 0, None))(x, residual, keys[0])
    np.testing.assert_array_equal(shared_key[1], f(x[1], residual[1], keys[0]))
    loss = lambda x, key: jnp.sum(f(x, residual[0], key) * inp["dy"][0])  # noqa: E731
    dx = jax.jit(jax.vmap(jax.grad(loss)))(x, keys)
    for i in range(4):
        np.testing.assert_array_equal(dx[i], jax.grad(loss)(x[i], keys[i]))


def test_targets_in_lowered_hlo():
    inp = _inputs(_key("hlo"), (4, 130), jnp.bfloat16, jnp.float32)
    for op in (LN, BDRLN):
        fused, _, args, _ = _fused_and_reference(op, inp)
        prefix = "jaxsub_layer_norm" if op == LN else "jaxsub_bdrln"
        fwd = _hlo(fused, *args)
        assert f"{prefix}_fwd" in fwd and f"{prefix}_bwd" not in fwd
        grad = _hlo(jax.grad(lambda *a: jnp.sum(fused(*a).astype(jnp.float32)), argnums=0), *args)
        assert f"{prefix}_fwd" in grad and f"{prefix}_bwd" in grad


# ---------------------------------------------------------------------------------------
# Dropout semantics.


def _bdrln(inp, rate=RATE, key=None, **kw):
    key = inp["dropout_key"] if key is None else key
    return ops.bias_dropout_residual_layer_norm(inp["x"], inp["bias"], inp["residual"], inp["scale"],
                                                inp["ln_bias"], rate=rate, key=key, **kw)


def _bdrln_grads(inp, **kw):
    def loss(x, residual):
        return jnp.sum(ops.bias_dropout_residual_layer_norm(
            x, inp["bias"], residual, inp["scale"], inp["ln_bias"], **kw).astype(jnp.float32)
            * inp["dy"].astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(inp["x"], inp["residual"])


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_keep_rate_and_gradient_mask(rate):
    inp = _inputs(_key("keep", rate), (64, 1000), jnp.float32, jnp.float32)
    dx, dresidual = _bdrln_grads(inp, rate=rate, key=inp["dropout_key"])
    kept = np.asarray(dx != 0)
    np.testing.assert_array_equal(kept, ops.dropout_mask(inp["dropout_key"], dx.shape, rate))
    n = kept.size
    sigma = np.sqrt(n * rate * (1 - rate))
    assert abs(kept.sum() - n * (1 - rate)) < 5 * sigma
    assert np.all(np.asarray(dresidual)[~kept] != 0)


def test_same_key_same_output_new_key_new_output():
    inp = _inputs(_key("keys"), (16, 130), jnp.bfloat16, jnp.bfloat16)
    first, again = _bdrln(inp), _bdrln(inp)
    np.testing.assert_array_equal(first, again)
    other = _bdrln(inp, key=jax.random.fold_in(inp["dropout_key"], 1))
    assert np.mean(np.asarray(first != other)) > 0.1


def test_raw_uint32_key_is_accepted():
    inp = _inputs(_key("raw key"), (4, 130), jnp.float32, jnp.float32)
    raw = jax.random.key_data(inp["dropout_key"])
    np.testing.assert_array_equal(_bdrln(inp, key=raw), _bdrln(inp))


def test_deterministic_and_rate_zero_equal_the_op_without_dropout():
    inp = _inputs(_key("deterministic"), (6, 130), jnp.bfloat16, jnp.float32)
    plain = _bdrln(inp, rate=0.0, key=None)
    np.testing.assert_array_equal(_bdrln(inp, rate=0.3, deterministic=True), plain)
    np.testing.assert_array_equal(_bdrln(inp, rate=0.3, key=None, deterministic=True), plain)
    expected = reference_bdrln(inp["x"], inp["bias"], inp["residual"], inp["scale"], inp["ln_bias"],
                               keep=None, rate=0.0)
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
    inp = _inputs(_key("bad"), (4, 8), jnp.float32, jnp.float32)
    args = dict(x=inp["x"], scale=inp["scale"], bias=inp["bias"], eps=1e-5) | override
    return lambda: ops.layer_norm(**args)


def _bad_bdrln(**override):
    inp = _inputs(_key("bad"), (4, 8), jnp.float32, jnp.float32)
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
                  x, jnp.ones((8,), jnp.float16), jnp.ones((8,), jnp.float16), eps=np.float32(1e-5))


@pytest.mark.parametrize("op", [LN, BDRLN])
def test_wide_rows_fall_back_to_the_reference(op):
    inp = _inputs(_key("fallback", op), (2, _ffi.MAX_COLS + 1), jnp.bfloat16, jnp.float32)
    fused, _, args, _ = _fused_and_reference(op, inp)
    assert "jaxsub_" + ("layer_norm" if op == LN else "bdrln") not in _hlo(fused, *args)
    _assert_matches(op, inp)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0)])
@pytest.mark.parametrize("op", [LN, BDRLN])
def test_zero_size_inputs(op, shape):
    inp = _inputs(_key("empty"), shape, jnp.float32, jnp.float32)
    fused, _, args, _ = _fused_and_reference(op, inp)
    y, grads = _value_and_vjp(fused, args, inp["dy"])
    assert y.shape == shape
    assert all(g.shape == a.shape and np.all(np.asarray(g) == 0) for g, a in zip(grads, args))


# ---------------------------------------------------------------------------------------
# CUDA against the CPU handlers (pytest -m gpu, on a CUDA machine).


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs the CUDA targets and a GPU")
class TestCuda:
    ROWS = 8 * 512

    def _on(self, platform, f, args, dy):
        device = jax.devices(platform)[0]
        return _value_and_vjp(f, jax.device_put(args, device), jax.device_put(dy, device))

    @pytest.mark.parametrize("n", [1024, 4096])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
    @pytest.mark.parametrize("op", [LN, BDRLN])
    def test_cuda_matches_cpu(self, op, dtype, n):
        inp = _inputs(_key("gpu", op, dtype, n), (self.ROWS, n), dtype, dtype)
        fused, _, args, names = _fused_and_reference(op, inp)
        y_gpu, g_gpu = self._on("gpu", fused, args, inp["dy"])
        y_cpu, g_cpu = self._on("cpu", fused, args, inp["dy"])
        assert_close(y_gpu, y_cpu, dtype, reduction=n, what=f"{op} y")
        for name, a, g, g_ref in zip(names, args, g_gpu, g_cpu):
            reduction = n if name in ACTIVATIONS else self.ROWS
            assert_close(g, g_ref, dtype, reduction=reduction, grad=True, what=f"{op} d{name}")

    @pytest.mark.parametrize("op", [LN, BDRLN])
    def test_cuda_writes_every_element(self, op):
        inp = _inputs(_key("gpu-all", op), (self.ROWS, 1024), jnp.bfloat16, jnp.float32)
        fused, reference, args, names = _fused_and_reference(op, inp)
        y, grads = self._on("gpu", fused, args, inp["dy"])
        y_ref, grads_ref = self._on("gpu", reference, args, inp["dy"])
        for name, a, b in zip(("y",) + names, (y, *grads), (y_ref, *grads_ref)):
            assert np.all(np.isfinite(np.asarray(a, np.float32))), name
            reduction = self.ROWS if name in ("scale", "bias", "ln_bias") else 1024
            assert_close(a, b, a.dtype, reduction=reduction, grad=name != "y", what=f"{op} {name}")
