"""jaxsub.optimize on CPU: flax.linen blocks (their dropouts, pre-LN, dropout under vmap
over per-example keys), layers stacked with nn.scan and lax.scan, and the products that go
through the GEMM target (conventions: test_optimize.py)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsub
from jaxsub.testing import assert_close
from optimize_helpers import (N, RATE, assert_same, bdrln_block, expect, ffn_block, gemm_c_types, ln_two_pass, normal,
                              target_counts)


# ---------------------------------------------------------------------------------------
# flax.linen blocks: their dropouts, pre-LN, dropout under vmap over per-example keys.


class FlaxBlock(nn.Module):
    rate: float = RATE
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(2 * N)(x)
        h = nn.Dropout(self.rate, deterministic=self.deterministic)(nn.gelu(h, approximate=False))
        h = nn.Dropout(self.rate, deterministic=self.deterministic)(nn.Dense(N)(h))
        return nn.LayerNorm()(x + h)


def test_flax_linen_block_deterministic():
    m = FlaxBlock()
    x = normal(0, (8, N))
    params = m.init(jax.random.key(0), x)
    assert_same(m.apply, (params, x), argnums=(0, 1))
    expect(m.apply, (params, x), bias_gelu_dropout=1, bdrln=1)


def _flax_dropout_block(rows):
    """(f, args): FlaxBlock with its two dropouts active, the key an argument."""
    m = FlaxBlock(deterministic=False)
    x = normal(0, (rows, N))

    def f(params, x, key):
        return m.apply(params, x, rngs={"dropout": key})

    return f, (m.init(jax.random.key(0), x), x, jax.random.key(1))


def test_flax_linen_dropout_rewritten():
    f, args = _flax_dropout_block(64)
    expect(f, args, bias_gelu_dropout=1, bdrln=1)
    opt = jaxsub.optimize(f)
    np.testing.assert_array_equal(opt(*args), opt(*args))
    assert np.isfinite(np.asarray(opt(*args))).all()
    report = jaxsub.explain(f, *args)
    assert report.totals == {"bias_gelu_dropout": 1, "bias_dropout_residual_layer_norm": 1}
    assert "rate=0.25" in str(report)


class FlaxPreLNBlock(nn.Module):
    """GPT style: h = x + dropout(Dense(LN(x))), out = h + dropout(MLP(LN(h)))."""
    rate: float = RATE
    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        h = x + nn.Dropout(self.rate, deterministic=self.deterministic)(nn.Dense(N)(nn.LayerNorm()(x)))
        m = nn.gelu(nn.Dense(2 * N)(nn.LayerNorm()(h)), approximate=False)
        return h + nn.Dropout(self.rate, deterministic=self.deterministic)(nn.Dense(N)(m))


@pytest.mark.parametrize("deterministic", [True, False])
def test_flax_linen_pre_ln_block(deterministic):
    """Both layer norms fused and handing on what they read (the block input, the residual
    sum) to the residual adds after them."""
    m = FlaxPreLNBlock(deterministic=deterministic)
    x = normal(0, (8, N))
    params = m.init(jax.random.key(0), x)

    def f(params, x, key):
        return m.apply(params, x, rngs={"dropout": key})

    args = (params, x, jax.random.key(1))
    expect(f, args, layer_norm=1, bdrln=1, bias_gelu_dropout=1)
    report = str(jaxsub.explain(f, *args))
    assert "x handed on" in report and "residual sum written too" in report, report
    if deterministic:
        assert_same(f, args, argnums=(0, 1))
    else:
        opt = jax.jit(jaxsub.optimize(f))
        np.testing.assert_array_equal(opt(*args), opt(*args))
        assert np.isfinite(np.asarray(opt(*args))).all()


def test_rewrite_dropout_false_leaves_dropout_alone():
    f, args = _flax_dropout_block(8)
    opt = jaxsub.optimize(f, rewrite_dropout=False)
    # The user's own bernoulli bits are kept, so results agree with the original.
    assert_close(opt(*args), f(*args), reduction=N)
    counts = target_counts(opt, *args)
    # Bias + GELU and the layer norm are still fused, each without the dropout next to it.
    assert counts == {"jaxsub_bdrln_fwd": 0, "jaxsub_layer_norm_fwd": 1, "jaxsub_bias_gelu_dropout_fwd": 1}
    report = jaxsub.explain(opt, *args)
    reasons = [m.detail for m in report.near_misses]
    assert reasons.count("dropout not rewritten (rewrite_dropout=False)") == 2


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_dropout_under_vmap_over_per_example_keys_is_left_as_written(raw):
    """jax.vmap over per-example keys batches the bernoulli call (a key array [E]): a fused
    op draws its mask from one key, so that dropout stays the user's, the rest is fused, and
    the numbers are plain JAX's (optimize raised "`key` must be a single PRNG key")."""
    block, args = _flax_dropout_block(8)
    params, x, _ = args
    split = jax.random.split(jax.random.PRNGKey(3) if raw else jax.random.key(3), 3)

    def f(params, xs, keys):
        return jax.vmap(block, in_axes=(None, 0, 0))(params, xs, keys)

    xs = jnp.stack([x, 2 * x, -x])
    opt = jaxsub.optimize(f)
    counts = target_counts(opt, params, xs, split)
    assert counts == {"jaxsub_bdrln_fwd": 0, "jaxsub_layer_norm_fwd": 1, "jaxsub_bias_gelu_dropout_fwd": 1}
    # explain names both dropouts (found by probing: only attention's was reported)
    report = jaxsub.explain(f, params, xs, split)
    assert sum("is one key per example" in m.detail for m in report.near_misses) == 2, str(report)
    assert_close(jax.jit(opt)(params, xs, split), jax.jit(f)(params, xs, split), reduction=N)
    loss = lambda g: lambda p: jnp.sum(g(p, xs, split) ** 2)  # noqa: E731
    for got, want in zip(jax.tree.leaves(jax.grad(loss(opt))(params)), jax.tree.leaves(jax.grad(loss(f))(params))):
        assert_close(got, want, reduction=8 * N, grad=True)


