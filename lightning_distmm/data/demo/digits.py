"""Handwritten digits: real scans shipped inside scikit-learn, as image-caption pairs.

``sklearn.datasets.load_digits`` holds 1,797 8 x 8 greyscale scans of digits written by 43 people
(UCI's optdigits test set; no download). Each becomes a ``[3, S, S]`` image (upsampled, normalised)
with a caption from one of a few templates (``"a handwritten seven"``, ``"the digit seven"``, ...),
picked per sample from the seed. The held-out split is a seeded tenth of the scans; the zero-shot
prompts (``"a photo of the digit {}"``) are a template the training captions never use.

Fields: ``image``, ``caption``, ``input_ids`` / ``attention_mask`` (a word-level tokenizer over
the captions' and prompts' words, built in process), ``label`` (the digit).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_distmm.data.demo.tokenizer import build_tokenizer, encode
from lightning_distmm.data.loader.shuffle import train_loader
from lightning_distmm.data.samples.fields import FieldDataset

CLASSNAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = ("a handwritten {}", "the digit {}", "a scan of the number {}", "a picture of a handwritten {}")
ZERO_SHOT_TEMPLATES = ("a photo of the digit {}",)
#: per-pixel mean and standard deviation of the scans in [0, 1]
PIXEL_MEAN, PIXEL_STD = 0.305, 0.377


@functools.cache
def _scans() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images / 16.0).astype(np.float32), digits.target.astype(np.int64)


@functools.cache
def digits_tokenizer() -> Any:
    words = {w for t in (*TEMPLATES, *ZERO_SHOT_TEMPLATES) for w in t.replace("{}", "").split()} | set(CLASSNAMES)
    return build_tokenizer(words)


def split_indices(split: str, seed: int = 0, val_fraction: float = 0.1) -> np.ndarray:
    """The scan indices of ``split`` (``train`` / ``val``): a seeded permutation, its first tenth held out."""
    n = len(_scans()[1])
    order = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * val_fraction))
    if split == "val":
        return order[:n_val]
    if split == "train":
        return order[n_val:]
    raise ValueError(f"unknown split {split!r}; splits are 'train', 'val'")


class DigitsDataset(FieldDataset):
    """Digit scans and template captions; ``load`` does only the work of the fields asked for."""

    fields: tuple[str, ...] = ("image", "caption", "input_ids", "attention_mask", "label")

    def __init__(self, split: str = "train", seed: int = 0, image_size: int = 32, context_length: int = 16):
        self.split, self.seed = split, int(seed)
        self.image_size, self.context_length = int(image_size), int(context_length)
        self.indices = split_indices(split, self.seed)

    def __len__(self) -> int:
        return len(self.indices)

    def __repr__(self) -> str:
        return f"DigitsDataset(split={self.split!r}, size={len(self)}, image_size={self.image_size})"

    def caption(self, index: int) -> str:
        label = int(_scans()[1][self.indices[index]])
        template = int(np.random.default_rng([self.seed, int(self.indices[index])]).integers(len(TEMPLATES)))
        return TEMPLATES[template].format(CLASSNAMES[label])

    def image(self, index: int) -> torch.Tensor:
        scan = torch.from_numpy(_scans()[0][self.indices[index]])[None, None]
        image = F.interpolate(scan, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return ((image[0] - PIXEL_MEAN) / PIXEL_STD).expand(3, -1, -1).contiguous()

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        fields = tuple(fields)
        unknown = [f for f in fields if f not in self.fields]
        if unknown:
            raise KeyError(f"DigitsDataset has no field(s) {unknown}; fields are {self.fields}")
        out: dict[str, Any] = {}
        if "image" in fields:
            out["image"] = self.image(index)
        if "label" in fields:
            out["label"] = int(_scans()[1][self.indices[index]])
        if any(f in fields for f in ("caption", "input_ids", "attention_mask")):
            text = self.caption(index)
            out["caption"] = text
            if "input_ids" in fields or "attention_mask" in fields:
                out.update(encode(text, self.context_length, digits_tokenizer()))
        return {f: out[f] for f in fields}


class DigitsDataModule(L.LightningDataModule):
    """Train / val loaders over :class:`DigitsDataset`, and what the evaluation callbacks ask for
    (``zero_shot_dataset``, ``classnames``, ``tokenize``). ``batch_size`` is the global batch."""

    classnames = CLASSNAMES

    def __init__(
        self,
        batch_size: int = 64,
        seed: int = 0,
        image_size: int = 32,
        context_length: int = 16,
        num_workers: int = 0,
        shuffle: bool = True,
        val_batch_size: int | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.val_batch_size = int(batch_size), int(val_batch_size or batch_size)
        self.num_workers, self.shuffle, self.context_length = int(num_workers), bool(shuffle), int(context_length)
        self.train_dataset = DigitsDataset("train", seed, image_size, context_length)
        self.val_dataset = DigitsDataset("val", seed, image_size, context_length)
        self.zero_shot_dataset = self.val_dataset

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        return encode(list(texts), self.context_length, digits_tokenizer())

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.train_dataset, self.batch_size, self.trainer, self.shuffle, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, batch_size=self.val_batch_size, num_workers=self.num_workers)


__all__ = ["CLASSNAMES", "TEMPLATES", "ZERO_SHOT_TEMPLATES", "DigitsDataModule", "DigitsDataset"]
