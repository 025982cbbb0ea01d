"""A LightningDataModule over the pair datasets (:mod:`lightning_distmm.data.datasets.pairs`).

``PairsDataModule`` trains on an open_clip CSV/TSV or an image folder, validates on a second one
or on a held-out tail of the first, and gives the evaluation callbacks what they ask for
(``retrieval_dataset``, ``tokenize``). ``batch_size`` is the global batch, as everywhere here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.utils.data import DataLoader

from lightning_distmm.data.datasets.pair_options import PairsModuleBase
from lightning_distmm.data.datasets.pairs import CsvPairs, ImageFolderPairs
from lightning_distmm.data.loader.shuffle import train_loader
from lightning_distmm.data.samples.fields import FieldDataset
from lightning_distmm.data.samples.skipping import SkipBadRows, SkipBadSamples


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


class StreamPairsDataModule(PairsModuleBase):
    """What the stream DataModules (WebDataset shards, LitData folders) share once their subclass
    has taken its options (:meth:`PairsModuleBase.take_options`): the datasets and their caption
    check (:meth:`hold`), the evaluation callbacks' ``retrieval_dataset``, and the loaders."""

    train_dataset: Any
    val_dataset: FieldDataset | None

    def hold(self, train: Any, val: FieldDataset | None, probe: Callable[[], FieldDataset], where: str) -> None:
        """Keep the training stream ``train`` and the held-out pairs ``val`` (skipping bad samples
        eagerly when asked: the callbacks load them per rank), and check the captions of ``val``, or
        of ``probe()`` (the stream's first pairs by index) without one; ``where`` names the source."""
        if self.options.skip_bad_samples and val is not None:
            val = SkipBadSamples(val, eager=True)
        self.train_dataset, self.val_dataset = train, val
        self.check_captions(val if val is not None else probe(), where)

    def check_captions(self, probe: FieldDataset, where: str, limit: int = 64) -> None:
        """Refuse captions the tokenizer cannot read (:meth:`CaptionTokenizer.check_captions`), read
        from the first ``limit`` pairs of ``probe``; and hold the held-out pairs for retrieval."""
        self.text.check_captions([probe.load(i, ("caption",))["caption"] for i in range(min(limit, len(probe)))], where)
        self.retrieval_dataset = self.val_dataset

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


class PairsDataModule(PairsModuleBase):
    """Image-caption pairs from files.

    Args:
        path: the training pairs: a CSV/TSV file (:class:`CsvPairs`) or a folder (:class:`ImageFolderPairs`).
        val_path: held-out pairs in the same format; None holds out the last ``val_size`` pairs of ``path``.
        val_size: pairs held out when ``val_path`` is None: a count, or a fraction below 1 (0.1: a tenth).
        img_key, caption_key, sep: the CSV's columns and separator (open_clip's defaults: ``filepath``, ``title``, tab).
        captions: an image folder's captions file (None: sidecar ``.txt`` files).
        shuffle: the seeded shuffle of the training pairs (:func:`~lightning_distmm.data.loader.shuffle.seeded_shuffle`).
        options: :class:`~lightning_distmm.data.datasets.pair_options.PairOptions` (``image_size``, ``mean``,
            ``std``, ``interpolation``, ``crop_pct``, ``tokenizer``, ``context_length``, ``batch_size``: the
            global batch, ``val_batch_size``, ``num_workers``, ``skip_bad_samples``).
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
        shuffle: bool = True,
        **options: Any,
    ):
        super().__init__()
        own = dict(path=path, val_path=val_path, val_size=val_size, img_key=img_key, caption_key=caption_key)
        own.update(sep=sep, captions=captions, shuffle=shuffle)
        transform = self.take_options(own, options)
        self.shuffle = bool(shuffle)
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
        if self.options.skip_bad_samples:
            self.train_dataset = SkipBadSamples(self.train_dataset)
            self.val_dataset = SkipBadSamples(self.val_dataset, eager=True)  # the callbacks load per rank
        self.retrieval_dataset = self.val_dataset

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.train_dataset, self.batch_size, self.trainer, self.shuffle, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, batch_size=self.val_batch_size, num_workers=self.num_workers)


__all__ = ["FieldSubset", "PairsDataModule", "StreamPairsDataModule"]