@pytest.mark.parametrize("op", ["gelu", "softmax"])
def test_dropout_of_an_unbatched_value_under_vmap_over_keys_is_named(op):
    """jax.vmap over per-example keys of a value it does not batch (in_axes=None): the op is
    fused alone and its dropout, of the op's output broadcast to the keys' batch, stays the
    user's; explain names that dropout (it listed the op with "no dropout" and nothing
    else), and not where the value is batched (the matcher names that one itself)."""
    x = normal(31, (8, N))
    b = normal(32, (N,))
    keys = jax.random.split(jax.random.key(33), 3)

    def f(x, key):
        h = jax.nn.gelu(x + b, approximate=False) if op == "gelu" else jax.nn.softmax(x, axis=-1)
        return jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0)

    unbatched = jax.vmap(f, in_axes=(None, 0))
    report = jaxsub.explain(unbatched, x, keys)
    assert len(report.matches) == 1 and "no dropout" in report.matches[0].detail, str(report)
    named = [m for m in report.near_misses if m.detail.startswith("the dropout after it: ")]
    assert len(named) == 1 and "is one key per example" in named[0].detail, str(report)
    assert named[0].pattern == report.matches[0].pattern
    assert_close(jax.jit(jaxsub.optimize(unbatched))(x, keys), jax.jit(unbatched)(x, keys), reduction=N)
    batched = jaxsub.explain(jax.vmap(f), jnp.stack([x, -x, 2 * x]), keys)
    assert not any(m.detail.startswith("the dropout after it") for m in batched.near_misses), str(batched)
    assert sum("is one key per example" in m.detail for m in batched.near_misses) == 1, str(batched)


