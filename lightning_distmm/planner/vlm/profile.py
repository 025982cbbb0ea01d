"""What one sample costs a vision-language model's modules (the VLM planner's; docs/vlm.md).

Three analytic profiles from a preset (:mod:`lightning_distmm.planner.vlm.sizes`), in the units the
cost model prices (:mod:`lightning_distmm.planner.cost.compute`):

* ``vision``: the ViT, per **image** (a tile): its patch tokens through every block;
* ``projector``: the MLP from the ViT's width to the LLM's, per image, with the vision tower (the
  runtime's vision tower holds both; it trains when the ViT is frozen, LLaVA's stages 1 and 2);
* ``llm``: a Llama-style decoder (grouped-query attention, SwiGLU, RMSNorm), per **sample**, its
  sequence the text tokens plus ``tokens_per_image`` for each of the sample's images.

Why images are a distribution: a sample carries 0, 1 or several images (tiles), so a replica's
rows carry a random number of images; the encoder's step is its slowest replica's.
:func:`straggler` gives the expected largest replica load over the mean, from the distribution
alone (the sum of ``rows`` draws, the maximum of ``dp`` replicas), for both the encoder (images) and
the LLM (tokens, the text part fixed). The workload (:class:`VLMWorkload`) is a dataclass with a
YAML round trip.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from lightning_distmm.planner.profiles.profile import Attn, Block, Gemm, TowerProfile, tower_profile
from lightning_distmm.planner.vlm.sizes import PRESETS, VLMPreset

#: the preset name of a workload whose modules are the live job's (profiles counted or measured, no preset)
LIVE = "live"


@dataclass(frozen=True)
class VLMWorkload:
    """A training job's data and what trains: images per sample as ``{count: probability}``, text
    tokens per sample (mean), which modules are frozen, and how each step's rows are assigned:
    ``balance: rows`` by count (the plan's even split), ``cost`` by their images and tokens
    (``Tower(cost=...)``, docs/runtime.md "Balancing each step"), which changes the straggler priced."""

    preset: str
    images: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    text_tokens: int = 512
    frozen_vision: bool = False
    frozen_llm: bool = False
    balance: str = "rows"

    def __post_init__(self) -> None:
        if self.preset != LIVE and self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r}: choose one of {', '.join(PRESETS)}")
        total = sum(self.images.values())
        if not self.images or any(k < 0 or p < 0 for k, p in self.images.items()) or abs(total - 1.0) > 1e-6:
            raise ValueError(f"images {self.images}: probabilities of counts >= 0 that sum to 1 (sum {total})")
        if self.text_tokens < 1:
            raise ValueError(f"text_tokens must be positive, got {self.text_tokens}")
        if self.balance not in ("rows", "cost"):
            raise ValueError(f"balance {self.balance!r}: choose 'rows' (even split) or 'cost' (each step by cost)")

    @property
    def mean_images(self) -> float:
        return float(sum(k * p for k, p in self.images.items()))

    def tokens(self) -> float:
        """Mean LLM sequence per sample: text plus image tokens."""
        return self.text_tokens + self.mean_images * PRESETS[self.preset].tokens_per_image

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["images"] = {int(k): float(v) for k, v in self.images.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VLMWorkload:
        d = dict(d)
        d["images"] = {int(k): float(v) for k, v in dict(d.get("images", {1: 1.0})).items()}
        return cls(**d)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> VLMWorkload:
        import yaml

        return cls.from_dict(yaml.safe_load(text))


#: the jobs the planner table prices (docs/vlm.md): LLaVA-1.5's instruction tuning (ViT frozen, about
#: 1 in 10 samples text-only); InternVL-1.5-like fine-tuning (dynamic resolution: 1-12 tiles of 448 px
#: plus a thumbnail, every module trains)
WORKLOADS: dict[str, VLMWorkload] = {
    "llava15_7b": VLMWorkload("llava15_7b", images={0: 0.1, 1: 0.9}, text_tokens=512, frozen_vision=True),
    "internvl_26b": VLMWorkload("internvl_26b", images={1: 0.2, 3: 0.3, 5: 0.3, 7: 0.2}, text_tokens=768),
}


def llama_layer(s: int, h: int, heads: int, kv_heads: int, m: int) -> Block:
    """A Llama / Qwen2-style decoder layer of ``s`` tokens: RMSNorm, grouped-query attention (``kv_heads``
    key/value heads), RoPE, SwiGLU of width ``m``; no biases. Causal flash attention skips the masked
    half of the scores, priced as ``s`` queries against ``s / 2`` keys."""
    d = h // heads
    qkv = h + 2 * kv_heads * d
    return Block(
        params=h * qkv + h * h + 3 * h * m + 2 * h,
        gemms=(Gemm(s, h, qkv, "col"), Gemm(s, h, h, "row"), Gemm(s, h, 2 * m, "col"), Gemm(s, m, h, "row")),
        attn=(Attn(s, max(s // 2, 1), h, heads),),
        elem_rep=10.0 * s * h,  # 2 RMSNorms (read + write), 2 residual adds (2 reads + write)
        elem_split=3.0 * s * m + 2.0 * s * (h + kv_heads * d),  # SwiGLU (2 reads + write), RoPE on q and k
        elem_rep_bwd=12.0 * s * h,
        elem_split_bwd=5.0 * s * m + 3.0 * s * (h + kv_heads * d),
        act_rep=4.0 * s * h,  # the norms' inputs, attention's and the MLP's inputs
        act_split=float(s * (qkv + h) + 3 * s * m),  # q, k, v, attention output; gate, up, SiLU output
        act_scores=float(heads * s * s),
        tp_allreduce=2.0 * s * h,
        casts=2.0 * s * h,
        kernels=12,
        boundary=float(s * h),
    )


def llm_profile(preset: VLMPreset, seq: int, frozen: bool = False) -> TowerProfile:
    """The causal LM of ``preset`` at ``seq`` tokens per sample (text + image tokens)."""
    c = preset.llm
    h, L, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    kv, m, V = int(c.get("num_key_value_heads", heads)), int(c["intermediate_size"]), int(c["vocab_size"])
    s = int(seq)
    pre = Block(params=V * h, elem_rep=2.0 * s * h, act_rep=float(s), kernels=2, boundary=float(s * h))
    post = Block(  # final RMSNorm, the LM head, the cross entropy over the vocabulary
        params=h + (0 if c.get("tie_word_embeddings", False) else h * V),
        gemms=(Gemm(s, h, V, "col"),),
        elem_rep=2.0 * s * h + 3.0 * s * V,
        act_split=2.0 * s * V,
        kernels=4,
    )
    return TowerProfile(
        "llm", "llama", frozen, L, math.gcd(heads, kv), h, s, h, pre, llama_layer(s, h, heads, kv, m), post
    )


def vision_profile(preset: VLMPreset, frozen: bool = False) -> TowerProfile:
    """The ViT of ``preset`` per image (CLIP-style: class token, pre-LN blocks, MLP ratio from the
    config), without a head: its patch tokens go to the projector."""
    c = preset.vision
    h = int(c["hidden_size"])
    cfg = {
        "arch": "vit",
        "width": h,
        "layers": int(c["num_hidden_layers"]),
        "heads": int(c["num_attention_heads"]),
        "mlp_ratio": int(c["intermediate_size"]) / h,
        "img_size": int(c["image_size"]),
        "patch_size": int(c["patch_size"]),
        "frozen": frozen,
    }
    prof = tower_profile("vision", cfg, h)
    prof.post = Block(params=2 * h, elem_rep=2.0 * prof.seq * h, kernels=1)  # the final LayerNorm
    return prof


def projector_profile(preset: VLMPreset, frozen: bool = False) -> TowerProfile:
    """The MLP projector per image: ``tokens_per_image`` rows through its linear layers (GELU between);
    an input wider than the ViT (InternVL's pixel shuffle: 4 patches into one token) is normalised
    first. Replicated under tensor parallelism (as the runtime keeps it)."""
    t, widths = preset.tokens_per_image, preset.projector
    gemms = tuple(Gemm(t, a, b, "rep", input_grad=True) for a, b in zip(widths, widths[1:]))
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    norm = widths[0] != int(preset.vision["hidden_size"])
    params += 2 * widths[0] if norm else 0
    inner = sum(t * b for b in widths[1:-1])
    block = Block(
        params=params,
        gemms=gemms,
        elem_rep=2.0 * inner + (2.0 * t * widths[0] if norm else 0.0),
        act_rep=float(t * sum(widths[:-1]) + inner),
        kernels=2 * len(gemms),
    )
    empty = Block()
    return TowerProfile("projector", "mlp", frozen, 1, 1, widths[-1], t, widths[-1], empty, empty, block)


@dataclass
class VLMProfiles:
    """The three profiles of a workload and what the handoff carries."""

    workload: VLMWorkload
    vision: TowerProfile
    projector: TowerProfile
    llm: TowerProfile
    #: a live job's image tokens and width (None: the preset's)
    image_tokens: int | None = None
    hidden: int | None = None

    @property
    def tokens_per_image(self) -> int:
        if self.image_tokens is not None:
            return self.image_tokens
        return PRESETS[self.workload.preset].tokens_per_image

    @property
    def tokens_per_row(self) -> float:
        """Image tokens one sample hands to the LLM, on average."""
        return self.workload.mean_images * self.tokens_per_image

    @property
    def width(self) -> int:
        return self.hidden if self.hidden is not None else int(PRESETS[self.workload.preset].llm["hidden_size"])


def vlm_profiles(workload: VLMWorkload) -> VLMProfiles:
    """Profiles of ``workload``'s preset: the LLM at the workload's mean sequence (text + image tokens)."""
    preset = PRESETS[workload.preset]
    return VLMProfiles(
        workload,
        vision_profile(preset, workload.frozen_vision),
        projector_profile(preset, False),
        llm_profile(preset, round(workload.tokens()), workload.frozen_llm),
    )


@lru_cache(maxsize=4096)
def _expected_max(images: tuple[tuple[int, float], ...], rows: int, dp: int) -> float:
    pmf = np.zeros(max(k for k, _ in images) + 1)
    for k, p in images:
        pmf[k] += p
    total = np.array([1.0])
    base, n = pmf, rows
    while n:  # the distribution of the sum of ``rows`` draws, by repeated squaring
        if n & 1:
            total = np.convolve(total, base)
        base, n = np.convolve(base, base), n >> 1
    cdf = np.clip(np.cumsum(total), 0.0, 1.0)
    return float(np.sum(1.0 - cdf[:-1] ** dp))  # E[max] of dp draws of a count >= 0


#: batches drawn to price the balanced assignment's straggler
BALANCE_DRAWS = 32


@lru_cache(maxsize=4096)
def _balanced_max(images: tuple[tuple[int, float], ...], rows: int, dp: int, tokens_per_image: int, text: int) -> float:
    """The mean largest replica load over :data:`BALANCE_DRAWS` drawn batches of ``rows * dp`` rows,
    each assigned largest-first to the least-loaded replica (the runtime's greedy, LPT), in images
    (``tokens_per_image = 0``) or tokens. A fixed seed: the same number on every call."""
    rng = random.Random(0)
    counts, probs = zip(*images)
    total = 0.0
    for _ in range(BALANCE_DRAWS):
        draw = rng.choices(counts, probs, k=rows * dp)
        costs = sorted((text + k * tokens_per_image if tokens_per_image else float(k) for k in draw), reverse=True)
        heap = [(0.0, i) for i in range(dp)]
        for c in costs:
            load, i = heapq.heappop(heap)
            heapq.heappush(heap, (load + c, i))
        total += max(load for load, _ in heap)
    return total / BALANCE_DRAWS


def straggler(
    workload: VLMWorkload, rows: int, dp: int, tokens_per_image: int = 0, text: int = 0, balanced: bool | None = None
) -> float:
    """The expected largest load of ``dp`` replicas of ``rows`` samples each over their mean load: the
    load is a replica's images (``tokens_per_image = 0``), or its tokens ``rows * text + images *
    tokens_per_image``. 1 when every sample carries the same number of images. ``balanced``
    (default: ``workload.balance == "cost"``): each step's rows assigned by cost, each module on its
    own (:func:`_balanced_max`; the runtime shares one order between the modules, so the module that
    does not lead can do a little worse), instead of an even split in sample order."""
    rows, dp = max(int(rows), 1), max(int(dp), 1)
    mean = workload.mean_images
    if mean == 0 or len([p for p in workload.images.values() if p > 0]) == 1 or dp == 1:
        return 1.0
    key = tuple(sorted((int(k), float(p)) for k, p in workload.images.items()))
    if balanced is None:
        balanced = workload.balance == "cost"
    if balanced and rows > 1:  # (one row per replica: nothing to move, the even split's price)
        top = _balanced_max(key, rows, dp, int(tokens_per_image), int(text))
        return top / (rows * (text + mean * tokens_per_image) if tokens_per_image else rows * mean)
    top = _expected_max(key, rows, dp)
    if tokens_per_image == 0:
        return top / (rows * mean)
    return (rows * text + top * tokens_per_image) / (rows * (text + mean * tokens_per_image))


__all__ = [
    "LIVE",
    "VLMWorkload",
    "WORKLOADS",
    "VLMProfiles",
    "llama_layer",
    "llm_profile",
    "vision_profile",
    "projector_profile",
    "vlm_profiles",
    "straggler",
]
