"""bias_add: the forward (plain XLA) against its reference, the gradient through the
jaxsub_bias_grad target, transformations, validation and the fallback path."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub import _ffi
from jaxsub.ops.bias import reference_bias_add
from jaxsub.testing import assert_close

op = jaxsub.ops.bias_add
F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
DTYPES = (F32, BF16, F16)
# Bias shapes: odd and vector-aligned column counts, and the [3, H, D] bias of a packed
# q/k/v projection (3072 columns).
BIASES = ((1,), (3,), (130,), (1000,), (3, 16, 64))


def normal(seed, shape, dtype=F32, scale=1.0):
    """Fresh standard-normal draws (never zeros) in `dtype`."""
    v = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(v.astype(np.float32), dtype)


def inputs(seed, lead, bias_shape, dtype, bias_dtype):
    """x [*lead, *bias_shape], bias, dy (x's shape and dtype)."""
    shape = tuple(lead) + tuple(bias_shape)
    return normal(seed, shape, dtype, 2.0), normal(seed + 1, bias_shape, bias_dtype), normal(seed + 2, shape, dtype)


def fused_vjp(x, bias, dy):
    y, vjp = jax.vjp(op, x, bias)
    return (y, *vjp(dy))


def reference_vjp(x, bias, dy):
    y, vjp = jax.vjp(reference_bias_add, x, bias)
    return (y, *vjp(dy))


fused_vjp_jit = jax.jit(fused_vjp)
reference_vjp_jit = jax.jit(reference_vjp)


def check_against_reference(x, bias, dy):
    got = fused_vjp_jit(x, bias, dy)
    want = reference_vjp_jit(x, bias, dy)
    rows = x.size // bias.size
    assert got[0].dtype == x.dtype and got[1].dtype == x.dtype and got[2].dtype == bias.dtype
    assert got[2].shape == bias.shape
    # The forward is the reference's arithmetic (f32 add, one rounding) and dx is dy.
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(dy, np.float32))
    assert_close(got[2], want[2], bias.dtype, reduction=rows, grad=True, what="dbias")


# Every bias shape with every dtype (bias in x's dtype), one leading row, a few, and many.
CASES = [(b, dtype, lead) for b in BIASES for dtype in DTYPES for lead in ((1,), (2, 3))]
CASES += [(b, BF16, (8, 64)) for b in ((130,), (3, 16, 64))] + [((1000,), F16, (300,))]


@pytest.mark.parametrize("bias_shape,dtype,lead", CASES,
                         ids=[f"{'x'.join(map(str, b))}-{d.name}-{'x'.join(map(str, l))}" for b, d, l in CASES])
def test_fwd_and_vjp_match_reference(bias_shape, dtype, lead):
    seed = 1000 + math.prod(bias_shape) * 7 + DTYPES.index(dtype) + 31 * math.prod(lead)
    check_against_reference(*inputs(seed, lead, bias_shape, dtype, dtype))


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("bias_shape", [(3,), (1000,), (3, 16, 64)])
def test_f32_bias_with_16bit_x(bias_shape, dtype):
    x, bias, dy = inputs(2000 + math.prod(bias_shape), (4, 5), bias_shape, dtype, F32)
    check_against_reference(x, bias, dy)
    # The f32 bias is added in f32, not rounded to x's dtype first.
    y = np.asarray(op(x, bias), np.float32)
    rounded_first = np.asarray(x + bias.astype(dtype), np.float32)
    assert not np.array_equal(y, rounded_first)


def test_bias_as_large_as_x():
    # bias.shape == x.shape: R = 1, dbias = dy.
    x, bias, dy = inputs(2100, (), (4, 130), BF16, F32)
    check_against_reference(x, bias, dy)
    _, _, dbias = fused_vjp_jit(x, bias, dy)
    np.testing.assert_array_equal(np.asarray(dbias), np.asarray(dy, np.float32))


def test_dbias_is_the_exact_column_sum():
    # Integers in f32: every partial sum is exact, so any summation order gives the same bits.
    x = jnp.zeros((257, 3, 7), F32)
    dy = jnp.asarray(np.random.default_rng(5).integers(-1000, 1000, x.shape).astype(np.float32))
    _, _, dbias = fused_vjp_jit(x, normal(6, (3, 7)), dy)
    np.testing.assert_array_equal(np.asarray(dbias), np.asarray(dy).sum(axis=0))