def test_dropout_with_a_mask_an_inner_vmap_shares_is_named():
    """A mask drawn once and shared by an inner jax.vmap's examples (broadcast over them):
    the GELU is fused alone, the dropout stays the user's, and explain names it."""
    b = normal(34, (N,))

    def f(x, key):
        keep = jax.random.bernoulli(key, 0.9, x.shape[1:])
        drop = lambda h, keep: jnp.where(keep, h / 0.9, 0)  # noqa: E731
        return jax.vmap(drop, in_axes=(0, None))(jax.nn.gelu(x + b, approximate=False), keep)

    x, key = normal(35, (3, 8, N)), jax.random.key(36)
    report = jaxsub.explain(f, x, key)
    assert len(report.matches) == 1 and "no dropout" in report.matches[0].detail, str(report)
    named = [m.detail for m in report.near_misses]
    assert named == [f"the dropout after it: dropout mask bool[8, {N}] is broadcast over float32[3, 8, {N}]; the "
                     "fused op drops every element independently"], str(report)
    np.testing.assert_array_equal(jax.jit(jaxsub.optimize(f))(x, key) == 0, jax.jit(f)(x, key) == 0)

    # Where the attention matcher names a broadcast mask on the probabilities itself (its
    # softmax then fused alone), the dropout is named once, not again after the softmax.
    def attention(q, k, v, key):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0, axis=-1)
        keep = jax.random.bernoulli(key, 0.9, (p.shape[0], 1, *p.shape[2:]))
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / 0.9, 0), v)

    q = normal(37, (2, 8, 2, N))
    report = jaxsub.explain(attention, q, q, q, key)
    assert report.totals == {"softmax_dropout": 1}, str(report)
    assert [m.pattern for m in report.near_misses] == ["attention"], str(report)


@pytest.mark.parametrize("x_batched,residual_batched", [(False, False), (False, True), (True, False)])
def test_dropout_before_a_layer_norm_under_vmap_over_keys_is_named(x_batched, residual_batched):
    """LN(residual + dropout(x + bias)) under jax.vmap over per-example keys where x or the
    residual is not batched (Monte Carlo dropout of one input, say): the vmap broadcasts it,
    the BDRLN matcher finds no residual sum of x's shape (or no dropout), the layer norm is
    fused alone and the dropout stays the user's. explain names that dropout once (it listed
    the layer norm and nothing else); with both batched the matcher names it itself."""
    x, res = normal(38, (8, N)), normal(39, (8, N))
    bias, scale, offset = normal(40, (N,)), 1 + normal(41, (N,)), normal(42, (N,))
    keys = jax.random.split(jax.random.key(43), 3)

    def f(x, key, res):
        h = jnp.where(jax.random.bernoulli(key, 0.9, x.shape), (x + bias) / 0.9, 0)
        s = res + h
        mean = s.mean(-1, keepdims=True)
        var = ((s - mean) ** 2).mean(-1, keepdims=True)
        return (s - mean) * jax.lax.rsqrt(var + 1e-5) * scale + offset

    batch = lambda a: jnp.stack([a, -a, 2 * a])  # noqa: E731
    g = jax.vmap(f, in_axes=(0 if x_batched else None, 0, 0 if residual_batched else None))
    args = (batch(x) if x_batched else x, keys, batch(res) if residual_batched else res)
    report = jaxsub.explain(g, *args)
    assert report.totals == {"layer_norm": 1}, str(report)
    assert [(m.pattern, m.detail.split(": ")[0]) for m in report.near_misses] == [
        ("bias_dropout_residual_layer_norm", "the dropout before it")], str(report)
    assert "is one key per example" in report.near_misses[0].detail
    assert_close(jax.jit(jaxsub.optimize(g))(*args), jax.jit(g)(*args), reduction=N)
    both = jaxsub.explain(jax.vmap(f), batch(x), keys, batch(res))
    assert [m.detail.split(": ")[0] for m in both.near_misses] == ["dropout key key<fry>[3] is one key per example "
                                                                   "(jax.vmap over keys); a fused op draws its mask "
                                                                   "from one key"], str(both)


# ---------------------------------------------------------------------------------------
# Stacks (nn.scan, lax.scan) and the products that go through the GEMM target.


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(N)(nn.gelu(nn.Dense(2 * N)(x), approximate=True))
        return nn.LayerNorm()(x + h), None


