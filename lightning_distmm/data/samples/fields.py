"""Datasets that can load some fields of a sample and skip the rest.

Under distmm a rank only computes some towers, so it should only read and decode the fields those
towers use (an image rank need not tokenize captions; a text rank need not decode JPEGs). A dataset
opts in by subclassing :class:`FieldDataset`; any other map-style dataset still works, its samples
are loaded whole and the unneeded fields dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch.utils.data import Dataset


class SampleDecodeError(OSError):
    """A sample's image could not be read or decoded; the message names the sample (file and CSV row,
    or shard and key) and the decoder's own words."""


class FieldDataset(Dataset):
    """A map-style dataset of dict samples whose fields can be loaded selectively."""

    #: every field a sample has
    fields: tuple[str, ...] = ()

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        """Load and decode only ``fields`` of sample ``index``."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.load(index, self.fields)


def load_fields(dataset: Any, index: int, fields: Iterable[str]) -> Mapping[str, Any]:
    """``fields`` of sample ``index``, loading only those when the dataset allows it."""
    fields = tuple(fields)
    if isinstance(dataset, FieldDataset):
        return dataset.load(index, fields)
    name = type(dataset).__name__
    return select_fields(dataset[index], fields, name, f"{name}[{index}] returned")


def select_fields(sample: Any, fields: Iterable[str], name: str, produced: str) -> dict[str, Any]:
    """``fields`` of an already decoded ``sample`` of the dataset called ``name``: a sample that is
    not a dict, or lacks a field a tower reads, is refused by name (``produced``: how the dataset gave
    it, ``"Name[3] returned"`` or ``"Name yielded"``)."""
    if not isinstance(sample, Mapping):
        raise TypeError(f"distmm needs samples that are dicts keyed by field name; {produced} {type(sample).__name__}")
    missing = [f for f in fields if f not in sample]
    if missing:
        raise KeyError(
            f"the samples of {name} have no field(s) {missing} that a tower reads; they have {sorted(sample)}"
        )
    return {f: sample[f] for f in fields}