@pytest.mark.parametrize("lead,bias_shape", [((3,), (5,)), ((2, 3), (3, 4))])
def test_check_grads(lead, bias_shape):
    x, bias, _ = inputs(11, lead, bias_shape, F32, F32)
    check_grads(op, (x, bias), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)


def test_grad_of_a_loss_under_jit():
    x, bias, dy = inputs(15, (6,), (3, 10), BF16, F32)
    grad = lambda f: jax.jit(jax.grad(lambda x, b: jnp.sum(f(x, b).astype(F32) * dy.astype(F32)), (0, 1)))
    got = grad(op)(x, bias)
    want = grad(reference_bias_add)(x, bias)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    assert_close(got[1], want[1], F32, reduction=6, grad=True, what="dbias")


def test_vmap_over_x_matches_loop():
    # Per-example vjp: the batch axis must not be summed into dbias.
    x, bias, dy = inputs(21, (3, 4), (3, 16, 8), BF16, F32)
    got = jax.jit(jax.vmap(lambda x, dy: fused_vjp(x, bias, dy)))(x, dy)
    assert got[2].shape == (3, 3, 16, 8)
    for i in range(x.shape[0]):
        want = fused_vjp_jit(x[i], bias, dy[i])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g[i], np.float32), np.asarray(w, np.float32))
        assert_close(got[2][i], reference_vjp_jit(x[i], bias, dy[i])[2], F32, reduction=4, grad=True)


def test_vmap_over_bias_and_over_a_middle_axis():
    # Batched bias (x shared: its gradient sums the examples' dy), then x batched along
    # axis 1 with the bias shared (dbias sums over every example and row).
    x, _, dy = inputs(23, (5,), (2, 7), F32, F32)
    biases = normal(24, (4, 2, 7))
    dys = normal(25, (4, 5, 2, 7))
    y, (dx, dbias) = jax.jit(jax.vmap(lambda b, d: (op(x, b), jax.vjp(op, x, b)[1](d)), in_axes=(0, 0),
                                      out_axes=0))(biases, dys)
    for i in range(4):
        ry, rdx, rdb = reference_vjp_jit(x, biases[i], dys[i])
        np.testing.assert_array_equal(np.asarray(y[i]), np.asarray(ry))
        np.testing.assert_array_equal(np.asarray(dx[i]), np.asarray(rdx))
        assert_close(dbias[i], rdb, F32, reduction=5, grad=True, what=f"dbias[{i}]")

    xs = normal(26, (5, 3, 2, 7))  # batch axis 1 of size 3
    bias = normal(27, (2, 7))
    loss = lambda f: lambda x, b: jnp.sum(jax.vmap(f, in_axes=(1, None), out_axes=1)(x, b) * dy[:, None])
    got = jax.jit(jax.grad(loss(op), (0, 1)))(xs, bias)
    want = jax.jit(jax.grad(loss(reference_bias_add), (0, 1)))(xs, bias)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert_close(got[1], want[1], F32, reduction=15, grad=True, what="dbias")
    assert "jaxsub_bias_grad" in jax.jit(jax.grad(loss(op), (0, 1))).lower(xs, bias).as_text()


def test_target_only_in_the_backward_hlo():
    x, bias, _ = inputs(41, (4,), (3, 16, 64), BF16, BF16)
    fwd = jax.jit(op).lower(x, bias).as_text()
    bwd = jax.jit(jax.grad(lambda x, b: op(x, b).astype(F32).sum(), (0, 1))).lower(x, bias).as_text()
    assert "jaxsub_" not in fwd
    assert "jaxsub_bias_grad" in bwd


def _bad_cases():
    x = normal(91, (4, 8))
    b = normal(92, (8,))
    return [
        ("x-rank0", dict(x=jnp.float32(1.0), bias=normal(0, (1,))), ValueError, "`x`"),
        ("x-int", dict(x=jnp.ones((4, 8), jnp.int32), bias=b), TypeError, "`x`"),
        ("bias-rank0", dict(x=x, bias=jnp.float32(1.0)), ValueError, "`bias`"),
        ("bias-len", dict(x=x, bias=normal(0, (9,))), ValueError, "`bias`"),
        ("bias-not-suffix", dict(x=x, bias=normal(0, (4,))), ValueError, "`bias`"),
        ("bias-rank-above-x", dict(x=x, bias=normal(0, (1, 4, 8))), ValueError, "`bias`"),
        ("bias-dtype", dict(x=x.astype(BF16), bias=b.astype(F16)), TypeError, "`bias`"),
        ("bias-f32-x-bias-f16", dict(x=x, bias=b.astype(F16)), TypeError, "`bias`"),
        ("bias-int", dict(x=x, bias=jnp.ones((8,), jnp.int32)), TypeError, "`bias`"),
    ]


