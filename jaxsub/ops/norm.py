"""Layer norm and bias-dropout-residual-layer-norm (BDRLN), fused.

Both normalize over the last axis: a tensor [..., N] is treated as R rows of N. The fused
kernels read each input once and write each output once; forward saves only the per-row
statistics (mean and rstd, f32) for backward.

Dropout in BDRLN is generated inside the kernel (Philox4x32-10 keyed by a seed derived
from the user's key, decision per row-major element index): nothing is stored, backward
regenerates the same mask, and `jaxsub.ops.dropout_mask(key, x.shape, rate)` returns it,
so any result can be reproduced with the pure-JAX references below.

Layout of this module: references, ffi_call wrappers, custom_vjp rules, public functions.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi
from jaxsub.ops import config as _config
from jaxsub.ops import dropout

_F32 = jnp.dtype(jnp.float32)
_ACTIVATION_DTYPES = (_F32, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---------------------------------------------------------------------------------------
# References: fp32 compute, output in x.dtype. The test oracle and the fallback.


def _normalize(h, scale, bias, eps):
    """Layer norm of an f32 array over its last axis; a None parameter is the identity."""
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    y = (h - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * scale.astype(_F32)
    if bias is not None:
        y = y + bias.astype(_F32)
    return y


def reference_layer_norm(x, scale, bias, *, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis."""
    return _normalize(x.astype(_F32), scale, bias, eps).astype(x.dtype)


def reference_bdrln(x, bias, residual, scale, ln_bias, *, keep, rate, eps=1e-5):
    """y = layer_norm(residual + dropout(x + bias)); `keep` is the boolean keep-mask of
    x's shape (None: no dropout), kept values are scaled by 1 / (1 - rate)."""
    return _normalize(_reference_sum(x, bias, residual, keep, rate), scale, ln_bias, eps).astype(x.dtype)


def _reference_sum(x, bias, residual, keep, rate):
    """h = residual + dropout(x + bias) in f32, the layer norm's input in BDRLN."""
    v = x.astype(_F32)
    if bias is not None:
        v = v + bias.astype(_F32)
    return residual.astype(_F32) + dropout.apply_reference(v, keep, rate)


# ---------------------------------------------------------------------------------------
# ffi_call wrappers, argument for argument as cuda/ABI.md lists them. `kernel` is the
# checked KernelConfig (jaxsub.ops.config); each direction passes its own half.


