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

Before timing, the fused op's output is checked against the reference (deterministic, and
with dropout using `jaxsub.ops.dropout_mask`) within `jaxsub.testing` tolerance. An op (or
reference) that raises NotImplementedError is reported as such and not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxsub
import jaxsub.ops.gelu as gelu_module
import jaxsub.ops.norm as norm_module
from bench import timing
from jaxsub import testing

RATE = 0.1
EPS = 1e-5
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "f32": jnp.float32}
DEFAULT_JSON = pathlib.Path(__file__).parent / "results" / "ops.json"


@dataclasses.dataclass(frozen=True)
class Size:
    rows: int
    k1: int
    k2: int
    copy_buffer_bytes: int
    copy_k1: int
    copy_k2: int
    repeats: int


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
    """`count` distinct input sets, dropout keys and cotangents, all random normal,
    drawn in one jitted call (one compilation instead of one per draw)."""

    def draw(key):
        sets, cotangents = [], []
        for i in range(count):
            set_key, cot_key = jax.random.split(jax.random.fold_in(key, i))
            draws = jax.random.split(set_key, len(op.inputs))
            sets.append(tuple(
                jax.random.normal(k, (rows, cols) if name in _ACTIVATIONS else (cols,), jnp.float32)
                .astype(dtype if name in _ACTIVATIONS else param_dtype)
                for k, name in zip(draws, op.inputs)
            ))
            cotangents.append(jax.random.normal(cot_key, (rows, cols), jnp.float32).astype(dtype))
        return sets, jax.random.split(jax.random.fold_in(key, count), count), cotangents

    return jax.jit(draw)(jax.random.key(seed))


def apply_k(apply: Callable, pass_: str):
    """One jitted function applying `apply(args, key)` to every input set it is given."""

    def run(sets, keys, cotangents):
        outs = []
        for i, args in enumerate(sets):
            def f(*a, key=keys[i]):
                return apply(a, key)
            if pass_ == "fwd":
                outs.append(f(*args))
            else:
                y, vjp = jax.vjp(f, *args)
                outs.append((y, vjp(cotangents[i])))
        return outs

    return jax.jit(run)


def spot_check(op: Op, args, key, dtype) -> str:
    """'ok', 'not implemented: ...', 'skipped: ...' or 'FAILED: ...' for the fused op
    against the reference, deterministic and with the kernels' own dropout mask."""
    try:
        deterministic = op.fused(args, key, True)
        dropped = op.fused(args, key, False) if op.dropout else None
    except NotImplementedError as e:
        return f"not implemented: {_reason(e)}"
    try:
        expected = op.reference(args, None)
        expected_dropped = (op.reference(args, jaxsub.ops.dropout_mask(key, args[0].shape, RATE))
                            if op.dropout else None)
    except NotImplementedError as e:
        return f"skipped: reference {_reason(e)}"
    reduction = args[0].shape[-1] if op.reduction else 1
    try:
        testing.assert_close(deterministic, expected, dtype, reduction, what=f"{op.name} deterministic")
        if op.dropout:
            testing.assert_close(dropped, expected_dropped, dtype, reduction, what=f"{op.name} dropout")
    except AssertionError as e:
        return f"FAILED: {e}"
    return "ok"


def time_impl(apply: Callable, pass_: str, sets, keys, cotangents, size: Size, repeats: int):
    """(microseconds per application, SlopeTiming) or (None, reason) if not implemented."""
    fn = apply_k(apply, pass_)

    def build(k):
        return fn, (sets[:k], keys[:k], cotangents[:k])

    try:
        t = timing.slope_time(build, size.k1, size.k2, repeats=repeats)
    except NotImplementedError as e:
        return None, f"not implemented: {_reason(e)}"
    return t.per_call_s * 1e6, t


def _reason(e: Exception) -> str:
    return str(e) or "stub raises NotImplementedError"


