"""What a layout/configuration problem is made of, independent of any one layer.

- A *layout label* names what one operator hands the next: tensor names, each with its
  axis order, e.g. "qkv:BS3HD" (one array [B, S, 3, H, D]) or "ffn:SBF;h:BSE" (the FFN
  activation [S, B, F] and the residual stream [B, S, E]). Labels are plain strings, so the
  solver and the cache never look inside them; `relayout` converts a value between two
  labels of the same tensors by transposing.
- A *candidate* of an operator is (input label, output label, config): the config string
  ("impl=fused", "bwd_threads=1024,fwd_threads=128", "" for none) is the algorithm and
  kernel configuration. New kernel-level layouts or kernel parameters are new candidates: the
  solver, the cache and the tuner stay as they are.
- A *Problem* lists its stages' candidates and, for each candidate and each label change,
  a `Workload` (a function and its example inputs) that the tuner times forward and
  backward, and a modelled cost for the heuristic.
- A *Selection* is the solved path: one Choice per stage, the cost and where it came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


def host_normal(rng, shape, dtype, scale: float = 1.0):
    """Standard normal values times `scale`, drawn and rounded to `dtype` on the host
    (numpy): a device-side conversion would compile a small program per new shape, a
    noticeable part of the tuner's time."""
    import jax.numpy as jnp
    import numpy as np

    return jnp.asarray((rng.standard_normal(shape, np.float32) * np.float32(scale)).astype(jnp.dtype(dtype)))


def config_str(**options) -> str:
    """The canonical config string: sorted `key=value` pairs joined by commas."""
    return ",".join(f"{k}={options[k]}" for k in sorted(options))


def parse_config(config: str) -> dict:
    if not config:
        return {}
    return dict(part.split("=", 1) for part in config.split(","))


def parse_label(label: str) -> dict:
    """"ffn:SBF;h:BSE" -> {"ffn": "SBF", "h": "BSE"}."""
    parts = {}
    for part in label.split(";"):
        name, _, axes = part.partition(":")
        if not name or not axes or name in parts:
            raise ValueError(f"bad layout label {label!r}")
        parts[name] = axes
    return parts


def label(**parts) -> str:
    return ";".join(f"{name}:{axes}" for name, axes in parts.items())


def convertible(a: str, b: str) -> bool:
    """Whether relayout can turn a value labelled `a` into one labelled `b`: the same
    tensors, each with the same axes in some order."""
    pa, pb = parse_label(a), parse_label(b)
    return pa.keys() == pb.keys() and all(sorted(pa[n]) == sorted(pb[n]) for n in pa)


def permutation(src: str, dst: str) -> tuple[int, ...]:
    """Axes of an array laid out as `src` (axis letters) to transpose it to `dst`."""
    return tuple(src.index(c) for c in dst)


def transpose(x, src: str, dst: str):
    import jax.numpy as jnp

    return x if src == dst else jnp.transpose(x, permutation(src, dst))


def atomic_transposes(a: str, b: str) -> list[tuple[str, str]] | None:
    """The single-array transposes (src axes, dst axes) that turn a value labelled `a`
    into one labelled `b` ([] when equal); None when impossible."""
    if not convertible(a, b):
        return None
    pa, pb = parse_label(a), parse_label(b)
    return [(pa[n], pb[n]) for n in pa if pa[n] != pb[n]]


def relayout(value: dict, a: str, b: str) -> dict:
    """A value (dict of arrays named as in label `a`) with every array transposed to its
    axis order in label `b`."""
    pa, pb = parse_label(a), parse_label(b)
    return {name: transpose(value[name], pa[name], pb[name]) for name in pa}


@dataclasses.dataclass(frozen=True)
class Candidate:
    in_layout: str
    out_layout: str
    config: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.in_layout, self.out_layout, self.config)

    def __str__(self) -> str:
        return f"{self.in_layout} -> {self.out_layout}" + (f" [{self.config}]" if self.config else "")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One operator: its name and candidates, the default configuration first (it wins
    ties, and `layouts="none"` takes it)."""

    name: str
    candidates: tuple[Candidate, ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the tuner times: `fn(diff, aux)` with `diff` a tuple of float arrays that are
    differentiated (forward and backward are timed together) and `aux` a tuple of other
    inputs (keys, masks). `make(seed)` returns concrete (diff, aux)."""

    fn: Callable
    make: Callable[[int], tuple[tuple, tuple]]


