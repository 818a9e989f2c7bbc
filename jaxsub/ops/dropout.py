"""Dropout randomness shared by every fused op.

The keep decision for element i (row-major index into the op's logical tensor) is a pure
function of (seed, i): Philox4x32-10 keyed by the two seed words, counter i // 8, 16-bit
lane i % 8 of the output (lane j = half j % 2 of word j // 2, low half first), kept when
the lane is >= round(rate * 2**16). The seed comes from the user's JAX
key, so any key implementation works (threefry, rbg, typed keys). Kernels regenerate the
mask in backward; nothing is stored.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi
from jaxsub.ops import config as _config


def check_rate(op: str, rate, name: str = "rate") -> float:
    if isinstance(rate, (str, bytes, bool, np.bool_)):  # float("0.1") and float(True) would pass
        raise TypeError(f"jaxsub.{op}: `{name}` must be a static Python float, got {rate!r}")
    try:
        rate = float(rate)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(f"jaxsub.{op}: `{name}` must be a static Python float, got {rate!r}") from e
    if not (0.0 <= rate < 1.0) or math.isnan(rate):
        raise ValueError(f"jaxsub.{op}: `{name}` must be in [0, 1), got {rate}")
    if scale_error(rate) > MAX_SCALE_ERROR:
        raise ValueError(f"jaxsub.{op}: `{name}` {rate} is too close to 1: keep decisions are drawn in steps of "
                         f"2^-16, so the kept elements' 1 / (1 - rate) would make the output's expected value "
                         f"{expected_scale(rate):.3g}x the input's (more than {MAX_SCALE_ERROR:.0%} off; every "
                         f"rate up to 0.999 is within it)")
    return rate


# The most by which the quantized keep probability may bias the output's expected value.
MAX_SCALE_ERROR = 0.01


def expected_scale(rate: float) -> float:
    """E[dropout(x)] / x at `rate`: the keep probability is (2^16 - threshold) / 2^16, the
    kept elements are scaled by 1 / (1 - rate)."""
    return (2**16 - int(threshold(rate))) / (2**16 * (1.0 - rate))


def scale_error(rate: float) -> float:
    """|expected_scale(rate) - 1|: at most 0.5 / (2^16 (1 - rate)), 2.5e-5 up to rates of
    0.7 and under 1% up to 0.999; a keep probability below 2^-16 still keeps 2^-16 of the
    elements."""
    return abs(expected_scale(rate) - 1.0)


def threshold(rate: float) -> np.uint32:
    """Words below this are dropped; 0 keeps everything."""
    return np.uint32(min(round(rate * 2.0**16), 2**16 - 1))


def keep_scale(rate: float) -> np.float32:
    return np.float32(1.0 / (1.0 - rate))


def attrs(rate: float) -> dict:
    """The dropout attributes of every fused op with dropout (cuda/ABI.md)."""
    return dict(threshold=threshold(rate), keep_scale=keep_scale(rate))


def keep(rate: float, letters: str) -> str | None:
    """A call's `keep` (jaxsub/_partition.py) with dropout at `rate`: the letters of the
    tensor whose elements its keep decisions index, or None where dropout is off."""
    return letters if threshold(rate) != 0 else None


class Words:
    """A dropout seed already in the kernels' form, passed where a key goes and used as is:
    uint32 words [2], or [4]: the seed, then the 64-bit offset in 8-element blocks of the
    op's first element in a larger tensor, low word first (0 for a whole tensor;
    cuda/ABI.md). `shared_seeds`
    (`optimize`, `jaxsub.flax.EncoderLayer`) and the scanned `jaxsub.flax.Encoder` pass
    seeds this way: each op gets a 16-byte quarter of one row of seeds, which XLA writes
    in one kernel, where 8-byte seeds took a copy each."""

    __slots__ = ("words",)

    def __init__(self, words):
        self.words = words


def seed_from_key(op: str, key) -> jax.Array:
    """Two uint32 words from any JAX PRNG key, passed to kernels as a device buffer.

    A threefry key's data is exactly two words and is used as is (no extra kernel); keys
    with more words (rbg) are hashed into two (`_fold`). `Words` are used as they are."""
    if key is None:
        raise ValueError(f"jaxsub.{op}: `key` is required when dropout is active (rate > 0, not deterministic)")
    if isinstance(key, Words):
        words = key.words
        if words.dtype != jnp.uint32 or words.shape not in ((2,), (4,)):
            raise ValueError(f"jaxsub.{op}: seed words must be uint32 [2] or [4], got {words.dtype} {words.shape}")
        return words
    if not isinstance(key, jax.Array):
        try:
            key = jnp.asarray(key)
        except TypeError as e:
            raise TypeError(f"jaxsub.{op}: `key` must be a JAX PRNG key, got {type(key).__name__}") from e
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed and key.dtype != jnp.uint32:
        raise TypeError(f"jaxsub.{op}: `key` must be a JAX PRNG key, got dtype {key.dtype}")
    if (typed and key.shape != ()) or (not typed and key.ndim != 1):
        raise ValueError(f"jaxsub.{op}: `key` must be a single PRNG key, got shape {key.shape}")
    if not typed and key.shape == (2,):
        return key  # the words themselves: an op that keeps its seed keeps this very array
    words = jax.random.key_data(key) if typed else key
    words = words.reshape(-1)
    if words.shape[0] == 2:
        return words
    if words.shape[0] < 2 or words.shape[0] % 2:
        raise ValueError(f"jaxsub.{op}: unsupported PRNG key with {words.shape[0]} words")
    return _fold(words)


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer (a bijection of uint32) on a uint32 array."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _fold(words):
    """Two words from a key of 2n words (rbg keys have four), each pair hashed into the
    running pair: the xor of the halves that this replaces gave every
    `jax.random.key(s, impl="rbg")` the same seed, since their data is [0, s, 0, s]."""
    acc = words[:2]
    for i in range(2, words.shape[0], 2):
        acc = _fmix32(acc * np.uint32(0x9E3779B1) ^ _fmix32(words[i:i + 2] + np.uint32(i)))
    return jnp.stack([acc[0] ^ _fmix32(acc[1]), acc[1]])  # both words of every input word


def seed_row(op: str, keys) -> jax.Array:
    """The seeds of `keys` as one uint32 row of four words per key: key i's two seed words
    at 4i and 4i + 1, then two zeros (four zeros for a None). Quarters of it are `Words`
    (`shared_seeds`); `jaxsub.flax.Encoder` keeps one row per layer."""
    return jnp.concatenate([jnp.pad(seed_from_key(op, k)[:2], (0, 2)) if k is not None else jnp.zeros(4, jnp.uint32)
                            for k in keys])


def shared_seeds(op: str, keys) -> list:
    """The ops' seeds for several keys (None stays None) as quarters of one `seed_row`.
    On a GPU, XLA computes the row, and with it the keys' derivations (a split, Flax's
    `make_rng`s), in one kernel and hands each op its quarter; an 8-byte seed per op took
    a copy kernel each (bench/NOTES.md, forty-fourth session). Fewer than two keys are
    returned as they are: one key's words are read in place."""
    keys = list(keys)
    if sum(k is not None for k in keys) < 2:
        return keys
    row = seed_row(op, keys)
    return [None if k is None else Words(row[4 * i:4 * i + 4]) for i, k in enumerate(keys)]


