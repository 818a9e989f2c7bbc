"""The encoder layer as a chain of eight operators, each with layout/algorithm candidates.

Stages (post-LN BERT; pre-LN noted where it differs) and what each hands on:

  qkv                x [B,S,E] -> q/k/v in one array: BS3HD (default), 3BSHD or 3BHSD.
                     The QKV weight [E,3,H,D] is contracted so the matmul itself writes
                     the layout (pre-LN: layer norm first).
  attention          q/k/v in any of those -> context BSHD (default) or BHSD;
                     impl=unfused (default) or fused (where the fused kernel exists).
                     jaxsub.ops.attention takes [B,S,H,D]: other layouts are transposed
                     around it at the JAX level, where XLA may fold them into matmuls.
  out_proj           context -> proj BSE ([B·S,E], default) or SBE ([S,B,E]).
  bdrln1             LN(x + dropout(proj + bias)) in proj's layout -> hm and h, the same
                     values as two outputs (see h_label) (pre-LN: h = x + dropout(proj +
                     bias), a = LN(h)).
  ffn_in             hm (or a) -> ffn BSF or SBF; h is handed on as the residual.
  bias_gelu_dropout  in the ffn layout.
  ffn_out            ffn -> out BSE or SBE (h still handed on).
  bdrln2             LN(h + dropout(out + bias)) -> y [B,S,E] (pre-LN: h + dropout(...)).

Dropout is defined on the logical tensor whatever the layout: the row kernels index their
mask by row-major position, so an [S,B,N] candidate of a row op with dropout active
transposes to [B,S,N] around the kernel (without dropout it runs in place). Every
candidate therefore computes the same numbers as the default; kernel-level support for a
row map would add a cheaper candidate, nothing else.

Kernel configurations: where the CUDA row kernels run, bdrln1, bias_gelu_dropout and
bdrln2 (the stages that call a fused row op: BDRLN, or pre-LN layer_norm, and GELU) also
offer each layout pair whose token tensors are row-major with the launch shapes of
ROW_KERNEL_CONFIGS (config
"bwd_threads=...,fwd_threads=...", passed to the op as `kernel_config`); "" is the
op's default. They change the rows per block of the forward and the backward kernel
(defaults 256 and 512 threads), never the numbers beyond the order of f32 sums.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsub import _ffi, ops
from jaxsub.layout.problem import (
    Candidate, host_normal, Problem, Selection, Stage, Workload, config_str, parse_config, parse_label, relayout, transpose)
from jaxsub.ops import attn as _attn
from jaxsub.ops import dropout as _dropout
from jaxsub.ops import gemm as _gemm
from jaxsub.ops import norm as _norm

QKV_LAYOUTS = ("BS3HD", "3BSHD", "3BHSD")
CTX_LAYOUTS = ("BSHD", "BHSD")
TOKEN_LAYOUTS = ("BSE", "SBE")
FFN_LAYOUTS = ("BSF", "SBF")
STAGE_NAMES = ("qkv", "attention", "out_proj", "bdrln1", "ffn_in", "bias_gelu_dropout", "ffn_out", "bdrln2")
IN_LABEL, OUT_LABEL = "x:BSE", "y:BSE"
# The layer's parameters after the cast to the compute dtype, by name.
PARAM_AXES = {"qkv_kernel": "E3HD", "qkv_bias": "3HD", "out_kernel": "HDE", "out_bias": "E",
              "attn_scale": "E", "attn_bias": "E", "in_kernel": "EF", "in_bias": "F",
              "ffn_kernel": "FE", "ffn_bias": "E", "mlp_scale": "E", "mlp_bias": "E"}
PARAMS = tuple(PARAM_AXES)
# The row stages' kernel configurations besides the default: threads per block of the
# forward kernel (default 256) x of the backward kernel (default 512).
ROW_KERNEL_CONFIGS = tuple(config_str(fwd_threads=f, bwd_threads=b)
                           for f, b in itertools.product((128, 512), (256, 1024)))
BDRLN = "bias_dropout_residual_layer_norm"


def _token_row_major(cand: Candidate) -> bool:
    """Whether every token tensor a candidate reads or hands on is [B, S, E] (the FFN
    activation's own layout may be either)."""
    labels = {**parse_label(cand.in_layout), **parse_label(cand.out_layout)}
    return all(v == TOKEN_LAYOUTS[0] for k, v in labels.items() if k in ("proj", "h", "a", "out"))


def row_op(stage: str, cand: Candidate) -> str | None:
    """The fused row op whose kernel configuration candidate `cand` of `stage` chooses
    (None for the other stages). Pre-LN's bdrln1 (it hands on "a") runs layer_norm."""
    if stage == "bias_gelu_dropout":
        return "bias_gelu_dropout"
    if stage == "bdrln1" and "a" in parse_label(cand.out_layout):
        return "layer_norm"
    return BDRLN if stage in ("bdrln1", "bdrln2") else None


def kernel_config(cand: Candidate) -> dict:
    """A row stage candidate's `kernel_config` for the op ({}: the defaults)."""
    return {k: int(v) for k, v in parse_config(cand.config).items()}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Everything the layer's timing depends on. `training`: dropout active (the tuner
    times training steps; the selection is used for inference too)."""

    batch: int
    seq: int
    hidden: int
    heads: int
    mlp_dim: int
    dtype: str = "bfloat16"
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    pre_layer_norm: bool = False
    causal: bool = False
    epsilon: float = 1e-5
    approximate_gelu: bool = False
    mask_shape: tuple | None = None
    mask_dtype: str | None = None
    training: bool = True
    broadcast_dropout: bool = False  # one [S, S] attention keep mask for every batch element and head

    def __post_init__(self):
        for name in ("batch", "seq", "hidden", "heads", "mlp_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"LayerSpec: {name} must be a positive int, got {value!r}")
        for name in ("dropout_rate", "attention_dropout_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"LayerSpec: {name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"LayerSpec: hidden {self.hidden} is not divisible by heads {self.heads}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        if self.mask_shape is not None:
            object.__setattr__(self, "mask_shape", tuple(int(n) for n in self.mask_shape))

    @property
    def dims(self) -> dict:
        return {"B": self.batch, "S": self.seq, "E": self.hidden, "H": self.heads,
                "D": self.hidden // self.heads, "F": self.mlp_dim, "3": 3}

    def shape(self, axes: str) -> tuple[int, ...]:
        return tuple(self.dims[c] for c in axes)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["mask_shape"] = list(self.mask_shape) if self.mask_shape is not None else None
        if not self.broadcast_dropout:  # named only when set: the layout caches' keys stay as they were
            del d["broadcast_dropout"]
        return d


def _ein(axes: str) -> str:
    return axes.lower().replace("3", "t")


def _place(a, src: str, dst: str):
    """`a` (axes src, a subset of dst) transposed to dst's order with unit axes for the
    letters it lacks, so it broadcasts against an array laid out as dst."""
    order = "".join(c for c in dst if c in src)
    a = transpose(a, src, order)
    return a.reshape([a.shape[order.index(c)] if c in src else 1 for c in dst])


def _rowwise(layout: str, canonical: str, active: bool, fn, *arrays):
    """fn over row-wise arrays laid out as `layout`. With dropout active and a layout
    other than the canonical one the arrays are transposed to it around fn, so that the
    mask is drawn on the logical tensor."""
    if layout == canonical or not active:
        return fn(*arrays)
    out = fn(*(transpose(a, layout, canonical) for a in arrays))
    return jax.tree.map(lambda o: transpose(o, canonical, layout), out)


def _residual(x, y, bias, rate, key):
    """x + dropout(y + bias) (pre-LN), mask from ops.dropout_mask on y's shape, drawn again
    in the backward rather than kept."""
    return _dropout.residual_add(x, y, bias, rate=rate, key=key)


def _dense(ext, a, kernel, bias=None, *, layer_input=False):
    """`ops.dense` of a's axes after B, S with the kernel's leading axes, where apply's
    library_products asks for it, the dtypes agree and are 16-bit; else None (the stage's
    einsum). layer_input: `a` is the layer's input, which the first residual reads again
    (post-LN): ext["x"] becomes the copy `dense_and_input` hands on, so that the
    residual's gradient is added into dx by the dx product."""
    if (not ext["library"] or not _gemm.in_place_pays(a.dtype) or a.dtype != kernel.dtype
            or (bias is not None and bias.dtype != a.dtype)):
        return None
    if layer_input:
        out, ext["x"] = _gemm.dense_and_input(a, kernel, bias, axes=a.ndim - 2)
        return out
    return ops.dense(a, kernel, bias, axes=a.ndim - 2)


