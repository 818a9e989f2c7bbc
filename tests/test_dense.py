"""dense (the jaxsub_gemm target): values and gradients against the reference, the
target's transposes and bias, transformations, scans, validation and the fallback."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub import _ffi
from jaxsub.ops.gemm import WORKSPACE_BYTES, dense_and_input, gemm, reference_dense
from jaxsub.testing import assert_close

op = jaxsub.ops.dense
F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
DTYPES = (F32, BF16, F16)


def normal(seed, shape, dtype=F32, scale=1.0):
    v = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(v.astype(np.float32), dtype)


def inputs(seed, lead, k, n, dtype, bias=True):
    x = normal(seed, (*lead, k), dtype)
    w = normal(seed + 1, (k, n), dtype, 1 / math.sqrt(k))
    b = normal(seed + 2, (n,), dtype) if bias else None
    dy = normal(seed + 3, (*lead, n), dtype)
    return x, w, b, dy


def vjp_of(f):
    def run(x, w, b, dy):
        if b is None:
            y, pull = jax.vjp(f, x, w)
        else:
            y, pull = jax.vjp(f, x, w, b)
        return (y, *pull(dy))
    return jax.jit(run)


fused_vjp, reference_vjp = vjp_of(op), vjp_of(reference_dense)


def check(x, w, b, dy):
    got, want = fused_vjp(x, w, b, dy), reference_vjp(x, w, b, dy)
    k, rows = x.shape[-1], x.size // x.shape[-1]
    assert got[0].shape == want[0].shape and got[0].dtype == x.dtype
    assert_close(got[0], want[0], x.dtype, reduction=k, what="y")
    assert_close(got[1], want[1], x.dtype, reduction=w.shape[1], grad=True, what="dx")
    assert_close(got[2], want[2], x.dtype, reduction=rows, grad=True, what="dkernel")
    if b is not None:
        assert_close(got[3], want[3], x.dtype, reduction=rows, grad=True, what="dbias")


CASES = [(lead, k, n, dtype, bias) for dtype in DTYPES for (lead, k, n) in (((1,), 1, 1), ((3,), 5, 7), ((2, 9), 33, 17),
                                                                            ((130,), 64, 96))
         for bias in (True, False)]


@pytest.mark.parametrize("lead,k,n,dtype,bias", CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-{c[1]}-{c[2]}-{c[3].name}-{'b' if c[4] else 'nb'}"
                              for c in CASES])
def test_fwd_and_vjp_match_reference(lead, k, n, dtype, bias):
    check(*inputs(100 + k + 3 * n + DTYPES.index(dtype), lead, k, n, dtype, bias))


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_target_transposes(trans_a, trans_b, dtype):
    m, k, n = 19, 23, 13
    a = normal(7, (k, m) if trans_a else (m, k), dtype)
    b = normal(8, (n, k) if trans_b else (k, n), dtype)
    bias = normal(9, (n,), dtype)
    got = jax.jit(lambda a, b, c: gemm(a, b, c, trans_a=trans_a, trans_b=trans_b))(a, b, bias)
    want = reference_dense(a.T if trans_a else a, b.T if trans_b else b, bias)
    assert_close(got, want, dtype, reduction=k, what="d")


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_target_adds_c(trans_b, bias, dtype):
    """The c operand is added with the bias before the one rounding: d = a b (+ bias) + c."""
    m, k, n = 21, 17, 11
    a, c = normal(71, (m, k), dtype), normal(72, (m, n), dtype)
    b = normal(73, (n, k) if trans_b else (k, n), dtype)
    bv = normal(74, (n,), dtype) if bias else None
    got = jax.jit(lambda a, b, bv, c: gemm(a, b, bv, c, trans_b=trans_b))(a, b, bv, c)
    prod = jnp.matmul(a.astype(F32), (b.T if trans_b else b).astype(F32), precision=jax.lax.Precision.HIGHEST)
    want = (prod + (0 if bv is None else bv.astype(F32)) + c.astype(F32)).astype(dtype)
    assert_close(got, want, dtype, reduction=k, what="d")


def test_target_c_at_k_zero_and_bad_c():
    """K = 0: d = c + bias. A c that is not [M, N] is the target's error, naming c."""
    a, b = jnp.zeros((3, 0), F32), jnp.zeros((0, 4), F32)
    bias, c = normal(75, (4,)), normal(76, (3, 4))
    np.testing.assert_allclose(np.asarray(jax.jit(gemm)(a, b, bias, c)), np.asarray(c + bias), rtol=1e-6)
    with pytest.raises(Exception, match="c must be"):
        jax.block_until_ready(jax.jit(gemm)(normal(77, (3, 5)), normal(78, (5, 4)), None, normal(79, (4, 3))))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dense_and_input_adds_the_other_gradient_in_the_product(dtype):
    """dense_and_input(x, ...) = (dense(x, ...), x): the cotangent of the second output
    (x's other uses) comes back added into dx, by the dx product's c operand (the lowered
    gradient has no add of x-shaped arrays)."""
    x, w, b, dy = inputs(81, (2, 9), 33, 17, dtype)
    dx_other = normal(85, x.shape, dtype)

    def run(f):
        (y, x2), pull = jax.vjp(f, x, w, b)
        return (y, x2, *pull((dy, dx_other)))

    got = jax.jit(lambda: run(dense_and_input))()
    want = jax.jit(lambda: run(lambda x, w, b: (reference_dense(x, w, b), x)))()
    assert_close(got[0], want[0], dtype, reduction=33, what="y")
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(x))
    for g, v, what in zip(got[2:], want[2:], ("dx", "dkernel", "dbias")):
        assert_close(g, v, dtype, reduction=18, grad=True, what=what)
    text = jax.jit(lambda x: run(lambda x, w, b: dense_and_input(x, w, b))[2]).lower(x).as_text()
    assert not [line for line in text.splitlines() if "stablehlo.add" in line and "2x9x33x" in line]
    assert text.count("@jaxsub_gemm") == 1  # dx with c (y and dkernel unused)


