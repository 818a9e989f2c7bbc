"""Transformer encoder layer and stack (flax.linen) on jaxsub's fused ops.

`EncoderLayer` is one BERT-style (post-LN) or GPT-style (pre-LN) encoder layer whose
memory-bound parts run as jaxsub's fused kernels; `ReferenceEncoderLayer` is the same
layer in plain Flax (`nn.MultiHeadDotProductAttention`, `nn.Dense`, `nn.LayerNorm`,
`nn.Dropout`), and `to_flax_params` / `from_flax_params` convert parameters between
the two, so a checkpoint of either runs in the other. `Encoder` stacks layers, scanned
(parameters stacked on a leading layer axis, as `nn.scan` stacks them) or unrolled, with
optional rematerialization.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxsub import _ffi, layout, ops, stack
from jaxsub.ops import dropout as _dropout

Initializer = Callable[..., Any]

_DEFAULT_EPS = 1e-5


class _Affine(nn.Module):
    """Holds a kernel and a bias and returns them, so that the layer's parameter tree
    nests like Dense's ({"kernel", "bias"}) while the matmul and the bias add stay apart:
    the bias goes into a fused op, not the matmul."""

    fan_in: int
    kernel_shape: tuple[int, ...]
    bias_shape: tuple[int, ...]
    kernel_init: Initializer
    bias_init: Initializer
    param_dtype: Any

    @nn.compact
    def __call__(self):
        size = 1
        for n in self.kernel_shape:
            size *= n

        # Initialize as the 2-D [fan_in, fan_out] matrix a Dense layer would see, so that
        # fan-in based initializers scale by the true fan-in, not by one of the split axes.
        def init(key, shape, dtype):
            return self.kernel_init(key, (self.fan_in, size // self.fan_in), dtype).reshape(shape)

        def bias_init(key, shape, dtype):
            return self.bias_init(key, (size // self.fan_in,), dtype).reshape(shape)

        kernel = self.param("kernel", init, self.kernel_shape, self.param_dtype)
        bias = self.param("bias", bias_init, self.bias_shape, self.param_dtype)
        return kernel, bias


class _Norm(nn.Module):
    """Layer-norm scale and bias ({"scale", "bias"}, as nn.LayerNorm names them)."""

    features: int
    param_dtype: Any

    @nn.compact
    def __call__(self):
        scale = self.param("scale", nn.initializers.ones, (self.features,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        return scale, bias


def _four_d(where: str, name: str, a, batch: int, heads: int, seq: int):
    """A module's mask or bias as [B or 1, H or 1, S or 1, S or 1]: a 2-D one of shape
    [B, S] is key padding, whatever S (an [S, S] one at B == S too: pass that as
    a[None, None]), any other 2-D one [Sq, Sk] as Flax reads it; otherwise it broadcasts
    to [B, H, S, S]."""
    full = (batch, heads, seq, seq)
    if a.ndim == 2 and a.shape == (batch, seq) and batch > 1:
        return a[:, None, None, :]
    if a.ndim > 4:
        raise ValueError(f"jaxsub.flax.{where}: `{name}` has rank {a.ndim}; it must broadcast to [B, H, S, S] {full}")
    shape = (1,) * (4 - a.ndim) + tuple(a.shape)
    if any(have not in (1, want) for have, want in zip(shape, full)):
        raise ValueError(f"jaxsub.flax.{where}: `{name}` of shape {tuple(a.shape)} does not broadcast to "
                         f"[B, H, S, S] {full} (a 2-D one of shape [B, S] is key padding)")
    return a.reshape(shape)


def _checked_mask(where: str, mask, bias):
    """(mask, bias) of a module's call, checked: mask boolean (an integer one as mask != 0,
    as Flax reads it), bias floating."""
    if mask is not None:
        mask = jnp.asarray(mask)
        if jnp.issubdtype(mask.dtype, jnp.floating):
            raise TypeError(
                f"jaxsub.flax.{where}: `mask` is {mask.dtype}; it must be boolean (or integer: nonzero attends). A "
                f"floating mask is ambiguous: Flax reads 0/1 floats (nn.make_attention_mask's default) as "
                f"boolean, jaxsub's ops read floats as additive. Pass mask.astype(bool), or an additive mask or "
                f"learned bias as `bias`")
        if mask.dtype != jnp.bool_:
            mask = mask != 0
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"jaxsub.flax.{where}: `bias` (added to the scaled scores) must be floating, "
                            f"got {bias.dtype}")
    return mask, bias


def _checked_4d(where: str, x, heads: int, mask, bias):
    """(mask, bias) checked (`_checked_mask`) and as 4-D arrays (`_four_d`), or None."""
    mask, bias = _checked_mask(where, mask, bias)
    b, s = x.shape[0], x.shape[1]
    return tuple(None if a is None else _four_d(where, name, a, b, heads, s)
                 for name, a in (("mask", mask), ("bias", bias)))


def _attention_mask(where: str, x, heads: int, mask, bias):
    """The one mask the attention ops take for a module's (mask, bias), 4-D: the boolean
    mask, the additive bias, or (both) the bias where the mask attends and -inf elsewhere,
    which the ops read as the boolean mask would hide those keys."""
    mask, bias = _checked_4d(where, x, heads, mask, bias)
    if mask is None or bias is None:
        return bias if mask is None else mask
    return jnp.where(mask, bias, -jnp.inf)


def _as_arguments(mask) -> dict:
    """A combined mask (`_attention_mask`) as the keyword arguments of EncoderLayer's call."""
    if mask is not None and jnp.issubdtype(mask.dtype, jnp.floating):
        return {"bias": mask}
    return {"mask": mask}


