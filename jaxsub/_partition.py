"""How a jaxsub custom call runs on several devices: one partitioning rule for every target.

XLA cannot look inside a custom call, so under `jit` with sharded operands it gathers them
onto every device and runs the call on the whole arrays. `sharded_call` wraps a target's
ffi_call in `jax.experimental.custom_partitioning` with a rule written as letters, one per
dimension, like an einsum:

    "... n, n, n -> ... n, ..., ..."          (layer norm's forward)
    "b q h d, b k h d, b k h d -> b q h d, b h q"

Equal letters are the same dimension. `...` stands for the leading (row) dimensions, the
same number in every operand that has it. The letters in `shard` are the dimensions the
kernel may run on a slice of: each device then calls the target on its slices, with no
gathering. Every other dimension is whole on every device. A result without one of the
sharded letters is a sum over it (a parameter's gradient: the kernel's column sums), and
is summed over the devices (one all-reduce). Marks:

- `!` before a result: scratch (a workspace) that nobody reads; never summed. A scratch
  dimension `_` keeps its size on every device (the kernels use any prefix of it).
- `+` before an operand: added into a result that is summed over devices (the GEMM's
  bias and C operand); only the first device of the sum adds it.
- `@` before an operand: the dropout seed (u32[2] or [4], cuda/ABI.md). With dropout on,
  `keep` names the letters of the tensor whose elements the keep decisions index (row
  major: `"... n"` for the row ops, `"b h q k"` for attention, `"q k"` for attention whose
  one mask is shared by every batch and head); of those, only the outermost letter of
  size > 1 may then be sliced, so that each device's elements are one contiguous range
  of that index, and each device's seed gets the range's start, in 8-element Philox
  blocks, as words 2-3: the kernels add it to their counters, and every device draws the
  decisions the whole tensor has there. A letter outside `keep` (b and h under a shared
  mask) slices freely: every slice draws the same decisions.
- `_`: a dimension of its own, never sharded.
- `b~` (any letter with `~`): a dimension of its own cut into as many slices as b: a
  workspace with rows per b (its size a multiple of b's), or grouped-query attention's k/v
  heads (a divisor of b's, q head n reading k/v head n // (H / H_kv)); b is then sliced
  only where this size divides by the devices too.

An operand's sharding that names no mesh axes in order (a sub-axis split by a reshape and
transposed: `[2, 8]` sliced `d` = 4 on the 8, reshaped to `[2, 2, 4]` and transposed to
`[2, 4, 2]`) counts as whole: XLA gathers it for the call. JAX's own decoding of such a
sharding raises, so the wrapper takes the shardings undecoded and decodes them itself.

An operand of size 0 (an optional operand left out) and a dimension of size 1 (a
broadcast mask) are dimensions of their own. A letter is sharded only where its size
divides by the devices that hold it, so no device runs on padding.

On one device (and inside `shard_map`) JAX lowers the wrapped function as it is, so the
program is the same as without the wrapper. `custom_partitioning` has no batching rule;
`jax.custom_batching.sequential_vmap` gives the wrapped call one (a loop of calls, as
`ffi_call(vmap_method="sequential")` has).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

SCRATCH, ADDEND, SEED, OWN, ROWS = "!", "+", "@", "_", "..."


def _parse(side: str) -> list[tuple[str, list[str]]]:
    """[(mark, letters)] for one side of a rule; mark is "", "!" or "+"."""
    out = []
    for operand in side.split(","):
        words = operand.split()
        mark = ""
        if words and words[0][0] in (SCRATCH, ADDEND, SEED):
            mark, words[0] = words[0][0], words[0][1:]
            if not words[0]:
                words = words[1:] or [OWN]  # "@" alone: the seed's one dimension
        out.append((mark, words))
    return out


class _Rule:
    """A rule bound to shapes: each operand's and result's letters, one per dimension."""

    def __init__(self, rule: str, shard: str, in_shapes, out_shapes, keep: str | None = None):
        ins, outs = (_parse(s) for s in rule.split("->"))
        if len(ins) != len(in_shapes) or len(outs) != len(out_shapes):
            raise ValueError(f"partition rule {rule!r}: {len(in_shapes)} operands, {len(out_shapes)} results")
        fresh = (f"u{i}" for i in itertools.count())
        rows = None
        for (_, words), shape in zip(ins + outs, list(in_shapes) + list(out_shapes)):
            if ROWS in words and math.prod(shape) != 0:
                rows = len(shape) - len(words) + 1
                break
        shard_letters = set(shard.split())
        self.sizes: dict[str, int] = {}
        self.tied: dict[str, str] = {}
        self.letters: list[list[str]] = []
        self.marks = [m for m, _ in ins + outs]
        self.n_in = len(ins)
        for (_, words), shape in zip(ins + outs, list(in_shapes) + list(out_shapes)):
            expanded = []
            for w in words:
                expanded += [f"r{i}" for i in range(rows or 0)] if w == ROWS else [w]
            if math.prod(shape) == 0:
                expanded = [OWN] * len(shape)  # an optional operand left out
            elif len(expanded) != len(shape):
                raise ValueError(f"partition rule {rule!r}: {words} for an array of shape {shape}")
            letters = []
            for w, size in zip(expanded, shape):
                if w.endswith("~"):
                    parent, w = w[:-1], next(fresh)
                    self.tied[w] = parent
                elif w == OWN or size == 1 or self.sizes.get(w, size) != size:
                    w = next(fresh)
                self.sizes.setdefault(w, size)
                letters.append(w)
            self.letters.append(letters)
        if ROWS in shard_letters:
            shard_letters |= {f"r{i}" for i in range(rows or 0)}
        self.keep = None  # the keep decisions' index space: (letter, size) outermost first
        if keep is not None:
            self.keep = []
            for w in keep.split():
                self.keep += [(f"r{i}", self.sizes.get(f"r{i}", 1)) for i in range(rows or 0)] if w == ROWS \
                    else [(w, self.sizes.get(w, 1))]
            outer = next((w for w, size in self.keep if size > 1), None)
            shard_letters = {w for w in shard_letters if w == outer or all(w != k for k, _ in self.keep)}
        self.shard = [w for w in self.sizes if w in shard_letters]
        # Letters tied to a parent with a size dividing the parent's (grouped-query heads),
        # one size per parent: in the Shardy rule the parent is the compound (p_kv p_g) of
        # that factor and the group, so that propagation slices them together.
        self.groups: dict[str, int] = {}
        for t, parent in self.tied.items():
            size, whole = self.sizes[t], self.sizes.get(parent, 0)
            if 1 < size < whole and whole % size == 0 and self.groups.setdefault(parent, size) != size:
                raise ValueError(f"partition rule {rule!r}: {parent}~ with two sizes")

    def sdy(self) -> str:
        def name(w):
            parent = self.tied.get(w)
            if parent in self.groups and self.sizes[w] == self.groups[parent]:
                return f"{parent}_kv"
            return f"({w}_kv {w}_g)" if w in self.groups else w

        def side(ls):
            return ", ".join(" ".join(map(name, x)) if x else "" for x in ls)
        return side(self.letters[:self.n_in]) + " -> " + side(self.letters[self.n_in:])

    def sdy_factor_sizes(self) -> dict[str, int]:
        """The sizes of the factors sdy() uses only inside compounds (the groups)."""
        return {f"{p}_g": self.sizes[p] // size for p, size in self.groups.items()}

    def assign(self, mesh, shardings) -> dict[str, tuple[str, ...]]:
        """letter -> mesh axes, from the operands' shardings in order (the first operand
        that shards a letter decides; a mesh axis serves one letter)."""
        got, used = {}, set()
        for letters, s in zip(self.letters, shardings):
            spec = tuple(s.spec) if isinstance(s, NamedSharding) else ()
            for w, entry in zip(letters, spec):
                if entry is None or w not in self.shard or w in got:
                    continue
                axes = (entry,) if isinstance(entry, str) else tuple(entry)
                n = math.prod(mesh.shape[a] for a in axes)
                tied = [self.sizes[t] for t, parent in self.tied.items() if parent == w]
                if used & set(axes) or any(size % n for size in [self.sizes[w], *tied]):
                    continue
                got[w] = axes
                used |= set(axes)
        keyed = self.keyed(got)
        if keyed and self.block_elements(mesh, keyed) % 8:
            return {}  # a slice's first element would fall inside a Philox block
        return got

    def keyed(self, got) -> tuple[str, tuple[str, ...]] | None:
        """(letter, mesh axes) of the keep index's sliced letter (its outermost), or None."""
        names = {w for w, _ in self.keep or ()}
        return next(((w, axes) for w, axes in got.items() if w in names), None)

    def block_elements(self, mesh, keyed) -> int:
        """Elements of the keep index space per slice of its sliced outermost letter."""
        _, axes = keyed
        return math.prod(size for _, size in self.keep) // math.prod(mesh.shape[a] for a in axes)

    def axes(self, got, w) -> tuple[str, ...]:
        return got.get(w) or got.get(self.tied.get(w), ())

    def sharding(self, mesh, got, i):
        return NamedSharding(mesh, PartitionSpec(*(_entry(self.axes(got, w)) for w in self.letters[i])))

    def local(self, mesh, got, i, shape):
        return tuple(size // math.prod(mesh.shape[a] for a in self.axes(got, w))
                     for w, size in zip(self.letters[i], shape))

    def summed(self, got, j) -> tuple[str, ...]:
        """The mesh axes result j is summed over (none for scratch)."""
        i = self.n_in + j
        if self.marks[i] == SCRATCH:
            return ()
        has = set(self.letters[i]) | {self.tied[w] for w in self.letters[i] if w in self.tied}  # b~ is sliced as b
        return tuple(a for w, axes in got.items() if w not in has for a in axes)


