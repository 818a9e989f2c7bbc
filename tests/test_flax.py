"""jaxsub.flax: EncoderLayer against the plain-Flax ReferenceEncoderLayer with converted
parameters, masks, dropout, and the Encoder stack (scan, remat)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import _ffi
from jaxsub.flax import Encoder, EncoderLayer, from_flax_params, reference_layer, to_flax_params
from jaxsub.testing import assert_close

B, S, E, H, F = 2, 12, 32, 4, 48


def _perturb(params, seed):
    """Parameters with every leaf moved off its initial value (zero biases and unit
    scales would hide a bias or scale routed to the wrong place). Drawn with NumPy:
    jax.random would compile a draw per leaf shape, seconds of test time."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: a + jnp.asarray(0.2 * rng.standard_normal(a.shape), a.dtype), params)


def _setup(seed=0, dtype=jnp.float32, **kw):
    layer = EncoderLayer(num_heads=H, mlp_dim=F, dtype=dtype, **kw)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((B, S, E)) + 0.5, jnp.float32)
    params = _perturb(jax.jit(layer.init)(jax.random.key(seed + 1), x)["params"], seed + 2)
    return layer, x, params


def _key_padding():
    """Batch 0 attends to all keys, batch 1 to the first 7 only."""
    return jnp.arange(S)[None, :] < jnp.array([[S], [7]])


def _additive(masking):
    """Additive biases: BERT's padding form (1 - valid) * -1e4 as [B, S]; a learned-bias-like
    [H, S, S] with the second example's last keys hidden by -inf ([B, H, S, S]); the same
    learned bias alone ([1, H, S, S]), to go with a boolean mask."""
    if masking == "additive_padding":
        return (1.0 - _key_padding().astype(jnp.float32)) * -1e4
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((1, H, S, S)).astype(np.float32))
    if masking == "mask_and_bias":
        return bias
    return jnp.where(_key_padding()[:, None, None, :], bias, -jnp.inf)


@pytest.mark.parametrize("pre_layer_norm,masking", [
    (False, "none"), (False, "key_padding"), (False, "causal"), (True, "none"), (True, "both"),
    (False, "additive_padding"), (True, "additive_bias"), (False, "mask_and_bias"), (True, "int_mask")])
def test_matches_plain_flax(pre_layer_norm, masking):
    """Values and gradients (the parameters', x's, and a bias's) against plain Flax, whose
    attention takes `mask` and `bias` as its own arguments."""
    causal = masking in ("causal", "both")
    layer, x, params = _setup(pre_layer_norm=pre_layer_norm, causal=causal)
    ref = reference_layer(layer)
    mask = _key_padding() if masking in ("key_padding", "both", "mask_and_bias") else None
    if masking == "int_mask":  # Flax's convention: nonzero attends
        mask = _key_padding().astype(jnp.int32) * 3
    bias = _additive(masking) if masking.startswith("additive") or masking == "mask_and_bias" else None

    def loss(module, p, x, bias):
        y = module.apply({"params": p}, x, mask, bias=bias)
        return jnp.sum(y * jnp.cos(y)), y

    # f32 products in f32 on a GPU backend too (XLA's default there rounds them to TF32).
    with jax.default_matmul_precision("highest"):
        grad = lambda module: jax.jit(jax.value_and_grad(  # noqa: E731
            lambda p, x, bias: loss(module, p, x, bias), (0, 1, 2), has_aux=True))
        (_, y), (gp, gx, gb) = grad(layer)(params, x, bias)
        flax_params = to_flax_params(params)
        (_, y_ref), (gp_ref, gx_ref, gb_ref) = grad(ref)(flax_params, x, bias)

    if masking == "mask_and_bias":
        assert_close(gb, gb_ref, reduction=S * E * F, grad=True, what="dbias")
    # The layer chains reductions over E, S and F; its error grows with all of them.
    assert_close(y, y_ref, reduction=E * F, what="output")
    assert_close(gx, gx_ref, reduction=S * E * F, grad=True, what="dx")
    got = to_flax_params(gp)
    for path, want in jax.tree_util.tree_leaves_with_path(gp_ref):
        have = got
        for k in path:
            have = have[k.key]
        assert_close(have, want, reduction=B * S * E * F, grad=True, what=jax.tree_util.keystr(path))


