"""The row ops' kernel configurations (`kernel_config`, cuda/ABI.md: block_threads and
max_elems per direction): every allowed one computes what the default computes, bad ones
are rejected in Python and by the handlers, the attributes reach the lowered HLO, and
`jaxsub.ops.config.use` supplies them. `-m gpu` runs every configuration on CUDA."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import ops
from jaxsub.ops import config, gelu, norm
from jaxsub.ops.config import KernelConfig
from jaxsub.testing import assert_close, ffi_attributes

LN, BDRLN, GELU = "layer_norm", "bias_dropout_residual_layer_norm", "bias_gelu_dropout"
OPS = (LN, BDRLN, GELU)
RATE = 0.25
THREADS = (0, *range(32, 1025, 32))
ELEMS = (0, 4, 8, 16, 32)
# Every (block_threads, max_elems) pair, each direction: the forward takes them in order,
# the backward in reverse, so the two directions are not always configured alike.
PAIRS = list(itertools.product(THREADS, ELEMS))
CONFIGS = [dict(fwd_threads=ft, fwd_elems=fe, bwd_threads=bt, bwd_elems=be)
           for (ft, fe), (bt, be) in zip(PAIRS, reversed(PAIRS))]


def _inputs(shape, dtype, seed=0):
    """x, residual, dy [R, N] in `dtype`; bias, scale, ln_bias [N] f32; a dropout key."""
    rng = np.random.default_rng(seed)
    n = shape[-1]

    def normal(s, dt, mean=0.0):
        return jnp.asarray((mean + rng.standard_normal(s)).astype(np.float32), dt)

    return dict(x=normal(shape, dtype, 0.5), residual=normal(shape, dtype), dy=normal(shape, dtype),
                bias=normal((n,), jnp.float32), scale=normal((n,), jnp.float32, 1.0),
                ln_bias=normal((n,), jnp.float32), key=jax.random.key(seed))


def _op(name, inp, **kw):
    """f(x, bias, residual, scale, ln_bias) -> y for one op (the arguments it ignores are
    not differentiated through)."""
    key = inp["key"]
    if name == LN:
        return lambda x, b, r, s, lb: ops.layer_norm(x, s, lb, **kw)
    if name == BDRLN:
        return lambda x, b, r, s, lb: ops.bias_dropout_residual_layer_norm(x, b, r, s, lb, rate=RATE, key=key, **kw)
    return lambda x, b, r, s, lb: ops.bias_gelu_dropout(x, b, rate=RATE, key=key, **kw)


ARGS = ("x", "bias", "residual", "scale", "ln_bias")


def _run_configs(name, inp, configs):
    """[(y, grads)] of `name` with the default configuration, then with each of `configs`,
    all in one compiled function."""

    @jax.jit
    def run(args, dy):
        out = []
        for cfg in [None, *configs]:
            y, vjp = jax.vjp(_op(name, inp, kernel_config=cfg), *args)
            out.append((y, vjp(dy)))
        return out

    return run(tuple(inp[a] for a in ARGS), inp["dy"])


def _assert_all_match_default(name, inp, configs):
    (y0, g0), *rest = _run_configs(name, inp, configs)
    rows, n = inp["x"].shape
    dtype = inp["x"].dtype
    for cfg, (y, g) in zip(configs, rest):
        assert_close(y, y0, dtype, reduction=n, what=f"{name} y {cfg}")
        for arg, a, b in zip(ARGS, g, g0):
            per_row = arg in ("x", "residual")
            assert_close(a, b, dtype if per_row else jnp.float32, reduction=n if per_row else rows, grad=True,
                         what=f"{name} d{arg} {cfg}")
        if name != LN:
            # The dropout mask never depends on the configuration.
            dropped = (g[0] == 0) if name == BDRLN else (y == 0)
            dropped0 = (g0[0] == 0) if name == BDRLN else (y0 == 0)
            np.testing.assert_array_equal(np.asarray(dropped), np.asarray(dropped0))


@pytest.mark.parametrize("name", OPS)
def test_every_configuration_matches_the_default(name):
    _assert_all_match_default(name, _inputs((5, 130), jnp.bfloat16, seed=OPS.index(name)), CONFIGS)


TARGETS = {LN: "jaxsub_layer_norm", BDRLN: "jaxsub_bdrln", GELU: "jaxsub_bias_gelu_dropout"}


def _launch(text, name):
    """((block_threads, max_elems) of the forward call, same of the backward) of op `name`
    in lowered HLO text with one call of each."""
    (fwd,), (bwd,) = (ffi_attributes(text, TARGETS[name] + d) for d in ("_fwd", "_bwd"))
    return (int(fwd["block_threads"]), int(fwd["max_elems"])), (int(bwd["block_threads"]), int(bwd["max_elems"]))


def _lowered_grad(name, inp, **kw):
    f = _op(name, inp, **kw)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.value_and_grad(loss)).lower(*(inp[a] for a in ARGS)).as_text()


@pytest.mark.parametrize("name", OPS)
def test_configuration_reaches_the_lowered_hlo(name):
    inp = _inputs((4, 64), jnp.float32)
    cfg = dict(fwd_threads=128, fwd_elems=8, bwd_threads=1024, bwd_elems=4)
    assert _launch(_lowered_grad(name, inp, kernel_config=cfg), name) == ((128, 8), (1024, 4))
    # A missing key is 0 (the kernel's default), as is None outside any configuration block.
    assert _launch(_lowered_grad(name, inp, kernel_config={"bwd_elems": 16}), name) == ((0, 0), (0, 16))
    assert _launch(_lowered_grad(name, inp), name) == ((0, 0), (0, 0))


@pytest.mark.parametrize("name", OPS)
def test_configuration_in_effect_reaches_the_op(name):
    inp = _inputs((4, 64), jnp.float32)
    other = OPS[(OPS.index(name) + 1) % 3]
    with config.use({name: {"kernel_config": {"fwd_threads": 512, "bwd_elems": 32}}}):
        assert _launch(_lowered_grad(name, inp), name) == ((512, 0), (0, 32))
        # An explicit kernel_config wins over the block; other ops are not affected.
        assert _launch(_lowered_grad(name, inp, kernel_config={}), name) == ((0, 0), (0, 0))
        assert _launch(_lowered_grad(other, inp), other) == ((0, 0), (0, 0))


def test_row_ops_ask_for_their_signature():
    inp = _inputs((2, 3, 64), jnp.bfloat16)
    asked = []

    def resolver(op, signature):
        asked.append((op, dict(signature)))
        return {}

    with config.use(resolver):
        for name in OPS:
            jax.eval_shape(_op(name, inp), *(inp[a] for a in ARGS))
    assert [op for op, _ in asked] == list(OPS)
    for _, sig in asked:
        assert sig["shape"] == (2, 3, 64) and sig["dtype"] == "bfloat16" and sig["param_dtype"] == "float32"
    assert asked[1][1]["dropout_rate"] == RATE and asked[2][1]["approximate"] is False


BAD = [
    ({"fwd_threads": 100}, ValueError, "fwd_threads"),
    ({"fwd_threads": 16}, ValueError, "fwd_threads"),
    ({"bwd_threads": 2048}, ValueError, "bwd_threads"),
    ({"bwd_threads": -32}, ValueError, "bwd_threads"),
    ({"fwd_elems": 2}, ValueError, "fwd_elems"),
    ({"bwd_elems": 64}, ValueError, "bwd_elems"),
    ({"fwd_threads": 128.0}, ValueError, "fwd_threads"),
    ({"fwd_threads": "128"}, ValueError, "fwd_threads"),
    ({"bwd_elems": True}, ValueError, "bwd_elems"),
    ({"threads": 128}, ValueError, "threads"),
    ("fast", TypeError, "mapping"),
    ([("fwd_threads", 128)], TypeError, "mapping"),
]


@pytest.mark.parametrize("cfg,error,what", BAD, ids=[f"{i}-{w}" for i, (_, _, w) in enumerate(BAD)])
@pytest.mark.parametrize("name", OPS)
def test_bad_configuration_raises_naming_op_and_argument(name, cfg, error, what):
    inp = _inputs((4, 8), jnp.float32)
    with pytest.raises(error) as info:
        _op(name, inp, kernel_config=cfg)(*(inp[a] for a in ARGS))
    assert f"jaxsub.{name}" in str(info.value) and "`kernel_config`" in str(info.value)
    assert what in str(info.value)


def test_bad_configuration_in_effect_raises():
    inp = _inputs((4, 8), jnp.float32)
    with config.use({LN: {"kernel_config": {"fwd_elems": 5}}}):
        with pytest.raises(ValueError, match=r"jaxsub.layer_norm: `kernel_config` from the configuration in effect"):
            _op(LN, inp)(*(inp[a] for a in ARGS))


def _direct_calls(inp, kernel):
    """Every target called directly with a KernelConfig built without Python's checks."""
    x, dy, b, r, s, lb = (inp[a] for a in ("x", "dy", "bias", "residual", "scale", "ln_bias"))
    seed = jnp.zeros((2,), jnp.uint32)
    _, mean, rstd = norm._layer_norm_fwd_call(x, s, lb, 1e-5, KernelConfig())
    return {
        "layer_norm_fwd": lambda: norm._layer_norm_fwd_call(x, s, lb, 1e-5, kernel),
        "layer_norm_bwd": lambda: norm._layer_norm_bwd_call(dy, x, s, mean, rstd, kernel),
        "bdrln_fwd": lambda: norm._bdrln_fwd_call(x, b, r, s, lb, seed, 1e-5, RATE, kernel),
        "bdrln_bwd": lambda: norm._bdrln_bwd_call(dy, None, x, b, r, s, mean, rstd, seed, RATE, kernel),
        "bias_gelu_dropout_fwd": lambda: gelu._fwd_call(x, b, seed, approximate=False, rate=RATE, kernel=kernel),
        "bias_gelu_dropout_bwd": lambda: gelu._bwd_call(dy, x, b, seed, approximate=False, rate=RATE, kernel=kernel),
    }


