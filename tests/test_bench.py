"""The op benchmark's --small path end to end on CPU: rows, JSON, positive times."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxsub.ops.gelu as gelu_module
import jaxsub.ops.norm as norm_module
from jaxsub.ops.dropout import apply_reference

# `bench` is not part of the installed package; appended (not prepended) so an installed
# jaxsub still wins over the source tree when tests run from tests/.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
from bench import ops as bench_ops  # noqa: E402


def _layer_norm(h, scale, bias, eps):
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)


def _standin_layer_norm(x, scale, bias, *, eps):
    return _layer_norm(x.astype(jnp.float32), scale, bias, eps).astype(x.dtype)


def _standin_bdrln(x, bias, residual, scale, ln_bias, *, keep, rate, eps):
    dropped = apply_reference(x.astype(jnp.float32) + bias.astype(jnp.float32), keep, rate)
    return _layer_norm(residual.astype(jnp.float32) + dropped, scale, ln_bias, eps).astype(x.dtype)


def _standin_bias_gelu_dropout(x, bias, *, keep, rate, approximate):
    v = x.astype(jnp.float32) + bias.astype(jnp.float32)
    return apply_reference(jax.nn.gelu(v, approximate=approximate), keep, rate).astype(x.dtype)


@pytest.fixture
def references(monkeypatch):
    """The op modules' references where they exist; the harness's XLA column needs them,
    so a worktree whose op modules are still stubs gets pure-JAX stand-ins."""
    for module, name, standin in (
        (norm_module, "reference_layer_norm", _standin_layer_norm),
        (norm_module, "reference_bdrln", _standin_bdrln),
        (gelu_module, "reference_bias_gelu_dropout", _standin_bias_gelu_dropout),
    ):
        if not hasattr(module, name):
            monkeypatch.setattr(module, name, standin, raising=False)


def test_small_run_writes_every_row_with_positive_times(tmp_path, references):
    out = tmp_path / "ops.json"
    # One dtype keeps the CPU run short (compilation dominates); both share every code path.
    assert bench_ops.main(["--small", "--dtypes", "bf16", "--repeats", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())

    assert result["copy_bandwidth_bytes_per_s"] > 0
    expected = {(op, "bf16", p) for op in bench_ops.OPS for p in bench_ops.PASSES}
    rows = {(r["op"], r["dtype"], r["pass"]): r for r in result["rows"]}
    assert set(rows) == expected and len(result["rows"]) == len(expected)

    for key, row in rows.items():
        assert row["xla_status"] == "ok", key
        assert row["xla_us"] > 0 and math.isfinite(row["xla_us"]), key
        assert row["floor_bytes"] > 0 and row["floor_us"] > 0, key
        assert row["xla_over_floor"] == pytest.approx(row["xla_us"] / row["floor_us"]), key
    for op in bench_ops.OPS:
        assert rows[(op, "bf16", "fwd+bwd")]["floor_bytes"] > rows[(op, "bf16", "fwd")]["floor_bytes"]

    unimplemented = sorted({k[0] for k, r in rows.items() if r["jaxsub_status"].startswith("not implemented")})
    implemented = {k: r for k, r in rows.items() if k[0] not in unimplemented}
    for key, row in implemented.items():
        assert row["check"] == "ok", (key, row["check"])
        assert row["jaxsub_us"] > 0 and math.isfinite(row["jaxsub_us"]), key
        assert row["speedup"] == pytest.approx(row["xla_us"] / row["jaxsub_us"]), key
    if unimplemented:
        pytest.xfail(f"jaxsub ops raise NotImplementedError in this worktree: {', '.join(unimplemented)}")


def test_floor_bytes_match_abi_traffic():
    """BERT-large bf16 floors equal the hand count of ABI.md traffic (TARGETS.md floors
    ignore the small parameter, statistic and seed terms)."""
    rows, act = 4096, 4096 * 1024 * 2
    stats, params = 2 * rows * 4, 1024 * 2
    ln = bench_ops.OPS["layer_norm"]
    assert ln.floor_bytes("fwd", rows, 1024, jnp.bfloat16, jnp.bfloat16) == 2 * act + 2 * params + stats
    assert ln.floor_bytes("fwd+bwd", rows, 1024, jnp.bfloat16, jnp.bfloat16) == (
        2 * act + 2 * params + stats + 3 * act + 3 * params + stats)
    gelu = bench_ops.OPS["bias_gelu_dropout"]
    big = 4096 * 4096 * 2
    assert gelu.floor_bytes("fwd+bwd", rows, 4096, jnp.float16, jnp.float32) == (
        2 * big + 4096 * 4 + 8 + 3 * big + 2 * 4096 * 4 + 8)


def test_trace_sums_device_kernels_per_call():
    from bench import trace

    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 50.0, "name": "PjitFunction(f)"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 4.0, "name": "norm_fwd_kernel"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 9, "dur": 6.0, "name": "norm_fwd_kernel"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 20, "dur": 3.0, "name": "loop_fusion"},
    ]
    assert trace.kernel_times_from_events(events, repeats=2) == {"norm_fwd_kernel": 5.0, "loop_fusion": 1.5}


def test_trace_finds_device_kernels_only_on_a_gpu():
    import jax.numpy as jnp

    from bench import trace

    times = trace.kernel_times(jax.jit(lambda x: jnp.tanh(x) * 2), (jnp.ones((64, 64)),), repeats=2)
    if jax.devices()[0].platform == "gpu":
        assert times and all(us > 0 for us in times.values())
    else:
        assert times == {}
