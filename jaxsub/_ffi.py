"""Loads the native extension once and registers every FFI target for cpu and CUDA."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _jaxpr, _partition

log = logging.getLogger("jaxsub")

# Longest row (last dimension) the row kernels take (ABI.md); wider rows use the reference.
MAX_COLS = 16384
# Rows of the GPU's parameter-gradient workspaces (ABI.md: C = clamp(R, 1, 256)).
WORKSPACE_ROWS = 256

try:
    from jaxsub import _C
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "jaxsub's native extension (jaxsub._C) is not built. Install the package with "
        "`pip install .` (or `make setup`), and do not import jaxsub from a source tree "
        "that has no build in it."
    ) from e


@functools.cache
def _cuda_targets() -> dict:
    """The CUDA handlers to register: the default table, plus the staged ones
    (cuda/targets.h) when JAXSUB_STAGED_CUDA=1 (for testing them on a GPU)."""
    targets = dict(_C.cuda_targets())
    if os.environ.get("JAXSUB_STAGED_CUDA") == "1":
        targets.update(_C.cuda_staged_targets())
    return targets


@functools.cache
def register() -> None:
    """Registers all targets (idempotent; registration happens once per process)."""
    for name, capsule in _C.cpu_targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    for name, capsule in _cuda_targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


@functools.cache
def has_cuda_target(name: str) -> bool:
    """Whether `name` has a CUDA handler registered in this process."""
    return name in _cuda_targets()


def cuda_built() -> bool:
    return bool(_C.built_with_cuda)


def cuda_available() -> bool:
    """True when CUDA targets were built and a CUDA device is visible to JAX."""
    if not cuda_built():
        return False
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def attention_sm90() -> bool:
    """Whether fused attention at head dims 64 and 128 runs the wgmma (sm_90a) kernels now:
    the CUDA handlers' own decision (sm_90a device code built, a compute capability 9.0
    device, JAXSUB_ATTENTION_SM90 not "0"); False without a CUDA build or a GPU."""
    return cuda_built() and bool(_C.attention_sm90())


def dense_gelu_sm90() -> bool:
    """Whether the dense_gelu_fwd target (CUTLASS's GEMM with the GELU epilogue) runs on
    the current GPU: built with CUTLASS and sm_90a device code, a compute capability 9.0
    device. False without a CUDA build or a GPU."""
    return cuda_available() and bool(_C.dense_gelu_sm90())


def dense_gelu_enabled() -> bool:
    """Whether `ops.dense_bias_gelu_dropout` runs the dense_gelu_fwd target on the GPU:
    only when JAXSUB_DENSE_GELU=1 (read at trace time) and dense_gelu_sm90(). Off by
    default: its epilogue measured slower than the GEMM and the GELU kernel apart
    (bench/NOTES.md, twenty-fourth and twenty-fifth sessions)."""
    return os.environ.get("JAXSUB_DENSE_GELU") == "1" and dense_gelu_sm90()


@functools.cache
def gemm_tune(dtype: str, m: int, n: int, k: int, trans_a: bool, trans_b: bool, bias: bool, c: bool,
              workspace_bytes: int) -> tuple[int, tuple[float, ...]]:
    """The gemm target's cuBLASLt algorithm for a shape (`c`: with a c operand) on the
    current GPU, timed among the heuristic's candidates once per process (cuda/gemm.h):
    (index in the heuristic's order, each candidate's µs or -1). (-1, ()) without a CUDA
    build or a GPU. Called while a product is traced: XLA may later capture the call into
    a CUDA graph, where the handler cannot time."""
    if not cuda_available():
        return -1, ()
    index, times = _C.gemm_tune(dtype, m, n, k, trans_a, trans_b, bias, c, workspace_bytes)
    result = int(index), tuple(float(t) for t in times)
    _TUNINGS[(dtype, m, n, k, trans_a, trans_b, bias, c)] = result
    return result


_TUNINGS: dict[tuple, tuple[int, tuple[float, ...]]] = {}


def gemm_tunings() -> list[dict]:
    """Every shape `gemm_tune` has timed in this process, in the order first timed: the
    shape, the pick (index in cuBLASLt's heuristic order) and each candidate's µs. The
    encoder benchmark writes them into its JSON, so that two runs' picks can be compared."""
    names = ("dtype", "m", "n", "k", "trans_a", "trans_b", "bias", "c")
    return [{**dict(zip(names, key)), "index": index, "times_us": list(times)}
            for key, (index, times) in _TUNINGS.items()]


def platform_of(x) -> str:
    """The platform an operand lives on ("cpu", "gpu", ...): its device's for a concrete
    jax.Array, the default backend's for a tracer or a host (NumPy) value."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return next(iter(x.devices())).platform
    return jax.default_backend()


def target_unsupported(x, target: str) -> str | None:
    """Why `target` cannot run where x lives (None: it can): every target has a CPU
    handler; on a GPU it needs its CUDA handler registered; no other platform has one."""
    platform = platform_of(x)
    if platform == "gpu" and not has_cuda_target(target):
        return f"no CUDA {target} target in this build"
    if platform not in ("cpu", "gpu"):
        return f"no {target} target for platform {platform!r}"
    return None


def check_bool(op: str, name: str, value) -> bool:
    """A Python bool flag as a bool, or a TypeError naming the function and the argument
    (a string such as "no" would otherwise count as True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"jaxsub.{op}: `{name}` must be a Python bool, got {value!r}")
    return bool(value)


@functools.cache
def _warn_once(key: str, message: str) -> None:
    log.warning(message)


def fallback(op: str, reason: str, instead: str = "the reference implementation") -> None:
    """One log line per (op, reason) when an op runs something other than its kernel."""
    _warn_once(f"{op}:{reason}", f"jaxsub.{op}: {reason}; using {instead}")


def workspace(x, k: int) -> jax.ShapeDtypeStruct:
    """The f32 [C, k, N] scratch result of a row kernel's backward over x [..., N]."""
    rows = math.prod(x.shape[:-1])
    return jax.ShapeDtypeStruct((min(max(rows, 1), WORKSPACE_ROWS), k, x.shape[-1]), jnp.float32)


def context_mesh():
    """The abstract mesh in effect (shard_map's, pmap's, `jax.sharding.use_mesh`'s), or
    None where this jax has no such notion."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    return None if get is None else get()


def inside_shard_map() -> bool:
    """Whether the trace is inside shard_map (manual mesh axes in effect): only there do
    values carry the mesh axes they vary over."""
    mesh = context_mesh()
    return mesh is None or bool(getattr(mesh, "manual_axes", True))


def varying_axes(x) -> frozenset:
    """The manual mesh axes (shard_map's) that x's value varies over; empty outside."""
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        return frozenset()
    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval) -> frozenset:
    """The manual mesh axes that a value of type `aval` varies over."""
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; `vma` before
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", None) or ())


def varying(tree, axes: frozenset):
    """`tree` with each array leaf typed as varying over `axes` (shard_map with check_vma:
    `lax.pcast` to "varying", whose transpose sums a cotangent over those axes)."""
    def cast(x):
        missing = axes - varying_axes(x) if isinstance(x, (jax.Array, jax.core.Tracer)) else None
        return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree.map(cast, tree) if axes else tree


# Tracer classes of JAX's differentiation: `jax.jvp` (and jacfwd, hessian's outer level)
# traces with JVPTracers; `jax.grad`, `vjp` and `linearize` with LinearizeTracers.
_JVP_TRACERS = frozenset({"JVPTracer"})
_LINEARIZE_TRACERS = frozenset({"LinearizeTracer"})
FORWARD_MODE = "forward-mode or higher-order differentiation (jax.jvp, jacfwd, hessian, grad of grad)"
PULLBACK = ("a derivative of its backward kernels' results (of grad through jit, checkpoint or scan, or of a vjp "
            "pullback)")
THROUGH_RULES = ("a derivative of its forward kernels' results (of grad through jit, checkpoint or scan: "
                 "hessian(jit(f)))")


def _zero_tangent(x):
    """A zero tangent for the value x (float0 for integers)."""
    dtype, shape = (x.dtype if hasattr(x, "dtype") else jnp.result_type(x)), np.shape(x)
    return jnp.zeros(shape, dtype) if jnp.issubdtype(dtype, jnp.inexact) else np.zeros(shape, jax.dtypes.float0)


def _like(grads, tangents):
    """`tangents` (the reference VJP's, one per differentiable argument) in the structure of
    `grads` (a backward rule's, with None for an argument it gives no gradient)."""
    out = []
    for g, t in zip(grads, tangents):
        leaves, tree = jax.tree.flatten(g, is_leaf=lambda x: x is None)
        parts = tree.flatten_up_to(t)
        out.append(jax.tree.unflatten(tree, [None if leaf is None else part for leaf, part in zip(leaves, parts)]))
    return type(grads)(out) if isinstance(grads, tuple) else out


@jax.tree_util.register_pytree_node_class
class _Kept:
    """What a forward rule keeps for its backward rule's derivative (`custom_vjp.defvjp`):
    the arguments not among its residuals (leaves), and the static plan of where each
    argument's leaf is found (in the residuals, here, or zeros)."""

    def __init__(self, extra: tuple, plan: tuple):
        self.extra, self.plan = extra, plan

    def tree_flatten(self):
        return (self.extra,), self.plan

    @classmethod
    def tree_unflatten(cls, plan, children):
        return cls(children[0], plan)


def beyond_first_reverse(tree) -> bool:
    """Whether the leaves of `tree` are traced for differentiation that a `custom_vjp`
    cannot take: forward mode (a JVP trace at any level of nesting: jax.jvp, jacfwd,
    hessian) or reverse mode over reverse mode (two linearize traces, on one leaf as grad
    of grad makes them or on two leaves, as a gradient penalty's inner grad over inputs
    and outer grad over parameters do)."""
    linearize = set()
    for x in jax.tree.leaves(tree):
        for _ in range(64):  # the levels of nested transformations, innermost first
            if not isinstance(x, jax.core.Tracer):
                break
            kind = type(x).__name__
            if kind in _JVP_TRACERS:
                return True
            if kind in _LINEARIZE_TRACERS:
                linearize.add(id(getattr(x, "_trace", x)))
                if len(linearize) > 1:
                    return True
            x = getattr(x, "primal", getattr(x, "val", None))
    return False


class _TraceFlag:
    """A flag that is part of JAX's trace context (a JAX configuration state), so that a body
    JAX traced and cached with the flag off (a `jax.checkpoint`'s or a `jax.jit`'s in a scanned
    layer) is traced again with it on; a thread-local flag, which such cached bodies do not
    see, where this jax has no such states."""

    def __init__(self, name: str, doc: str):
        self._local = threading.local()
        try:
            from jax._src import config as jax_config

            # (JAX reads a state's default from the environment variable of its name in
            # capitals: these no user sets.)
            self._state = jax_config.bool_state(f"jaxsub_internal_{name}", False, f"jaxsub: {doc} (set by jaxsub "
                                                "itself)", include_in_trace_context=True)
        except Exception:  # noqa: BLE001 (a jax without the private API, or the name taken)
            self._state = None

    @contextlib.contextmanager
    def on(self):
        if self._state is not None:
            with self._state(True):
                yield
            return
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    def __bool__(self) -> bool:
        if self._state is not None:
            return bool(self._state.value)
        return getattr(self._local, "depth", 0) > 0


_REFERENCES = _TraceFlag("trace_with_references", "every fused op runs as its jnp reference (forward-mode and "
                         "higher-order derivatives)")
_UNWRAPPED = _TraceFlag("unwrapped_rules", "the fused ops' rules run their kernels unwrapped")


def references():
    """Within it every op runs its jnp reference (`custom_vjp`), also in the bodies traced
    meanwhile (a scan's, a jit's, a checkpoint's), where the tracers of a forward-mode
    transformation around the caller do not reach: `optimize`, `stack.scan` and the Flax
    encoder modules open it when their arguments are traced beyond a first reverse
    derivative."""
    return _REFERENCES.on()


def references_forced() -> bool:
    return bool(_REFERENCES)


def unwrapped_rules():
    """Within it the ops' rules run their kernels as they are, without the custom_jvp
    wrappers and the kept arguments of `custom_vjp.defvjp`: `stack.scan` finds the kernels'
    custom calls in its step to write their results in place and stores every residual of
    the step's pullback, and its own `custom_vjp` takes the rules' derivatives with the
    whole loop's reference."""
    return _UNWRAPPED.on()


class custom_vjp:
    """`jax.custom_vjp` for jaxsub's ops, made right inside `shard_map`: the array
    arguments are cast to the union of the mesh axes they vary over before the call, so
    that each gradient's type is its argument's, and a replicated argument (a parameter
    next to a sharded activation) gets its gradient summed over the devices by the cast's
    transpose, as JAX's own ops do. Under an Explicit mesh (`jax.set_mesh`) the op runs
    with the mesh's axes Auto (`_in_auto_axes`). Otherwise it is jax.custom_vjp.

    A custom_vjp has a first reverse-mode derivative only. Where the arguments are traced
    for more (`beyond_first_reverse`: jax.jvp, jacfwd, hessian, grad of grad), the call
    runs the op's jnp reference instead (`defreference`; the same dropout mask, drawn from
    the seed), which JAX differentiates to any order; so does every op inside `references()`.
    That takes the transformation applied around the op's call (or around `optimize`'s or
    `stack.scan`'s); a forward-mode one applied to a jitted function, a `lax.scan` or a
    `jax.checkpoint` that calls the op sees only its traced body and raises JAX's error, as
    for any custom_vjp. A derivative that reaches the rules' results (grad of a jitted grad, a
    pullback's derivative) takes the reference's derivatives there (`defvjp`)."""

    def __init__(self, fun, nondiff_argnums=()):
        self._fun = jax.custom_vjp(fun, nondiff_argnums=nondiff_argnums)
        self._nondiff_order = tuple(nondiff_argnums)
        self._nondiff = frozenset(nondiff_argnums)
        self._reference = None
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd, bwd, symbolic_zeros: bool = False):
        """jax.custom_vjp's defvjp, with the kernels' results differentiable: the forward
        rule's kernels and the backward rule's are each a `jax.custom_jvp` whose derivative
        is the op's reference's (its JVP; the JVP of its VJP at the arguments). A custom_vjp
        rule is differentiated where a transformation reaches its rules' results and not the
        op's call: grad of a jitted, checkpointed or scanned grad (hessian(jit(f)) among
        them), and jax.jvp or jax.vjp of a pullback with respect to its cotangent. First
        derivatives inline the custom_jvp calls and run the kernels alone.

        The backward rule's derivative needs the arguments: it finds them among the
        residuals (`_Kept`: where the forward rule returned an argument itself as a
        residual), takes zeros for those the op is affine in (`defreference`'s `affine`: its
        VJP does not depend on them), and the residuals keep the rest beside their own (of
        jaxsub's ops, `dense_attention_packed`'s bias and the stack's initial carry). The
        residuals that are arguments leave the forward's custom_jvp as the arguments
        themselves: returned through it, a `lax.scan` stacked them as computed values."""
        def fwd_rule(*args):
            if _UNWRAPPED or self._reference is None:
                out, res = fwd(*args)
                return out, (res, None)
            return self._fwd_with_jvp(fwd, args, symbolic_zeros)

        def bwd_rule(*args):
            fixed, (res, kept), ct = args[:-2], args[-2], args[-1]
            if kept is None:
                return bwd(*fixed, res, ct)
            return self._bwd_with_jvp(bwd, fixed, res, kept, ct)

        self._fun.defvjp(fwd_rule, bwd_rule, symbolic_zeros=symbolic_zeros)

    def defreference(self, op: str, reference, affine: tuple = ()):
        """`reference`: the op in differentiable jnp, with the same arguments (the
        non-differentiable ones included) and results; `op` names it in the log line.
        `affine`: the positions of arguments the op is affine in (x + dropout(y) in x and y),
        whose values its VJP does not read."""
        self._reference = (op, reference, frozenset(affine))

    def _call_reference(self, fixed_at: dict, count: int) -> Callable:
        """The reference as a function of the differentiable arguments, the others held
        (`fixed_at`: position -> value; `count` arguments in all)."""
        reference = self._reference[1]

        def call(*xs):
            it = iter(xs)
            return reference(*(fixed_at[i] if i in fixed_at else next(it) for i in range(count)))

        return call

    def _fwd_with_jvp(self, fwd, args, symbolic_zeros):
        count = len(args)
        diff_at = [i for i in range(count) if i not in self._nondiff]
        fixed_at = {i: args[i] for i in self._nondiff_order}
        values = [_jaxpr.primal_values(args[i]) if symbolic_zeros else args[i] for i in diff_at]
        # (symbolic_zeros: the forward rule takes CustomVJPPrimal leaves; their `perturbed`
        # flags are static, their values the custom_jvp's arguments)
        flags = [_jaxpr.perturbed_tree(args[i]) if symbolic_zeros else None for i in diff_at]
        traced = {}  # per residual leaf, the argument leaf it is (or None), found while tracing

        def kernels(*vals):
            full = dict(fixed_at)
            for i, v, f in zip(diff_at, vals, flags):
                full[i] = _jaxpr.as_primals(v, f) if symbolic_zeros else v
            out, res = fwd(*(full[i] for i in range(count)))
            at = {id(x): j for j, x in enumerate(jax.tree.leaves(vals))}
            leaves, traced["tree"] = jax.tree.flatten(res)
            traced["args"] = tuple(at.get(id(r)) for r in leaves)
            # The residuals that are arguments leave through the arguments themselves, so
            # that a scan sees them as its body's inputs (not stacked as computed values).
            return out, [r for r, j in zip(leaves, traced["args"]) if j is None]

        kernels = jax.custom_jvp(kernels)

        @kernels.defjvp
        def _(primals, tangents):
            out, computed = kernels(*primals)
            fallback(self._reference[0], THROUGH_RULES, instead="its jnp reference's derivatives")
            with references():
                dout = jax.jvp(self._call_reference(fixed_at, count), primals, tangents)[1]
            # The computed residuals feed the backward rule alone, whose derivative takes the
            # arguments' tangents instead.
            return (out, computed), (dout, [_zero_tangent(r) for r in computed])

        out, computed = kernels(*values)
        leaves = jax.tree.leaves(values)
        it = iter(computed)
        res = jax.tree.unflatten(traced["tree"], [next(it) if j is None else leaves[j] for j in traced["args"]])
        in_res = {j: k for k, j in reversed(list(enumerate(traced["args"]))) if j is not None}
        affine = self._reference[2]
        owner = [i for i, v in zip(diff_at, values) for _ in jax.tree.leaves(v)]
        plan, extra = [], []
        for j, (x, i) in enumerate(zip(leaves, owner)):
            if j in in_res:
                plan.append(("res", in_res[j]))
            elif i in affine:
                plan.append(("zero", jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))))
            else:
                plan.append(("extra", len(extra)))
                extra.append(x)
        return out, (res, _Kept(tuple(extra), (jax.tree.structure(values), tuple(plan), count)))

    def _bwd_with_jvp(self, bwd, fixed, res, kept, ct):
        tree, plan, count = kept.plan  # tree: the differentiable arguments' (a list)
        fixed_at = dict(zip(self._nondiff_order, fixed))
        leaves, ct_tree = jax.tree.flatten(ct, is_leaf=_jaxpr.is_symbolic_zero)
        zeros = [leaf.aval if _jaxpr.is_symbolic_zero(leaf) else None for leaf in leaves]
        dense = [leaf for leaf in leaves if not _jaxpr.is_symbolic_zero(leaf)]

        def cotangent(dense):  # ct again, its symbolic zeros where they were
            it = iter(dense)
            return jax.tree.unflatten(ct_tree, [next(it) if z is None else _jaxpr.SymbolicZero(z) for z in zeros])

        def arguments(res, extra, zero):
            res = jax.tree.leaves(res)
            return jax.tree.unflatten(tree, [res[k] if kind == "res" else extra[k] if kind == "extra" else zero(k)
                                             for kind, k in plan])

        kernels = jax.custom_jvp(lambda res, extra, dense: bwd(*fixed, res, cotangent(dense)))

        @kernels.defjvp
        def _(primals, tangents):
            res, extra, dense = primals
            dres, dextra, ddense = tangents
            grads = kernels(res, extra, dense)
            fallback(self._reference[0], PULLBACK, instead="its jnp reference's VJP")
            call = self._call_reference(fixed_at, count)
            with references():
                vjp = lambda d, c: jax.vjp(call, *d)[1](c)  # noqa: E731
                dense_ct = lambda d: _jaxpr.dense_cotangent(cotangent(d))  # noqa: E731
                zeros_of = lambda a: jnp.zeros(a.shape, a.dtype)  # noqa: E731
                dgrads = jax.jvp(vjp, (arguments(res, extra, zeros_of), dense_ct(dense)),
                                 (arguments(dres, dextra, _zero_tangent), dense_ct(ddense)))[1]
            return grads, _like(grads, dgrads)

        return kernels(res, kept.extra, dense)

    def __call__(self, *args):
        if self._reference is not None and (references_forced() or beyond_first_reverse(args)):
            op, reference, _ = self._reference
            fallback(op, FORWARD_MODE, instead="its jnp reference")
            return reference(*args)
        if not inside_shard_map():
            for i, a in enumerate(args):
                for x in (() if i in self._nondiff else jax.tree.leaves(a)):
                    if (sharding := explicit_sharding(x)) is not None:
                        return self._in_auto_axes(args, (x.shape, sharding))
            return self._fun(*args)
        diff = [a for i, a in enumerate(args) if i not in self._nondiff]
        axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(diff)))
        if axes:
            args = tuple(a if i in self._nondiff else varying(a, axes) for i, a in enumerate(args))
        return self._fun(*args)

    def _in_auto_axes(self, args, shaped):
        """The op run with the mesh's axes made Auto (`jax.sharding.auto_axes`) when an
        argument's type names its sharding (`jax.set_mesh` with Explicit axes): the ops'
        reshapes of sharded rows and their custom calls' results, which carry no sharding,
        are typed as under `jit` with sharded inputs, where the partitioning rules run
        each device on its rows. A result is typed as the first such argument (`shaped`:
        its shape and sharding) where it has that shape, else as replicated."""
        shape, sharding = shaped
        leaves, tree = jax.tree.flatten(args)
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, jax.core.Tracer))]

        def call(*xs):  # the array leaves as arguments (auto_axes retypes those), the rest as they are
            full = list(leaves)
            for i, x in zip(arrays, xs):
                full[i] = x
            return self._fun(*jax.tree.unflatten(tree, full))

        xs = [leaves[i] for i in arrays]
        replicated = jax.sharding.PartitionSpec()
        outs = jax.eval_shape(jax.sharding.auto_axes(call, out_sharding=replicated), *xs)
        out_sharding = jax.tree.map(lambda o: sharding.spec if o.shape == shape else replicated, outs)
        return jax.sharding.auto_axes(call, out_sharding=out_sharding)(*xs)