@pytest.mark.parametrize("target", ["layer_norm_fwd", "layer_norm_bwd", "bdrln_fwd", "bdrln_bwd",
                                    "bias_gelu_dropout_fwd", "bias_gelu_dropout_bwd"])
def test_handlers_reject_bad_attributes(target):
    inp = _inputs((3, 16), jnp.float32)
    direction = target.rsplit("_", 1)[1]
    bad_threads = KernelConfig(**{f"{direction}_threads": 48})
    bad_elems = KernelConfig(**{f"{direction}_elems": 12})
    with pytest.raises(Exception, match=rf"{target}: `block_threads` must be 0 or a multiple of 32 .* got 48"):
        jax.block_until_ready(_direct_calls(inp, bad_threads)[target]())
    with pytest.raises(Exception, match=rf"{target}: `max_elems` must be 0, 4, 8, 16 or 32, got 12"):
        jax.block_until_ready(_direct_calls(inp, bad_elems)[target]())
    jax.block_until_ready(_direct_calls(inp, KernelConfig(1024, 32, 32, 4))[target]())


# ---------------------------------------------------------------------------------------
# CUDA (pytest -m gpu): every configuration launches and matches the default at odd and
# boundary row lengths (general path, vector path, one warp per row, many rows per block,
# the longest vector rows).


