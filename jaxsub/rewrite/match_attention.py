"""Attention and softmax(+dropout) matchers (issue #4, pattern 1).

Attention: softmax(Q·Kᵀ·scale [+ additive mask | where(mask, s, -big)] [causal]) [dropout] · V
becomes `jaxsub.ops.attention` whenever q, k and v can be viewed as [B, S, H, D] (einsum
'bqhd,bkhd->bhqk', 'bhqd,bhkd->bhqk', jax.nn.dot_product_attention's grouped form, flax
linen/nnx attention; a product with more batch axes, such as windowed attention on
[B, W, H, N, D] or an attention under jax.vmap, has all but its last folded into B; with
k and v of fewer heads than q, grouped- or multi-query attention, they keep their heads,
which the op groups q's heads over, labels.folds):
the scale may sit on q, k or the logits, and is folded into
`scale`; masks may come before or after it. `where(mask, s, c)` with c <= -1e4 (-1e9,
finfo.min, -inf) is taken as a boolean mask: equal to the original on every row with at
least one visible key, because exp(c - max) underflows to exactly 0 there. On a fully
masked row the original averages v uniformly (finite c) or gives NaN (-inf), the fused
op gives 0; such rows carry no information, so the rewrite is made and explain() says so
("fully-masked rows give 0 instead of the mean of v"). An additive mask added after such
a where must leave c + mask a big negative (`M.lifted`). A mask that is a constant
(built from iota/ones, as jnp.tril and flax's make_causal_mask do; evaluated in broadcast
form, rewrite.constants) and equals jaxsub's bottom-right lower triangle (boolean, or
additive: 0 on it and a big negative elsewhere) becomes `causal=True`; any other mask is
passed as is.
Dropout on the probabilities (see match_dropout) becomes `dropout_rate` with the key that
fed bernoulli; a mask that varies over the queries and keys only, broadcast over every
batch and head axis (flax's default `broadcast_dropout=True`), becomes
`broadcast_dropout=True` (one [Sq, Sk] mask shared by all of them, as the op draws it). A
mask broadcast some other way (over some batch axes only, or over the queries) is a
near-miss.

The softmax itself is recognized by match_softmax.
"""


from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxsub import ops
from jaxsub.rewrite import constants
from jaxsub.rewrite import graph as G
from jaxsub.rewrite import attention_masks as M
from jaxsub.rewrite import labels as L
from jaxsub.rewrite import match_dropout, projections
from jaxsub.rewrite.match_softmax import parse, shift_of
from jaxsub.rewrite.patterns import ACTIVATION_DTYPES, Match, NearMiss, private_violation, shapes

ATTN = "attention"

# ---------------------------------------------------------------------------------------
# Attention: softmax(scale * Q Kᵀ (+ masks)) (dropout) V.
#
# Every tensor on the path from the Q·K contraction to the ·V contraction gets a *label*
# per axis: "b" and "h" for the contraction's batch dims (first and second; absent ones
# have size 1; past two, "a0", "a1", ... and "h", the a's folded into the op's B), "L"/"R"
# for the free dim of its left/right operand (which one is the query side follows from the
# softmax axis, the key side), None for unit axes. Transposes
# permute labels, reshapes may only add or drop unit axes, elementwise steps keep them.
# q, k, v and the masks are then moved to [B, S, H, D] / [B, H, Sq, Sk] by one transpose
# and one unit reshape (XLA elides both), and the result is moved back to the ·V
# contraction's layout (labels.py).


