"""CoCa (Yu et al., 2022, "Contrastive Captioners"): the pieces the recipe's model adds for it.

CoCa trains an image tower and a unimodal text tower with the contrastive loss of CLIP, and a
multimodal text decoder that reads the text tower's token states, cross-attends to the image
tower's tokens and predicts each next caption token (the captioning loss). On the distmm runtime
the two towers are ordinary towers; the decoder is **not** a tower: it runs inside the
interaction, on the batch-sync ranks, each of them decoding only its loss rows
(:func:`lightning_distmm.interaction.local_rows`). docs/coca.md says why and what it costs.

A tower hands the runtime one tensor with a row per sample, so a CoCa tower packs what the
interaction needs into its row:

- image (``arch: vit`` with ``attn_pool``): ``[B, Q, E]``, open_clip's attentional pooler over the
  ViT's tokens (``Q`` learned queries of width ``E = embed_dim``, then ``ln_post``); row ``0`` after
  the ``E x E`` projection is the contrastive embedding, rows ``1..Q-1`` are the image tokens the
  decoder cross-attends to (as open_clip's ``CoCa``);
- text (``arch: clip_text``, built with ``output_tokens``): ``[B, E + L * (W + D)]``, the
  contrastive embedding, the ``L`` token states of width ``W`` and the ``L`` token ids written as
  ``D`` base-256 digits (:func:`pack_text`): every float type holds the integers 0..256 exactly, so
  the labels cross the exchange unchanged at any precision, and the ranks of the image tower (which
  read no text field) can compute their caption rows.

:func:`coca_loss` unpacks them, adds the weighted contrastive and captioning losses, and decodes
only this rank's rows.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_distmm.interaction import local_rows
from lightning_distmm.losses import caption_loss, clip_loss

#: token ids travel as digits of this base (bf16's 8 significand bits hold 0..256 exactly)
DIGIT_BASE = 256
#: open_clip's CoCa defaults (``coca_caption_loss_weight``, ``coca_contrastive_loss_weight``)
CAPTION_LOSS_WEIGHT = 2.0
CONTRASTIVE_LOSS_WEIGHT = 1.0


# ---------------------------------------------------------------------- packing a tower's row
def id_digits(vocab_size: int) -> int:
    """How many base-256 digits a token id of a ``vocab_size`` vocabulary takes."""
    return max(1, math.ceil(math.log(max(2, int(vocab_size)), DIGIT_BASE)))


def pack_text(embedding: Tensor, tokens: Tensor, ids: Tensor, digits: int) -> Tensor:
    """``[B, E + L * (W + D)]``: the embedding, the token states, the ids as ``D`` digits (in the embedding's dtype)."""
    b, dtype = embedding.shape[0], embedding.dtype
    scale = DIGIT_BASE ** torch.arange(digits, device=ids.device)
    coded = (ids.long().unsqueeze(-1) // scale) % DIGIT_BASE
    return torch.cat([embedding, tokens.to(dtype).reshape(b, -1), coded.to(dtype).reshape(b, -1)], dim=1)


@dataclass(frozen=True)
class TextRows:
    """A text tower's packed rows, unpacked: ``embedding [B, E]``, ``tokens [B, L, W]``, ``ids [B, L]``."""

    embedding: Tensor
    tokens: Tensor
    ids: Tensor


def unpack_text(features: Tensor, embed_dim: int, width: int, digits: int) -> TextRows:
    """The inverse of :func:`pack_text` (the sequence length ``L`` follows from the row's width)."""
    b, total = features.shape[0], features.shape[-1]
    per_token = width + digits
    if features.dim() != 2 or (total - embed_dim) % per_token or total <= embed_dim:
        raise ValueError(
            f"CoCa text features of shape {list(features.shape)} are not [B, {embed_dim} + L * ({width} + {digits})]:"
            " the text tower must be built with output_tokens (model.loss: coca does this)"
        )
    length = (total - embed_dim) // per_token
    tokens = features[:, embed_dim : embed_dim + length * width].reshape(b, length, width)
    coded = features[:, embed_dim + length * width :].detach().reshape(b, length, digits)
    scale = DIGIT_BASE ** torch.arange(digits, device=features.device)
    ids = (coded.float().round().long() * scale).sum(-1)
    return TextRows(features[:, :embed_dim], tokens, ids)


# ---------------------------------------------------------------------- the image tower's head
class AttentionalPooler(nn.Module):
    """open_clip's ``AttentionalPooler``: ``queries`` learned queries of width ``width`` attend to the tokens."""

    def __init__(self, width: int, context_width: int, heads: int = 8, queries: int = 256):
        super().__init__()
        self.query = nn.Parameter(torch.randn(queries, width))
        self.attn = nn.MultiheadAttention(width, heads, kdim=context_width, vdim=context_width, batch_first=True)
        self.ln_q = nn.LayerNorm(width)
        self.ln_k = nn.LayerNorm(context_width)

    def forward(self, x: Tensor) -> Tensor:
        x = self.ln_k(x)
        q = self.ln_q(self.query).unsqueeze(0).expand(x.shape[0], -1, -1)
        return self.attn(q, x, x, need_weights=False)[0]


class CoCaImageHead(nn.Module):
    """A ViT's head for CoCa (open_clip's ``attentional_pool``): the pooler over every token, ``ln_post``,
    then the projection of query 0. Returns ``[B, Q, E]``: row 0 the embedding, rows 1.. the image tokens."""

    def __init__(self, width: int, embed_dim: int, queries: int = 256, heads: int = 8, norm_eps: float = 1e-5):
        super().__init__()
        if queries < 2:
            raise ValueError(f"attn_pool needs at least 2 queries (one embedding, one token), got {queries}")
        self.attn_pool = AttentionalPooler(embed_dim, width, heads, queries)
        self.ln_post = nn.LayerNorm(embed_dim, eps=norm_eps)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=embed_dim**-0.5)

    def forward(self, x: Tensor) -> Tensor:
        pooled = self.ln_post(self.attn_pool(x))
        embedding = self.proj(pooled[:, :1])
        return torch.cat([embedding, pooled[:, 1:].to(embedding.dtype)], dim=1)


# ---------------------------------------------------------------------- the multimodal decoder
class ResidualAttentionBlock(nn.Module):
    """open_clip's pre-norm block: attention (to itself, or to a ``context`` of width ``context_width``), then an MLP."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0, context_width: int | None = None):
        super().__init__()
        self.cross = context_width is not None
        kv = context_width if context_width is not None else width
        self.ln_1 = nn.LayerNorm(width)
        self.ln_1_kv = nn.LayerNorm(kv) if self.cross else None
        self.attn = nn.MultiheadAttention(width, heads, kdim=kv, vdim=kv, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential(
            OrderedDict(c_fc=nn.Linear(width, hidden), gelu=nn.GELU(), c_proj=nn.Linear(hidden, width))
        )

    def forward(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        q = self.ln_1(x)
        kv = self.ln_1_kv(context) if self.ln_1_kv is not None and context is not None else q
        x = x + self.attn(q, kv, kv, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class MultimodalDecoder(nn.Module):
    """open_clip's ``MultimodalTransformer``: per layer a causal self-attention block over the text
    token states and a cross-attention block to the image tokens, then ``ln_final`` and the
    projection to the vocabulary. ``forward(image_tokens [r, N, C], text_tokens [r, T, W]) -> [r, T, V]``."""

    def __init__(
        self, width: int, layers: int, heads: int, vocab_size: int, context_width: int, mlp_ratio: float = 4.0
    ):
        super().__init__()
        self.width, self.vocab_size = width, vocab_size
        self.resblocks = nn.ModuleList(ResidualAttentionBlock(width, heads, mlp_ratio) for _ in range(layers))
        self.cross_attn = nn.ModuleList(
            ResidualAttentionBlock(width, heads, mlp_ratio, context_width=context_width) for _ in range(layers)
        )
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, vocab_size) * width**-0.5)

    def forward(self, image_tokens: Tensor, text_tokens: Tensor) -> Tensor:
        t = text_tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=text_tokens.device).triu(1)  # True: may not attend
        x = text_tokens
        for block, cross in zip(self.resblocks, self.cross_attn):
            x = block(x, mask=causal)
            x = cross(x, context=image_tokens)
        return self.ln_final(x) @ self.text_projection


# ---------------------------------------------------------------------- config and loss
@dataclass(frozen=True)
class CoCaSpec:
    """What :func:`coca_loss` needs to read the towers' rows and weigh the two losses."""

    embed_dim: int
    text_width: int
    digits: int
    pad_id: int
    caption_weight: float
    contrastive_weight: float


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise KeyError(f"{where} needs {key!r}; it has {sorted(cfg)}")
    return cfg[key]


#: what a model config with CoCa's decoder among its towers is told (the planner's presets write it there)
NOT_A_TOWER = (
    "arch 'text_decoder' (CoCa's multimodal decoder) is not a tower at runtime: it runs in the interaction on"
    " the batch-sync ranks. Set loss: coca and give it as the model config's top-level 'decoder' (width,"
    " layers, heads, mlp_ratio, vocab_size; conf/model/coca_tiny.yaml, docs/coca.md)"
)


def check_towers(towers: Mapping[str, Any]) -> None:
    """Refuse a ``text_decoder`` among the towers, before any tower is built."""
    names = [n for n, t in towers.items() if isinstance(t, Mapping) and t.get("arch") == "text_decoder"]
    if names:
        raise ValueError(f"towers {names}: {NOT_A_TOWER}")


def coca_spec(model_cfg: Mapping[str, Any]) -> CoCaSpec:
    """Check a ``loss: coca`` model config (image ``vit`` + ``attn_pool``, text ``clip_text``, a ``decoder``)."""
    towers = _require(model_cfg, "towers", "the model config")
    check_towers(towers)
    image, text = towers.get("image"), towers.get("text")
    if set(towers) != {"image", "text"} or image.get("arch") != "vit" or text.get("arch") != "clip_text":
        raise ValueError(
            "loss: coca needs exactly two towers, image (arch vit) and text (arch clip_text); the config has "
            + ", ".join(f"{n} ({t.get('arch')})" for n, t in towers.items())
        )
    if not image.get("attn_pool"):
        raise ValueError("loss: coca needs the image tower's attn_pool ({queries, heads}): its tokens feed the decoder")
    decoder = _require(model_cfg, "decoder", "a loss: coca model config")
    embed_dim, text_width = int(model_cfg["embed_dim"]), int(_require(text, "width", "the text tower"))
    if int(_require(decoder, "width", "the decoder")) != text_width:
        raise ValueError(
            f"the decoder's width {decoder['width']} must be the text tower's {text_width}: it reads the text tower's"
            " token states (as open_clip's CoCa)"
        )
    text_vocab = int(_require(text, "vocab_size", "the text tower"))
    vocab = int(decoder.get("vocab_size") or text_vocab)
    if vocab < text_vocab:
        raise ValueError(f"the decoder's vocab_size {vocab} < the text tower's {text_vocab}: it predicts those tokens")
    return CoCaSpec(
        embed_dim=embed_dim,
        text_width=text_width,
        digits=id_digits(text_vocab),
        pad_id=int(text.get("pad_token_id", 0) or 0),
        caption_weight=float(model_cfg.get("caption_loss_weight", CAPTION_LOSS_WEIGHT)),
        contrastive_weight=float(model_cfg.get("contrastive_loss_weight", CONTRASTIVE_LOSS_WEIGHT)),
    )


def build_decoder(model_cfg: Mapping[str, Any]) -> MultimodalDecoder:
    """The multimodal decoder from the model config's ``decoder`` (cross-attending to ``embed_dim``-wide image tokens)."""
    cfg, text = model_cfg["decoder"], model_cfg["towers"]["text"]
    return MultimodalDecoder(
        width=int(cfg["width"]),
        layers=int(_require(cfg, "layers", "the decoder")),
        heads=int(_require(cfg, "heads", "the decoder")),
        vocab_size=int(cfg.get("vocab_size") or text["vocab_size"]),
        context_width=int(model_cfg["embed_dim"]),
        mlp_ratio=float(cfg.get("mlp_ratio", 4.0)),
    )


def embedding(spec: CoCaSpec, tower: str, features: Tensor) -> Tensor:
    """The contrastive embedding inside a CoCa tower's packed row (what retrieval compares)."""
    return features[:, 0] if tower == "image" else features[:, : spec.embed_dim]


def coca_loss(
    spec: CoCaSpec, decoder: MultimodalDecoder, features: Mapping[str, Tensor], logit_scale: Tensor
) -> Tensor:
    """``contrastive_weight * clip_loss + caption_weight * caption_loss`` over the whole batch's packed rows.

    The decoder runs on this process's rows only (all of them in one process): each caption row is
    a sum over its own tokens, so the rows split over the batch-sync ranks exactly.
    """
    contrastive, caption = coca_terms(spec, decoder, features, logit_scale)
    return spec.contrastive_weight * contrastive + spec.caption_weight * caption


def coca_terms(
    spec: CoCaSpec, decoder: MultimodalDecoder, features: Mapping[str, Tensor], logit_scale: Tensor
) -> tuple[Tensor, Tensor]:
    """``(clip_loss, caption_loss)`` before weighting: this process's rows' share of each (all rows in
    one process), so the sums over the batch-sync ranks are the whole batch's terms."""
    image, text = features["image"], unpack_text(features["text"], spec.embed_dim, spec.text_width, spec.digits)
    contrastive = clip_loss(image[:, 0], text.embedding, logit_scale)
    rows = local_rows(image.shape[0])
    labels = text.ids[:, 1:]  # teacher forcing: the state of token t predicts token t + 1
    logits = decoder(image[rows, 1:], text.tokens[rows, :-1])
    return contrastive, caption_loss(logits, labels, pad_id=spec.pad_id)


__all__ = [
    "AttentionalPooler",
    "CoCaImageHead",
    "CoCaSpec",
    "MultimodalDecoder",
    "ResidualAttentionBlock",
    "build_decoder",
    "check_towers",
    "coca_loss",
    "coca_spec",
    "coca_terms",
    "embedding",
    "id_digits",
    "pack_text",
    "unpack_text",
]
