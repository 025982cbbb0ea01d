"""The tiny ``CLIPModel`` configs the loss-variant tests share (CoCa, SigLIP): towers over the
fields and sizes of ``distmm_testing.PairData`` (3x8x8 images, 6 tokens of 20), trained with the
plain SGD the other exactness tests use."""

from __future__ import annotations

from typing import Any

import torch
from distmm_testing import EMBED, SEQ, VOCAB

from lightning_distmm.models.clip import CLIPModel


def tiny_config(name: str, loss: str, image_layers: int = 1, **image: Any) -> dict[str, Any]:
    """A ``CLIPModel`` config: a ViT of ``image_layers`` blocks (``image``: further keys of its
    entry) and a one-layer CLIP text tower, both 16 wide with 2 heads."""
    vit = {"arch": "vit", "input": "image", "img_size": 8, "patch_size": 4, "width": 16, "layers": image_layers}
    text = {"arch": "clip_text", "input": ["input_ids", "attention_mask"], "vocab_size": VOCAB, "context_length": SEQ}
    text.update(
        width=16, layers=1, heads=2, mlp_ratio=2.0, pad_token_id=0, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1
    )
    vit.update(heads=2, mlp_ratio=2.0, qkv_bias=False, **image)
    return {"name": name, "embed_dim": EMBED, "loss": loss, "towers": {"image": vit, "text": text}}


class SGDCLIPModel(CLIPModel):
    """A ``CLIPModel`` with plain SGD (momentum), as the other exactness tests use."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