class _Scores:
    """Parse of the path from the Q·K dot_general to the softmax input, walked backwards."""

    def __init__(self, g, axis):
        self.g = g
        self.axis = axis     # the softmax axis of the walk's first value
        self.steps = []      # (node, kind, payload), from the softmax input back
        self.qk = None
        self.weak_fill = None  # a where(mask, s, c) met whose c is above the boolean-mask bound

    def _axis_here(self):
        """The softmax axis at the value the walk has reached (the layout steps undone)."""
        labels = None
        for node, kind, _ in self.steps:
            if kind != "layout":
                continue
            if labels is None:
                labels = tuple("a" if i == self.axis else None for i in range(len(node.outs[0].shape)))
            labels = L.backward(node, labels)
            if labels is None:
                return None
        return self.axis if labels is None else (labels.index("a") if "a" in labels else None)

    def walk(self, ref, depth=0):
        g = self.g
        node = g.producer.get(ref)
        if node is None or depth > 16 or node.outs[0].shape != ref.shape:
            return False
        if node.prim == "dot_general":
            self.qk = node
            return True
        n = len(self.steps)
        if node.prim in L.LAYOUT and L.unit_reshape(node):
            if node.prim == "convert_element_type" and node.outs[0].dtype not in ACTIVATION_DTYPES:
                return False
            self.steps.append((node, "layout", None))
            if self.walk(node.ins[0], depth + 1):
                return True
        elif node.prim in ("mul", "div"):
            for s, c in (node.ins, node.ins[::-1]):
                k = g.scalar(c)
                if node.prim == "div" and c is not node.ins[1] or s.shape != ref.shape:
                    continue
                if k is None and L.broadcasts(c, ref) and jnp.issubdtype(c.dtype, jnp.floating):
                    # A scale computed at run time (a temperature, a learned per-head scale):
                    # folded into q or k where it varies over one side only (`_Attn.chain`).
                    self.steps.append((node, "runtime scale", (c, node.prim == "div")))
                    if self.walk(s, depth + 1):
                        return True
                    del self.steps[n:]
                    continue
                if k is None or k == 0.0:
                    continue
                self.steps.append((node, "scale", 1.0 / k if node.prim == "div" else k))
                if self.walk(s, depth + 1):
                    return True
                del self.steps[n:]
        elif node.prim == "add":
            for s, m in (node.ins, node.ins[::-1]):
                if s.shape == ref.shape and jnp.issubdtype(m.dtype, jnp.floating):
                    self.steps.append((node, "add", m))
                    if self.walk(s, depth + 1):
                        return True
                    del self.steps[n:]
        elif node.prim == "sub":  # s - m: the additive mask -m (`s - 1e9 * (1 - valid)`)
            s, m = node.ins
            axis = self._axis_here()
            shift = shift_of(g, m, s, axis) if axis is not None and s.shape == ref.shape else None
            if shift is not None:  # s - max(s): a shift the softmax does not see
                self.steps.append((node, "shift", shift))
                if self.walk(s, depth + 1):
                    return True
                del self.steps[n:]
            elif s.shape == ref.shape and jnp.issubdtype(m.dtype, jnp.floating):
                self.steps.append((node, "sub", m))
                if self.walk(s, depth + 1):
                    return True
        elif node.prim == "select_n" and len(node.ins) == 3 and node.ins[0].dtype == jnp.bool_:
            pred, no, yes = node.ins
            for s, c, negate in ((yes, no, False), (no, yes, True)):
                fill = g.scalar(c)
                if fill is not None and fill > M.big_negative(c.dtype) and s.shape == ref.shape:
                    self.weak_fill = fill
                if fill is not None and fill <= M.big_negative(c.dtype) and s.shape == ref.shape:
                    self.steps.append((node, "select", (pred, fill, negate)))
                    if self.walk(s, depth + 1):
                        return True
                    del self.steps[n:]
        del self.steps[n:]
        return False


def _unscaled(g, ref):
    """(x, factor, node) when ref = x * c or x / c for a scalar c; else (ref, 1.0, None)."""
    node = g.op(ref, "mul", "div")
    if node is not None and node.ins[0].dtype == ref.dtype:
        for x, c in (node.ins, node.ins[::-1]):
            k = g.scalar(c)
            if k and x.shape == ref.shape and (node.prim == "mul" or c is node.ins[1]):
                return x, (1.0 / k if node.prim == "div" else k), node
    return ref, 1.0, None


def _strip_layout(g, ref, into):
    for _ in range(8):
        node = g.op(ref, *L.LAYOUT)
        if node is None or not L.unit_reshape(node) or node.outs[0].dtype not in ACTIVATION_DTYPES:
            break
        into.append(node)
        ref = node.ins[0]
    return ref


