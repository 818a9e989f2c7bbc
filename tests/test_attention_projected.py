"""attention_projected: self-attention on x's three projections equals `attention` on
x·W_q + b_q, x·W_k + b_k, x·W_v + b_v (outputs and the gradients of x, the weights and the
biases; both implementations, masks, causal, dropout), its fused path lowers to the
forward and the packed-gradient backward targets, that backward target equals
`attention_bwd` (CPU; GPU), check_grads, vmap, validation; on the GPU, the op against the
CPU handlers at BERT shapes and odd sizes."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsub
from jaxsub.testing import assert_close
from test_attention import BF16, F16, F32, IMPLEMENTATIONS, make_mask, normal

op = jaxsub.ops.attention_projected
attn_calls = importlib.import_module("jaxsub.ops.attn_calls")
_dropout = importlib.import_module("jaxsub.ops.dropout")
_masks = importlib.import_module("jaxsub.ops.masks")


def inputs(seed, b, s, e, h, d, dtype, bias=True):
    """x, three weights (scaled so that the scores are O(1) to O(10)), three biases and an
    output cotangent."""
    rng = np.random.default_rng(seed)
    x = normal(rng, (b, s, e), dtype)
    ws = tuple(normal(rng, (e, h, d), dtype) * jnp.asarray(scale / np.sqrt(e), dtype) for scale in (3.0, 1.0, 1.0))
    bs = tuple(normal(rng, (h, d), dtype) for _ in range(3)) if bias else None
    return x, ws, bs, normal(rng, (b, s, h, d), dtype)


def on_projections(x, ws, bs, **kw):
    """`attention` on the three projections, written as a user would."""
    q, k, v = (jnp.einsum("bse,ehd->bshd", x, w) + (0 if bs is None else b)
               for w, b in zip(ws, bs if bs is not None else (None,) * 3))
    return jaxsub.ops.attention(q, k, v, **kw)


def vjp(f, x, ws, bs, dout, **kw):
    out, pull = jax.vjp(lambda x, ws, bs: f(x, ws, bs, **kw), x, ws, bs)
    return out, pull(dout)


_STATIC = ("causal", "dropout_rate", "implementation", "broadcast_dropout")
projected_vjp = jax.jit(lambda *a, **kw: vjp(op, *a, **kw), static_argnames=_STATIC)
reference_vjp = jax.jit(lambda *a, **kw: vjp(on_projections, *a, **kw), static_argnames=_STATIC)


def assert_vjps_close(got, want, dtype, s, e, what=""):
    (out, (dx, dws, dbs)), (want_out, (wdx, wdws, wdbs)) = got, want
    assert_close(out, want_out, dtype, reduction=s * e, what=f"{what} out")
    assert_close(dx, wdx, dtype, reduction=s * e, grad=True, what=f"{what} dx")
    for i in range(3):
        assert_close(dws[i], wdws[i], dtype, reduction=s * e, grad=True, what=f"{what} dw[{i}]")
        if dbs is not None:
            assert_close(dbs[i], wdbs[i], dtype, reduction=s * e, grad=True, what=f"{what} db[{i}]")


# (S, E, H, D, dtype, mask, causal, rate)
CASES = [
    (1, 4, 1, 8, F32, None, False, 0.0),
    (7, 12, 3, 4, F32, "padding", True, 0.1),
    (130, 16, 1, 64, BF16, "additive", False, 0.1),
    (128, 24, 3, 8, F16, None, True, 0.0),
    (65, 10, 2, 8, F32, "bool4d", False, 0.2),
]


@pytest.mark.parametrize("s,e,h,d,dtype,mask_kind,causal,rate", CASES,
                         ids=[f"s{c[0]}-e{c[1]}-h{c[2]}-d{c[3]}-{c[4].name}-{c[5]}-{'causal' if c[6] else 'full'}-p{c[7]}"
                              for c in CASES])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_equals_attention_on_the_projections(implementation, s, e, h, d, dtype, mask_kind, causal, rate):
    b = 2
    x, ws, bs, dout = inputs(s * 10 + d, b, s, e, h, d, dtype)
    kw = dict(mask=make_mask(mask_kind, s + 1, b, h, s, s), key=jax.random.key(s), causal=causal,
              dropout_rate=rate, implementation=implementation)
    got = projected_vjp(x, ws, bs, dout, **kw)
    want = reference_vjp(x, ws, bs, dout, **kw)
    assert got[0].shape == (b, s, h, d) and got[0].dtype == dtype
    assert [a.shape for a in got[1][1]] == [(e, h, d)] * 3 and [a.shape for a in got[1][2]] == [(h, d)] * 3
    assert all(a.dtype == dtype for a in jax.tree.leaves(got))
    assert_vjps_close(got, want, dtype, s, e)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_broadcast_dropout(implementation):
    """One mask for every batch and head: the projected and the dense-packed ops equal the
    ops they stand for with it."""
    b, s, e, h, d = 2, 9, 12, 3, 4
    x, ws, bs, dout = inputs(5, b, s, e, h, d, F32)
    kw = dict(mask=make_mask("padding", 6, b, h, s, s), key=jax.random.key(7), causal=True, dropout_rate=0.3,
              implementation=implementation, broadcast_dropout=True)
    assert_vjps_close(projected_vjp(x, ws, bs, dout, **kw), reference_vjp(x, ws, bs, dout, **kw), F32, s, e)
    x, kernel, bias, dout, dx_other = dense_inputs(8, b, s, e, h, d, F32)
    kw.update(axes=1, with_input=True)
    got = dense_op_vjp(x, kernel, bias, dout, dx_other, **kw)
    assert_dense_vjps_close(got, dense_ref_vjp(x, kernel, bias, dout, dx_other, **kw), F32, s, e, True)
    other = dense_op_vjp(x, kernel, bias, dout, dx_other, **{**kw, "broadcast_dropout": False})
    assert np.abs(np.asarray(other[0][0]) - np.asarray(got[0][0])).max() > 0.1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_without_biases(implementation):
    x, ws, _, dout = inputs(3, 2, 7, 12, 3, 4, F32, bias=False)
    kw = dict(dropout_rate=0.1, key=jax.random.key(1), implementation=implementation)
    got, want = projected_vjp(x, ws, None, dout, **kw), reference_vjp(x, ws, None, dout, **kw)
    assert got[1][2] is None
    assert_vjps_close(got, want, F32, 7, 12)


def _bwd_pair(seed, b, s, h, d, dtype, mask_kind, causal, rate, bcast=False):
    """(dqkv from jaxsub_attention_bwd_dqkv, (dq, dk, dv) from jaxsub_attention_bwd) on one
    forward's out and lse, as jitted functions of the inputs."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (normal(rng, (b, s, h, d), dtype) for _ in range(4))
    mask4d, kind = _masks.normalize("t", make_mask(mask_kind, seed, b, h, s, s), (b, h), s, s, key_padding_ok=True)
    seed_words = _dropout.seed_from_key("t", jax.random.key(seed)) if rate else _dropout.NO_SEED
    static = (1.0 / np.sqrt(d), causal, kind, rate, bcast)

    def both(q, k, v, dout, mask4d, seed_words):
        out, lse = attn_calls.fwd_call(q, k, v, mask4d, seed_words, *static)
        return (attn_calls.bwd_dqkv_call(dout, q, k, v, out, lse, mask4d, seed_words, *static),
                attn_calls.bwd_call(dout, q, k, v, out, lse, mask4d, seed_words, *static))

    return jax.jit(both), (q, k, v, dout, jnp.asarray(mask4d), seed_words)