def test_nn_scan_stack():
    stack = nn.scan(ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()
    x = normal(0, (8, N))
    params = stack.init(jax.random.key(0), x, None)

    def f(params, x):
        return stack.apply(params, x, None)[0]

    assert_same(f, (params, x), argnums=(0, 1))
    expect(f, (params, x), bias_gelu_dropout=1, bdrln=1)
    report = jaxsub.explain(f, params, x)
    assert all(m.scope == "scan" for m in report.matches)
    # In a scan as in a single layer the GELU output is kept for the Dense product's
    # weight gradient (the scan's custom calls write their residuals into its stacks in
    # place), so the GELU backward does not write it again (an empty y result).
    assert "bias_gelu_dropout_dense" not in str(report)
    assert _gelu_writes_y(f, (params, x)) == [False]
    layer = ScanLayer()
    p1 = layer.init(jax.random.key(0), x, None)
    assert _gelu_writes_y(lambda p, x: layer.apply(p, x, None)[0], (p1, x)) == [False]


class BF16ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        dense = functools.partial(nn.Dense, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        h = dense(N)(nn.gelu(dense(2 * N)(x), approximate=True))
        return nn.LayerNorm(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x + h), None


def test_scan_products_through_the_gemm_target(monkeypatch):
    """On GPU (forced here) the bf16 products of a scanned body that runs fused ops go
    through ops.dense, the one after the GELU too: same values and gradients, the gemm
    target in the program (forward and both gradient products of each product). f32
    products stay XLA's."""
    from jaxsub.rewrite import scan_products

    stack = nn.scan(BF16ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()
    x = normal(0, (8, N)).astype(jnp.bfloat16)
    params = stack.init(jax.random.key(0), x, None)

    def f(params, x):
        return stack.apply(params, x, None)[0]

    grad = lambda: jax.jit(jax.grad(lambda p, x: jnp.sum(jaxsub.optimize(f)(p, x) ** 2), (0, 1)))  # noqa: E731
    monkeypatch.setattr(scan_products, "LIBRARY", False)  # as on CPU: XLA's dots
    assert "jaxsub_gemm" not in grad().lower(params, x).as_text()
    monkeypatch.setattr(scan_products, "LIBRARY", True)
    assert_same(f, (params, x), jnp.bfloat16, argnums=(0, 1))
    report = jaxsub.explain(f, params, x)
    assert report.totals.get("dense") == 2
    assert "ops.dense" in str(report)
    text = grad().lower(params, x).as_text()
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == 6
    f32 = nn.scan(ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()
    x32 = normal(0, (8, N))
    p32 = f32.init(jax.random.key(0), x32, None)
    assert "dense" not in jaxsub.explain(lambda p, x: f32.apply(p, x, None)[0], p32, x32).totals


def _attention_layer(w, h):
    """One bf16 attention layer, written as einsums: a packed q/k/v product plus its bias,
    and an out-projection contracting two axes whose pairs einsum lists in reverse order."""
    qkv = jnp.einsum("bse,ethd->bsthd", h, w["qkv"]) + w["qkv_bias"]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32), -1).astype(h.dtype), v)
    return h + jnp.einsum("bshd,hde->bse", a, w["out"])


def _attention_stack(ws, x):
    """Two of _attention_layer under lax.scan."""
    return jax.lax.scan(lambda h, w: (_attention_layer(w, h), None), x, ws)[0]


def test_scan_attention_products_through_the_gemm_target(monkeypatch):
    """In a scanned attention layer (GPU forced): the q/k/v product and the bias the
    attention match adds become one ops.dense (the bias in the GEMM's epilogue), the
    out-projection another; same values and gradients."""
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    bf = jnp.bfloat16
    # Scores of order one: the original rounds them to bf16 before its f32 softmax.
    ws = {"qkv": (normal(1, (2, 32, 3, 2, 16)) / 12).astype(bf), "qkv_bias": (normal(2, (2, 3, 2, 16)) / 4).astype(bf),
          "out": (normal(3, (2, 2, 16, 32)) / 6).astype(bf)}
    x = normal(0, (2, 8, 32)).astype(bf)
    assert_same(_attention_stack, (ws, x), bf, argnums=(0, 1))
    report = jaxsub.explain(_attention_stack, ws, x)
    assert report.totals.get("attention") == 1 and report.totals.get("dense") == 1
    assert "the q/k/v product and its bias as one ops.dense" in str(report)
    grad = jax.jit(jax.grad(lambda ws, x: jnp.sum(jaxsub.optimize(_attention_stack)(ws, x).astype(jnp.float32)),
                            (0, 1)))
    text = grad.lower(ws, x).as_text()
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == 6  # two products, forward and both gradients
    assert "@jaxsub_bias_add" not in text
    # The layer input h is also the residual: the product hands it on (ops.gemm.dense_and_input),
    # so the residual's gradient is added into dh by the dh product's c operand. The one
    # [2, 8, 32] add left is the forward's residual add.
    assert "its input's other uses read it from there" in str(report)
    assert gemm_c_types(text).count("tensor<16x32xbf16>") == 1
    assert len([ln for ln in text.splitlines() if "stablehlo.add" in ln and "tensor<2x8x32xbf16>" in ln]) == 1


# GEMM-target calls in the gradient: the q/k/v product's forward and two gradients; "all"
# adds the out-projection's two gradients (its forward feeds nothing the gradient needs).
@pytest.mark.parametrize("outside,gemms", [("attention", 3), ("all", 5), ("none", 0)])
def test_single_layer_attention_product_through_the_gemm_target(monkeypatch, outside, gemms):
    """Outside a scan (GPU forced): the q/k/v product, its bias and the attention as one
    ops.dense_attention_packed (the bias gradient from the attention's backward, the
    residual's gradient added by the dx product), as EncoderLayer runs them; with OUTSIDE
    "all" the out-projection through the GEMM target too, with "none" neither. Same values
    and gradients."""
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    monkeypatch.setattr(scan_products, "OUTSIDE", outside)
    bf = jnp.bfloat16
    # Head dim 32: one the CUDA attention kernels take too, so that on a GPU backend the
    # fused path runs as on CPU.
    w = {"qkv": (normal(1, (32, 3, 2, 32)) / 12).astype(bf), "qkv_bias": (normal(2, (3, 2, 32)) / 4).astype(bf),
         "out": (normal(3, (2, 32, 32)) / 8).astype(bf)}
    x = normal(0, (2, 8, 32)).astype(bf)
    assert_same(_attention_layer, (w, x), bf, argnums=(0, 1))
    report = str(jaxsub.explain(_attention_layer, w, x))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jaxsub.optimize(_attention_layer)(w, x).astype(jnp.float32)),
                            (0, 1)))
    text = grad.lower(w, x).as_text()
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == gemms
    # x is also the residual. (The gradient alone needs no forward output, so the program
    # has no forward residual add.) Apart, XLA adds the residual's gradient to dx; through
    # the GEMM target the dx product adds it as its c operand.
    adds = [ln for ln in text.splitlines() if "stablehlo.add" in ln and "tensor<2x8x32xbf16>" in ln]
    if outside == "none":
        assert "ops.dense" not in report and len(adds) == 1
        return
    assert "one ops.dense_attention_packed" in report and "its input's other uses read it from there" in report
    assert "@jaxsub_bias_add" not in text and "@jaxsub_bias_grad" not in text
    assert text.count("@jaxsub_attention_qkv_bwd(") == 1
    assert gemm_c_types(text).count("tensor<16x32xbf16>") == 1 and not adds


