"""Bias + GELU + dropout (paper: BRD in the forward pass, BDRB in the backward pass).

y = dropout(gelu(x + bias)) in one pass over x: the pre-activation x + bias and the
activation are never written to memory, and backward recomputes both from x, bias and
the seed (the dropout mask is regenerated, not stored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi
from jaxsub.ops import config as _config
from jaxsub.ops import dropout as _dropout
from jaxsub.ops import gemm as _gemm

_OP = "bias_gelu_dropout"
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---------------------------------------------------------------------------------------
# Reference.


def reference_bias_gelu_dropout(x, bias, *, keep, rate, approximate=False):
    """Pure-JAX bias + GELU + dropout: fp32 compute, output in x.dtype.

    `keep` is the boolean keep-mask of x's shape (None = no dropout); kept elements are
    scaled by 1 / (1 - rate). GELU is `jax.nn.gelu(approximate=...)`: exact (erf) or tanh.
    """
    v = x.astype(jnp.float32) + bias.astype(jnp.float32)
    y = jax.nn.gelu(v, approximate=approximate)
    return _dropout.apply_reference(y, keep, rate).astype(x.dtype)


# ---------------------------------------------------------------------------------------
# FFI calls. `kernel` is the checked KernelConfig (jaxsub.ops.config); each direction passes
# its own half.


def _fwd_call(x, bias, seed, *, approximate, rate, kernel):
    return _ffi.call(
        "jaxsub_bias_gelu_dropout_fwd",
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        x, bias, seed,
        approximate=approximate,
        **_dropout.attrs(rate),
        **kernel.attrs("fwd"),
    )


def _bwd_call(dy, x, bias, seed, *, approximate, rate, kernel, with_y=False):
    """(dx, dbias, y): y, the forward's output written again by the same kernel, only
    with_y (else None; the target's y result is then empty)."""
    dx, dbias, _, y = _ffi.call(
        "jaxsub_bias_gelu_dropout_bwd",
        (
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(bias.shape, bias.dtype),
            _ffi.workspace(x, 1),
            jax.ShapeDtypeStruct(x.shape if with_y else (0,), x.dtype),
        ),
        dy, x, bias, seed,
        approximate=approximate,
        **_dropout.attrs(rate),
        **kernel.attrs("bwd"),
    )
    return dx, dbias, (y if with_y else None)


# ---------------------------------------------------------------------------------------
# custom_vjp. The seed is an ordinary (integer, hence non-differentiable) primal so that it
# may be traced (jit, grad, vmap over keys); `approximate`, `rate` and the kernel
# configuration are static.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x, bias, seed, approximate, rate, kernel):
    return _fwd_call(x, bias, seed, approximate=approximate, rate=rate, kernel=kernel)


def _fused_fwd(x, bias, seed, approximate, rate, kernel):
    return _fwd_call(x, bias, seed, approximate=approximate, rate=rate, kernel=kernel), (x, bias, seed)


def _fused_bwd(approximate, rate, kernel, res, dy):
    x, bias, seed = res
    dx, dbias, _ = _bwd_call(dy, x, bias, seed, approximate=approximate, rate=rate, kernel=kernel)
    return dx, dbias, None


_fused.defvjp(_fused_fwd, _fused_bwd)


# The op followed by a product with a [N, E] weight. Autodiff of `y @ w` keeps y for w's
# gradient; here the backward kernel writes y again instead (two more instructions per
# element beside the derivative), so only x is kept. That pays where a kept value costs
# more than writing it again: in a scanned stack, y (the size of x) is copied into the
# residual stack and back out for the product (bench/NOTES.md, eighteenth session).


def _dense(y, w, library=False):
    """y @ w over y's last axis: XLA's product, or jaxsub's GEMM target (`ops.dense`'s
    reason: in a scan it reads the stacked w in place)."""
    if not library:
        return jnp.einsum("...n,ne->...e", y, w)
    return _gemm._forward(y, w, None, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused_dense(x, bias, w, seed, approximate, rate, kernel, library):
    return _dense(_fwd_call(x, bias, seed, approximate=approximate, rate=rate, kernel=kernel), w, library)


def _fused_dense_fwd(x, bias, w, seed, approximate, rate, kernel, library):
    out = _dense(_fwd_call(x, bias, seed, approximate=approximate, rate=rate, kernel=kernel), w, library)
    return out, (x, bias, w, seed)


def _fused_dense_bwd(approximate, rate, kernel, library, res, dout):
    x, bias, w, seed = res
    d2 = dout.reshape(-1, dout.shape[-1])
    if library:  # the gradients without barriers: XLA may write dw straight into a scan's stack
        dy = _gemm.gemm(d2, w, trans_b=True, barrier=False).reshape(*x.shape)
    else:
        dy = jnp.einsum("...e,ne->...n", dout, w)
    dx, dbias, y = _bwd_call(dy, x, bias, seed, approximate=approximate, rate=rate, kernel=kernel, with_y=True)
    y2 = y.reshape(-1, y.shape[-1])
    dw = _gemm.gemm(y2, d2, trans_a=True, barrier=False) if library else jnp.einsum("tn,te->ne", y2, d2)
    return dx, dbias, dw, None


_fused_dense.defvjp(_fused_dense_fwd, _fused_dense_bwd)


# ---------------------------------------------------------------------------------------
# Public function.


def _check_bool(name, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"jaxsub.{_OP}: `{name}` must be a Python bool, got {value!r}")
    return bool(value)


def _check_inputs(x, bias):
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    bias = bias if isinstance(bias, jax.Array) else jnp.asarray(bias)
    if x.ndim < 1:
        raise ValueError(f"jaxsub.{_OP}: `x` must have rank >= 1, got shape {x.shape}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"jaxsub.{_OP}: `x` must be float32, bfloat16 or float16, got {x.dtype}")
    if bias.shape != (x.shape[-1],):
        raise ValueError(
            f"jaxsub.{_OP}: `bias` must have shape ({x.shape[-1]},) (x.shape[-1]), got {bias.shape}")
    if bias.dtype not in (x.dtype, jnp.dtype(jnp.float32)):
        raise TypeError(f"jaxsub.{_OP}: `bias` must have x's dtype ({x.dtype}) or float32, got {bias.dtype}")
    return x, bias


def _prepare(x, bias, rate, key, approximate, deterministic, kernel_config):
    """Checked (x, bias, rate, approximate, seed, kernel, fallback reason or None)."""
    x, bias = _check_inputs(x, bias)
    rate = _dropout.check_rate(_OP, rate)
    approximate = _check_bool("approximate", approximate)
    deterministic = _check_bool("deterministic", deterministic)
    if deterministic:
        rate = 0.0
    seed = _dropout.seed_from_key(_OP, key) if rate > 0.0 else _dropout.NO_SEED
    kernel = _config.kernel_config(_OP, kernel_config, _config.row_signature(
        x, bias.dtype, approximate=approximate, dropout_rate=rate))
    n = x.shape[-1]
    reason = None
    if n > _ffi.MAX_COLS or x.size == 0:
        reason = "zero-size input" if x.size == 0 else f"last dimension {n} > {_ffi.MAX_COLS}"
    return x, bias, rate, approximate, seed, kernel, reason


def bias_gelu_dropout(x, bias, *, rate, key, approximate=False, deterministic=False, kernel_config=None):
    """dropout(gelu(x + bias)), fused into one kernel per pass.

    Args:
      x: activations [..., N], float32, bfloat16 or float16.
      bias: [N], x's dtype or float32 (its gradient comes back in the same dtype).
      rate: dropout probability, a static float in [0, 1).
      key: a JAX PRNG key (any implementation, typed or raw); required when dropout is
        active (rate > 0 and not deterministic). It may be traced (jit, grad, vmap).
      approximate: tanh GELU when True, exact (erf) GELU otherwise, as `jax.nn.gelu`.
      deterministic: when True (or rate == 0), no dropout and `key` is not needed.
      kernel_config: the launch shape of the CUDA kernels, a mapping with any of the keys
        fwd_threads, bwd_threads (threads per block) and fwd_elems, bwd_elems (elements
        per thread at most); missing keys keep the defaults
        (`jaxsub.ops.config.KernelConfig`). None: the configuration in effect
        (`jaxsub.ops.config.use`), else the defaults.

    Returns:
      An array of x's shape and dtype. Arithmetic is fp32, rounded once.

    Dropout is generated inside the kernel with Philox4x32-10 from a seed derived from
    `key`; element i of x (row-major) is kept with probability 1 - rate and scaled by
    1 / (1 - rate). `jaxsub.ops.dropout_mask(key, x.shape, rate)` returns exactly the
    keep-mask used, so `reference_bias_gelu_dropout(x, bias, keep=mask, rate=rate)`
    reproduces the result. The backward pass regenerates the mask from the seed, so no
    mask is stored. Gradients flow to `x` and `bias`.
    """
    x, bias, rate, approximate, seed, kernel, reason = _prepare(x, bias, rate, key, approximate, deterministic,
                                                                 kernel_config)
    if reason is not None:
        _ffi.fallback(_OP, reason)
        keep = _dropout.dropout_mask(key, x.shape, rate) if rate > 0.0 and x.size else None
        return reference_bias_gelu_dropout(x, bias, keep=keep, rate=rate, approximate=approximate)
    return _fused(x, bias, seed, approximate, rate, kernel)


def bias_gelu_dropout_dense(x, bias, kernel, *, rate, key, approximate=False, deterministic=False,
                            kernel_config=None, library_products=False):
    """`bias_gelu_dropout(x, bias, ...) @ kernel`, keeping x rather than the GELU output for
    the backward pass.

    Args:
      x, bias, rate, key, approximate, deterministic, kernel_config: as bias_gelu_dropout's.
      kernel: [N, E] with N = x.shape[-1], x's dtype.
      library_products: the product and its two gradient products through jaxsub's GEMM
        target (`jaxsub.ops.dense`: for a kernel sliced from stacked layers in a scan)
        rather than XLA's, for bf16/f16 x (`jaxsub.ops.gemm.in_place_pays`).

    Returns:
      [..., E] in x's dtype: the same values as `jnp.einsum("...n,ne->...e",
      bias_gelu_dropout(x, bias, ...), kernel)` and the same gradients. The backward
      kernel writes the GELU output again for kernel's gradient (one more write of x's
      size) instead of the forward keeping it: what a scanned stack of layers wants, where
      every kept value is copied into the stack and back out.
    """
    x, bias, rate, approximate, seed, config, reason = _prepare(x, bias, rate, key, approximate, deterministic,
                                                                kernel_config)
    kernel = kernel if isinstance(kernel, jax.Array) else jnp.asarray(kernel)
    if kernel.ndim != 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(f"jaxsub.{_OP}_dense: `kernel` must have shape ({x.shape[-1]}, E), got {kernel.shape}")
    if kernel.dtype != x.dtype:
        raise TypeError(f"jaxsub.{_OP}_dense: `kernel` must have x's dtype ({x.dtype}), got {kernel.dtype}")
    if reason is not None:
        return _dense(bias_gelu_dropout(x, bias, rate=rate, key=key, approximate=approximate,
                                        kernel_config=kernel_config), kernel)
    library = (_check_bool("library_products", library_products) and _gemm.in_place_pays(x.dtype)
               and _gemm.supported(x, kernel))
    return _fused_dense(x, bias, kernel, seed, approximate, rate, config, library)
