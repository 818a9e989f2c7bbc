"""jaxsub.analyze: flops, bytes and operator classes, checked against hand counts."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import jaxsub
from bench.ops import OPS
from jaxsub import analysis, ops
from jaxsub.flax import ReferenceEncoderLayer

CON, NORM, EW = analysis.CONTRACTION, analysis.NORMALIZATION, analysis.ELEMENTWISE


def _normal(i, shape):
    return jnp.asarray(np.random.default_rng(i).standard_normal(shape, np.float32))


def block(x, w, b, scale, ln_bias):
    """matmul + bias, tanh GELU, layer norm: x [4, 8], w [8, 16], vectors [16]."""
    h = x @ w + b
    g = 0.5 * h * (1.0 + jnp.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))
    mean = jnp.mean(g, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(g - mean), axis=-1, keepdims=True)
    return (g - mean) * jax.lax.rsqrt(var + 1e-5) * scale + ln_bias


BLOCK_ARGS = (_normal(0, (4, 8)), _normal(1, (8, 16)), _normal(2, (16,)), _normal(3, (16,)), _normal(4, (16,)))


def _rows(report, op):
    return [(r.cls, r.flops, r.bytes) for r in report.ops if r.op == op]


def test_block_counts_by_hand():
    r = jaxsub.analyze(block, *BLOCK_ARGS, compare_optimized=False)
    # f32, so 4 bytes an element. [4, 16] = 64 elements = 256 B; a row statistic [4] = 16 B.
    # matmul: 2·4·16·8 flops; reads x 128 B + w 512 B, writes 256 B.
    assert _rows(r, "dot_general") == [(CON, 1024, 896)]
    # h + b reads the [16] bias (64 B), not its broadcast: 256 + 64 + 256.
    assert _rows(r, "add")[0] == (EW, 64, 576)
    # GELU: 8 element-wise ops of 64 flops; x·0.5 style ops 512 B, two-operand ones 768 B.
    assert _rows(r, "tanh") == [(EW, 64, 512)]
    # mean and variance: reduce [4, 16] -> [4] is 64 flops, 256 + 16 B.
    assert _rows(r, "reduce_sum") == [(NORM, 64, 272)] * 2
    assert _rows(r, "rsqrt") == [(NORM, 4, 32)]
    # x - mean (twice, as written), square feeding the variance sum, · rstd: normalization;
    # · scale and + bias after it: element-wise.
    assert _rows(r, "square") == [(NORM, 64, 512)]
    assert _rows(r, "sub") == [(NORM, 64, 528)] * 2
    assert [c for c, _, _ in _rows(r, "mul")] == [EW] * 4 + [NORM, EW]
    totals = r.by_class()
    assert (totals[CON]["flops"], totals[CON]["bytes"]) == (1024, 896)
    # 11 element-wise ops: 9 of 64 flops in bias+GELU, 2 after the norm; bytes summed by hand.
    assert (totals[EW]["ops"], totals[EW]["flops"], totals[EW]["bytes"]) == (11, 704, 6336)
    # 2 reductions, 2 /N, 2 subs, square, +eps, rsqrt, ·rstd.
    assert (totals[NORM]["ops"], totals[NORM]["flops"], totals[NORM]["bytes"]) == (10, 400, 2768)
    assert (r.flops, r.bytes) == (2128, 10000)


def test_class_totals_add_up(encoder):
    layer, params, x = encoder
    r = jaxsub.analyze(_loss(layer), params, x, jax.random.key(1), grad=True)
    for report in (r, r.optimized):
        totals = report.by_class()
        assert set(totals) == set(analysis.CLASSES)
        assert sum(t["bytes"] for t in totals.values()) == report.bytes > 0
        assert sum(t["flops"] for t in totals.values()) == report.flops > 0
        assert sum(t["ops"] for t in totals.values()) == len(report.ops)
        assert sum(t["bytes_pct"] for t in totals.values()) == pytest.approx(100.0)
        assert all(r.bytes == r.flops == 0 for r in report.ops if r.cls == analysis.STRUCTURAL)
        assert totals[analysis.STRUCTURAL]["ops"] > 0


def test_scan_multiplies_by_trip_count():
    w = _normal(5, (8, 8))

    def step(c, _):
        return jnp.tanh(c @ w), None

    one = jaxsub.analyze(lambda x: step(x, None)[0], BLOCK_ARGS[0], compare_optimized=False)
    five = jaxsub.analyze(lambda x: jax.lax.scan(step, x, None, length=5)[0], BLOCK_ARGS[0],
                          compare_optimized=False)
    assert one.flops == 2 * 4 * 8 * 8 + 32
    assert (five.flops, five.bytes) == (5 * one.flops, 5 * one.bytes)
    assert {(r.count, r.scope) for r in five.ops} == {(5, "scan×5")}


def test_cond_counts_largest_branch_and_while_body_once():
    x, w = BLOCK_ARGS[0], _normal(5, (8, 8))

    def branches(x):
        return jax.lax.cond(x[0, 0] > 0, lambda x: x @ w, lambda x: jnp.sin(x), x)

    r = jaxsub.analyze(branches, x, compare_optimized=False)
    assert _rows(r, "dot_general") == [(CON, 512, 512)] and not _rows(r, "sin")
    # lax.cond's branches are (false, true): the matmul is branch 1.
    assert any("cond" in n and "branch 1" in n for n in r.notes)

    def loop(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]

    r = jaxsub.analyze(loop, x, compare_optimized=False)
    assert _rows(r, "dot_general") == [(CON, 512, 512)]
    assert any("while" in n and "once" in n for n in r.notes)


def test_convolution_and_an_opaque_primitive():
    x, k = _normal(10, (2, 3, 8, 8)), _normal(11, (4, 3, 3, 3))
    r = jaxsub.analyze(lambda x, k: jax.lax.conv(x, k, (1, 1), "VALID"), x, k, compare_optimized=False)
    # out [2, 4, 6, 6], each 3·3·3 multiply-adds; reads 1536 + 432 B, writes 1152 B.
    assert _rows(r, "conv_general_dilated") == [(CON, 2 * 2 * 4 * 6 * 6 * 27, 3120)]

    def solve(b):
        return jax.lax.custom_linear_solve(lambda v: 2.0 * v, b, lambda mv, b: b / 2.0)

    r = jaxsub.analyze(solve, x[0, 0, 0], compare_optimized=False)
    assert any("custom_linear_solve" in n and "not descended" in n for n in r.notes)


def test_dead_equations_are_not_counted():
    def f(x):
        jax.nn.softmax(x)
        return x * 2.0

    r = jaxsub.analyze(f, BLOCK_ARGS[0], compare_optimized=False)
    assert [r.op for r in r.ops] == ["mul"]


def test_effects_without_outputs_that_read_a_reduction():
    """An equation with no outputs (jax.debug.print, jax.debug.callback, an ordered
    io_callback without a result) reading a reduction: the normalization classifier took
    every equation's first output and raised IndexError (found by a probe). The
    reduction stays a statistical normalization and the rest is counted."""
    x = _normal(12, (3, 5))
    effects = [
        lambda v: jax.debug.print("{}", v),
        lambda v: jax.debug.callback(lambda _: None, v),
        lambda v: io_callback(lambda _: None, None, v, ordered=True),
    ]
    for effect in effects:
        def f(x):
            effect(jnp.sum(x, axis=-1))
            return x * 2.0

        r = jaxsub.analyze(f, x, compare_optimized=False)
        assert _rows(r, "reduce_sum") == [(NORM, 15, 15 * 4 + 3 * 4)]
        assert _rows(r, "mul") == [(EW, 15, 2 * 15 * 4)]


@pytest.fixture(scope="module")
def encoder():
    layer = ReferenceEncoderLayer(num_heads=4, mlp_dim=128, dropout_rate=0.1, attention_dropout_rate=0.1)
    x = _normal(6, (2, 16, 32))
    return layer, layer.init(jax.random.key(0), x), x


def _apply(layer):
    return lambda p, x, k: layer.apply(p, x, deterministic=False, rngs={"dropout": k})


def _loss(layer):
    return lambda p, x, k: jnp.sum(_apply(layer)(p, x, k) ** 2)


def test_bert_layer_moves_fewer_bytes_after_optimize(encoder):
    layer, params, x = encoder
    # layouts="none": the unfused attention (XLA matmuls around the softmax kernel), so the
    # contractions are the same before and after; analyze takes the original as baseline.
    r = jaxsub.analyze(jaxsub.optimize(_apply(layer), layouts="none"), params, x, jax.random.key(1))
    opt = r.optimized
    assert opt.targets == {"jaxsub_softmax_dropout_fwd", "jaxsub_bdrln_fwd", "jaxsub_bias_gelu_dropout_fwd"}
    assert not r.targets
    assert r.bytes_reduction_pct == pytest.approx(100 * (1 - opt.bytes / r.bytes))
    assert opt.bytes < r.bytes and r.bytes_reduction_pct > 50
    # Fusion leaves the matmuls' work alone: the same contraction flops. The three q/k/v
    # projections of one input become one product (x read once, not three times).
    con, opt_con = r.by_class()[CON], opt.by_class()[CON]
    assert opt_con["flops"] == con["flops"] and opt_con["ops"] == con["ops"] - 2
    b, s, e = x.shape
    assert opt_con["bytes"] == con["bytes"] - 2 * b * s * e * 4
    assert r.by_class()[NORM]["bytes"] > opt.by_class()[NORM]["bytes"]
    # Flax's softmax (its exp) and LayerNorm are normalizations; rows name their module.
    assert {row.cls for row in r.ops if row.op == "exp"} == {NORM}
    assert any(row.cls == NORM and row.source.endswith("[ReferenceEncoderLayer/attention_norm]")
               for row in r.ops)


def test_training_step_counts_backward_kernels(encoder):
    layer, params, x = encoder
    fwd = jaxsub.analyze(_loss(layer), params, x, jax.random.key(1))
    step = jaxsub.analyze(_loss(layer), params, x, jax.random.key(1), grad=True)
    for t in fwd.optimized.targets:  # attention on Flax's projections: the packed-gradient backward
        assert {t.replace("_fwd", "_bwd"), t.replace("_fwd", "_bwd_dqkv")} & step.optimized.targets, t
    assert step.bytes > fwd.bytes and step.optimized.bytes > fwd.optimized.bytes
    # Each matmul gets two backward ones (d_input, d_weight), except that x is not
    # differentiated: the input gradients of the q/k/v projections (2·B·S·E·E each) are dead.
    assert step.by_class()[CON]["flops"] == 3 * fwd.by_class()[CON]["flops"] - 3 * 2 * 32 * 32 * 32
    assert step.bytes_reduction_pct > 0


def test_fused_target_bytes_match_the_op_benchmark_floor():
    """A jaxsub target moves what bench/ops.py's memory floor says (ABI.md tensors,
    workspace excluded), forward and backward, and grad of a plain function sees both."""
    x, scale, bias = _normal(7, (64, 48)), _normal(8, (48,)), _normal(9, (48,))
    r = jaxsub.analyze(lambda x, s, b: jnp.sum(ops.layer_norm(x, s, b)), x, scale, bias,
                       compare_optimized=False, grad=True, argnums=(0, 1, 2))
    fused = {row.op: row for row in r.ops if row.op in r.targets}
    assert set(fused) == {"jaxsub_layer_norm_fwd", "jaxsub_layer_norm_bwd"}
    floor = OPS["layer_norm"].floor_bytes
    assert fused["jaxsub_layer_norm_fwd"].bytes == floor("fwd", 64, 48, jnp.float32, jnp.float32)
    assert fused["jaxsub_layer_norm_bwd"].bytes == (floor("fwd+bwd", 64, 48, jnp.float32, jnp.float32)
                                                   - floor("fwd", 64, 48, jnp.float32, jnp.float32))
    assert {row.cls for row in fused.values()} == {NORM}


def test_gelu_backward_counts_its_y_result_not_its_workspace():
    """bias_gelu_dropout_bwd's results are dx, dbias, workspace, y: the workspace is
    scratch, y (written again by bias_gelu_dropout_dense's backward) is moved bytes."""
    x, bias, w = _normal(10, (64, 48)), _normal(11, (48,)), _normal(12, (48, 8))
    key = jax.random.key(13)
    rows = {}
    for name, f in (("op", lambda x, b, w: jnp.sum(ops.bias_gelu_dropout(x, b, rate=0.1, key=key) @ w)),
                    ("dense", lambda x, b, w: jnp.sum(ops.bias_gelu_dropout_dense(x, b, w, rate=0.1, key=key)))):
        r = jaxsub.analyze(f, x, bias, w, compare_optimized=False, grad=True, argnums=(0, 1, 2))
        rows[name] = next(row for row in r.ops if row.op == "jaxsub_bias_gelu_dropout_bwd")
    # dy, x, bias, seed in; dx, dbias out (f32); the dense op's y: one more x-sized write.
    assert rows["op"].bytes == 4 * (3 * 64 * 48 + 2 * 48) + 8
    assert rows["dense"].bytes == rows["op"].bytes + 4 * 64 * 48


def test_residual_dropout_counts_its_tensors_not_its_workspace():
    """bias_dropout_residual_fwd reads y, bias, residual and the seed and writes the sum;
    bias_dropout_bwd reads dy and the seed and writes dx and dbias (its workspace is
    scratch). Element-wise, 3 and 2 flops per element."""
    x, y, bias = _normal(18, (64, 48)), _normal(19, (64, 48)), _normal(20, (48,))
    f = lambda x, y, b: jnp.sum(ops.dropout.residual_add(x, y, b, rate=0.1, key=jax.random.key(21)))
    r = jaxsub.analyze(f, x, y, bias, compare_optimized=False, grad=True, argnums=(0, 1, 2))
    assert _rows(r, "jaxsub_bias_dropout_residual_fwd") == [(EW, 3 * 64 * 48, 4 * (3 * 64 * 48 + 48) + 8)]
    assert _rows(r, "jaxsub_bias_dropout_bwd") == [(EW, 2 * 64 * 48, 4 * (2 * 64 * 48 + 48) + 8)]


def test_dense_gelu_is_a_contraction_with_its_bytes():
    """dense_gelu_fwd: the product's flops plus the GELU's per element of y; it reads x, w,
    bias and the seed and writes y and h."""
    x, w, bias = _normal(14, (32, 24)), _normal(15, (24, 40)), _normal(16, (40,))
    f = lambda x, w, b: ops.dense_bias_gelu_dropout(x, w, b, rate=0.1, key=jax.random.key(17))
    (row,) = _rows(jaxsub.analyze(f, x, w, bias, compare_optimized=False), "jaxsub_dense_gelu_fwd")
    assert row == (CON, 2 * 32 * 40 * 24 + 7 * 32 * 40, 4 * (32 * 24 + 24 * 40 + 40 + 2 * 32 * 40) + 8)


def test_fused_attention_is_a_contraction_with_its_bytes():
    b, s, h, d = 2, 8, 2, 4
    q, k, v = (_normal(i, (b, s, h, d)) for i in (12, 13, 14))

    def loss(q, k, v):
        return jnp.sum(ops.attention(q, k, v, implementation="fused"))

    r = jaxsub.analyze(loss, q, k, v, compare_optimized=False, grad=True, argnums=(0, 1, 2))
    fused = {row.op: row for row in r.ops if row.op in r.targets}
    qkv, lse = 3 * q.nbytes, b * h * s * 4
    # fwd reads q, k, v, the [1,1,1,1] dummy mask (1 B) and the u32[2] seed; writes out and lse.
    assert fused["jaxsub_attention_fwd"] == analysis.OpStat(
        "jaxsub_attention_fwd", CON, fused["jaxsub_attention_fwd"].shape, 4 * b * h * s * s * d,
        qkv + 1 + 8 + q.nbytes + lse, source=fused["jaxsub_attention_fwd"].source)
    # bwd reads dout, q, k, v, out, lse, mask, seed; writes dq, dk, dv (workspaces excluded).
    assert (fused["jaxsub_attention_bwd"].cls, fused["jaxsub_attention_bwd"].flops,
            fused["jaxsub_attention_bwd"].bytes) == (CON, 10 * b * h * s * s * d,
                                                     2 * q.nbytes + qkv + lse + 1 + 8 + qkv)


def test_packed_attention_counts_as_the_separate_one():
    b, s, h, d = 2, 8, 2, 4
    packed = _normal(15, (b, s, 3, h, d))

    def loss(x):
        return jnp.sum(ops.attention_packed(x, implementation="fused"))

    r = jaxsub.analyze(loss, packed, compare_optimized=False, grad=True)
    fused = {row.op: row for row in r.ops if row.op in r.targets}
    out, lse = packed.nbytes // 3, b * h * s * 4
    assert (fused["jaxsub_attention_qkv_fwd"].cls, fused["jaxsub_attention_qkv_fwd"].flops,
            fused["jaxsub_attention_qkv_fwd"].bytes) == (CON, 4 * b * h * s * s * d, packed.nbytes + 1 + 8 + out + lse)
    # bwd reads dout, qkv, out, lse, mask, seed; writes dqkv.
    assert (fused["jaxsub_attention_qkv_bwd"].cls, fused["jaxsub_attention_qkv_bwd"].flops,
            fused["jaxsub_attention_qkv_bwd"].bytes) == (CON, 10 * b * h * s * s * d,
                                                         2 * out + 2 * packed.nbytes + lse + 1 + 8)


def test_projected_attention_backward_counts_as_the_separate_one():
    b, s, e, h, d = 2, 8, 6, 2, 4
    x, ws, bs = _normal(16, (b, s, e)), [_normal(17 + i, (e, h, d)) for i in range(3)], None

    def loss(x):
        return jnp.sum(ops.attention_projected(x, ws, bs, implementation="fused"))

    r = jaxsub.analyze(loss, x, compare_optimized=False, grad=True)
    row = {row.op: row for row in r.ops if row.op in r.targets}["jaxsub_attention_bwd_dqkv"]
    out, lse = b * s * h * d * 4, b * h * s * 4
    # reads dout, q, k, v, out, lse, mask, seed; writes dqkv (three outs' worth).
    assert (row.cls, row.flops, row.bytes) == (CON, 10 * b * h * s * s * d, 5 * out + lse + 1 + 8 + 3 * out)


def test_optimized_function_is_compared_with_its_original():
    fast = jaxsub.optimize(block)
    r = jaxsub.analyze(fast, *BLOCK_ARGS)
    assert r.bytes == 10000 and not r.targets
    assert r.optimized.targets == {"jaxsub_layer_norm_fwd", "jaxsub_bias_gelu_dropout_fwd"}


def test_table_and_json(encoder):
    r = jaxsub.analyze(block, *BLOCK_ARGS)
    text = str(r)
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("dot_general"))
    assert row.split()[:7] == ["dot_general", "tensor", "contraction", "f32[4,16]", "1", "1,024", "896"]
    assert "test_analysis.py:" in row and "(block)" in row
    assert any(line.startswith("statistical normalization") and "2,768" in line for line in lines)
    assert "5 zero-cost structural equations not shown" in text
    assert "jaxsub_layer_norm_fwd" in text
    assert f"{r.bytes_reduction_pct:.2f}% fewer" in text
    d = json.loads(r.to_json())
    assert d == r.to_dict() and d["bytes"] == 10000 and d["optimized"]["bytes"] == r.optimized.bytes
    assert analysis.Analysis.from_dict(d).to_dict() == d