def _broadcast_dropout(g, ref):
    """The bernoulli node of a dropout on a softmax that match_dropout does not take (a mask
    broadcast over batch/heads, flax's default `broadcast_dropout=True`)."""
    node = g.op(ref, "mul", "select_n")
    if node is None:
        return None
    if not any(parse(g, _strip_layout(g, r, [])) for r in node.ins if r.shape == ref.shape):
        return None
    return match_dropout.drawn_mask(g, ref)


class _Attn:
    """One attention candidate ending at the ·V dot_general `anchor`, P = operand `pi`."""

    def __init__(self, g, anchor, pi):
        self.g, self.anchor, self.pi = g, anchor, pi
        self.nodes, self.roles, self.masks = [anchor], {}, []
        self.runtime_scales = []  # (source, labels, divides): scales of the scores computed at run time
        self.drop = self.sm = None
        self.near_miss = None

    def take(self, nodes, role):
        for n in nodes:
            if n not in self.roles:
                self.roles[n] = role
                self.nodes.append(n)

    def parse(self):
        g, anchor = self.g, self.anchor
        post = []
        ref = _strip_layout(g, anchor.ins[self.pi], post)
        drop = match_dropout.parse(g, ref, broadcast=True)
        if drop is not None and drop.h.shape == ref.shape:
            self.drop = drop
            anchor_side = len(post)
            ref = _strip_layout(g, drop.h, post)
            self.drop_at = len(post) - anchor_side  # the post nodes before the dropout (chain)
        elif drop is None:
            bern = _broadcast_dropout(g, ref)
            if bern is not None:
                if bern.outs[0].shape == ref.shape:
                    wrong = (f"dropout mask {shapes(bern.outs[0])} on the probabilities without its 1 / (1 - rate) "
                             f"scale on them (after the product with v, or none); the fused op scales the kept "
                             f"probabilities")
                else:
                    wrong = (f"dropout mask {shapes(bern.outs[0])} is broadcast over the probabilities {shapes(ref)} "
                             f"in a way the fused op does not draw: it drops each element on its own, or shares "
                             f"one mask over queries and keys by every batch and head (broadcast_dropout)")
                why = match_dropout.batched_key(bern) or wrong
                self.near_miss = why, ("drop", id(bern))
                return False
        sm = parse(g, ref)
        if sm is None:
            remat = g.producer.get(ref)
            if remat is not None and remat.prim in G.REMAT and remat.body is not None:
                out = remat.body.outvars[remat.outs.index(ref)]
                if parse(remat.body, out) is not None:
                    self.near_miss = ("the softmax is inside a jax.checkpoint without the scores' product: "
                                      "checkpoint the whole attention to fuse it", ("remat", id(remat)))
            return False
        self.sm, self.post = sm, post[::-1]
        scores = _Scores(g, sm.axis)
        if not scores.walk(sm.x):
            if scores.weak_fill is not None:
                self.near_miss = (f"where(mask, scores, {scores.weak_fill:g}): a fill above -1e4 leaves the hidden "
                                  f"keys some weight (exp(fill - max) need not underflow), which the fused op's mask "
                                  f"would drop; fill with -1e9, finfo.min or -inf to fuse it", ("fill", id(sm.x)))
            return False
        self.steps = scores.steps[::-1]
        if sm.mask is not None:  # where= inside jax.nn.softmax's call: the last step of the chain
            axes = sm.mask_axes if sm.perm is None else tuple(a if a is None else sm.perm[a] for a in sm.mask_axes)
            self.steps.append((sm.nodes[0], "select", (sm.mask, float("-inf"), False, axes)))
        return self.qk_labels(scores.qk) and self.chain() and self.pv()

    def qk_labels(self, qk):
        (lc, rc), (lb, rb) = qk.params["dimension_numbers"]
        lhs, rhs = qk.ins
        if len(lc) != 1 or lhs.dtype != rhs.dtype or lhs.dtype not in ACTIVATION_DTYPES:
            return False
        names = L.batch_names(len(lb))  # see labels.folds
        ll, lfree = L.operand_labels(lhs.shape, lb, lc, "L", names)
        rl, rfree = L.operand_labels(rhs.shape, rb, rc, "R", names)
        if ll is None or rl is None or ("g" in ll and "g" in rl):
            return False
        if "g" in ll or "g" in rl:  # query groups: the kv heads are "hk"
            names, ll, rl = (tuple("hk" if l == "h" else l for l in ls) for ls in (names, ll, rl))
        self.sizes = {l: lhs.shape[d] for d, l in zip(lb, names)}
        for shape, labels in ((lhs.shape, ll), (rhs.shape, rl)):
            self.sizes.update({l: shape[d] for d, l in enumerate(labels) if l in ("L", "R", "g")})
        self.sizes.update(d=lhs.shape[lc[0]])
        self.sizes.setdefault("L", 1), self.sizes.setdefault("R", 1)
        self.operands = [[lhs, ll], [rhs, rl]]
        self.qk, self.labels = qk, (*names, *(ll[d] for d in lfree), *(rl[d] for d in rfree))
        return True

    def chain(self):
        g, labels, factor = self.g, self.labels, 1.0
        dtype = self.operands[0][0].dtype
        converts = [n for n, kind, _ in self.steps if kind == "layout"] + list(self.post)
        for n in converts:
            if n.prim == "convert_element_type" and jnp.finfo(n.outs[0].dtype).eps > jnp.finfo(dtype).eps:
                what = "scores" if n not in self.post else "probabilities"
                self.near_miss = (f"the {what} are rounded to {jnp.dtype(n.outs[0].dtype).name} in a "
                                  f"{jnp.dtype(dtype).name} attention; the fused op would not round them",
                                  ("narrowed", id(self.qk)))
                return False
        inside = {r for n, _, _ in self.steps for r in n.outs} | set(self.qk.outs)
        for node, kind, payload in self.steps:
            if kind == "layout":
                labels = L.forward(node, labels)
            elif kind == "shift":
                continue
            elif kind == "runtime scale":
                c, div = payload
                if c in inside or self.masks:
                    if self.masks:
                        self.near_miss = ("the masked scores are scaled by a value computed at run time: scale "
                                          "before masking (or scale q) to fuse", ("runtime", id(node)))
                    return False
                cl = tuple(l if a == n else None for l, a, n in zip(labels, c.shape, node.outs[0].shape))
                self.runtime_scales.append((*M.mask_source(g, c, cl), div))
            elif kind == "scale":
                factor *= payload
                for m in self.masks:
                    m.factor *= payload
                    m.fill *= payload
            else:
                m = payload[0] if kind == "select" else payload
                if m in inside:  # the scores added to themselves (`s + s`): no mask
                    return False
                if kind == "select" and len(payload) > 3:
                    # jax.nn.softmax's where= inside its call: each mask axis is the scores'
                    # axis payload[3] names (None: a unit axis)
                    ml = tuple(labels[a] if a is not None else None for a in payload[3])
                else:
                    chain_shape = node.outs[0].shape
                    if len(m.shape) != len(chain_shape) or any(a not in (1, c) for a, c in zip(m.shape, chain_shape)):
                        return False
                    ml = tuple(l if a == c else None for l, a, c in zip(labels, m.shape, chain_shape))
                src, sl = M.mask_source(g, m, ml)
                if kind == "select":
                    self.masks += [M.Mask(r, rl, True, negate=payload[2], fill=payload[1])
                                   for r, rl in M.conjuncts(g, src, sl, payload[2])]
                else:
                    self.masks.append(M.Mask(src, sl, False, factor=-1.0 if kind == "sub" else 1.0,
                                            bounds=M.bounds(g, m)))
        why = M.lifted(self.masks)
        if why is not None:
            self.near_miss = why, ("lifted", id(self.qk))
            return False
        weak = [m.fill for m in self.masks if m.boolean and not m.fill <= M.big_negative(jnp.bfloat16)]
        if weak:  # a big negative scaled down after the where (by less than 1)
            self.near_miss = (f"where(mask, scores, c) is scaled after it to a fill of {weak[0]:g}, above -1e4: the "
                              f"hidden keys keep some weight, which the fused op's mask would drop; fill with -1e9, "
                              f"finfo.min or -inf to fuse it", ("fill", id(self.qk)))
            return False
        query = {"L": "R", "R": "L"}.get(labels[self.sm.axis])
        if query is None:
            return False
        key = labels[self.sm.axis]
        if "g" in self.operands[key == "R"][1]:
            return False  # k with a free axis q lacks: not attention's form
        rename = {query: "q", key: "k"}
        # Grouped-query attention: q's two free axes are its query groups and its queries.
        # Either reading is the same function; the masks tell the queries (a causal mask
        # varies over them), else the larger axis is taken for them.
        if "g" in self.sizes:
            over = [{"g", query} & set(m.labels) for m in self.masks]
            swap = {"g"} in over if ({"g"} in over) != ({query} in over) else self.sizes["g"] > self.sizes[query]
            if swap:
                rename.update({query: "g", "g": "q"})

        def ren(ls):
            return tuple(rename.get(l, l) for l in ls)

        self.sizes = {rename.get(l, l): n for l, n in self.sizes.items()}
        for m in self.masks:
            m.labels = ren(m.labels)
        self.q_scales, self.k_scales = [], []
        for src, sl, div in self.runtime_scales:
            sl = ren(sl)
            side = {"q" if l == "g" else l for l in sl if l is not None and not L.is_batch(l)}
            if len(side) > 1:
                self.near_miss = (f"the scores are multiplied by {shapes(src)} computed at run time, varying over "
                                  f"queries and keys: not a scale of q or of k", ("runtime", id(src)))
                return False
            (self.k_scales if side == {"k"} else self.q_scales).append((src, sl, div))
        for op in self.operands:
            op[1] = ren(op[1])
        if query == "R":
            self.operands.reverse()
        at = [self.sm.out_labels(ren(labels))]  # the labels before each post node, then after the last
        for node in self.post:
            at.append(L.forward(node, at[-1]))
        self.prob_labels = at[-1]
        if self.drop is not None and not self.drop_labels(at[self.drop_at]):
            return False
        q, k = self.operands
        self.q, qf, qn = _unscaled(g, q[0])
        self.k, kf, kn = _unscaled(g, k[0])
        self.q_labels, self.k_labels = q[1], k[1]
        self.scale = factor * qf * kf
        self.take([n for n in (qn, kn) if n is not None and g.uses[n.outs[0]] == 1], "scaled q/k")
        return self.q.dtype == self.k.dtype

    def drop_labels(self, labels):
        """Whether the dropout's mask, at h's `labels`, is one the op draws: h's own shape, or
        varying over the queries and keys only (broadcast_dropout); else a near-miss."""
        drop = self.drop
        if not drop.broadcast:
            return True
        if all((n == 1) == (l not in ("q", "k") and h > 1)
               for n, l, h in zip(drop.mask_shape, labels, drop.h.shape) if h > 1):
            return True
        self.near_miss = (f"dropout mask {shapes(drop.bernoulli.outs[0])} is broadcast over the probabilities "
                          f"{shapes(drop.h)} other than over every batch and head axis (flax's broadcast_dropout): "
                          f"the fused op drops each element on its own, or shares one [Sq, Sk] mask by every "
                          f"batch and head", ("drop", id(drop.bernoulli)))
        return False

    def pv(self):
        anchor, sizes = self.anchor, self.sizes
        (c0, c1), (b0, b1) = anchor.params["dimension_numbers"]
        pc, vc, pb, vb = (c0, c1, b0, b1) if self.pi == 0 else (c1, c0, b1, b0)
        p, v = anchor.ins[self.pi], anchor.ins[1 - self.pi]
        pl = self.prob_labels
        if len(pc) != 1 or not L.is_label(pl[pc[0]], "k", sizes) or v.dtype != self.q.dtype:
            return False
        pfree = [d for d in range(len(p.shape)) if d not in pb and d not in pc]
        if (not all(pl[d] is None or L.is_batch(pl[d]) or pl[d] == "g" for d in pb)
                or not all(pl[d] in ("q", "g", None) for d in pfree)):
            return False
        vl = [None] * len(v.shape)
        for dp, dv in zip(pb, vb):
            vl[dv] = pl[dp]
        vl[vc[0]] = "k"
        vfree = [d for d in range(len(v.shape)) if d not in vb and d != vc[0]]
        big = [d for d in vfree if v.shape[d] != 1]
        if len(big) > 1:
            return False
        if math.prod(v.shape[d] for d in vfree) != sizes["d"]:
            self.near_miss = (f"v's head dim {math.prod(v.shape[d] for d in vfree)} differs from q and k's "
                              f"{sizes['d']}: the fused op takes one head dim", ("vdim", id(anchor)))
            return False
        for d in big:
            vl[d] = "e"
        sizes["e"] = sizes["d"]
        self.v, self.v_labels = v, tuple(vl)
        free = [pl[d] for d in pfree], [vl[d] for d in vfree]
        self.out_labels = (*(pl[d] for d in pb), *free[self.pi], *free[1 - self.pi])
        want = tuple(sizes.get(l, 1) if l else 1 for l in self.out_labels)
        return want == anchor.outs[0].shape and all(
            math.prod(x.shape) == math.prod(sizes[l] for l in labels if l)
            for x, labels in ((self.q, self.q_labels), (self.k, self.k_labels)))

    def causal(self):
        """Take a constant bottom-right lower-triangular mask (boolean, or additive: 0 where
        visible, a big negative elsewhere) as `causal=True`."""
        sq, sk = self.sizes["q"], self.sizes["k"]
        memo, fills = {}, {}
        for m in self.masks:
            val = constants.value(self.g, m.ref, memo)
            if val is None:
                continue
            if m.boolean:
                vis, fill = constants.invert(val) if m.negate else val, m.fill
            else:  # 0 where visible, a big negative elsewhere (where(tril, 0, -inf), (1 - tril) * -1e9)
                vis, fill = constants.visible(val, m.factor, M.big_negative(jnp.bfloat16))
                # that the other additive masks do not lift back (M.lifted: the same for a boolean mask's fill)
                others = [a for a in self.masks if not a.boolean and a is not m]
                if vis is not None and not M.hides(fill, M.lift_of(others)):
                    continue
            if vis is not None and constants.qk_prefix(vis, m.labels, sq, sk, sk - sq):
                fills[id(m)] = fill
                if not m.boolean:
                    break  # (another additive triangle's lift check counted this one)
        # every mask that is the triangle goes (dot_product_attention with a window and
        # is_causal ands two); its hidden scores' fill is the largest of theirs
        self.masks = [m for m in self.masks if id(m) not in fills]
        self.causal_fill = max(fills.values(), default=None)
        return bool(fills)