def test_mask_must_say_boolean_or_additive():
    """Found by probing: nn.make_attention_mask's float 0/1 mask (Flax reads it as boolean)
    was taken as additive, +1 / 0 on the scores: padded keys were not hidden. A floating
    mask now raises; a boolean or integer one is Flax's mask, an additive one goes in
    `bias`, for the layer, the stack, the plain-Flax twin and the nnx module."""
    import flax.linen as nn
    from flax import nnx

    from jaxsub.flax import nnx as jnnx

    layer, x, params = _setup(seed=11)
    valid = _key_padding()
    flax_mask = nn.make_attention_mask(valid, valid)  # float32 0/1, [B, 1, S, S]
    assert flax_mask.dtype == jnp.float32
    want = layer.apply({"params": params}, x, flax_mask.astype(bool))
    enc = Encoder(num_layers=2, num_heads=H, mlp_dim=F, layouts="none")
    nnx_layer = jnnx.EncoderLayer(E, num_heads=H, mlp_dim=F, rngs=nnx.Rngs(0))
    for call in (lambda m: layer.apply({"params": params}, x, m),
                 lambda m: reference_layer(layer).apply({"params": to_flax_params(params)}, x, m),
                 lambda m: enc.init(jax.random.key(0), x, m), lambda m: nnx_layer(x, m)):
        with pytest.raises(TypeError, match=r"jaxsub.flax.\w+: `mask` is float32; it must be boolean"):
            call(flax_mask)
    with pytest.raises(TypeError, match="jaxsub.flax.EncoderLayer: `bias` .* must be floating, got bool"):
        layer.apply({"params": params}, x, bias=valid)
    assert_close(layer.apply({"params": params}, x, flax_mask.astype(jnp.int8)), want, what="int8 mask")
    # The hidden keys stay hidden under a bias too, and the stack passes both to each layer.
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((H, S, S)), jnp.float32)
    both = layer.apply({"params": params}, x, valid, bias=bias)
    assert_close(both, layer.apply({"params": params}, x, bias=jnp.where(valid[:, None, None], bias, -jnp.inf)),
                 what="mask and bias")
    p2 = enc.init(jax.random.key(0), x)["params"]
    assert_close(enc.apply({"params": p2}, x, valid, bias=bias),
                 enc.apply({"params": p2}, x, bias=jnp.where(valid[:, None, None], bias, -jnp.inf)),
                 what="stack, mask and bias")


def test_two_d_masks_and_bad_biases():
    """Found by probing: a [B, S] additive bias raised from attention_packed at B == S; a
    bias of a bad shape was reported as attention_packed's `mask`; the plain-Flax twin read
    every 2-D mask as key padding. Now a 2-D [B, S] mask or bias is key padding (also at
    B == S, the common case of a padding mask; an [S, S] one goes in as [None, None]), any
    other 2-D one [S, S], as Flax reads it; errors name the module and the argument; both
    layers agree."""
    layer, x, params = _setup(seed=13)
    ref = reference_layer(layer)
    rp = to_flax_params(params)
    tril = jnp.tril(jnp.ones((S, S), bool))
    for mask in (tril, _key_padding()):
        got = layer.apply({"params": params}, x, mask)
        assert_close(got, ref.apply({"params": rp}, x, mask), reduction=E * F, what=f"2-D mask {mask.shape}")
    assert_close(layer.apply({"params": params}, x, tril), layer.apply({"params": params}, x, tril[None, None]),
                 what="[S, S] as [1, 1, S, S]")
    # B == S: [B, S] is key padding, for the mask and for an additive bias.
    square = jnp.asarray(np.random.default_rng(14).standard_normal((S, S, E)), jnp.float32)
    valid = jnp.arange(S)[None, :] < (jnp.arange(S)[:, None] % 5 + 3)
    want = layer.apply({"params": params}, square, valid[:, None, None, :])
    assert_close(layer.apply({"params": params}, square, valid), want, what="B == S key padding")
    assert_close(layer.apply({"params": params}, square, bias=jnp.where(valid, 0.0, -1e4)), want,
                 what="B == S additive key padding")
    assert_close(ref.apply({"params": rp}, square, valid), want, reduction=E * F, what="B == S plain Flax")
    # The layout key of a [B, S] padding mask is what `python -m jaxsub tune --padding-mask` writes.
    from jaxsub.flax import encoder as encoder_module
    made = encoder_module._attention_mask("EncoderLayer", x, H, _key_padding(), None)
    assert made.shape == (B, 1, 1, S) and layer._spec(x, made).mask_shape == (B, S)
    for bad in (jnp.zeros((3, S, S)), jnp.zeros((1, 1, 1, S, S))):
        with pytest.raises(ValueError, match=r"jaxsub.flax.EncoderLayer: `bias` .*(does not broadcast|has rank 5)"):
            layer.apply({"params": params}, x, bias=bad)


def test_param_conversion_round_trips():
    layer, x, params = _setup()
    back = from_flax_params(to_flax_params({"params": params}))["params"]
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref_params = jax.eval_shape(reference_layer(layer).init, jax.random.key(3), x)["params"]
    assert jax.tree.map(jnp.shape, to_flax_params(params)) == jax.tree.map(jnp.shape, ref_params)


def test_encoder_stack_fields_are_checked():
    """`scan_unroll` 0 raised as jaxsub.stack.scan's `unroll`, a negative `num_layers` as an
    MLIR error (probe round 10); now ValueErrors naming the Encoder's field."""
    for field in ({"scan_unroll": 0}, {"num_layers": -1}, {"scan_unroll": True}):
        fields = {"num_layers": 2, **field}
        with pytest.raises(ValueError, match=f"Encoder: `{next(iter(field))}` must be an int >="):
            Encoder(num_heads=4, mlp_dim=F, **fields).init(jax.random.key(0), jnp.ones((1, 3, E)))


