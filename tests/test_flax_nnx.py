"""jaxsub.flax.nnx: the linen encoder modules through flax.nnx.bridge — same parameters,
same outputs and gradients as the linen module, dropout from the 'dropout' rng stream,
fused targets in the compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsub.flax import Encoder, EncoderLayer
from jaxsub.flax import nnx as jnnx
from jaxsub.testing import assert_close

FIELDS = dict(num_heads=4, mlp_dim=64, dropout_rate=0.1, attention_dropout_rate=0.1, layouts="none")


def _x(seed=3, shape=(2, 8, 32)):
    return jax.random.normal(jax.random.key(seed), shape)


def _params(module):
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))["module"]


def test_layer_matches_linen_with_the_same_parameters():
    layer = jnnx.EncoderLayer(32, rngs=nnx.Rngs(0, dropout=1), **FIELDS)
    x = _x()
    params = _params(layer)
    assert set(params) == {"qkv", "out", "attention_norm", "mlp_in", "mlp_out", "mlp_norm"}
    want = EncoderLayer(**FIELDS).apply({"params": params}, x)
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(want))

    def nnx_loss(m):
        return jnp.sum(m(x) ** 2)

    grads = nnx.to_pure_dict(nnx.grad(nnx_loss)(layer))["module"]
    want_grads = jax.grad(lambda p: jnp.sum(EncoderLayer(**FIELDS).apply({"params": p}, x) ** 2))(params)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        assert_close(g, w, jnp.float32, reduction=16, grad=True, what=jax.tree_util.keystr(path))


def test_dropout_draws_from_the_rngs_and_fuses():
    layer = jnnx.EncoderLayer(32, rngs=nnx.Rngs(0, dropout=1), **FIELDS)
    x = _x()
    a, b = layer(x, deterministic=False), layer(x, deterministic=False)
    assert not np.allclose(np.asarray(a), np.asarray(b))   # a fresh key per call
    assert not np.allclose(np.asarray(a), np.asarray(layer(x)))

    @nnx.jit
    def step(m, x):
        return nnx.grad(lambda m: jnp.sum(m(x, deterministic=False) ** 2))(m)

    hlo = step.lower(layer, x).as_text()
    for target in ("jaxsub_bdrln_fwd", "jaxsub_bdrln_bwd", "jaxsub_bias_gelu_dropout_bwd"):
        assert target in hlo


def test_encoder_stack_matches_linen():
    enc = jnnx.Encoder(32, num_layers=2, scan_layers=True, rngs=nnx.Rngs(0), **FIELDS)
    x = _x(5)
    want = Encoder(num_layers=2, scan_layers=True, **FIELDS).apply({"params": _params(enc)}, x)
    np.testing.assert_array_equal(np.asarray(enc(x)), np.asarray(want))


def test_train_and_eval_switch_dropout():
    """nnx's model.train() / model.eval() set the layer's `deterministic` (found by
    probing: they changed nothing, dropout only with deterministic=False at each call);
    an explicit deterministic= still wins."""
    layer = jnnx.EncoderLayer(32, rngs=nnx.Rngs(0, dropout=1), **FIELDS)
    x = _x()
    plain = layer(x)
    layer.train()
    assert not layer.deterministic
    dropped = layer(x)
    assert float(jnp.abs(dropped - plain).max()) > 1e-3
    assert_close(layer(x, deterministic=True), plain, what="explicit")
    layer.eval()
    assert_close(layer(x), plain, what="eval")


def test_eval_mode_runs_under_plain_jax_transforms():
    """Found by probing: in eval mode the layer failed under plain jax.jit / grad / vmap
    (Flax's TraceContextError: the bridge advanced the rng streams' counts, a mutation of
    the closed-over module), where an nnx.Dropout model in eval mode runs. Without dropout
    no stream is drawn from; with dropout (train mode) nnx's own transforms are needed."""
    layer = jnnx.EncoderLayer(32, rngs=nnx.Rngs(0, dropout=1), **FIELDS)
    x = _x()
    want = layer(x)
    counts = nnx.to_pure_dict(nnx.state(layer, nnx.RngCount))
    assert_close(jax.jit(lambda x: layer(x))(x), want, what="jit")
    assert_close(jax.vmap(lambda x: layer(x[None])[0])(x), want, what="vmap")
    assert jax.grad(lambda x: layer(x).sum())(x).shape == x.shape
    assert nnx.to_pure_dict(nnx.state(layer, nnx.RngCount)) == counts


def test_nnx_is_an_attribute_of_jaxsub_flax():
    """Found by probing: `jaxsub.flax.nnx.EncoderLayer`, the README's spelling, needed an
    explicit `import jaxsub.flax.nnx` first (checked in a fresh process)."""
    import os
    import pathlib
    import subprocess
    import sys

    import jaxsub

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(jaxsub.__file__).parents[1]))
    code = "import jaxsub; print(jaxsub.flax.nnx.EncoderLayer.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "EncoderLayer", out.stderr[-2000:]
