"""What one sample costs a tower: parameters, FLOPs, bytes moved, activations kept for backward.

Why per *block* and per *sample*: the partitioner needs the cost of any slice of a tower (``L/pp``
layers, split ``tp`` ways) at any microbatch size, so a tower is described as a ``pre`` block
(embeddings), ``layers`` identical transformer blocks and a ``post`` block (final norm, head), each
as the GEMM shapes, attention sizes, elementwise traffic and stored activations of one sample.
Everything else (time on a device, memory per device, bytes on links) is derived in ``cost/``.

Two sources:

* **analytic**, from the model config shared with the model builders (``conf/model/*.yaml``); the
  parameter counts follow timm's ``VisionTransformer``, transformers' ``CLIPTextModel`` and
  ``BertModel`` layer by layer (tests compare them with real modules);
* **measured**, by timing the real module forward and backward at a few microbatch sizes in this
  process and fitting ``t(b) = a + c * b`` (:mod:`lightning_distmm.planner.measure.tower_timing`);
  a microbatch between two measured sizes is priced between their times, the fit's slope
  extending them beyond; activation bytes are measured by counting the tensors autograd saves. A measured fit
  (:class:`MeasuredFit`) replaces the analytic compute time at ``tp = pp = 1`` and rescales the
  analytic time for other splits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_distmm.planner.machine.config import to_plain
from lightning_distmm.planner.profiles.blocks import (
    BWD_ELEM_RATIO,
    Attn,
    Block,
    Gemm,
    attention_pool,
    cross_block,
    map_pool,
    merge_blocks,
    transformer_block,
)

ARCHS = ("vit", "clip_text", "bert", "text_decoder")


@dataclass
class MeasuredFit:
    """Forward / backward seconds and activation bytes as ``a + c * microbatch`` on one device; the
    times at the sizes timed (``raw``) price the microbatches between them (:meth:`fwd_time`)."""

    device: str
    batch_sizes: list[int]
    fwd: tuple[float, float]
    bwd: tuple[float, float]
    act_bytes: tuple[float, float]
    params: int
    trainable_params: int
    raw: list[dict[str, float]] = field(default_factory=list)
    opt_time: float | None = None  # seconds of one AdamW step over the tower's trainable parameters
    #: seconds the runtime's own per-layer work adds to a forward and a backward, by the form that
    #: adds it (``"tp"``: DTensor's dispatch under tensor parallelism; ``"fsdp"``: FSDP2's hooks and
    #: copies), each ``((a, c), (a, c))`` for ``a + c * microbatch``; measured on a mesh of one rank
    #: (:func:`lightning_distmm.planner.measure.tower_timing.measure_wrapped`) or on a pair of ranks
    #: (``benchmarks/placement_emulated.py``), empty if not measured
    runtime_overhead: dict[str, tuple[tuple[float, float], tuple[float, float]]] = field(default_factory=dict)
    #: seconds an AdamW step over the tower's parameters takes beyond a plain one when they are the
    #: runtime's DTensors, by form (``"tp"``, ``"fsdp"``): a per-tensor dispatch cost that bytes do
    #: not price; empty if not measured
    optimizer_overhead: dict[str, float] = field(default_factory=dict)

    def fwd_time(self, mb: Any) -> Any:
        return self._time("fwd", self.fwd, mb)

    def bwd_time(self, mb: Any) -> Any:
        return self._time("bwd", self.bwd, mb)

    def _time(self, key: str, fit: tuple[float, float], mb: Any) -> Any:
        """Seconds at ``mb`` rows: between the smallest and the largest size timed (``raw``), the
        straight line between the two timed sizes around ``mb``; above them, the largest timed
        size's time plus the fit's ``c`` per row; below them, the smallest timed size's time less
        ``c`` per row but never below ``a + c * mb`` (a microbatch smaller than any timed keeps at
        least the fit's fixed cost: pricing it lower makes many small microbatches look free);
        without two timed sizes, ``a + c * mb``. A timed size slower than a larger one (a hiccup
        on a shared host) counts as the larger one's time: more rows never take less.

        Why not the line alone: a CPU tower's time per row grows with the batch (the side-by-side
        text tower: 2.7 ms a row at 16 rows, 3.3 at 32, 4.9 at 1), so the least-squares line over
        4-32 rows ran through the origin and priced sixteen one-row microbatches like one of 16 rows
        (measured 186 against 131 ms)."""
        line = fit[0] + fit[1] * np.asarray(mb, dtype=float)
        pts = sorted({float(r["batch"]): float(r[key]) for r in self.raw if key in r and "batch" in r}.items())
        if len(pts) < 2:
            return line if np.ndim(mb) else float(line)
        xs, ys = (np.asarray(v, dtype=float) for v in zip(*pts, strict=True))
        ys = np.minimum.accumulate(ys[::-1])[::-1]  # more rows never take less time (a hiccup does)
        x = np.asarray(mb, dtype=float)
        below = np.maximum(ys[0] + fit[1] * (x - xs[0]), line)  # never cheaper than the line says
        beyond = np.where(x < xs[0], below, ys[-1] + fit[1] * (x - xs[-1]))
        out = np.where((x >= xs[0]) & (x <= xs[-1]), np.interp(x, xs, ys), np.maximum(beyond, 0.0))
        return out if np.ndim(mb) else float(out)


@dataclass
class TowerProfile:
    """One tower: ``pre`` + ``layers`` x ``layer`` + ``post``, plus what the planner must respect.

    ``heads`` bounds tensor parallelism (tp must divide it), ``layers`` bounds pipeline parallelism
    (pp must divide it). ``embed_dim`` is the feature width exchanged at the batch sync.
    ``cross_from``/``cross_elems``: a tower fed by another tower's tokens (CoCa's multimodal text
    decoder reads the image tokens), ``cross_elems`` elements per sample.
    """

    name: str
    arch: str
    frozen: bool
    layers: int
    heads: int
    width: int
    seq: int
    embed_dim: int
    pre: Block
    layer: Block
    post: Block
    cross_from: str | None = None
    cross_elems: float = 0.0
    measured: MeasuredFit | None = None
    analytic: bool = True

    @property
    def params(self) -> int:
        if not self.analytic and self.measured is not None:
            return self.measured.params
        return self.pre.params + self.layers * self.layer.params + self.post.params

    @property
    def trainable_params(self) -> int:
        if self.frozen:
            return 0
        if not self.analytic and self.measured is not None:
            return self.measured.trainable_params
        return self.params

    def flops_per_sample(self) -> float:
        """Forward FLOPs of one sample (training adds 2x for backward unless frozen)."""
        if not self.analytic and self.measured is not None:
            return 0.0
        return self.pre.flops() + self.layers * self.layer.flops() + self.post.flops()

    def train_flops_per_sample(self) -> float:
        return self.flops_per_sample() * (1.0 if self.frozen else 3.0)

    def valid_tp(self, devices_per_node: int) -> list[int]:
        """tp values that divide the heads (and the MLP width) and fit in a node."""
        if not self.analytic:
            return [1]
        return [t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0 and self.heads % t == 0]

    def valid_pp(self, limit: int) -> list[int]:
        if not self.analytic:
            return [1]
        return [p for p in range(1, min(self.layers, limit) + 1) if self.layers % p == 0]

    def summary(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "params": self.params,
            "frozen": self.frozen,
            "layers": self.layers,
            "width": self.width,
            "heads": self.heads,
            "tokens": self.seq,
            "gflops_per_sample": self.flops_per_sample() / 1e9,
        }


def _req(cfg: Mapping[str, Any], key: str, name: str) -> Any:
    if key not in cfg:
        raise ValueError(f"tower {name!r} ({cfg.get('arch')}): model config lacks {key!r}")
    return cfg[key]


def tower_profile(
    name: str, cfg: Mapping[str, Any], embed_dim: int, towers: Mapping[str, Any] | None = None
) -> TowerProfile:
    """The analytic profile of one tower from its model-config entry.

    ``towers`` (the whole ``towers`` mapping) lets a ``text_decoder`` find the width and token count
    of the tower it cross-attends to (``cross_from``, default ``image``).
    """
    arch = cfg.get("arch")
    if arch not in ARCHS:
        raise ValueError(f"tower {name!r}: unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    h = int(_req(cfg, "width", name))
    L = int(_req(cfg, "layers", name))
    heads = int(_req(cfg, "heads", name))
    m = int(h * float(cfg.get("mlp_ratio", 4.0)))
    E = int(embed_dim)
    frozen = bool(cfg.get("frozen", False))
    if h % heads:
        raise ValueError(f"tower {name!r}: width {h} is not divisible by its {heads} heads")

    if arch == "vit":
        img, p = int(_req(cfg, "img_size", name)), int(_req(cfg, "patch_size", name))
        chans = int(cfg.get("in_chans", 3))
        n = (img // p) ** 2
        # timm's class token and register tokens (NeMo's ViT pads to ``class_token_length`` 8: 1 + 7)
        s = n + (1 if cfg.get("class_token", True) else 0) + int(cfg.get("reg_tokens", 0))
        pre = Block(
            params=chans * p * p * h + h + h + s * h,  # patch conv (+bias), class token, position embedding
            gemms=(Gemm(n, chans * p * p, h, "rep", input_grad=False),),
            elem_rep=2.0 * chans * img * img + 3.0 * s * h,
            elem_rep_bwd=3.0 * s * h,  # the image needs no gradient: position and class-token gradients only
            act_rep=float(chans * img * img),
            kernels=4,
            boundary=float(s * h),
        )
        pool = cfg.get("attn_pool")
        if pool and "mlp_ratio" in pool:  # SigLIP's MAP head (timm AttentionPoolLatent)
            post = map_pool(s, h, int(pool.get("heads", heads)), int(h * float(pool["mlp_ratio"])))
        elif pool:
            post = attention_pool(s, h, E, int(pool.get("queries", 256)), int(pool.get("heads", 8)))
        else:
            post = Block(params=2 * h + h * E + E, gemms=(Gemm(1, h, E, "rep"),), elem_rep=2.0 * s * h, kernels=3)
        layer = transformer_block(s, h, heads, m)
    elif arch in ("clip_text", "bert"):
        V, ctx = int(_req(cfg, "vocab_size", name)), int(_req(cfg, "context_length", name))
        s = ctx
        if arch == "clip_text":
            pre_params = V * h + ctx * h
            post_params = 2 * h + h * E + (E if cfg.get("proj_bias", False) else 0)
            post_gemms: tuple[Gemm, ...] = (Gemm(1, h, E, "rep"),)
        else:
            types = int(cfg.get("type_vocab_size", 2))
            pre_params = V * h + int(cfg.get("max_position_embeddings", ctx)) * h + types * h + 2 * h
            pooler = bool(cfg.get("pooler", True))
            post_params = (h * h + h if pooler else 0) + h * E + (E if cfg.get("proj_bias", True) else 0)
            post_gemms = ((Gemm(1, h, h, "rep"),) if pooler else ()) + (Gemm(1, h, E, "rep"),)
        pre = Block(params=pre_params, elem_rep=4.0 * s * h, act_rep=float(s), kernels=3, boundary=float(s * h))
        post = Block(params=post_params, gemms=post_gemms, elem_rep=2.0 * s * h, kernels=3)
        layer = transformer_block(s, h, heads, m)
    else:  # text_decoder
        V, ctx = int(_req(cfg, "vocab_size", name)), int(_req(cfg, "context_length", name))
        s = ctx
        src = str(cfg.get("cross_from", "image"))
        if "cross_tokens" in cfg and "cross_width" in cfg:
            n_ctx, h_ctx = int(cfg["cross_tokens"]), int(cfg["cross_width"])
        elif towers is not None and src in towers:
            sp = tower_profile(src, towers[src], embed_dim)
            n_ctx, h_ctx = sp.seq, sp.width
        else:
            raise ValueError(f"tower {name!r}: text_decoder needs cross_tokens and cross_width, or a tower {src!r}")
        pre = Block(params=0, elem_rep=2.0 * s * h, kernels=1, boundary=float(s * h))
        post = Block(
            params=2 * h + h * V,
            gemms=(Gemm(s, h, V, "col"),),
            elem_rep=2.0 * s * h + 3.0 * s * V,
            act_split=2.0 * s * V,
            kernels=4,
        )
        layer = merge_blocks(transformer_block(s, h, heads, m), cross_block(s, h, heads, m, n_ctx, h_ctx))
        prof = TowerProfile(
            name,
            arch,
            frozen,
            L,
            heads,
            h,
            s,
            E,
            pre,
            layer,
            post,
            cross_from=src,
            cross_elems=float(n_ctx * h_ctx + s * h),
        )
        return prof
    return TowerProfile(name, arch, frozen, L, heads, h, s, E, pre, layer, post)


def model_profiles(model_cfg: Mapping[str, Any]) -> dict[str, TowerProfile]:
    """Analytic profiles of every tower of a model config (``embed_dim`` + ``towers``)."""
    cfg = to_plain(model_cfg)
    if cfg.get("kind") in ("vlm", "llava"):
        raise ValueError(
            f"model config {cfg.get('name', '?')!r} is a vision encoder feeding a language model (kind:"
            f" {cfg['kind']}): its modules are profiled by lightning_distmm.planner.vlm.profile, not as contrastive towers"
        )
    if "towers" not in cfg or not cfg["towers"]:
        raise ValueError(f"model config {cfg.get('name', '?')!r} has no towers")
    E = int(cfg.get("embed_dim", 512))
    return {name: tower_profile(name, t, E, cfg["towers"]) for name, t in cfg["towers"].items()}


def measured_profile(
    name: str, fit: MeasuredFit, frozen: bool, embed_dim: int, analytic: TowerProfile | None = None
) -> TowerProfile:
    """A profile carrying a measured fit; with an ``analytic`` twin it can also be split tp/pp ways."""
    if analytic is not None:
        return dataclasses.replace(analytic, measured=fit, frozen=frozen)
    empty = Block()
    return TowerProfile(
        name, "measured", frozen, 1, 1, 0, 1, int(embed_dim), empty, empty, empty, measured=fit, analytic=False
    )


__all__ = [
    "ARCHS",
    "BWD_ELEM_RATIO",
    "Gemm",
    "Attn",
    "Block",
    "MeasuredFit",
    "TowerProfile",
    "tower_profile",
    "model_profiles",
    "measured_profile",
]