def test_param_conversion_of_a_scanned_stack_and_bad_trees():
    """A scanned Encoder's stacked layer tree converts layer by layer (leading axes pass
    through; the kernel's hidden axis was sliced as q/k/v before, with no error), and trees
    that are no layer's raise naming the function and what is wrong (bare KeyErrors, or
    extra subtrees dropped silently, before; probe round 10)."""
    enc = Encoder(num_layers=3, num_heads=4, mlp_dim=F)
    stacked = enc.init(jax.random.key(0), jnp.ones((1, 3, E)))["params"]["layers"]["layer"]
    flax_tree = to_flax_params(stacked)
    per_layer = jax.vmap(to_flax_params)(stacked)
    assert jax.tree.map(jnp.shape, flax_tree) == jax.tree.map(jnp.shape, per_layer)
    for a, b in zip(jax.tree.leaves(flax_tree), jax.tree.leaves(per_layer)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(from_flax_params(flax_tree)), jax.tree.leaves(stacked)):
        np.testing.assert_array_equal(a, b)
    layer, _, params = _setup()
    flat = {**params, "qkv": {"kernel": params["qkv"]["kernel"].reshape(E, -1), "bias": params["qkv"]["bias"]}}
    for bad, message in (({**params, "pooler": {}}, "subtrees qkv, out"), (enc.init(jax.random.key(0), jnp.ones(
            (1, 3, E)))["params"], "got \\['layers'\\]"), (to_flax_params(params), "got \\['attention'"),
            (flat, "`params\\['qkv'\\]\\['kernel'\\]` must have rank >= 4 with 3 at axis -3")):
        with pytest.raises(ValueError, match=f"to_flax_params: .*{message}"):
            to_flax_params(bad)
    with pytest.raises(ValueError, match="from_flax_params: `params` must be one layer's"):
        from_flax_params(params)


def test_key_padding_hides_padded_tokens():
    layer, x, params = _setup(seed=5)
    mask = _key_padding()
    y = layer.apply({"params": params}, x, mask)
    x2 = x.at[1, 7:].set(100.0)
    y2 = layer.apply({"params": params}, x2, mask)
    np.testing.assert_allclose(np.asarray(y2[:, :7]), np.asarray(y[:, :7]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(y2[1, 7:]), np.asarray(y[1, 7:]))


def test_causal_ignores_future_tokens():
    layer, x, params = _setup(seed=7, causal=True, pre_layer_norm=True)
    y = layer.apply({"params": params}, x)
    y2 = layer.apply({"params": params}, x.at[:, 5:].add(3.0))
    np.testing.assert_allclose(np.asarray(y2[:, :5]), np.asarray(y[:, :5]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(y2[:, 5:]), np.asarray(y[:, 5:]))


@pytest.mark.parametrize("pre_layer_norm", [False, True], ids=["post_ln", "pre_ln"])
def test_dropout_uses_the_rng(pre_layer_norm):
    layer, x, params = _setup(seed=9, pre_layer_norm=pre_layer_norm)

    @jax.jit
    def run(key):
        return layer.apply({"params": params}, x, None, False, rngs={"dropout": key})

    a, a2, b = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    assert not np.allclose(np.asarray(a), np.asarray(b))
    off = layer.apply({"params": params}, x)
    assert not np.allclose(np.asarray(a), np.asarray(off))
    grads = jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x, None, False,
                                                   rngs={"dropout": jax.random.key(1)}) ** 2))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("stack", [False, True], ids=["layer", "scanned_stack"])
@pytest.mark.parametrize("layouts", ["none", "heuristic"])
def test_broadcast_dropout_shares_the_attention_mask(layouts, stack):
    """broadcast_dropout=True (Flax attention's default): one attention keep mask for every
    batch element, so identical batch elements stay identical, forward and backward, where
    per-element masks make them differ; the fused attention's custom calls are told so
    (their `dropout_bcast` attribute). Only the attention dropout is on."""
    x = jnp.tile(jnp.asarray(np.random.default_rng(3).standard_normal((1, S, E)), jnp.float32), (3, 1, 1))
    fields = dict(num_heads=H, mlp_dim=F, dropout_rate=0.0, attention_dropout_rate=0.5, layouts=layouts)
    outs = {}
    for bcast in (True, False):
        module = (Encoder(num_layers=2, broadcast_dropout=bcast, **fields) if stack
                  else EncoderLayer(broadcast_dropout=bcast, **fields))
        params = module.init(jax.random.key(1), x)["params"]

        def loss(p, x):
            y = module.apply({"params": p}, x, None, False, rngs={"dropout": jax.random.key(7)})
            return jnp.sum(jnp.sin(y)), y

        step = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True))
        text = step.lower(params, x).as_text()
        calls = [line for line in text.split("\n") if "custom_call @jaxsub_attention" in line]
        assert all(f"dropout_bcast = {str(bcast).lower()}" in line for line in calls), calls[:1]
        assert bool(calls) == (layouts != "none")  # "none": the unfused attention, its dropout in XLA
        (_, y), dx = step(params, x)
        outs[bcast] = (np.asarray(y), np.asarray(dx))
    for a in outs[True]:
        np.testing.assert_array_equal(a[1:], np.broadcast_to(a[:1], a[1:].shape))
    for a in outs[False]:
        assert not np.allclose(a[1], a[0])


