"""The settings every image-caption pairs DataModule takes, written once.

``PairsDataModule`` (CSV / image folder), ``WebDatasetDataModule`` and ``LitDataDataModule`` differ
in where their pairs come from; the transform, the tokenizer and the loaders' sizes are the same
eleven keys (flat in ``conf/data/*.yaml``). :class:`PairOptions` holds them with their defaults and
:class:`PairsModuleBase` turns them into the module's hyperparameters, sizes, transform and tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import lightning as L
import torch

from lightning_distmm.data.datasets.preprocess import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    CaptionTokenizer,
    pair_preprocessing,
)


@dataclass
class PairOptions:
    """What a pairs DataModule takes besides its sources (keyword arguments of its constructor).

    Args:
        image_size: the image tower's input side; mean, std, interpolation, crop_pct: the eval transform
            (``timm.data.create_transform``; CLIP's mean and std by default).
        tokenizer: a local tokenizer directory or ``tokenizer.json`` (None: the embedded tokenizer).
        context_length: token width.
        batch_size: the global batch; val_batch_size, num_workers: as for any DataModule.
        skip_bad_samples: replace a sample that cannot be decoded by the next one that can, logging
            and counting it (:mod:`lightning_distmm.data.samples.skipping`); off: the first one ends the run, named.
    """

    image_size: int = 224
    mean: Sequence[float] = OPENAI_CLIP_MEAN
    std: Sequence[float] = OPENAI_CLIP_STD
    interpolation: str = "bicubic"
    crop_pct: float = 1.0
    tokenizer: str | None = None
    context_length: int = 77
    batch_size: int = 64
    val_batch_size: int | None = None
    num_workers: int = 0
    skip_bad_samples: bool = False

    @classmethod
    def take(cls, owner: str, own: Sequence[str], options: Mapping[str, Any]) -> PairOptions:
        """The options ``owner``'s constructor was given; a key that is neither one of ``own`` nor an
        option is refused by name (a ``TypeError``, as Python refuses an unknown keyword)."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(
                f"{owner}() got unexpected keyword argument(s) {unknown}: it takes {list(own)}"
                f" and the pair options {known}"
            )
        return cls(**options)


def stream_seed(seed: int | None) -> int:
    """A stream's order seed: the one given, else ``PL_GLOBAL_SEED`` (``seed_everything``), else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)


class PairsModuleBase(L.LightningDataModule):
    """The part of a pairs DataModule its options decide: hyperparameters, ``batch_size``,
    ``val_batch_size``, ``num_workers``, the caption tokenizer ``text`` and ``tokenize`` (for the
    evaluation callbacks)."""

    options: PairOptions
    text: CaptionTokenizer

    def take_options(self, own: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        """Record ``own`` (the constructor's own arguments) and ``options`` (:class:`PairOptions`, checked)
        as the hyperparameters, set the loaders' sizes and the tokenizer; returns the image transform."""
        opts = PairOptions.take(type(self).__name__, list(own), options)
        self.save_hyperparameters({**own, **vars(opts)})
        self.options = opts
        self.batch_size = int(opts.batch_size)
        self.val_batch_size = int(opts.val_batch_size or opts.batch_size)
        self.num_workers = int(opts.num_workers)
        transform, self.text = pair_preprocessing(
            opts.image_size, opts.mean, opts.std, opts.interpolation, opts.crop_pct, opts.tokenizer, opts.context_length
        )
        return transform

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.text.batch(list(texts))


__all__ = ["PairOptions", "PairsModuleBase", "stream_seed"]