def _offset_seed(seed, axes, n, blocks):
    """The seed with words 2-3 advanced by this device's slice index (of n) along `axes`
    times `blocks` (a 64-bit sum of 32-bit words, exact; a u32[2] seed has offset 0)."""
    table = np.array([[(i * blocks) & 0xFFFFFFFF, (i * blocks) >> 32] for i in range(n)], np.uint32)
    return _add64(seed, jnp.asarray(table)[jax.lax.axis_index(axes)])


def _add64(seed, add):
    """A u32[4] seed whose words 2-3 (u32[2] seed: 0) are advanced by add (u32[2], low
    word first), with the carry."""
    base = seed[2:4] if seed.shape[0] == 4 else jnp.zeros((2,), jnp.uint32)
    lo = base[0] + add[0]
    hi = base[1] + add[1] + (lo < base[0]).astype(jnp.uint32)
    return jnp.stack([seed[0], seed[1], lo, hi])


def _decoded(mesh, sharding):
    """`sharding` (from the partitioner, undecoded) as a NamedSharding on `mesh`; None where
    it names no mesh axes in order, or there is no mesh."""
    if isinstance(sharding, NamedSharding) or sharding is None:
        return sharding
    try:
        from jax._src.sharding_impls import parse_flatten_op_sharding
        spec, = parse_flatten_op_sharding(sharding._hlo_sharding, mesh)
    except Exception:  # a transposed sub-axis (IndivisibleError); a private API that moved
        return None
    return NamedSharding(mesh, spec)


