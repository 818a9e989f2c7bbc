"""Multi-head attention: out = dropout(softmax(scale * Q Kᵀ + mask)) V, per batch and head.

Two implementations of the same function (cuda/ABI.md, "Attention family"):

- "unfused", the paper's structure: the score GEMM in XLA, the fused softmax-dropout op
  (`jaxsub.ops.softmax_dropout`, one pass over [B, H, Sq, Sk] in each direction), then
  the GEMM with V.
- "fused": one custom call per direction (`jaxsub_attention_fwd/_bwd`) that never writes
  the [B, H, Sq, Sk] probabilities; forward saves only the per-row log-sum-exp.

`attention_packed` is self-attention on q, k, v packed in one array ([B, S, 3, H, D] or
[3, B, S, H, D], as one QKV projection writes them). Its fused path
(`jaxsub_attention_qkv_fwd/_bwd`) reads the three in place and writes their gradients
into one array of the packed shape, so neither the forward's slices nor the backward's
concatenation is copied.

`attention_projected` and `dense_attention_packed` (jaxsub.ops.projected) are
self-attention fused with the q/k/v projection that computes its input; they run through
`_attention` here with a source of q, k and v.

Both drop exactly the same probabilities: element (b, h, i, j) of the logical
[B, H, Sq, Sk] tensor is kept or dropped by `dropout_mask(key, (B, H, Sq, Sk), rate)`,
so `reference_attention(..., keep=that_mask)` reproduces either. With
`broadcast_dropout=True` one mask, `dropout_mask(key, (1, 1, Sq, Sk), rate)`, is shared by
every batch and head (Flax's `broadcast_dropout`; the kernels' `dropout_bcast`).

Layout of this module: reference, ffi_call wrappers, custom_vjp, public function.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi
from jaxsub.ops import attn_calls as _calls
from jaxsub.ops import config as _config
from jaxsub.ops import dropout as _dropout
from jaxsub.ops import masks as _masks
from jaxsub.ops import softmax as _softmax

_OP = "attention"
_F32, _F64 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)
_DTYPES = (_F32, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# What the CUDA fused kernels take (ABI.md); the CPU handlers take any D and all _DTYPES.
_CUDA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_CUDA_HEAD_DIMS = (32, 64, 128)
_IMPLEMENTATIONS = (None, "fused", "unfused")


# ---------------------------------------------------------------------------------------
# Reference.


def _visible(kind, mask4d, causal, sq, sk):
    """Boolean [*, *, Sq, Sk] (broadcastable): which keys each query may attend to."""
    vis = jnp.ones((1, 1, 1, 1), jnp.bool_)
    if kind == _masks.BOOLEAN:
        vis = vis & mask4d
    if causal:
        vis = vis & _masks.causal_visible(sq, sk)
    return vis


def reference_attention(q, k, v, *, mask=None, causal=False, scale=None, keep=None, rate=0.0):
    """Pure-JAX attention: f32 compute (f64 when the inputs are f64), output in q.dtype.

    q: [B, Sq, H, D]; k, v: [B, Sk, H_kv, D] (H_kv dividing H, as in `attention`); `mask`
    as in `attention`; `keep` is the boolean keep-mask, [B, H, Sq, Sk] or broadcastable to it
    (None = no dropout), kept probabilities scaled by 1 / (1 - rate). Rows with no visible
    key give zeros (and zero gradients), not NaN.
    """
    b, sq, h, d = q.shape
    sk = k.shape[1]
    k, v = repeat_kv(q, k, v)
    cdt = _F64 if q.dtype == _F64 else _F32
    scale = 1.0 / math.sqrt(max(d, 1)) if scale is None else float(scale)
    mask4d, kind = _masks.normalize(_OP, mask, (b, h), sq, sk, key_padding_ok=True, causal=causal)
    if kind == _masks.ADDITIVE and causal and mask4d.shape[-2] == 1:
        mask4d = mask4d - _masks.query_shift(mask4d, sq, sk)  # `by_query`'s rows, always
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(cdt), k.astype(cdt), precision=hi) * scale
    if kind == _masks.ADDITIVE:
        s = s + mask4d.astype(cdt)
    vis = _visible(kind, mask4d, causal, sq, sk) & ~jnp.isneginf(s)
    # Masked scores are replaced by 0 before exp (and zeroed after) so that no inf or NaN
    # reaches the gradient; an empty row has denominator 0 and gives p = 0. A NaN or +inf
    # visible score makes the row NaN, as jax.nn.softmax does.
    s = jnp.where(vis, s, 0.0)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom == 0.0, 1.0, denom)
    p = _dropout.apply_reference(p, keep, rate)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(cdt), precision=hi).astype(q.dtype)


# ---------------------------------------------------------------------------------------
# custom_vjp for the fused path. The mask and the seed are primals (they may be traced:
# jit, vmap over masks or keys); the seed gets no cotangent, an additive mask one only
# where the program differentiates it (masks.py: symbolic zeros); scale, causal, the mask
# kind, the rate and whether the dropout mask is broadcast (bcast) are static attributes.


def packed_slices(qkv, axis):
    """q, k, v: the slices of a packed array along `axis`."""
    return tuple(jax.lax.index_in_dim(qkv, i, axis, keepdims=False) for i in range(3))


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _fused(q, k, v, mask4d, seed, scale, causal, kind, rate, bcast):
    return _calls.fwd_call(q, k, v, mask4d, seed, scale, causal, kind, rate, bcast)[0]


def _fused_fwd(q, k, v, mask4d, seed, scale, causal, kind, rate, bcast):
    grad_mask = _masks.differentiated(kind, mask4d)
    q, k, v, mask4d, seed = _masks.primals(q, k, v, mask4d, seed)
    if grad_mask:
        return _masks.switched(_OP, lambda q, k, v, m: _unfused(q, *repeat_kv(q, k, v), m, seed, kind, causal, scale,
                                                         rate, op=_OP, bcast=bcast),
                        q, k, v, mask4d)
    out, lse = _calls.fwd_call(q, k, v, mask4d, seed, scale, causal, kind, rate, bcast)
    return out, (q, k, v, out, lse, mask4d, seed)


# The grouped-query backward runs one block per key block of each k/v head (64 keys), each
# walking its group's q heads: H / H_kv times fewer blocks, each H / H_kv times longer, than
# with k and v repeated to q's heads. Below this many blocks the backward takes k and v
# repeated (and sums dk and dv over each group after it). On an H100 (132 SMs; fwd+bwd,
# bf16, dropout; bench/NOTES.md, fifty-eighth session) the grouped one took 0.90-0.94x the
# repeated one's time at 2048 and 4096 blocks (causal, D 128), 1.03-1.20x at 256-1024
# (0.98x at 512 without the causal mask), and 4.3x at 64 (multi-query).
GROUPED_BWD_MIN_BLOCKS = 2048


def _bwd_repeats_kv(q, k) -> bool:
    """Whether the fused backward takes k and v repeated to q's heads (see above)."""
    b, sk, h_kv = k.shape[:3]
    return h_kv != q.shape[2] and b * h_kv * -(-sk // 64) < GROUPED_BWD_MIN_BLOCKS


def _fused_bwd(scale, causal, kind, rate, bcast, res, dout):
    dout = _masks.cotangent(dout)
    if isinstance(res, _masks.Switched):
        return res.backward(dout)
    q, k, v, out, lse, mask4d, seed = res
    if not _bwd_repeats_kv(q, k):
        dq, dk, dv = _calls.bwd_call(dout, q, k, v, out, lse, mask4d, seed, scale, causal, kind, rate, bcast)
        return dq, dk, dv, None, None
    dq, dk, dv = _calls.bwd_call(dout, q, *repeat_kv(q, k, v), out, lse, mask4d, seed, scale, causal, kind, rate, bcast)
    b, sk, h_kv, d = k.shape
    group_sum = lambda g, like: g.astype(_F32).reshape(b, sk, h_kv, -1, d).sum(3).astype(like.dtype)
    return dq, group_sum(dk, k), group_sum(dv, v), None, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
# Forward-mode differentiation (`_ffi.custom_vjp`): the unfused structure, whose softmax takes
# its own jnp reference there. The same mask (both structures draw `dropout_mask`'s).
_fused.defreference(_OP, lambda q, k, v, mask4d, seed, scale, causal, kind, rate, bcast: _unfused(
    q, *repeat_kv(q, k, v), mask4d, seed, kind, causal, scale, rate, op=_OP, bcast=bcast))


@functools.partial(_ffi.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _fused_packed(qkv, mask4d, seed, axis, scale, causal, kind, rate, bcast):
    return _calls.fwd_packed_call(qkv, axis, mask4d, seed, scale, causal, kind, rate, bcast)[0]


def _fused_packed_fwd(qkv, mask4d, seed, axis, scale, causal, kind, rate, bcast):
    grad_mask = _masks.differentiated(kind, mask4d)
    qkv, mask4d, seed = _masks.primals(qkv, mask4d, seed)
    if grad_mask:
        return _masks.switched("attention_packed",
                        lambda qkv, m: _unfused(*packed_slices(qkv, axis), m, seed, kind, causal, scale, rate,
                                                op="attention_packed", bcast=bcast),
                        qkv, mask4d)
    out, lse = _calls.fwd_packed_call(qkv, axis, mask4d, seed, scale, causal, kind, rate, bcast)
    return out, (qkv, out, lse, mask4d, seed)


def _fused_packed_bwd(axis, scale, causal, kind, rate, bcast, res, dout):
    dout = _masks.cotangent(dout)
    if isinstance(res, _masks.Switched):
        return res.backward(dout)
    qkv, out, lse, mask4d, seed = res
    return (_calls.bwd_packed_call(dout, qkv, axis, out, lse, mask4d, seed, scale, causal, kind, rate, bcast),
            None, None)


_fused_packed.defvjp(_fused_packed_fwd, _fused_packed_bwd, symbolic_zeros=True)
_fused_packed.defreference("attention_packed", lambda qkv, mask4d, seed, axis, scale, causal, kind, rate, bcast: (
    _unfused(*packed_slices(qkv, axis), mask4d, seed, kind, causal, scale, rate, op="attention_packed", bcast=bcast)))


# ---------------------------------------------------------------------------------------
# Public function.


def _unfused(q, k, v, mask4d, seed, kind, causal, scale, rate, *, op, bcast=False):
    # Both GEMMs in the input dtype: the GPU accumulates in f32 and rounds once, as an f32
    # result cast back would, but autodiff then keeps every cotangent in that dtype too.
    # (With an f32 result, the backward turned dS into f32 [B, H, Sq, Sk] tensors and ran
    # mixed f32 x bf16 GEMMs.)
    if q.dtype == jnp.float16 and abs(scale) < 1.0:
        # float16 scores before the scale overflow where the scaled ones do not (|q.k| of
        # 65 504 is |q|, |k| ~ 32 at D 64): scale q instead (in f32, rounded once). Below
        # 2^-6 (head dims past 4096) q * scale would lose bits to float16's subnormals:
        # q and k each take the square root.
        if abs(scale) >= 2.0 ** -6:
            q_factor, k_factor = scale, None
        else:
            k_factor = math.sqrt(abs(scale))
            q_factor = math.copysign(k_factor, scale)
        q = (q.astype(jnp.float32) * q_factor).astype(q.dtype)
        if k_factor is not None:
            k = (k.astype(jnp.float32) * k_factor).astype(k.dtype)
        scale = 1.0
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if not bcast:
        p = _softmax.softmax_4d(scores, mask4d, seed, scale, causal, kind, rate, op=op)
    else:
        # The softmax kernel draws a mask per (b, h): the shared one is applied after it, in
        # f32 and rounded once, as the kernels scale the kept probabilities.
        p = _softmax.softmax_4d(scores, mask4d, _dropout.NO_SEED, scale, causal, kind, 0.0, op=op)
        keep = _dropout.seed_mask(seed, (1, 1, *scores.shape[2:]), rate)
        p = _dropout.apply_reference(p.astype(_F32), keep, rate).astype(p.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def unfused_source(source, mask4d, seed, kind, causal, scale, rate, *, op, bcast=False):
    """The unfused path on a source of q, k and v (`_attention`'s `source`); `op` names
    the public function in log lines."""
    qkv, axis, extra = source.product()
    return source.result(_unfused(*packed_slices(qkv, axis), mask4d, seed, kind, causal, scale, rate, op=op,
                                  bcast=bcast), extra)


_platform = _ffi.platform_of  # where q lives (a module attribute: tests replace it)


def fused_unsupported(platform: str, dtype, head_dim: int) -> str | None:
    """Why the fused kernels cannot run for this platform ("cpu", "gpu"), dtype and head
    dim (None when they can). The layout selector offers "fused" only where they can."""
    if platform == "cpu":
        return None
    if platform != "gpu" or not _ffi.has_cuda_target("jaxsub_attention_fwd"):
        return f"no fused attention kernel for platform {platform!r} in this build"
    if jnp.dtype(dtype) not in _CUDA_DTYPES:
        return f"the CUDA fused kernel takes bfloat16/float16, not {jnp.dtype(dtype)}"
    if head_dim not in _CUDA_HEAD_DIMS:
        return f"the CUDA fused kernel takes head dims {_CUDA_HEAD_DIMS}, not {head_dim}"
    return None


def _fused_unsupported(q) -> str | None:
    return fused_unsupported(_platform(q), q.dtype, q.shape[-1])


_KIND_NAMES = {_masks.NONE: "none", _masks.BOOLEAN: "boolean", _masks.ADDITIVE: "additive"}


def _default_implementation(q, mask4d, kind) -> str:
    """`implementation=None` where no configuration block chooses: "fused" on a GPU whose
    CUDA kernel takes this dtype and head dim, for head dims up to 64, and at 128 where the
    wgmma kernels run (sm_90a); else "unfused". Measured on the H200 (bench/NOTES.md,
    "Hopper kernels"): fused fwd+bwd 214.6 µs against unfused 328.2 at B8 S512 H16 D64
    (242.1 against 397.2 with key padding), 1046.1 against 1292.7 at causal S2048 D128;
    the mma.sync kernels were slower than unfused there (1369 vs 1285, attention v4). On
    the CPU the fused handler is a float64-accumulating oracle, not a fast path.

    An additive mask that varies over the queries (a learned relative-position bias
    [1, H, Sq, Sk]) takes the kernels' general score rule, one f32 load per score, and a
    backward that runs serialized: "unfused" (H100, T5-like B32 S512 H12 D64, dropout
    0.1, bias [1, 12, 512, 512] constant: fused fwd+bwd 1 829 µs, unfused with the bias
    differentiated 1 459, plain XLA 2 589; bench/NOTES.md, fifty-third session). One that
    does not ([B, 1, 1, Sk], [1, H, 1, Sk]) takes the kernels' key-bias rule, one load per
    key, at about the boolean key mask's time (sixtieth session)."""
    d = q.shape[-1]
    fast = (_platform(q) == "gpu" and _fused_unsupported(q) is None
            and (d <= 64 or (d == 128 and _ffi.attention_sm90())))
    if slow_fused_mask(_KIND_NAMES[kind], np.shape(mask4d)):
        return "unfused"
    return "fused" if fast else "unfused"


# The fused kernels against the unfused structure under such a mask (fwd+bwd, the H100
# measurement above; the unfused time includes the bias's gradient, so the ratio is a lower
# bound): what the layout selector's byte model charges the fused candidate.
SLOW_FUSED_MASK_RATIO = 1829.0 / 1459.0


def slow_fused_mask(kind: str, mask_shape) -> bool:
    """Whether a mask ("none", "boolean" or "additive", and its 4-D shape) makes the fused
    kernels slower than the unfused structure: an additive mask that varies over the
    queries (`_default_implementation`)."""
    return kind == "additive" and len(mask_shape) == 4 and mask_shape[2] > 1


def signature(q, k, mask4d, kind, causal, rate, bcast=False) -> tuple:
    """What the choice of implementation may depend on: the key under which
    `jaxsub.ops.config.lookup("attention", ...)` is asked (and the layout cache stores).
    Broadcast dropout adds ("broadcast_dropout", True); keys without it are those from
    before it existed."""
    b, sq, h, d = q.shape
    mask_shape = tuple(int(n) for n in np.shape(mask4d)) if kind != _masks.NONE else ()
    return (("batch", b), ("seq_q", sq), ("seq_k", k.shape[1]), ("heads", h), ("head_dim", d),
            ("dtype", jnp.dtype(q.dtype).name), ("causal", bool(causal)), ("mask", _KIND_NAMES[kind]),
            ("mask_shape", mask_shape), ("dropout_rate", float(rate)),
            *((("broadcast_dropout", True),) if bcast else ()))


def _check_packed(qkv, axis):
    op = "attention_packed"
    qkv = qkv if isinstance(qkv, jax.Array) else jnp.asarray(qkv)
    if qkv.ndim != 5:
        raise ValueError(f"jaxsub.{op}: `qkv` must have rank 5 ([B, S, 3, H, D] or [3, B, S, H, D]), "
                         f"got shape {qkv.shape}")
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or int(axis) not in (0, 2, -5, -3):
        raise ValueError(f"jaxsub.{op}: `axis` must be 2 ([B, S, 3, H, D]) or 0 ([3, B, S, H, D]), got {axis!r}")
    axis = int(axis) % 5
    if qkv.shape[axis] != 3:
        raise ValueError(f"jaxsub.{op}: `qkv` must have size 3 (q, k, v) on axis {axis}, got shape {qkv.shape}")
    if qkv.dtype not in _DTYPES:
        raise TypeError(f"jaxsub.{op}: `qkv` must be float32, bfloat16 or float16, got {qkv.dtype}")
    return qkv, axis


def _check_inputs(q, k, v):
    arrays = []
    for name, a in (("q", q), ("k", k), ("v", v)):
        a = a if isinstance(a, jax.Array) else jnp.asarray(a)
        if a.ndim != 4:
            raise ValueError(f"jaxsub.{_OP}: `{name}` must have rank 4 [B, S, H, D], got shape {a.shape}")
        arrays.append(a)
    q, k, v = arrays
    if q.dtype not in _DTYPES:
        raise TypeError(f"jaxsub.{_OP}: `q` must be float32, bfloat16 or float16, got {q.dtype}")
    for name, a in (("k", k), ("v", v)):
        if a.dtype != q.dtype:
            raise TypeError(f"jaxsub.{_OP}: `{name}` must have q's dtype ({q.dtype}), got {a.dtype}")
    for axis, dim in ((0, "B"), (3, "D")):
        if k.shape[axis] != q.shape[axis]:
            raise ValueError(f"jaxsub.{_OP}: `k` must have q's {dim} ({q.shape[axis]}), got shape {k.shape}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"jaxsub.{_OP}: `k`'s heads ({k.shape[2]}) must divide q's ({q.shape[2]}): q's heads "
                         f"in groups of H // H_kv per k/v head, got q {q.shape} and k {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"jaxsub.{_OP}: `v` must have k's shape {k.shape} (same Sk and heads), got {v.shape}")
    return q, k, v


def repeat_kv(q, k, v):
    """k and v repeated to q's heads (grouped-query attention): q head n reads k/v head
    n // (H // H_kv), as jax.nn.dot_product_attention groups them."""
    groups = q.shape[2] // k.shape[2]
    if groups == 1:
        return k, v
    return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def attention(q, k, v, *, mask=None, causal=False, scale=None, dropout_rate=0.0, key=None,
              implementation=None, broadcast_dropout=False):
    """Scaled dot-product attention with optional mask, causal masking and dropout.

    Args:
      q: queries [B, Sq, H, D]; float32, bfloat16 or float16.
      k, v: keys and values [B, Sk, H_kv, D], q's dtype, B and D. H_kv = H is multi-head
        attention; H_kv dividing H is grouped-query attention (H_kv = 1: multi-query), q head
        n reading k/v head n // (H // H_kv) as in jax.nn.dot_product_attention. The fused
        kernels read each k/v head for its group of q heads (no copies; the backward sums dk
        and dv over the group in registers, except where that leaves too few blocks for the
        GPU, B * H_kv * ceil(Sk / 64) < GROUPED_BWD_MIN_BLOCKS, where it takes k and v
        repeated; sharded over devices by heads, each device's q heads read its own k/v
        heads where H_kv divides by the devices); the unfused path repeats k and v to H
        heads and sums their gradients.
      mask: None; a boolean key-padding mask [B, Sk] (True = attend); or a boolean
        (True = attend) or additive (floating, added to the scaled scores, -inf allowed)
        mask broadcastable to [B, H, Sq, Sk]. A 2-D mask of shape [B, Sk] (either kind)
        is read as key padding; where B == Sq > 1 a 2-D additive mask could be [B, Sk]
        or [Sq, Sk] and raises a ValueError (pass mask[:, None, None, :] or mask[None, None]).
        An additive mask that the program differentiates (a learned relative-position
        bias) gets its gradient, the score gradient summed over the mask's broadcast
        dims. The fused kernels do not write the [B, H, Sq, Sk] score gradient, so where
        the program differentiates the mask, the fused path runs the unfused structure,
        whose softmax backward writes it (a one-time log line says so; the scores, in the
        inputs' dtype, and the probabilities are then in memory). A row whose mask values
        are all below -256 is shifted up by its maximum (its softmax is the same; its f32
        log-sum-exp would not hold the row's scores: `masks._near`); with `causal`, each
        query's row whose visible keys' values are all below -256 (a mask broadcast over
        the queries is then expanded to a row per query, only where some query needs it:
        `masks.by_query`).
      causal: query i attends to keys j <= i + (Sk - Sq), i.e. the causal diagonal is
        aligned to the bottom-right corner, so that with Sq < Sk the queries are the last
        Sq positions of the key sequence (decoding with a cache). With Sq > Sk the first
        Sq - Sk queries see no key. Combines with `mask` (both must allow a key).
      scale: static float multiplying Q Kᵀ; default 1 / sqrt(D).
      dropout_rate: static float in [0, 1), dropout on the attention probabilities.
      key: a JAX PRNG key, required when dropout_rate > 0 (may be traced).
      broadcast_dropout: static bool. False (the default): each probability (b, h, i, j)
        is dropped on its own. True: one [Sq, Sk] dropout mask shared by every batch
        element and head, as Flax's `broadcast_dropout=True` (the default of
        `nn.MultiHeadDotProductAttention` and `nn.dot_product_attention`) draws it.
      implementation: "fused" (one kernel per direction, no [B, H, Sq, Sk] tensor in
        memory), "unfused" (score GEMM, fused softmax-dropout, GEMM), or None: the
        choice of the enclosing `jaxsub.ops.config.use` block (what `jaxsub.optimize`'s
        `layouts=` selected for this signature), else "fused" on a GPU where the CUDA
        kernel runs and the head dim is at most 64, or 128 where the Hopper (sm_90a)
        kernels run, and "unfused" otherwise (measured on the H200: fused faster at B8
        S512 D64, and at causal S2048 D128 with the Hopper kernels; on the CPU the fused
        handler is a slow oracle).
        "fused" on a GPU without a CUDA fused kernel for this build, dtype (float32) or head
        dim (not 32, 64 or 128) runs the unfused path with a one-time log line.

    Returns:
      [B, Sq, H, D] in q's dtype. A query with no visible key gets zeros and zero
      gradients. Probability (b, h, i, j) is dropped exactly where
      `dropout_mask(key, (B, H, Sq, Sk), dropout_rate)` is False (with broadcast_dropout,
      where `dropout_mask(key, (1, 1, Sq, Sk), dropout_rate)[0, 0, i, j]` is), in both
      implementations.
    """
    q, k, v = _check_inputs(q, k, v)
    return _attention(_OP, q, k, v, None, mask, causal, scale, dropout_rate, key, implementation, broadcast_dropout)


def attention_packed(qkv, *, axis=2, mask=None, causal=False, scale=None, dropout_rate=0.0, key=None,
                     implementation=None, broadcast_dropout=False):
    """Self-attention on queries, keys and values packed in one array.

    The same function as `attention(q, k, v, ...)` with q, k, v the three slices of `qkv`
    along `axis` (index 0, 1, 2), the same dropout masks and the same `implementation`
    choice; the gradient is one array of qkv's shape. This is the form one QKV projection
    writes (``einsum("bse,ethd->bsthd", x, w_qkv)``). The fused kernels read q, k and v in
    place and write dq, dk and dv into one gradient array: the forward copies no slice and
    the backward concatenates nothing (`attention` on slices of one array does both).

    Args:
      qkv: [B, S, 3, H, D] (axis=2, the default) or [3, B, S, H, D] (axis=0); float32,
        bfloat16 or float16.
      axis: 2 or 0 (or -3, -5): where the q / k / v index is.
      mask, causal, scale, dropout_rate, key, implementation, broadcast_dropout: as in
        `attention` (Sq = Sk = S).

    Returns:
      [B, S, H, D] in qkv's dtype.
    """
    qkv, axis = _check_packed(qkv, axis)
    like = jax.ShapeDtypeStruct(_calls.packed_dims(qkv.shape, axis), qkv.dtype)  # q's, k's and v's shape
    return _attention("attention_packed", like, like, like, (qkv, axis), mask, causal, scale, dropout_rate, key,
                      implementation, broadcast_dropout)


def _attention(op, q, k, v, packed, mask, causal, scale, dropout_rate, key, implementation, broadcast_dropout=False):
    """`attention` after the q, k, v checks. `packed`: None (q, k, v are arrays), (qkv,
    axis) when q, k, v are its slices, or a source of q, k, v computed from other arrays
    (jaxsub.ops.projected: `.data`, an array for the platform, dtype and head dim;
    `.fused(mask4d, seed, scale, causal, kind, rate, bcast)`, the fused path;
    `.product()`, (qkv, axis, extra) for the others; `.result(out, extra)`, the op's
    result). q, k, v are then shapes only: the fused path reads qkv in place (or computes
    it itself), and only the other paths slice it (eagerly, slices nobody reads would
    still be copied)."""
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"jaxsub.{op}: `implementation` must be None, 'fused' or 'unfused', got {implementation!r}")
    causal = _ffi.check_bool(op, "causal", causal)
    broadcast_dropout = _ffi.check_bool(op, "broadcast_dropout", broadcast_dropout)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(max(d, 1)) if scale is None else _masks.check_scale(op, scale)
    rate = _dropout.check_rate(op, dropout_rate, "dropout_rate")
    bcast = broadcast_dropout and rate > 0.0
    seed = _dropout.seed_from_key(op, key) if rate > 0.0 else _dropout.NO_SEED
    mask4d, kind = _masks.normalize(op, mask, (b, h), sq, sk, key_padding_ok=True, causal=causal)
    source = None if packed is None or isinstance(packed, tuple) else packed
    # An array: its platform, dtype and head dim.
    data = q if packed is None else packed[0] if source is None else source.data

    def result(out, extra=None):
        return out if source is None else source.result(out, extra)

    if q.size == 0 or k.size == 0:
        _ffi.fallback(op, "zero-size input")
        return result(jnp.zeros(q.shape, q.dtype))
    if implementation is None:
        implementation = _config.lookup(_OP, signature(q, k, mask4d, kind, causal, rate, bcast)).get("impl")
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"jaxsub.{op}: the configuration in effect selects implementation "
                             f"{implementation!r}; expected 'fused' or 'unfused'")
        if implementation is None:
            implementation = _default_implementation(data, mask4d, kind)
    operands = (q, k, v, packed if source is None else vars(source))
    return _masks.by_query(mask4d, kind, sq, sk, causal, functools.partial(
        _attention_call, op, q, k, v, packed, source, data, seed, scale, causal, kind, rate, bcast, implementation),
        operands)


def _attention_call(op, q, k, v, packed, source, data, seed, scale, causal, kind, rate, bcast, implementation,
                    mask4d):
    """`_attention` on the mask as `masks.by_query` gives it, its implementation chosen."""
    if implementation == "fused":
        reason = _fused_unsupported(data)
        if reason is None:
            if source is not None:
                return source.fused(jnp.asarray(mask4d), seed, scale, causal, kind, rate, bcast)
            if packed is not None:
                return _fused_packed(packed[0], jnp.asarray(mask4d), seed, packed[1], scale, causal, kind, rate, bcast)
            if k.shape[2] != q.shape[2] and k.shape[2] % jax.device_count():
                # k's heads divide by the devices or are repeated to q's: otherwise Shardy
                # can give the backward's k an indivisible sharding (q's heads sliced by more
                # devices than H_kv; found by a fuzzer).
                k, v = repeat_kv(q, k, v)
            return _fused(q, k, v, jnp.asarray(mask4d), seed, scale, causal, kind, rate, bcast)
        _ffi.fallback(op, reason, instead="the unfused path")
    if source is not None:
        return unfused_source(source, mask4d, seed, kind, causal, scale, rate, op=op, bcast=bcast)
    if packed is not None:
        q, k, v = packed_slices(*packed)
    return _unfused(q, *repeat_kv(q, k, v), mask4d, seed, kind, causal, scale, rate, op=op, bcast=bcast)