def test_broadcast_dropout_must_be_a_bool():
    layer = EncoderLayer(num_heads=H, mlp_dim=F, broadcast_dropout="yes")
    with pytest.raises(TypeError, match="EncoderLayer: `broadcast_dropout` must be a Python bool"):
        layer.init(jax.random.key(0), jnp.zeros((B, S, E)))


@pytest.mark.parametrize("pre_layer_norm", [False, True], ids=["post_ln", "pre_ln"])
def test_no_dropout_mask_is_kept_for_the_backward(pre_layer_norm):
    """Every dropout of the layer draws its mask again in the backward: nothing of the
    activations' shape is kept as a boolean (the pre-LN residuals were an XLA select on a
    mask before)."""
    from test_dropout import saved_residuals

    layer, x, params = _setup(seed=13, pre_layer_norm=pre_layer_norm)

    def loss(p, x):
        return jnp.sum(layer.apply({"params": p}, x, None, False, rngs={"dropout": jax.random.key(1)}) ** 2)

    kept = [line for line in saved_residuals(loss, params, x).splitlines() if line.startswith("bool[")]
    assert not [line for line in kept if line.startswith(f"bool[{B},{S},")], kept


def test_bf16_smoke():
    layer, x, params = _setup(seed=11, dtype=jnp.bfloat16)
    y = jax.jit(lambda p, x: layer.apply({"params": p}, x, _key_padding()))(params, x)
    assert y.dtype == jnp.bfloat16
    y32 = jax.jit(EncoderLayer(num_heads=H, mlp_dim=F).apply)({"params": params}, x, _key_padding())
    # bf16 rounds every matmul input, so allow a few bf16 ulps per reduction step.
    assert_close(y, y32, dtype=jnp.bfloat16, reduction=E * F, what="bf16 output")
    g = jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x).astype(jnp.float32)))(params)
    assert all(np.isfinite(np.asarray(l, np.float32)).all() for l in jax.tree.leaves(g))


LAYERS = 2


def _encoder(**kw):
    return Encoder(num_layers=LAYERS, num_heads=H, mlp_dim=F, **kw)


def _stacked_to_layers(params, n):
    """Scanned Encoder parameters -> the unscanned Encoder's (layers_i)."""
    out = {f"layers_{i}": jax.tree.map(lambda a: a[i], params["layers"]) for i in range(n)}
    out.update({k: v for k, v in params.items() if k != "layers"})
    return out