@pytest.mark.parametrize("s,h,d,dtype,mask_kind,causal,rate", [
    (1, 1, 8, F32, None, False, 0.0), (7, 3, 4, BF16, "padding", True, 0.1), (130, 2, 16, F16, "additive", False, 0.2)])
def test_packed_gradient_target_equals_attention_bwd(s, h, d, dtype, mask_kind, causal, rate):
    # The CPU handlers run the same loops, writing at other strides: identical values.
    run, args = _bwd_pair(s + d, 2, s, h, d, dtype, mask_kind, causal, rate)
    dqkv, grads = run(*args)
    assert dqkv.shape == (2, s, 3, h, d) and dqkv.dtype == dtype
    for i, (name, g) in enumerate(zip(("dq", "dk", "dv"), grads)):
        np.testing.assert_array_equal(np.asarray(dqkv[:, :, i], np.float32), np.asarray(g, np.float32), err_msg=name)


def test_fused_lowers_to_the_projected_targets():
    x, ws, bs, _ = inputs(0, 2, 7, 12, 3, 8, BF16)
    f = lambda x, ws, bs, impl: op(x, ws, bs, dropout_rate=0.1, key=jax.random.key(0), implementation=impl)
    grad = lambda impl: jax.jit(jax.grad(lambda *a: f(*a, impl).astype(F32).sum(), argnums=(0, 1, 2)))
    hlo = grad("fused").lower(x, ws, bs).as_text()
    assert "@jaxsub_attention_fwd(" in hlo and "@jaxsub_attention_bwd_dqkv(" in hlo
    # the bias gradient: the backward target's dbias result (T[3, H, D]), no column sum
    assert "@jaxsub_bias_grad(" not in hlo
    assert "tensor<3x3x8xbf16>" in [ln for ln in hlo.splitlines() if "@jaxsub_attention_bwd_dqkv(" in ln][0]
    assert "jaxsub_attention_qkv" not in hlo and "@jaxsub_attention_bwd(" not in hlo
    unfused = grad("unfused").lower(x, ws, bs).as_text()
    assert "jaxsub_softmax_dropout_fwd" in unfused and "jaxsub_attention" not in unfused


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_check_grads_fused(rate):
    x, ws, bs, _ = inputs(3, 1, 5, 6, 2, 4, F32)
    mask = jnp.asarray([[True, True, False, True, True]])
    f = lambda x, ws, bs: op(x, ws, bs, mask=mask, causal=True, dropout_rate=rate, key=jax.random.key(4),
                             implementation="fused")
    check_grads(f, (x, ws, bs), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_extra_leading_axis_matches_loop(implementation):
    x = jnp.stack([inputs(10 + i, 2, 7, 12, 3, 8, F32)[0] for i in range(3)])
    _, ws, bs, _ = inputs(9, 2, 7, 12, 3, 8, F32)
    keys = jax.random.split(jax.random.key(5), 3)
    f = lambda x, k: op(x, ws, bs, causal=True, dropout_rate=0.2, key=k, implementation=implementation)
    got = jax.vmap(f)(x, keys)
    for i in range(3):
        assert_close(got[i], f(x[i], keys[i]), F32, reduction=7 * 12, what=f"vmap element {i}")


_W = tuple(np.zeros((12, 3, 4), np.float32) for _ in range(3))
_B = tuple(np.zeros((3, 4), np.float32) for _ in range(3))


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(x=np.zeros((2, 7, 3, 12), np.float32)), ValueError, ["attention_projected", "`x`", "rank 3"]),
    (dict(x=np.zeros((2, 7, 12), np.int32)), TypeError, ["attention_projected", "`x`", "int32"]),
    (dict(weights=_W[:2]), TypeError, ["attention_projected", "`weights`", "three"]),
    (dict(weights=(np.zeros((10, 3, 4), np.float32),) + _W[1:]), ValueError, ["attention_projected", "weights[0]"]),
    (dict(weights=_W[:2] + (np.zeros((12, 3, 5), np.float32),)), ValueError, ["attention_projected", "weights[2]"]),
    (dict(weights=_W[:2] + (np.zeros((12, 3, 4), np.float16),)), TypeError, ["attention_projected", "weights[2]"]),
    (dict(biases=_B[:1] + (np.zeros((4, 3), np.float32),) + _B[2:]), ValueError, ["attention_projected", "biases[1]"]),
    (dict(biases=np.zeros((3, 3, 4), np.float32)), TypeError, ["attention_projected", "`biases`"]),
    (dict(biases=_B[:1] + (None,) + _B[2:]), TypeError, ["attention_projected", "biases[1]", "None"]),
    (dict(dropout_rate=0.1), ValueError, ["attention_projected", "key"]),
])
def test_bad_inputs_raise_naming_op_and_argument(kwargs, exc, words):
    args = dict(x=np.zeros((2, 7, 12), np.float32), weights=_W, biases=_B)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        op(args.pop("x"), args.pop("weights"), args.pop("biases"), **args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


class CudaAgainstCpu:
    """The GPU cases both GPU classes run through their own `_cuda_vs_cpu` (the fused path
    on the GPU against the CPU handlers, same inputs and key); `odd_batch` and `bert_kw`
    are each class's batch for the odd sizes and extra arguments at BERT-large size."""

    odd_batch = 2
    bert_kw = {}

    def test_bert_large_dropout_matches_cpu(self):
        self._cuda_vs_cpu(8, 512, 1024, 16, 64, causal=False, rate=0.1, mask_kind="padding", **self.bert_kw)

    def test_short_sequences_matches_cpu(self):  # S 128: the cluster-reduced dq on sm_90a
        self._cuda_vs_cpu(12, 128, 256, 4, 64, causal=False, rate=0.1)

    @pytest.mark.parametrize("d", [32, 64, 128])
    @pytest.mark.parametrize("s,mask_kind,causal", [(1, None, False), (7, "padding", True), (130, "additive", False),
                                                    (200, "headkeys", True)])
    def test_odd_sizes_match_cpu(self, s, mask_kind, causal, d):
        self._cuda_vs_cpu(self.odd_batch, s, 40, 3, d, causal=causal, rate=0.1, dtype=F16 if d == 32 else BF16,
                          mask_kind=mask_kind, seed=s * 10 + d)


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
class TestCuda(CudaAgainstCpu):
    """The fused op on the GPU against the CPU handlers (same inputs and key), and the
    packed-gradient kernel against the separate-gradient one on the GPU."""

    @staticmethod
    def _cuda_vs_cpu(b, s, e, h, d, *, causal, rate, dtype=BF16, mask_kind=None, seed=161):
        x, ws, bs, dout = inputs(seed, b, s, e, h, d, dtype)
        kw = dict(mask=make_mask(mask_kind, seed + 1, b, h, s, s), key=jax.random.key(seed + 2), causal=causal,
                  dropout_rate=rate, implementation="fused")
        run = jax.jit(lambda *a: vjp(op, *a, **kw))
        args = (x, ws, bs, dout)
        hlo = run.lower(*args).as_text()
        assert "@jaxsub_attention_bwd_dqkv(" in hlo, "the packed-gradient kernel did not run"
        want = run(*jax.device_put(args, jax.devices("cpu")[0]))
        got = run(*jax.device_put(args, jax.devices()[0]))
        assert_vjps_close(got, want, dtype, s, e, what="cuda vs cpu")

    @pytest.mark.parametrize("s,d,causal,bcast", [(512, 64, False, False), (128, 64, False, False),
                                                  (130, 128, True, False), (77, 32, False, False),
                                                  (130, 64, True, True)])
    def test_packed_gradient_kernel_equals_separate(self, s, d, causal, bcast):
        # Same kernels, other gradient strides: dk and dv bitwise equal; dq adds f32 atomics
        # in a nondeterministic order (outside the cluster path), so within tolerance.
        run, args = _bwd_pair(s + d, 4, s, 4, d, BF16, "padding", causal, 0.1, bcast)
        dqkv, (dq, dk, dv) = run(*args)
        assert_close(dqkv[:, :, 0], dq, BF16, reduction=s, grad=True, what="dq")
        for name, i, g in (("dk", 1, dk), ("dv", 2, dv)):
            np.testing.assert_array_equal(np.asarray(dqkv[:, :, i], np.float32), np.asarray(g, np.float32),
                                          err_msg=name)


# ---------------------------------------------------------------------------------------
# dense_attention_packed: the packed product by ops.dense and the packed attention as one
# op, whose fused backward takes the bias gradient from the attention's backward.

dense_op = jaxsub.ops.dense_attention_packed


def dense_inputs(seed, b, s, e, h, d, dtype, axes=1):
    """x ([B, S, E], or [B, S, 2, E / 2] for axes 2), the packed kernel, its bias, and the
    cotangents of the output and of x handed on."""
    rng = np.random.default_rng(seed)
    xshape = (b, s, e) if axes == 1 else (b, s, 2, e // 2)
    x = normal(rng, xshape, dtype)
    kernel = normal(rng, (*xshape[2:], 3, h, d), dtype) * jnp.asarray(2.0 / np.sqrt(e), dtype)
    return x, kernel, normal(rng, (3, h, d), dtype), normal(rng, (b, s, h, d), dtype), normal(rng, xshape, dtype)


def dense_then_packed(x, kernel, bias, *, axes, with_input, **kw):
    """The two ops dense_attention_packed stands for."""
    out = jaxsub.ops.attention_packed(jaxsub.ops.dense(x, kernel, bias, axes=axes), axis=2, **kw)
    return (out, x) if with_input else out


def dense_vjp(f, x, kernel, bias, dout, dx_other, *, axes, with_input, **kw):
    out, pull = jax.vjp(lambda x, k, b: f(x, k, b, axes=axes, with_input=with_input, **kw), x, kernel, bias)
    return out, pull((dout, dx_other) if with_input else dout)


_DENSE_STATIC = ("axes", "with_input", *_STATIC)
dense_op_vjp = jax.jit(lambda *a, **kw: dense_vjp(dense_op, *a, **kw), static_argnames=_DENSE_STATIC)
dense_ref_vjp = jax.jit(lambda *a, **kw: dense_vjp(dense_then_packed, *a, **kw), static_argnames=_DENSE_STATIC)


def assert_dense_vjps_close(got, want, dtype, s, e, with_input, what=""):
    (out, grads), (want_out, want_grads) = got, want
    if with_input:
        (out, again), (want_out, want_again) = out, want_out
        np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(want_again, np.float32))
    assert_close(out, want_out, dtype, reduction=s * e, what=f"{what} out")
    for name, g, w in zip(("dx", "dkernel", "dbias"), grads, want_grads):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert_close(g, w, dtype, reduction=s * e, grad=True, what=f"{what} {name}")


# (S, E, H, D, dtype, mask, causal, rate, axes, with_input)
DENSE_CASES = [
    (1, 4, 1, 8, F32, None, False, 0.0, 1, False),
    (7, 12, 3, 4, F32, "padding", True, 0.1, 1, True),
    (130, 16, 1, 64, BF16, "additive", False, 0.1, 2, False),
    (65, 10, 2, 8, F16, "bool4d", False, 0.2, 2, True),
]


@pytest.mark.parametrize("s,e,h,d,dtype,mask_kind,causal,rate,axes,with_input", DENSE_CASES,
                         ids=[f"s{c[0]}-e{c[1]}-h{c[2]}-d{c[3]}-{c[4].name}-{c[5]}-p{c[7]}-axes{c[8]}-input{c[9]}"
                              for c in DENSE_CASES])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dense_attention_packed_equals_the_two_ops(implementation, s, e, h, d, dtype, mask_kind, causal, rate, axes,
                                                   with_input):
    b = 2
    x, kernel, bias, dout, dx_other = dense_inputs(s * 10 + d, b, s, e, h, d, dtype, axes)
    kw = dict(mask=make_mask(mask_kind, s + 1, b, h, s, s), key=jax.random.key(s), causal=causal,
              dropout_rate=rate, implementation=implementation, axes=axes, with_input=with_input)
    got = dense_op_vjp(x, kernel, bias, dout, dx_other, **kw)
    want = dense_ref_vjp(x, kernel, bias, dout, dx_other, **kw)
    assert_dense_vjps_close(got, want, dtype, s, e, with_input)


def test_dense_attention_packed_fused_takes_the_bias_gradient_from_the_attention():
    """The fused path's backward: one packed attention backward with the dbias result, the
    two gradient products, no column sum of dqkv."""
    x, kernel, bias, dout, dx_other = dense_inputs(5, 2, 9, 12, 3, 4, F32)
    kw = dict(dropout_rate=0.1, key=jax.random.key(2), implementation="fused", axes=1, with_input=True)
    text = dense_op_vjp.lower(x, kernel, bias, dout, dx_other, **kw).as_text()
    bwd = [ln for ln in text.splitlines() if "@jaxsub_attention_qkv_bwd(" in ln]
    assert len(bwd) == 1 and "tensor<3x3x4xf32>" in bwd[0].split("->")[1]
    assert "@jaxsub_bias_grad" not in text
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == 3


@pytest.mark.parametrize("s,e,h,d,dtype,mask_kind,causal,rate,axes,with_input", DENSE_CASES[1:],
                         ids=[f"s{c[0]}-{c[4].name}-p{c[7]}-axes{c[8]}-input{c[9]}" for c in DENSE_CASES[1:]])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dense_attention_packed_takes_three_biases(implementation, s, e, h, d, dtype, mask_kind, causal, rate, axes,
                                                   with_input):
    """Three [H, D] biases (separate parameters, as Flax's) give the values and gradients of
    the same biases stacked, bit for bit, each bias its own gradient."""
    b = 2
    x, kernel, bias, dout, dx_other = dense_inputs(s * 7 + d, b, s, e, h, d, dtype, axes)
    kw = dict(mask=make_mask(mask_kind, s + 1, b, h, s, s), key=jax.random.key(s), causal=causal,
              dropout_rate=rate, implementation=implementation, axes=axes, with_input=with_input)
    got_out, (gdx, gdk, gdb) = dense_op_vjp(x, kernel, tuple(bias), dout, dx_other, **kw)
    want_out, (wdx, wdk, wdb) = dense_op_vjp(x, kernel, bias, dout, dx_other, **kw)
    assert isinstance(gdb, tuple) and len(gdb) == 3 and all(g.shape == (h, d) and g.dtype == dtype for g in gdb)
    for name, g, w in [("out", got_out, want_out), ("dx", gdx, wdx), ("dkernel", gdk, wdk),
                       ("dbias", jnp.stack(gdb), wdb)]:
        for ga, wa in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            np.testing.assert_array_equal(np.asarray(ga, np.float32), np.asarray(wa, np.float32), err_msg=name)


def test_dense_attention_packed_three_biases_get_three_results():
    """The fused path with three biases: the attention backward writes the three bias
    gradients as three results (no slices of one [3, H, D] gradient)."""
    x, kernel, bias, dout, dx_other = dense_inputs(5, 2, 9, 12, 3, 4, F32)
    kw = dict(dropout_rate=0.1, key=jax.random.key(2), implementation="fused", axes=1, with_input=True)
    text = dense_op_vjp.lower(x, kernel, tuple(bias), dout, dx_other, **kw).as_text()
    bwd = [ln for ln in text.splitlines() if "@jaxsub_attention_qkv_bwd(" in ln]
    assert len(bwd) == 1
    results = bwd[0].split("->")[1]
    assert results.count("tensor<3x4xf32>") == 3 and "tensor<3x3x4xf32>" not in results, results
    assert "stablehlo.slice" not in text and "@jaxsub_bias_grad" not in text


@pytest.mark.parametrize("extra", [1, 3])
def test_packed_backward_takes_two_more_results_or_none(extra):
    """attention_qkv_bwd's results after its five: the k and v bias gradients, or none;
    another count is refused with a message naming the target."""
    b, s, h, d = 1, 4, 2, 8
    rng = np.random.default_rng(3)
    qkv, dout = normal(rng, (b, s, 3, h, d), F32), normal(rng, (b, s, h, d), F32)
    mask4d, kind = _masks.normalize("t", None, (b, h), s, s, key_padding_ok=True)
    seed = _dropout.seed_from_key("t", jax.random.key(3))
    static = (1.0 / np.sqrt(d), False, kind, 0.0, False)
    out, lse = attn_calls.fwd_packed_call(qkv, 2, jnp.asarray(mask4d), seed, *static)
    hd = jax.ShapeDtypeStruct((h, d), F32)
    types = (jax.ShapeDtypeStruct(qkv.shape, F32), hd, jax.ShapeDtypeStruct((b, 3, h, d), F32),
             jax.ShapeDtypeStruct((b, h, s), F32), jax.ShapeDtypeStruct((b, s, h, d), F32), *(hd,) * extra)
    with pytest.raises(Exception, match="attention_qkv_bwd.*two more"):
        jax.block_until_ready(jaxsub._ffi.call("jaxsub_attention_qkv_bwd", types, dout, qkv, out, lse,
                                               jnp.asarray(mask4d), seed, qkv_axis=np.int32(2),
                                               **attn_calls.attrs(*static)))


@pytest.mark.parametrize("axis", [2, 0])
def test_packed_backward_bias_result_is_the_gradient_column_sums(axis):
    """The targets' dbias result (CPU handler) equals dqkv summed over B and S, in f64."""
    b, s, h, d = 2, 11, 3, 8
    rng = np.random.default_rng(31)
    shape = (b, s, 3, h, d) if axis == 2 else (3, b, s, h, d)
    qkv, dout = normal(rng, shape, F32), normal(rng, (b, s, h, d), F32)
    mask4d, kind = _masks.normalize("t", None, (b, h), s, s, key_padding_ok=True)
    seed = _dropout.seed_from_key("t", jax.random.key(3))
    static = (1.0 / np.sqrt(d), False, kind, 0.1, False)
    out, lse = attn_calls.fwd_packed_call(qkv, axis, jnp.asarray(mask4d), seed, *static)
    dqkv, dbias = attn_calls.bwd_packed_call(dout, qkv, axis, out, lse, jnp.asarray(mask4d), seed, *static,
                                             bias_grad=True)
    sums = np.asarray(dqkv, np.float64).sum(axis=(0, 1) if axis == 2 else (1, 2))
    assert dbias.shape == (3, h, d) and dbias.dtype == F32
    np.testing.assert_allclose(np.asarray(dbias), sums, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(bias=None), TypeError, ["dense_attention_packed", "bias"]),
    (dict(kernel=jnp.zeros((12, 2, 3, 4)), bias=jnp.zeros((2, 3, 4))), ValueError, ["dense_attention_packed", "kernel"]),
    (dict(kernel=jnp.zeros((12, 3, 4)), bias=jnp.zeros((3, 4))), ValueError, ["dense_attention_packed", "kernel"]),
    # A kernel without its q/k/v axis of 3 beside a [3, H, D] bias: the kernel is named (the
    # bias was, as not fitting the kernel; found by probing).
    (dict(kernel=jnp.zeros((12, 2, 3, 4))), ValueError, ["`kernel` [*K, 3, H, D]"]),
    (dict(bias=jnp.zeros((3, 3, 5))), ValueError, ["jaxsub.dense_attention_packed: `bias`"]),
    (dict(x=jnp.zeros((2, 5, 12), jnp.bfloat16)), TypeError, ["jaxsub.dense_attention_packed: `kernel`"]),
    (dict(with_input="no"), TypeError, ["jaxsub.dense_attention_packed: `with_input`"]),  # a tuple came back
])
def test_dense_attention_packed_bad_inputs_raise(kwargs, exc, words):
    args = dict(x=jnp.zeros((2, 5, 12)), kernel=jnp.zeros((12, 3, 3, 4)), bias=jnp.zeros((3, 3, 4)))
    args.update(kwargs)
    with pytest.raises(exc) as info:
        dense_op(args["x"], args["kernel"], args["bias"], **({"with_input": args["with_input"]} if "with_input" in args
                                                              else {}))
    for w in words:
        assert w in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
