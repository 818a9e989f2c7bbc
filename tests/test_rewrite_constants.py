"""The pass's constant evaluator (jaxsub.rewrite.constants): values computed from iotas and
literals, kept in broadcast (compact) form, comparisons of large ones kept lazy; and the
causal-triangle test on them. CPU only, no custom calls."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxsub.rewrite import constants as C
from jaxsub.rewrite import graph as G

SHAPE = (2, 6, 5)


def _evaluate(fn):
    """(compact value, dense value) of fn()'s result as the pass sees it, and jax's value."""
    closed = jax.make_jaxpr(fn)()
    g = G.build(closed.jaxpr, closed.consts)
    out = g.outvars[0]
    return C.value(g, out, {}), out.shape, np.asarray(fn())


def _random_program(rng: random.Random, depth: int):
    """A random constant program over SHAPE: iotas, broadcasts of small constants, layout
    round trips (splits, merges, transposes), comparisons, selects, converts, integer
    arithmetic and boolean logic."""
    def leaf():
        kind = rng.choice(["iota", "iota", "scalar", "small"])
        if kind == "iota":
            d = rng.randrange(3)
            return lambda: lax.broadcasted_iota(jnp.int32, SHAPE, d) * rng_int + shift
        if kind == "scalar":
            return lambda: jnp.full(SHAPE, value, jnp.int32)
        small = tuple(n if rng.random() < 0.5 else 1 for n in SHAPE)
        arr = np.asarray(rng_np.integers(-3, 4, small), np.int32)
        return lambda: jnp.broadcast_to(lax.broadcasted_iota(jnp.int32, small, 0) * 0 + arr, SHAPE)

    def ints(d):
        if d == 0 or rng.random() < 0.3:
            return leaf()
        kind = rng.choice(["arith", "select", "pick", "pick", "layout", "convert"])
        if kind == "arith":
            a, b, op = ints(d - 1), ints(d - 1), rng.choice([jnp.add, jnp.subtract, jnp.multiply])
            return lambda: op(a(), b())
        if kind == "select":
            c, a, b = bools(d - 1), ints(d - 1), ints(d - 1)
            return lambda: jnp.where(c(), a(), b())
        if kind == "pick":  # between two single values (jnp.tril's select, where(m, 0, -big))
            c, a, b = bools(d - 1), rng.randrange(-3, 4), rng.randrange(-3, 4)
            return lambda: jnp.where(c(), a, b).astype(jnp.int32)
        if kind == "convert":
            c = bools(d - 1)
            return lambda: c().astype(jnp.int32) * 3
        return layout(ints(d - 1))

    def bools(d):
        if d == 0:
            a, b = leaf(), leaf()
            return lambda: a() >= b()
        kind = rng.choice(["compare", "compare", "logic", "not", "layout", "tril", "triu", "convert"])
        if kind == "compare":
            a, b = ints(d - 1), ints(d - 1)
            op = rng.choice([jnp.greater_equal, jnp.greater, jnp.less, jnp.less_equal, jnp.equal, jnp.not_equal])
            return lambda: op(a(), b())
        if kind == "logic":
            a, b, op = bools(d - 1), bools(d - 1), rng.choice([jnp.logical_and, jnp.logical_or])
            return lambda: op(a(), b())
        if kind == "not":
            a = bools(d - 1)
            return lambda: jnp.logical_not(a())
        if kind in ("tril", "triu"):
            a, k, tri = bools(d - 1), rng.randrange(-2, 3), getattr(jnp, kind)
            return lambda: tri(a(), k)
        if kind == "convert":
            a = ints(d - 1)
            return lambda: a().astype(jnp.float32) != 0.0
        return layout(bools(d - 1))

    def layout(x):
        kind = rng.choice(["split", "merge", "transpose", "expand"])
        if kind == "split":
            return lambda: x().reshape(2, 3, 2, 5).reshape(SHAPE)
        if kind == "merge":
            return lambda: x().reshape(12, 5).reshape(SHAPE)
        if kind == "transpose":
            return lambda: jnp.transpose(jnp.transpose(x(), (2, 0, 1)), (1, 2, 0))
        return lambda: lax.squeeze(jnp.expand_dims(x(), 1), (1,))

    rng_int, shift, value = rng.randrange(1, 3), rng.randrange(-2, 3), rng.randrange(-3, 4)
    rng_np = np.random.default_rng(rng.randrange(1 << 30))
    return bools(depth) if rng.random() < 0.6 else ints(depth)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
def test_compact_values_equal_jax_on_random_programs(monkeypatch, eager):
    """Differential: 150 random constant programs, evaluated by the pass (each result
    broadcast to its shape) and by jax. `lazy` makes every comparison a `Compare`, so the
    lazy steps and their materialization run too."""
    if not eager:
        monkeypatch.setattr(C, "_EAGER", 0)
    lazy = 0
    for seed in range(150):
        fn = _random_program(random.Random(seed), depth=3)
        val, shape, want = _evaluate(fn)
        assert val is not None, seed
        lazy += isinstance(val, (C.Compare, C.Sum))
        got = C.dense(val, shape)
        assert got.dtype == want.dtype and got.shape == want.shape, seed
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
        # What the pass asks of a value holds for any kind of it (and does not raise).
        lo, hi = C.span(val)
        assert lo <= want.min() and want.max() <= hi, seed
        assert not C.all_true(val) or bool(want.all()), seed
        vis, _ = C.visible(val, 1.0, -1e4)
        assert vis is None or np.array_equal(C.dense(vis, shape), want == 0), seed
        if want.dtype == np.bool_:
            if C.qk_prefix(val, ("b", "q", "k"), SHAPE[1], SHAPE[2], SHAPE[2] - SHAPE[1]):  # only where it holds
                assert _brute(want[0], *SHAPE[1:], SHAPE[2] - SHAPE[1]) and bool(np.all(want == want[:1])), seed
    assert (lazy > 0) == (not eager)


def test_iota_and_broadcasts_stay_compact():
    """An iota is a vector and a broadcast adds unit axes: [4, 1, 8192, 8192] costs 8192
    elements until a comparison, which past 2^20 stays lazy."""
    def tri():
        m = lax.broadcasted_iota(jnp.int32, (8192, 8192), 0) >= lax.broadcasted_iota(jnp.int32, (8192, 8192), 1)
        return jnp.broadcast_to(m, (4, 1, 8192, 8192))

    closed = jax.make_jaxpr(tri)()
    g = G.build(closed.jaxpr, closed.consts)
    val = C.value(g, g.outvars[0], {})
    assert isinstance(val, C.Compare) and val.op == "ge"
    assert val.a.shape == (1, 1, 8192, 1) and val.b.shape == (1, 1, 1, 8192)


def _brute(vis, sq, sk, offset):
    return np.array_equal(np.broadcast_to(vis, (sq, sk)), np.arange(sk)[None, :] <= np.arange(sq)[:, None] + offset)


@pytest.mark.parametrize("seed", range(4))
def test_qk_prefix_matches_brute_force(seed):
    """Lazy comparisons of a query vector with a key vector (both orders, every comparison,
    true/false swapped) against the triangle checked element by element: monotone vectors,
    shifted ones, ties and non-monotone ones, offsets around Sk - Sq."""
    rng = np.random.default_rng(seed)
    found = 0
    for _ in range(300):
        sq, sk = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        offset = sk - sq + int(rng.integers(-1, 2))
        qv = np.arange(sq) * int(rng.integers(1, 3)) + int(rng.integers(-1, 2))
        kv = np.arange(sk) * int(rng.integers(1, 3)) + int(rng.integers(-1, 2))
        if rng.random() < 0.3:  # the triangle's own vectors, give or take one
            qv, kv = np.arange(sq) + sk - sq + int(rng.integers(-1, 2)), np.arange(sk)
        if rng.random() < 0.3:
            kv = rng.permutation(kv)
        if rng.random() < 0.2:
            kv = np.minimum(kv, int(rng.integers(0, sk + 1)))  # ties
        op = str(rng.choice(["ge", "gt", "le", "lt", "eq"]))
        flip = rng.random() < 0.5
        a, b = qv[:, None], kv[None, :]
        if flip:
            a, b = b, a
        truth = bool(rng.random() < 0.7)
        cmp = C.Compare(op, a, b, np.asarray(truth), np.asarray(not truth))
        want = _brute(C.dense(cmp, (sq, sk)), sq, sk, offset)
        assert C.qk_prefix(cmp, ("q", "k"), sq, sk, offset) == want, (op, flip, truth, qv, kv, offset)
        assert C.qk_prefix(C.dense(cmp, (sq, sk)).copy(), ("q", "k"), sq, sk, offset) == want
        found += want
    assert found > 10  # some cases are the triangle


def test_qk_prefix_reads_other_axes_and_key_major_labels():
    """A mask equal along its batch axis is the triangle; one differing along it is not; a
    [k, q] mask is read transposed."""
    sq = sk = 5
    tri = np.arange(sk)[None, :] <= np.arange(sq)[:, None]
    assert C.qk_prefix(np.stack([tri, tri]), ("b", "q", "k"), sq, sk, 0)
    assert not C.qk_prefix(np.stack([tri, ~tri]), ("b", "q", "k"), sq, sk, 0)
    assert C.qk_prefix(tri.T.copy(), ("k", "q"), sq, sk, 0)
    assert not C.qk_prefix(tri, ("k", "q"), sq, sk, 0)