def _scaled(read, x, scales, target, sizes, kv=False):
    """x (q or k in the `target` layout) times (or divided by) the run-time scales of its side."""
    for src, labels, div in scales:
        t = L.relayout(read(src), labels, target, sizes, kv=kv)
        x = (x / t if div else x * t).astype(x.dtype)
    return x


def _packed_source(g, att):
    """(qkv, axis) when q, k and v are slices 0, 1, 2 of one rank-5 array along its axis 0 or
    2, each squeezed to [B, S, H, D] exactly as the op takes it (one QKV projection's
    output: `qkv[:, :, i]`); `ops.attention_packed` then reads that array in place. Else None."""
    if (att.q_labels, att.k_labels, att.v_labels) != (tuple("bqhd"), tuple("bkhd"), tuple("bkhe")):
        return None
    src = axis = None
    for i, ref in enumerate((att.q, att.k, att.v)):
        sq = g.op(ref, "squeeze")
        sl = g.op(sq.ins[0], "slice") if sq is not None and len(sq.params["dimensions"]) == 1 else None
        if sl is None:
            return None
        a, x, p = sq.params["dimensions"][0], sl.ins[0], sl.params
        whole = all(d == a or (b == 0 and e == n) for d, (b, e, n) in
                    enumerate(zip(p["start_indices"], p["limit_indices"], x.shape)))
        if (len(x.shape) != 5 or a not in (0, 2) or x.shape[a] != 3 or not whole or p["start_indices"][a] != i
                or any(st != 1 for st in p["strides"] or ()) or (src is not None and (x is not src or a != axis))):
            return None
        src, axis = x, a
    return src, axis