@pytest.mark.parametrize("pre_layer_norm,configs", [
    (False, [(False, False), (True, False), (True, True)]),
    (True, [(False, True), (True, False)]),
], ids=["post_ln", "pre_ln"])
def test_encoder_scan_remat_match_unrolled(pre_layer_norm, configs):
    """Scanned and unrolled stacks, with and without remat, give the same loss and
    gradients for the same per-layer parameters (the first config is the reference)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, S, E)), jnp.float32)
    mask = _key_padding()
    scanned = _encoder(pre_layer_norm=pre_layer_norm)
    params = _perturb(jax.jit(scanned.init)(jax.random.key(1), x)["params"], 2)
    assert params["layers"]["layer"]["qkv"]["kernel"].shape == (LAYERS, E, 3, H, E // H)
    assert ("final_norm" in params) == pre_layer_norm
    unrolled_params = _stacked_to_layers(params, LAYERS)

    def loss(module, p):
        return jnp.sum(jnp.sin(module.apply({"params": p}, x, mask)))

    results = []
    for scan, remat in configs:
        module = _encoder(pre_layer_norm=pre_layer_norm, scan_layers=scan, remat=remat)
        value, grads = jax.jit(jax.value_and_grad(lambda p: loss(module, p)))(params if scan else unrolled_params)
        assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
        # The first layer's gradients flow back through every later layer.
        results.append((value, jax.tree.map(lambda a: a[0], grads["layers"]) if scan else grads["layers_0"]))
    ref_value, ref_grads = results[0]
    for (scan, remat), (value, grads) in zip(configs[1:], results[1:]):
        assert_close(value, ref_value, reduction=B * S * E * F, what=f"loss scan={scan} remat={remat}")
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            assert_close(a, b, reduction=B * S * E * F, grad=True, what=f"grads scan={scan} remat={remat}")


def test_encoder_dropout_uses_the_rng():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, S, E)), jnp.float32)
    module = _encoder(remat=True)
    params = module.init(jax.random.key(1), x)["params"]

    def run(key):
        return module.apply({"params": params}, x, None, False, rngs={"dropout": key})

    a, a2, b = run(jax.random.key(3)), run(jax.random.key(3)), run(jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    assert not np.allclose(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(a)).all()


@pytest.mark.parametrize("rates,unroll", [((0.2, 0.3), 1), ((0.2, 0.0), 1), ((0.0, 0.3), 1), ((0.2, 0.3), 2)])
def test_scanned_encoder_draws_each_layers_dropout_keys_as_the_layer_would(rates, unroll):
    """The scanned Encoder draws every layer's dropout keys before its loop
    (EncoderLayer.dropout_keys on the layer's key split from the 'dropout' stream) and
    passes them in, as one row of seed words per layer: layer i drops what EncoderLayer
    drops when applied alone with that key, forward and backward, whichever dropouts are
    on; also with two layers per iteration of the stack's loops (scan_unroll)."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((B, S, E)), jnp.float32)
    rate, attention_rate = rates
    module = _encoder(dropout_rate=rate, attention_dropout_rate=attention_rate, scan_unroll=unroll)
    params = module.init(jax.random.key(1), x)["params"]
    key = jax.random.key(7)
    layer = EncoderLayer(num_heads=H, mlp_dim=F, dropout_rate=rate, attention_dropout_rate=attention_rate,
                         layouts="none")
    # the stream's first key, as the Encoder's first make_rng("dropout") draws it
    first = module.apply({"params": params}, rngs={"dropout": key}, method=lambda m: m.make_rng("dropout"))
    layer_keys = jax.random.split(first, LAYERS)

    def stacked(p, x):
        return jnp.sum(jnp.sin(module.apply({"params": p}, x, None, False, rngs={"dropout": key})))

    def alone(p, x):
        for i in range(LAYERS):
            pi = jax.tree.map(lambda a: a[i], p["layers"]["layer"])
            x = layer.apply({"params": pi}, x, None, False, rngs={"dropout": layer_keys[i]})
        return jnp.sum(jnp.sin(x))

    got = jax.jit(jax.value_and_grad(stacked, argnums=(0, 1)))(params, x)
    want = jax.jit(jax.value_and_grad(alone, argnums=(0, 1)))(params, x)
    assert_close(got[0], want[0], reduction=B * S * E * F, what="loss")
    assert_close(got[1][1], want[1][1], reduction=B * S * E * F, grad=True, what="dx")
    for a, b in zip(jax.tree.leaves(got[1][0]), jax.tree.leaves(want[1][0])):
        assert_close(a, b, reduction=B * S * E * F, grad=True, what="dparams")


def test_lazy_export_and_bad_hidden_size():
    assert jaxsub.flax.EncoderLayer is EncoderLayer
    with pytest.raises(ValueError, match="num_heads"):
        EncoderLayer(num_heads=5, mlp_dim=F).init(jax.random.key(0), jnp.ones((1, 3, E)))
    # Zero heads or feed-forward width: a ValueError naming the field (a ZeroDivisionError before).
    for heads, mlp in ((0, F), (4, 0)):
        with pytest.raises(ValueError, match="EncoderLayer: `(num_heads|mlp_dim)` must be a positive int"):
            EncoderLayer(num_heads=heads, mlp_dim=mlp).init(jax.random.key(0), jnp.ones((1, 3, E)))
    # A dtype the ops do not take: a TypeError naming the field (one naming jaxsub.bias_add before).
    for field in ({"dtype": jnp.int32}, {"param_dtype": jnp.int8}):
        with pytest.raises(TypeError, match=f"EncoderLayer: `{next(iter(field))}` must be float32"):
            EncoderLayer(num_heads=4, mlp_dim=F, **field).init(jax.random.key(0), jnp.ones((1, 3, E)))
    # A dropout rate out of range: named as the layer's field (LayerSpec's before; probe round five).
    for field in ({"dropout_rate": 1.0}, {"attention_dropout_rate": -0.1}, {"dropout_rate": "0.1"}):
        with pytest.raises(ValueError, match=f"EncoderLayer: `{next(iter(field))}` must be a float in"):
            EncoderLayer(num_heads=4, mlp_dim=F, **field).init(jax.random.key(0), jnp.ones((1, 3, E)))
    # An array rate: said to be no Python number (probe round 8: the message read as a range error).
    with pytest.raises(ValueError, match="of type ArrayImpl \\(a Python number\\)"):
        EncoderLayer(num_heads=4, mlp_dim=F, dropout_rate=jnp.asarray(0.2)).init(jax.random.key(0), jnp.ones((1, 3, E)))
    none = EncoderLayer(num_heads=4, mlp_dim=F, dtype=None)  # Flax's "from the inputs" (and the parameters)
    x = jnp.ones((1, 3, E), jnp.float32)
    assert none.apply(none.init(jax.random.key(0), x), x).dtype == jnp.float32


@pytest.mark.parametrize("stack", [None, "scan", "unrolled"])
def test_dtype_none_computes_in_the_promoted_dtype(stack):
    """dtype=None is Flax's "from the inputs and the parameters": a bfloat16 input with
    float32 parameters computes in float32, as the plain Flax layer does (the fused ops
    were handed a bfloat16 residual with float32 activations and raised; probe round 8)."""
    fields = dict(num_heads=4, mlp_dim=F, dtype=None, layouts="none")
    module = EncoderLayer(**fields) if stack is None else Encoder(num_layers=2, scan_layers=stack == "scan", **fields)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, E)), jnp.bfloat16)
    params = module.init(jax.random.key(0), x.astype(jnp.float32))
    got = module.apply(params, x)
    assert got.dtype == jnp.float32
    assert_close(got, module.apply(params, x.astype(jnp.float32)), reduction=E * F)
    if stack is None:
        twin = reference_layer(module).apply({"params": to_flax_params(params["params"])}, x)
        assert twin.dtype == jnp.float32
        assert_close(got, twin, reduction=E * F)


