"""Tiny vision-language data and the reference comparison for the VLM tests (docs/vlm.md)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from distmm_testing import Comparison, read_losses, run_distmm, run_reference
from torch.utils.data import DataLoader

import lightning_distmm as ldm

MAX_IMAGES = 2
SEQ = 6
VOCAB = 32


class VLMData(ldm.FieldDataset):
    """Samples with 0, 1 or 2 random 8x8 images (``index % 3``) and padded random text of length 2..SEQ."""

    fields = ("pixel_values", "n_images", "input_ids", "attention_mask", "labels", "n_tokens")

    def __init__(self, size: int = 64, dtype: torch.dtype = torch.float32) -> None:
        self.size = size
        self.dtype = dtype

    def __len__(self) -> int:
        return self.size

    def images(self, index: int) -> int:
        return index % 3

    def load(self, index: int, fields: Any) -> dict[str, Any]:
        g = torch.Generator().manual_seed(index)
        pixels = torch.randn(MAX_IMAGES, 3, 8, 8, generator=g).to(self.dtype)
        n_images = self.images(index)
        pixels[n_images:] = 0
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        length = 2 + (index * 7) % (SEQ - 1)
        mask = (torch.arange(SEQ) < length).long()
        ids = ids * mask
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        labels[0] = -100  # the prompt token is not a target
        full = {
            "pixel_values": pixels,
            "n_images": torch.tensor(n_images),
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "n_tokens": length,  # the caption's tokens: a cost field (Tower(cost=...)), never collated
        }
        return {k: full[k] for k in fields}


class MiscountedVLMData(VLMData):
    """:class:`VLMData` whose sample ``index`` says ``n_images`` (its pixel_values stay VLMData's)."""

    def __init__(self, index: int, n_images: int, size: int = 64) -> None:
        super().__init__(size)
        self.index, self.n_images = index, n_images

    def load(self, index: int, fields: Any) -> dict[str, Any]:
        sample = super().load(index, fields)
        if index == self.index and "n_images" in sample:
            sample["n_images"] = torch.tensor(self.n_images)
        return sample


class SkewedVLMData(VLMData):
    """:class:`VLMData` with images in runs (0, 0, 0, 2, 2, 2, ...): a global batch's rows in sample
    order put the images on some encoder replicas and none on others."""

    def images(self, index: int) -> int:
        return 2 * ((index // 3) % 2)


def vlm_loader(
    batch: int, size: int = 64, dtype: torch.dtype = torch.float32, data: type[VLMData] = VLMData
) -> DataLoader:
    return DataLoader(data(size, dtype), batch_size=batch, drop_last=True)


def compare_vlm(
    make: Callable[[], L.LightningModule],
    plan: Any,
    devices: int,
    batch: int,
    steps: int,
    tmp_path: Path,
    dtype: torch.dtype = torch.float32,
    callbacks: list[Any] | None = None,
    data: type[VLMData] = VLMData,
    **extra: Any,
) -> Comparison:
    """``make()``'s module trained in one process and under distmm on the same global batches
    (``dtype``: the module's and the images' floating dtype; float64 separates rounding from error;
    ``callbacks``: the distmm run's; ``data``: the dataset class)."""
    L.seed_everything(0)
    reference = make().to(dtype)
    module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
    run_reference(reference, vlm_loader(batch, dtype=dtype, data=data), steps, str(tmp_path / "ref.json"), **extra)
    run_distmm(
        module,
        plan,
        devices,
        vlm_loader(batch, dtype=dtype, data=data),
        steps,
        str(tmp_path / "dist.json"),
        callbacks=callbacks or [],
        **extra,
    )
    return Comparison(
        reference, module, initial, read_losses(tmp_path / "ref.json"), read_losses(tmp_path / "dist.json")
    )
