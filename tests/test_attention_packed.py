"""attention_packed: self-attention on one [B, S, 3, H, D] or [3, B, S, H, D] array equals
attention on its three slices (outputs and the gradient, both implementations, masks,
causal, dropout), its fused path lowers to the packed targets, check_grads, vmap,
validation; on the GPU, the packed CUDA kernels against the CPU handlers and against the
separate-tensor kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub.testing import assert_close
from test_attention import BF16, F16, F32, IMPLEMENTATIONS, make_mask, normal

op = jaxsub.ops.attention_packed


def packed_inputs(seed, b, s, h, d, dtype, axis):
    """qkv with the 3 on `axis` (q scaled up: peaked softmax rows) and a cotangent [B, S, H, D]."""
    rng = np.random.default_rng(seed)
    qkv = normal(rng, (b, s, 3, h, d), dtype)
    qkv = qkv * jnp.asarray([2.0, 1.0, 1.0], dtype)[:, None, None]
    if axis == 0:
        qkv = jnp.moveaxis(qkv, 2, 0)
    return qkv, normal(rng, (b, s, h, d), dtype)


def split(qkv, axis):
    return tuple(jax.lax.index_in_dim(qkv, i, axis, keepdims=False) for i in range(3))


def packed_vjp(qkv, dout, mask, key, *, axis, causal, rate, implementation, broadcast=False):
    f = lambda qkv: op(qkv, axis=axis, mask=mask, causal=causal, dropout_rate=rate, key=key,
                       implementation=implementation, broadcast_dropout=broadcast)
    out, vjp = jax.vjp(f, qkv)
    return out, vjp(dout)[0]


def sliced_vjp(qkv, dout, mask, key, *, axis, causal, rate, implementation, broadcast=False):
    """attention on the slices of qkv; the gradient with respect to qkv."""
    f = lambda qkv: jaxsub.ops.attention(*split(qkv, axis), mask=mask, causal=causal, dropout_rate=rate, key=key,
                                         implementation=implementation, broadcast_dropout=broadcast)
    out, vjp = jax.vjp(f, qkv)
    return out, vjp(dout)[0]


_STATIC = ("axis", "causal", "rate", "implementation", "broadcast")
packed_vjp_jit = jax.jit(packed_vjp, static_argnames=_STATIC)
sliced_vjp_jit = jax.jit(sliced_vjp, static_argnames=_STATIC)

# (S, H, D, dtype, mask, causal, rate)
CASES = [
    (1, 1, 8, F32, None, False, 0.0),
    (7, 3, 8, F32, "padding", True, 0.1),
    (130, 1, 64, BF16, "additive", False, 0.1),
    (128, 3, 8, F16, None, True, 0.0),
    (130, 3, 8, F32, "bool4d", False, 0.2),
    (7, 3, 8, BF16, "headkeys", True, 0.1),
]


@pytest.mark.parametrize("axis", [2, 0])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_broadcast_dropout_equals_attention_on_the_slices(implementation, axis):
    """One mask for every batch and head (broadcast_dropout), as `attention` draws it."""
    qkv, dout = packed_inputs(9, 2, 13, 3, 8, F32, axis)
    kw = dict(axis=axis, causal=True, rate=0.3, implementation=implementation, broadcast=True)
    mask, key = make_mask("padding", 10, 2, 3, 13, 13), jax.random.key(11)
    got, want = packed_vjp_jit(qkv, dout, mask, key, **kw), sliced_vjp_jit(qkv, dout, mask, key, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("s,h,d,dtype,mask_kind,causal,rate", CASES,
                         ids=[f"s{c[0]}-h{c[1]}-d{c[2]}-{c[3].name}-{c[4]}-{'causal' if c[5] else 'full'}-p{c[6]}"
                              for c in CASES])
@pytest.mark.parametrize("axis", [2, 0])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_equals_attention_on_the_slices(implementation, axis, s, h, d, dtype, mask_kind, causal, rate):
    # The CPU handlers run the same loops with other strides, and the unfused path the same
    # graph: the results are identical, not merely close.
    b = 2
    qkv, dout = packed_inputs(s * 100 + d, b, s, h, d, dtype, axis)
    mask = make_mask(mask_kind, s + 1, b, h, s, s)
    key = jax.random.key(s + 2)
    kw = dict(axis=axis, causal=causal, rate=rate, implementation=implementation)
    out, dqkv = packed_vjp_jit(qkv, dout, mask, key, **kw)
    want_out, want_dqkv = sliced_vjp_jit(qkv, dout, mask, key, **kw)
    assert out.shape == (b, s, h, d) and out.dtype == dtype
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(dqkv, np.float32), np.asarray(want_dqkv, np.float32))
    assert bool(jnp.all(jnp.isfinite(dqkv.astype(F32))))


@pytest.mark.parametrize("axis", [2, 0])
def test_fused_lowers_to_the_packed_targets(axis):
    qkv, _ = packed_inputs(0, 2, 7, 3, 8, BF16, axis)
    f = lambda qkv: op(qkv, axis=axis, dropout_rate=0.1, key=jax.random.key(0), implementation="fused")
    hlo = jax.jit(jax.grad(lambda x: f(x).astype(F32).sum())).lower(qkv).as_text()
    assert "jaxsub_attention_qkv_fwd" in hlo and "jaxsub_attention_qkv_bwd" in hlo
    assert "jaxsub_attention_fwd" not in hlo and "jaxsub_attention_bwd" not in hlo
    unfused = jax.jit(lambda x: op(x, axis=axis, implementation="unfused")).lower(qkv).as_text()
    assert "jaxsub_softmax_dropout_fwd" in unfused and "jaxsub_attention_qkv" not in unfused


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_check_grads_fused_packed(rate):
    qkv, _ = packed_inputs(3, 1, 5, 2, 4, F32, 2)
    key = jax.random.key(4)
    mask = jnp.asarray([[True, True, False, True, True]])
    f = lambda x: op(x, mask=mask, causal=True, dropout_rate=rate, key=key, implementation="fused")
    check_grads(f, (qkv,), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_extra_leading_axis_matches_loop(implementation):
    qkv = jnp.stack([packed_inputs(10 + i, 2, 7, 3, 8, F32, 0)[0] for i in range(3)])
    keys = jax.random.split(jax.random.key(5), 3)
    f = lambda x, k: op(x, axis=0, causal=True, dropout_rate=0.2, key=k, implementation=implementation)
    got = jax.vmap(f)(qkv, keys)
    for i in range(3):
        assert_close(got[i], f(qkv[i], keys[i]), F32, reduction=7, what=f"vmap element {i}")


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(qkv=np.zeros((2, 7, 3, 8), np.float32)), ValueError, ["attention_packed", "qkv", "rank 5"]),
    (dict(qkv=np.zeros((2, 7, 3, 3, 8), np.float32), axis=1), ValueError, ["attention_packed", "axis"]),
    (dict(qkv=np.zeros((2, 7, 4, 3, 8), np.float32)), ValueError, ["attention_packed", "qkv", "size 3"]),
    (dict(qkv=np.zeros((3, 2, 7, 3, 8), np.float32), axis=2), ValueError, ["attention_packed", "qkv", "size 3"]),
    (dict(qkv=np.zeros((2, 7, 3, 3, 8), np.int32)), TypeError, ["attention_packed", "qkv", "int32"]),
    (dict(qkv=np.zeros((2, 7, 3, 3, 8), np.float32), dropout_rate=0.1), ValueError, ["attention_packed", "key"]),
    (dict(qkv=np.zeros((2, 7, 3, 3, 8), np.float32), mask=np.ones((2, 6), bool)), ValueError,
     ["attention_packed", "mask"]),
])
def test_bad_inputs_raise_naming_op_and_argument(kwargs, exc, words):
    kwargs = dict(kwargs)
    qkv = kwargs.pop("qkv")
    with pytest.raises(exc) as info:
        op(qkv, **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
class TestCuda:
    """The packed CUDA kernels against the CPU handlers (same inputs, key, mask) and
    against the separate-tensor CUDA kernels. "fused" must run the packed kernels."""

    @staticmethod
    def _cuda_vs_cpu(b, s, h, d, axis, *, causal, rate, dtype=BF16, mask_kind=None, seed=141, broadcast=False):
        qkv, dout = packed_inputs(seed, b, s, h, d, dtype, axis)
        mask = make_mask(mask_kind, seed + 1, b, h, s, s)
        key = jax.random.key(seed + 2)
        run = jax.jit(lambda qkv, dout, mask, key: packed_vjp(qkv, dout, mask, key, axis=axis, causal=causal,
                                                              rate=rate, implementation="fused", broadcast=broadcast))
        args = (qkv, dout, mask, key)
        hlo = run.lower(*args).as_text()
        assert "jaxsub_attention_qkv_fwd" in hlo and "jaxsub_attention_qkv_bwd" in hlo, "packed kernel did not run"
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        assert_close(got[0], want[0], dtype, reduction=s, what="out")
        for i, name in enumerate(("dq", "dk", "dv")):
            g, w = (jax.lax.index_in_dim(x, i, axis, keepdims=False) for x in (got[1], want[1]))
            assert_close(g, w, dtype, reduction=s, grad=True, what=name)

    @pytest.mark.parametrize("axis", [2, 0])
    def test_bert_large_dropout_matches_cpu(self, axis):
        self._cuda_vs_cpu(8, 512, 16, 64, axis, causal=False, rate=0.1, mask_kind="padding")

    @pytest.mark.parametrize("d", [32, 64, 128])
    @pytest.mark.parametrize("s,mask_kind,causal,axis", [
        (1, None, False, 2), (7, "padding", True, 0), (130, "additive", False, 2), (65, "bool4d", True, 0),
        (130, "headkeys", True, 2), (200, None, True, 0)])
    def test_odd_sizes_match_cpu(self, s, mask_kind, causal, axis, d):
        self._cuda_vs_cpu(2, s, 3, d, axis, causal=causal, rate=0.1, dtype=F16 if d == 32 else BF16,
                          mask_kind=mask_kind, seed=s * 10 + d)

    @pytest.mark.parametrize("axis", [2, 0])
    def test_broadcast_dropout_matches_cpu(self, axis):
        self._cuda_vs_cpu(2, 200, 3, 64, axis, causal=True, rate=0.1, mask_kind="padding", broadcast=True)

    @pytest.mark.parametrize("axis", [2, 0])
    def test_packed_equals_separate_kernels(self, axis):
        # Same kernels, other strides: out, dk and dv are bitwise equal; dq adds f32
        # atomics in a nondeterministic order, so it is compared within tolerance.
        b, s, h, d = 4, 384, 8, 64
        qkv, dout = packed_inputs(151, b, s, h, d, BF16, axis)
        mask = make_mask("padding", 152, b, h, s, s)
        key = jax.random.key(153)
        kw = dict(axis=axis, causal=True, rate=0.1, implementation="fused")
        out, dqkv = packed_vjp_jit(qkv, dout, mask, key, **kw)
        want_out, want_dqkv = sliced_vjp_jit(qkv, dout, mask, key, **kw)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
        g, w = split(dqkv, axis), split(want_dqkv, axis)
        assert_close(g[0], w[0], BF16, reduction=s, grad=True, what="dq")
        for name, x, y in zip(("dk", "dv"), g[1:], w[1:]):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=name)