def explicit_sharding(x):
    """x's sharding when its type names mesh axes (`jax.set_mesh` with Explicit axes:
    `float32[8@d, ...]`), else None."""
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        return None
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return sharding if spec is not None and any(p is not None for p in spec) else None


def call(target: str, out_types, *args, barrier: bool = True, rule: str | None = None, shard: str = "",
         keep: str | None = None, **attrs):
    """An ffi_call of a jaxsub target. Kernels treat leading axes as rows, so `vmap` maps
    the call sequentially: that keeps every argument's meaning (per-example keys,
    batched parameters) exact. `barrier=False`: the results without the barrier below,
    for a call whose result XLA should write straight into a dynamic-update-slice that
    is its only user (the gemm target's gradients, jaxsub/ops/gemm.py). `rule` and
    `shard` (and `keep`, with dropout): how the call runs on several devices
    (jaxsub/_partition.py; None: gathered onto each device whole). A process with one
    device has nothing to partition, and skips the rule's wrappers (their tracing costs
    ~1.5 ms per call)."""
    register()
    if rule is None or jax.device_count() == 1:
        out = jax.ffi.ffi_call(target, out_types, vmap_method="sequential")(*args, **attrs)
    else:
        single = not isinstance(out_types, (tuple, list))
        out = _partition.sharded_call(
            lambda types, *xs: jax.ffi.ffi_call(target, types, vmap_method="sequential")(*xs, **attrs),
            rule, shard, args, (out_types,) if single else out_types, keep)
        out = out[0] if single else out
    # Inside shard_map a custom call's results carry no mesh axes; they vary over those of
    # its operands.
    if inside_shard_map():
        out = varying(out, frozenset().union(*(varying_axes(x) for x in args)))
    if not barrier:
        return out
    # The results pass through an optimization barrier (an identity that costs nothing):
    # under `lax.scan` / `nn.scan`, a result that is both used in the loop body and saved
    # as a residual for the backward pass is written into the stacked residual buffer by
    # a dynamic-update-slice; XLA's GPU dynamic-slice fusion then runs a *second copy of
    # the custom call* that writes straight into that buffer, while the first copy feeds
    # the body. Behind the barrier XLA copies the result instead: a copy of the output
    # rather than a second run of the kernel (24-layer encoder stack on the H200:
    # 28.8 -> 26.5 ms per training step; bench/NOTES.md, "Scanned stacks").
    # `jaxsub.stack.scan` passes through the barrier where it writes the result into its
    # stack right after the call and has the body's readers read it from there.
    return jax.lax.optimization_barrier(out)


register()