def test_exact_on_integers():
    # Small integers in f32: every product and partial sum is exact, so any order agrees.
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.integers(-8, 8, (37, 29)).astype(np.float32))
    w = jnp.asarray(rng.integers(-8, 8, (29, 41)).astype(np.float32))
    b = jnp.asarray(rng.integers(-8, 8, (41,)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(op)(x, w, b)), np.asarray(x) @ np.asarray(w) + np.asarray(b))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_multi_axis_kernels(dtype):
    # The encoder's forms: x [B, S, E] with a [E, 3, H, D] kernel and [3, H, D] bias, and
    # the attention output [B, S, H, D] contracted over (H, D) with an [H, D, E] kernel.
    x, k1, b1, dy1 = (normal(61, (2, 5, 12), dtype), normal(62, (12, 3, 2, 4), dtype, 0.3),
                      normal(63, (3, 2, 4), dtype), normal(64, (2, 5, 3, 2, 4), dtype))
    c, k2, dy2 = normal(65, (2, 5, 2, 4), dtype), normal(66, (2, 4, 12), dtype, 0.3), normal(67, (2, 5, 12), dtype)
    for args, axes in (((x, k1, b1, dy1), 1), ((c, k2, None, dy2), 2)):
        got = vjp_of(lambda *a: op(*a, axes=axes))(*args)
        want = vjp_of(lambda *a: reference_dense(*a, axes=axes))(*args)
        assert got[0].shape == want[0].shape == args[3].shape
        for g, v, what in zip(got, want, ("y", "dx", "dkernel", "dbias")):
            assert g.shape == v.shape, what
            assert_close(g, v, dtype, reduction=12, grad=what != "y", what=what)


def test_check_grads():
    x, w, b, _ = inputs(11, (4,), 6, 5, F32)
    check_grads(op, (x, w, b), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)


def test_vmap_matches_loop():
    x, w, b, dy = inputs(21, (3, 4), 8, 6, F32)
    ws = normal(25, (3, 8, 6))
    got = jax.jit(jax.vmap(lambda x, w, dy: fused_vjp(x, w, b, dy)))(x, ws, dy)
    for i in range(3):
        want = reference_vjp(x[i], ws[i], b, dy[i])
        for g, v, what in zip(got, want, ("y", "dx", "dkernel", "dbias")):
            assert_close(g[i], v, F32, reduction=8, grad=what != "y", what=what)


def _stack_loss(scan):
    def loss(ws, bs, x):
        def body(h, wb):
            return jnp.tanh(op(h, *wb)), None
        h, _ = scan(body, x, (ws, bs))
        return jnp.sum(h.astype(F32) ** 2)
    return loss


@pytest.mark.parametrize("scan", ["lax", "stack"])
def test_in_a_scan_over_stacked_weights(scan):
    # Weights and biases as slices of stacked arrays, their gradients written into stacks:
    # what the op is for. Against the reference op under lax.scan.
    ws, bs, x = normal(31, (3, 24, 24), F32, 0.2), normal(32, (3, 24)), normal(33, (5, 24))
    run = {"lax": jax.lax.scan, "stack": lambda f, c, xs: jaxsub.stack.scan(lambda _, h, x: f(h, x), c, xs, ())}[scan]
    got = jax.jit(jax.value_and_grad(_stack_loss(run), (0, 1, 2)))(ws, bs, x)

    def ref(h, wb):
        return jnp.tanh(reference_dense(h, *wb)), None
    want = jax.jit(jax.value_and_grad(lambda ws, bs, x: jnp.sum(jax.lax.scan(ref, x, (ws, bs))[0] ** 2),
                                      (0, 1, 2)))(ws, bs, x)
    assert_close(got[0], want[0], F32, reduction=120, what="loss")
    for g, v, what in zip(got[1], want[1], ("dws", "dbs", "dx")):
        assert_close(g, v, F32, reduction=120, grad=True, what=what)