@pytest.mark.gpu
@pytest.mark.skipif(not jaxsub.cuda_available(), reason="needs CUDA kernels and a GPU")
@pytest.mark.parametrize("n", [1, 7, 127, 1000, 1024, 4100])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", OPS)
def test_cuda_every_configuration_matches_the_default(name, dtype, n):
    inp = jax.device_put(_inputs((67, n), dtype, seed=n), jax.devices("gpu")[0])
    _assert_all_match_default(name, inp, CONFIGS)


def test_a_kernel_config_value_and_bad_use_blocks():
    """Found by probing: a KernelConfig (the checked form) was refused as `kernel_config`;
    a `use` block with a non-mapping entry, a string, or a resolver answering a non-mapping
    gave Python's own errors, naming nothing."""
    inp = _inputs((4, 8), jnp.float32)
    want = _op(LN, inp)(*(inp[a] for a in ARGS))
    got = _op(LN, inp, kernel_config=KernelConfig(fwd_threads=64))(*(inp[a] for a in ARGS))
    assert_close(got, want, what="KernelConfig")
    for bad in ({LN: 5}, "fast"):
        with pytest.raises(TypeError, match="jaxsub.ops.config.use"):
            with config.use(bad):
                pass
    with config.use(lambda op, signature: 5):
        with pytest.raises(TypeError, match="resolver of the `use` block in effect returned 5"):
            _op(LN, inp)(*(inp[a] for a in ARGS))
    with pytest.raises(ValueError, match="jaxsub.ops.config.use: no op 'layernorm' takes a configuration"):
        with config.use({"layernorm": {"kernel_config": {}}}):
            pass
    with pytest.raises(ValueError, match="jaxsub.ops.config.use: attention has no option 'implementation'"):
        with config.use({"attention": {"implementation": "fused"}}):
            pass
    with pytest.raises(ValueError, match="no tolerance for float64"):
        jaxsub.testing.tolerance(np.float64)
