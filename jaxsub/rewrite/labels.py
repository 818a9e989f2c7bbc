"""Axis labels for the attention matcher (match_attention.py).

Every tensor on the path from the Q·K contraction to the ·V contraction gets a *label* per
axis: "b" and "h" for the contraction's batch dims, "L"/"R" for the free dim of its left/
right operand (then "q"/"k"), "d"/"e" for the head dims, None for unit axes. These helpers
carry labels through layout nodes (transposes, unit reshapes) and move a value from one
labelled layout to another.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

# Layout nodes: unit reshapes include a squeeze and a broadcast_in_dim that only adds unit
# axes (jnp.matmul squeezes a unit batch axis away and broadcasts it back).
LAYOUT = ("transpose", "reshape", "squeeze", "broadcast_in_dim", "convert_element_type")
UNIT_OPS = ("reshape", "squeeze", "broadcast_in_dim")


def nonunit(shape):
    return tuple(d for d in shape if d != 1)


def unit_reshape(node):
    if node.prim not in UNIT_OPS:
        return True
    src, out = node.ins[0].shape, node.outs[0].shape
    return nonunit(src) == nonunit(out) and math.prod(src) == math.prod(out)


def forward(node, labels):
    """The labels of a layout node's output, given its input's."""
    if node.prim == "transpose":
        return tuple(labels[p] for p in node.params["permutation"])
    if node.prim in UNIT_OPS:  # a unit reshape (`unit_reshape`)
        it = iter(l for l, d in zip(labels, node.ins[0].shape) if d != 1)
        return tuple(next(it) if d != 1 else None for d in node.outs[0].shape)
    return labels


def backward(node, labels):
    """The labels of a layout node's input, given its output's; None if not a layout."""
    src, out = node.ins[0], node.outs[0]
    if node.prim == "transpose":
        res = [None] * len(labels)
        for i, p in enumerate(node.params["permutation"]):
            res[p] = labels[i]
        return tuple(res)
    if node.prim in ("reshape", "squeeze") and unit_reshape(node):
        it = iter(l for l, d in zip(labels, out.shape) if d != 1)
        return tuple(next(it) if d != 1 else None for d in src.shape)
    if node.prim == "broadcast_in_dim":
        dims = node.params["broadcast_dimensions"]
        return tuple(labels[o] if src.shape[i] == out.shape[o] else None for i, o in enumerate(dims))
    return None


def relayout(x, labels, target, sizes, kv=False):
    """x (axes labelled `labels`, unlabelled ones of size 1) as the axes `target`; a target
    label x lacks becomes a unit axis. A target label that is folded (`folds`: "b" from
    the batch axes past two, "h" from the kv heads and the query groups of grouped-query
    attention) is the product of its parts, broadcast over the parts x lacks. `kv` (k and
    v): "b" over all its parts, even where x has none, and "h" over none: k and v keep
    their own heads (the kv heads, or one where they are shared), which `ops.attention`
    groups q's heads over; an x axis with a folded label (the op's result) is split into
    its parts."""
    groups = folds(sizes)
    for t, parts in groups.items():
        if t in labels:
            i = labels.index(t)
            x = x.reshape((*x.shape[:i], *(sizes[l] for l in parts), *x.shape[i + 1:]))
            labels = (*labels[:i], *parts, *labels[i + 1:])
    fine = tuple(l for t in target for l in groups.get(t, (t,)))
    x = arrange(x, labels, fine, sizes)
    shape, at = [], 0
    for t in target:
        parts = groups.get(t, (t,))
        n = len(parts)
        if t in groups and (kv and t == "b" or not kv and any(l in labels for l in parts)):
            whole = (*x.shape[:at], *(sizes[l] for l in parts), *x.shape[at + n:])
            x = (np if isinstance(x, np.ndarray) else jnp).broadcast_to(x, whole)
        shape.append(math.prod(x.shape[at:at + n]))
        at += n
    return x.reshape(tuple(shape)) if tuple(shape) != x.shape else x


def arrange(x, labels, target, sizes):
    """x (axes labelled `labels`, unlabelled ones of size 1) with its axes in the order
    `target`, a target label x lacks a unit axis; `sizes`: the labels' sizes."""
    order = [labels.index(t) for t in target if t in labels]
    order += [i for i in range(len(labels)) if i not in order]
    xp = np if isinstance(x, np.ndarray) else jnp  # constants stay numpy while tracing
    x = xp.transpose(x, order) if order != list(range(len(order))) else x
    return x.reshape(tuple(sizes[t] if t in labels else 1 for t in target))


def batch_names(n):
    """Labels of a product's n batch axes: "b" and "h", or, past two, "a0", "a1", ... and
    "h", the a's folded into the op's "b" (`folds`). (With query groups, grouped-query
    attention, the matcher calls the kv heads "hk": folded with the groups "g" into the
    op's "h".)"""
    return list("bh"[:n]) if n <= 2 else [f"a{i}" for i in range(n - 1)] + ["h"]


def folds(sizes):
    """{op label: its parts, in order} for the labels the op's axes fold (see relayout)."""
    groups = {}
    outer = sorted((l for l in sizes if l[0] == "a"), key=lambda l: int(l[1:]))
    if outer:
        groups["b"] = tuple(outer)
    if "g" in sizes:
        groups["h"] = tuple(l for l in ("hk", "g") if l in sizes)
    return groups


def is_batch(label):
    return label in ("b", "h", "hk") or (label is not None and label[0] == "a")


def broadcasts(c, ref) -> bool:
    """Whether c (a scalar, or of ref's rank with each axis 1 or ref's) broadcasts to ref."""
    return not c.shape or (len(c.shape) == len(ref.shape) and all(a in (1, n) for a, n in zip(c.shape, ref.shape)))


def operand_labels(shape, batch, contract, free_label, names):
    """Labels of a dot_general operand (its batch axes `names`), or None when its free dims
    hold more than two non-unit dims. Of two, the first is labelled "g" (a query group of
    grouped-query attention; which of the two is the query is settled by the masks,
    `_Attn.chain`)."""
    labels = [None] * len(shape)
    for d, l in zip(batch, names):
        labels[d] = l
    labels[contract[0]] = "d"
    free = [d for d in range(len(shape)) if d not in batch and d != contract[0]]
    big = [d for d in free if shape[d] != 1]
    if len(big) > 2:
        return None, free
    for d, l in zip(big, ("g", free_label)[2 - len(big):]):
        labels[d] = l
    return tuple(labels), free


def is_label(label, want, sizes):
    return label == want or (label is None and sizes.get(want, 1) == 1)
