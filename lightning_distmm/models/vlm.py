"""A vision encoder feeding a language model (LLaVA-style): timm ViT + MLP projector + a transformers
causal LM, as two towers where the LLM consumes the vision tower's image tokens (docs/mllm.md).

Samples carry 0 to ``max_images`` images: ``pixel_values`` is ``[B, K, C, H, W]`` with ``K =
max_images`` (absent images' slots are ignored) and ``n_images`` ``[B]`` says how many are real. The
vision tower returns one row per sample, ``[B, K, T, D]`` (``T`` tokens per image, absent slots
zero). The language model reads the present images' tokens as a prefix of the text (absent slots
masked, positions counted over present tokens only) and returns the text positions' logits; the
loss is next-token cross-entropy over the target tokens (``labels`` not ``-100``), a token mean
over the whole batch (:meth:`VLM.token_loss`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.tower import Tower

IGNORE = -100


class VisionProjector(nn.Module):
    """A ViT's tokens of each present image through an MLP projector into the LLM's width (LLaVA's
    connector). ``freeze_vit``: the ViT keeps its weights and only the projector trains (LLaVA's
    first stage)."""

    def __init__(self, vit: nn.Module, vit_width: int, llm_width: int, freeze_vit: bool = False) -> None:
        super().__init__()
        self.vit = vit
        self.projector = nn.Sequential(nn.Linear(vit_width, llm_width), nn.GELU(), nn.Linear(llm_width, llm_width))
        self.freeze_vit = freeze_vit
        if freeze_vit:
            self.vit.requires_grad_(False)

    def forward(self, pixel_values: Tensor, n_images: Tensor) -> Tensor:
        b, k = pixel_values.shape[:2]
        present = torch.arange(k, device=pixel_values.device)[None, :] < n_images[:, None]  # [B, K]
        images = pixel_values[present]  # [M, C, H, W], M present images (possibly none)
        if self.freeze_vit:
            with torch.no_grad():
                tokens = self.vit.forward_features(images)
        else:
            tokens = self.vit.forward_features(images)
        tokens = self.projector(tokens)  # [M, T, D]
        out = tokens.new_zeros(b, k, *tokens.shape[1:])
        # the rows keep a graph even with no present image (the projector's parameters get a zero gradient)
        return out.index_put((present,), tokens) + 0.0 * tokens.sum()


class LanguageModel(nn.Module):
    """A causal LM that reads image tokens as a prefix: returns ``[B, S, V]`` logits of the text positions."""

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, n_images: Tensor, image_embeds: Tensor
    ) -> Tensor:
        b, k, t, d = image_embeds.shape
        text = self.lm.get_input_embeddings()(input_ids)
        present = torch.arange(k, device=input_ids.device)[None, :] < n_images[:, None]
        image_mask = present.repeat_interleave(t, dim=1).to(attention_mask.dtype)  # [B, K*T]
        embeds = torch.cat([image_embeds.reshape(b, k * t, d).to(text.dtype), text], dim=1)
        mask = torch.cat([image_mask, attention_mask], dim=1)
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # present tokens numbered 0, 1, ... per sample
        logits = self.lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
        return logits[:, k * t :]


def tiny_llama_config(vocab: int = 32, width: int = 32, layers: int = 2, heads: int = 4) -> LlamaConfig:
    """A Llama-style config of a few ten thousand parameters (random init, offline)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",  # fully masked padding rows stay finite (no NaN in their gradients)
    )


def tiny_vit(
    img_size: int = 8, patch_size: int = 4, width: int = 16, depth: int = 1, heads: int = 2
) -> VisionTransformer:
    return VisionTransformer(
        img_size=img_size,
        patch_size=patch_size,
        embed_dim=width,
        depth=depth,
        num_heads=heads,
        mlp_ratio=2.0,
        num_classes=0,
        global_pool="",
    )


class VLM(DistMMMixin, L.LightningModule):
    """Vision tower (ViT + projector) feeding a causal LM; the loss is the batch's next-token token mean.

    ``vit`` / ``lm``: built tiny at random when None; pass e.g. ``AutoModelForCausalLM.from_pretrained(dir,
    local_files_only=True)`` (see :func:`load_language_model`) and a timm ViT for real weights.
    """

    def __init__(
        self,
        vit: nn.Module | None = None,
        lm: PreTrainedModel | None = None,
        vit_width: int = 16,
        freeze_vit: bool = False,
        frozen_llm: bool = False,
        optimizer: str = "sgd",
        lr: float = 0.1,
    ) -> None:
        super().__init__()
        lm = lm if lm is not None else LlamaForCausalLM(tiny_llama_config())
        self.vision = VisionProjector(
            vit if vit is not None else tiny_vit(width=vit_width), vit_width, lm.config.hidden_size, freeze_vit
        )
        self.language = LanguageModel(lm)
        self.frozen_llm = frozen_llm
        self.optimizer_name = optimizer
        self.lr = lr

    def towers(self) -> dict[str, Tower]:
        return {
            "image": Tower(self.vision, input=["pixel_values", "n_images"]),
            "llm": Tower(
                self.language,
                input=["input_ids", "attention_mask", "labels", "n_images"],
                consumes={"image": "image_embeds"},
                frozen=self.frozen_llm,
            ),
        }

    def token_loss(self, outputs: Tensor, batch: Any) -> tuple[Tensor, Tensor]:
        """Next-token cross-entropy summed over these rows' target tokens, and their count."""
        labels = batch["labels"][:, 1:]
        logits = outputs[:, :-1]
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return total, (labels != IGNORE).sum()

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


def load_language_model(path: str) -> PreTrainedModel:
    """A causal LM from a local Hugging Face folder (never downloads)."""
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="eager")