class EncoderProblem(Problem):
    kind = "encoder_layer"

    def __init__(self, spec: LayerSpec, platform: str | None = None, *, kernel_configs: bool | None = None):
        """`kernel_configs`: offer the row stages' kernel configurations (ROW_KERNEL_CONFIGS).
        None: where the CUDA row kernels run (on CPU they would be timed for nothing: the
        handlers ignore them); True also elsewhere (tests), False nowhere."""
        self.spec = spec
        self.platform = platform or jax.default_backend()
        if kernel_configs is None:
            kernel_configs = self.platform == "gpu" and _ffi.has_cuda_target("jaxsub_bdrln_fwd")
        self.kernel_configs = bool(kernel_configs)
        s = spec
        # The fused attention kernel is a candidate only where it runs as itself.
        impls = ["unfused"]
        if _attn.fused_unsupported(self.platform, s.dtype, s.hidden // s.heads) is None:
            impls.append("fused")
        h = self.h_label
        rows = self._with_kernel_configs
        self.stages = (
            Stage("qkv", tuple(Candidate(IN_LABEL, f"qkv:{q}") for q in QKV_LAYOUTS)),
            Stage("attention", tuple(Candidate(f"qkv:{q}", f"ctx:{c}", config_str(impl=i))
                                     for q, c, i in itertools.product(QKV_LAYOUTS, CTX_LAYOUTS, impls))),
            Stage("out_proj", tuple(Candidate(f"ctx:{c}", f"proj:{p}")
                                    for c, p in itertools.product(CTX_LAYOUTS, TOKEN_LAYOUTS))),
            Stage("bdrln1", rows(s.hidden, [Candidate(f"proj:{p}", h(p)) for p in TOKEN_LAYOUTS])),
            Stage("ffn_in", tuple(Candidate(h(p), f"ffn:{f};h:{p}")
                                  for p, f in itertools.product(TOKEN_LAYOUTS, FFN_LAYOUTS))),
            Stage("bias_gelu_dropout", rows(s.mlp_dim, [Candidate(f"ffn:{f};h:{p}", f"ffn:{f};h:{p}")
                                                        for p, f in itertools.product(TOKEN_LAYOUTS, FFN_LAYOUTS)])),
            Stage("ffn_out", tuple(Candidate(f"ffn:{f};h:{p}", f"out:{r};h:{p}")
                                   for p, f, r in itertools.product(TOKEN_LAYOUTS, FFN_LAYOUTS, TOKEN_LAYOUTS))),
            Stage("bdrln2", rows(0 if s.pre_layer_norm else s.hidden,
                                 [Candidate(f"out:{r};h:{p}", OUT_LABEL)
                                  for p, r in itertools.product(TOKEN_LAYOUTS, TOKEN_LAYOUTS)])),
        )

    def _with_kernel_configs(self, cols: int, cands: list) -> tuple:
        """A row stage's candidates: the layout pairs with the default kernel configuration
        first (each is listed before its other configurations, so it wins their ties), then,
        where the fused kernel runs (kernel configurations offered, rows of 1 to MAX_COLS;
        cols 0: the stage has no row op), every other configuration of the pairs whose token
        tensors are row-major [B, S, E] (TOKEN_LAYOUTS[0]) — the layouts the kernels are
        tuned for; offering them for every pair would triple the row stages' tuning time."""
        extra = ROW_KERNEL_CONFIGS if self.kernel_configs and 0 < cols <= _ffi.MAX_COLS else ()
        row_major = [c for c in cands if _token_row_major(c)]
        return tuple(cands) + tuple(dataclasses.replace(c, config=k) for k in extra for c in row_major)

    def h_label(self, p: str) -> str:
        """What bdrln1 hands on: the feed-forward input and "h", the residual of bdrln2.
        Pre-LN: "a" = layer_norm(h), from the kernel that writes h (ops.norm.bdrln_and_sum).
        Post-LN: "hm", the same values as h, returned as a
        second output of the fused op (ops.norm.bdrln_pair), so that its backward kernel
        adds the two consumers' cotangents as it reads them (no XLA add)."""
        return f"a:{p};h:{p}" if self.spec.pre_layer_norm else f"hm:{p};h:{p}"

    def key(self) -> dict:
        return {"problem": self.kind, **self.spec.to_json()}

    # -----------------------------------------------------------------------------------
    # The stages. Each takes (candidate, params, value in the input label, ext) and
    # returns the value in the output label; ext = {"x": layer input, "mask", "keys",
    # "deterministic", "library" (apply's library_products)}; keys = {"attn", "drop1",
    # "gelu", "drop2"}, None where off.

    def run_stage(self, i, cand: Candidate, p, v, ext):
        return getattr(self, "_" + STAGE_NAMES[i])(cand, p, v, ext)

    def _qkv_input(self, p, v, ext):
        """The q/k/v product's input: x, or (pre-LN) its layer norm."""
        s = self.spec
        a = v["x"]
        if s.pre_layer_norm:  # x is also the first residual: its gradient is added by the LN backward
            a, ext["x"] = _norm.layer_norm_and_input(a, p["attn_scale"], p["attn_bias"], eps=s.epsilon,
                                                     kernel_config={})
        return a

    def _qkv(self, cand, p, v, ext):
        s = self.spec
        a = self._qkv_input(p, v, ext)
        q = parse_label(cand.out_layout)["qkv"]
        out = _dense(ext, a, p["qkv_kernel"], p["qkv_bias"], layer_input=not s.pre_layer_norm) if q == "BS3HD" else None
        if out is not None:  # the bias in the GEMM's epilogue
            return {"qkv": out}
        out = jnp.einsum(f"bse,ethd->{_ein(q)}", a, p["qkv_kernel"])
        if q.endswith("3HD"):  # the bias is a suffix: its gradient by the fused column sum
            return {"qkv": ops.bias_add(out, p["qkv_bias"])}
        return {"qkv": out + _place(p["qkv_bias"], "3HD", q)}

    def _attention_kw(self, cand, ext) -> dict:
        s = self.spec
        key = ext["keys"]["attn"]
        return dict(mask=ext["mask"], causal=s.causal,
                    dropout_rate=s.attention_dropout_rate if key is not None else 0.0, key=key,
                    broadcast_dropout=s.broadcast_dropout,
                    implementation=parse_config(cand.config).get("impl", "unfused"))

    def _attention(self, cand, p, v, ext):
        src = parse_label(cand.in_layout)["qkv"]
        dst = parse_label(cand.out_layout)["ctx"]
        kw = self._attention_kw(cand, ext)
        if src in ("BS3HD", "3BSHD"):  # one array the fused kernels read in place
            out = ops.attention_packed(v["qkv"], axis=src.index("3"), **kw)
        else:
            per = src.replace("3", "")
            out = ops.attention(*(transpose(jax.lax.index_in_dim(v["qkv"], i, src.index("3"), keepdims=False), per,
                                            "BSHD") for i in range(3)), **kw)
        return {"ctx": transpose(out, "BSHD", dst)}

    def _qkv_attention_fits(self, qkv: Candidate, att: Candidate, params) -> bool:
        """Whether qkv and attention can run as one ops.dense_attention_packed: the packed
        product through ops.dense (library_products) into [B, S, 3, H, D], read there by
        the attention with no relayout between, 16-bit operands of one dtype."""
        k = params["qkv_kernel"]
        return (parse_label(qkv.out_layout)["qkv"] == "BS3HD" and att.in_layout == qkv.out_layout
                and _gemm.in_place_pays(k.dtype) and k.dtype == self.spec.dtype
                and params["qkv_bias"].dtype == k.dtype)

    def _qkv_attention(self, cand, p, v, ext):
        """qkv and attention (cand) as one ops.dense_attention_packed, whose fused backward
        takes the q/k/v bias gradient from the attention's (post-LN: the layer input handed
        on, as `_dense` does)."""
        s = self.spec
        a = self._qkv_input(p, v, ext)
        out = ops.dense_attention_packed(a, p["qkv_kernel"], p["qkv_bias"], axes=a.ndim - 2,
                                         with_input=not s.pre_layer_norm, **self._attention_kw(cand, ext))
        if not s.pre_layer_norm:
            out, ext["x"] = out
        return {"ctx": transpose(out, "BSHD", parse_label(cand.out_layout)["ctx"])}

    def _out_proj(self, cand, p, v, ext):
        src = parse_label(cand.in_layout)["ctx"]
        dst = parse_label(cand.out_layout)["proj"]
        out = _dense(ext, v["ctx"], p["out_kernel"]) if (src, dst) == ("BSHD", "BSE") else None
        if out is None:
            out = jnp.einsum(f"{_ein(src)},hde->{_ein(dst)}", v["ctx"], p["out_kernel"])
        return {"proj": out}

    def _bdrln1(self, cand, p, v, ext):
        s = self.spec
        lay = parse_label(cand.in_layout)["proj"]
        key, det = ext["keys"]["drop1"], ext["deterministic"]
        x = transpose(ext["x"], "BSE", lay)
        kc = kernel_config(cand)
        if s.pre_layer_norm:  # h = x + dropout(proj + bias) and layer_norm(h) from one kernel
            def bdrln(y, r):
                return _norm.bdrln_and_sum(y, p["out_bias"], r, p["mlp_scale"], p["mlp_bias"], rate=s.dropout_rate,
                                           key=key, eps=s.epsilon, deterministic=det, kernel_config=kc)

            a, h = _rowwise(lay, "BSE", key is not None, bdrln, v["proj"], x)
            return {"a": a, "h": h}

        def bdrln(y, r):
            return _norm.bdrln_pair(y, p["out_bias"], r, p["attn_scale"], p["attn_bias"], rate=s.dropout_rate,
                                    key=key, eps=s.epsilon, deterministic=det, kernel_config=kc)

        hm, h = _rowwise(lay, "BSE", key is not None, bdrln, v["proj"], x)
        return {"hm": hm, "h": h}

    def _ffn_in(self, cand, p, v, ext):
        src = parse_label(cand.in_layout)["h"]
        dst = parse_label(cand.out_layout)["ffn"]
        a = v["a"] if self.spec.pre_layer_norm else v["hm"]
        out = _dense(ext, a, p["in_kernel"]) if (src, dst) == ("BSE", "BSF") else None
        if out is None:
            out = jnp.einsum(f"{_ein(src)},ef->{_ein(dst)}", a, p["in_kernel"])
        return {"ffn": out, "h": v["h"]}

    def _bias_gelu_dropout(self, cand, p, v, ext):
        s = self.spec
        lay = parse_label(cand.in_layout)["ffn"]
        key, det = ext["keys"]["gelu"], ext["deterministic"]

        def gelu(f):
            return ops.bias_gelu_dropout(f, p["in_bias"], rate=s.dropout_rate, key=key,
                                         approximate=s.approximate_gelu, deterministic=det,
                                         kernel_config=kernel_config(cand))

        return {"ffn": _rowwise(lay, "BSF", key is not None, gelu, v["ffn"]), "h": v["h"]}

    def _gelu_dense(self, gelu_cand, p, v, ext):
        """bias_gelu_dropout and ffn_out as one op (apply's recompute_gelu), row-major."""
        s = self.spec
        out = ops.bias_gelu_dropout_dense(v["ffn"], p["in_bias"], p["ffn_kernel"], rate=s.dropout_rate,
                                          key=ext["keys"]["gelu"], approximate=s.approximate_gelu,
                                          deterministic=ext["deterministic"], kernel_config=kernel_config(gelu_cand),
                                          library_products=ext["library"])
        return {"out": out, "h": v["h"]}

    def _ffn_out(self, cand, p, v, ext):
        src = parse_label(cand.in_layout)["ffn"]
        dst = parse_label(cand.out_layout)["out"]
        out = _dense(ext, v["ffn"], p["ffn_kernel"]) if (src, dst) == ("BSF", "BSE") else None
        if out is None:
            out = jnp.einsum(f"{_ein(src)},fe->{_ein(dst)}", v["ffn"], p["ffn_kernel"])
        return {"out": out, "h": v["h"]}

    def _bdrln2(self, cand, p, v, ext):
        s = self.spec
        parts = parse_label(cand.in_layout)
        lay = parts["out"]
        key, det = ext["keys"]["drop2"], ext["deterministic"]
        h = transpose(v["h"], parts["h"], lay)
        if s.pre_layer_norm:
            y = _rowwise(lay, "BSE", key is not None,
                         lambda o, r: _residual(r, o, p["ffn_bias"], s.dropout_rate, key), v["out"], h)
        else:
            def bdrln(o, r):
                return ops.bias_dropout_residual_layer_norm(o, p["ffn_bias"], r, p["mlp_scale"], p["mlp_bias"],
                                                            rate=s.dropout_rate, key=key, eps=s.epsilon,
                                                            deterministic=det, kernel_config=kernel_config(cand))

            y = _rowwise(lay, "BSE", key is not None, bdrln, v["out"], h)
        return {"y": transpose(y, lay, "BSE")}

    # -----------------------------------------------------------------------------------
    # The whole layer.

    def check(self, selection: Selection) -> Selection:
        """`selection` if it fits this layer (stage names, and label pairs that are
        candidates here; the config may be any the stage understands), else ValueError."""
        if selection.kind != self.kind or [c.stage for c in selection.choices] != list(STAGE_NAMES):
            raise ValueError(f"jaxsub.layout: a {selection.kind} selection with stages "
                             f"{[c.stage for c in selection.choices]} does not fit the encoder layer "
                             f"(stages {list(STAGE_NAMES)})")
        for stage, choice in zip(self.stages, selection.choices):
            pairs = {(c.in_layout, c.out_layout) for c in stage.candidates}
            got = (choice.candidate.in_layout, choice.candidate.out_layout)
            if got not in pairs:
                raise ValueError(f"jaxsub.layout: stage {stage.name!r} has no candidate {got[0]} -> {got[1]} "
                                 f"for this layer (pre_layer_norm={self.spec.pre_layer_norm})")
        return selection

    def apply(self, selection: Selection, params: dict, x, mask=None, keys=None, deterministic=True,
              recompute_gelu=False, library_products=False):
        """The layer's output [B,S,E] for x [B,S,E] with the stages `selection` chose.

        recompute_gelu: where bias_gelu_dropout and ffn_out are both row-major ([B, S, F]
        into [B, S, E]), run them as one `ops.bias_gelu_dropout_dense`, whose backward
        writes the GELU output again rather than keeping it (one residual less, for
        memory).
        library_products: the four projections, where row-major, through `ops.dense`
        (jaxsub's GEMM target, which XLA runs on slices of stacked parameters and
        residuals in place: also for a scanned stack), the q/k/v bias in its epilogue;
        with the packed attention after it, both as one `ops.dense_attention_packed`."""
        choices = self.check(selection).choices
        ext = {"x": x, "mask": mask, "keys": _keys(keys), "deterministic": bool(deterministic),
               "library": bool(library_products)}
        ffn_in, gelu, ffn_out = (STAGE_NAMES.index(n) for n in ("ffn_in", "bias_gelu_dropout", "ffn_out"))
        dense = recompute_gelu and self._dense_fits(choices[gelu].candidate, choices[ffn_out].candidate)
        fused_in = ext["library"] and self._fused_in_fits(choices[ffn_in].candidate, choices[gelu].candidate, params)
        qkv_att = ext["library"] and self._qkv_attention_fits(choices[0].candidate, choices[1].candidate, params)
        value, prev = {"x": x}, IN_LABEL
        for i, choice in enumerate(choices):
            cand = choice.candidate
            if cand.in_layout != prev:
                value = relayout(value, prev, cand.in_layout)
            if (fused_in and i == ffn_in) or (dense and i == gelu) or (qkv_att and i == 0):
                pass  # run with the stage after
            elif qkv_att and i == 1:
                value = self._qkv_attention(cand, params, value, ext)
            elif fused_in and i == gelu:
                value = self._dense_gelu(cand, params, value, ext, None)
            elif dense and i == ffn_out:
                value = (self._dense_gelu(choices[gelu].candidate, params, value, ext, params["ffn_kernel"])
                         if fused_in else self._gelu_dense(choices[gelu].candidate, params, value, ext))
            else:
                value = self.run_stage(i, cand, params, value, ext)
            prev = cand.out_layout
        return value["y"]

    def _fused_in_fits(self, ffn_in: Candidate, gelu: Candidate, params) -> bool:
        """Whether ffn_in and bias_gelu_dropout can run as ops.dense_bias_gelu_dropout:
        [B, S, E] into [B, S, F], no relayout between, 16-bit operands of one dtype."""
        a = params["in_kernel"]
        return (parse_label(ffn_in.in_layout)["h"] == TOKEN_LAYOUTS[0] and ffn_in.out_layout == gelu.in_layout
                and parse_label(gelu.in_layout)["ffn"] == FFN_LAYOUTS[0] and _gemm.in_place_pays(a.dtype)
                and a.dtype == self.spec.dtype and params["in_bias"].dtype == a.dtype)

    def _dense_gelu(self, gelu_cand, p, v, ext, out_kernel):
        """ffn_in and bias_gelu_dropout (and ffn_out, given its kernel) as one
        ops.dense_bias_gelu_dropout (on an H200 with JAXSUB_DENSE_GELU=1, one GEMM that writes
        the GELU output)."""
        s = self.spec
        a = v["a"] if s.pre_layer_norm else v["hm"]
        out = ops.dense_bias_gelu_dropout(a, p["in_kernel"], p["in_bias"], rate=s.dropout_rate,
                                          key=ext["keys"]["gelu"], approximate=s.approximate_gelu,
                                          deterministic=ext["deterministic"], kernel_config=kernel_config(gelu_cand),
                                          out_kernel=out_kernel, library_products=ext["library"])
        return {"out" if out_kernel is not None else "ffn": out, "h": v["h"]}

    @staticmethod
    def _dense_fits(gelu: Candidate, ffn_out: Candidate) -> bool:
        """Whether bias_gelu_dropout and ffn_out can run as bias_gelu_dropout_dense: the
        feed-forward activations [B, S, F] into a [B, S, E] output, no relayout between."""
        return (parse_label(gelu.in_layout)["ffn"] == FFN_LAYOUTS[0] and gelu.out_layout == ffn_out.in_layout
                and parse_label(ffn_out.out_layout)["out"] == TOKEN_LAYOUTS[0])

    # -----------------------------------------------------------------------------------
    # What the tuner times.

    def label_value(self, lab: str, rng) -> dict:
        return {n: host_normal(rng, self.spec.shape(axes), self.spec.dtype) for n, axes in parse_label(lab).items()}

    def stage_params(self, i: int) -> tuple[str, ...]:
        """The parameters stage i reads (only these are differentiated when it is timed:
        gradients of unused ones would be zero tensors written for nothing)."""
        pre = self.spec.pre_layer_norm
        return {
            "qkv": ("qkv_kernel", "qkv_bias") + (("attn_scale", "attn_bias") if pre else ()),
            "attention": (),
            "out_proj": ("out_kernel",),
            "bdrln1": ("out_bias",) + (("mlp_scale", "mlp_bias") if pre else ("attn_scale", "attn_bias")),
            "ffn_in": ("in_kernel",),
            "bias_gelu_dropout": ("in_bias",),
            "ffn_out": ("ffn_kernel",),
            "bdrln2": ("ffn_bias",) + (() if pre else ("mlp_scale", "mlp_bias")),
        }[STAGE_NAMES[i]]

    def random_params(self, rng, names=PARAMS) -> dict:
        s = self.spec
        return {n: host_normal(rng, s.shape(PARAM_AXES[n]), s.dtype, 1 / np.sqrt(s.shape(PARAM_AXES[n])[0]))
                for n in names}

    def random_ext(self, rng) -> tuple[dict, object]:
        """(keys, mask) for a training step of this spec."""
        s = self.spec
        train = s.training
        seeds = rng.integers(0, 2**31, size=4)
        keys = {n: jax.random.key(int(k)) if train and r > 0 else None
                for n, k, r in zip(("attn", "drop1", "gelu", "drop2"), seeds,
                                   (s.attention_dropout_rate, s.dropout_rate, s.dropout_rate, s.dropout_rate))}
        mask = None
        if s.mask_shape is not None:
            if s.mask_dtype == "bool":
                m = rng.random(s.mask_shape) > 0.2
                m[..., 0] = True
                mask = jnp.asarray(m)
            else:
                mask = jnp.zeros(s.mask_shape, s.mask_dtype or jnp.float32)
        return keys, mask

    def stage_workload(self, i: int, cand: Candidate) -> Workload:
        uses_x = STAGE_NAMES[i] == "bdrln1"
        det = not self.spec.training

        def fn(diff, aux):
            params, value, x = diff
            keys, mask = aux
            ext = {"x": x, "mask": mask, "keys": keys, "deterministic": det, "library": False}
            return self.run_stage(i, cand, params, value, ext)

        def make(seed):
            rng = np.random.default_rng(seed)
            x = self.label_value(IN_LABEL, rng)["x"] if uses_x else None
            return ((self.random_params(rng, self.stage_params(i)), self.label_value(cand.in_layout, rng), x),
                    self.random_ext(rng))

        return Workload(fn, make)

    def layer_workload(self, selection: Selection) -> Workload:
        """The whole layer under `selection` (forward + backward: x and every parameter),
        to measure a configuration end to end."""
        det = not self.spec.training

        def fn(diff, aux):
            params, x = diff
            keys, mask = aux
            return self.apply(selection, params, x, mask=mask, keys=keys, deterministic=det)

        def make(seed):
            rng = np.random.default_rng(seed)
            return (self.random_params(rng), self.label_value(IN_LABEL, rng)["x"]), self.random_ext(rng)

        return Workload(fn, make)

    def transpose_workload(self, src: str, dst: str) -> Workload:
        """Transposing one array laid out as `src` (axis letters) to `dst`."""
        def make(seed):
            rng = np.random.default_rng(seed)
            return (host_normal(rng, self.spec.shape(src), self.spec.dtype),), ()

        return Workload(lambda diff, aux: transpose(diff[0], src, dst), make)

    def model_stage(self, i: int, cand: Candidate) -> float:
        from jaxsub.layout import model

        return model.encoder_stage(self, i, cand)

    def model_transpose(self, src: str, dst: str) -> float:
        from jaxsub.layout import model

        return model.transpose(self.spec.shape(src), self.spec.dtype)


def _keys(keys) -> dict:
    keys = dict(keys or {})
    return {n: keys.get(n) for n in ("attn", "drop1", "gelu", "drop2")}

