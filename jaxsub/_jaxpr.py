"""Evaluating jaxpr equations, shared by the jaxpr pass and `jaxsub.stack`."""

from __future__ import annotations


def bind(eqn, vals):
    """Bind eqn's primitive on vals as `jax.core.eval_jaxpr` does; always a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    # Before jax 0.10 this returned (subfuns, params); the subfuns are leading operands.
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]