@pytest.mark.parametrize("name,kwargs,exc,arg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_naming_op_and_argument(name, kwargs, exc, arg):
    with pytest.raises(exc, match="jaxsub.bias_add") as info:
        jax.jit(op).lower(kwargs["x"], kwargs["bias"])
    assert arg in str(info.value)


@pytest.mark.parametrize("lead,bias_shape", [((0,), (16,)), ((3,), (0,)), ((2, 0), (4, 5))])
def test_zero_size_falls_back(lead, bias_shape, fallback_log):
    x, bias, dy = inputs(111, lead, bias_shape, F32, F32)
    y, dx, dbias = fused_vjp_jit(x, bias, dy)
    assert y.shape == x.shape and dx.shape == x.shape and dbias.shape == bias.shape
    assert not np.asarray(dbias).any()
    assert fallback_log == [("bias_add", "zero-size input")]


def test_bias_above_max_cols_falls_back(fallback_log):
    x, bias, dy = inputs(121, (2,), (3, 8192), BF16, F32)
    grad = jax.jit(jax.grad(lambda x, b: op(x, b).astype(F32).sum(), (0, 1)))
    assert "jaxsub_bias_grad" not in grad.lower(x, bias).as_text()
    assert fallback_log and fallback_log[0][0] == "bias_add" and "24576" in fallback_log[0][1]
    check_against_reference(x, bias, dy)


@pytest.mark.parametrize("bias_shape", [(3, 4, 8), (3, 8192)], ids=["column-sum", "above-max-cols"])
def test_bias_grad_sums_the_leading_dims_in_f32(bias_shape):
    """bias_grad, the helper other ops' backward rules call (attention_projected): the fused
    column sum where the bias fits, XLA's reduction above MAX_COLS; both the f32 sum."""
    from jaxsub.ops.bias import bias_grad
    dy = jnp.asarray(np.random.default_rng(5).standard_normal((2, 7, *bias_shape)), BF16)
    like = jax.ShapeDtypeStruct(bias_shape, BF16)
    text = jax.jit(lambda dy: bias_grad(dy, like)).lower(dy).as_text()
    assert ("jaxsub_bias_grad" in text) == (math.prod(bias_shape) <= _ffi.MAX_COLS)
    got = bias_grad(dy, like)
    assert got.shape == bias_shape and got.dtype == BF16
    assert_close(got, jnp.sum(dy.astype(F32), axis=(0, 1)).astype(BF16), BF16, reduction=14, grad=True)


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
class TestCuda:
    @pytest.mark.parametrize("lead,bias_shape,dtype,bias_dtype", [
        ((8, 512), (3, 16, 64), BF16, BF16),    # BERT-large q/k/v bias, b8 x s512
        ((8, 512), (3, 16, 64), BF16, F32),
        ((4096,), (1024,), F16, F16),
        ((4096,), (1000,), BF16, BF16),         # general (scalar) path
        ((37,), (3,), F16, F32),
        ((1,), (130,), F32, F32),               # one row
        ((3,), (16383,), F32, F32),
        ((300,), (16384,), BF16, F32),          # widest row the kernel takes
        ((100_000,), (8,), BF16, BF16),         # many rows, few columns
    ])
    def test_cuda_matches_cpu_and_is_deterministic(self, lead, bias_shape, dtype, bias_dtype):
        x, bias, dy = inputs(131, lead, bias_shape, dtype, bias_dtype)
        cpu = jax.device_put((x, bias, dy), jax.devices("cpu")[0])
        gpu = jax.device_put((x, bias, dy), jax.devices()[0])
        run = jax.jit(fused_vjp)
        want = run(*cpu)
        got = run(*gpu)
        again = run(*gpu)
        assert all(g.devices() == {jax.devices()[0]} for g in got)
        assert "jaxsub_bias_grad" in run.lower(*gpu).as_text()
        assert_close(got[0], want[0], dtype, what="y")
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(dy, np.float32))
        assert_close(got[2], want[2], bias_dtype, reduction=math.prod(lead), grad=True, what="dbias")
        np.testing.assert_array_equal(np.asarray(again[2], np.float32), np.asarray(got[2], np.float32))