class Problem:
    """Interface of a selection problem (see EncoderProblem, AttentionProblem)."""

    kind: str = "problem"
    stages: tuple[Stage, ...] = ()

    def key(self) -> dict:
        """JSON-able description of the problem (shapes, dtypes, options) for the cache."""
        raise NotImplementedError

    def stage_workload(self, i: int, cand: Candidate) -> Workload:
        raise NotImplementedError

    def transpose_workload(self, src: str, dst: str) -> Workload:
        """Transposing one array from axis order `src` to `dst` (e.g. "BSE" -> "SBE"); a
        label change costs the sum of its arrays' transposes (`atomic_transposes`)."""
        raise NotImplementedError

    def layer_workload(self, selection: Selection) -> Workload | None:
        """Every stage under `selection` as one workload, to time whole configurations
        (`tuning.verify`); None: the problem has no such workload."""
        return None

    def model_stage(self, i: int, cand: Candidate) -> float:
        raise NotImplementedError

    def model_transpose(self, src: str, dst: str) -> float:
        raise NotImplementedError

    def default(self) -> list[Candidate]:
        return [s.candidates[0] for s in self.stages]


@dataclasses.dataclass(frozen=True)
class Choice:
    stage: str
    candidate: Candidate
    seconds: float | None = None           # this stage's time (measured or modelled)
    transpose_s: float | None = None       # the label change before this stage (0: none)


@dataclasses.dataclass(frozen=True)
class Selection:
    """A configuration of a problem's stages. `source`: "default", "heuristic" (byte
    model), "timed" (measured now), "cache" (measured earlier, read from disk) or "user".
    `cost_s`: the stages' and transposes' times added up; `layer_s`: the whole
    configuration timed end to end, where it was (`tuning.verify`)."""

    kind: str
    choices: tuple[Choice, ...]
    cost_s: float | None = None
    source: str = "user"
    layer_s: float | None = None

    def choice(self, stage: str) -> Choice:
        for c in self.choices:
            if c.stage == stage:
                return c
        raise KeyError(f"Selection has no stage {stage!r} (stages: {[c.stage for c in self.choices]})")

    def candidate(self, stage: str) -> Candidate:
        return self.choice(stage).candidate

    def config(self, stage: str) -> dict:
        return parse_config(self.candidate(stage).config)

    @classmethod
    def of(cls, problem: Problem, candidates: Sequence[Candidate], source: str = "user") -> Selection:
        """A Selection of `problem` from one candidate per stage (checked to exist)."""
        if len(candidates) != len(problem.stages):
            raise ValueError(f"{problem.kind}: {len(candidates)} candidates for {len(problem.stages)} stages")
        for stage, cand in zip(problem.stages, candidates):
            if cand not in stage.candidates:
                raise ValueError(f"{problem.kind}: {cand} is not a candidate of stage {stage.name!r}")
        return cls(problem.kind, tuple(Choice(s.name, c) for s, c in zip(problem.stages, candidates)),
                   None, source)

    def describe(self) -> str:
        """One line per stage: name, candidate, time; then the total."""
        def us(t):
            return "" if t is None else f"{t * 1e6:10.4g} us"

        rows, prev = [], None
        for c in self.choices:
            if prev is not None and prev != c.candidate.in_layout:
                rows.append(f"  {'(transpose)':<18} {prev + ' -> ' + c.candidate.in_layout:<44} {us(c.transpose_s)}")
            rows.append(f"  {c.stage:<18} {str(c.candidate):<44} {us(c.seconds)}")
            prev = c.candidate.out_layout
        total = "" if self.cost_s is None else f"{self.cost_s * 1e6:.4g} us"
        if self.layer_s is not None:
            total += f" (timed whole: {self.layer_s * 1e6:.4g} us)"
        return "\n".join([f"{self.kind} selection ({self.source}):", *rows, f"  total {total}"])

    def to_json(self) -> dict:
        return {"kind": self.kind, "source": self.source, "cost_s": self.cost_s, "layer_s": self.layer_s,
                "choices": [{"stage": c.stage, "in": c.candidate.in_layout, "out": c.candidate.out_layout,
                             "config": c.candidate.config, "seconds": c.seconds,
                             "transpose_s": c.transpose_s} for c in self.choices]}

    @classmethod
    def from_json(cls, data: dict) -> Selection:
        choices = tuple(Choice(c["stage"], Candidate(c["in"], c["out"], c["config"]), c.get("seconds"),
                               c.get("transpose_s")) for c in data["choices"])
        return cls(data["kind"], choices, data.get("cost_s"), data.get("source", "user"), data.get("layer_s"))

    def __str__(self) -> str:
        return self.describe()

