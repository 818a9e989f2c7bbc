"""dropout_mask: the C++ Philox4x32-10 keep-mask against an independent NumPy Philox that
is itself pinned to the published Random123 known-answer vectors."""

import contextlib
import io
import math

import jax
import jax.ad_checkpoint
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub.ops.dropout import seed_from_key, threshold
from jaxsub.testing import assert_close, assert_vmap_matches_loop

_MASK32 = np.uint64(0xFFFFFFFF)
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)


def philox4x32_10(ctr, key):
    """Philox4x32-10 (Salmon et al., SC'11) on arrays: ctr uint32 [..., 4], key uint32 [2].
    Products are formed in uint64 so mulhi/mullo are exact."""
    ctr = np.asarray(ctr, np.uint32).astype(np.uint64)
    c0, c1, c2, c3 = (ctr[..., i] for i in range(4))
    k0, k1 = (np.uint64(int(k)) for k in np.asarray(key, np.uint32))
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK32
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def numpy_mask(seed, shape, rate, offset=0):
    """philox.h's rule: element i uses counter (i // 8 + offset as 64-bit lo, hi, 0, 0) and
    16-bit lane i % 8 (lane j = half j % 2 of word j // 2, low half first); it is kept when
    that lane is >= threshold(rate)."""
    n = math.prod(shape)
    q = np.arange((n + 7) // 8, dtype=np.uint64) + np.uint64(offset)
    ctr = np.stack([q & _MASK32, q >> np.uint64(32), 0 * q, 0 * q], axis=-1).astype(np.uint32)
    words = philox4x32_10(ctr, seed).reshape(-1)
    lanes = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(-1)[:n]
    return (lanes >= threshold(rate)).reshape(shape)


# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, expected output).
KNOWN_ANSWERS = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("ctr,key,expected", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_numpy_philox_known_answers(ctr, key, expected):
    np.testing.assert_array_equal(philox4x32_10(np.array(ctr, np.uint32), key), np.array(expected, np.uint32))


def test_philox_side_by_side_matches_single_calls(host_check):
    """cuda/philox.h's philox4x32_10_n (the attention and row kernels' calls side by side
    with one key schedule) against single calls and the known answers: philox_check.cc."""
    assert "80000 calls, 0 failures" in host_check("philox_check")


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("shape", [(7, 13), (1,), (3, 1001), (2, 3, 64)], ids=str)
def test_mask_matches_numpy_philox(shape, rate):
    key = jax.random.key(sum(shape) * 10 + int(rate * 10))
    got = np.asarray(jaxsub.ops.dropout_mask(key, shape, rate))
    assert got.shape == shape and got.dtype == np.bool_
    want = numpy_mask(np.asarray(seed_from_key("test", key)), shape, rate)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_within_binomial_bounds(rate):
    shape = (256, 1000)
    mask = np.asarray(jaxsub.ops.dropout_mask(jax.random.key(3), shape, rate))
    n, p = mask.size, 1.0 - rate
    assert abs(mask.mean() - p) < 5 * math.sqrt(p * (1 - p) / n)


KEYS = {
    "threefry-raw": lambda: jax.random.PRNGKey(5),
    "threefry-typed": lambda: jax.random.key(5),
    "rbg-typed": lambda: jax.random.key(5, impl="rbg"),
    "unsafe_rbg-typed": lambda: jax.random.key(5, impl="unsafe_rbg"),
    "rbg-raw": lambda: jax.random.PRNGKey(5, impl="rbg"),
}


@pytest.mark.parametrize("kind", KEYS)
def test_every_key_implementation(kind):
    key = KEYS[kind]()
    shape, rate = (5, 37), 0.3
    seed = np.asarray(seed_from_key("test", key))
    assert seed.shape == (2,) and seed.dtype == np.uint32
    mask = np.asarray(jaxsub.ops.dropout_mask(key, shape, rate))
    np.testing.assert_array_equal(mask, numpy_mask(seed, shape, rate))
    np.testing.assert_array_equal(mask, np.asarray(jax.jit(lambda k: jaxsub.ops.dropout_mask(k, shape, rate))(key)))


def test_distinct_keys_give_distinct_masks():
    k1, k2 = jax.random.split(jax.random.key(6))
    a = np.asarray(jaxsub.ops.dropout_mask(k1, (64, 64), 0.5))
    b = np.asarray(jaxsub.ops.dropout_mask(k1, (64, 64), 0.5))
    c = np.asarray(jaxsub.ops.dropout_mask(k2, (64, 64), 0.5))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_distinct_rbg_keys_give_distinct_masks(impl):
    """An rbg key's data is [0, s, 0, s] for key(s): the xor of its halves, which the seed
    was before, was 0 for every s, so every such key drew the same masks."""
    seeds = {tuple(np.asarray(seed_from_key("test", jax.random.key(s, impl=impl)))) for s in (1, 2, 12345)}
    seeds |= {tuple(np.asarray(seed_from_key("test", k))) for k in jax.random.split(jax.random.key(1, impl=impl))}
    assert len(seeds) == 5
    masks = [np.asarray(jaxsub.ops.dropout_mask(jax.random.key(s, impl=impl), (64, 64), 0.5)) for s in (1, 2)]
    assert 0.4 < float((masks[0] != masks[1]).mean()) < 0.6


def test_jit_and_vmap_over_keys():
    keys = jax.random.split(jax.random.key(7), 4)
    shape, rate = (9, 33), 0.2
    masks = np.asarray(jax.jit(jax.vmap(lambda k: jaxsub.ops.dropout_mask(k, shape, rate)))(keys))
    assert masks.shape == (4,) + shape
    for i in range(keys.shape[0]):
        seed = np.asarray(seed_from_key("test", keys[i]))
        np.testing.assert_array_equal(masks[i], numpy_mask(seed, shape, rate))
    assert (masks[0] != masks[1]).any()


def test_rate_zero_keeps_everything():
    mask = jaxsub.ops.dropout_mask(None, (4, 5), 0.0)
    assert mask.shape == (4, 5) and bool(jnp.all(mask))


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan")])
def test_bad_rate_raises(rate):
    with pytest.raises(ValueError, match="dropout_mask.*`rate`"):
        jaxsub.ops.dropout_mask(jax.random.key(0), (4,), rate)


def test_rate_the_16_bit_steps_would_bias_raises():
    """Keep decisions come in steps of 2^-16, and kept elements are scaled by 1 / (1 - rate):
    at 0.99999 the output's expected value was 1.53x the input's, at 1 - 1e-7 152x (probe
    round 9). Rates whose bias passes 1% raise, naming the op; every rate up to 0.999 runs,
    and the kept elements' mean scale is within 1% of 1 there."""
    x, b = jnp.ones((64, 1024)), jnp.zeros(1024)
    for rate in (0.99999, 1 - 1e-7):
        with pytest.raises(ValueError, match=r"bias_gelu_dropout: `rate` .* too close to 1.*steps of 2\^-16"):
            jaxsub.ops.bias_gelu_dropout(x, b, rate=rate, key=jax.random.key(0))
        with pytest.raises(ValueError, match="dropout_mask: `rate`"):
            jaxsub.ops.dropout_mask(jax.random.key(0), (4,), rate)
    rates = np.linspace(0.0, 0.999, 4001)
    assert max(jaxsub.ops.dropout.scale_error(r) for r in rates) < 0.01
    for rate in (0.999, 0.9993):
        kept = jaxsub.ops.dropout_mask(jax.random.key(1), (1 << 22,), rate).mean() / (1 - rate)
        assert abs(float(kept) - 1) < 0.12, rate  # ~4200 kept: a few standard deviations


@pytest.mark.parametrize("p", [1e-5, 0.9])
def test_optimize_leaves_a_rate_its_steps_would_bias_as_written(p):
    """A user's dropout at keep probability 1e-5 stays theirs (bias + GELU fused without
    it), one at 0.9 is fused."""
    def f(x, b, key):
        h = jax.nn.gelu(x + b)
        return jnp.where(jax.random.bernoulli(key, p, x.shape), h / p, 0.0)

    args = (jnp.ones((8, 16)), jnp.ones(16), jax.random.key(2))
    report = str(jaxsub.explain(f, *args))
    assert ("no dropout" if p < 0.5 else "dropout rate=0.1") in report, report
    if p < 0.5:
        np.testing.assert_array_equal(jax.jit(jaxsub.optimize(f))(*args) != 0, jax.jit(f)(*args) != 0)
        assert_close(jax.jit(jaxsub.optimize(f))(*args), jax.jit(f)(*args), reduction=1)


def test_missing_key_raises():
    with pytest.raises(ValueError, match=r"dropout_mask: `key` is required when dropout is active \(rate > 0\)$"):
        jaxsub.ops.dropout_mask(None, (4,), 0.1)


@pytest.mark.parametrize("key", ["abc", object(), [1.5, 2.5]])
def test_key_that_is_no_key_raises(key):
    with pytest.raises(TypeError, match="dropout_mask: `key` must be a JAX PRNG key"):
        jaxsub.ops.dropout_mask(key, (4,), 0.1)


@pytest.mark.parametrize("shape", [(-1, 3), 5, (2.5, 3), (True, 2)])
def test_bad_shape_raises(shape):
    with pytest.raises(ValueError, match="dropout_mask.*`shape`"):
        jaxsub.ops.dropout_mask(jax.random.key(0), shape, 0.1)


def test_key_without_words_raises():
    with pytest.raises(ValueError, match="dropout_mask.*PRNG key with 0 words"):
        jaxsub.ops.dropout_mask(jnp.zeros((0,), jnp.uint32), (4,), 0.1)


def _ops_with_dropout(key):
    """One public op of each family with dropout, applied with `key` to fixed random
    inputs (a dict of outputs, and the gradients of those whose backwards draw the mask
    again)."""
    ops = jaxsub.ops
    r = np.random.default_rng(3)
    f32 = jnp.float32
    x, res = (jnp.asarray(r.standard_normal((3, 5, 40)), f32) for _ in range(2))
    b, s, lb = (jnp.asarray(r.standard_normal(40), f32) for _ in range(3))
    qkv = jnp.asarray(r.standard_normal((2, 24, 3, 2, 16)), f32)
    scores = jnp.asarray(r.standard_normal((2, 2, 24, 24)), f32)
    bdrln = lambda x, b: ops.bias_dropout_residual_layer_norm(x, b, res, s, lb, rate=0.3, key=key)  # noqa: E731
    gelu = lambda x, b: ops.bias_gelu_dropout(x, b, rate=0.3, key=key)  # noqa: E731
    loss = lambda f: lambda x, b: jnp.sum(f(x, b) * res)  # noqa: E731
    return {"mask": ops.dropout_mask(key, (7, 9), 0.4), "bdrln": bdrln(x, b), "gelu": gelu(x, b),
            "bdrln_grad": jax.grad(loss(bdrln), argnums=(0, 1))(x, b),
            "gelu_grad": jax.grad(loss(gelu), argnums=(0, 1))(x, b),
            "softmax": ops.softmax_dropout(scores, rate=0.2, key=key),
            "attention": ops.attention_packed(qkv, dropout_rate=0.2, key=key),
            "attention_grad": jax.grad(lambda q: jnp.sum(ops.attention_packed(q, dropout_rate=0.2, key=key) ** 2))(qkv)}


def test_seed_words_padded_to_four_act_as_their_key():
    """A seed as the kernels' words (dropout.Words), two of them or padded to four as the
    scanned Encoder passes them, gives every op exactly what its key gives."""
    from jaxsub.ops.dropout import Words

    key = jax.random.key(11)
    words = seed_from_key("test", key)
    want = _ops_with_dropout(key)
    for seed in (words, jnp.pad(words, (0, 2))):
        got = _ops_with_dropout(Words(seed))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{seed.shape}{jax.tree_util.keystr(path)}")


# Offsets in 8-element blocks: small, past 2^32 (the high word), and at the low word's end.
_OFFSETS = [1, 37, (1 << 32) + 5, 0xFFFFFFFF]


def _with_offset(words, offset):
    return jnp.concatenate([words[:2], jnp.asarray([offset & 0xFFFFFFFF, offset >> 32], jnp.uint32)])


@pytest.mark.parametrize("offset", _OFFSETS)
def test_seed_words_two_and_three_offset_the_index(offset):
    """Words 2-3 of a four-word seed are the 64-bit offset, in 8-element blocks, of the
    call's first element (a slice of a larger tensor on one of several devices)."""
    words = seed_from_key("test", jax.random.key(5))
    got = np.asarray(jaxsub.ops.dropout.seed_mask(_with_offset(words, offset), (3, 1001), 0.3))
    np.testing.assert_array_equal(got, numpy_mask(np.asarray(words), (3, 1001), 0.3, offset))


def _slices_with_offsets(dtype=jnp.float32, n=40, s=16, d=8):
    """(op on a slice with its offset seed, the same slice of the op on the whole tensor)
    for each family, the slice starting at a multiple of 8 elements: rows of n, scores of
    9 x s, attention of s x s with head dim d."""
    from jaxsub.ops.dropout import Words

    key = jax.random.key(12)
    words = seed_from_key("test", key)
    rng = np.random.default_rng(0)
    x, bias = jnp.asarray(rng.standard_normal((6, n)), dtype), jnp.linspace(-1, 1, n).astype(dtype)
    scores = jnp.asarray(rng.standard_normal((4, 3, 9, s)), dtype)
    qkv = jnp.asarray(rng.standard_normal((4, s, 3, 2, d)), dtype)
    ops_ = jaxsub.ops
    cases = {
        "gelu": (lambda k, x: ops_.bias_gelu_dropout(x, bias, rate=0.3, key=k), x, 2),
        "bdrln": (lambda k, x: ops_.bias_dropout_residual_layer_norm(x, bias, x * 0.5, bias, bias, rate=0.3, key=k),
                  x, 2),
        "residual_add": (lambda k, x: ops_.dropout.residual_add(x, x, bias, rate=0.3, key=k), x, 2),
        "softmax": (lambda k, s: ops_.softmax_dropout(s, rate=0.3, key=k), scores, 1),
        "attention": (lambda k, q: ops_.attention_packed(q, dropout_rate=0.3, key=k, implementation="fused"), qkv, 1),
    }
    for name, (op, a, start) in cases.items():
        whole = op(key, a)
        per_item = math.prod(a.shape[1:]) if name != "attention" else 2 * s * s  # H * S * S
        seed = Words(_with_offset(words, start * per_item // 8))
        yield name, op(seed, a[start:]), whole[start:]
        grad = lambda k, a: jax.grad(lambda a: jnp.sum(op(k, a) ** 2))(a)
        yield name + " grad", grad(seed, a[start:]), grad(key, a)[start:]


def test_a_slice_with_its_offset_draws_the_whole_tensors_decisions():
    for name, got, want in _slices_with_offsets():
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_slice_with_its_offset_draws_the_whole_tensors_decisions_on_gpu(dtype):
    """The kernels' own Philox counters (tile_words, the attention's keep words, the
    forward's masks drawn under P V) with the offset: the fast paths' sizes."""
    assert jax.devices()[0].platform == "gpu"
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    for name, got, want in _slices_with_offsets(dtype, n=1024, s=128, d=64):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol,
                                   err_msg=name)
    words = seed_from_key("test", jax.random.key(5))
    for offset in _OFFSETS:
        got = np.asarray(jaxsub.ops.dropout.seed_mask(_with_offset(words, offset), (3, 1001), 0.3))
        np.testing.assert_array_equal(got, numpy_mask(np.asarray(words), (3, 1001), 0.3, offset))


@pytest.mark.parametrize("words", [np.zeros(3, np.uint32), np.zeros(2, np.int32), np.zeros((2, 2), np.uint32)])
def test_bad_seed_words_raise(words):
    from jaxsub.ops.dropout import Words

    with pytest.raises(ValueError, match="bias_gelu_dropout.*seed words"):
        jaxsub.ops.bias_gelu_dropout(jnp.ones((2, 8)), jnp.ones(8), rate=0.1, key=Words(jnp.asarray(words)))


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
@pytest.mark.parametrize("shape,rate", [((8, 16, 512, 512), 0.1), ((3, 7, 131), 0.3), ((5,), 0.5), ((2, 4095), 0.9)])
def test_gpu_mask_bit_identical_to_cpu(shape, rate):
    # Whole groups of eight leave as one 8-byte store; the sizes not a multiple of 8 end
    # in a partial group written byte by byte.
    key = jax.random.key(8)
    f = jax.jit(lambda k: jaxsub.ops.dropout_mask(k, shape, rate))
    cpu = f(jax.device_put(key, jax.devices("cpu")[0]))
    gpu = f(jax.device_put(key, jax.devices()[0]))
    assert gpu.devices() == {jax.devices()[0]} and jax.devices()[0].platform == "gpu"
    np.testing.assert_array_equal(np.asarray(gpu), np.asarray(cpu))


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
def test_seed_words_padded_to_four_act_as_their_key_on_gpu():
    test_seed_words_padded_to_four_act_as_their_key()


def saved_residuals(f, *args):
    """What autodiff keeps for f's backward, as printed by jax.ad_checkpoint."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    return out.getvalue()


def residual_inputs(seed, shape, dtype, bias_dtype):
    ks = jax.random.split(jax.random.key(seed), 4)
    x, y = (jax.random.normal(k, shape).astype(dtype) for k in ks[:2])
    return x, y, jax.random.normal(ks[2], shape[-1:]).astype(bias_dtype), ks[3]


def residual_vjp(fn, x, y, bias, seed_w=5):
    """fn's value and the gradients of a weighted sum of it for x, y and bias (jit)."""
    w = jax.random.normal(jax.random.key(seed_w), y.shape)
    loss = lambda *a: (fn(*a).astype(jnp.float32) * w).sum()
    return jax.jit(fn)(x, y, bias), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, y, bias)


def check_residual(got, want, dtype, bias_dtype, rows):
    for g, v, what in zip(got, want, ("out", "dx", "dy", "dbias")):
        assert_close(g, v, bias_dtype if what == "dbias" else dtype, reduction=rows if what == "dbias" else 1,
                     grad=what != "out", what=what)


@pytest.mark.parametrize("dtype,bias_dtype,shape", [
    (jnp.float32, jnp.float32, (3, 7, 5)), (jnp.bfloat16, jnp.bfloat16, (2, 130)),
    (jnp.float16, jnp.float32, (4, 1000)), (jnp.bfloat16, jnp.float32, (1, 1))])
def test_residual_add_matches_reference(dtype, bias_dtype, shape):
    """The pre-LN residual x + dropout(y + bias) of jaxsub's layers, one kernel each way
    (jaxsub_bias_dropout_residual_fwd, jaxsub_bias_dropout_bwd): value and gradients as the
    reference with dropout_mask's mask, and no boolean mask kept for the backward (the jnp
    formula keeps one)."""
    from jaxsub.ops.dropout import reference_residual_add, residual_add

    x, y, bias, key = residual_inputs(11, shape, dtype, bias_dtype)
    rate = 0.3
    keep = jaxsub.ops.dropout_mask(key, y.shape, rate)
    fused = lambda x, y, b: residual_add(x, y, b, rate=rate, key=key)
    got = residual_vjp(fused, x, y, bias)
    want = residual_vjp(lambda x, y, b: reference_residual_add(x, y, b, keep=keep, rate=rate), x, y, bias)
    check_residual(got, want, dtype, bias_dtype, math.prod(shape[:-1]))
    # Dropped elements get exactly zero gradient; x's gradient is the cotangent itself.
    assert not np.asarray(got[2], np.float32)[~np.asarray(keep)].any()
    w = jax.random.normal(jax.random.key(5), y.shape)
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(w.astype(dtype), np.float32))
    loss = lambda x, y, b: fused(x, y, b).astype(jnp.float32).sum()
    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, y, bias).as_text()
    assert "jaxsub_bias_dropout_residual_fwd" in hlo and "jaxsub_bias_dropout_bwd" in hlo
    assert "jaxsub_dropout_mask" not in hlo
    assert "bool" not in saved_residuals(loss, x, y, bias)
    # No key or rate 0: the plain sum.
    for k, r in ((None, rate), (key, 0.0)):
        np.testing.assert_array_equal(np.asarray(residual_add(x, y, bias, rate=r, key=k), np.float32),
                                      np.asarray(x + (y + bias), np.float32))