def _packed_projections(g, att):
    """(projections.Packed, None) when q, k and v are three projections of one input that
    only this attention uses (see projections.py); (None, the reason) when they are three
    projections of one input that cannot be packed; else (None, None)."""
    refs, unit = [], []
    for ref, labels, want in ((att.q, att.q_labels, "bqhd"), (att.k, att.k_labels, "bkhd"),
                              (att.v, att.v_labels, "bkhe")):
        node = g.op(ref, "reshape")  # nnx's grouped-query view [B, S, H, 1, D]
        if node is not None and L.unit_reshape(node):
            ref, labels = node.ins[0], L.backward(node, labels)
            unit.append(node)
        if labels != tuple(want):
            return None, None
        refs.append(ref)
    found = projections.pack(g, *refs)
    if not isinstance(found, projections.Packed):
        return None, found
    found = dataclasses.replace(found, nodes=[*unit, *found.nodes])
    members = {*att.nodes, *found.nodes}
    if any(g.producer.get(r) in members for r in found.inputs()):
        return None, "an input of a projection is computed inside the attention"
    roles = {**att.roles, **{n: "q/k/v projection" for n in found.nodes}}
    why = private_violation(g, list(members), att.anchor, roles)
    return (found, None) if why is None else (None, why)


def match_attention(g, anchor, options):
    """softmax(scale * Q Kᵀ (+ masks)) (dropout) · V ending at the dot_general `anchor`."""
    if anchor.prim != "dot_general":
        return None
    for pi in (0, 1):
        att = _Attn(g, anchor, pi)
        if att.parse():
            break
        if att.near_miss is not None:
            return NearMiss(ATTN, anchor, att.near_miss[0], key=att.near_miss[1])
    else:
        return None
    drop = att.drop
    why = match_dropout.not_rewritten(options, drop)
    if why is not None:
        return NearMiss(ATTN, anchor, why, key=("drop", id(drop.bernoulli)))
    causal = att.causal()
    att.take([*att.post, *(drop.nodes if drop else []), *att.sm.nodes], "attention probabilities")
    att.take([n for n, _, _ in att.steps] + [att.qk], "attention scores")
    att.take([n for _, kind, shift in att.steps if kind == "shift" for n in shift], "the scores' row maximum")
    why = private_violation(g, att.nodes, anchor, att.roles)
    if why is not None:
        return NearMiss(ATTN, anchor, why, key=("attention", id(att.qk)))
    sizes, masks, scale = att.sizes, list(att.masks), att.scale
    rate = drop.rate if drop is not None else 0.0
    mask = M.builder(masks, sizes)
    out_dtype = anchor.outs[0].dtype

    runtime = att.q_scales or att.k_scales  # q and k are then scaled apart from any packing
    packed = _packed_source(g, att) if not runtime else None
    projected, unpacked = (None, None) if packed is not None or runtime else _packed_projections(g, att)
    if projected is not None:
        att.take(projected.nodes, "q/k/v projection")
    # The packed array x·W + bias, read only by the three slices: the same add through
    # ops.bias_add, whose bias gradient is a fused column sum. (The original add and
    # slices are left in place, unread, and dropped as dead code.)
    biased = projections.bias_add_of(g, packed[0]) if packed is not None and g.uses[packed[0]] == 3 else None

    def attend(read, qkv=None, dense=None):
        """The match's output; `qkv`, when given, is the packed array with its bias added
        (rewrite.scan_products computes it another way). `dense` = (x, w, bias, axes,
        shared): the packed array is that product (rewrite.scan_products), run with the
        attention as one ops.dense_attention_packed; with `shared`, the result is (the
        output, x handed on)."""
        kw = dict(mask=mask(read), causal=causal, scale=scale, dropout_rate=rate,
                  key=read(drop.key) if drop is not None else None,
                  broadcast_dropout=drop is not None and drop.broadcast)
        shared = dense is not None and dense[4]
        if dense is not None:
            x, w, bias, axes, _ = dense
            got = ops.dense_attention_packed(x, w, bias, axes=axes, with_input=shared, **kw)
            out, again = got if shared else (got, None)
        elif packed is not None:
            if qkv is None:
                qkv = ops.bias_add(read(biased[0]), read(biased[1])) if biased is not None else read(packed[0])
            out = ops.attention_packed(qkv, axis=packed[1], **kw)
        elif projected is not None and projected.apart:
            out = ops.attention_projected(*projected.operands(read), **kw)
        elif projected is not None:
            out = ops.attention_packed(projected.build(read), axis=2, **kw)
        else:
            q = _scaled(read, L.relayout(read(att.q), att.q_labels, "bqhd", sizes), att.q_scales, "bqhd", sizes)
            k = _scaled(read, L.relayout(read(att.k), att.k_labels, "bkhd", sizes, kv=True), att.k_scales,
                        "bkhd", sizes, kv=True)
            v = L.relayout(read(att.v), att.v_labels, "bkhe", sizes, kv=True)
            out = ops.attention(q, k, v, **kw)
        outs = [L.relayout(out, tuple("bqhe"), att.out_labels, sizes).astype(out_dtype)]
        return (outs, again) if shared else outs

    detail = _describe(att, causal, rate)
    if packed is not None:
        detail += f", q/k/v read in place from one {shapes(packed[0])} array (attention_packed, axis {packed[1]})"
        if biased is not None:
            detail += f", its bias {shapes(biased[1])} added by ops.bias_add"
    elif projected is not None:
        detail += f", {projected.describe()}"
    elif unpacked is not None:
        detail += f", q/k/v projections of one input not packed: {unpacked}"
    # For scan_products: the packed array's (product, bias) and the build taking it
    # (`dense` only where the product writes the [B, S, 3, H, D] layout), or Flax's three
    # projections (the Packed that attention_projected takes) and the build.
    if biased is not None:
        attrs = dict(biased=biased, attend=attend, dense_ok=packed[1] == 2)
    elif projected is not None and projected.apart:
        attrs = dict(projected=projected, attend=attend)
    else:
        attrs = {}
    return Match(ATTN, anchor, att.nodes, dict(q=att.q, k=att.k, v=att.v, key=drop.key if drop is not None else None),
                 attend, detail, attrs=attrs)


