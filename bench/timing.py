"""Device-time measurement shared by the op, layer and model benchmarks.

Method (DESIGN.md, "Benchmarks"):

1. The thing to time is wrapped in ONE jitted function that applies it to K distinct input
   sets and returns every output, so nothing is dead-code-eliminated and the working set
   (K sets) is larger than the GPU's L2 (60 MB on an H200): each application reads from
   DRAM, as it would inside a real model.
2. A whole call is timed from the host, ending with `jax.block_until_ready`, after warm-up
   calls (compilation, autotuning, allocator growth). The median over `repeats` calls is
   kept; the median ignores the occasional preempted call.
3. The per-application time is the slope between two values of K,
   (t(K2) - t(K1)) / (K2 - K1): launch and dispatch overhead, which is the same for both
   calls, cancels. Calls at K1 and K2 are interleaved so slow drift of the clock or of
   other load affects both alike.
4. When the slope is not positive (timing noise larger than the work, which only happens
   for tiny problems such as a CPU smoke run), t(K2) / K2 is reported instead: an upper
   bound, flagged `reliable=False`.

Copy bandwidth is measured the same way with negation of K distinct f32 buffers; bytes
moved = bytes read + bytes written.

`random_sets` and `apply_k` build the K-application functions for any op given as
`apply(args, key)`: the forward alone, or `jax.vjp` with a random cotangent returning the
output and every gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxsub import _timing


@dataclasses.dataclass(frozen=True)
class SlopeTiming:
    """Per-application device time from calls at two sizes K1 < K2."""

    per_call_s: float
    k1: int
    k2: int
    t_k1_s: float
    t_k2_s: float
    reliable: bool

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RunSize:
    """How much timing a benchmark run does: K1 < K2 input sets per op, the copy-bandwidth
    buffers (K2 of them should reach 1 GiB on a GPU) and the timed calls per K. Each
    benchmark extends it with its problem sizes."""

    k1: int
    k2: int
    copy_buffer_bytes: int
    copy_k1: int
    copy_k2: int
    repeats: int


median_times = _timing.median_times


def slope_time(build: Callable[[int], tuple[Callable, Sequence]], k1: int, k2: int, *,
               repeats: int, warmup: int = 2) -> SlopeTiming:
    """Time per application of an op from `build(k) -> (jitted_fn, args)`, which applies
    the op to k distinct input sets in one call."""
    if not 0 < k1 < k2:
        raise ValueError(f"slope_time: need 0 < k1 < k2, got k1={k1}, k2={k2}")
    t1, t2 = median_times([build(k1), build(k2)], repeats=repeats, warmup=warmup)
    seconds, reliable = _timing.slope(t1, t2, k1, k2)
    return SlopeTiming(seconds, k1, k2, t1, t2, reliable=reliable)


def random_sets(specs: Sequence[tuple[tuple[int, ...], object]], cotangent: tuple[tuple[int, ...], object],
                count: int, seed: int):
    """`count` distinct input sets (one array per (shape, dtype) in `specs`), dropout keys
    and cotangents (of shape, dtype `cotangent`), all random normal, drawn in one jitted
    call (one compilation instead of one per draw)."""

    def draw(key):
        sets, cotangents = [], []
        for i in range(count):
            set_key, cot_key = jax.random.split(jax.random.fold_in(key, i))
            draws = jax.random.split(set_key, len(specs))
            sets.append(tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype)
                              for k, (shape, dtype) in zip(draws, specs)))
            cot_shape, cot_dtype = cotangent
            cotangents.append(jax.random.normal(cot_key, cot_shape, jnp.float32).astype(cot_dtype))
        return sets, jax.random.split(jax.random.fold_in(key, count), count), cotangents

    return jax.jit(draw)(jax.random.key(seed))


@functools.cache
def apply_k(apply: Callable, pass_: str):
    """One jitted function applying `apply(args, key)` to every input set it is given:
    pass_ "fwd" returns the outputs, "fwd+bwd" the outputs and all gradients. Cached per
    (apply, pass_), so the slope timing and the kernel trace of a row share one compile."""

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


def time_applications(apply: Callable, pass_: str, sets, keys, cotangents, k1: int, k2: int, *,
                      repeats: int) -> SlopeTiming:
    """Slope time of one application of `apply(args, key)` (see `apply_k`) over the given
    input sets; exceptions from tracing, compiling or running propagate to the caller."""
    fn = apply_k(apply, pass_)

    def build(k):
        return fn, (sets[:k], keys[:k], cotangents[:k])

    return slope_time(build, k1, k2, repeats=repeats)


def kernel_time_applications(apply: Callable, pass_: str, sets, keys, cotangents, k: int):
    """Profiler-trace kernel time of one application over k input sets (bench/trace.py):
    (µs, {kernel: µs}), or (None, {}) without device events. Unlike the slope, this is
    the kernels alone: launch gaps between them are not counted."""
    from bench import trace

    return trace.per_application(apply_k(apply, pass_), (sets[:k], keys[:k], cotangents[:k]), k)


def copy_bandwidth(buffer_bytes: int, k1: int, k2: int, *, repeats: int, seed: int = 0) -> tuple[float, SlopeTiming]:
    """Device copy bandwidth in bytes/s (read + write) from negating K distinct f32
    buffers of `buffer_bytes` each; K2 * buffer_bytes should be >= 1 GiB on a GPU."""
    n = buffer_bytes // 4
    keys = jax.random.split(jax.random.key(seed), k2)
    buffers = [jax.random.normal(keys[i], (n,), jnp.float32) for i in range(k2)]
    negate_all = jax.jit(lambda bufs: [-b for b in bufs])

    def build(k):
        return negate_all, (buffers[:k],)

    timing = slope_time(build, k1, k2, repeats=repeats)
    return 2 * 4 * n / timing.per_call_s, timing


def copy_bandwidth_kernels(buffer_bytes: int, k: int, *, seed: int = 0) -> float | None:
    """Copy bandwidth from the negation kernels' own device time in a profiler trace
    (bench/trace.py); None without device events."""
    from bench import trace

    n = buffer_bytes // 4
    keys = jax.random.split(jax.random.key(seed), k)
    buffers = [jax.random.normal(keys[i], (n,), jnp.float32) for i in range(k)]
    us, _ = trace.per_application(jax.jit(lambda bufs: [-b for b in bufs]), (buffers,), k)
    return None if not us else 2 * 4 * n / (us * 1e-6)


def describe_device() -> str:
    device = jax.devices()[0]
    return f"{device.platform}: {device.device_kind}"