@pytest.mark.parametrize("use_bias", [True, False])
def test_flax_projections_through_the_gemm_target(monkeypatch, use_bias):
    """Flax's three q/k/v DenseGenerals of a post-LN block's input (GPU forced): one
    ops.dense_attention_packed on the weights and biases stacked, as the packed q/k/v
    product runs (no attention_projected, no separate bias gradient, the residual's
    gradient added by the dx product); same values and gradients, the three kernels' and
    biases' included."""
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    bf = jnp.bfloat16
    m = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=64, out_features=32, use_bias=use_bias,
                                        dtype=bf, param_dtype=bf)
    x = normal(0, (2, 8, 32)).astype(bf)
    params = jax.tree.map(lambda a: (a.astype(jnp.float32) / 2).astype(bf), m.init(jax.random.key(0), x))

    def f(params, x):
        return x + m.apply(params, x)

    assert_same(f, (params, x), bf, argnums=(0, 1))
    report = str(jaxsub.explain(f, params, x))
    assert "one ops.dense_attention_packed on the weights and biases stacked" in report, report
    assert "its input's other uses read it from there" in report
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(jaxsub.optimize(f)(p, x).astype(jnp.float32)), (0, 1)))
    text = grad.lower(params, x).as_text()
    assert text.count("@jaxsub_attention_qkv_bwd(") == 1 and "@jaxsub_attention_bwd_dqkv(" not in text
    assert "@jaxsub_bias_grad" not in text and "@jaxsub_bias_add" not in text
    # The three biases' gradients are three results of the attention's backward, not
    # slices of one [3, H, D] result (each a copy kernel on the GPU).
    bwd = next(ln for ln in text.splitlines() if "@jaxsub_attention_qkv_bwd(" in ln).split("->")[1]
    assert bwd.count("tensor<2x32xbf16>") == 3 and "tensor<3x2x32xbf16>" not in bwd, bwd
    # The q/k/v product's forward and two gradients, the out-projection's two gradients.
    assert text.count("stablehlo.custom_call @jaxsub_gemm") == 5
    assert gemm_c_types(text).count("tensor<16x32xbf16>") == 1


