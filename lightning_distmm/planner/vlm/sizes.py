"""Vision-language model sizes people train (the VLM planner's presets), as transformers configs
whose parameter counts are checked by building them on the meta device (nothing allocated, nothing
downloaded).

* ``llava15_7b``: LLaVA-1.5-7B: CLIP ViT-L/14 at 336 px (576 patches + CLS, the second-to-last
  layer's patch tokens feed the LLM), a two-layer MLP projector 1024 -> 4096 -> 4096, Vicuna-7B
  (Llama-2-7B's shape).
* ``internvl_26b``: InternVL-Chat-like: InternViT-6B (448 px, patch 14, width 3200, 48 blocks as
  published at 5.9B; V1.5 drops the last 3; written here as a CLIP-style ViT of the same shape,
  which transformers has, without InternViT's QK-norm and layer scale), pixel shuffle to 256
  tokens per tile (4 x the width into the projector), an MLP projector into InternLM2-20B's shape
  (written as a Llama config: InternLM2 is Llama-like with grouped-query attention).

The planner's profiles will be derived from these (docs/next-steps.md); today they give parameter
counts and the tokens an image adds to the LLM's sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VLMPreset:
    """A vision encoder, a projector and a causal LM, by their transformers configs."""

    name: str
    vision: dict[str, Any]
    llm: dict[str, Any]
    #: widths of the projector's linear layers, input first (LLaVA: vision width -> LLM width -> LLM width)
    projector: tuple[int, ...]
    #: tokens one image (tile) adds to the LLM's sequence
    tokens_per_image: int
    #: published totals, for the check (encoder, LLM), in parameters
    published: dict[str, float] = field(default_factory=dict)


PRESETS: dict[str, VLMPreset] = {
    "llava15_7b": VLMPreset(
        "llava15_7b",
        vision=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            projection_dim=768,
        ),
        llm=dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            tie_word_embeddings=False,
        ),
        projector=(1024, 4096, 4096),
        tokens_per_image=576,
        published={"vision": 303.5e6, "llm": 6.738e9},
    ),
    "internvl_26b": VLMPreset(
        "internvl_26b",
        vision=dict(
            hidden_size=3200,
            intermediate_size=12800,
            num_hidden_layers=48,
            num_attention_heads=25,
            image_size=448,
            patch_size=14,
            projection_dim=768,
        ),
        llm=dict(
            vocab_size=92544,
            hidden_size=6144,
            intermediate_size=16384,
            num_hidden_layers=48,
            num_attention_heads=48,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
        projector=(4 * 3200, 6144, 6144),
        tokens_per_image=256,
        published={"vision": 5.9e9, "llm": 19.86e9},
    ),
}


def count_on_meta(preset: VLMPreset) -> dict[str, int]:
    """Parameters of the preset's vision encoder, projector and LLM, built by transformers on meta."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        vision = CLIPVisionModel(CLIPVisionConfig(**preset.vision))
        llm = LlamaForCausalLM(LlamaConfig(**preset.llm))
        projector = torch.nn.Sequential(
            *[torch.nn.Linear(a, b) for a, b in zip(preset.projector, preset.projector[1:])]
        )
    return {
        "vision": sum(p.numel() for p in vision.parameters()),
        "projector": sum(p.numel() for p in projector.parameters()),
        "llm": sum(p.numel() for p in llm.parameters()),
    }


__all__ = ["PRESETS", "VLMPreset", "count_on_meta"]