def test_residual_add_check_grads():
    from jaxsub.ops.dropout import residual_add

    x, y, bias, key = residual_inputs(13, (3, 9), jnp.float32, jnp.float32)
    check_grads(lambda x, y, b: residual_add(x, y, b, rate=0.2, key=key), (x, y, bias), order=1,
                              modes=("rev",))


def test_residual_add_vmap_over_keys_matches_loop():
    from jaxsub.ops.dropout import residual_add

    x, y, bias, _ = residual_inputs(17, (5, 24), jnp.bfloat16, jnp.bfloat16)

    def f(key):
        out, vjp = jax.vjp(lambda x, y, b: residual_add(x, y, b, rate=0.25, key=key), x, y, bias)
        return (out, *vjp(jnp.ones_like(out)))

    assert_vmap_matches_loop(f, jax.random.split(jax.random.key(18), 3))


def test_assert_vmap_matches_loop_takes_one_array_and_can_fail():
    """jaxsub.testing's check on a function returning one array (it once zipped over the
    array's rows), and on functions it must refuse: one ignoring its key, one whose vmap
    differs from its loop."""
    x = jnp.ones((4, 8))
    keys = jax.random.split(jax.random.key(19), 3)
    assert_vmap_matches_loop(lambda key: jaxsub.ops.bias_gelu_dropout(x, jnp.zeros(8), rate=0.5, key=key), keys)
    with pytest.raises(AssertionError, match="the first two keys gave the same results"):
        assert_vmap_matches_loop(lambda key: x * 2, keys)

    @jax.custom_batching.custom_vmap
    def shifted_under_vmap(u):
        return u

    @shifted_under_vmap.def_vmap
    def _(axis_size, in_batched, u):
        return u + 1.0, in_batched[0]

    with pytest.raises(AssertionError, match="Arrays are not equal"):
        assert_vmap_matches_loop(lambda key: shifted_under_vmap(jax.random.uniform(key, (3,))), keys)
    with pytest.raises(ValueError, match="assert_vmap_matches_loop: `keys` must be a batch of at least two"):
        assert_vmap_matches_loop(lambda key: x, keys[:1])


