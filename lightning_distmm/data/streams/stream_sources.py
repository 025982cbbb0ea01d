"""Which iterable datasets distmm reads, and as what: every rank must read the same stream.

A :class:`~lightning_distmm.data.streams.streaming.FieldStream` is read as it is; a LitData
``StreamingDataset`` through :class:`~lightning_distmm.data.streams.litdata_stream.LitDataStream` (as one
process reads it); any other ``IterableDataset`` of dict samples as a
:class:`~lightning_distmm.data.streams.streaming.PlainStream`. Refused by name, at setup, on every rank:
what splits itself by rank or reads differently per process, so that the cause is named before any
step (the run-time check of :mod:`~lightning_distmm.data.streams.agreement` catches the others).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

from lightning_distmm.data.streams.litdata_stream import LitDataStream
from lightning_distmm.data.streams.streaming import FieldStream, PlainStream


def as_stream(dataset: IterableDataset) -> FieldStream:
    """``dataset`` as a :class:`FieldStream`; refuses what distmm cannot read the same on every rank,
    and reads a LitData ``StreamingDataset`` as one process would (:mod:`~lightning_distmm.data.streams.litdata_stream`)."""
    if isinstance(dataset, FieldStream):
        return dataset
    refuse_unsupported_stream(dataset)
    if is_litdata(dataset):
        return LitDataStream(dataset)
    return PlainStream(dataset)


def _module_of(dataset: Any) -> str:
    return type(dataset).__module__ or ""


def is_litdata(dataset: Any) -> bool:
    """A LitData ``StreamingDataset`` (or a subclass), recognised without importing litdata."""
    return any(
        c.__name__ == "StreamingDataset" and (c.__module__ or "").startswith("litdata.") for c in type(dataset).__mro__
    )


def refuse_unsupported_stream(dataset: Any) -> None:
    """Refuse, naming the cause, a stream known to read differently per process: a Hugging Face
    dataset after ``split_dataset_by_node``, LitData's combined or parallel datasets (they assign chunks
    by rank), a ``webdataset`` pipeline (it splits shards by rank and worker and shuffles from the
    process's clock). Under distmm every rank must read the same stream."""
    module = _module_of(dataset)
    if (module == "datasets" or module.startswith("datasets.")) and getattr(dataset, "_distributed", None) is not None:
        node = dataset._distributed
        raise TypeError(
            f"distmm cannot train on a Hugging Face {type(dataset).__name__} split by"
            f" datasets.distributed.split_dataset_by_node (this rank reads node {getattr(node, 'rank', '?')} of"
            f" {getattr(node, 'world_size', '?')}): each rank would read other samples, while under distmm every"
            f" rank reads the whole stream in the same order and keeps only its rows of each global batch. Pass the"
            f" dataset before split_dataset_by_node to the DataLoader (shuffle it with .shuffle(seed=...,"
            f" buffer_size=...): distmm calls its set_epoch)"
        )
    if module.startswith("litdata.") and not is_litdata(dataset):
        raise TypeError(
            f"distmm cannot train on LitData's {type(dataset).__name__}: it assigns its datasets' chunks to ranks"
            f" and workers from the process's rank and world size, while every distmm rank must read the same"
            f" stream; give the DataLoader a litdata.StreamingDataset (distmm reads it as one process would)"
        )
    if module == "webdataset" or module.startswith("webdataset."):
        raise TypeError(
            f"distmm cannot train on a webdataset pipeline ({type(dataset).__name__}): it splits shards by rank and"
            f" worker, shuffles from the process's clock and decodes whole samples, while every distmm rank must read"
            f" the same stream in the same order and decode only its rows: use"
            f" lightning_distmm.data.WebDatasetPairs(urls, shuffle=..., seed=...) over the same shards"
        )


__all__ = ["as_stream", "is_litdata", "refuse_unsupported_stream"]