def test_nnx_projections_through_the_gemm_target(monkeypatch):
    """The same for flax.nnx.MultiHeadAttention (its q is viewed [B, S, H, 1, D]): one
    ops.dense_attention_packed on the stacked weights; values and the input's gradient."""
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    bf = jnp.bfloat16
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=64, decode=False, dtype=bf,
                                   param_dtype=bf, rngs=nnx.Rngs(0))
    x = normal(0, (2, 8, 32)).astype(bf)

    def f(x):
        return x + layer(x)

    assert_same(f, (x,), bf)
    assert "one ops.dense_attention_packed on the weights and biases stacked" in str(jaxsub.explain(f, x))
    text = jax.jit(jax.grad(lambda x: jnp.sum(jaxsub.optimize(f)(x).astype(jnp.float32)))).lower(x).as_text()
    assert text.count("@jaxsub_attention_qkv_bwd(") == 1 and "@jaxsub_attention_bwd_dqkv(" not in text


def test_outside_products_mode_is_checked(monkeypatch):
    from jaxsub.rewrite import scan_products

    monkeypatch.setattr(scan_products, "LIBRARY", True)
    monkeypatch.setattr(scan_products, "OUTSIDE", "sometimes")
    x = normal(0, (2, 8, 32)).astype(jnp.bfloat16)
    w = {"qkv": jnp.zeros((32, 3, 2, 16), jnp.bfloat16), "qkv_bias": jnp.zeros((3, 2, 16), jnp.bfloat16),
         "out": jnp.zeros((2, 16, 32), jnp.bfloat16)}
    with pytest.raises(ValueError, match="JAXSUB_OPTIMIZE_PRODUCTS.*sometimes"):
        jaxsub.optimize(_attention_layer)(w, x)


def _gelu_writes_y(f, args):
    """For each GELU backward call in the gradient of optimize(f): whether it writes y."""
    text = jax.jit(jax.grad(lambda *a: jnp.sum(jaxsub.optimize(f)(*a)))).lower(*args).as_text()
    return [not ln.rstrip().endswith("tensor<0xf32>)") for ln in text.splitlines()
            if "@jaxsub_bias_gelu_dropout_bwd" in ln]