def test_time_without_gpu_warns_and_returns_the_counts():
    if jax.default_backend() == "gpu":
        pytest.skip("CPU behaviour")
    with pytest.warns(UserWarning, match="GPU"):
        r = jaxsub.analyze(block, *BLOCK_ARGS, time=True, compare_optimized=False)
    assert r.timing is None and r.bytes == 10000


@pytest.mark.gpu
def test_time_on_gpu_reports_memory_efficiency():
    r = jaxsub.analyze(block, *BLOCK_ARGS, time=True, compare_optimized=False)
    t = r.timing
    assert t["time_s"] > 0 and t["bandwidth_Bps"] > 1e11
    assert t["memory_efficiency"] == pytest.approx(r.bytes / t["bandwidth_Bps"] / t["time_s"])


def test_slices_move_their_window_not_the_array():
    # A dynamic_update_slice into a [64, 256] buffer writes one [1, 256] row in place; a
    # dynamic_slice reads one row: 2 x 1 KB each, not 2 x 64 KB.
    def f(buf, row, i):
        buf = jax.lax.dynamic_update_slice(buf, row, (i, 0))
        return jax.lax.dynamic_slice(buf, (i + 1, 0), (1, 256))

    buf, row = jnp.zeros((64, 256), jnp.float32), jnp.ones((1, 256), jnp.float32)
    rows = {r.op: r for r in jaxsub.analyze(f, buf, row, 3).ops}
    assert rows["dynamic_update_slice"].bytes == 2 * 1024
    assert rows["dynamic_slice"].bytes == 2 * 1024


def test_a_function_that_moves_no_bytes_prints():
    """Found by probing: printing raised (the reduction percentage is None at 0 bytes)."""
    text = str(jaxsub.analyze(lambda x: x, _normal(0, (4, 8))))
    assert "data movement: 0 -> 0 bytes" in text
    with pytest.raises(TypeError, match="jaxsub.analyze: `fn` must be callable"):
        jaxsub.analyze(5, _normal(0, (4, 8)))
