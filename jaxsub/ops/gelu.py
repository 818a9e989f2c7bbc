"""Bias + GELU + dropout (paper: BRD in the forward pass, BDRB in the backward pass).

y = dropout(gelu(x + bias)) in one pass over x: the pre-activation x + bias and the
activation are never written to memory, and backward recomputes both from x, bias and
the seed (the dropout mask is regenerated, not stored).

`dense_bias_gelu_dropout` puts the product before it into the same call: on an H200 (opt-in,
JAXSUB_DENSE_GELU=1) a GEMM whose epilogue writes both the product (for the backward) and
the GELU output (cuda/dense_gelu.cu), so that the GELU pass over the product goes.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

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
        rule="... n, n, @ -> ... n", shard="...", keep=_dropout.keep(rate, "... n"),
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
        rule="... n, ... n, n, @ -> ... n, n, !_ _ n, ... n", shard="...", keep=_dropout.keep(rate, "... n"),
        approximate=approximate,
        **_dropout.attrs(rate),
        **kernel.attrs("bwd"),
    )
    return dx, dbias, (y if with_y else None)


# ---------------------------------------------------------------------------------------
# custom_vjp. The seed is an ordinary (integer, hence non-differentiable) primal so that it
# may be traced (jit, grad, vmap over keys); `approximate`, `rate` and the kernel
# configuration are static.


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x, bias, seed, approximate, rate, kernel):
    return _fwd_call(x, bias, seed, approximate=approximate, rate=rate, kernel=kernel)


def _fused_fwd(x, bias, seed, approximate, rate, kernel):
    return _fwd_call(x, bias, seed, approximate=approximate, rate=rate, kernel=kernel), (x, bias, seed)


def _fused_bwd(approximate, rate, kernel, res, dy):
    x, bias, seed = res
    dx, dbias, _ = _bwd_call(dy, x, bias, seed, approximate=approximate, rate=rate, kernel=kernel)
    return dx, dbias, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def _reference(x, bias, seed, approximate, rate):
    """The fused op in jnp (forward-mode differentiation: `_ffi.custom_vjp`), the kernel's mask."""
    keep = _dropout.seed_mask(seed, x.shape, rate) if rate > 0.0 else None
    return reference_bias_gelu_dropout(x, bias, keep=keep, rate=rate, approximate=approximate)


_fused.defreference(_OP, lambda x, bias, seed, approximate, rate, kernel: _reference(x, bias, seed, approximate, rate))


# The op followed by a product with a [N, E] weight. Autodiff of `y @ w` keeps y for w's
# gradient; here the backward kernel writes y again instead (two more instructions per
# element beside the derivative), so only x is kept: memory for time. (It paid in scanned
# stacks while kept values were copied into the stack and back out, eighteenth session;
# since they are written in place, keeping y is faster there too, thirty-first session.)


def _dense(y, w, library=False):
    """y @ w over y's last axis: XLA's product, or jaxsub's GEMM target (`ops.dense`'s
    reason: in a scan it reads the stacked w in place)."""
    if not library:
        return jnp.einsum("...n,ne->...e", y, w)
    return _gemm.forward(y, w, None, 1)


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
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
_fused_dense.defreference("bias_gelu_dropout_dense", lambda x, bias, w, seed, approximate, rate, kernel, library: (
    _dense(_reference(x, bias, seed, approximate, rate), w)))


# The product before the op in the same call (dense_gelu_fwd: y and the product h for the
# backward), optionally followed by a product with a [F, E] weight whose backward writes y
# again (as _fused_dense). Residuals: x, the weights, h, the bias and the seed; never y.


def _dense_gelu_call(x2, w, bias, seed, *, approximate, rate):
    shape = jax.ShapeDtypeStruct((x2.shape[0], w.shape[1]), x2.dtype)
    # The contracted k is never sliced: the GELU of a partial sum is not a part of one.
    return _ffi.call("jaxsub_dense_gelu_fwd", (shape, shape), x2, w, bias, seed, rule="m k, k n, n, @ -> m n, m n",
                     shard="m n", keep=_dropout.keep(rate, "m n"), approximate=approximate, **_dropout.attrs(rate))


