"""Every layout/algorithm/kernel-configuration candidate of every encoder-layer stage
computes what the default candidate computes (outputs and gradients, dropout on and off),
whole layers built from non-default selections equal the default layer, and a selected
kernel configuration reaches the kernels."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsub
from jaxsub import _ffi, layout
from jaxsub.layout import tuning
from jaxsub.layout.encoder import ROW_KERNEL_CONFIGS, STAGE_NAMES
from jaxsub.layout.problem import Selection, relayout
from jaxsub.testing import assert_close, ffi_attributes

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
    # platform "cpu" offers the fused attention candidate (its CPU handler is real), and
    # kernel_configs=True the row stages' kernel configurations (the CPU handlers check
    # and ignore them). All candidates of the stage run in one compiled function.
    problem = layout.EncoderProblem(_spec(pre_layer_norm, training), platform="cpu", kernel_configs=True)
    candidates = problem.stages[stage].candidates
    default = candidates[0]
    diff, aux = problem.stage_workload(stage, default).make(seed=stage)
    results = jax.jit(lambda d, a: [_fwd_bwd(_stage_fn(problem, stage, c, default), d, a) for c in candidates])(diff, aux)
    (want_out, want_grad), results = results[0], results[1:]
    assert len(candidates) > 1
    if problem.stages[stage].name in ("bdrln1", "bias_gelu_dropout") or (
            problem.stages[stage].name == "bdrln2" and not pre_layer_norm):
        assert any(c.config for c in candidates)   # the kernel configurations are among them
    for cand, (out, grad) in zip(candidates[1:], results):
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
    problem = layout.EncoderProblem(base._spec(x, mask), platform="cpu", kernel_configs=True)
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
    paths.append(list(problem.default()))  # row-major feed-forward: fused with recompute_gelu
    fused = 0
    for path, recompute in itertools.product(paths, (False, True)):
        sel = Selection.of(problem, path)
        # recompute_gelu fuses the GELU and the feed-forward output product where both are
        # row-major, else leaves them apart: the same numbers either way.
        fused += recompute and problem._dense_fits(path[STAGE_NAMES.index("bias_gelu_dropout")],
                                                   path[STAGE_NAMES.index("ffn_out")])
        (_, got), (gp, gx) = run(base.clone(layouts=sel, recompute_gelu=recompute))
        what = f"{sel} recompute_gelu={recompute}"
        assert_close(got, want, reduction=E * F, what=what)
        assert_close(gx, gx_want, reduction=S * E * F, grad=True, what=what)
        for g, w in zip(jax.tree.leaves(gp), jax.tree.leaves(gp_want)):
            assert_close(g, w, reduction=B * S * E * F, grad=True, what=what)
    assert 0 < fused < len(paths)  # both cases ran


def test_selection_that_does_not_fit_is_rejected():
    problem = layout.EncoderProblem(_spec(), platform="cpu")
    sel = Selection.of(problem, problem.default())
    pre = layout.EncoderProblem(_spec(pre_layer_norm=True), platform="cpu")
    with pytest.raises(ValueError, match="bdrln1"):
        pre.check(sel)
    with pytest.raises(ValueError, match="not a candidate"):
        Selection.of(problem, [problem.stages[0].candidates[0]] * len(problem.stages))


ROW_STAGES = ("bdrln1", "bias_gelu_dropout", "bdrln2")


@pytest.mark.parametrize("pre_layer_norm", [False, True])
def test_kernel_configurations_are_offered_after_each_default_and_the_heuristic_picks_defaults(pre_layer_norm):
    problem = layout.EncoderProblem(_spec(pre_layer_norm), platform="cpu", kernel_configs=True)
    tables = tuning.model_tables(problem)
    for stage, table in zip(problem.stages, tables.stages):
        if stage.name not in ROW_STAGES:
            continue
        pairs = [c for c in stage.candidates if not c.config]
        configs = ROW_KERNEL_CONFIGS if not (pre_layer_norm and stage.name == "bdrln2") else ()
        # Configurations only for the pairs whose token tensors are row-major [B, S, E].
        row_major = [c for c in pairs if "SBE" not in c.in_layout + c.out_layout]
        assert row_major
        assert [c.config for c in stage.candidates] == [""] * len(pairs) + [k for k in configs for _ in row_major]
        assert [c.in_layout + c.out_layout for c in stage.candidates[len(pairs):]] == [
            c.in_layout + c.out_layout for _ in configs for c in row_major]
        for c in stage.candidates[len(pairs):]:
            # Same layouts, same modelled cost: the default (listed first) wins the tie.
            assert table[c.key] == table[(c.in_layout, c.out_layout, "")]
    sel = tuning.solve(problem, tables, "heuristic")
    assert all(not sel.candidate(name).config for name in ROW_STAGES)
    # By default the configurations are offered only where the CUDA row kernels run: on a
    # GPU platform with the CUDA targets built (on CPU, or without them, nothing to time).
    for platform in ("cpu", "gpu"):
        offered = any(c.config for name in ROW_STAGES
                      for c in layout.EncoderProblem(_spec(pre_layer_norm), platform=platform).stages[
                          STAGE_NAMES.index(name)].candidates)
        assert offered == (platform == "gpu" and _ffi.has_cuda_target("jaxsub_bdrln_fwd"))


def _launches(text, target):
    return sorted((int(a["block_threads"]), int(a["max_elems"])) for a in ffi_attributes(text, target))


@pytest.mark.parametrize("pre_layer_norm", [False, True])
def test_encoder_layer_applies_the_selected_kernel_configurations(pre_layer_norm):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, S, E)), jnp.float32)
    base = jaxsub.flax.EncoderLayer(num_heads=H, mlp_dim=F, dropout_rate=0.25, attention_dropout_rate=0.25,
                                    pre_layer_norm=pre_layer_norm, layouts="none")
    params = jax.jit(base.init)(jax.random.key(1), x)
    problem = layout.EncoderProblem(base._spec(x, None), platform="cpu", kernel_configs=True)
    chosen = {"bdrln1": "bwd_threads=256,fwd_threads=128", "bias_gelu_dropout": "bwd_threads=1024,fwd_threads=512"}
    if not pre_layer_norm:  # pre-LN's bdrln2 runs no row op, so it has no configurations
        chosen["bdrln2"] = "bwd_threads=1024,fwd_threads=128"
    # The default layouts (the first candidate with a config has the first layout pair).
    path = [next(c for c in st.candidates if c.config == chosen[st.name]) if st.name in chosen else st.candidates[0]
            for st in problem.stages]
    assert [c.in_layout for c in path] == [c.in_layout for c in problem.default()]
    layer = base.clone(layouts=Selection.of(problem, path))
    loss = lambda p, x: jnp.sum(layer.apply(p, x, deterministic=False, rngs={"dropout": jax.random.key(2)}))  # noqa: E731
    text = jax.jit(jax.value_and_grad(loss)).lower(params, x).as_text()
    assert _launches(text, "jaxsub_bias_gelu_dropout_fwd") == [(512, 0)]
    assert _launches(text, "jaxsub_bias_gelu_dropout_bwd") == [(1024, 0)]
    if pre_layer_norm:
        # bdrln1 is the first residual with the MLP's layer norm (ops.norm.bdrln_and_sum); the
        # attention block's layer norm (in qkv) keeps the defaults; bdrln2 has no row op.
        assert _launches(text, "jaxsub_layer_norm_fwd") == [(0, 0)]
        assert _launches(text, "jaxsub_layer_norm_bwd") == [(0, 0)]
        assert _launches(text, "jaxsub_bdrln_fwd") == [(128, 0)]
        assert _launches(text, "jaxsub_bdrln_bwd") == [(256, 0)]
    else:
        assert _launches(text, "jaxsub_bdrln_fwd") == [(128, 0), (128, 0)]
        assert _launches(text, "jaxsub_bdrln_bwd") == [(256, 0), (1024, 0)]
