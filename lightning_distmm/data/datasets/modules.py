"""A LightningDataModule over the pair datasets (:mod:`lightning_distmm.data.datasets.pairs`).

``PairsDataModule`` trains on an open_clip CSV/TSV or an image folder, validates on a second one
or on a held-out tail of the first, and gives the evaluation callbacks what they ask for
(``retrieval_dataset``, ``tokenize``). ``batch_size`` is the global batch, as everywhere here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_distmm.data.datasets.pairs import CsvPairs, ImageFolderPairs
from lightning_distmm.data.datasets.preprocess import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    CaptionTokenizer,
    pair_preprocessing,
)
from lightning_distmm.data.datasets.shuffle import seeded_shuffle
from lightning_distmm.data.loader.fields import FieldDataset
from lightning_distmm.data.loader.skipping import SkipBadRows, SkipBadSamples


class FieldSubset(FieldDataset):
    """Samples ``indices`` of a :class:`FieldDataset`, still loading only the fields asked for
    (``torch.utils.data.Subset`` would load whole samples)."""

    def __init__(self, dataset: FieldDataset, indices: Sequence[int]):
        self.dataset, self.indices = dataset, list(indices)
        self.fields = dataset.fields

    def __len__(self) -> int:
        return len(self.indices)

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        return self.dataset.load(self.indices[index], fields)


class StreamPairsDataModule(L.LightningDataModule):
    """What the stream DataModules (WebDataset shards, LitData folders) share once their subclass
    has set ``train_dataset`` (a stream), ``val_dataset`` (map-style or None), ``text`` (the
    tokenizer), ``batch_size``, ``val_batch_size`` and ``num_workers``: the caption check, the
    evaluation callbacks' ``retrieval_dataset`` and ``tokenize``, and the loaders."""

    train_dataset: Any
    val_dataset: FieldDataset | None
    text: CaptionTokenizer
    batch_size: int
    val_batch_size: int
    num_workers: int

    def check_captions(self, probe: FieldDataset, where: str, limit: int = 64) -> None:
        """Refuse captions the tokenizer cannot read (:meth:`CaptionTokenizer.check_captions`), read
        from the first ``limit`` pairs of ``probe``; and hold the held-out pairs for retrieval."""
        self.text.check_captions([probe.load(i, ("caption",))["caption"] for i in range(min(limit, len(probe)))], where)
        self.retrieval_dataset = self.val_dataset

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.text.batch(list(texts))

    def train_dataloader(self) -> DataLoader:
        split = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        if split and int(split.get("num_replicas", 1)) > 1:  # DDP: each replica its rows of the global batch
            self.train_dataset.split_replicas(int(split["rank"]), int(split["num_replicas"]), self.batch_size)
        skipping = self.train_dataset.__dict__.get("skip_bad_samples") is True
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=SkipBadRows(self.train_dataset) if skipping else None,  # one process: bad rows replaced
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return DataLoader(self.val_dataset, batch_size=self.val_batch_size, num_workers=self.num_workers)


class PairsDataModule(L.LightningDataModule):
    """Image-caption pairs from files.

    Args:
        path: the training pairs: a CSV/TSV file (:class:`CsvPairs`) or a folder (:class:`ImageFolderPairs`).
        val_path: held-out pairs in the same format; None holds out the last ``val_size`` pairs of ``path``.
        val_size: pairs held out when ``val_path`` is None: a count, or a fraction below 1 (0.1: a tenth).
        img_key, caption_key, sep: the CSV's columns and separator (open_clip's defaults: ``filepath``, ``title``, tab).
        captions: an image folder's captions file (None: sidecar ``.txt`` files).
        image_size: the image tower's input side; mean, std, interpolation, crop_pct: the eval transform
            (``timm.data.create_transform``; CLIP's mean and std by default).
        tokenizer: a local tokenizer directory or ``tokenizer.json`` (None: the embedded tokenizer).
        context_length: token width.
        batch_size: the global batch; val_batch_size, num_workers, shuffle: as for any DataModule.
        skip_bad_samples: replace a sample that cannot be decoded by the next one that can, logging
            and counting it (:mod:`lightning_distmm.data.loader.skipping`); off: the first one ends the run, named.
    """

    def __init__(
        self,
        path: str,
        val_path: str | None = None,
        val_size: float = 256,
        img_key: str = "filepath",
        caption_key: str = "title",
        sep: str | None = None,
        captions: str | None = None,
        image_size: int = 224,
        mean: Sequence[float] = OPENAI_CLIP_MEAN,
        std: Sequence[float] = OPENAI_CLIP_STD,
        interpolation: str = "bicubic",
        crop_pct: float = 1.0,
        tokenizer: str | None = None,
        context_length: int = 77,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        skip_bad_samples: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.val_batch_size = int(batch_size), int(val_batch_size or batch_size)
        self.num_workers, self.shuffle = int(num_workers), bool(shuffle)
        transform, self.text = pair_preprocessing(
            image_size, mean, std, interpolation, crop_pct, tokenizer, context_length
        )
        self.image_transform = transform  # also what a class folder for zero-shot is read with
        common: dict[str, Any] = {"transform": transform, "tokenizer": self.text}

        def open_pairs(where: str) -> FieldDataset:
            if os.path.isdir(where):
                return ImageFolderPairs(where, captions=captions, **common)
            return CsvPairs(where, img_key=img_key, caption_key=caption_key, sep=sep, **common)

        train = open_pairs(path)
        probe = sorted({i * len(train) // 64 for i in range(64)}) if len(train) else []
        self.text.check_captions([train.caption(i) for i in probe], f"{path} (data.path)")
        if val_path is not None:
            self.train_dataset, self.val_dataset = train, open_pairs(val_path)
        else:
            n = len(train)
            held = int(round(val_size * n)) if 0 < val_size < 1 else int(val_size)
            if not 0 < held < n:
                raise ValueError(
                    f"val_size={val_size} holds out {held} of the {n} pairs in {path}, leaving none to train on"
                    f" (or holding out none): pass a smaller count, a fraction such as val_size=0.1, or val_path="
                )
            val_size = held
            self.train_dataset = FieldSubset(train, range(n - val_size))
            self.val_dataset = FieldSubset(train, range(n - val_size, n))
        if skip_bad_samples:
            self.train_dataset = SkipBadSamples(self.train_dataset)
            self.val_dataset = SkipBadSamples(self.val_dataset, eager=True)  # the callbacks load per rank
        self.retrieval_dataset = self.val_dataset

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.text.batch(list(texts))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=seeded_shuffle(self.train_dataset, self.trainer) if self.shuffle else None,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, batch_size=self.val_batch_size, num_workers=self.num_workers)


__all__ = ["FieldSubset", "PairsDataModule", "StreamPairsDataModule"]