@pytest.mark.parametrize("shape", [(0, 5, E), (2, 0, E)])
def test_empty_batch_or_sequence_gives_an_empty_output(shape):
    """As plain Flax: an empty batch or sequence gives an empty output (and zero gradients),
    the parameters made as for any input; LayerSpec raised "batch must be a positive int"
    (probe round 8)."""
    layer = EncoderLayer(num_heads=4, mlp_dim=F, dropout_rate=0.1)
    x = jnp.zeros(shape)
    params = layer.init(jax.random.key(0), jnp.ones((2, 5, E)))
    assert jax.tree.map(jnp.shape, layer.init(jax.random.key(0), x)) == jax.tree.map(jnp.shape, params)
    twin = reference_layer(layer).apply({"params": to_flax_params(params["params"])}, x)
    for module, p in ((layer, params), (Encoder(num_layers=2, num_heads=4, mlp_dim=F), None)):
        p = module.init(jax.random.key(0), jnp.ones((2, 5, E))) if p is None else p
        run = lambda p: module.apply(p, x, None, False, rngs={"dropout": jax.random.key(1)})  # noqa: E731
        assert run(p).shape == twin.shape == shape
        assert all((g == 0).all() for g in jax.tree.leaves(jax.grad(lambda p: run(p).sum())(p)))


def _scanned_train_step(dtype, hidden, heads, seq, layouts="none"):
    """A training step of the scanned Encoder with dropout, its arguments, for HLO checks."""
    module = Encoder(num_layers=3, num_heads=heads, mlp_dim=2 * hidden, dtype=dtype, dropout_rate=0.1,
                     attention_dropout_rate=0.1, layouts=layouts)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, seq, hidden)), dtype)
    params = module.init(jax.random.key(1), x)["params"]

    def loss(p, x, key):
        y = module.apply({"params": p}, x, None, False, rngs={"dropout": key})
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x, jax.random.key(2))


