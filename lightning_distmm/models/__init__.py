"""Model builders (CLIP on timm + transformers), evaluation metrics and the throughput callback."""

from lightning_distmm.models.clip import CLIP_TINY, BertTower, CLIPModel, TextTower, build_tower, num_parameters
from lightning_distmm.models.metrics import format_metrics, retrieval_metrics
from lightning_distmm.models.throughput import Throughput, per_device_share

__all__ = [
    "CLIP_TINY",
    "CLIPModel",
    "TextTower",
    "BertTower",
    "build_tower",
    "num_parameters",
    "retrieval_metrics",
    "format_metrics",
    "Throughput",
    "per_device_share",
]
