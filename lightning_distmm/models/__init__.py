"""Model builders (CLIP on timm + transformers) and evaluation metrics."""

from lightning_distmm.models.clip import CLIP_TINY, BertTower, CLIPModel, TextTower, build_tower, num_parameters
from lightning_distmm.models.metrics import format_metrics, retrieval_metrics

__all__ = [
    "CLIP_TINY",
    "CLIPModel",
    "TextTower",
    "BertTower",
    "build_tower",
    "num_parameters",
    "retrieval_metrics",
    "format_metrics",
]
