"""Every layout/algorithm candidate of every encoder-layer stage computes what the default
candidate computes (outputs and gradients, dropout on and off), and whole layers built
from non-default selections equal the default layer."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import layout
from jaxsub.layout.encoder import STAGE_NAMES
from jaxsub.layout.problem import Selection, relayout
from jaxsub.testing import assert_close

B, S, E, H, F = 2, 6, 16, 2, 24


def _spec(pre_layer_norm=False, training=True, mask=True):
    return layout.LayerSpec(batch=B, seq=S, hidden=E, heads=H, mlp_dim=F, dtype="float32", dropout_rate=0.25,
                            attention_dropout_rate=0.25, pre_layer_norm=pre_layer_norm, training=training,
                            mask_shape=(B, S) if mask else None, mask_dtype="bool" if mask else None)


def _stage_fn(problem, i, cand, default):
    """The stage on inputs in the default candidate's input label, output converted to
    the default candidate's output label: comparable across candidates."""
    wl = problem.stage_workload(i, cand)

    def fn(diff, aux):
        params, value, x = diff
        value = relayout(value, default.in_layout, cand.in_layout)
        out = wl.fn((params, value, x), aux)
        return relayout(out, cand.out_layout, default.out_layout)

    return fn


def _fwd_bwd(fn, diff, aux):
    out, vjp = jax.vjp(lambda d: fn(d, aux), diff)
    cot = jax.tree.map(lambda o: jnp.cos(jnp.arange(o.size, dtype=o.dtype).reshape(o.shape)), out)
    return out, vjp(cot)


CASES = [(False, True, i) for i in range(len(STAGE_NAMES))] + [
    (False, False, STAGE_NAMES.index(n)) for n in ("bdrln1", "bias_gelu_dropout", "bdrln2")] + [
    (True, True, STAGE_NAMES.index(n)) for n in ("qkv", "bdrln1", "ffn_in", "bdrln2")]


@pytest.mark.parametrize("pre_layer_norm,training,stage", CASES,
                         ids=[f"{'pre' if p else 'post'}-{'train' if t else 'eval'}-{STAGE_NAMES[i]}" for p, t, i in CASES])
def test_every_candidate_matches_the_default(pre_layer_norm, training, stage):
    # platform "cpu" offers the fused attention candidate (its CPU handler is real).
    problem = layout.EncoderProblem(_spec(pre_layer_norm, training), platform="cpu")
    candidates = problem.stages[stage].candidates
    default = candidates[0]
    diff, aux = problem.stage_workload(stage, default).make(seed=stage)
    want_out, want_grad = jax.jit(lambda d, a: _fwd_bwd(_stage_fn(problem, stage, default, default), d, a))(diff, aux)
    assert len(candidates) > 1
    for cand in candidates[1:]:
        fn = _stage_fn(problem, stage, cand, default)
        out, grad = jax.jit(lambda d, a, fn=fn: _fwd_bwd(fn, d, a))(diff, aux)
        for path, w in jax.tree_util.tree_leaves_with_path(want_out):
            g = out
            for k in path:
                g = g[k.key]
            assert_close(g, w, reduction=F, what=f"{cand} output {jax.tree_util.keystr(path)}")
        flat_w, tree = jax.tree.flatten(want_grad)
        flat_g, tree_g = jax.tree.flatten(grad)
        assert tree == tree_g
        for g, w in zip(flat_g, flat_w):
            assert_close(g, w, reduction=B * S * F, grad=True, what=f"{cand} gradient")


def _random_paths(problem, n, seed):
    """n consistent random paths (consecutive labels equal or convertible)."""
    rng = np.random.default_rng(seed)
    paths = []
    while len(paths) < n:
        path = [st.candidates[rng.integers(len(st.candidates))] for st in problem.stages]
        if path != problem.default():
            paths.append(path)
    return paths


@pytest.mark.parametrize("pre_layer_norm", [False, True])
def test_encoder_layer_with_any_selection_matches_default(pre_layer_norm):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, S, E)), jnp.float32)
    mask = jnp.arange(S)[None, :] < jnp.array([[S], [4]])
    base = jaxsub.flax.EncoderLayer(num_heads=H, mlp_dim=F, dropout_rate=0.25, attention_dropout_rate=0.25,
                                    pre_layer_norm=pre_layer_norm, layouts="none")
    params = jax.jit(base.init)(jax.random.key(1), x)
    problem = layout.EncoderProblem(base._spec(x, mask), platform="cpu")
    rngs = {"dropout": jax.random.key(2)}

    def loss(layer, p, x):
        y = layer.apply(p, x, mask, deterministic=False, rngs=rngs)
        return jnp.sum(y * jnp.sin(y)), y

    def run(layer):
        return jax.jit(jax.value_and_grad(lambda p, x: loss(layer, p, x), (0, 1), has_aux=True))(params, x)

    (_, want), (gp_want, gx_want) = run(base)
    paths = [list(p) for p in itertools.islice(_random_paths(problem, 4, seed=int(pre_layer_norm)), 4)]
    # Every non-default label at least once: all the last candidates of each stage.
    paths.append([st.candidates[-1] for st in problem.stages])
    for path in paths:
        sel = Selection.of(problem, path)
        (_, got), (gp, gx) = run(base.clone(layouts=sel))
        assert_close(got, want, reduction=E * F, what=str(sel))
        assert_close(gx, gx_want, reduction=S * E * F, grad=True, what=str(sel))
        for g, w in zip(jax.tree.leaves(gp), jax.tree.leaves(gp_want)):
            assert_close(g, w, reduction=B * S * E * F, grad=True, what=str(sel))


def test_selection_that_does_not_fit_is_rejected():
    problem = layout.EncoderProblem(_spec(), platform="cpu")
    sel = Selection.of(problem, problem.default())
    pre = layout.EncoderProblem(_spec(pre_layer_norm=True), platform="cpu")
    with pytest.raises(ValueError, match="bdrln1"):
        pre.check(sel)
    with pytest.raises(ValueError, match="not a candidate"):
        Selection.of(problem, [problem.stages[0].candidates[0]] * len(problem.stages))
