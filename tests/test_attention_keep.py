"""Fused attention's keep words (cuda/ABI.md): under differentiation the forward writes each
dropout decision as one bit and the backward reads its mask from them instead of running
the generator again. The words must be exactly `dropout_mask`'s decisions in the ABI's
layout, and the backward must give the same gradients from them as from the generator
(on the GPU the generator runs in the mma.sync backward only)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import _ffi
from jaxsub.ops import dropout as dropout_ops
from jaxsub.ops import masks as masks_ops
from jaxsub.testing import assert_close

attn = importlib.import_module("jaxsub.ops.attn")
BF16 = jnp.dtype(jnp.bfloat16)
RATE = 0.1


def inputs(seed, b, sq, sk, h, d, mask_kind, dtype):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (jnp.asarray(rng.standard_normal(s).astype(np.float32), dtype)
                     for s in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d), (b, sq, h, d)))
    mask = None
    if mask_kind == "padding":
        m = rng.random((b, sk)) < 0.7
        m[:, 0] = True
        mask = jnp.asarray(m)
    elif mask_kind == "additive":
        mask = jnp.asarray(rng.standard_normal((h, sq, sk)).astype(np.float32))
    mask4d, kind = masks_ops.normalize("attention", mask, (b, h), sq, sk, key_padding_ok=True)
    key = jax.random.key(seed + 1)
    return q, k, v, dout, jnp.asarray(mask4d), kind, key


def expected_words(key, b, h, sq, sk):
    """`dropout_mask`'s decisions packed as ABI.md lays out the keep words."""
    groups, rows = attn.keep_words_shape(b, h, sq, sk, RATE)[1:]
    keep = np.zeros((b * h, rows, groups * 16), bool)
    keep[:, :sq, :sk] = np.asarray(jaxsub.ops.dropout_mask(key, (b, h, sq, sk), RATE)).reshape(b * h, sq, sk)
    bits = keep.reshape(b * h, rows, groups, 16).astype(np.uint32) << np.arange(16, dtype=np.uint32)
    return bits.sum(-1).astype(np.uint16).transpose(0, 2, 1)  # [B * H, groups, rows]


