"""One attention call as a one-stage problem: what `jaxsub.optimize(fn, layouts=...)` can
choose inside a user's function.

The user's code fixes the layouts around a matched attention (the rewrite relays q/k/v to
[B,S,H,D] for `jaxsub.ops.attention` whatever they were), so what is left to choose per
call is the algorithm and kernel configuration: impl=unfused or impl=fused (where the
fused kernel runs for this platform, dtype and head dim). The signature
(`jaxsub.ops.attn.signature`: shapes, dtype, causal, mask, dropout rate and form) is the problem.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import ops
from jaxsub.layout import model
from jaxsub.layout.problem import Candidate, Problem, Stage, Workload, config_str, parse_config
from jaxsub.ops import attn as _attn

LABEL = "qkv:BSHD"


class AttentionProblem(Problem):
    kind = "attention"

    def __init__(self, signature: tuple, platform: str | None = None):
        self.signature = tuple(signature)
        self.sig = dict(self.signature)
        self.platform = platform or jax.default_backend()
        impls = ["unfused"]
        if _attn.fused_unsupported(self.platform, self.sig["dtype"], self.sig["head_dim"]) is None:
            impls.append("fused")
        self.stages = (Stage("attention", tuple(Candidate(LABEL, LABEL, config_str(impl=i)) for i in impls)),)

    def key(self) -> dict:
        return {"problem": self.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.signature}}

    def stage_workload(self, i: int, cand: Candidate) -> Workload:
        g = self.sig
        impl = parse_config(cand.config).get("impl", "unfused")
        rate = g["dropout_rate"]

        def fn(diff, aux):
            q, k, v = diff
            mask, key = aux
            return ops.attention(q, k, v, mask=mask, causal=g["causal"], dropout_rate=rate,
                                 key=key if rate > 0 else None, implementation=impl,
                                 broadcast_dropout=g.get("broadcast_dropout", False))

        def make(seed):
            rng = np.random.default_rng(seed)
            dt = jnp.dtype(g["dtype"])
            shapes = [(g["batch"], g["seq_q"], g["heads"], g["head_dim"])] + 2 * [
                (g["batch"], g["seq_k"], g["heads"], g["head_dim"])]
            qkv = tuple(jnp.asarray(rng.standard_normal(s, np.float32), dt) for s in shapes)
            mask = None
            if g["mask"] == "boolean":
                m = rng.random(g["mask_shape"]) > 0.2
                m[..., 0] = True
                mask = jnp.asarray(m)
            elif g["mask"] == "additive":
                mask = jnp.zeros(g["mask_shape"], jnp.float32)
            return qkv, (mask, jax.random.key(int(rng.integers(0, 2**31))))

        return Workload(fn, make)

    def transpose_workload(self, src: str, dst: str) -> Workload:
        raise ValueError("attention: a one-stage problem has no transposes")

    def model_stage(self, i: int, cand: Candidate) -> float:
        g = self.sig
        impl = parse_config(cand.config).get("impl", "unfused")
        # The unfused path's batched matmuls want [B,H,S,D]: q, k, v and the output move.
        def time(impl):
            return model.attention(g["batch"], g["seq_q"], g["heads"], g["head_dim"], jnp.dtype(g["dtype"]).itemsize,
                                   g["dtype"], impl, 0 if impl == "fused" else 4)

        if impl == "fused" and _attn.slow_fused_mask(g["mask"], g["mask_shape"]):
            return time("unfused") * _attn.SLOW_FUSED_MASK_RATIO  # the kernels' general score rule: measured
        return time(impl)

    def model_transpose(self, src: str, dst: str) -> float:
        raise ValueError("attention: a one-stage problem has no transposes")