def test_lax_scan_pre_ln_stack():
    """Pre-LN blocks in a scan (and under remat): the layer norms' hand-ons inside the body."""
    ws = {"w": normal(1, (2, N, N)) / 6, "b": normal(2, (2, N)), "s1": normal(3, (2, N)),
          "b1": normal(4, (2, N)), "s2": normal(5, (2, N)), "b2": normal(6, (2, N))}

    def f(ws, x):
        def layer(h, w):
            a = ln_two_pass(h, w["s1"], w["b1"])
            h2 = h + (a @ w["w"] + w["b"])
            return ln_two_pass(h2, w["s2"], w["b2"]) * 0.5 + h2, None
        return jax.lax.scan(jax.checkpoint(layer), x, ws)[0]

    x = normal(0, (8, N))
    assert_same(f, (ws, x), argnums=(0, 1))
    expect(f, (ws, x), layer_norm=1, bdrln=1)


@pytest.mark.parametrize("unroll", [1, 2])
def test_lax_scan_stack(unroll):
    """Also a scan with two steps per loop iteration, which the pass keeps."""
    ws = {"w1": normal(1, (3, N, 2 * N)) / 6, "b1": normal(2, (3, 2 * N)), "w2": normal(3, (3, 2 * N, N)) / 8,
          "b2": normal(4, (3, N)), "s": normal(5, (3, N)), "lb": normal(6, (3, N))}

    def f(ws, x):
        def layer(h, w):
            a = ffn_block(h, w["w1"], w["b1"], None, rate=0.0, approximate=False)
            return bdrln_block(a @ w["w2"], w["b2"], h, w["s"], w["lb"], None, rate=0.0), None
        return jax.lax.scan(jax.checkpoint(layer), x, ws, unroll=unroll)[0]

    x = normal(0, (8, N))
    assert_same(f, (ws, x), argnums=(0, 1))
    assert jaxsub.explain(f, ws, x).totals == {"bias_gelu_dropout": 1, "bias_dropout_residual_layer_norm": 1}
    # In the lowered text each target appears once per copy of the body: once where JAX
    # lowers the checkpointed body as one function that the loop calls (0.10), once per
    # unrolled step and for the remainder where it inlines them (0.11: 2 + 1 of 3 steps).
    copies = (1,) if unroll == 1 else (1, 3)
    counts = target_counts(jaxsub.optimize(f), ws, x)
    assert counts["jaxsub_bias_gelu_dropout_fwd"] == counts["jaxsub_bdrln_fwd"] in copies, counts
    assert sum(counts.values()) == 2 * counts["jaxsub_bdrln_fwd"], counts
    # A scan whose body runs fused ops goes through jaxsub.stack.scan: for a GPU its
    # gradient allocates the residual stacks (AllocateBuffer) rather than zero-filling them.
    grad = jax.jit(jax.grad(lambda ws, x: jnp.sum(jaxsub.optimize(f)(ws, x)), argnums=(0, 1)))
    text = grad.trace(ws, x).lower(lowering_platforms=("cuda",)).as_text()
    assert "@AllocateBuffer" in text
    assert "@AllocateBuffer" not in jax.jit(jax.grad(lambda ws, x: jnp.sum(f(ws, x)))).trace(ws, x).lower(
        lowering_platforms=("cuda",)).as_text()
    # (the stack's forward and backward loops, inside the custom_jvp calls of its rules)
    scans = [e for e in _equations(jax.make_jaxpr(grad)(ws, x).jaxpr) if e.primitive.name == "scan"]
    assert scans and all(e.params["unroll"] == unroll for e in scans)


def _equations(jaxpr, depth=0):
    """jaxpr's equations and those of the calls in it (a jit's, a custom_jvp's), not of loops."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name != "scan" and depth < 8:
            for key in ("jaxpr", "call_jaxpr"):
                inner = e.params.get(key)
                if inner is not None:
                    yield from _equations(getattr(inner, "jaxpr", inner), depth + 1)