@pytest.mark.parametrize("what", ["mixed dtypes", "wide rows", "zero size", "no CUDA target"])
def test_residual_add_falls_back_to_the_formula(what, fallback_log, monkeypatch):
    """Operands the kernels do not take, or a GPU build without the target, run the jnp
    formula with dropout_mask's mask, bit for bit, and say so."""
    from jaxsub import _ffi
    from jaxsub.ops.dropout import residual_add

    dtype, shape = jnp.bfloat16, {"wide rows": (2, 16385), "zero size": (0, 8)}.get(what, (3, 40))
    x, y, bias, key = residual_inputs(19, shape, dtype, dtype)
    if what == "mixed dtypes":
        x = x.astype(jnp.float32)
    if what == "no CUDA target":  # as if on a GPU whose build lacks the target
        monkeypatch.setattr(_ffi, "platform_of", lambda a: "gpu")
        monkeypatch.setattr(_ffi, "has_cuda_target", lambda name: False)
    rate = 0.3

    def formula(x, y, bias):
        v = y + bias
        keep = jaxsub.ops.dropout_mask(key, v.shape, rate)
        return x + jnp.where(keep, v / jnp.asarray(1.0 - rate, v.dtype), jnp.zeros((), v.dtype))

    got = residual_vjp(lambda x, y, b: residual_add(x, y, b, rate=rate, key=key), x, y, bias)
    want = residual_vjp(formula, x, y, bias)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert fallback_log and fallback_log[0][0] == "residual_add"
    assert {"mixed dtypes": "dtypes", "wide rows": "16385", "zero size": "zero-size",
            "no CUDA target": "no CUDA jaxsub_bias_dropout_residual_fwd target"}[what] in fallback_log[0][1]


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs a CUDA device and the CUDA build")
@pytest.mark.parametrize("dtype,bias_dtype,shape", [
    (jnp.bfloat16, jnp.bfloat16, (8, 512, 1024)), (jnp.float16, jnp.float32, (3, 7, 131)),
    (jnp.float32, jnp.float32, (5, 4095)), (jnp.bfloat16, jnp.float32, (2, 16384)), (jnp.bfloat16, jnp.bfloat16, (1, 3))])
