"""Fused memory-bound ops against plain XLA, at BERT-large sizes, next to their memory floor.

Run: `python -m bench.ops` (GPU), `python -m bench.ops --small` (seconds, CPU smoke run).

For each op (layer_norm, bias_dropout_residual_layer_norm, bias_gelu_dropout), dtype and
pass (fwd, fwd+bwd) two implementations are timed in the same process:

- jaxsub: the fused op (`jaxsub.ops.*`), dropout from its Philox seed.
- XLA: the op's pure-JAX reference (what a user writes in jnp) under `jax.jit`, with the
  keep-mask drawn by `jax.random.bernoulli` inside the jitted function.

fwd+bwd is `jax.vjp` of the op with a random cotangent, returning the output and every
gradient. Inputs and parameters are fresh random normal draws, one set per application.

Timing (see bench/timing.py): one jitted function applies the op to K distinct input sets
and returns all outputs; the median time of whole calls is taken at K1 and K2, and the
slope (t(K2) - t(K1)) / (K2 - K1) is the device time of one application, free of dispatch
overhead. At BERT-large sizes K1 = 8 sets already exceed the 60 MB L2.

Memory floor: bytes that must move for one application (each input read once, each output
written once, as listed for the op's FFI targets in cuda/ABI.md, parameters, f32
statistics and the dropout seed included) over the copy bandwidth measured at the start of
the run (negation of >= 1 GiB of distinct buffers; bytes read + written). The fwd+bwd
floor is the fwd floor plus the bwd floor.

Same-size copy: the kernel time of an XLA negation whose f32 buffer is read and written
for a pass's floor bytes in all, taken over distinct buffers that together exceed twice
the L2; fwd+bwd adds one such copy for the forward's bytes and one for the backward's. It
is what plain kernels moving those bytes cost at this size (launch, ramp and tail
included), a practical floor beside the bandwidth floor; GPU only.

Before timing, the fused op's output is checked against the reference (deterministic, and
with dropout using `jaxsub.ops.dropout_mask`) within `jaxsub.testing` tolerance. An op (or
reference) that raises NotImplementedError is reported as such and not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxsub
import jaxsub.ops.gelu as gelu_module
import jaxsub.ops.norm as norm_module
from bench import report, timing
from jaxsub import testing

RATE = 0.1
EPS = 1e-5
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "f32": jnp.float32}
DEFAULT_JSON = pathlib.Path(__file__).parent / "results" / "ops.json"


@dataclasses.dataclass(frozen=True)
class Size(timing.RunSize):
    rows: int


# BERT-large: batch 8 x sequence 512 rows. The copy measurement reaches 1 GiB at K2.
FULL = Size(rows=8 * 512, k1=8, k2=32, copy_buffer_bytes=64 << 20, copy_k1=4, copy_k2=16, repeats=10)
SMALL = Size(rows=128, k1=1, k2=3, copy_buffer_bytes=4 << 20, copy_k1=2, copy_k2=6, repeats=5)

# What each tensor named in ABI.md is: [R, N] activation, [N] parameter, f32 [R]
# statistic, or the u32[2] dropout seed.
_ACTIVATIONS = {"x", "residual", "y", "dy", "dx", "dresidual"}
_PARAMETERS = {"scale", "bias", "ln_bias", "dscale", "dbias", "dln_bias"}
_STATISTICS = {"mean", "rstd"}


def traffic_bytes(names, rows: int, cols: int, dtype, param_dtype) -> int:
    """Bytes of the tensors `names` (ABI.md names) for an [rows, cols] problem."""
    total = 0
    for name in names:
        if name in _ACTIVATIONS:
            total += rows * cols * jnp.dtype(dtype).itemsize
        elif name in _PARAMETERS:
            total += cols * jnp.dtype(param_dtype).itemsize
        elif name in _STATISTICS:
            total += rows * 4
        elif name == "seed":
            total += 8
        else:
            raise ValueError(f"traffic_bytes: unknown tensor {name!r}")
    return total


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    cols: int                      # BERT-large width
    small_cols: int
    inputs: tuple[str, ...]        # differentiable inputs, in call order
    dropout: bool
    reduction: bool                # outputs depend on a reduction over the row
    fwd_reads: tuple[str, ...]     # per ABI.md
    fwd_writes: tuple[str, ...]
    bwd_reads: tuple[str, ...]
    bwd_writes: tuple[str, ...]
    fused: Callable                # (args, key, deterministic) -> y
    reference: Callable            # (args, keep) -> y; keep None = no dropout

    def floor_bytes(self, pass_: str, rows: int, cols: int, dtype, param_dtype) -> int:
        fwd = traffic_bytes(self.fwd_reads + self.fwd_writes, rows, cols, dtype, param_dtype)
        if pass_ == "fwd":
            return fwd
        return fwd + traffic_bytes(self.bwd_reads + self.bwd_writes, rows, cols, dtype, param_dtype)

    def xla(self, args, key):
        keep = jax.random.bernoulli(key, 1.0 - RATE, args[0].shape) if self.dropout else None
        return self.reference(args, keep)


def _reference(module, name: str) -> Callable:
    """The op module's reference, looked up at call time; a worktree whose op module does
    not define it yet reports the op as not implemented instead of failing the run."""
    fn = getattr(module, name, None)
    if fn is None:
        raise NotImplementedError(f"{module.__name__}.{name} is not defined")
    return fn


OPS = {
    op.name: op
    for op in (
        Op(
            name="layer_norm", cols=1024, small_cols=128, inputs=("x", "scale", "bias"),
            dropout=False, reduction=True,
            fwd_reads=("x", "scale", "bias"), fwd_writes=("y", "mean", "rstd"),
            bwd_reads=("dy", "x", "scale", "mean", "rstd"), bwd_writes=("dx", "dscale", "dbias"),
            fused=lambda a, key, det: jaxsub.ops.layer_norm(*a, eps=EPS),
            reference=lambda a, keep: _reference(norm_module, "reference_layer_norm")(*a, eps=EPS),
        ),
        Op(
            name="bdrln", cols=1024, small_cols=128,
            inputs=("x", "bias", "residual", "scale", "ln_bias"), dropout=True, reduction=True,
            fwd_reads=("x", "bias", "residual", "scale", "ln_bias", "seed"),
            fwd_writes=("y", "mean", "rstd"),
            bwd_reads=("dy", "x", "bias", "residual", "scale", "mean", "rstd", "seed"),
            bwd_writes=("dx", "dbias", "dresidual", "dscale", "dln_bias"),
            fused=lambda a, key, det: jaxsub.ops.bias_dropout_residual_layer_norm(
                *a, rate=RATE, key=key, eps=EPS, deterministic=det),
            reference=lambda a, keep: _reference(norm_module, "reference_bdrln")(
                *a, keep=keep, rate=RATE, eps=EPS),
        ),
        Op(
            name="bias_gelu_dropout", cols=4096, small_cols=512, inputs=("x", "bias"),
            dropout=True, reduction=False,
            fwd_reads=("x", "bias", "seed"), fwd_writes=("y",),
            bwd_reads=("dy", "x", "bias", "seed"), bwd_writes=("dx", "dbias"),
            fused=lambda a, key, det: jaxsub.ops.bias_gelu_dropout(
                *a, rate=RATE, key=key, deterministic=det),
            reference=lambda a, keep: _reference(gelu_module, "reference_bias_gelu_dropout")(
                *a, keep=keep, rate=RATE, approximate=False),
        ),
    )
}
PASSES = ("fwd", "fwd+bwd")


def make_inputs(op: Op, rows: int, cols: int, dtype, param_dtype, count: int, seed: int):
    """`count` distinct input sets, dropout keys and cotangents, all random normal."""
    specs = [((rows, cols), dtype) if name in _ACTIVATIONS else ((cols,), param_dtype) for name in op.inputs]
    return timing.random_sets(specs, ((rows, cols), dtype), count, seed)


def spot_check(op: Op, args, key, dtype) -> str:
    """'ok', 'not implemented: ...', 'skipped: ...' or 'FAILED: ...' for the fused op
    against the reference, deterministic and with the kernels' own dropout mask."""
    try:
        deterministic = op.fused(args, key, True)
        dropped = op.fused(args, key, False) if op.dropout else None
    except NotImplementedError as e:
        return f"not implemented: {report.reason(e)}"
    try:
        expected = op.reference(args, None)
        expected_dropped = (op.reference(args, jaxsub.ops.dropout_mask(key, args[0].shape, RATE))
                            if op.dropout else None)
    except NotImplementedError as e:
        return f"skipped: reference {report.reason(e)}"
    reduction = args[0].shape[-1] if op.reduction else 1
    try:
        testing.assert_close(deterministic, expected, dtype, reduction, what=f"{op.name} deterministic")
        if op.dropout:
            testing.assert_close(dropped, expected_dropped, dtype, reduction, what=f"{op.name} dropout")
    except AssertionError as e:
        return f"FAILED: {e}"
    return "ok"


