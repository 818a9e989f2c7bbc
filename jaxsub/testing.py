"""The one tolerance table and assert_close, shared by tests/ and bench/; the documented
shift of additive mask rows under the causal rule, in numpy, for references; and reading
the attributes of jaxsub's custom calls from lowered HLO."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

# Relative error of one rounded output, per dtype: about 4 ulps of the format.
_BASE = {
    jnp.dtype(jnp.float32): 2e-6,
    jnp.dtype(jnp.bfloat16): 1.6e-2,
    jnp.dtype(jnp.float16): 2e-3,
}
GRAD_FACTOR = 4.0


def tolerance(dtype, reduction: int = 1, grad: bool = False) -> float:
    """Allowed error (absolute and relative) for outputs of `dtype` that depend on a
    reduction over `reduction` elements; gradients get GRAD_FACTOR more."""
    if jnp.dtype(dtype) not in _BASE:
        raise ValueError(f"jaxsub.testing.tolerance: no tolerance for {jnp.dtype(dtype)}; the table has "
                         f"{sorted(str(d) for d in _BASE)}")
    base = _BASE[jnp.dtype(dtype)]
    tol = base * max(1.0, math.sqrt(reduction) / 8.0)
    return tol * (GRAD_FACTOR if grad else 1.0)


def assert_close(actual, expected, dtype=None, reduction: int = 1, grad: bool = False, what: str = ""):
    """|actual - expected| <= tol * (1 + |expected|) elementwise, with tol from the table.
    NaN never passes."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {actual.shape} != expected {expected.shape}")
    dtype = dtype if dtype is not None else jnp.float32
    tol = tolerance(dtype, reduction, grad)
    if np.isnan(actual).any() and not np.isnan(expected).any():
        raise AssertionError(f"{what}: NaN in result")
    err = np.abs(actual - expected)
    bound = tol * (1.0 + np.abs(expected))
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(
            f"{what}: {bad.sum()} of {err.size} elements out of tolerance {tol:.2e} "
            f"(worst at {i}: got {actual[i]}, expected {expected[i]})"
        )


def causal_rows_shifted(mask, sq: int, sk: int):
    """The documented rule in numpy, for a reference to take as its mask: the additive
    `mask` (broadcastable to [.., Sq, Sk]) as a row per query, each row whose values on the
    keys its query sees under the causal rule (j <= i + Sk - Sq) are all below -256
    shifted up by their maximum."""
    mask = np.asarray(mask)
    vis = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    rows = np.broadcast_to(mask, mask.shape[:-2] + (sq, sk))
    top = np.where(vis, rows, -np.inf).max(-1, keepdims=True)
    return jnp.asarray(rows - np.where(top < -256, top, 0.0))


def assert_vmap_matches_loop(f, keys):
    """vmap of f over a batch of keys (at least two) equals f applied key by key (bit for
    bit), and the first two keys give different results: per-example keys keep their
    meaning. f may return an array or any pytree of arrays."""
    if keys.ndim < 1 or keys.shape[0] < 2:
        raise ValueError(f"jaxsub.testing.assert_vmap_matches_loop: `keys` must be a batch of at least two keys, "
                         f"got shape {keys.shape}")
    got = jax.tree.leaves(jax.jit(jax.vmap(f))(keys))
    for i in range(keys.shape[0]):
        want = jax.tree.leaves(jax.jit(f)(keys[i]))
        assert len(want) == len(got)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w))
    assert any(not np.array_equal(np.asarray(g[0]), np.asarray(g[1])) for g in got), \
        "the first two keys gave the same results"


def ffi_attributes(hlo_text: str, target: str) -> list[dict]:
    """The attributes of each custom call of `target` (e.g. "jaxsub_layer_norm_fwd") in
    lowered StableHLO text (`jax.jit(f).lower(...).as_text()`), in program order, values
    as written there: [{"block_threads": "128", "eps": "9.99999974E-6", ...}, ...]."""
    calls = re.findall(rf"@{re.escape(target)}\(.*?mhlo\.backend_config = \{{([^}}]*)\}}", hlo_text)
    return [{k: v.strip() for k, v in re.findall(r"(\w+) = ([^,:]+)", attrs)} for attrs in calls]