def _entry(axes):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def sharded_call(call, rule: str, shard: str, args, out_types, keep: str | None = None):
    """call(out_types, *args) -> results (a tuple, one per out_types), run through the
    rule above. `call` is invoked again on each device's slices with their shapes. `keep`:
    the keep decisions' letters where dropout is on (None: off)."""
    out_types = tuple(out_types)
    bound = _Rule(rule, shard, [a.shape for a in args], [t.shape for t in out_types], keep)
    if not bound.shard:
        return call(out_types, *args)

    def lowering(mesh, got):
        types = tuple(jax.ShapeDtypeStruct(bound.local(mesh, got, bound.n_in + j, t.shape), t.dtype)
                      for j, t in enumerate(out_types))
        summed = [bound.summed(got, j) for j in range(len(out_types))]
        first_axes = tuple(dict.fromkeys(a for axes in summed for a in axes))

        def lower(*local):
            # Traced while XLA partitions, under the caller's context mesh: where that is
            # `jax.set_mesh` with Explicit axes, the slice arithmetic below (the seed's
            # offset) would be typed for it and lowered with sharding annotations that
            # nothing partitions any more (jax 0.11: "No registered implementation for
            # untyped custom call to Sharding"); the rule's own mesh has Auto axes.
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return lower_local(*local)

        def lower_local(*local):
            keyed = bound.keyed(got)
            if keyed is not None:
                axes = keyed[1]
                n = math.prod(mesh.shape[a] for a in axes)
                local = [_offset_seed(a, axes, n, bound.block_elements(mesh, keyed) // 8) if bound.marks[i] == SEED
                         else a for i, a in enumerate(local)]
            if first_axes:
                first = jax.lax.axis_index(first_axes) == 0
                local = [jax.numpy.where(first, a, 0).astype(a.dtype) if bound.marks[i] == ADDEND and a.size else a
                         for i, a in enumerate(local)]
            outs = call(types, *local)
            return tuple(jax.lax.psum(o, axes) if axes else o for o, axes in zip(outs, summed))
        return lower

    def partition(mesh, arg_shapes, result_shape):
        got = bound.assign(mesh, [_decoded(mesh, a.sharding) for a in arg_shapes])
        ins = tuple(bound.sharding(mesh, got, i) for i in range(bound.n_in))
        outs = tuple(bound.sharding(mesh, got, bound.n_in + j) for j in range(len(out_types)))
        return mesh, lowering(mesh, got), outs, ins

    def infer(mesh, arg_shapes, result_shape):
        got = bound.assign(mesh, [_decoded(mesh, a.sharding) for a in arg_shapes])
        return tuple(bound.sharding(mesh, got, bound.n_in + j) for j in range(len(out_types)))

    @custom_partitioning
    def wrapped(*xs):
        return tuple(call(out_types, *xs))

    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=bound.sdy(),
                          decode_shardings=False, **bound.sdy_factor_sizes())
    return jax.custom_batching.sequential_vmap(wrapped)(*args)


WRAPPERS = ("custom_vmap_call", "custom_partitioning")


def inner_call(eqn):
    """The ffi_call equation that `eqn` is, or wraps (through `sharded_call`'s wrappers);
    None if it is neither."""
    while eqn.primitive.name in WRAPPERS:
        inner = eqn.params["call"].jaxpr
        calls = [e for e in inner.eqns if e.primitive.name in WRAPPERS + ("ffi_call",)]
        if len(calls) != 1:
            return None
        eqn = calls[0]
    return eqn if eqn.primitive.name == "ffi_call" else None