class TestCudaDense(CudaAgainstCpu):
    """dense_attention_packed's fused path on the GPU against the CPU handlers: the bias
    gradient from the attention backward's column sums (dk, dv in the tile kernels; dq in
    the dq kernel, or after the clusters at S <= 128)."""

    odd_batch = 3
    bert_kw = {"with_input": True}

    @staticmethod
    def _cuda_vs_cpu(b, s, e, h, d, *, causal, rate, dtype=BF16, mask_kind=None, with_input=False, seed=171):
        x, kernel, bias, dout, dx_other = dense_inputs(seed, b, s, e, h, d, dtype)
        kw = dict(mask=make_mask(mask_kind, seed + 1, b, h, s, s), key=jax.random.key(seed + 2), causal=causal,
                  dropout_rate=rate, implementation="fused", axes=1, with_input=with_input)
        args = (x, kernel, bias, dout, dx_other)
        text = dense_op_vjp.lower(*args, **kw).as_text()
        assert "@jaxsub_attention_qkv_bwd(" in text and "@jaxsub_bias_grad" not in text
        want = dense_op_vjp(*jax.device_put(args, jax.devices("cpu")[0]), **kw)
        got = dense_op_vjp(*jax.device_put(args, jax.devices()[0]), **kw)
        assert_dense_vjps_close(got, want, dtype, s, e, with_input, what="cuda vs cpu")
        # and against the two ops on the GPU (the bias gradient by the column-sum kernel)
        assert_dense_vjps_close(got, dense_ref_vjp(*args, **kw), dtype, s, e, with_input, what="cuda vs two ops")

    @pytest.mark.parametrize("s,causal", [(512, False), (64, False), (130, True)])
    def test_three_biases(self, s, causal):
        """Three [H, D] biases on the GPU: the values and gradients of the stacked bias (the
        same kernels, the column sums written to three arrays; bit for bit where dq is
        reduced in clusters, S 64, within tolerance where atomics add it up, S 512 and
        causal), and close to the CPU."""
        b, e, h, d = 2, 256, 4, 64
        x, kernel, bias, dout, dx_other = dense_inputs(9 + s, b, s, e, h, d, BF16)
        kw = dict(key=jax.random.key(4), causal=causal, dropout_rate=0.1, implementation="fused", axes=1,
                  with_input=True)
        got = dense_op_vjp(x, kernel, tuple(bias), dout, dx_other, **kw)
        want = dense_op_vjp(x, kernel, bias, dout, dx_other, **kw)
        stack = lambda r: (r[0], (r[1][0], r[1][1], jnp.stack(r[1][2])))  # noqa: E731
        if s <= 128 and not causal:
            for g, w in zip(jax.tree.leaves(stack(got)), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        assert_dense_vjps_close(stack(got), want, BF16, s, e, True, what="three biases against one")
        cpu = dense_op_vjp(*jax.device_put((x, kernel, tuple(bias), dout, dx_other), jax.devices("cpu")[0]), **kw)
        assert_dense_vjps_close(stack(got), stack(cpu), BF16, s, e, True, what="three biases, cuda vs cpu")