def _library(library_products: bool | None) -> bool:
    """EncoderLayer.library_products, None resolved: on where JAX's default backend is a GPU."""
    return jax.default_backend() == "gpu" if library_products is None else bool(library_products)


class _LayerFields(nn.Module):
    """The fields EncoderLayer and its plain-Flax twin share, declared once."""

    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    pre_layer_norm: bool = False
    causal: bool = False
    epsilon: float = _DEFAULT_EPS
    approximate_gelu: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros
    broadcast_dropout: bool = False


def _compute_dtype(dtype, param_dtype, x):
    """The activations' dtype: `dtype`, or for None Flax's, the input's promoted with the
    parameters' (a bfloat16 input with float32 parameters computes in float32)."""
    if dtype is not None:
        return jnp.dtype(dtype)
    x_dtype = jnp.asarray(x).dtype
    return jnp.result_type(x_dtype, x_dtype if param_dtype is None else param_dtype)


class EncoderLayer(_LayerFields):
    """One transformer encoder layer on jaxsub's fused ops.

    Attributes:
      num_heads: attention heads; the hidden size (last axis of the input) must divide.
      mlp_dim: width of the feed-forward block.
      dropout_rate: dropout after the attention output projection, after the GELU and
        after the feed-forward output projection.
      attention_dropout_rate: dropout on the attention probabilities.
      pre_layer_norm: False (default) is BERT's post-LN layer,
        ``y = LN(h + drop(FFN(h)))`` with ``h = LN(x + drop(Attn(x)))``; True is the
        GPT-style pre-LN layer, ``y = h + drop(FFN(LN(h)))`` with
        ``h = x + drop(Attn(LN(x)))`` (no final norm: `Encoder` adds one).
      causal: causal self-attention (query i sees keys j <= i).
      epsilon: layer-norm epsilon; 1e-5, the default of jaxsub's ops (BERT uses 1e-12).
      approximate_gelu: tanh approximation of GELU (False: the exact erf form, as BERT).
      dtype: compute dtype of activations and matmuls; parameters are cast to it.
      param_dtype: dtype of the parameters.
      kernel_init, bias_init: initializers, applied as for `nn.Dense` (the fused QKV
        kernel is initialized as a [hidden, 3 * hidden] matrix).
      broadcast_dropout: as `nn.MultiHeadDotProductAttention`'s: True draws one attention
        keep mask [S, S] shared by every batch element and head (Flax's default;
        `ops.dropout_mask(key, (1, 1, S, S), rate)`), False (default here, as BERT) one
        per element (`ops.dropout_mask(key, (B, H, S, S), rate)`).

    Parameter tree (E = hidden size, H = num_heads, D = E // H, F = mlp_dim)::

      qkv:            kernel [E, 3, H, D]   bias [3, H, D]   (index 0, 1, 2 = q, k, v)
      out:            kernel [H, D, E]      bias [E]
      attention_norm: scale  [E]            bias [E]
      mlp_in:         kernel [E, F]         bias [F]
      mlp_out:        kernel [F, E]         bias [E]
      mlp_norm:       scale  [E]            bias [E]

    How the ops are used: Q, K and V come from one matmul (the algebraic fusion of the
    three projections), without bias; the QKV bias is added before `ops.attention`.
    Post-LN: the output projection's bias, the dropout, the residual and the layer norm
    are one `ops.bias_dropout_residual_layer_norm`, likewise for the feed-forward output.
    Pre-LN: the norm before each block is `ops.layer_norm`, and the residual
    ``x + dropout(y + bias)`` is elementwise JAX (no fused op has that epilogue), with the
    mask from `ops.dropout_mask`. Both: the feed-forward input bias, GELU and dropout are
    one `ops.bias_gelu_dropout`.

    layouts: how the layer's operators are laid out and configured (issue #6):
      "auto" (default: timed on the GPU at the first call for new shapes, cached on disk;
      the byte-count heuristic without a GPU), "heuristic", "none" (the layouts above,
      unfused attention), `jaxsub.layout.Auto(...)` or a `jaxsub.layout.Selection`. Every
      choice computes the same function (same dropout masks); only speed differs. The
      choice never changes the parameter tree. See `jaxsub.layout.encoder`.

    recompute_gelu: in the backward pass, have the GELU kernel write its output again
      for the feed-forward output weight's gradient instead of keeping it from the
      forward (`ops.bias_gelu_dropout_dense`; row-major feed-forward layouts only). It
      saves a [B, S, F] residual (memory) for one more [B, S, F] write (time). `Encoder`
      set it for its scanned stack until the stack's custom calls wrote their residuals
      in place; keeping the output now measures faster there too (24 BERT-large layers
      at b8 x s512 bf16 on the H200: 18.76 against 18.89 ms per step, through a switch
      with the same dataflow; bench/NOTES.md, thirty-first session).

    library_products: run the four projections (where their layouts are row-major) and
      their gradients through `ops.dense`, jaxsub's cuBLASLt call with its algorithm
      timed per shape, rather than XLA's GEMMs. XLA runs a custom call on slices of
      stacked arrays in place, where it copies a slice for its own GEMMs (`Encoder`'s
      scanned stack, whose weights, residuals and weight gradients are all such slices).
      None (default): on when JAX's default backend is a GPU (a single BERT-large layer
      at b8 x s512 bf16 on the H200: 0.773 against 0.790 ms per training step with XLA's
      GEMMs, bench/NOTES.md, twenty-second session), off on CPU, where XLA's dot is
      faster. Same numbers up to the order of f32 sums.

    `__call__(x, mask=None, deterministic=True, *, bias=None, dropout_keys=None)`: x
    [B, S, E]. mask: Flax's attention mask, boolean (True attends) or integer (nonzero
    attends), of shape [B, S] (key padding, also where B == S) or broadcastable to
    [B, H, S, S] (another 2-D one: [S, S]); a floating
    mask raises a TypeError (Flax reads 0/1 floats as boolean, jaxsub's ops read floats as
    additive: say which with mask.astype(bool) or `bias`). bias: an additive mask or a
    learned bias on the scaled scores (e.g. (1 - valid) * -1e4 as [B, S], or T5's
    relative-position bias broadcastable to [B, H, S, S]), differentiable; with a mask
    too, the bias applies where the mask attends. With deterministic=False, dropout keys
    come from the 'dropout' rng, or from `dropout_keys`, a dict as `dropout_keys()` returns
    (keys or their uint32 words).
    A query that sees no key gets a zero attention output (plain Flax averages V).
    """

    layouts: Any = "auto"
    recompute_gelu: bool = False
    library_products: bool | None = None

    def _affine(self, name, fan_in, kernel_shape, bias_shape, dtype):
        kernel, bias = _Affine(fan_in, kernel_shape, bias_shape, self.kernel_init, self.bias_init,
                               self.param_dtype, name=name)()
        return kernel.astype(dtype), bias.astype(dtype)

    def _norm(self, name, features, dtype):
        scale, bias = _Norm(features, self.param_dtype, name=name)()
        return scale.astype(dtype), bias.astype(dtype)

    def _key(self, rate, deterministic):
        """A fresh dropout key, or None when this dropout is off (no rng is consumed)."""
        return None if deterministic or rate == 0.0 else self.make_rng("dropout")

    def dropout_keys(self, deterministic=False):
        """The layer's four dropout keys ("attn", "drop1", "gelu", "drop2"; None where that
        dropout is off), drawn from the 'dropout' rng in the order the ops consume them,
        whatever the layouts: what `__call__` draws. `Encoder` draws every layer's keys
        with this before its scanned loop and passes them to `__call__` as `dropout_keys`."""
        det = bool(deterministic)
        return {"attn": self._key(self.attention_dropout_rate, det), "drop1": self._key(self.dropout_rate, det),
                "gelu": self._key(self.dropout_rate, det), "drop2": self._key(self.dropout_rate, det)}

    def selection(self, x, mask=None, *, bias=None):
        """The layout Selection this layer uses for input x [B, S, E] (and mask, bias)."""
        return self._resolve(x, _attention_mask("EncoderLayer", x, self.num_heads, mask, bias))[1]

    def _resolve(self, x, mask):
        problem = layout.EncoderProblem(self._spec(x, mask))
        return problem, layout.resolve(self.layouts, problem, "jaxsub.flax.EncoderLayer")

    def _spec(self, x, mask):
        b, s, e = x.shape
        for name in ("num_heads", "mlp_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"jaxsub.flax.EncoderLayer: `{name}` must be a positive int, got {value!r}")
        for name in ("dropout_rate", "attention_dropout_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
                kind = "" if isinstance(value, numbers.Real) else f" of type {type(value).__name__} (a Python number)"
                raise ValueError(f"jaxsub.flax.EncoderLayer: `{name}` must be a float in [0, 1){kind}, got {value!r}")
        _ffi.check_bool("flax.EncoderLayer", "broadcast_dropout", self.broadcast_dropout)
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            value = x.dtype if value is None else jnp.dtype(value)  # None: Flax's "from the input"
            if value not in (jnp.float32, jnp.bfloat16, jnp.float16):
                raise TypeError(f"jaxsub.flax.EncoderLayer: `{name}` must be float32, bfloat16 or float16, "
                                f"got {value}")
        if e % self.num_heads:
            raise ValueError(f"jaxsub.flax.EncoderLayer: hidden size {e} is not divisible by "
                             f"num_heads={self.num_heads}")
        mask_shape = mask_dtype = None
        if mask is not None:
            mask_shape, mask_dtype = tuple(jnp.shape(mask)), jnp.result_type(mask).name
            if mask_dtype == "bool" and mask_shape == (b, 1, 1, s):
                mask_shape = (b, s)  # key padding, as `python -m jaxsub tune --padding-mask` keys it
        return layout.LayerSpec(
            batch=b, seq=s, hidden=e, heads=self.num_heads, mlp_dim=self.mlp_dim,
            dtype=_compute_dtype(self.dtype, self.param_dtype, x).name,
            dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
            pre_layer_norm=self.pre_layer_norm, causal=self.causal, epsilon=self.epsilon,
            approximate_gelu=self.approximate_gelu, mask_shape=mask_shape, mask_dtype=mask_dtype,
            broadcast_dropout=bool(self.broadcast_dropout))

    @nn.compact
    def __call__(self, x, mask=None, deterministic=True, *, bias=None, dropout_keys=None):
        dtype = _compute_dtype(self.dtype, self.param_dtype, x)
        x = jnp.asarray(x, dtype)
        if x.ndim != 3:
            raise ValueError(f"jaxsub.flax.EncoderLayer: `x` must be [B, S, E], got shape {x.shape}")
        mask = _attention_mask("EncoderLayer", x, self.num_heads, mask, bias)
        empty = 0 in x.shape[:2]
        if empty:  # an empty batch or sequence: the fields checked, no layout to choose
            problem = selection = None
            e, h = self._spec(jnp.zeros((1, 1, x.shape[2]), dtype), None).hidden, self.num_heads
        else:
            problem, selection = self._resolve(x, mask)
            e, h = problem.spec.hidden, problem.spec.heads
        d = e // h
        params = {}
        params["qkv_kernel"], params["qkv_bias"] = self._affine("qkv", e, (e, 3, h, d), (3, h, d), dtype)
        params["out_kernel"], params["out_bias"] = self._affine("out", e, (h, d, e), (e,), dtype)
        params["attn_scale"], params["attn_bias"] = self._norm("attention_norm", e, dtype)
        params["in_kernel"], params["in_bias"] = self._affine("mlp_in", e, (e, self.mlp_dim), (self.mlp_dim,), dtype)
        params["ffn_kernel"], params["ffn_bias"] = self._affine("mlp_out", self.mlp_dim, (self.mlp_dim, e), (e,),
                                                                dtype)
        params["mlp_scale"], params["mlp_bias"] = self._norm("mlp_norm", e, dtype)
        det = bool(deterministic)
        if dropout_keys is None:  # the seeds as quarters of one row: one kernel on a GPU, not one per key
            keys = self.dropout_keys(det)
            keys = dict(zip(keys, _dropout.shared_seeds("flax.EncoderLayer", keys.values())))
        else:
            keys = dropout_keys
        if empty:  # nothing to compute, as in plain Flax (the parameters and keys made as always)
            return jnp.zeros(x.shape, dtype)
        return problem.apply(selection, params, x, mask=mask, keys=keys, deterministic=det,
                             recompute_gelu=self.recompute_gelu, library_products=_library(self.library_products))


class ReferenceEncoderLayer(_LayerFields):
    """`EncoderLayer` in plain Flax: the same computation with the same fields, built from
    nn.MultiHeadDotProductAttention, nn.Dense, nn.LayerNorm and nn.Dropout. It is the
    oracle of the tests and the layer `to_flax_params` converts to. Its `mask` and `bias`
    (as `EncoderLayer`'s) are Flax attention's mask and bias.

    Parameter tree::

      attention:      query / key / value: kernel [E, H, D] bias [H, D];
                      out: kernel [H, D, E] bias [E]
      attention_norm: scale [E] bias [E]
      mlp_in:         kernel [E, F] bias [F]
      mlp_out:        kernel [F, E] bias [E]
      mlp_norm:       scale [E] bias [E]
    """

    @nn.compact
    def __call__(self, x, mask=None, deterministic=True, *, bias=None):
        x = jnp.asarray(x, self.dtype)
        e = x.shape[-1]
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                     bias_init=self.bias_init)
        # The exact two-pass variance, as jaxsub's layer norm computes it.
        norm = dict(epsilon=self.epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
                    use_fast_variance=False)
        # The mask and the bias as EncoderLayer reads them, for Flax's attention (which adds
        # the bias to the scaled scores).
        mask, bias = _checked_4d("ReferenceEncoderLayer", x, self.num_heads, mask, bias)
        masks = [] if mask is None else [mask]
        if self.causal:
            masks.append(nn.make_causal_mask(x[..., 0]))
        attn_mask = nn.combine_masks(*masks) if masks else None

        attention = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, qkv_features=e, out_features=e, broadcast_dropout=self.broadcast_dropout,
            dropout_rate=self.attention_dropout_rate, deterministic=deterministic, name="attention",
            attention_fn=nn.dot_product_attention if bias is None else functools.partial(
                nn.dot_product_attention, bias=bias), **dense)
        attention_norm = nn.LayerNorm(name="attention_norm", **norm)
        mlp_in = nn.Dense(self.mlp_dim, name="mlp_in", **dense)
        mlp_out = nn.Dense(e, name="mlp_out", **dense)
        mlp_norm = nn.LayerNorm(name="mlp_norm", **norm)

        def drop(y):
            return nn.Dropout(self.dropout_rate, deterministic=deterministic)(y)

        def mlp(y):
            return mlp_out(drop(nn.gelu(mlp_in(y), approximate=self.approximate_gelu)))

        if self.pre_layer_norm:
            a = attention_norm(x)
            x = x + drop(attention(a, a, mask=attn_mask))
            return x + drop(mlp(mlp_norm(x)))
        x = attention_norm(x + drop(attention(x, x, mask=attn_mask)))
        return mlp_norm(x + drop(mlp(x)))