L2_BYTES = 60 << 20  # H200


def copy_plan(floor_bytes: int) -> tuple[int, int]:
    """(f32 elements per buffer, buffers) for the same-size copy of `floor_bytes`: each
    negation reads and writes 4 bytes per element, about floor_bytes in all; the buffers
    together are at least twice the L2, with at most 64 buffers (problems under ~1 MB
    stay partly in the L2, as they would in a model). The element count is a multiple of
    64: XLA's negation of an odd count uses scalar accesses and ran at 1.6 TB/s on the
    H200 (25 MB and 67 MB copies, bench/NOTES.md v5), which is not the copy we mean."""
    n = max(64, floor_bytes // 8 // 64 * 64)
    return n, min(64, max(2, -(-2 * L2_BYTES // (4 * n))))


@functools.cache
def same_size_copy_us(floor_bytes: int, seed: int) -> float | None:
    """Kernel µs of negations moving `floor_bytes` (see copy_plan: the measured bandwidth
    applied to the exact byte count); None off the GPU (no device events to time).
    Cached: the fwd+bwd row reuses the forward's copy."""
    if jax.default_backend() != "gpu":
        return None
    n, k = copy_plan(floor_bytes)
    bandwidth = timing.copy_bandwidth_kernels(4 * n, k, seed=seed)
    return None if not bandwidth else floor_bytes / bandwidth * 1e6


def time_impl(apply: Callable, pass_: str, sets, keys, cotangents, size: Size, repeats: int):
    """(microseconds per application, SlopeTiming) or (None, reason) if not implemented."""
    try:
        t = timing.time_applications(apply, pass_, sets, keys, cotangents, size.k1, size.k2, repeats=repeats)
    except NotImplementedError as e:
        return None, f"not implemented: {report.reason(e)}"
    return t.per_call_s * 1e6, t


def bench_op(op: Op, dtype_name: str, param_dtype_name: str, size: Size, small: bool,
             bandwidth: float, repeats: int, seed: int) -> list[dict]:
    dtype = DTYPES[dtype_name]
    param_dtype = dtype if param_dtype_name == "same" else DTYPES[param_dtype_name]
    cols = op.small_cols if small else op.cols
    sets, keys, cotangents = make_inputs(op, size.rows, cols, dtype, param_dtype, size.k2, seed)
    check = spot_check(op, sets[0], keys[0], dtype)
    print(f"  {op.name} {dtype_name} [{size.rows}, {cols}] check: {check}", flush=True)
    rows = []
    for pass_ in PASSES:
        results, kernels = {}, {}
        for impl, apply in (("jaxsub", lambda a, key: op.fused(a, key, False)), ("xla", op.xla)):
            if impl == "jaxsub" and check.startswith("not implemented"):
                results[impl] = (None, check)
            else:
                results[impl] = time_impl(apply, pass_, sets, keys, cotangents, size, repeats)
            kernels[impl] = (timing.kernel_time_applications(apply, pass_, sets, keys, cotangents, size.k1)
                             if results[impl][0] is not None else (None, {}))
        floor_bytes = op.floor_bytes(pass_, size.rows, cols, dtype, param_dtype)
        floor_us = floor_bytes / bandwidth * 1e6
        fwd_bytes = op.floor_bytes("fwd", size.rows, cols, dtype, param_dtype)
        copies = [same_size_copy_us(b, seed) for b in ([floor_bytes] if pass_ == "fwd"
                                                        else [fwd_bytes, floor_bytes - fwd_bytes])]
        copy_us = None if None in copies else sum(copies)
        row = {
            "op": op.name, "dtype": dtype_name, "param_dtype": jnp.dtype(param_dtype).name,
            "pass": pass_, "shape": [size.rows, cols], "rate": RATE if op.dropout else 0.0,
            "floor_bytes": floor_bytes, "floor_us": floor_us, "copy_kernel_us": copy_us, "check": check,
        }
        for impl, (us, detail) in results.items():
            row[f"{impl}_us"] = us
            row[f"{impl}_status"] = "ok" if us is not None else detail
            row[f"{impl}_timing"] = detail.as_dict() if us is not None else None
            row[f"{impl}_over_floor"] = report.ratio(us, floor_us)
            row[f"{impl}_kernel_us"], row[f"{impl}_kernels"] = kernels[impl]
            row[f"{impl}_kernel_over_floor"] = report.ratio(kernels[impl][0], floor_us)
            row[f"{impl}_kernel_over_copy"] = report.ratio(kernels[impl][0], copy_us)
        row["speedup"] = report.ratio(row["xla_us"], row["jaxsub_us"])
        rows.append(row)
        print(f"    {pass_:8s} jaxsub {report.fmt(row['jaxsub_us'])} us (kernels {report.fmt(row['jaxsub_kernel_us'])})"
              f"  xla {report.fmt(row['xla_us'])} us (kernels {report.fmt(row['xla_kernel_us'])})"
              f"  floor {floor_us:.1f} us  same-size copy {report.fmt(copy_us)} us", flush=True)
        for name, us in list(row["jaxsub_kernels"].items())[:4]:
            print(f"      {us:8.2f} us  {name[:100]}", flush=True)
        if row["xla_us"] is None:
            print(f"    xla {row['xla_status']}", flush=True)
        noisy = [impl for impl, (us, t) in results.items() if us is not None and not t.reliable]
        if noisy:
            print(f"    {', '.join(noisy)}: slope not positive (noise); reporting t(K2)/K2", flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    header = ("op", "dtype", "pass", "jaxsub µs", "XLA µs", "speedup", "floor µs", "jaxsub/floor", "XLA/floor",
              "jaxsub kernels µs", "XLA kernels µs", "jaxsub kernels/floor", "copy µs", "jaxsub kernels/copy")
    f = report.fmt
    lines = [[r["op"], r["dtype"], r["pass"], f(r["jaxsub_us"]), f(r["xla_us"]), f(r["speedup"], ".2f"),
              f(r["floor_us"]), f(r["jaxsub_over_floor"], ".2f"), f(r["xla_over_floor"], ".2f"),
              f(r["jaxsub_kernel_us"]), f(r["xla_kernel_us"]), f(r["jaxsub_kernel_over_floor"], ".2f"),
              f(r["copy_kernel_us"]), f(r["jaxsub_kernel_over_copy"], ".2f")]
             for r in rows]
    return report.format_table(header, lines, text_columns=3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke run that finishes in seconds")
    p.add_argument("--ops", type=report.csv_choices(OPS), default=list(OPS),
                   help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--dtypes", type=report.csv_choices(DTYPES), default=["bf16", "fp16"],
                   help="comma-separated, from bf16,fp16,f32")
    p.add_argument("--param-dtype", choices=("same", "f32"), default="same",
                   help="parameter dtype: the activation dtype, or f32 (mixed precision)")
    report.add_run_arguments(p, DEFAULT_JSON, FULL.repeats, SMALL.repeats)
    return report.parse_run_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    size = SMALL if args.small else FULL
    repeats = args.repeats or size.repeats
    backend = report.print_run_header()
    bandwidth, copy = report.measure_copy_bandwidth(size.copy_buffer_bytes, size.copy_k1, size.copy_k2,
                                                    repeats=repeats, seed=args.seed)

    rows = []
    for name in args.ops:
        for dtype_name in args.dtypes:
            rows += bench_op(OPS[name], dtype_name, args.param_dtype, size, args.small, bandwidth,
                             repeats, args.seed)

    result = {
        **report.run_metadata(backend, args.small, repeats), "rate": RATE, "eps": EPS,
        "copy_bandwidth_bytes_per_s": bandwidth, "copy_timing": copy.as_dict(),
        "method": __doc__, "rows": rows,
    }
    report.write_json(args.json, result)
    print()
    print(format_table(rows))
    failed = [f"{r['op']} {r['dtype']}" for r in rows if r["check"].startswith("FAILED")]
    if failed:
        print(f"correctness check FAILED for: {', '.join(sorted(set(failed)))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
