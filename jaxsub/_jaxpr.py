"""JAX internals shared across the package: evaluating jaxpr equations (the jaxpr pass and
`jaxsub.stack`) and the arguments of custom_vjp rules defined with symbolic zeros (the
attention family's and `jaxsub.stack`'s)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero


def bind(eqn, vals):
    """Bind eqn's primitive on vals as `jax.core.eval_jaxpr` does; always a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    # Before jax 0.10 this returned (subfuns, params); the subfuns are leading operands.
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _is_primal(p) -> bool:
    return isinstance(p, CustomVJPPrimal)


def primal_values(tree):
    """A forward rule's primal arguments (CustomVJPPrimal leaves) as their values."""
    return jax.tree.map(lambda p: p.value, tree, is_leaf=_is_primal)


def perturbed(tree) -> list:
    """Per leaf of a forward rule's primal arguments: whether the program differentiates it."""
    return [p.perturbed for p in jax.tree.leaves(tree, is_leaf=_is_primal)]


def perturbed_tree(tree):
    """A forward rule's primal arguments (CustomVJPPrimal leaves) as their `perturbed` flags."""
    return jax.tree.map(lambda p: p.perturbed, tree, is_leaf=_is_primal)


def as_primals(values, flags):
    """`values` as a forward rule's primal arguments again, with `flags` (perturbed_tree)."""
    return jax.tree.map(lambda f, v: CustomVJPPrimal(v, f), flags, values)


def is_symbolic_zero(t) -> bool:
    return isinstance(t, SymbolicZero)


def dense_cotangent(ct):
    """A backward rule's cotangent with its symbolic zeros made arrays of zeros."""
    return jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype) if isinstance(t, SymbolicZero) else t, ct,
                        is_leaf=lambda t: isinstance(t, SymbolicZero))