def test_lowering_has_the_target_and_unbarriered_gradients():
    x, w, b, dy = inputs(41, (4,), 16, 8, BF16)
    fwd = jax.jit(op).lower(x, w, b).as_text()
    bwd = jax.jit(jax.grad(lambda x, w, b: (op(x, w, b).astype(F32) ** 2).sum(), (0, 1, 2))).lower(x, w, b).as_text()
    assert "@jaxsub_gemm" in fwd and "optimization_barrier" in fwd
    assert bwd.count("@jaxsub_gemm") == 3  # forward, dx, dkernel
    assert "jaxsub_bias_grad" in bwd
    # Barriers on the forward's result and the bias gradient's, none on dx and dkernel.
    assert bwd.count("optimization_barrier") == 2


def _bad_cases():
    x, w = normal(91, (4, 8)), normal(92, (8, 3))
    return [
        ("x-rank0", dict(x=jnp.float32(1.0), kernel=w), ValueError, "`x`"),
        ("x-int", dict(x=jnp.ones((4, 8), jnp.int32), kernel=w), TypeError, "`x`"),
        ("kernel-rank", dict(x=x, kernel=normal(0, (8,))), ValueError, "`kernel`"),
        ("axes-0", dict(x=x, kernel=w, axes=0), ValueError, "`axes`"),
        ("axes-above-x", dict(x=x, kernel=normal(0, (4, 8, 8, 3)), axes=3), ValueError, "`x`"),
        ("axes-2-mismatch", dict(x=normal(0, (2, 4, 8)), kernel=normal(0, (8, 4, 3)), axes=2), ValueError,
         "`kernel`"),
        ("kernel-k", dict(x=x, kernel=normal(0, (7, 3))), ValueError, "`kernel`"),
        ("kernel-dtype", dict(x=x, kernel=w.astype(BF16)), TypeError, "`kernel`"),
        ("bias-shape", dict(x=x, kernel=w, bias=normal(0, (4,))), ValueError, "`bias`"),
        ("bias-dtype", dict(x=x, kernel=w, bias=normal(0, (3,), BF16)), TypeError, "`bias`"),
    ]