def _ratio(a, b):
    return a / b if a is not None and b is not None and b > 0 else None


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
        results = {}
        for impl, apply in (("jaxsub", lambda a, key: op.fused(a, key, False)), ("xla", op.xla)):
            if impl == "jaxsub" and check.startswith("not implemented"):
                results[impl] = (None, check)
            else:
                results[impl] = time_impl(apply, pass_, sets, keys, cotangents, size, repeats)
        floor_bytes = op.floor_bytes(pass_, size.rows, cols, dtype, param_dtype)
        floor_us = floor_bytes / bandwidth * 1e6
        row = {
            "op": op.name, "dtype": dtype_name, "param_dtype": jnp.dtype(param_dtype).name,
            "pass": pass_, "shape": [size.rows, cols], "rate": RATE if op.dropout else 0.0,
            "floor_bytes": floor_bytes, "floor_us": floor_us, "check": check,
        }
        for impl, (us, detail) in results.items():
            row[f"{impl}_us"] = us
            row[f"{impl}_status"] = "ok" if us is not None else detail
            row[f"{impl}_timing"] = detail.as_dict() if us is not None else None
            row[f"{impl}_over_floor"] = _ratio(us, floor_us)
        row["speedup"] = _ratio(row["xla_us"], row["jaxsub_us"])
        rows.append(row)
        print(f"    {pass_:8s} jaxsub {_fmt(row['jaxsub_us'])} us  xla {_fmt(row['xla_us'])} us  "
              f"floor {floor_us:.1f} us", flush=True)
        if row["xla_us"] is None:
            print(f"    xla {row['xla_status']}", flush=True)
        noisy = [impl for impl, (us, t) in results.items() if us is not None and not t.reliable]
        if noisy:
            print(f"    {', '.join(noisy)}: slope not positive (noise); reporting t(K2)/K2", flush=True)
    return rows


def _fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    header = ("op", "dtype", "pass", "jaxsub µs", "XLA µs", "speedup", "floor µs", "jaxsub/floor", "XLA/floor")
    lines = [[r["op"], r["dtype"], r["pass"], _fmt(r["jaxsub_us"]), _fmt(r["xla_us"]),
              _fmt(r["speedup"], ".2f"), _fmt(r["floor_us"]), _fmt(r["jaxsub_over_floor"], ".2f"),
              _fmt(r["xla_over_floor"], ".2f")] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = [" | ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines]
    return "\n".join(out)


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke run that finishes in seconds")
    p.add_argument("--ops", type=_csv(OPS), default=list(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--dtypes", type=_csv(DTYPES), default=["bf16", "fp16"], help="comma-separated, from bf16,fp16,f32")
    p.add_argument("--param-dtype", choices=("same", "f32"), default="same",
                   help="parameter dtype: the activation dtype, or f32 (mixed precision)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per K (median); default 10, 5 with --small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=pathlib.Path, default=DEFAULT_JSON, help=f"output path (default {DEFAULT_JSON})")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    size = SMALL if args.small else FULL
    repeats = args.repeats or size.repeats
    backend = jax.default_backend()
    print(f"device {timing.describe_device()}; jax {jax.__version__}; cuda kernels built and visible: "
          f"{jaxsub.cuda_available()}")
    if backend == "cpu":
        print("note: running on CPU; CPU timings say nothing about GPU speed")

    bandwidth, copy = timing.copy_bandwidth(size.copy_buffer_bytes, size.copy_k1, size.copy_k2,
                                            repeats=repeats, seed=args.seed)
    if not copy.reliable:
        print("copy bandwidth: slope not positive (noise); using t(K2)/K2, a lower bound on bandwidth")
    print(f"copy bandwidth (read + write, negation of {size.copy_k2} x {size.copy_buffer_bytes >> 20} MiB): "
          f"{bandwidth / 1e12:.3f} TB/s", flush=True)

    rows = []
    for name in args.ops:
        for dtype_name in args.dtypes:
            rows += bench_op(OPS[name], dtype_name, args.param_dtype, size, args.small, bandwidth,
                             repeats, args.seed)

    result = {
        "device": timing.describe_device(), "backend": backend, "jax_version": jax.__version__,
        "small": args.small, "repeats": repeats, "rate": RATE, "eps": EPS,
        "copy_bandwidth_bytes_per_s": bandwidth, "copy_timing": copy.as_dict(),
        "method": __doc__, "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    print()
    print(format_table(rows))
    failed = [f"{r['op']} {r['dtype']}" for r in rows if r["check"].startswith("FAILED")]
    if failed:
        print(f"correctness check FAILED for: {', '.join(sorted(set(failed)))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