NO_SEED = np.zeros((2,), np.uint32)


def seed_mask(seed, shape, rate):
    """The keep-mask of `shape` for seed words (the `jaxsub_dropout_mask` target)."""
    return _ffi.call("jaxsub_dropout_mask", jax.ShapeDtypeStruct(shape, jnp.bool_), seed, threshold=threshold(rate))


def dropout_mask(key, shape, rate) -> jax.Array:
    """The boolean keep-mask the fused kernels use for a logical tensor of `shape`.

    `fused_op(..., rate=r, key=k)` equals the op's reference with this mask, so any fused
    result can be reproduced exactly with plain JAX.
    """
    rate = check_rate("dropout_mask", rate)
    if (not isinstance(shape, (tuple, list)) or
            not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ValueError(f"jaxsub.dropout_mask: `shape` must be a tuple of non-negative ints, got {shape!r}")
    shape = tuple(int(d) for d in shape)
    if rate == 0.0:
        return jnp.ones(shape, jnp.bool_)
    if key is None:  # (it has no `deterministic`, which seed_from_key's message names)
        raise ValueError("jaxsub.dropout_mask: `key` is required when dropout is active (rate > 0)")
    return seed_mask(seed_from_key("dropout_mask", key), shape, rate)


def apply_reference(v: jax.Array, keep, rate: float) -> jax.Array:
    """Reference dropout on an fp32 value given the keep-mask (None = no dropout)."""
    if keep is None or rate == 0.0:
        return v
    return jnp.where(keep, v * keep_scale(rate), 0.0)


# ---------------------------------------------------------------------------------------
# The pre-LN residual, x + dropout(y + bias), for jaxsub's own layers (internal). One
# kernel each way (cuda/gelu.cu: the GELU kernel without the GELU): the forward reads y, x
# and the bias and writes the sum; the backward writes dropout(g) and its column sums, the
# bias gradient, drawing the mask again from the seed. Written in jnp, autodiff would keep
# the boolean mask as a residual of the backward's select; the jnp formula below is the
# fallback (and the same arithmetic up to rounding: the kernels round once, from f32).

_RESIDUAL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def reference_residual_add(x, y, bias, *, keep, rate):
    """Pure-JAX x + dropout(y + bias), the kernels' arithmetic: f32, rounded once to y's
    dtype. `keep` is the keep-mask of y's shape (None = no dropout)."""
    v = y.astype(jnp.float32) + bias.astype(jnp.float32)
    return (x.astype(jnp.float32) + apply_reference(v, keep, rate)).astype(y.dtype)


def _drop_bias(y, bias, keep, rate):
    v = y + bias
    return jnp.where(keep, v / jnp.asarray(1.0 - rate, v.dtype), jnp.zeros((), v.dtype))


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(4,))
def _residual_add_jnp(x, y, bias, seed, rate):
    return x + _drop_bias(y, bias, seed_mask(seed, y.shape, rate), rate)