@pytest.mark.parametrize("name,kwargs,exc,arg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_naming_op_and_argument(name, kwargs, exc, arg):
    with pytest.raises(exc, match="jaxsub.dense") as info:
        op(**kwargs)
    assert arg in str(info.value)


def test_zero_size_falls_back(fallback_log):
    x, w, b, dy = inputs(111, (0,), 8, 3, F32)
    y, dx, dw, db = fused_vjp(x, w, b, dy)
    assert y.shape == (0, 3) and dx.shape == x.shape and not np.asarray(dw).any() and not np.asarray(db).any()
    assert ("dense", "zero-size input") in fallback_log


def test_gemm_tunings_record_each_timed_shape(monkeypatch):
    """`_ffi.gemm_tunings` lists what `gemm_tune` timed (the encoder benchmark writes it to
    its JSON): the shape, the pick and each candidate's time, once per shape."""
    class FakeC:
        calls = 0

        @staticmethod
        def gemm_tune(*args):
            FakeC.calls += 1
            return 2, [3.0, 2.5, 1.0]

    monkeypatch.setattr(_ffi, "cuda_available", lambda: True)
    monkeypatch.setattr(_ffi, "_C", FakeC)
    monkeypatch.setattr(_ffi, "_TUNINGS", {})
    _ffi.gemm_tune.cache_clear()
    try:
        for _ in range(2):
            assert _ffi.gemm_tune("bfloat16", 64, 32, 16, False, True, True, False, 1024) == (2, (3.0, 2.5, 1.0))
        _ffi.gemm_tune("float16", 8, 8, 8, True, False, False, True, 1024)
        assert FakeC.calls == 2
        assert _ffi.gemm_tunings() == [
            {"dtype": "bfloat16", "m": 64, "n": 32, "k": 16, "trans_a": False, "trans_b": True, "bias": True,
             "c": False, "index": 2, "times_us": [3.0, 2.5, 1.0]},
            {"dtype": "float16", "m": 8, "n": 8, "k": 8, "trans_a": True, "trans_b": False, "bias": False,
             "c": True, "index": 2, "times_us": [3.0, 2.5, 1.0]}]
    finally:
        _ffi.gemm_tune.cache_clear()  # the fake's results must not outlive the test


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
class TestCuda:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 33, 5), (130, 72, 18), (257, 1023, 129)])
    def test_cuda_matches_reference(self, dtype, m, k, n):
        for bias in (True, False):
            check(*jax.device_put(inputs(200 + m + k + n, (m,), k, n, dtype, bias), jax.devices()[0]))

    @pytest.mark.parametrize("k,n", [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)])
    def test_bert_shapes(self, k, n):
        check(*jax.device_put(inputs(300 + n, (8, 512), k, n, BF16), jax.devices()[0]))

    @pytest.mark.parametrize("m,k,n", [(7, 33, 5), (4096, 3072, 1024)])
    def test_cuda_c_matches_cpu(self, m, k, n):
        """The c operand (cuBLASLt's C, beta = 1), as the dx product of a post-LN layer's
        q/k/v projection uses it (dense_and_input), against the CPU handler; its algorithm
        is timed as a shape of its own."""
        a, b, c = normal(21, (m, k), BF16), normal(22, (n, k), BF16, 1 / math.sqrt(k)), normal(23, (m, n), BF16)
        f = jax.jit(lambda a, b, c: gemm(a, b, None, c, trans_b=True))
        got = f(*jax.device_put((a, b, c), jax.devices()[0]))
        want = f(*jax.device_put((a, b, c), jax.devices("cpu")[0]))
        assert_close(got, want, BF16, reduction=k, what="d")
        index, times = _ffi.gemm_tune("bfloat16", m, n, k, False, True, False, True, WORKSPACE_BYTES)
        assert index >= 0 and len(times) >= 1

    @pytest.mark.parametrize("trans_a", [False, True])
    @pytest.mark.parametrize("trans_b", [False, True])
    def test_cuda_transposes_match_cpu(self, trans_a, trans_b):
        m, k, n = 67, 129, 45
        a = normal(17, (k, m) if trans_a else (m, k), BF16)
        b = normal(18, (n, k) if trans_b else (k, n), BF16)
        bias = normal(19, (n,), BF16)
        f = jax.jit(lambda a, b, c: gemm(a, b, c, trans_a=trans_a, trans_b=trans_b))
        got = f(*jax.device_put((a, b, bias), jax.devices()[0]))
        want = f(*jax.device_put((a, b, bias), jax.devices("cpu")[0]))
        assert_close(got, want, BF16, reduction=k, what="d")

    def test_tuned_algorithm_is_timed_and_used(self):
        """Tracing a product times cuBLASLt's candidates for its shape once (cuda/gemm.h):
        a choice in the heuristic's order, timed, no slower than the heuristic's first;
        the call then runs it, with the reference's values."""
        x, w, b, dy = inputs(401, (8, 512), 1024, 4096, BF16)
        check(*jax.device_put((x, w, b, dy), jax.devices()[0]))
        index, times = _ffi.gemm_tune("bfloat16", 8 * 512, 4096, 1024, False, False, True, False, WORKSPACE_BYTES)
        assert index >= 0 and len(times) >= 1 and index < len(times)
        if len(times) > 1:
            assert 0 < times[index] <= times[0]

    @pytest.mark.parametrize("n", [130, 256])
    def test_scan_reads_slices_in_place(self, n):
        """A 12-layer stack.scan over stacked weights and biases (at n = 130 a layer's
        bias starts 260 bytes after the last: not 16-byte aligned, so the bias is added
        after the product, and the weights 8-byte aligned): same values as the reference
        under lax.scan, and the compiled step runs the target inside XLA's dynamic-slice
        fusion, on the stacks' slices in place."""
        layers = 12
        ws, bs, x = normal(51, (layers, n, n), BF16, 1 / math.sqrt(n)), normal(52, (layers, n), BF16), \
            normal(53, (256, n), BF16)
        args = jax.device_put((ws, bs, x), jax.devices()[0])
        scan = lambda f, c, xs: jaxsub.stack.scan(lambda _, h, x: f(h, x), c, xs, ())  # noqa: E731
        step = jax.jit(jax.value_and_grad(_stack_loss(scan), (0, 1, 2)))
        got = step(*args)

        def ref(h, wb):
            return jnp.tanh(reference_dense(h, *wb)), None
        want = jax.jit(jax.value_and_grad(lambda ws, bs, x: jnp.sum(jax.lax.scan(ref, x, (ws, bs))[0].astype(F32) ** 2),
                                          (0, 1, 2)))(*args)
        assert_close(got[0], want[0], BF16, reduction=256 * n, what="loss")
        for g, v, what in zip(got[1], want[1], ("dws", "dbs", "dx")):
            assert_close(g, v, BF16, reduction=256 * n, grad=True, what=what)
        text = step.lower(*args).compile().as_text()
        fusions = [c for c in text.split("\n\n") if "dynamic-slice-fusion" in c.split("\n")[0] and "jaxsub_gemm" in c]
        assert fusions, "no jaxsub_gemm inside a dynamic-slice fusion"
