"""Tiny real towers and a quiet Trainer's settings, for the tests and the benchmarks.

The test helpers (``tests/distmm_testing.py``) and the benchmark scripts train the same kinds of
small two-tower CLIPs: a transformers CLIP text encoder pooled at its last attended token and a
timm ViT, at a few thousand to a few hundred thousand parameters. They are built here once, at
the sizes each caller names, so that a fix to one (the frozen key bias, the pipeline cut) reaches all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from timm.models.vision_transformer import VisionTransformer


class TinyText(nn.Module):
    """``transformers.CLIPTextModel`` (as ``encoder``) + a linear projection to ``embed``, pooled at
    the last attended token; token ids: ``[EOS]`` is ``vocab - 1``, ``[BOS]`` ``vocab - 2``, pad 0.

    ``freeze_key_bias``: softmax ignores a shift shared by all keys, so the key bias has an
    exactly-zero true gradient; Adam turns the float noise there into +-lr steps that differ between
    any two correct implementations. Exactness checks freeze it (:func:`tiny_vit` has no qkv bias
    for the same reason).
    """

    def __init__(
        self,
        vocab: int,
        seq: int,
        width: int,
        embed: int,
        layers: int = 1,
        heads: int = 2,
        intermediate: int | None = None,
        freeze_key_bias: bool = True,
    ) -> None:
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModel

        cfg = CLIPTextConfig(
            vocab_size=vocab,
            hidden_size=width,
            intermediate_size=intermediate or 2 * width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=seq,
            eos_token_id=vocab - 1,
            bos_token_id=vocab - 2,
            pad_token_id=0,
        )
        self.encoder = CLIPTextModel(cfg)
        if freeze_key_bias:
            for layer in self.encoder.encoder.layers:
                layer.self_attn.k_proj.bias.requires_grad_(False)
        self.proj = nn.Linear(width, embed, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self._pool(hidden, attention_mask)

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        last = attention_mask.sum(dim=1) - 1
        return self.proj(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])

    def pipeline_stages(self, pp: int) -> list:
        """The cut distmm's pipeline parallelism uses (``pp`` stages of the encoder layers)."""
        from lightning_distmm.parallel.families.clip_text import clip_text_stages

        return clip_text_stages(self.encoder, pp, lambda h, rows: self._pool(h, rows["attention_mask"]), [self.proj])


def tiny_vit(
    img_size: int,
    patch_size: int,
    width: int,
    depth: int,
    heads: int,
    embed: int,
    mlp_ratio: float = 2.0,
    qkv_bias: bool = False,
    **timm: Any,
) -> VisionTransformer:
    """A timm ``VisionTransformer`` whose head projects to ``embed`` (no qkv bias by default: see
    :class:`TinyText`); ``timm``: further ``VisionTransformer`` arguments."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=img_size,
        patch_size=patch_size,
        embed_dim=width,
        depth=depth,
        num_heads=heads,
        mlp_ratio=mlp_ratio,
        num_classes=embed,
        qkv_bias=qkv_bias,
        **timm,
    )


def quiet_trainer_kwargs(**extra: Any) -> dict[str, Any]:
    """A ``Trainer``'s arguments for a run that only trains: no logger, checkpoints, progress bar,
    model summary or validation; ``extra`` adds or overrides."""
    kw: dict[str, Any] = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kw.update(extra)
    return kw


__all__ = ["TinyText", "quiet_trainer_kwargs", "tiny_vit"]
