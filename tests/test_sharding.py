"""The fused ops on several devices (four CPU devices in a subprocess, since the device
count is fixed when JAX starts): under `jit` with the batch sharded, values and gradients
equal the single-device ones (dropout indexed on the whole logical tensor); under
`shard_map` each device runs the op on its own shard, whose dropout is indexed on that
shard, as `jax.random` inside `shard_map` is."""

import os
import subprocess
import sys
import textwrap

import jaxsub

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jaxsub
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map

    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 12, 64)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((8, 12, 2, 32)), jnp.float32)
    scale, bias = jnp.linspace(0.5, 1.5, 64), jnp.linspace(-1.0, 1.0, 64)
    key = jax.random.key(1)
    ops = {
        "layer_norm": (x, lambda x: jaxsub.ops.layer_norm(x, scale, bias)),
        "bias_gelu_dropout": (x, lambda x: jaxsub.ops.bias_gelu_dropout(x, bias, rate=0.1, key=key)),
        "bdrln": (x, lambda x: jaxsub.ops.bias_dropout_residual_layer_norm(x, bias, x * 0.5, scale, bias,
                                                                           rate=0.1, key=key)),
        "attention": (q, lambda q: jaxsub.ops.attention(q, q, q, dropout_rate=0.1, key=key)),
    }
    worst = 0.0
    for name, (a, f) in ops.items():
        loss = lambda a: jnp.sum(f(a) ** 2)
        sharded = jax.device_put(a, NamedSharding(mesh, P("data")))
        for got, want in ((jax.jit(f)(sharded), f(a)), (jax.jit(jax.grad(loss))(sharded), jax.grad(loss)(a))):
            err = float(jnp.abs(got - want).max())
            assert err <= 1e-5 * (1.0 + float(jnp.abs(want).max())), (name, err)
            worst = max(worst, err)
        per_shard = shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        got = jax.jit(per_shard)(sharded)
        want = jnp.concatenate([f(s) for s in jnp.split(a, 4)])
        assert float(jnp.abs(got - want).max()) <= 1e-5 * (1.0 + float(jnp.abs(want).max())), name
    print("ok", worst)
""")


def test_ops_on_four_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    # The jaxsub this test imported (the installed one, or a development tree's).
    here = os.path.dirname(os.path.dirname(jaxsub.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