def _fields(module: nn.Module) -> dict:
    """The configuration fields EncoderLayer shares with its plain-Flax twin (not parent,
    name or layouts)."""
    names = {f.name for f in dataclasses.fields(_LayerFields)} - {"parent", "name"}
    return {n: getattr(module, n) for n in names}


def reference_layer(layer: EncoderLayer) -> ReferenceEncoderLayer:
    """The plain-Flax layer equivalent to `layer` (same configuration)."""
    return ReferenceEncoderLayer(**_fields(layer))


_SHARED = ("attention_norm", "mlp_in", "mlp_out", "mlp_norm")
_QKV = ("query", "key", "value")


def _layer_tree(where, params, names, shapes):
    """`params` checked to be one layer's tree with exactly the subtrees `names`, and the
    arrays `shapes` lists ((subtree, leaf) -> the trailing rank it must have and, where
    given, the size of its axis -3); leading axes beyond them (a scanned stack's layer
    axis) pass through."""
    keys = set(params) if hasattr(params, "keys") else None
    if keys != set(names):
        got = sorted(keys) if keys is not None else type(params).__name__
        raise ValueError(f"jaxsub.flax.{where}: `params` must be one layer's 'params' collection with the subtrees "
                         f"{', '.join(names)} (a scanned Encoder's params['layers']['layer'] too); got {got}")
    for (tree, leaf), (rank, three) in shapes.items():
        shape = jnp.shape(params[tree].get(leaf) if hasattr(params[tree], "get") else None)
        if len(shape) < rank or (three and shape[-3] != 3):
            want = f"rank >= {rank}" + (" with 3 at axis -3 (q, k, v)" if three else "")
            raise ValueError(f"jaxsub.flax.{where}: `params['{tree}']['{leaf}']` must have {want}, got shape {shape}")


