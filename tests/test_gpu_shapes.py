"""CUDA against CPU for every op family at odd and boundary row lengths (general path,
vector path, the largest rows, many rows per block), forward and all gradients, with
dropout. BERT-large sizes are covered in the per-family files; this sweep is what catches
launch-shape bugs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub.testing import assert_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs CUDA kernels and a GPU"),
]

SHAPES = [(3, 1), (5, 130), (7, 1000), (9, 1024), (3, 4096), (2, 6000), (2, 16383), (2, 16384), (1000, 64)]


def _loss(key):
    def f(x, scale, bias, res, b2):
        a = jaxsub.ops.layer_norm(x, scale, bias)
        b = jaxsub.ops.bias_dropout_residual_layer_norm(x, b2, res, scale, bias, rate=0.1, key=key)
        c = jaxsub.ops.bias_gelu_dropout(x, b2, rate=0.1, key=key)
        return (a.astype(jnp.float32).sum() + 0.5 * b.astype(jnp.float32).sum()
                + 0.1 * (c.astype(jnp.float32) ** 2).sum())

    return f


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("params_f32", [True, False])
def test_cuda_matches_cpu(shape, dtype, params_f32):
    rows, n = shape
    keys = jax.random.split(jax.random.key(rows * 7919 + n), 6)
    pdt = jnp.float32 if params_f32 else dtype
    x = jax.random.normal(keys[0], shape).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(keys[1], (n,))).astype(pdt)
    bias = (0.1 * jax.random.normal(keys[2], (n,))).astype(pdt)
    res = jax.random.normal(keys[3], shape).astype(dtype)
    b2 = (0.1 * jax.random.normal(keys[4], (n,))).astype(pdt)
    g = jax.jit(jax.value_and_grad(_loss(keys[5]), argnums=(0, 1, 2, 3, 4)))
    args = (x, scale, bias, res, b2)
    gpu = jax.block_until_ready(g(*args))
    cpu = g(*jax.device_put(args, jax.devices("cpu")[0]))
    for i, (a, b) in enumerate(zip(jax.tree.leaves(gpu), jax.tree.leaves(cpu))):
        assert np.isfinite(np.asarray(a, np.float32)).all(), f"output {i} not finite"
        assert_close(a, b, dtype, reduction=rows * n, grad=True, what=f"output {i}")
