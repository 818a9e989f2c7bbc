"""Attention (issue #3): jaxsub fused and unfused against plain XLA and cuDNN, bf16.

Run: `python -m bench.attention` (GPU; a few minutes, mostly compilation;
`--cases` splits it),
`python -m bench.attention --small` (tiny shapes, a CPU smoke run: its timings mean
nothing), `python -m bench.attention --floors` (the computed floors only, no timing).

Cases, q/k/v [B, S, H, D] bf16, scale 1/sqrt(D), self-attention (Sq = Sk = S):
- bert: BERT-large attention, B=8, S=512, H=16, D=64, no mask.
- bert-pad: the same with a key-padding mask [B, S]: key j of sequence b is visible when
  j < length[b], lengths drawn in [S/2, S] with the first sequence full.
- causal: B=2, S=2048, H=16, D=128, causal.
- `--shape B,S,H,D[,causal|padded]` (repeatable) adds a case of that shape, named after it
  (e.g. `--shape 2,2048,16,64` is case b2s2048h16d64); given without `--cases`, only the
  given shapes run. H may be H/H_kv: grouped-query attention, k and v with H_kv heads
  (plain XLA repeats them to H; `--shape 2,2048,32/8,128,causal` is b2s2048h32kv8d128-causal).

Rows, each forward ("fwd") and forward + backward ("fwd+bwd": `jax.vjp` with a random
cotangent; the output and all of dq, dk, dv are returned):
- fused: `jaxsub.ops.attention(implementation="fused")`, dropout 0.1 and 0.0. Without a
  CUDA fused kernel in the build it falls back to the unfused path (one log line); the
  run prints and records what actually ran ("runs").
- unfused: `implementation="unfused"` (score GEMM, fused softmax-dropout, GEMM), dropout 0.1.
- xla: plain XLA attention as a user writes it (Flax's `dot_product_attention`): einsum of
  the pre-scaled q with k in bf16, mask by `jnp.where`, softmax in f32 cast to bf16,
  dropout 0.1 as a multiply by `jax.random.bernoulli` keep / (1 - rate), einsum with v.
  The baseline of "vs XLA".
- cudnn: `jax.nn.dot_product_attention(implementation="cudnn")`, no dropout (it has
  none); key padding passed as `key_value_seq_lengths`. GPU only: where it fails (always
  on CPU) the error is recorded and the run goes on.
- Not run unless named in `--impls`: fused_bcast and xla_bcast, the fused and the plain-XLA
  rows with Flax's default dropout (`broadcast_dropout=True`: one [Sq, Sk] keep mask for
  every batch and head; plain XLA draws `bernoulli` of shape [1, 1, Sq, Sk]).

softmax_dropout alone: `jaxsub.ops.softmax_dropout` on scores [8, 16, 512, 512] (scale
1/8, dropout 0.1) against plain XLA (softmax in f32, `jax.random.bernoulli` dropout, cast
back), fwd and fwd+bwd, next to its memory floor: bytes that the ABI.md targets must move
(fwd: read scores, seed; write y, lse; bwd: read dy, scores, lse, seed; write dscores)
over the copy bandwidth measured at the start of the run, and over 4.17 TB/s (the H200
copy bandwidth in TARGETS.md), so runs with a low measured bandwidth stay comparable.

Columns:
- µs: device time of one application (slope method of bench/timing.py: one jitted
  function applies the op to K distinct input sets; (t(K2) - t(K1)) / (K2 - K1)).
- TFLOP/s: attention matmul flops over µs. Convention (FlashAttention's, so numbers
  compare with published ones): forward = 4·B·H·Sq·Sk·D (Q·Kᵀ and P·V), halved when
  causal; backward = 2.5 × forward (dV, dP, dQ, dK and the recomputed Q·Kᵀ), so
  fwd+bwd = 3.5 × forward. Every implementation is credited the same flops, whatever it
  recomputes; key padding does not reduce the count; dropout adds none.
- vs XLA: t(plain XLA with dropout 0.1, same case and pass) / t(row).
- vs cuDNN: t(cuDNN without dropout) / t(row). Above 1 means the row is faster; the
  TARGETS.md goal is fused with dropout fwd+bwd >= 1.
- floor µs, ×floor (softmax rows): the memory floor at the run's bandwidth and at 4.17 TB/s,
  and the row's time over each.

Before timing, each case is checked at dropout 0.1 with one key: fused, unfused and
`reference_attention` with `keep = jaxsub.ops.dropout_mask(key, (B, H, Sq, Sk), 0.1)` (the
mask the kernels use), outputs and dq/dk/dv, pairwise within `jaxsub.testing` tolerance;
softmax_dropout likewise against `reference_softmax_dropout`. A failed check, or an error
timing any row but cuDNN, is printed, kept in the JSON and makes the run exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxsub
from bench import report, timing
from jaxsub import _ffi, testing
from jaxsub.ops import attn as attn_module
from jaxsub.ops import softmax as softmax_module

RATE = 0.1
DTYPE = jnp.bfloat16
PASSES = ("fwd", "fwd+bwd")
BWD_FLOPS_PER_FWD = 2.5
# H200 ceilings measured in TARGETS.md, for floors that do not depend on this run.
H200_COPY_BYTES_PER_S = 4.17e12
H200_MATMUL_FLOPS_PER_S = 707e12
DEFAULT_JSON = pathlib.Path(__file__).parent / "results" / "attention.json"
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int
    s: int
    h: int
    d: int
    causal: bool
    padded: bool
    h_kv: int | None = None  # k/v heads (grouped-query attention); None: H

    @property
    def qkv_shape(self) -> tuple[int, int, int, int]:
        return (self.b, self.s, self.h, self.d)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.b, self.s, self.h_kv or self.h, self.d)

    def describe(self) -> str:
        extra = ", causal" if self.causal else ", key padding" if self.padded else ""
        heads = f"{self.h}/{self.h_kv}" if self.h_kv else f"{self.h}"
        return f"B={self.b} S={self.s} H={heads} D={self.d}{extra}"


@dataclasses.dataclass(frozen=True)
class Size(timing.RunSize):
    cases: dict[str, Case]
    softmax_shape: tuple[int, int, int, int]


def _cases(*cases: Case) -> dict[str, Case]:
    return {c.name: c for c in cases}


# K1 = 2 sets already exceed the 60 MB L2 (bert: 2 x 32 MB of q, k, v, cotangent; softmax:
# 2 x 128 MB of scores and cotangent); K2 = 6 keeps the unrolled K-application functions
# quick to compile, so the full run fits in one 10-minute GPU command.
FULL = Size(
    cases=_cases(Case("bert", 8, 512, 16, 64, causal=False, padded=False),
                 Case("bert-pad", 8, 512, 16, 64, causal=False, padded=True),
                 Case("causal", 2, 2048, 16, 128, causal=True, padded=False),
                 Case("short", 96, 128, 16, 64, causal=False, padded=False)),  # the b96 x s128 layer's
    softmax_shape=(8, 16, 512, 512), k1=2, k2=6,
    copy_buffer_bytes=64 << 20, copy_k1=4, copy_k2=16, repeats=10)
# Same case names and code paths; the sizes only keep a CPU run short.
SMALL = Size(
    cases=_cases(Case("bert", 2, 64, 2, 32, causal=False, padded=False),
                 Case("bert-pad", 2, 64, 2, 32, causal=False, padded=True),
                 Case("causal", 1, 128, 2, 64, causal=True, padded=False),
                 Case("short", 4, 32, 2, 32, causal=False, padded=False)),
    softmax_shape=(2, 2, 64, 64), k1=1, k2=2,
    copy_buffer_bytes=4 << 20, copy_k1=2, copy_k2=6, repeats=3)


# ---------------------------------------------------------------------------------------
# Flops and floors (computed, not measured).


def attention_flops(case: Case, pass_: str) -> float:
    fwd = 4.0 * case.b * case.h * case.s * case.s * case.d * (0.5 if case.causal else 1.0)
    return fwd if pass_ == "fwd" else fwd * (1.0 + BWD_FLOPS_PER_FWD)


def attention_floor_bytes(case: Case, pass_: str) -> int:
    """Bytes the fused ABI.md targets must move: fwd reads q, k, v, mask, seed and writes
    out, lse; bwd reads dout, q, k, v, out, lse, mask, seed and writes dq, dk, dv. The bwd
    workspaces are scratch and not counted; the key-padding mask is [B, 1, 1, S] pred."""
    act = math.prod(case.qkv_shape) * jnp.dtype(DTYPE).itemsize  # q, out, dout, dq
    act_kv = math.prod(case.kv_shape) * jnp.dtype(DTYPE).itemsize  # k, v, dk, dv
    lse = case.b * case.h * case.s * 4
    mask = case.b * case.s if case.padded else 0
    fwd = 2 * act + 2 * act_kv + lse + mask + 8
    return fwd if pass_ == "fwd" else fwd + 4 * act + 4 * act_kv + lse + mask + 8


def softmax_floor_bytes(shape, pass_: str) -> int:
    """ABI.md traffic of softmax_dropout (no mask): fwd reads scores, seed and writes y,
    lse; bwd reads dy, scores, lse, seed and writes dscores."""
    act = math.prod(shape) * jnp.dtype(DTYPE).itemsize
    lse = math.prod(shape[:-1]) * 4
    fwd = 2 * act + lse + 8
    return fwd if pass_ == "fwd" else fwd + 3 * act + lse + 8


def computed_floors(size: Size, bandwidth: float | None = None) -> list[dict]:
    """Per case and pass: flops, the matmul floor at 707 TFLOP/s and the fused memory
    floor at 4.17 TB/s (and at `bandwidth`, when given); then the softmax floors."""
    out = []
    for case in size.cases.values():
        for pass_ in PASSES:
            flops, nbytes = attention_flops(case, pass_), attention_floor_bytes(case, pass_)
            out.append({
                "case": case.name, "shape": case.describe(), "pass": pass_, "flops": flops,
                "matmul_floor_us_at_707": flops / H200_MATMUL_FLOPS_PER_S * 1e6,
                "floor_bytes": nbytes, "floor_us_at_4.17": nbytes / H200_COPY_BYTES_PER_S * 1e6,
                "floor_us": nbytes / bandwidth * 1e6 if bandwidth else None,
            })
    for pass_ in PASSES:
        nbytes = softmax_floor_bytes(size.softmax_shape, pass_)
        out.append({
            "case": "softmax", "shape": str(list(size.softmax_shape)), "pass": pass_, "flops": None,
            "matmul_floor_us_at_707": None, "floor_bytes": nbytes,
            "floor_us_at_4.17": nbytes / H200_COPY_BYTES_PER_S * 1e6,
            "floor_us": nbytes / bandwidth * 1e6 if bandwidth else None,
        })
    return out


def format_floors(floors: list[dict]) -> str:
    header = ("case", "shape", "pass", "GFLOP", "matmul µs @707", "floor MB", "floor µs @4.17")
    lines = [[f["case"], f["shape"], f["pass"], report.fmt(None if f["flops"] is None else f["flops"] / 1e9, ".2f"),
              report.fmt(f["matmul_floor_us_at_707"]), f"{f['floor_bytes'] / 1e6:.2f}",
              report.fmt(f["floor_us_at_4.17"])] for f in floors]
    return report.format_table(header, lines, text_columns=3)


# ---------------------------------------------------------------------------------------
# Implementations: each `make(case, mask, lengths)` returns `apply(args, key)`.


def xla_attention(q, k, v, *, mask, causal: bool, rate: float, key, broadcast: bool = False):
    """Plain XLA attention as written in jnp (after Flax's dot_product_attention); k and
    v with fewer heads (grouped-query) repeated to q's; `broadcast`: Flax's
    broadcast_dropout, one keep mask for every batch and head."""
    k, v = attn_module.repeat_kv(q, k, v)
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(_F32)
    visible = None if mask is None else mask[:, None, None, :]
    if causal:
        tri = jnp.tril(jnp.ones(logits.shape[-2:], jnp.bool_))
        visible = tri if visible is None else visible & tri
    if visible is not None:
        logits = jnp.where(visible, logits, jnp.finfo(_F32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    if rate > 0.0:
        keep = jax.random.bernoulli(key, 1.0 - rate, (1, 1, *weights.shape[2:]) if broadcast else weights.shape)
        weights = weights * (keep.astype(q.dtype) / jnp.asarray(1.0 - rate, q.dtype))
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _jaxsub(implementation: str, rate: float, broadcast: bool = False):
    def make(case: Case, mask, lengths):
        def apply(a, key):
            return jaxsub.ops.attention(*a, mask=mask, causal=case.causal, dropout_rate=rate, key=key,
                                        implementation=implementation, broadcast_dropout=broadcast)
        return apply
    return make


def _xla(case: Case, mask, lengths, broadcast: bool = False):
    return lambda a, key: xla_attention(*a, mask=mask, causal=case.causal, rate=RATE, key=key, broadcast=broadcast)


def _cudnn(case: Case, mask, lengths):
    return lambda a, key: jax.nn.dot_product_attention(
        *a, is_causal=case.causal, key_value_seq_lengths=lengths, implementation="cudnn")


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    label: str
    rate: float
    make: Callable
    optional: bool = False       # an error is recorded but does not fail the run
    default: bool = True         # run unless --impls names others


IMPLS = {
    i.name: i
    for i in (
        Impl("fused", "jaxsub fused", RATE, _jaxsub("fused", RATE)),
        Impl("fused_nodrop", "jaxsub fused", 0.0, _jaxsub("fused", 0.0)),
        Impl("unfused", "jaxsub unfused", RATE, _jaxsub("unfused", RATE)),
        Impl("xla", "plain XLA", RATE, _xla),
        Impl("cudnn", "cuDNN", 0.0, _cudnn, optional=True),
        Impl("fused_bcast", "jaxsub fused", RATE, _jaxsub("fused", RATE, broadcast=True), default=False),
        Impl("xla_bcast", "plain XLA", RATE, functools.partial(_xla, broadcast=True), default=False),
    )
}
DEFAULT_IMPLS = [name for name, impl in IMPLS.items() if impl.default]
BASELINE, CUDNN = "xla", "cudnn"


def fused_runs(q) -> str:
    """What `implementation="fused"` runs for inputs like `q` (attn.py's routing)."""
    why_not = attn_module._fused_unsupported(q)
    if why_not is not None:
        return f"unfused path (fallback: {why_not})"
    platform = next(iter(q.devices())).platform
    return "fused CUDA kernel" if platform == "gpu" else f"fused {platform} handler"


def key_padding(case: Case, seed: int):
    """(mask [B, S] bool, lengths [B] int32), or (None, None) for an unpadded case."""
    if not case.padded:
        return None, None
    rng = np.random.default_rng(seed)
    lengths = rng.integers(case.s // 2, case.s + 1, size=case.b).astype(np.int32)
    lengths[0] = case.s
    return jnp.asarray(np.arange(case.s)[None, :] < lengths[:, None]), jnp.asarray(lengths)


# ---------------------------------------------------------------------------------------
# Correctness spot checks.


def _value_and_grads(apply, args, cotangent, extra):
    y, vjp = jax.vjp(lambda *a: apply(a, extra), *args)
    return (y, *vjp(cotangent))


def _run_vjp(apply: Callable, args, cotangent, extra):
    """Output and gradients of `apply(args, extra)`, jitted. `extra` (a key or a keep-mask)
    is an argument, not a closure: a closed-over [B, H, S, S] mask would be embedded in
    the program as a constant of up to 134 MB."""
    return jax.jit(functools.partial(_value_and_grads, apply))(args, cotangent, extra)


def _compare(results: dict[str, tuple], names: tuple[str, ...], reduction: int, what: str) -> str:
    """'ok' when every pair of `results` agrees within tolerance, else 'FAILED: ...'."""
    labels = list(results)
    try:
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                for name, x, y in zip(names, results[a], results[b]):
                    testing.assert_close(x, y, DTYPE, reduction, grad=name != names[0],
                                         what=f"{what} {name}: {a} vs {b}")
    except AssertionError as e:
        return f"FAILED: {e}"
    return "ok"


def check_attention(case: Case, mask, args, cotangent, key) -> str:
    def reference(a, keep):
        return attn_module.reference_attention(*a, mask=mask, causal=case.causal, keep=keep, rate=RATE)

    try:
        keep = jaxsub.ops.dropout_mask(key, (case.b, case.h, case.s, case.s), RATE)
        results = {
            "fused": _run_vjp(IMPLS["fused"].make(case, mask, None), args, cotangent, key),
            "unfused": _run_vjp(IMPLS["unfused"].make(case, mask, None), args, cotangent, key),
            "reference": _run_vjp(reference, args, cotangent, keep),
        }
    except Exception as e:  # noqa: BLE001 - a crash is a failed check, reported with the rest
        return f"FAILED: {report.reason(e)}"
    return _compare(results, ("out", "dq", "dk", "dv"), max(case.s, case.d), case.name)


def check_softmax(apply: Callable, scores, cotangent, key, scale: float) -> str:
    """`apply(args, key)` (the timed softmax_dropout row) against the reference."""
    def reference(a, keep):
        return softmax_module.reference_softmax_dropout(a[0], scale=scale, keep=keep, rate=RATE)

    try:
        keep = jaxsub.ops.dropout_mask(key, scores.shape, RATE)
        results = {"softmax_dropout": _run_vjp(apply, (scores,), cotangent, key),
                   "reference": _run_vjp(reference, (scores,), cotangent, keep)}
    except Exception as e:  # noqa: BLE001 - a crash is a failed check, reported with the rest
        return f"FAILED: {report.reason(e)}"
    return _compare(results, ("y", "dscores"), scores.shape[-1], "softmax")


# ---------------------------------------------------------------------------------------
# Timing and rows.


def time_row(apply: Callable, pass_: str, data, size: Size, repeats: int):
    """(µs, SlopeTiming, kernels µs, {kernel: µs}) or (None, 'failed: ...', None, {})."""
    sets, keys, cotangents = data
    try:
        t = timing.time_applications(apply, pass_, sets, keys, cotangents, size.k1, size.k2, repeats=repeats)
        kernel_us, kernels = timing.kernel_time_applications(apply, pass_, sets, keys, cotangents, size.k1)
    except Exception as e:  # noqa: BLE001 - recorded in the row; the run goes on
        return None, f"failed: {report.reason(e)}", None, {}
    return t.per_call_s * 1e6, t, kernel_us, kernels


def _row(case: str, shape, pass_: str, impl: str, label: str, rate: float, runs: str, check: str,
         timed, optional: bool = False) -> dict:
    us, detail, kernel_us, kernels = timed
    return {
        "kernel_us": kernel_us, "kernels": kernels,
        "case": case, "shape": list(shape), "pass": pass_, "impl": impl, "label": label, "rate": rate,
        "optional": optional,
        "runs": runs, "check": check, "us": us, "status": "ok" if us is not None else detail,
        "timing": detail.as_dict() if us is not None else None, "reliable": us is not None and detail.reliable,
        "flops": None, "tflops": None, "speedup_vs_xla": None, "vs_cudnn": None,
        "floor_bytes": None, "floor_us": None, "floor_us_at_4.17": None,
        "over_floor": None, "over_floor_at_4.17": None,
    }


def _print_row(row: dict) -> None:
    print(f"    {row['pass']:8s} {row['impl']:12s} {report.fmt(row['us']):>10s} us"
          f" (kernels {report.fmt(row['kernel_us'])})"
          + ("" if row["status"] == "ok" else f"  {row['status']}")
          + ("" if row["reliable"] or row["us"] is None else "  (slope not positive: t(K2)/K2)"), flush=True)


def bench_case(case: Case, size: Size, impls: list[str], repeats: int, seed: int) -> list[dict]:
    mask, lengths = key_padding(case, seed)
    data = timing.random_sets([(case.qkv_shape, DTYPE), (case.kv_shape, DTYPE), (case.kv_shape, DTYPE)],
                              (case.qkv_shape, DTYPE), size.k2, seed)
    sets, keys, cotangents = data
    check = check_attention(case, mask, sets[0], cotangents[0], keys[0])
    runs = fused_runs(sets[0][0])
    print(f"  {case.name} ({case.describe()}) check: {check}; fused runs: {runs}", flush=True)
    rows = []
    for pass_ in PASSES:
        flops = attention_flops(case, pass_)
        for name in impls:
            impl = IMPLS[name]
            row = _row(case.name, case.qkv_shape, pass_, name, impl.label, impl.rate,
                       runs if name.startswith("fused") else impl.label, check,
                       time_row(impl.make(case, mask, lengths), pass_, data, size, repeats), impl.optional)
            row["flops"] = flops
            row["tflops"] = None if row["us"] is None else flops / row["us"] / 1e6
            rows.append(row)
            _print_row(row)
    by_impl = {(r["pass"], r["impl"]): r["us"] for r in rows}
    for r in rows:
        r["speedup_vs_xla"] = report.ratio(by_impl.get((r["pass"], BASELINE)), r["us"])
        r["vs_cudnn"] = report.ratio(by_impl.get((r["pass"], CUDNN)), r["us"])
    return rows


def xla_softmax_dropout(scores, *, scale: float, rate: float, key):
    p = jax.nn.softmax(scores.astype(_F32) * scale, axis=-1)
    keep = jax.random.bernoulli(key, 1.0 - rate, p.shape)
    return jnp.where(keep, p / (1.0 - rate), 0.0).astype(scores.dtype)


def bench_softmax(size: Size, bandwidth: float, repeats: int, seed: int) -> list[dict]:
    shape = size.softmax_shape
    scale = 1.0 / 8.0
    data = timing.random_sets([(shape, DTYPE)], (shape, DTYPE), size.k2, seed)
    sets, keys, cotangents = data
    impls = (
        ("softmax_dropout", "jaxsub softmax_dropout",
         lambda a, key: jaxsub.ops.softmax_dropout(a[0], scale=scale, rate=RATE, key=key)),
        ("xla", "plain XLA softmax + bernoulli",
         lambda a, key: xla_softmax_dropout(a[0], scale=scale, rate=RATE, key=key)),
    )
    check = check_softmax(impls[0][2], sets[0][0], cotangents[0], keys[0], scale)
    print(f"  softmax {list(shape)} check: {check}", flush=True)
    rows = []
    for pass_ in PASSES:
        floor_bytes = softmax_floor_bytes(shape, pass_)
        for name, label, apply in impls:
            row = _row("softmax", shape, pass_, name, label, RATE, label, check,
                       time_row(apply, pass_, data, size, repeats))
            row["floor_bytes"] = floor_bytes
            row["floor_us"] = floor_bytes / bandwidth * 1e6
            row["floor_us_at_4.17"] = floor_bytes / H200_COPY_BYTES_PER_S * 1e6
            row["over_floor"] = report.ratio(row["us"], row["floor_us"])
            row["over_floor_at_4.17"] = report.ratio(row["us"], row["floor_us_at_4.17"])
            row["kernels_over_floor_at_4.17"] = report.ratio(row["kernel_us"], row["floor_us_at_4.17"])
            rows.append(row)
            _print_row(row)
        xla_us = rows[-1]["us"]
        for r in rows[-2:]:
            r["speedup_vs_xla"] = report.ratio(xla_us, r["us"])
    return rows


def format_table(rows: list[dict]) -> str:
    header = ("case", "pass", "impl", "runs", "dropout", "µs", "kernels µs", "TFLOP/s", "vs XLA", "vs cuDNN",
              "floor µs", "floor µs @4.17", "×floor", "×floor @4.17")
    f = report.fmt
    lines = [[r["case"], r["pass"], r["impl"], r["runs"], f(r["rate"]), f(r["us"]), f(r["kernel_us"]), f(r["tflops"]),
              f(r["speedup_vs_xla"], ".2f"), f(r["vs_cudnn"], ".2f"), f(r["floor_us"]),
              f(r["floor_us_at_4.17"]), f(r["over_floor"], ".2f"), f(r["over_floor_at_4.17"], ".2f")]
             for r in rows]
    return report.format_table(header, lines, text_columns=4)


def parse_shape(text: str) -> Case:
    """argparse type of --shape: "B,S,H,D" with an optional ",causal" or ",padded"; H may
    be "H/H_kv" (grouped-query: k and v with H_kv heads, H_kv dividing H)."""
    parts = [t.strip() for t in text.split(",")]
    flag = parts.pop() if parts and parts[-1] in ("causal", "padded") else ""
    heads = parts[2].split("/") if len(parts) == 4 else []
    try:
        dims = [int(t) for t in parts[:2] + heads[:1] + parts[3:]]
        h_kv = int(heads[1]) if len(heads) == 2 else None
    except (ValueError, IndexError):
        dims, h_kv = [], None
    if len(dims) != 4 or min(dims) <= 0 or len(heads) > 2 or (h_kv is not None and (h_kv <= 0 or dims[2] % h_kv)):
        raise argparse.ArgumentTypeError(f"expected B,S,H,D or B,S,H/H_kv,D (positive integers, H_kv dividing H) "
                                         f"and optionally ,causal or ,padded; got {text!r}")
    b, s, h, d = dims
    kv = f"kv{h_kv}" if h_kv else ""
    name = f"b{b}s{s}h{h}{kv}d{d}" + {"causal": "-causal", "padded": "-pad", "": ""}[flag]
    return Case(name, b, s, h, d, causal=flag == "causal", padded=flag == "padded", h_kv=h_kv)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke run; its timings mean nothing")
    p.add_argument("--cases", type=report.csv_choices(FULL.cases), default=None,
                   help=f"comma-separated subset of {','.join(FULL.cases)} (default: all, or none with --shape)")
    p.add_argument("--shape", type=parse_shape, action="append", default=[], metavar="B,S,H[/H_kv],D[,causal|padded]",
                   help="an extra case of that shape, q/k/v [B, S, H, D] (repeatable)")
    p.add_argument("--impls", type=report.csv_choices(IMPLS), default=DEFAULT_IMPLS,
                   help=f"comma-separated subset of {','.join(IMPLS)} (default {','.join(DEFAULT_IMPLS)}; "
                        "ratios need xla and cudnn)")
    p.add_argument("--no-softmax", action="store_true", help="skip the softmax_dropout rows")
    p.add_argument("--floors", action="store_true", help="print the computed flops and floors and exit")
    report.add_run_arguments(p, DEFAULT_JSON, FULL.repeats, SMALL.repeats)
    return report.parse_run_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    size = SMALL if args.small else FULL
    if args.floors:
        print(format_floors(computed_floors(size)))
        return 0
    repeats = args.repeats or size.repeats
    backend = report.print_run_header()
    if args.small:
        print("note: --small uses tiny shapes; its timings (and ratios) mean nothing")
    has_fused = _ffi.has_cuda_target("jaxsub_attention_fwd")
    print(f"CUDA fused attention target (jaxsub_attention_fwd) built: {has_fused}")
    bandwidth, copy = report.measure_copy_bandwidth(size.copy_buffer_bytes, size.copy_k1, size.copy_k2,
                                                    repeats=repeats, seed=args.seed)

    names = args.cases if args.cases is not None else ([] if args.shape else list(size.cases))
    cases = [size.cases[n] for n in names] + args.shape
    rows = []
    for case in cases:
        rows += bench_case(case, size, args.impls, repeats, args.seed)
    if not args.no_softmax:
        rows += bench_softmax(size, bandwidth, repeats, args.seed)

    result = {
        **report.run_metadata(backend, args.small, repeats), "dtype": jnp.dtype(DTYPE).name, "rate": RATE,
        "cuda_fused_attention_target": has_fused, "bwd_flops_per_fwd": BWD_FLOPS_PER_FWD,
        "copy_bandwidth_bytes_per_s": bandwidth, "copy_timing": copy.as_dict(),
        "cases": {c.name: dataclasses.asdict(c) for c in cases},
        "floors": computed_floors(size, bandwidth), "method": __doc__, "rows": rows,
    }
    report.write_json(args.json, result)
    print()
    print(format_table(rows))
    failed = sorted({r["case"] for r in rows if r["check"].startswith("FAILED")})
    errors = sorted({f"{r['case']} {r['pass']} {r['impl']}" for r in rows if r["us"] is None and not r["optional"]})
    if failed:
        print(f"correctness check FAILED for: {', '.join(failed)}", file=sys.stderr)
    if errors:
        print(f"timing failed for: {', '.join(errors)}", file=sys.stderr)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