def to_flax_params(params):
    """EncoderLayer parameters -> ReferenceEncoderLayer parameters (the same layer).

    Takes the 'params' collection of one layer (or a {'params': ...} variables dict,
    returned in the same form); a scanned Encoder's stacked params['layers']['layer'] give
    the stacked trees of its layers (leading axes pass through)."""
    if hasattr(params, "keys") and set(params) == {"params"}:
        return {"params": to_flax_params(params["params"])}
    _layer_tree("to_flax_params", params, ("qkv", "out", *_SHARED),
                {("qkv", "kernel"): (4, True), ("qkv", "bias"): (3, True)})
    qkv = params["qkv"]
    attention = {name: {"kernel": qkv["kernel"][..., i, :, :], "bias": qkv["bias"][..., i, :, :]}
                 for i, name in enumerate(_QKV)}
    attention["out"] = dict(params["out"])
    return {"attention": attention, **{n: dict(params[n]) for n in _SHARED}}


def from_flax_params(params):
    """ReferenceEncoderLayer parameters -> EncoderLayer parameters; inverse of
    `to_flax_params` (stacked trees too)."""
    if hasattr(params, "keys") and set(params) == {"params"}:
        return {"params": from_flax_params(params["params"])}
    _layer_tree("from_flax_params", params, ("attention", *_SHARED), {})
    attention = params["attention"]
    _layer_tree("from_flax_params", attention, (*_QKV, "out"),
                {**{(n, "kernel"): (3, False) for n in _QKV}, **{(n, "bias"): (2, False) for n in _QKV}})
    qkv = {
        "kernel": jnp.stack([attention[n]["kernel"] for n in _QKV], axis=-3),
        "bias": jnp.stack([attention[n]["bias"] for n in _QKV], axis=-3),
    }
    return {"qkv": qkv, "out": dict(attention["out"]), **{n: dict(params[n]) for n in _SHARED}}