def _product(a, b, library, *, trans_a=False, trans_b=False):
    """op(a) @ op(b) for 2-D a, b: jaxsub's GEMM target (library) or XLA's."""
    if library:  # no barrier: XLA may write a weight gradient straight into a scan's stack
        return _gemm.gemm(a, b, trans_a=trans_a, trans_b=trans_b, barrier=False)
    return jnp.matmul(a.T if trans_a else a, b.T if trans_b else b)


def _dg_forward(x, w, bias, w_out, seed, approximate, rate, library):
    y, h = _dense_gelu_call(x.reshape(-1, x.shape[-1]), w, bias, seed, approximate=approximate, rate=rate)
    out = y if w_out is None else _product(y, w_out, library)
    return out.reshape(*x.shape[:-1], out.shape[-1]), h


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _dense_gelu(x, w, bias, w_out, seed, approximate, rate, kernel, library):
    return _dg_forward(x, w, bias, w_out, seed, approximate, rate, library)[0]


def _dense_gelu_fwd(x, w, bias, w_out, seed, approximate, rate, kernel, library):
    out, h = _dg_forward(x, w, bias, w_out, seed, approximate, rate, library)
    return out, (x, w, h, bias, w_out, seed)


def _dense_gelu_bwd(approximate, rate, kernel, library, res, dout):
    x, w, h, bias, w_out, seed = res
    d2 = dout.reshape(h.shape[0], -1)
    dy = d2 if w_out is None else _product(d2, w_out, library, trans_b=True)
    dh, dbias, y = _bwd_call(dy, h, bias, seed, approximate=approximate, rate=rate, kernel=kernel,
                             with_y=w_out is not None)
    dw_out = None if w_out is None else _product(y, d2, library, trans_a=True)
    x2 = x.reshape(h.shape[0], -1)
    dx = _product(dh, w, library, trans_b=True).reshape(x.shape)
    dw = _product(x2, dh, library, trans_a=True)
    return dx, dw, dbias, dw_out, None


_dense_gelu.defvjp(_dense_gelu_fwd, _dense_gelu_bwd)


def _dense_gelu_reference(x, w, bias, w_out, seed, approximate, rate, kernel, library):
    h = jnp.matmul(x.reshape(-1, x.shape[-1]), w)
    out = _reference(h, bias, seed, approximate, rate)
    out = out if w_out is None else jnp.matmul(out, w_out)
    return out.reshape(*x.shape[:-1], out.shape[-1])


_dense_gelu.defreference("dense_bias_gelu_dropout", _dense_gelu_reference)


def _dense_gelu_unsupported(x, kernel, bias) -> str | None:
    """Why dense_bias_gelu_dropout cannot run the dense_gelu_fwd target here (None: it can;
    "" : off on this GPU, by default, which is not logged)."""
    if x.size == 0 or kernel.size == 0:
        return "zero-size input"
    if bias.dtype != x.dtype:  # the target's contract (ABI.md), on every platform
        return "the fused GEMM takes the bias in x's dtype"
    platform = _ffi.platform_of(x)
    if platform == "cpu":
        return None
    if platform == "gpu" and os.environ.get("JAXSUB_DENSE_GELU") != "1":
        return ""
    if platform != "gpu" or not _ffi.dense_gelu_sm90():
        return "the GEMM with the GELU epilogue needs an sm_90 GPU and a build with CUTLASS"
    if x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "the GEMM with the GELU epilogue takes bfloat16 or float16"
    if kernel.shape[0] % 8 or kernel.shape[1] % 8:
        return "the GEMM with the GELU epilogue needs both kernel dims multiples of 8"
    return None


# ---------------------------------------------------------------------------------------
# Public function.