def _describe(att, causal, rate):
    parts = [f"q {shapes(att.q)}, k {shapes(att.k)}, v {shapes(att.v)}", f"scale={att.scale:.6g}"]
    if "g" in att.sizes:
        heads = math.prod(att.sizes[l] for l in L.folds(att.sizes)["h"])
        parts.append(f"grouped-query: {att.sizes['g']} query groups over k and v's heads (q's {heads} heads)")
    for side, scales in (("q", att.q_scales), ("k", att.k_scales)):
        parts += [f"{side} {'divided' if div else 'multiplied'} by {shapes(src)} computed at run time"
                  for src, _, div in scales]
    if causal:
        parts.append("causal")
    for m in att.masks:
        parts.append(("boolean" if m.boolean else "additive") + f" mask {shapes(m.ref)}")
    shared = " (one [Sq, Sk] mask for every batch and head: broadcast_dropout)" if rate and att.drop.broadcast else ""
    parts.append(f"dropout rate={rate:g}{shared}{att.drop.note}" if rate else "no dropout")
    fills = [m.fill for m in att.masks if m.boolean] + ([att.causal_fill] if causal else [])
    if att.sm.zero_rows and len(fills) == 1:
        fills = []  # softmax(where=mask) gives hidden rows 0 as the fused op does
    if any(np.isfinite(f) for f in fills):
        parts.append("fully-masked rows give 0 instead of the mean of v")
    elif fills:
        parts.append("fully-masked rows give 0 instead of NaN")
    if any(not m.boolean for m in att.masks):
        parts.append("a row whose additive mask is below -256 everywhere gets its unmasked attention "
                     "(f32 code: the mean of v)")
    return ", ".join(parts)