def test_post_ln_backward_has_one_add_of_token_gradients():
    """Post-LN: the attention block's output h feeds the feed-forward matmul and the second
    residual as two outputs of the fused op (ops.norm.bdrln_pair), so the only [B, S, E]
    add (forward or backward) is the one summing the input's two gradients (residual and
    q/k/v projection)."""
    layer, x, params = _setup(seed=11)
    w = jnp.asarray(np.random.default_rng(12).standard_normal(x.shape), jnp.float32)

    def loss(p, x):  # linear in y: its cotangent is w, no add of its own
        y = layer.apply({"params": p}, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
        return jnp.sum(y * w)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()
    shape = f"{B}x{S}x{E}xf32"
    grad_adds = [line for line in text.splitlines() if "stablehlo.add" in line and shape in line]
    assert len(grad_adds) == 1, grad_adds


@pytest.mark.parametrize("scan", [False, True])
def test_post_ln_library_products_add_the_input_gradient_in_the_dx_product(scan, monkeypatch):
    """With library_products (bf16), the q/k/v projection hands the layer input on to the
    first residual (ops.gemm.dense_and_input, or ops.dense_attention_packed(with_input=True)
    where the projection and the attention run as one op), so the residual's gradient is
    added into dx by the dx product's c operand: no [B, S, E] add of gradients at all. In
    the scanned stack the input is still read from its carry stack: the step stores the
    same residuals as with the input passed to the residual directly."""
    import jaxsub.flax.encoder as flax_encoder
    from jaxsub import ops, stack
    from jaxsub.ops import gemm as gemm_mod
    from optimize_helpers import gemm_c_types

    x = jnp.asarray(np.random.default_rng(19).standard_normal((B, S, E)), jnp.bfloat16)
    kw = dict(num_heads=H, mlp_dim=F, dropout_rate=0.1, layouts="heuristic", dtype=jnp.bfloat16,
              param_dtype=jnp.bfloat16)
    module = Encoder(num_layers=2, **kw) if scan else EncoderLayer(**kw, library_products=True)
    monkeypatch.setattr(flax_encoder, "_library", lambda _: True)
    params = module.init(jax.random.key(20), x)["params"]
    plans, plan = [], stack._plan
    monkeypatch.setattr(stack, "_plan", lambda *a: plans.append(plan(*a)) or plans[-1])

    def lowered():
        def loss(p, x):
            y = module.apply({"params": p}, x, None, False, rngs={"dropout": jax.random.key(21)})
            return jnp.sum(jnp.sin(y.astype(jnp.float32)))
        return jax.jit(jax.grad(loss, (0, 1))).lower(params, x).as_text()

    text = lowered()
    assert not [line for line in text.splitlines() if "stablehlo.add" in line and f"{B}x{S}x{E}xbf16" in line]
    assert f"tensor<{B * S}x{E}xbf16>" in gemm_c_types(text)
    if scan:
        passing = plans[-1]
        monkeypatch.setattr(gemm_mod, "dense_and_input", lambda a, k, b=None, axes=1: (
            gemm_mod.dense(a, k, b, axes=axes), a))
        fused = ops.dense_attention_packed

        def apart(a, k, b, *, with_input=False, **kw):  # the input passed on directly
            out = fused(a, k, b, **kw)
            return (out, a) if with_input else out

        monkeypatch.setattr(ops, "dense_attention_packed", apart)
        assert f"tensor<{B * S}x{E}xbf16>" not in gemm_c_types(lowered())
        assert plans[-1] is not passing
        assert passing.stored == plans[-1].stored and passing.sources == plans[-1].sources


def _forward_targets(text: str, pattern: str) -> dict:
    import collections
    import re

    return collections.Counter(m for m in re.findall(pattern, text) if m.endswith("_fwd"))


def test_every_custom_call_result_passes_an_optimization_barrier(monkeypatch):
    """jaxsub._ffi.call puts each custom call's results behind an optimization barrier, so
    that XLA's GPU dynamic-slice fusion cannot run a forward kernel a second time to write
    a scan residual in place (see the GPU test below, and the comment in _ffi.call). The
    exceptions: the gemm target's gradients, and the calls whose results jaxsub.stack
    writes into a stack itself, the only user of the result then (stack._early)."""
    from jaxsub import stack

    passed, early = [], stack._early
    monkeypatch.setattr(stack, "_early", lambda *a: passed.append(early(*a)[1]) or early(*a))
    step, args = _scanned_train_step(jnp.float32, E, H, S)
    text = step.lower(*args).as_text()
    calls = text.count("stablehlo.custom_call @jaxsub_")
    # The gemm target's two gradient products per forward product are left unbarriered,
    # for XLA to write them straight into the gradient stacks (ops.dense).
    gemms = text.count("stablehlo.custom_call @jaxsub_gemm")
    # The gemm target runs a scanned stack's bf16/f16 projections on GPU: forward, dx, dkernel.
    assert calls >= 4 and gemms % 3 == 0
    through = sum(map(len, passed))
    assert len(passed) == 2 and through > 0  # the forward and the backward step
    assert text.count("stablehlo.optimization_barrier") == calls - 2 * gemms // 3 - through


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs CUDA kernels and a GPU")
def test_scanned_encoder_copies_seeds_once_per_layer_and_direction():
    """The compiled scanned stack copies small uint32 slices (the dropout seeds) at most
    three times per layer: the row's quarters forward and backward (and, before
    stack.scan made them again from xs, the quarters kept for the backward: three on the
    H200); with one 8-byte table per key XLA copied each op's seed out of it, eight copies
    per layer (bench/NOTES.md, twenty-third session)."""
    import re

    step, args = _scanned_train_step(jnp.bfloat16, 128, 2, 128, "heuristic")
    text = step.lower(*args).compile().as_text()
    copies = [line for line in text.split("\n") if re.search(r"\b(fusion|fusion-start)\(", line)
              and "kind=kLoop" in line and re.search(r"u32\[\d+,\d+\]", line)]
    assert 1 <= len(copies) <= 3, "\n".join(c.strip()[:160] for c in copies)


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs CUDA kernels and a GPU")
def test_scanned_encoder_runs_each_forward_kernel_once():
    """In the compiled scanned stack, each forward custom call appears as often as in the
    traced program: XLA did not clone a forward kernel into a dynamic-slice fusion that
    writes the stacked residual (which ran attention, GELU and BDRLN forward twice per
    layer before the barrier)."""
    for layouts in ("none", "heuristic"):  # unfused and fused attention at D = 64
        step, args = _scanned_train_step(jnp.bfloat16, 128, 2, 128, layouts)
        lowered = step.lower(*args)
        traced = _forward_targets(lowered.as_text(), r"stablehlo.custom_call @(jaxsub_\w+)")
        compiled = _forward_targets(lowered.compile().as_text(), r'custom_call_target="(jaxsub_\w+)"')
        gelu = "jaxsub_dense_gelu_fwd" if _ffi.dense_gelu_enabled() else "jaxsub_bias_gelu_dropout_fwd"
        assert {"jaxsub_bdrln_fwd", gelu} <= set(traced), traced
        assert compiled == traced, layouts


def test_layer_passes_each_op_a_quarter_of_one_seed_row(monkeypatch):
    """One layer's four dropout keys become one row of seed words (one kernel on a GPU,
    not one per key), each op given its 16-byte quarter: the same seeds, the same numbers
    as each op given its own key."""
    from jaxsub.ops import dropout as _dropout

    layer, x, params = _setup(seed=9)

    def loss(p, x):
        return jnp.sum(layer.apply({"params": p}, x, None, False, rngs={"dropout": jax.random.key(1)}) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    text = step.lower(params, x).as_text()
    calls = [line for line in text.split("\n") if "stablehlo.custom_call @jaxsub_" in line and "_fwd(" in line]
    seeded = [line.rsplit(" : (", 1)[1].split(") ->")[0].split(", ")[-1] for line in calls
              if "threshold" in line]
    assert len(seeded) == 4 and set(seeded) == {"tensor<4xui32>"}, seeded
    assert text.count("-> tensor<16xui32>") == 1
    got = step(params, x)
    monkeypatch.setattr(_dropout, "shared_seeds", lambda op, keys: list(keys))
    apart = jax.jit(jax.value_and_grad(loss))
    assert "tensor<16xui32>" not in apart.lower(params, x).as_text()
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(apart(params, x))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


def test_scanned_encoder_passes_each_op_sixteen_bytes_of_seed():
    """Each op with dropout in the scanned stack takes four seed words (a 16-byte slice of
    its layer's row), never two, so XLA reads one row per layer rather than one
    8-byte slice per op (cuda/ABI.md, dropout)."""
    import re

    step, args = _scanned_train_step(jnp.float32, 32, 2, 16, "heuristic")
    text = step.lower(*args).as_text()
    targets = ("attention", "bdrln", "bias_gelu_dropout")
    calls = [line for line in text.split("\n") if re.search(r"stablehlo.custom_call @jaxsub_(%s)" % "|".join(targets), line)]
    assert {t for t in targets for line in calls if f"@jaxsub_{t}" in line} == set(targets)
    for line in calls:
        operand_types = line.rsplit(" : (", 1)[1].split(") ->")[0]
        assert "tensor<4xui32>" in operand_types and "tensor<2xui32>" not in operand_types, line[-300:]
    assert "tensor<3x16xui32>" in text  # the seed table: a row per layer


def test_scanned_encoder_names_missing_stacked_parameters():
    x = jnp.ones((1, S, E), jnp.float32)
    params = _encoder().init(jax.random.key(0), x)["params"]
    with pytest.raises(ValueError, match=r"Encoder.*params\['layers'\]\['layer'\]"):
        _encoder().apply({"params": {k: v for k, v in params.items() if k != "layers"}}, x)


@pytest.mark.parametrize("layouts", ["heuristic", "none"])
def test_recompute_gelu_same_numbers_gelu_output_not_kept(layouts):
    """recompute_gelu runs the GELU and the feed-forward output product as
    ops.bias_gelu_dropout_dense: same loss and gradients (same dropout masks), and the
    GELU backward target is asked to write the GELU output again."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((B, S, E)), jnp.float32)
    params = None
    results, texts = [], []
    for recompute in (False, True):
        layer = EncoderLayer(num_heads=H, mlp_dim=F, dropout_rate=0.1, layouts=layouts, recompute_gelu=recompute)
        params = params or _perturb(layer.init(jax.random.key(6), x)["params"], 7)

        def loss(p):
            y = layer.apply({"params": p}, x, deterministic=False, rngs={"dropout": jax.random.key(8)})
            return jnp.sum(jnp.sin(y))

        step = jax.jit(jax.value_and_grad(loss))
        results.append(step(params))
        texts.append(step.lower(params).as_text())
    (v0, g0), (v1, g1) = results
    assert_close(v1, v0, reduction=B * S * E * F, what="loss")
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, reduction=B * S * E * F, grad=True, what="grads")
    shape = f"tensor<{B}x{S}x{F}xf32>"
    bwd = [[ln for ln in t.splitlines() if "@jaxsub_bias_gelu_dropout_bwd" in ln] for t in texts]
    assert len(bwd[0]) == len(bwd[1]) == 1
    assert bwd[0][0].rstrip().endswith("tensor<0xf32>)") and bwd[1][0].rstrip().endswith(f"{shape})")


@pytest.mark.parametrize("recompute_gelu", [False, True])
@pytest.mark.parametrize("layouts", ["heuristic", "none"])
def test_library_products_same_numbers(layouts, recompute_gelu):
    """library_products runs the row-major bf16 projections (and, with recompute_gelu, the
    GELU/product op's products) through the gemm target: same loss and gradients, and
    the target is called for the forward product and both gradient products of each."""
    x = jnp.asarray(np.random.default_rng(15).standard_normal((B, S, E)), jnp.bfloat16)
    params = None
    results, texts = [], []
    for library in (False, True):
        layer = EncoderLayer(num_heads=H, mlp_dim=F, dropout_rate=0.1, layouts=layouts, dtype=jnp.bfloat16,
                             param_dtype=jnp.bfloat16, recompute_gelu=recompute_gelu, library_products=library)
        params = params or _perturb(layer.init(jax.random.key(16), x)["params"], 17)

        def loss(p, x):
            y = layer.apply({"params": p}, x, deterministic=False, rngs={"dropout": jax.random.key(18)})
            return jnp.sum(jnp.sin(y))

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        results.append(step(params, x))
        texts.append(step.lower(params, x).as_text())
    (v0, g0), (v1, g1) = results
    assert_close(v1, v0, jnp.bfloat16, reduction=B * S * E * F, what="loss")
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, jnp.bfloat16, reduction=B * S * E * F, grad=True, what="grads")
    assert "@jaxsub_gemm" not in texts[0] and "@jaxsub_dense_gelu_fwd" not in texts[0]
    # The feed-forward input product runs with the GELU in ops.dense_bias_gelu_dropout's
    # target (on CPU; on a GPU only with JAXSUB_DENSE_GELU=1, else as the gemm target and
    # the GELU op), its gradient products through the gemm target.
    fused = jax.default_backend() == "cpu" or _ffi.dense_gelu_enabled()
    assert texts[1].count("stablehlo.custom_call @jaxsub_dense_gelu_fwd") == int(fused)
    assert ("@jaxsub_bias_gelu_dropout_fwd" in texts[1]) == (not fused)
    assert texts[1].count("stablehlo.custom_call @jaxsub_gemm") == (11 if fused else 12)