def _residual_add_jnp_fwd(x, y, bias, seed, rate):
    # Zero-size slices of x and y carry their dtypes and y's shape to the backward without
    # their values.
    return _residual_add_jnp(x, y, bias, seed, rate), (bias, seed, x[..., :0], y[..., :0])


def _residual_add_jnp_bwd(rate, res, g):
    bias, seed, x0, y0 = res
    shape = y0.shape[:-1] + (bias.shape[-1],)
    keep = seed_mask(seed, shape, rate)
    # The select's and the bias add's transposes, exactly as autodiff of the forward makes
    # them (the forward's values are dead code for XLA).
    _, vjp = jax.vjp(lambda y, b: _drop_bias(y, b, keep, rate), jnp.zeros(shape, y0.dtype), bias)
    dy, dbias = vjp(g.astype(y0.dtype))
    return g.astype(x0.dtype), dy, dbias, None


_residual_add_jnp.defvjp(_residual_add_jnp_fwd, _residual_add_jnp_bwd)
# forward-mode differentiation: jnp already
_residual_add_jnp.defreference("residual_add", _residual_add_jnp.__wrapped__, affine=(0, 1, 2))

_DEFAULT_LAUNCH = _config.KernelConfig().attrs("fwd")  # the kernels' default launch shape (0, 0)


def _residual_fwd_call(x, y, bias, seed, rate):
    return _ffi.call("jaxsub_bias_dropout_residual_fwd", jax.ShapeDtypeStruct(y.shape, y.dtype), y, bias, x, seed,
                     rule="... n, n, ... n, @ -> ... n", shard="...", keep=keep(rate, "... n"), **attrs(rate),
                     **_DEFAULT_LAUNCH)


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(4,))
def _residual_add_fused(x, y, bias, seed, rate):
    return _residual_fwd_call(x, y, bias, seed, rate)


def _residual_add_fused_fwd(x, y, bias, seed, rate):
    # bias[:0] carries the bias dtype; its length is g's last axis.
    return _residual_fwd_call(x, y, bias, seed, rate), (seed, bias[:0])


def _residual_add_fused_bwd(rate, res, g):
    seed, bias0 = res
    dy, dbias, _ = _ffi.call(
        "jaxsub_bias_dropout_bwd",
        (jax.ShapeDtypeStruct(g.shape, g.dtype), jax.ShapeDtypeStruct(g.shape[-1:], bias0.dtype), _ffi.workspace(g, 1)),
        g, seed, rule="... n, @ -> ... n, n, !_ _ n", shard="...", keep=keep(rate, "... n"), **attrs(rate),
        **_DEFAULT_LAUNCH)
    return g, dy, dbias, None


_residual_add_fused.defvjp(_residual_add_fused_fwd, _residual_add_fused_bwd)
_residual_add_fused.defreference("residual_add", lambda x, y, bias, seed, rate: reference_residual_add(
    x, y, bias, keep=seed_mask(seed, y.shape, rate) if rate > 0.0 else None, rate=rate), affine=(0, 1, 2))


def _residual_unsupported(x, y, bias) -> str | None:
    """Why the kernels cannot take these operands (None: they can)."""
    if y.size == 0:
        return "zero-size input"
    if y.shape[-1] > _ffi.MAX_COLS:
        return f"last dimension {y.shape[-1]} > {_ffi.MAX_COLS}"
    if x.dtype != y.dtype or y.dtype not in _RESIDUAL_DTYPES or bias.dtype not in (y.dtype, jnp.float32):
        return f"dtypes x {x.dtype}, y {y.dtype}, bias {bias.dtype} (the kernels take x and y of one float dtype)"
    return _ffi.target_unsupported(y, "jaxsub_bias_dropout_residual_fwd")


def residual_add(x, y, bias, *, rate, key):
    """x + dropout(y + bias), the keep-mask `dropout_mask(key, y.shape, rate)` (no dropout
    when key is None or rate is 0). x and y have one shape; bias is y's last axis. The
    backward regenerates the mask instead of keeping it. Operands the kernels do not take
    (mixed dtypes, rows longer than 16384, no CUDA target) run the jnp formula, in y's
    dtype before the add, with a log line."""
    if key is None or rate == 0.0:
        return x + (y + bias)
    if x.shape != y.shape or bias.shape != y.shape[-1:]:
        raise ValueError(f"jaxsub.residual_add: x {x.shape}, y {y.shape} and bias {bias.shape} do not fit")
    seed, rate = seed_from_key("residual_add", key), check_rate("residual_add", rate)
    reason = _residual_unsupported(x, y, bias)
    if reason is not None:
        _ffi.fallback("residual_add", reason, instead="the jnp formula")
        return _residual_add_jnp(x, y, bias, seed, rate)
    return _residual_add_fused(x, y, bias, seed, rate)