def _like(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _row_stats(x):
    """mean and rstd: f32[R], shaped like x without its last axis."""
    s = jax.ShapeDtypeStruct(x.shape[:-1], _F32)
    return s, s


def _layer_norm_fwd_call(x, scale, bias, eps, kernel):
    return _ffi.call("jaxsub_layer_norm_fwd", (_like(x), *_row_stats(x)), x, scale, bias,
                     rule="... n, n, n -> ... n, ..., ...", shard="...", eps=np.float32(eps), **kernel.attrs("fwd"))


def _optional(a, like):
    """An optional [R, N] operand: `a`, or an empty [0] one in like's dtype for None."""
    return jnp.zeros((0,), like.dtype) if a is None else a


def _layer_norm_bwd_call(dy, x, scale, mean, rstd, kernel, dh=None):
    """dh: a cotangent of x itself, added to dx inside the kernel; None: none."""
    dx, dscale, dbias, _ = _ffi.call(
        "jaxsub_layer_norm_bwd", (_like(x), _like(scale), _like(scale), _ffi.workspace(x, 2)),
        dy, _optional(dh, dy), x, scale, mean, rstd,
        rule="... n, ... n, ... n, n, ..., ... -> ... n, n, n, !_ _ n", shard="...", **kernel.attrs("bwd"))
    return dx, dscale, dbias


def _bdrln_fwd_call(x, bias, residual, scale, ln_bias, seed, eps, rate, kernel, keep_h=False):
    """(y, mean, rstd, h): h = residual + dropout(x + bias) in x's dtype where keep_h, else
    an empty [0] array (the kernel does not write it)."""
    h = _like(x) if keep_h else jax.ShapeDtypeStruct((0,), x.dtype)
    return _ffi.call("jaxsub_bdrln_fwd", (_like(x), *_row_stats(x), h), x, bias, residual, scale,
                     ln_bias, seed, rule="... n, n, ... n, n, n, @ -> ... n, ..., ..., ... n",
                     shard="...", keep=dropout.keep(rate, "... n"), eps=np.float32(eps), **dropout.attrs(rate),
                     **kernel.attrs("fwd"))


def _bdrln_bwd_call(dy, dy2, x, bias, residual, scale, mean, rstd, seed, rate, kernel, dh=None):
    """dy2: a second cotangent of y, added to dy inside the kernel; dh: a cotangent of h
    itself, added to the layer norm's gradient of h; None: an empty [0] operand."""
    *grads, _ = _ffi.call(
        "jaxsub_bdrln_bwd",
        (_like(x), _like(bias), _like(x), _like(scale), _like(scale), _ffi.workspace(x, 3)),
        dy, _optional(dy2, dy), _optional(dh, dy), x, bias, residual, scale, mean, rstd, seed,
        rule="... n, ... n, ... n, ... n, n, ... n, n, ..., ..., @ -> ... n, n, ... n, n, n, !_ _ n",
        shard="...", keep=dropout.keep(rate, "... n"), **dropout.attrs(rate), **kernel.attrs("bwd"))
    return grads


# ---------------------------------------------------------------------------------------
# custom_vjp rules. eps, rate and the kernel configuration are static; the seed is an
# integer primal whose cotangent is None, so it may be traced (a key under jit, vmap or
# grad).


# with_input: return (y, x), x's second cotangent added to dx in the kernel
# (layer_norm_and_input).
@functools.partial(_ffi.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm(x, scale, bias, eps, kernel, with_input):
    y = _layer_norm_fwd_call(x, scale, bias, eps, kernel)[0]
    return (y, x) if with_input else y


def _layer_norm_fwd(x, scale, bias, eps, kernel, with_input):
    y, mean, rstd = _layer_norm_fwd_call(x, scale, bias, eps, kernel)
    return ((y, x) if with_input else y), (x, scale, mean, rstd)


def _layer_norm_bwd(eps, kernel, with_input, residuals, ct):
    del eps
    dy, dh = ct if with_input else (ct, None)
    return _layer_norm_bwd_call(dy, *residuals, kernel, dh=dh)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _layer_norm_reference(x, scale, bias, eps, kernel, with_input):
    """_layer_norm in jnp (forward-mode differentiation: `_ffi.custom_vjp`)."""
    y = reference_layer_norm(x, scale, bias, eps=eps)
    return (y, x) if with_input else y


_layer_norm.defreference("layer_norm", _layer_norm_reference, affine=(2,))


# `outputs`: "y" (y alone), "yy" (y twice) or "yh" (y and h, the sum the layer norm reads). Separate
# outputs reach the backward as separate cotangents, and the kernel adds them as it reads
# them (dy2 for the second y, dh after the layer norm's gradient of h), instead of XLA
# adding them in a kernel of its own first (bdrln_pair, bdrln_and_sum).
@functools.partial(_ffi.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _bdrln(x, bias, residual, scale, ln_bias, seed, eps, rate, kernel, outputs):
    return _bdrln_fwd(x, bias, residual, scale, ln_bias, seed, eps, rate, kernel, outputs)[0]


def _bdrln_fwd(x, bias, residual, scale, ln_bias, seed, eps, rate, kernel, outputs):
    y, mean, rstd, h = _bdrln_fwd_call(x, bias, residual, scale, ln_bias, seed, eps, rate, kernel,
                                       keep_h=outputs == "yh")
    out = {"y": y, "yy": (y, y), "yh": (y, h)}[outputs]
    return out, (x, bias, residual, scale, mean, rstd, seed)


def _bdrln_bwd(eps, rate, kernel, outputs, residuals, ct):
    del eps
    dy, dy2, dh = ct, None, None
    if outputs == "yy":
        dy, dy2 = ct
    elif outputs == "yh":
        dy, dh = ct
    dx, dbias, dresidual, dscale, dln_bias = _bdrln_bwd_call(dy, dy2, *residuals, rate, kernel, dh=dh)
    return dx, dbias, dresidual, dscale, dln_bias, None


_bdrln.defvjp(_bdrln_fwd, _bdrln_bwd)


def _bdrln_reference(x, bias, residual, scale, ln_bias, seed, eps, rate, kernel, outputs):
    """_bdrln in jnp (forward-mode differentiation: `_ffi.custom_vjp`), the kernel's mask."""
    keep = dropout.seed_mask(seed, x.shape, rate) if rate > 0.0 else None
    h = _reference_sum(x, bias, residual, keep, rate)
    y = _normalize(h, scale, ln_bias, eps).astype(x.dtype)
    return {"y": y, "yy": (y, y), "yh": (y, h.astype(x.dtype))}[outputs]


_bdrln.defreference("bias_dropout_residual_layer_norm", _bdrln_reference, affine=(4,))


# ---------------------------------------------------------------------------------------
# Validation (trace time) and the fallback decision.


def _check_activation(op, name, a):
    a = jnp.asarray(a)
    if a.dtype not in _ACTIVATION_DTYPES:
        raise TypeError(f"jaxsub.{op}: `{name}` must be float32, bfloat16 or float16, got {a.dtype}")
    if a.ndim < 1:
        raise ValueError(f"jaxsub.{op}: `{name}` must have at least one dimension (the normalized "
                         f"last axis), got shape {a.shape}")
    return a


def _check_eps(op, eps):
    if isinstance(eps, (str, bytes, bool, np.bool_)):  # float("1e-5") and float(True) would pass
        raise TypeError(f"jaxsub.{op}: `eps` must be a static Python float, got {eps!r}")
    try:
        eps = float(eps)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(f"jaxsub.{op}: `eps` must be a static Python float, got {eps!r}") from e
    if not (eps > 0.0 and math.isfinite(eps)):
        raise ValueError(f"jaxsub.{op}: `eps` must be positive and finite, got {eps}")
    return eps


def _check_params(op, x, params):
    """`params` is a list of (name, array or None, fill). Each array must be [N] in x's dtype
    or float32. The kernels take one parameter dtype, so all are brought to float32 if any
    is float32 (autodiff casts their gradients back); None becomes the constant `fill`."""
    n = x.shape[-1]
    given = []
    for name, p, _ in params:
        if p is None:
            continue
        p = jnp.asarray(p)
        if p.dtype not in (x.dtype, _F32):
            raise TypeError(f"jaxsub.{op}: `{name}` must be float32 or have the dtype of x "
                            f"({x.dtype}), got {p.dtype}")
        if p.shape != (n,):
            raise ValueError(f"jaxsub.{op}: `{name}` must have shape ({n},) (the last axis of x), "
                             f"got {p.shape}")
        given.append(p)
    pdtype = _F32 if any(p.dtype == _F32 for p in given) else x.dtype
    return [jnp.full((n,), fill, pdtype) if p is None else jnp.asarray(p).astype(pdtype)
            for _, p, fill in params]


def _fallback_reason(x):
    if x.size == 0:
        return "zero-size input"
    if x.shape[-1] > _ffi.MAX_COLS:
        return f"last dimension {x.shape[-1]} > {_ffi.MAX_COLS}"
    return None


# ---------------------------------------------------------------------------------------
# Public functions.


def layer_norm(x, scale, bias, *, eps=1e-5, kernel_config=None):
    """Layer norm over the last axis, fused.

    y = (x - mean) / sqrt(var + eps) * scale + bias, with mean and (biased) variance over
    the last axis computed in f32. x: [..., N] float32/bfloat16/float16; scale, bias: [N]
    in x's dtype or float32, or None (ones / zeros, no gradient). y has x's dtype;
    gradients come back in the inputs' dtypes.

    kernel_config: the launch shape of the CUDA kernels, a mapping with any of the keys
    fwd_threads, bwd_threads (threads per block) and fwd_elems, bwd_elems (elements per
    thread at most); missing keys keep the defaults (`jaxsub.ops.config.KernelConfig`).
    None: the configuration in effect (`jaxsub.ops.config.use`), else the defaults.
    """
    return _layer_norm_op(x, scale, bias, eps=eps, kernel_config=kernel_config, with_input=False)


def layer_norm_and_input(x, scale, bias, *, eps=1e-5, kernel_config=None):
    """(`layer_norm(x, ...)`, x), for an x with other consumers besides the layer norm (a
    pre-LN layer's input, which is also its first residual). x's cotangent from the second
    output is added to the layer norm's dx inside the backward kernel, instead of autodiff
    adding the two in an XLA kernel of its own. Internal to jaxsub's layers."""
    return _layer_norm_op(x, scale, bias, eps=eps, kernel_config=kernel_config, with_input=True)


def _layer_norm_op(x, scale, bias, *, eps, kernel_config, with_input):
    op = "layer_norm"
    x = _check_activation(op, "x", x)
    eps = _check_eps(op, eps)
    scale, bias = _check_params(op, x, [("scale", scale, 1.0), ("bias", bias, 0.0)])
    kernel = _config.kernel_config(op, kernel_config, _config.row_signature(x, scale.dtype))
    reason = _fallback_reason(x)
    if reason is not None:
        _ffi.fallback(op, reason)
        y = reference_layer_norm(x, scale, bias, eps=eps)
        return (y, x) if with_input else y
    return _layer_norm(x, scale, bias, eps, kernel, with_input)


def bias_dropout_residual_layer_norm(x, bias, residual, scale, ln_bias, *, rate, key, eps=1e-5,
                                     deterministic=False, kernel_config=None):
    """y = layer_norm(residual + dropout(x + bias), scale, ln_bias), fused (paper: BDRLN).

    The epilogue of a post-LN transformer sublayer. x, residual: [..., N], same shape and
    dtype (float32/bfloat16/float16); bias, scale, ln_bias: [N] in x's dtype or float32, or
    None (zeros / ones / zeros, no gradient).

    Dropout drops each element of x + bias with probability `rate` and scales kept ones by
    1 / (1 - rate). The mask is generated in the kernel from `key` and is exactly
    `jaxsub.ops.dropout_mask(key, x.shape, rate)`; backward regenerates it. With rate 0 or
    deterministic=True there is no dropout and `key` may be None.

    kernel_config: the launch shape of the CUDA kernels, as for `layer_norm`.
    """
    return _bdrln_op(x, bias, residual, scale, ln_bias, rate=rate, key=key,
                     eps=eps, deterministic=deterministic, kernel_config=kernel_config, outputs="y")


def bdrln_pair(x, bias, residual, scale, ln_bias, *, rate, key, eps=1e-5, deterministic=False, kernel_config=None):
    """`bias_dropout_residual_layer_norm` returning its output twice, as (y, y), for a y
    with two consumers (a post-LN layer's h feeds the next matmul and the next residual).

    As separate outputs, the two consumers' cotangents reach the backward kernel
    separately, and it adds them while reading them. With one output, autodiff would add
    them first, in an XLA kernel that reads two [R, N] arrays and writes one (at BERT-large
    size, about as long as a third of the backward kernel). Internal to jaxsub's layers.
    """
    return _bdrln_op(x, bias, residual, scale, ln_bias, rate=rate, key=key,
                     eps=eps, deterministic=deterministic, kernel_config=kernel_config, outputs="yy")


def bdrln_and_sum(x, bias, residual, scale, ln_bias, *, rate, key, eps=1e-5, deterministic=False,
                  kernel_config=None):
    """(`bias_dropout_residual_layer_norm(...)`, h) with h = residual + dropout(x + bias) in
    x's dtype: a pre-LN layer's residual stream, which the layer norm reads and the next
    residual adds to. One kernel writes both, and the backward kernel adds h's own
    cotangent to the layer norm's gradient of h, so the pre-LN residual needs no XLA select,
    mask kernel or gradient add of its own. The layer norm normalizes h in f32, before h is
    rounded to x's dtype. Internal to jaxsub's layers."""
    return _bdrln_op(x, bias, residual, scale, ln_bias, rate=rate, key=key,
                     eps=eps, deterministic=deterministic, kernel_config=kernel_config, outputs="yh")


def _bdrln_op(x, bias, residual, scale, ln_bias, *, rate, key, eps, deterministic, kernel_config, outputs):
    op = "bias_dropout_residual_layer_norm"
    x = _check_activation(op, "x", x)
    residual = jnp.asarray(residual)
    if residual.dtype != x.dtype:
        raise TypeError(f"jaxsub.{op}: `residual` must have the dtype of x ({x.dtype}), got {residual.dtype}")
    if residual.shape != x.shape:
        raise ValueError(f"jaxsub.{op}: `residual` must have the shape of x {x.shape}, got {residual.shape}")
    eps = _check_eps(op, eps)
    rate = dropout.check_rate(op, rate)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"jaxsub.{op}: `deterministic` must be a Python bool, got {deterministic!r}")
    if deterministic:
        rate = 0.0
    bias, scale, ln_bias = _check_params(
        op, x, [("bias", bias, 0.0), ("scale", scale, 1.0), ("ln_bias", ln_bias, 0.0)])
    seed = dropout.seed_from_key(op, key) if rate > 0.0 else jnp.asarray(dropout.NO_SEED)
    kernel = _config.kernel_config(op, kernel_config, _config.row_signature(x, scale.dtype, dropout_rate=rate))
    reason = _fallback_reason(x)
    if reason is not None:
        _ffi.fallback(op, reason)
        keep = dropout.dropout_mask(key, x.shape, rate) if rate > 0.0 else None
        y = reference_bdrln(x, bias, residual, scale, ln_bias, keep=keep, rate=rate, eps=eps)
        if outputs == "yh":
            return y, _reference_sum(x, bias, residual, keep, rate).astype(x.dtype)
        return {"y": y, "yy": (y, y)}[outputs]
    return _bdrln(x, bias, residual, scale, ln_bias, seed, eps, rate, kernel, outputs)
