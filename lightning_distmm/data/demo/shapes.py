"""Shapes: an embedded, procedurally generated image-caption dataset (nothing to download).

Every sample is a function of ``(seed, split, index)`` only: an RGB image of one coloured shape
(circle, square, triangle, cross; eight colours) in one of the nine cells of a 3 x 3 grid, with
random size, sub-cell position jitter, a small rotation, colour jitter, a noisy background; and a
caption that names colour, shape and place with one of a few templates::

    "a red circle at the top left"      "there is a cyan cross in the center"
    "a picture of a white square on the right"    "at the bottom there is a pink triangle"

There are ``8 * 4 * 9 = 288`` (colour, shape, place) combinations. Each run of 288 consecutive
indices (aligned to multiples of 288) holds every combination exactly once, in a seeded random
order, so a held-out split of up to 288 samples has no two samples with the same description and
exact-pair retrieval on it is well defined. Splits are disjoint ranges of one global index space
(``train`` starts at 0, ``val`` and ``test`` far beyond any train size).

Fields (:attr:`ShapesDataset.fields`): ``image`` ``[3, S, S]`` float (normalised: zero mean,
unit variance over the dataset), ``caption`` (str), ``input_ids`` / ``attention_mask`` ``[context_length]`` long (see
:mod:`lightning_distmm.data.demo.tokenizer`) and ``label`` (the combination id, an int). ``load`` does
only the work of the fields asked for: no rendering without ``image``, no tokenizing without
``input_ids``/``attention_mask``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_distmm.data.demo.captions import COLORS, POSITIONS, SHAPES, TEMPLATES, vocabulary
from lightning_distmm.data.demo.tokenizer import build_caption_tokenizer, encode
from lightning_distmm.data.loader.shuffle import train_loader
from lightning_distmm.data.samples.fields import FieldDataset

NUM_COMBOS = len(COLORS) * len(SHAPES) * len(POSITIONS)
_COLOR_NAMES = tuple(COLORS)
_COLOR_VALUES = np.array([COLORS[c] for c in _COLOR_NAMES], dtype=np.float32)

#: per-pixel mean and standard deviation of the images in [0, 1] (measured, all channels alike);
#: normalising with them centres the dark background near 0 and makes the shape stand out
PIXEL_MEAN, PIXEL_STD = 0.15, 0.16

#: first global index of each split; disjoint for any split size below 288 * 2**20 (~3e8)
SPLIT_OFFSETS: dict[str, int] = {"train": 0, "val": NUM_COMBOS * 2**20, "test": 2 * NUM_COMBOS * 2**20}
DEFAULT_SIZES: dict[str, int] = {"train": 50_000, "val": 256, "test": 256}

# the random streams of a sample: independent, so that loading some fields never shifts others
_STREAM_ATTRS, _STREAM_IMAGE, _STREAM_PERM = 0, 1, 2


def describe(label: int) -> tuple[str, str, int]:
    """``(colour, shape, position index)`` of combination ``label``."""
    if not 0 <= label < NUM_COMBOS:
        raise ValueError(f"label must be in [0, {NUM_COMBOS}), got {label}")
    n_pos, n_shape = len(POSITIONS), len(SHAPES)
    return _COLOR_NAMES[label // (n_shape * n_pos)], SHAPES[(label // n_pos) % n_shape], label % n_pos


@functools.lru_cache(maxsize=256)
def _block_permutation(seed: int, block: int) -> np.ndarray:
    return np.random.default_rng([seed, block, _STREAM_PERM]).permutation(NUM_COMBOS)


def combination(seed: int, global_index: int) -> int:
    """The (colour, shape, place) combination id of a global index (a permutation per block of 288)."""
    block, offset = divmod(global_index, NUM_COMBOS)
    return int(_block_permutation(seed, block)[offset])


@functools.lru_cache(maxsize=8)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    coords = np.arange(size, dtype=np.float32) + 0.5
    return np.meshgrid(coords, coords, indexing="xy")  # x[row, col] = col, y[row, col] = row


def render(
    color: str, shape: str, position: int, rng: np.random.Generator, size: int = 32, noise: float = 0.06
) -> np.ndarray:
    """A ``[3, size, size]`` float32 image in ``[0, 1]`` of one shape; all randomness from ``rng``."""
    cell = size / 3.0
    row, col = divmod(position, 3)
    radius = cell * rng.uniform(0.36, 0.47)
    jitter = cell * 0.5 - radius  # keep the shape inside its cell
    cx = (col + 0.5) * cell + rng.uniform(-1, 1) * max(jitter, 0.0) * 0.6
    cy = (row + 0.5) * cell + rng.uniform(-1, 1) * max(jitter, 0.0) * 0.6
    theta = rng.uniform(-0.2, 0.2)
    x, y = _grid(size)
    dx, dy = x - cx, y - cy
    cos, sin = np.cos(theta), np.sin(theta)
    u, v = cos * dx + sin * dy, -sin * dx + cos * dy  # rotated coordinates, v points down
    if shape == "circle":
        mask = u * u + v * v <= radius * radius
    elif shape == "square":
        side = radius * 0.9
        mask = (np.abs(u) <= side) & (np.abs(v) <= side)
    elif shape == "triangle":  # pointing up
        mask = (v <= radius * 0.7) & (np.abs(u) <= (v + radius) * 0.62)
    elif shape == "cross":
        arm = radius * 0.33
        mask = ((np.abs(u) <= arm) & (np.abs(v) <= radius)) | ((np.abs(v) <= arm) & (np.abs(u) <= radius))
    else:
        raise ValueError(f"unknown shape {shape!r}; shapes are {SHAPES}")
    base = rng.uniform(0.0, 0.25)
    background = base + rng.normal(0.0, 0.03, size=3).astype(np.float32)  # slightly tinted
    rgb = np.clip(np.asarray(COLORS[color], dtype=np.float32) + rng.normal(0.0, 0.06, size=3), 0.0, 1.0)
    image = np.where(mask[None], rgb[:, None, None], background[:, None, None]).astype(np.float32)
    image += rng.normal(0.0, noise, size=image.shape).astype(np.float32)
    return np.clip(image, 0.0, 1.0, out=image)


class ShapesDataset(FieldDataset):
    """Procedural image-caption pairs; see the module docstring.

    Args:
        split: ``"train"``, ``"val"`` or ``"test"`` (disjoint index ranges).
        size: number of samples (default 50 000 for train, 256 for val/test).
        seed: the data seed (what the data *is*; independent of the training seed).
        image_size: side of the square image in pixels.
        context_length: token width of ``input_ids`` / ``attention_mask``.
        noise: standard deviation of the per-pixel noise (images in ``[0, 1]`` before normalising).
        fields: the fields ``__getitem__`` returns (default: all); ``load`` takes any subset.
    """

    fields: tuple[str, ...] = ("image", "caption", "input_ids", "attention_mask", "label")
    TOKEN_FIELDS = ("input_ids", "attention_mask")

    def __init__(
        self,
        split: str = "train",
        size: int | None = None,
        seed: int = 0,
        image_size: int = 32,
        context_length: int = 16,
        noise: float = 0.06,
        fields: Sequence[str] | None = None,
    ):
        if split not in SPLIT_OFFSETS:
            raise ValueError(f"unknown split {split!r}; splits are {sorted(SPLIT_OFFSETS)}")
        size = DEFAULT_SIZES[split] if size is None else int(size)
        if not 0 < size <= NUM_COMBOS * 2**20:
            raise ValueError(f"size must be in [1, {NUM_COMBOS * 2**20}], got {size}")
        if image_size < 6:
            raise ValueError(f"image_size must be at least 6 pixels, got {image_size}")
        self.split, self.size, self.seed = split, size, int(seed)
        self.image_size, self.context_length, self.noise = int(image_size), int(context_length), float(noise)
        self.offset = SPLIT_OFFSETS[split]
        if fields is not None:
            unknown = [f for f in fields if f not in type(self).fields]
            if unknown:
                raise KeyError(f"ShapesDataset has no field(s) {unknown}; fields are {type(self).fields}")
            self.fields = tuple(fields)
        self._tokenizer = None

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return (
            f"ShapesDataset(split={self.split!r}, size={self.size}, seed={self.seed}, "
            f"image_size={self.image_size}, context_length={self.context_length})"
        )

    # ------------------------------------------------------------------ pieces of a sample
    def _global_index(self, index: int) -> int:
        index = int(index)
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self!r}")
        return self.offset + index

    def attributes(self, index: int) -> dict[str, Any]:
        """Colour, shape, position, template and label of sample ``index`` (cheap: no rendering)."""
        g = self._global_index(index)
        label = combination(self.seed, g)
        color, shape, position = describe(label)
        template = int(np.random.default_rng([self.seed, g, _STREAM_ATTRS]).integers(len(TEMPLATES)))
        return {"label": label, "color": color, "shape": shape, "position": position, "template": template}

    @staticmethod
    def caption_of(attrs: dict[str, Any]) -> str:
        return TEMPLATES[attrs["template"]].format(
            color=attrs["color"], shape=attrs["shape"], where=POSITIONS[attrs["position"]][1]
        )

    def pixels(self, index: int, attrs: dict[str, Any]) -> np.ndarray:
        """The ``[3, S, S]`` render of sample ``index`` in ``[0, 1]`` (the expensive part)."""
        rng = np.random.default_rng([self.seed, self._global_index(index), _STREAM_IMAGE])
        return render(attrs["color"], attrs["shape"], attrs["position"], rng, self.image_size, self.noise)

    def render(self, index: int, attrs: dict[str, Any]) -> torch.Tensor:
        """The normalised ``[3, S, S]`` image of sample ``index``."""
        return torch.from_numpy((self.pixels(index, attrs) - PIXEL_MEAN) / PIXEL_STD)

    def for_file(self, index: int) -> tuple[np.ndarray, str]:
        """Sample ``index`` as the recipes write it to files: the 8-bit ``[S, S, 3]`` pixels (for a
        PNG or JPEG) and the caption."""
        attrs = self.attributes(index)
        pixels = (self.pixels(index, attrs).transpose(1, 2, 0) * 255).round().astype(np.uint8)
        return pixels, self.caption_of(attrs)

    def tokenize(self, caption: str) -> dict[str, torch.Tensor]:
        if self._tokenizer is None:
            self._tokenizer = build_caption_tokenizer()
        return encode(caption, self.context_length, self._tokenizer)

    # ------------------------------------------------------------------ FieldDataset
    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        fields = tuple(fields)
        unknown = [f for f in fields if f not in type(self).fields]
        if unknown:
            raise KeyError(f"ShapesDataset has no field(s) {unknown}; fields are {type(self).fields}")
        attrs = self.attributes(index)
        out: dict[str, Any] = {}
        caption = self.caption_of(attrs) if any(f in fields for f in ("caption", *self.TOKEN_FIELDS)) else None
        tokens = self.tokenize(caption) if any(f in fields for f in self.TOKEN_FIELDS) else None
        for f in fields:
            if f == "image":
                out[f] = self.render(index, attrs)
            elif f == "caption":
                out[f] = caption
            elif f == "label":
                out[f] = attrs["label"]
            else:
                out[f] = tokens[f]
        return out

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers rebuild the tokenizer lazily
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        return state


class ShapesDataModule(L.LightningDataModule):
    """Train / val loaders over :class:`ShapesDataset`.

    ``batch_size`` is the **global** batch: the samples that one contrastive loss sees (under distmm
    the strategy splits it across each tower's replicas). Training batches drop the last partial
    batch; validation keeps it. ``shuffle`` is a seeded permutation per epoch (see
    :func:`~lightning_distmm.data.loader.shuffle.seeded_shuffle`), identical under single-process and distmm training.
    """

    def __init__(
        self,
        batch_size: int = 64,
        train_size: int = DEFAULT_SIZES["train"],
        val_size: int = DEFAULT_SIZES["val"],
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        image_size: int = 32,
        context_length: int = 16,
        noise: float = 0.06,
        val_batch_size: int | None = None,
        pin_memory: bool = False,
        shuffle_seed: int | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.val_batch_size = int(batch_size), int(val_batch_size or batch_size)
        self.num_workers, self.shuffle, self.pin_memory = int(num_workers), bool(shuffle), bool(pin_memory)
        self.shuffle_seed = shuffle_seed
        common = dict(seed=seed, image_size=image_size, context_length=context_length, noise=noise)
        self.train_dataset = ShapesDataset("train", train_size, **common)
        self.val_dataset = ShapesDataset("val", val_size, **common)

    def _eval_loader(self, batch_size: int) -> DataLoader:
        """The held-out split in order (the last partial batch kept)."""
        return DataLoader(
            self.val_dataset,
            batch_size=batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader:
        return train_loader(
            self.train_dataset,
            self.batch_size,
            self.trainer,
            self.shuffle,
            self.num_workers,
            self.shuffle_seed,
            pin_memory=self.pin_memory,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_batch_size)

    # ------------------------------------------------------------------ for the evaluation callbacks
    @property
    def retrieval_dataset(self) -> ShapesDataset:
        """Held-out pairs for :class:`lightning_distmm.models.evaluation.Retrieval` (descriptions unique)."""
        return self.val_dataset

    @property
    def zero_shot_dataset(self) -> ShapesDataset:
        return self.val_dataset

    @property
    def classnames(self) -> list[str]:
        """One name per label (a colour, shape and place combination): ``"red circle at the top left"``."""
        names = []
        for label in range(NUM_COMBOS):
            color, shape, position = describe(label)
            names.append(f"{color} {shape} {POSITIONS[position][1]}")
        return names

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Prompts to the text tower's inputs (the captions' tokenizer and width)."""
        return encode(list(texts), self.val_dataset.context_length, build_caption_tokenizer())

    def eval_dataloader(self, batch_size: int | None = None) -> DataLoader:
        """The held-out (val) split in order, for retrieval metrics."""
        return self._eval_loader(batch_size or self.val_batch_size)


__all__ = [
    "COLORS",
    "SHAPES",
    "POSITIONS",
    "TEMPLATES",
    "NUM_COMBOS",
    "ShapesDataset",
    "ShapesDataModule",
    "vocabulary",
    "describe",
    "render",
]