def visited(b, h, sq, sk, causal):
    """Where the forward writes words: every (query tile, key tile) pair it visits (causal:
    the key tiles up to a query tile's last visible key), which is every pair the backward
    reads."""
    groups, rows = attn.keep_words_shape(b, h, sq, sk, RATE)[1:]
    seen = np.ones((b * h, groups, rows), bool)
    if causal:
        for qt in range(rows // 64):
            key_end = min(sk, 64 * qt + 64 + sk - sq)
            seen[:, 4 * -(-max(key_end, 0) // 64):, 64 * qt:64 * qt + 64] = False
    return seen


def forward_words(q, k, v, mask4d, kind, key, causal, scale):
    seed = dropout_ops.seed_from_key("attention", key)
    return jax.jit(lambda q, k, v, m, s: attn._fwd_call(q, k, v, m, s, scale, causal, kind, RATE, keep_words=True))(
        q, k, v, mask4d, seed)


def backward(q, k, v, dout, mask4d, kind, key, causal, scale, keep):
    seed = dropout_ops.seed_from_key("attention", key)
    out, lse, _ = forward_words(q, k, v, mask4d, kind, key, causal, scale)
    run = jax.jit(lambda *a: attn._bwd_call(*a, scale, causal, kind, RATE))
    return run(dout, q, k, v, out, lse, mask4d, seed, keep)


SHAPES = [  # (b, h, sq, sk, d, mask_kind, causal): odd sizes, partial tiles both ways
    (2, 3, 70, 130, 64, None, False), (1, 2, 1, 7, 64, "padding", False), (2, 3, 130, 65, 64, None, True),
    (1, 2, 200, 300, 128, "additive", True), (2, 2, 64, 64, 32, "padding", True)]


def check_words_and_backward(device, b, h, sq, sk, d, mask_kind, causal, dtype):
    q, k, v, dout, mask4d, kind, key = jax.device_put(
        inputs(sq * 31 + sk, b, sq, sk, h, d, mask_kind, dtype), device)
    scale = 1.0 / np.sqrt(d)
    words = np.asarray(forward_words(q, k, v, mask4d, kind, key, causal, scale)[2])
    want = expected_words(key, b, h, sq, sk)
    assert words.shape == want.shape == attn.keep_words_shape(b, h, sq, sk, RATE)
    seen = visited(b, h, sq, sk, causal)
    np.testing.assert_array_equal(np.where(seen, words, 0), np.where(seen, want, 0))
    stored = backward(q, k, v, dout, mask4d, kind, key, causal, scale, jnp.asarray(words))
    regenerated = backward(q, k, v, dout, mask4d, kind, key, causal, scale, jnp.zeros((0,), jnp.uint16))
    for name, x, y, n in zip(("dq", "dk", "dv"), stored, regenerated, (sk, sq, sq)):
        if device.platform == "cpu":  # one handler either way
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:  # without keep words the mma.sync backward runs, whatever the kernels of the call
            assert_close(x, y, dtype, reduction=n, grad=True, what=name)


@pytest.mark.parametrize("b,h,sq,sk,d,mask_kind,causal", SHAPES)
def test_keep_words_cpu(b, h, sq, sk, d, mask_kind, causal):
    check_words_and_backward(jax.devices("cpu")[0], b, h, sq, sk, d, mask_kind, causal, jnp.dtype(jnp.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
@pytest.mark.parametrize("kernels", ["default", "mma"])
@pytest.mark.parametrize("b,h,sq,sk,d,mask_kind,causal", SHAPES)
def test_keep_words_cuda(monkeypatch, kernels, b, h, sq, sk, d, mask_kind, causal):
    if kernels == "mma":
        monkeypatch.setenv("JAXSUB_ATTENTION_SM90", "0")
    check_words_and_backward(jax.devices()[0], b, h, sq, sk, d, mask_kind, causal, BF16)


def test_keep_words_only_under_differentiation_with_dropout():
    q, k, v, dout, _, _, key = inputs(5, 1, 70, 70, 2, 16, None, jnp.float32)
    f = lambda q, rate: jaxsub.ops.attention(q, k, v, dropout_rate=rate, key=key, implementation="fused")
    words = attn.keep_words_shape(1, 2, 70, 70, RATE)
    assert words == (2, 8, 128)
    grad_hlo = jax.jit(jax.grad(lambda q: f(q, RATE).sum())).lower(q).as_text()
    assert "tensor<2x8x128xui16>" in grad_hlo  # written by the forward, read by the backward
    assert "tensor<2x8x128xui16>" not in jax.jit(lambda q: f(q, RATE)).lower(q).as_text()
    assert "tensor<0xui16>" in jax.jit(jax.grad(lambda q: f(q, 0.0).sum())).lower(q).as_text()


@pytest.mark.parametrize("shape,rate,message", [((3,), RATE, "wrong dtype or number"), ((2, 8, 128), 0.0, "empty")])
def test_bad_keep_buffer_is_an_error_naming_the_op(shape, rate, message):
    q, k, v, _, mask4d, kind, key = inputs(7, 1, 70, 70, 2, 16, None, jnp.float32)
    seed = dropout_ops.seed_from_key("attention", key)
    call = lambda q: _ffi.call(
        "jaxsub_attention_fwd",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 70), jnp.float32),
         jax.ShapeDtypeStruct(shape, jnp.uint16)),
        q, k, v, mask4d, seed, **masks_ops.attrs(0.25, False, kind, rate))
    with pytest.raises(Exception, match=f"attention_fwd.*{message}|{message}.*attention_fwd"):
        jax.block_until_ready(jax.jit(call)(q))
