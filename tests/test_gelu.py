"""bias_gelu_dropout: the fused op against its reference (mask from dropout_mask), its
gradients, transformations, dropout semantics, validation and the fallback path."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub import _ffi
from jaxsub.ops.gelu import reference_bias_gelu_dropout
from jaxsub.ops.gemm import reference_dense
from jaxsub.testing import assert_close, assert_vmap_matches_loop

op = jaxsub.ops.bias_gelu_dropout
F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
DTYPES = (F32, BF16, F16)
COLS = (1, 3, 130, 1000, 4096)
LEADS = ((5,), (2, 3))


def normal(seed, shape, dtype=F32, scale=1.0):
    """Fresh standard-normal draws (never zeros) in `dtype`."""
    v = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(v.astype(np.float32), dtype)


def inputs(seed, shape, dtype, bias_dtype, positive=False):
    """x, bias, dy; `positive` keeps x + bias > 0, where gelu never rounds to zero, so
    zeros in the output are exactly the dropped elements."""
    x = normal(seed, shape, dtype, scale=2.0)
    bias = normal(seed + 1, shape[-1:], bias_dtype)
    if positive:
        x, bias = jnp.abs(x) + 0.1, jnp.abs(bias)
    dy = normal(seed + 2, shape, dtype)
    return x, bias, dy


def fused_vjp(x, bias, dy, *, rate, key, approximate):
    y, vjp = jax.vjp(lambda x, b: op(x, b, rate=rate, key=key, approximate=approximate), x, bias)
    return (y, *vjp(dy))


def reference_vjp(x, bias, dy, *, keep, rate, approximate):
    f = lambda x, b: reference_bias_gelu_dropout(x, b, keep=keep, rate=rate, approximate=approximate)
    y, vjp = jax.vjp(f, x, bias)
    return (y, *vjp(dy))


# Jitted once each: eager vjp dispatches (and compiles) op by op, which is most of the
# suite's time otherwise.
fused_vjp_jit = jax.jit(fused_vjp, static_argnames=("rate", "approximate"))
reference_vjp_jit = jax.jit(reference_vjp, static_argnames=("rate", "approximate"))


def check_against_reference(x, bias, dy, *, rate, key, approximate):
    keep = jaxsub.ops.dropout_mask(key, x.shape, rate) if rate > 0 else None
    got = fused_vjp_jit(x, bias, dy, rate=rate, key=key, approximate=approximate)
    want = reference_vjp_jit(x, bias, dy, keep=keep, rate=rate, approximate=approximate)
    rows = math.prod(x.shape[:-1])
    assert got[0].dtype == x.dtype and got[1].dtype == x.dtype and got[2].dtype == bias.dtype
    assert_close(got[0], want[0], x.dtype, what="y")
    assert_close(got[1], want[1], x.dtype, grad=True, what="dx")
    assert_close(got[2], want[2], bias.dtype, reduction=rows, grad=True, what="dbias")


# Every column count with every dtype; the other factors rotate with the case index so
# that each pair of (dtype, approximate, bias dtype) values is covered without the full
# product, which would dominate the suite's runtime with compilations.
CASES = [
    (cols, dtype, LEADS[(i // 4) % 2], bool(i % 2), bool((i // 2) % 2))
    for i, (cols, dtype) in enumerate(itertools.product(COLS, DTYPES))
]


@pytest.mark.parametrize("cols,dtype,lead,approximate,bias_f32", CASES,
                         ids=[f"{c}-{d.name}-{l}-{'tanh' if a else 'erf'}-{'f32' if b else 'same'}bias"
                              for c, d, l, a, b in CASES])
def test_fwd_and_vjp_match_reference(cols, dtype, lead, approximate, bias_f32):
    seed = 1000 + cols * 7 + DTYPES.index(dtype)
    x, bias, dy = inputs(seed, lead + (cols,), dtype, F32 if bias_f32 else dtype)
    check_against_reference(x, bias, dy, rate=0.1, key=jax.random.key(seed), approximate=approximate)


@pytest.mark.parametrize("dtype,approximate", [(F32, False), (BF16, True), (F16, False)],
                         ids=["float32-erf", "bfloat16-tanh", "float16-erf"])
def test_without_dropout_matches_reference(dtype, approximate):
    x, bias, dy = inputs(7 + DTYPES.index(dtype), (2, 3, 130), dtype, dtype)
    check_against_reference(x, bias, dy, rate=0.0, key=None, approximate=approximate)


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_check_grads(rate, approximate):
    x, bias, _ = inputs(11, (3, 5), F32, F32)
    key = jax.random.key(12)
    f = lambda x, b: op(x, b, rate=rate, key=key, approximate=approximate)
    check_grads(f, (x, bias), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)


def test_vmap_over_x_matches_loop():
    x, bias, dy = inputs(21, (3, 4, 130), BF16, F32)
    key = jax.random.key(22)
    f = lambda x, dy: fused_vjp(x, bias, dy, rate=0.2, key=key, approximate=False)
    got = jax.jit(jax.vmap(f))(x, dy)
    for i in range(x.shape[0]):
        want = jax.jit(f)(x[i], dy[i])
        np.testing.assert_array_equal(np.asarray(got[0][i], np.float32), np.asarray(want[0], np.float32))
        np.testing.assert_array_equal(np.asarray(got[1][i], np.float32), np.asarray(want[1], np.float32))
        np.testing.assert_array_equal(np.asarray(got[2][i]), np.asarray(want[2]))


@pytest.mark.parametrize("make_keys", [
    lambda: jax.random.split(jax.random.key(31), 3),
    lambda: jax.random.split(jax.random.PRNGKey(31), 3),
], ids=["typed", "raw"])
def test_vmap_over_keys_matches_loop(make_keys):
    x, bias, dy = inputs(32, (4, 130), F32, F32)
    keys = make_keys()
    f = lambda k: fused_vjp(x, bias, dy, rate=0.5, key=k, approximate=True)
    assert_vmap_matches_loop(f, keys)


def test_targets_in_lowered_hlo():
    x, bias, _ = inputs(41, (4, 130), BF16, BF16)
    key = jax.random.key(42)
    f = lambda x, b: op(x, b, rate=0.1, key=key)
    fwd = jax.jit(f).lower(x, bias).as_text()
    bwd = jax.jit(jax.grad(lambda x, b: f(x, b).astype(jnp.float32).sum(), (0, 1))).lower(x, bias).as_text()
    assert "jaxsub_bias_gelu_dropout_fwd" in fwd
    assert "jaxsub_bias_gelu_dropout_bwd" in bwd


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_keep_fraction_and_mask(rate):
    x, bias, _ = inputs(51, (64, 1000), F32, F32, positive=True)
    key = jax.random.key(52)
    y = np.asarray(op(x, bias, rate=rate, key=key))
    kept = y != 0
    np.testing.assert_array_equal(kept, np.asarray(jaxsub.ops.dropout_mask(key, x.shape, rate)))
    n, p = kept.size, 1.0 - rate
    assert abs(kept.mean() - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_same_key_same_output_new_key_different():
    x, bias, _ = inputs(61, (8, 130), F32, F32)
    k1, k2 = jax.random.split(jax.random.key(62))
    a = np.asarray(op(x, bias, rate=0.3, key=k1))
    b = np.asarray(op(x, bias, rate=0.3, key=k1))
    c = np.asarray(op(x, bias, rate=0.3, key=k2))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_dx_exactly_zero_where_dropped():
    x, bias, dy = inputs(71, (16, 130), BF16, F32, positive=True)
    key = jax.random.key(72)
    _, dx, _ = fused_vjp_jit(x, bias, dy, rate=0.4, key=key, approximate=False)
    keep = np.asarray(jaxsub.ops.dropout_mask(key, x.shape, 0.4))
    dx = np.asarray(dx, np.float32)
    assert keep.any() and (~keep).any()
    assert (dx[~keep] == 0).all()
    assert (dx[keep] != 0).mean() > 0.99


@pytest.mark.parametrize("approximate", [False, True])
def test_deterministic_and_rate_zero_are_the_op_without_dropout(approximate):
    x, bias, dy = inputs(81, (6, 130), F16, F32)
    plain = fused_vjp_jit(x, bias, dy, rate=0.0, key=None, approximate=approximate)

    @jax.jit
    def det(x, bias, dy):
        y, vjp = jax.vjp(lambda x, b: op(x, b, rate=0.3, key=None, approximate=approximate,
                                         deterministic=True), x, bias)
        return (y, *vjp(dy))

    det = det(x, bias, dy)
    keyed = fused_vjp_jit(x, bias, dy, rate=0.0, key=jax.random.key(82), approximate=approximate)
    for p, d, k in zip(plain, det, keyed):
        np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(d, np.float32))
        np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(k, np.float32))
    want = reference_bias_gelu_dropout(x, bias, keep=None, rate=0.0, approximate=approximate)
    assert_close(plain[0], want, F16, what="y")


def _bad_cases():
    x = normal(91, (4, 8))
    b = normal(92, (8,))
    key = jax.random.key(93)
    ok = dict(x=x, bias=b, rate=0.1, key=key)
    return [
        ("x-rank0", dict(ok, x=jnp.float32(1.0), bias=normal(0, (1,))), ValueError, "`x`"),
        ("x-int", dict(ok, x=jnp.ones((4, 8), jnp.int32)), TypeError, "`x`"),
        ("bias-none", dict(ok, bias=None), TypeError, "`bias`"),
        ("bias-len", dict(ok, bias=normal(0, (9,))), ValueError, "`bias`"),
        ("bias-rank2", dict(ok, bias=normal(0, (1, 8))), ValueError, "`bias`"),
        ("bias-dtype", dict(ok, x=x.astype(BF16), bias=b.astype(F16)), TypeError, "`bias`"),
        ("rate-one", dict(ok, rate=1.0), ValueError, "`rate`"),
        ("rate-negative", dict(ok, rate=-0.1), ValueError, "`rate`"),
        ("key-missing", dict(ok, key=None), ValueError, "`key`"),
        ("approximate-str", dict(ok, approximate="tanh"), TypeError, "`approximate`"),
        ("deterministic-none", dict(ok, deterministic=None), TypeError, "`deterministic`"),
    ]


@pytest.mark.parametrize("name,kwargs,exc,arg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_naming_op_and_argument(name, kwargs, exc, arg):
    kwargs = dict(kwargs)
    x, bias = kwargs.pop("x"), kwargs.pop("bias")
    with pytest.raises(exc, match="bias_gelu_dropout") as info:
        jax.jit(lambda x, b: op(x, b, **kwargs)).lower(x, bias)
    assert arg in str(info.value)


def test_traced_rate_is_a_type_error():
    x, bias, _ = inputs(95, (2, 8), F32, F32)
    with pytest.raises(TypeError, match="bias_gelu_dropout.*`rate`"):
        jax.jit(lambda r: op(x, bias, rate=r, key=jax.random.key(0)))(0.1)


def test_wide_rows_fall_back_to_reference(fallback_log):
    x, bias, dy = inputs(101, (2, 32769), BF16, F32)
    key = jax.random.key(102)
    f = lambda x, b: op(x, b, rate=0.1, key=key)
    hlo = jax.jit(f).lower(x, bias).as_text()
    assert "jaxsub_bias_gelu_dropout" not in hlo
    assert "jaxsub_dropout_mask" in hlo
    assert fallback_log and fallback_log[0][0] == "bias_gelu_dropout" and "32769" in fallback_log[0][1]
    keep = jaxsub.ops.dropout_mask(key, x.shape, 0.1)
    got = fused_vjp_jit(x, bias, dy, rate=0.1, key=key, approximate=False)
    want = reference_vjp_jit(x, bias, dy, keep=keep, rate=0.1, approximate=False)
    assert_close(got[0], want[0], BF16, what="y")
    assert_close(got[1], want[1], BF16, grad=True, what="dx")
    assert_close(got[2], want[2], F32, reduction=2, grad=True, what="dbias")


@pytest.mark.parametrize("shape", [(0, 16), (3, 0)])
def test_zero_size_falls_back(shape, fallback_log):
    x, bias, dy = inputs(111, shape, F32, F32)
    y, dx, dbias = fused_vjp_jit(x, bias, dy, rate=0.1, key=jax.random.key(112), approximate=False)
    assert y.shape == shape and dx.shape == shape and dbias.shape == shape[-1:]
    assert not np.asarray(dbias).any()
    assert fallback_log and "zero-size" in fallback_log[0][1]


def exact_gelu_grid_errors(device):
    """Worst error of the exact GELU and its derivative (float32, no dropout) on a dense grid
    of inputs in [-12, 12], against float64 math.erfc, relative to 1 + |value|. The kernels
    compute Phi without erf (cuda/gelu_math.h): this pins that approximation down."""
    v = np.linspace(-12.0, 12.0, 480_000, dtype=np.float32)
    f = lambda x, b: op(x, b, rate=0.0, key=None)
    x, b = jax.device_put((jnp.asarray(v.reshape(480, 1000)), jnp.zeros((1000,), F32)), device)
    y, vjp = jax.jit(lambda x, b: jax.vjp(f, x, b))(x, b)
    dx = vjp(jnp.ones_like(y))[0]
    v64 = v.astype(np.float64)
    cdf = np.array([0.5 * math.erfc(-t / math.sqrt(2.0)) for t in v64])
    want_y = v64 * cdf
    want_dx = cdf + v64 * np.exp(-0.5 * v64 * v64) / math.sqrt(2.0 * math.pi)
    err_y = np.abs(np.asarray(y, np.float64).ravel() - want_y) / (1.0 + np.abs(want_y))
    err_dx = np.abs(np.asarray(dx, np.float64).ravel() - want_dx) / (1.0 + np.abs(want_dx))
    return err_y.max(), err_dx.max()


def test_exact_gelu_accuracy_on_dense_grid():
    # float32 with erf is ~8e-8 here; 2.5e-7 is about 4 ulps of a value near 1.
    err_y, err_dx = exact_gelu_grid_errors(jax.devices("cpu")[0])
    assert err_y < 2.5e-7 and err_dx < 2.5e-7, (err_y, err_dx)


SPECIALS = [np.inf, -np.inf, np.nan, 3e38, -3e38, 7.0, -7.0, 0.0, 1e-30, -12.0]


def special_values(dtype, device=None):
    """x with infinities, a NaN and large, tail and tiny values (rounded to dtype), a zero
    bias; on `device` where given."""
    x = jnp.asarray(np.array(SPECIALS * 3, np.float32).reshape(3, -1)).astype(dtype)
    b = jnp.zeros(x.shape[-1], dtype)
    return (x, b) if device is None else jax.device_put((x, b), device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", [False, True])
def test_infinities_and_nan(dtype, approximate):
    """+inf gives +inf and NaN gives NaN, as jax.nn.gelu (the exact GELU gave NaN at +inf:
    inf * 0 in max(v, 0) - |v| q, found by a probe). At -inf the exact GELU gives 0, its
    limit, where jax.nn.gelu's v * Phi(v) gives NaN; the tanh form gives NaN as jax's does."""
    x, b = special_values(dtype)
    y = np.asarray(op(x, b, rate=0.0, key=None, approximate=approximate), np.float32)
    want = np.asarray(jax.nn.gelu(x.astype(F32), approximate=approximate).astype(dtype), np.float32)
    if not approximate:
        want = np.where(np.isneginf(np.asarray(x, np.float32)), 0.0, want)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(want))
    finite = np.isfinite(want)
    tol = 1e-6 if dtype == F32 else 1e-2
    np.testing.assert_allclose(y[finite], want[finite], rtol=tol, atol=1e-10)
    assert np.all(y[np.isposinf(want)] > 0)


# bias_gelu_dropout_dense: the op followed by a product, whose backward has the GELU
# kernel write the op's output again instead of keeping it.


def dense_vjp(x, bias, w, dout, *, rate, key, approximate, fused=True, library=False):
    if fused:
        f = lambda x, b, w: jaxsub.ops.bias_gelu_dropout_dense(x, b, w, rate=rate, key=key, approximate=approximate,
                                                               library_products=library)
    else:
        # Accumulated in f32, as the fused op's product: under jax 0.11 the CPU dot of two
        # bf16 operands gave dw elements 2.5 bf16 ulps from the f32-accumulated sum.
        f = lambda x, b, w: jnp.einsum("...n,ne->...e", op(x, b, rate=rate, key=key, approximate=approximate), w,
                                       preferred_element_type=jnp.float32).astype(x.dtype)
    out, vjp = jax.vjp(f, x, bias, w)
    return (out, *vjp(dout))


dense_vjp_jit = jax.jit(dense_vjp, static_argnames=("rate", "approximate", "fused", "library"))


@pytest.mark.parametrize("lead,cols,dtype,rate,approximate,library", [
    ((2, 5), 130, F32, 0.1, False, False), ((2, 5), 1000, BF16, 0.25, True, False),
    ((10,), 7, F16, 0.0, False, False), ((2, 5), 4096, BF16, 0.1, False, False), ((), 33, F32, 0.1, False, False),
    ((1, 2, 1, 5, 1), 9, F32, 0.5, True, False),
    # library_products (its products through the GEMM target, for 16-bit dtypes): an
    # AttributeError from a renamed function until found by probing.
    ((2, 5), 1000, BF16, 0.25, True, True), ((10,), 7, F16, 0.0, False, True)])
def test_dense_matches_op_then_product(lead, cols, dtype, rate, approximate, library):
    """Values and gradients equal bias_gelu_dropout followed by einsum (the same dropout
    mask), for any number of leading axes."""
    x, bias, _ = inputs(31, (*lead, cols), dtype, dtype)
    w = normal(34, (cols, 24), dtype, scale=1 / math.sqrt(cols))
    dout = normal(35, (*lead, 24), dtype)
    key = jax.random.key(36)
    got = dense_vjp_jit(x, bias, w, dout, rate=rate, key=key, approximate=approximate, library=library)
    want = dense_vjp_jit(x, bias, w, dout, rate=rate, key=key, approximate=approximate, fused=False)
    rows = math.prod(lead)
    for g, v, what, red in zip(got, want, ("out", "dx", "dbias", "dw"), (cols, cols, rows * cols, rows)):
        assert g.dtype == v.dtype and g.shape == v.shape, what
        assert_close(g, v, dtype, reduction=red, grad=what != "out", what=what)


def test_dense_backward_writes_y_and_keeps_x_only():
    x, bias, _ = inputs(41, (4, 64), F32, F32)
    w = normal(42, (64, 8), F32)
    f = lambda x, b, w: jaxsub.ops.bias_gelu_dropout_dense(x, b, w, rate=0.1, key=jax.random.key(43))
    text = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))).lower(x, bias, w).as_text()
    bwd = [ln for ln in text.splitlines() if "@jaxsub_bias_gelu_dropout_bwd" in ln]
    assert len(bwd) == 1 and "tensor<4x64xf32>, tensor<64xf32>, tensor<" in bwd[0] and bwd[0].rstrip().endswith(
        "tensor<4x64xf32>)"), bwd
    # Without this op the product keeps the op's output: grad of the plain composition
    # asks the bwd target for no y.
    plain = lambda x, b, w: jnp.einsum("...n,ne->...e", op(x, b, rate=0.1, key=jax.random.key(43)), w)
    text = jax.jit(jax.grad(lambda *a: plain(*a).sum(), argnums=(0, 1, 2))).lower(x, bias, w).as_text()
    assert any("@jaxsub_bias_gelu_dropout_bwd" in ln and ln.rstrip().endswith("tensor<0xf32>)")
               for ln in text.splitlines())


def test_dense_bad_kernel():
    x, bias, _ = inputs(44, (4, 16), F32, F32)
    with pytest.raises(ValueError, match="bias_gelu_dropout_dense.*kernel"):
        jaxsub.ops.bias_gelu_dropout_dense(x, bias, jnp.ones((8, 3)), rate=0.0, key=None)
    with pytest.raises(TypeError, match="bias_gelu_dropout_dense.*kernel"):
        jaxsub.ops.bias_gelu_dropout_dense(x, bias, jnp.ones((16, 3), BF16), rate=0.0, key=None)
    # The GELU's own options, checked under the name of the function called.
    w = jnp.ones((16, 3))
    for opts, exc, arg in [(dict(rate=1.5), ValueError, "rate"), (dict(deterministic=None), TypeError, "deterministic"),
                           (dict(kernel_config={"bwd_threads": 48}), ValueError, "kernel_config"),
                           (dict(library_products=1), TypeError, "library_products")]:
        with pytest.raises(exc, match=f"bias_gelu_dropout_dense: `{arg}`"):
            jaxsub.ops.bias_gelu_dropout_dense(x, bias, w, **{"rate": 0.0, "key": None, **opts})
    with pytest.raises(ValueError, match="bias_gelu_dropout_dense: `bias` must have shape"):
        jaxsub.ops.bias_gelu_dropout_dense(x, bias[:3], w, rate=0.0, key=None)


# dense_bias_gelu_dropout: the product before the op in one call (on CPU the target's
# plain loops; on an H200 a GEMM with the GELU epilogue).


def dense_gelu_vjp(x, w, bias, w_out, dout, *, rate, key, approximate, fused=True, library=False):
    def f(x, w, b, w_out):
        if fused:
            return jaxsub.ops.dense_bias_gelu_dropout(x, w, b, rate=rate, key=key, approximate=approximate,
                                                      out_kernel=w_out, library_products=library)
        y = op(reference_dense(x, w), b, rate=rate, key=key, approximate=approximate)
        return y if w_out is None else jnp.einsum("...f,fe->...e", y, w_out)

    out, vjp = jax.vjp(f, x, w, bias, w_out)
    return (out, *vjp(dout))


dense_gelu_vjp_jit = jax.jit(dense_gelu_vjp, static_argnames=("rate", "approximate", "fused", "library"))


def dense_gelu_inputs(seed, lead, e, f, e2, dtype):
    x = normal(seed, (*lead, e), dtype)
    w = normal(seed + 1, (e, f), dtype, scale=2 / math.sqrt(e))
    bias = normal(seed + 2, (f,), dtype)
    w_out = None if e2 is None else normal(seed + 3, (f, e2), dtype, scale=1 / math.sqrt(f))
    dout = normal(seed + 4, (*lead, f if e2 is None else e2), dtype)
    return x, w, bias, w_out, dout


def check_dense_gelu(got, want, dtype, e, f, rows, what=""):
    names = ("out", "dx", "dw", "dbias", "dw_out")
    reductions = (e, f, rows, rows, rows)
    for g, v, name, red in zip(got, want, names, reductions):
        if v is None:
            assert g is None, name
            continue
        assert g.dtype == v.dtype and g.shape == v.shape, name
        assert_close(g, v, dtype, reduction=red, grad=name != "out", what=f"{what}{name}")


@pytest.mark.parametrize("lead,e,f,e2,dtype,rate,approximate", [
    ((2, 5), 24, 40, None, F32, 0.1, False), ((3,), 8, 1000, 16, BF16, 0.25, True),
    ((2, 3), 12, 20, 8, F16, 0.0, False), ((7,), 16, 136, None, BF16, 0.1, False), ((), 9, 5, 3, F32, 0.5, True)])
def test_dense_gelu_matches_product_then_op(lead, e, f, e2, dtype, rate, approximate):
    """Values and gradients equal the product (f32 sums, rounded to x's dtype) followed by
    bias_gelu_dropout (the same dropout mask) and, with out_kernel, the second product."""
    x, w, bias, w_out, dout = dense_gelu_inputs(51, lead, e, f, e2, dtype)
    key = jax.random.key(56)
    got = dense_gelu_vjp_jit(x, w, bias, w_out, dout, rate=rate, key=key, approximate=approximate)
    want = dense_gelu_vjp_jit(x, w, bias, w_out, dout, rate=rate, key=key, approximate=approximate, fused=False)
    check_dense_gelu(got, want, dtype, e, f, max(1, math.prod(lead)))


def test_dense_gelu_with_a_float32_bias_falls_back(fallback_log):
    """A bf16 x with an f32 bias (which bias_gelu_dropout takes) failed in the target's
    handler with an XLA runtime error; it runs as the two ops, with a log line."""
    x, w, _, _, dout = dense_gelu_inputs(81, (3,), 8, 16, None, BF16)
    bias = normal(84, (16,), F32)
    key = jax.random.key(85)
    got = dense_gelu_vjp_jit(x, w, bias, None, dout, rate=0.1, key=key, approximate=False)
    want = dense_gelu_vjp_jit(x, w, bias, None, dout, rate=0.1, key=key, approximate=False, fused=False)
    check_dense_gelu(got, want, BF16, 8, 16, 3)
    assert got[3].dtype == F32
    assert fallback_log == [("dense_bias_gelu_dropout", "the fused GEMM takes the bias in x's dtype")]


def test_dense_gelu_check_grads():
    x, w, bias, w_out, _ = dense_gelu_inputs(61, (3,), 6, 10, 4, F32)
    f = lambda x, w, b, w_out: jaxsub.ops.dense_bias_gelu_dropout(x, w, b, rate=0.2, key=jax.random.key(62),
                                                                  out_kernel=w_out)
    check_grads(f, (x, w, bias, w_out), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)


def test_dense_gelu_targets_in_lowered_hlo():
    """One dense_gelu_fwd target forward (no separate GELU forward); the GELU backward
    kernel writes y again when out_kernel is given."""
    x, w, bias, w_out, _ = dense_gelu_inputs(71, (4,), 16, 32, 8, F32)
    f = lambda x, w, b, w_out: jaxsub.ops.dense_bias_gelu_dropout(x, w, b, rate=0.1, key=jax.random.key(72),
                                                                  out_kernel=w_out).sum()
    text = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3))).lower(x, w, bias, w_out).as_text()
    assert text.count("@jaxsub_dense_gelu_fwd") == 1
    assert "@jaxsub_bias_gelu_dropout_fwd" not in text
    bwd = [ln for ln in text.splitlines() if "@jaxsub_bias_gelu_dropout_bwd" in ln]
    assert len(bwd) == 1 and bwd[0].rstrip().endswith("tensor<4x32xf32>)"), bwd


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(w=jnp.ones((8, 32))), ValueError, "dense_bias_gelu_dropout.*kernel"),
    (dict(w=jnp.ones((16, 32), BF16)), TypeError, "dense_bias_gelu_dropout.*kernel"),
    (dict(bias=jnp.ones((31,))), ValueError, "dense_bias_gelu_dropout.*bias"),
    (dict(x=jnp.ones((4, 16), jnp.int32), w=jnp.ones((16, 32), jnp.int32)), TypeError, "dense_bias_gelu_dropout.*x"),
    (dict(w_out=jnp.ones((31, 8))), ValueError, "dense_bias_gelu_dropout.*out_kernel"),
    (dict(w_out=jnp.ones((32, 8), F16)), TypeError, "dense_bias_gelu_dropout.*out_kernel"),
    (dict(rate=1.0), ValueError, "dense_bias_gelu_dropout: `rate`"),
    (dict(approximate=1), TypeError, "dense_bias_gelu_dropout: `approximate`"),
    (dict(kernel_config={"fwd_elems": 5}), ValueError, "dense_bias_gelu_dropout: `kernel_config`"),
    (dict(library_products="yes"), TypeError, "dense_bias_gelu_dropout: `library_products`")])
def test_dense_gelu_bad_inputs_raise(kwargs, exc, match):
    a = dict(x=jnp.ones((4, 16)), w=jnp.ones((16, 32)), bias=jnp.ones((32,)), w_out=None, rate=0.1)
    a.update(kwargs)
    opts = {k: a[k] for k in ("approximate", "kernel_config", "library_products") if k in a}
    with pytest.raises(exc, match=match):
        jaxsub.ops.dense_bias_gelu_dropout(a["x"], a["w"], a["bias"], rate=a["rate"], key=jax.random.key(0),
                                           out_kernel=a["w_out"], **opts)


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
class TestCuda:
    @pytest.mark.parametrize("lead,e,f,e2,dtype,approximate", [
        ((8, 512), 1024, 4096, 1024, BF16, False), ((8, 512), 1024, 4096, None, F16, True)])
    def test_dense_gelu_epilogue_at_bert_size(self, monkeypatch, lead, e, f, e2, dtype, approximate):
        """The GEMM with the GELU epilogue against the product (XLA, f32 sums) followed by
        the GELU kernel, both on the GPU: values and gradients, the same dropout mask."""
        monkeypatch.setenv("JAXSUB_DENSE_GELU", "1")
        if not _ffi.dense_gelu_sm90():
            pytest.skip("the GEMM with the GELU epilogue needs an sm_90 device and a CUTLASS build")
        x, w, bias, w_out, dout = dense_gelu_inputs(81, lead, e, f, e2, dtype)
        args = (x, w, bias, w_out, dout, jax.random.key(86))
        run = lambda fused: jax.jit(lambda x, w, b, wo, d, k: dense_gelu_vjp(
            x, w, b, wo, d, rate=0.1, key=k, approximate=approximate, fused=fused, library=True))
        compiled = run(True).lower(*args).compile().as_text()
        assert 'custom_call_target="jaxsub_dense_gelu_fwd"' in compiled
        check_dense_gelu(run(True)(*args), run(False)(*args), dtype, e, f, math.prod(lead))

    @pytest.mark.parametrize("quad", ["1", "0"])
    @pytest.mark.parametrize("lead,e,f,e2,dtype,rate", [
        ((333,), 72, 136, 40, F16, 0.1), ((1, 5), 8, 8, None, BF16, 0.3), ((2, 130), 264, 1000, 24, BF16, 0.0),
        ((129,), 1024, 4096, None, BF16, 0.1)])
    def test_dense_gelu_epilogue_matches_cpu(self, monkeypatch, lead, e, f, e2, dtype, rate, quad):
        """Partial tiles in every direction (rows, the product's columns, the contracted
        dim not a multiple of the 64 a tile reads): the GPU's values and gradients as the
        CPU handler's, so every output element is written and the mask is indexed right;
        with the quads sharing Philox calls and (JAXSUB_DENSE_GELU_QUAD=0) without."""
        monkeypatch.setenv("JAXSUB_DENSE_GELU", "1")
        monkeypatch.setenv("JAXSUB_DENSE_GELU_QUAD", quad)
        if not _ffi.dense_gelu_sm90():
            pytest.skip("the GEMM with the GELU epilogue needs an sm_90 device and a CUTLASS build")
        x, w, bias, w_out, dout = dense_gelu_inputs(91, lead, e, f, e2, dtype)
        args = (x, w, bias, w_out, dout, jax.random.key(96))
        run = jax.jit(lambda x, w, b, wo, d, k: dense_gelu_vjp(x, w, b, wo, d, rate=rate, key=k, approximate=False))
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        check_dense_gelu(got, want, dtype, e, f, math.prod(lead))

    @pytest.mark.parametrize("approximate", [False, True])
    def test_dense_cuda_matches_cpu(self, approximate):
        """The backward kernel's second output (the forward's y, written again) at
        BERT-large sizes: gradients as the CPU handlers give them."""
        x, bias, _ = inputs(131, (8, 512, 4096), BF16, BF16)
        w = normal(132, (4096, 1024), BF16, scale=1 / 64)
        dout = normal(133, (8, 512, 1024), BF16)
        args = (x, bias, w, dout, jax.random.key(134))
        run = jax.jit(lambda x, b, w, d, k: dense_vjp(x, b, w, d, rate=0.1, key=k, approximate=approximate))
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        for g, v, what, red in zip(got, want, ("out", "dx", "dbias", "dw"), (4096, 4096, 4096, 4096)):
            assert_close(g, v, BF16, reduction=red, grad=what != "out", what=what)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("approximate", [False, True])
    def test_infinities_and_nan_as_on_cpu(self, dtype, approximate):
        """The kernels give the CPU handler's infinities and NaNs (test_infinities_and_nan)."""
        run = jax.jit(lambda x, b: op(x, b, rate=0.0, key=None, approximate=approximate))
        want = np.asarray(run(*special_values(dtype, jax.devices("cpu")[0])), np.float32)
        got = np.asarray(run(*special_values(dtype, jax.devices()[0])), np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-2, atol=1e-10)

    @pytest.mark.parametrize("approximate", [False, True])
    @pytest.mark.parametrize("dtype,bias_dtype", [(BF16, BF16), (F16, F32)])
    def test_cuda_matches_cpu(self, dtype, bias_dtype, approximate):
        shape = (8 * 512, 4096)
        x, bias, dy = inputs(121, shape, dtype, bias_dtype)
        key = jax.random.key(122)
        run = jax.jit(lambda x, b, dy, k: fused_vjp(x, b, dy, rate=0.1, key=k, approximate=approximate))
        cpu = jax.device_put((x, bias, dy, key), jax.devices("cpu")[0])
        gpu = jax.device_put((x, bias, dy, key), jax.devices()[0])
        want = run(*cpu)
        got = run(*gpu)
        assert all(g.devices() == {jax.devices()[0]} for g in got)
        assert_close(got[0], want[0], dtype, what="y")
        assert_close(got[1], want[1], dtype, grad=True, what="dx")
        assert_close(got[2], want[2], bias_dtype, reduction=shape[0], grad=True, what="dbias")

    def test_exact_gelu_accuracy_on_dense_grid(self):
        # ex2.approx adds up to 2 ulps to the exp2 of the CPU handler.
        err_y, err_dx = exact_gelu_grid_errors(jax.devices()[0])
        assert err_y < 4e-7 and err_dx < 4e-7, (err_y, err_dx)