def test_residual_add_cuda_matches_cpu(dtype, bias_dtype, shape):
    """The CUDA kernels against the CPU handlers (the same mask, so the same dropped
    elements): the vectorized path, odd widths on the general path, the widest row."""
    from jaxsub.ops.dropout import residual_add

    x, y, bias, key = residual_inputs(23, shape, dtype, bias_dtype)
    fn = lambda x, y, b, k: residual_add(x, y, b, rate=0.1, key=k)

    def run(device):
        args = jax.device_put((x, y, bias, key), device)
        w = jax.device_put(jax.random.normal(jax.random.key(5), shape), device)
        loss = lambda x, y, b, k: (fn(x, y, b, k).astype(jnp.float32) * w).sum()
        return (jax.jit(fn)(*args), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args))

    hlo = jax.jit(fn).lower(*jax.device_put((x, y, bias, key), jax.devices()[0])).compile().as_text()
    assert "jaxsub_bias_dropout_residual_fwd" in hlo
    got, want = run(jax.devices()[0]), run(jax.devices("cpu")[0])
    check_residual(got, want, dtype, bias_dtype, math.prod(shape[:-1]))
    np.testing.assert_array_equal(np.asarray(got[2], np.float32) == 0, np.asarray(want[2], np.float32) == 0)