def _check_inputs(x, bias, op=_OP):
    x = x if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else jnp.asarray(x)
    if bias is None:
        raise TypeError(f"jaxsub.{op}: `bias` is required (pass zeros of shape (x.shape[-1],) for none)")
    bias = bias if isinstance(bias, jax.Array) else jnp.asarray(bias)
    if x.ndim < 1:
        raise ValueError(f"jaxsub.{op}: `x` must have rank >= 1, got shape {x.shape}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"jaxsub.{op}: `x` must be float32, bfloat16 or float16, got {x.dtype}")
    if bias.shape != (x.shape[-1],):
        raise ValueError(
            f"jaxsub.{op}: `bias` must have shape ({x.shape[-1]},) (x.shape[-1]), got {bias.shape}")
    if bias.dtype not in (x.dtype, jnp.dtype(jnp.float32)):
        raise TypeError(f"jaxsub.{op}: `bias` must have x's dtype ({x.dtype}) or float32, got {bias.dtype}")
    return x, bias


def _prepare(x, bias, rate, key, approximate, deterministic, kernel_config, op=_OP):
    """Checked (x, bias, rate, approximate, seed, kernel, fallback reason or None); errors
    name `op` (the public function called)."""
    x, bias = _check_inputs(x, bias, op)
    rate = _dropout.check_rate(op, rate)
    approximate = _ffi.check_bool(op, "approximate", approximate)
    deterministic = _ffi.check_bool(op, "deterministic", deterministic)
    if deterministic:
        rate = 0.0
    seed = _dropout.seed_from_key(op, key) if rate > 0.0 else _dropout.NO_SEED
    kernel = _config.kernel_config(_OP, kernel_config, _config.row_signature(
        x, bias.dtype, approximate=approximate, dropout_rate=rate), caller=op)
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
      size) instead of the forward keeping it: one [..., N] residual less, for memory.
      (In a scanned stack it no longer saves time since the stack's custom calls write
      their residuals in place: bench/NOTES.md, thirty-first session.)
    """
    name = f"{_OP}_dense"
    x, bias, rate, approximate, seed, config, reason = _prepare(x, bias, rate, key, approximate, deterministic,
                                                                kernel_config, name)
    kernel = kernel if isinstance(kernel, jax.Array) else jnp.asarray(kernel)
    if kernel.ndim != 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(f"jaxsub.{name}: `kernel` must have shape ({x.shape[-1]}, E), got {kernel.shape}")
    if kernel.dtype != x.dtype:
        raise TypeError(f"jaxsub.{name}: `kernel` must have x's dtype ({x.dtype}), got {kernel.dtype}")
    if reason is not None:
        return _dense(bias_gelu_dropout(x, bias, rate=rate, key=key, approximate=approximate,
                                        kernel_config=kernel_config), kernel)
    library = (_ffi.check_bool(name, "library_products", library_products) and _gemm.in_place_pays(x.dtype)
               and _gemm.supported(x, kernel))
    return _fused_dense(x, bias, kernel, seed, approximate, rate, config, library)


def dense_bias_gelu_dropout(x, kernel, bias, *, rate, key, approximate=False, deterministic=False,
                            kernel_config=None, out_kernel=None, library_products=False):
    """`bias_gelu_dropout(x @ kernel, bias, ...)` (then `@ out_kernel`), the product and the
    GELU in one call.

    Args:
      x: [..., E], float32, bfloat16 or float16.
      kernel: [E, F], x's dtype.
      bias, rate, key, approximate, deterministic, kernel_config: as bias_gelu_dropout's,
        for the [..., F] product.
      out_kernel: None, or [F, E2] in x's dtype: the result is then multiplied by it, and
        the backward writes the GELU output again for out_kernel's gradient instead of
        keeping it (as bias_gelu_dropout_dense: one residual less).
      library_products: the backward's products (and the product with out_kernel) through
        jaxsub's GEMM target (`jaxsub.ops.dense`, for weights sliced from stacked layers in
        a scan) rather than XLA's.

    Returns:
      [..., F] (or [..., E2]) in x's dtype: the values of `bias_gelu_dropout(dense(x,
      kernel), bias, ...)` (the product rounded to x's dtype before the bias, as there),
      up to the product's summation order; the same dropout mask
      (`dropout_mask(key, (..., F), rate)`).

    Target `jaxsub_dense_gelu_fwd` computes the forward in one call: on CPU in plain loops;
    on an H200 with JAXSUB_DENSE_GELU=1 (bf16 or f16, E and F multiples of 8, the bias in
    x's dtype) as one GEMM whose epilogue writes the product, kept for the backward, and
    the GELU output (CUTLASS's sm90 GEMM with an epilogue of jaxsub's). That GEMM is off by
    default: it measured slower than the two kernels apart (149 against 96 us at
    4096 x 1024 x 4096; bench/NOTES.md, twenty-fourth and twenty-fifth sessions).
    Otherwise on a GPU the product and bias_gelu_dropout run as separate ops (a one-time
    log line where JAXSUB_DENSE_GELU=1 asked for the GEMM and it cannot run). The backward
    is bias_gelu_dropout's kernel and the products' gradients.
    """
    name = f"dense_{_OP}"
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    kernel = kernel if isinstance(kernel, jax.Array) else jnp.asarray(kernel)
    if x.ndim < 1:
        raise ValueError(f"jaxsub.{name}: `x` must have rank >= 1, got shape {x.shape}")
    if kernel.ndim != 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(f"jaxsub.{name}: `kernel` must have shape ({x.shape[-1]}, F), got {kernel.shape}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"jaxsub.{name}: `x` must be float32, bfloat16 or float16, got {x.dtype}")
    if kernel.dtype != x.dtype:
        raise TypeError(f"jaxsub.{name}: `kernel` must have x's dtype ({x.dtype}), got {kernel.dtype}")
    if jnp.shape(bias) != (kernel.shape[1],):
        raise ValueError(f"jaxsub.{name}: `bias` must have shape ({kernel.shape[1]},) (kernel.shape[1]), "
                         f"got {jnp.shape(bias)}")
    # The op's checks and configuration for the product, [..., F].
    product = jax.ShapeDtypeStruct((*x.shape[:-1], kernel.shape[1]), x.dtype)
    _, bias, rate, approximate, seed, config, reason = _prepare(product, bias, rate, key, approximate, deterministic,
                                                                kernel_config, name)
    if out_kernel is not None:
        out_kernel = out_kernel if isinstance(out_kernel, jax.Array) else jnp.asarray(out_kernel)
        if out_kernel.ndim != 2 or out_kernel.shape[0] != kernel.shape[1]:
            raise ValueError(f"jaxsub.{name}: `out_kernel` must have shape ({kernel.shape[1]}, E2), "
                             f"got {out_kernel.shape}")
        if out_kernel.dtype != x.dtype:
            raise TypeError(f"jaxsub.{name}: `out_kernel` must have x's dtype ({x.dtype}), got {out_kernel.dtype}")
    library = _ffi.check_bool(name, "library_products", library_products) and _gemm.in_place_pays(x.dtype)
    why = _dense_gelu_unsupported(x, kernel, bias)
    if why is not None or reason is not None:
        if why != "":
            _ffi.fallback(name, why or reason, "the product and bias_gelu_dropout as separate ops")
        h = _gemm.dense(x, kernel) if library else jnp.einsum("...e,ef->...f", x, kernel)
        if out_kernel is None:
            return bias_gelu_dropout(h, bias, rate=rate, key=key, approximate=approximate, kernel_config=kernel_config)
        return bias_gelu_dropout_dense(h, bias, out_kernel, rate=rate, key=key, approximate=approximate,
                                       kernel_config=kernel_config, library_products=library)
    return _dense_gelu(x, kernel, bias, out_kernel, seed, approximate, rate, config, library)