class _Block(nn.Module):
    """One layer with the (carry, x) -> (carry, out) signature nn.scan expects; the
    deterministic flag is a field so that nn.scan and nn.remat see only arrays."""

    layer: dict
    deterministic: bool

    @nn.compact
    def __call__(self, x, mask):
        """mask: the combined mask (`_attention_mask`)."""
        layer = EncoderLayer(**self.layer, name="layer")
        return layer(x, deterministic=self.deterministic, **_as_arguments(mask)), None


class Encoder(_LayerFields):
    """A stack of `num_layers` EncoderLayers (fields as EncoderLayer's; `num_layers` by keyword).

    Attributes:
      scan_layers: scan over the layers: one compiled layer body, parameters stacked on
        a leading axis of size num_layers, under params["layers"]["layer"] (nn.scan's
        tree; `init` runs nn.scan). Applying runs `jaxsub.stack.scan`, whose gradient
        keeps each layer's residuals in buffers it does not zero-fill first; dropout
        keys are one per layer, split from the 'dropout' stream, and each layer's four
        keys are drawn from its key before the loop (what the layer would draw applied
        alone with that key). Without scan, layer i's
        parameters are params[f"layers_{i}"]["layer"]. The scan compiles fast; XLA would
        copy the slices of the stacked weights and residuals its own GEMMs read, so on
        GPU the layers run their projections through jaxsub's GEMM, which reads them in
        place (EncoderLayer's library_products), as jaxsub's other custom calls read and
        write theirs. On the H200, 24 layers at batch 8 x 512 bf16 took 25.8 ms per
        training step under nn.scan, 23.6 ms with stack.scan (NOTES, eighteenth session)
        and 21.8 ms now (nineteenth); 21.6 ms as 24 layers unrolled before either (compile
        4 s against 71 s; NOTES, seventeenth session).
      remat: rematerialize each layer's activations in the backward pass (jax.checkpoint
        of each layer; nn.remat without scan).
      scan_unroll: with scan_layers, layers per iteration of the stack's loops
        (`jaxsub.stack.scan`'s unroll); the compiled body holds that many layers. On the
        H200, 2 made the 24-layer BERT-large step 3.6% slower than 1 (NOTES, thirtieth
        session): XLA copies the results of every layer but an iteration's last into
        their stacks (NOTES, thirty-third session).
      layouts: as EncoderLayer's; every layer has the same shapes, so one selection
        (one tuning) serves the whole stack.

    With pre_layer_norm, a final layer norm ("final_norm": scale, bias) follows the
    stack, as in GPT-style models whose layers leave their output unnormalized.
    """

    # The layer's fields come from _LayerFields; num_layers is keyword-only because it
    # follows fields with defaults.
    num_layers: int = dataclasses.field(kw_only=True)
    scan_layers: bool = True
    remat: bool = False
    scan_unroll: int = 1
    layouts: Any = "auto"

    @nn.compact
    def __call__(self, x, mask=None, deterministic=True, *, bias=None):
        """x [B, S, E]; mask, bias as EncoderLayer's, the same for every layer."""
        # Under jax.jvp, hessian or grad of grad every op runs as its jnp reference, also in
        # the layers nn.remat checkpoints (whose bodies the transformation's tracers do not reach).
        beyond = not self.is_initializing() and _ffi.beyond_first_reverse((x, mask, bias, self.variables))
        with _ffi.references() if beyond else contextlib.nullcontext():
            return self._layers(x, mask, deterministic, bias)

    def _layers(self, x, mask, deterministic, bias):
        layer = dict(_fields(self), layouts=self.layouts)
        deterministic = bool(deterministic)
        for name in ("num_layers", "scan_unroll"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_layers" else 1):
                raise ValueError(f"jaxsub.flax.Encoder: `{name}` must be an int >= "
                                 f"{0 if name == 'num_layers' else 1}, got {value!r}")
        block = nn.remat(_Block, prevent_cse=not self.scan_layers) if self.remat else _Block
        x = jnp.asarray(x, _compute_dtype(self.dtype, self.param_dtype, x))
        if x.ndim != 3:
            raise ValueError(f"jaxsub.flax.Encoder: `x` must be [B, S, E], got shape {x.shape}")
        mask = _attention_mask("Encoder", x, self.num_heads, mask, bias)
        if self.scan_layers and self.is_initializing():
            # nn.scan makes the stacked parameters (so init draws what it always drew);
            # applying runs the same layers through stack.scan.
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                            in_axes=nn.broadcast, length=self.num_layers)
            x, _ = stack(layer, deterministic, name="layers")(x, mask)
        elif self.scan_layers:
            x = self._scan(layer, deterministic, x, mask)
        else:
            for i in range(self.num_layers):
                x, _ = block(layer, deterministic, name=f"layers_{i}")(x, mask)
        if self.pre_layer_norm:
            scale, bias = _Norm(x.shape[-1], self.param_dtype, name="final_norm")()
            x = ops.layer_norm(x, scale.astype(x.dtype), bias.astype(x.dtype), eps=self.epsilon)
        return x

    def _scan(self, layer, deterministic, x, mask):
        """The stack as stack.scan over the stacked parameters: each layer's
        residuals go into buffers allocated once rather than into nn.scan's stacked
        outputs, which JAX fills with zeros first. One dropout key per layer, split from
        this module's 'dropout' stream."""
        params = self.variables.get("params", {}).get("layers", {}).get("layer")
        if params is None:
            raise ValueError("jaxsub.flax.Encoder: with scan_layers=True the parameters need the stacked "
                             "layers under params['layers']['layer'] (as Encoder.init makes them)")
        # jaxsub's GEMM where it reads the stacks in place: on GPU (on CPU XLA's dot is faster).
        module = EncoderLayer(**layer, library_products=None)
        rates = (self.dropout_rate, self.attention_dropout_rate)
        seeds = None
        if not deterministic and any(r > 0.0 for r in rates):
            # Every layer's dropout keys, drawn before the loop as each layer would draw them
            # from its own key, as the words the kernels take, so that no step derives a key
            # (on the H200 that took four small kernels per layer forward, two backward).
            # One row of 16 words per layer, key j's words at 4j and 4j + 1, each op passed
            # its quarter: XLA copies the row's quarters out of the table once per layer and
            # direction, and stack.scan makes the backward's again from xs rather than
            # storing them; a table of 8-byte seeds per key took one copy per op and
            # direction (eight per layer on the H200; bench/NOTES.md, twenty-third session).
            draw = functools.partial(module.apply, {}, False, method=EncoderLayer.dropout_keys)
            present = []  # (name, whether that dropout is on), in dropout_keys' order

            def row(keys):
                present[:] = [(n, k is not None) for n, k in keys.items()]
                return _dropout.seed_row("jaxsub.flax.Encoder", keys.values())

            seeds = jax.vmap(lambda k: row(draw(rngs={"dropout": k})))(
                jax.random.split(self.make_rng("dropout"), self.num_layers))

        def body(mask, h, xs):
            p, seed = xs
            keys = None if seed is None else {n: _dropout.Words(seed[4 * j:4 * j + 4]) if on else None
                                              for j, (n, on) in enumerate(present)}
            return module.apply({"params": p}, h, deterministic=deterministic, dropout_keys=keys,
                                **_as_arguments(mask))

        if self.remat:
            body = jax.checkpoint(body, prevent_cse=False)  # the loop already keeps XLA from merging layers
        return stack.scan(lambda mask, h, xs: (body(mask, h, xs), None), x, (params, seeds), mask,
                          unroll=self.scan_unroll)[0]
