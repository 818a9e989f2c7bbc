"""The kernel configuration in effect for ops called without an explicit choice.

An op whose behaviour has a tunable choice (today: `attention`'s `implementation`) asks
`lookup(op, signature)` when the caller leaves the choice at None. Outside any `use`
block the answer is {} and the op keeps its built-in default. `jaxsub.optimize(fn,
layouts=...)` evaluates fn inside `use(...)` with a resolver that picks per signature
(timed, cached or modelled; see jaxsub.layout), so matched ops get the selected
configuration without the user's code changing.

The context is a `contextvars.ContextVar`: it follows the Python call stack, so it holds
while a function is traced (jit, grad, vmap all trace in the caller's context) and never
leaks into other threads.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Mapping

# A resolver: (op name, signature) -> {option: value}. The signature is a tuple of
# (name, value) pairs describing the call (shapes, dtype, static options).
Resolver = Callable[[str, tuple], Mapping]

_CURRENT: contextvars.ContextVar[Resolver | None] = contextvars.ContextVar("jaxsub_op_config", default=None)


def lookup(op: str, signature: tuple) -> dict:
    """The configuration the innermost `use` block gives `op` at `signature` ({} if none)."""
    resolver = _CURRENT.get()
    if resolver is None:
        return {}
    return dict(resolver(op, signature) or {})


@contextlib.contextmanager
def use(resolver: Resolver | Mapping | None):
    """Run a block with `resolver` answering `lookup`. A mapping {op: {option: value}}
    applies the same configuration at every signature; None clears any outer block."""
    if isinstance(resolver, Mapping):
        table = {op: dict(cfg) for op, cfg in resolver.items()}

        def resolver(op, signature, _table=table):
            return _table.get(op, {})

    token = _CURRENT.set(resolver)
    try:
        yield
    finally:
        _CURRENT.reset(token)
