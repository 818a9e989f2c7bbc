"""The kernel configuration in effect for ops called without an explicit choice.

An op whose behaviour has a tunable choice (`attention`'s `implementation`; the row ops'
`kernel_config`) asks `lookup(op, signature)` when the caller leaves the choice at None.
Outside any `use` block the answer is {} and the op keeps its built-in default.
`jaxsub.optimize(fn, layouts=...)` evaluates fn inside `use(...)` with a resolver that
picks per signature (timed, cached or modelled; see jaxsub.layout), so matched ops get
the selected configuration without the user's code changing.

The context is a `contextvars.ContextVar`: it follows the Python call stack, so it holds
while a function is traced (jit, grad, vmap all trace in the caller's context) and never
leaks into other threads. It is read at trace time only and is not part of `jax.jit`'s
cache key: a jitted function called again under another block reuses its first trace
(make a new `jax.jit` of the function, or call its `clear_cache()`, to trace it again).
`jaxsub.optimize` enters its block itself, inside its own trace, so this does not arise
there.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

# The ops that ask `lookup`, and the options each reads from its answer.
OPTIONS = {"attention": ("impl",), "layer_norm": ("kernel_config",),
           "bias_dropout_residual_layer_norm": ("kernel_config",), "bias_gelu_dropout": ("kernel_config",)}

# A resolver: (op name, signature) -> {option: value}. The signature is a tuple of
# (name, value) pairs describing the call (shapes, dtype, static options).
Resolver = Callable[[str, tuple], Mapping]

_CURRENT: contextvars.ContextVar[Resolver | None] = contextvars.ContextVar("jaxsub_op_config", default=None)


def lookup(op: str, signature: tuple) -> dict:
    """The configuration the innermost `use` block gives `op` at `signature` ({} if none)."""
    resolver = _CURRENT.get()
    if resolver is None:
        return {}
    answer = resolver(op, signature) or {}
    if not isinstance(answer, Mapping):
        raise TypeError(f"jaxsub.ops.config: the resolver of the `use` block in effect returned {answer!r} for "
                        f"{op}; expected a mapping {{option: value}}")
    return dict(answer)


def current() -> Resolver | None:
    """The resolver of the innermost `use` block (None outside any): for code that traces
    a user's function again later, outside that block (jaxsub.stack.scan's rules under
    jax.checkpoint), to run it under the same answers."""
    return _CURRENT.get()


@contextlib.contextmanager
def use(resolver: Resolver | Mapping | None):
    """Run a block with `resolver` answering `lookup`. A mapping {op: {option: value}}
    applies the same configuration at every signature (its ops and options must be among
    `OPTIONS`: a misspelt name raises instead of being ignored); None clears any outer
    block."""
    if isinstance(resolver, Mapping):
        bad = {op: cfg for op, cfg in resolver.items() if not isinstance(cfg, Mapping)}
        if bad:
            raise TypeError(f"jaxsub.ops.config.use: each op's configuration must be a mapping {{option: value}}, "
                            f"got {bad!r}")
        unknown = {op: sorted(set(cfg) - set(OPTIONS[op])) if op in OPTIONS else None
                   for op, cfg in resolver.items()}
        for op, extra in unknown.items():
            if extra is None:
                raise ValueError(f"jaxsub.ops.config.use: no op {op!r} takes a configuration; expected any of "
                                 f"{sorted(OPTIONS)}")
            if extra:
                raise ValueError(f"jaxsub.ops.config.use: {op} has no option {extra[0]!r}; expected any of "
                                 f"{OPTIONS[op]}")
        table = {op: dict(cfg) for op, cfg in resolver.items()}

        def resolver(op, signature, _table=table):
            return _table.get(op, {})
    elif resolver is not None and not callable(resolver):
        raise TypeError(f"jaxsub.ops.config.use: expects a mapping {{op: {{option: value}}}}, a resolver "
                        f"(op, signature) -> mapping, or None; got {resolver!r}")

    token = _CURRENT.set(resolver)
    try:
        yield
    finally:
        _CURRENT.reset(token)


# ---------------------------------------------------------------------------------------
# Kernel configurations of the row ops (layer_norm, bias_dropout_residual_layer_norm,
# bias_gelu_dropout): the launch shape of their CUDA kernels, forward and backward each
# (cuda/ABI.md: the attributes block_threads and max_elems; 0 = the built-in default).

KERNEL_CONFIG_KEYS = ("fwd_threads", "fwd_elems", "bwd_threads", "bwd_elems")
_ELEMS = (4, 8, 16, 32)


class KernelConfig(NamedTuple):
    """The launch shape of a row op's CUDA kernels, the checked form of its `kernel_config`
    argument (a mapping with any of these keys; missing keys and 0 keep the built-in
    defaults, cuda/ABI.md).

    fwd_threads, bwd_threads: threads per block of the forward / backward kernel, a
      multiple of 32 in [32, 1024] (rows per block = threads / threads per row).
    fwd_elems, bwd_elems: elements per thread at most, 4, 8, 16 or 32 (fewer means more
      threads per row).

    The kernels relax a value a row cannot use (a row wider than the block gets a block of
    its own; a long row takes more elements per thread). A configuration changes speed and
    the order of the f32 sums (results agree within the testing tolerances), never the
    dropout mask; the CPU handlers check it and ignore it. Being a NamedTuple it is static
    and hashable, so it passes through custom_vjp as a non-differentiable argument.
    """

    fwd_threads: int = 0
    fwd_elems: int = 0
    bwd_threads: int = 0
    bwd_elems: int = 0

    def attrs(self, direction: str) -> dict:
        """The FFI attributes of the "fwd" or "bwd" call."""
        return {"block_threads": np.int32(getattr(self, direction + "_threads")),
                "max_elems": np.int32(getattr(self, direction + "_elems"))}


def _check_kernel_config(op: str, value, origin: str = "") -> KernelConfig:
    what = f"jaxsub.{op}: `kernel_config`{origin}"
    if isinstance(value, KernelConfig):
        value = value._asdict()
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be None or a mapping with keys among {KERNEL_CONFIG_KEYS}, got {value!r}")
    unknown = sorted(set(value) - set(KERNEL_CONFIG_KEYS), key=str)
    if unknown:
        raise ValueError(f"{what} has unknown keys {unknown}; expected any of {KERNEL_CONFIG_KEYS}")
    for key, v in value.items():
        if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)):
            raise ValueError(f"{what} {key!r} must be an int, got {v!r}")
        if key.endswith("_threads") and not (v == 0 or (32 <= v <= 1024 and v % 32 == 0)):
            raise ValueError(f"{what} {key!r} (threads per block) must be 0 (the default) or a multiple of 32 "
                             f"in [32, 1024], got {v}")
        if key.endswith("_elems") and v not in (0, *_ELEMS):
            raise ValueError(f"{what} {key!r} (elements per thread) must be 0 (the default) or one of {_ELEMS}, "
                             f"got {v}")
    return KernelConfig(**{k: int(v) for k, v in value.items()})


def kernel_config(op: str, value, signature: tuple, caller: str | None = None) -> KernelConfig:
    """The kernel configuration a row op runs with: `value` (the op's `kernel_config`
    argument) when given, else the "kernel_config" entry of `lookup(op, signature)`, else
    the defaults. TypeError/ValueError naming `caller` (the public function called, `op`
    by default) and `kernel_config` when it is bad."""
    caller = caller or op
    if value is not None:
        return _check_kernel_config(caller, value)
    value = lookup(op, signature).get("kernel_config")
    if value is None:
        return KernelConfig()
    return _check_kernel_config(caller, value, " from the configuration in effect")


def row_signature(x, param_dtype, **static) -> tuple:
    """What a row op's kernel configuration may depend on: the key under which it asks
    `lookup` (x's shape and dtype, the parameters' dtype, the op's static options)."""
    return (("shape", tuple(int(n) for n in x.shape)), ("dtype", np.dtype(x.dtype).name),
            ("param_dtype", np.dtype(param_dtype).name), *sorted(static.items()))
