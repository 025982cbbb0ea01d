"""Checks of the training data against a plan, run at setup on every rank.

Every rank runs the same checks on the same dataset, so bad data fails on all ranks at once with a
message naming the cause, instead of one rank failing (and the others waiting on it) when the bad
sample or the short last batch is reached, after earlier steps have trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_distmm.core.plan import split_batch
from lightning_distmm.data.samples.fields import FieldDataset
from lightning_distmm.data.streams.stream_sources import as_stream
from lightning_distmm.data.streams.streaming import FieldStream


def check_dataloader(
    dataloader: DataLoader,
    fields_by_tower: Mapping[str, Sequence[str]],
    replicas_by_tower: Mapping[str, int],
    sync_groups: int = 1,
) -> None:
    """:func:`check_dataset` with the batch size, ``drop_last`` and epoch length of ``dataloader``.

    Raises:
        ValueError: a DataLoader that does not batch (``batch_size=None``), as over a dataset that
            yields batches itself.
    """
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        raise ValueError(prebatched_message(dataloader.dataset))
    sampler = getattr(batch_sampler, "sampler", None)
    num_samples = None
    if sampler is not None and hasattr(sampler, "__len__") and not isinstance(dataloader.dataset, IterableDataset):
        num_samples = len(sampler)
    check_dataset(
        dataloader.dataset,
        fields_by_tower,
        batch_size=getattr(batch_sampler, "batch_size", None),
        drop_last=bool(getattr(batch_sampler, "drop_last", False)),
        replicas_by_tower=replicas_by_tower,
        sync_groups=sync_groups,
        num_samples=num_samples,
    )


def prebatched_message(dataset: Any) -> str:
    """Why a DataLoader with ``batch_size=None`` cannot be trained on under distmm, and what to change."""
    name = type(dataset).__name__
    return (
        f"the training DataLoader over {name} has batch_size=None, so it does not batch: the samples come as the"
        f" dataset yields them, batched already if it batches itself (webdataset's .batched(n), a dataset"
        f" yielding lists or stacked tensors). distmm must cut every global batch into each rank's rows, so the"
        f" DataLoader has to do the batching: make the dataset yield single samples (dicts keyed by field) and"
        f" give the DataLoader batch_size=<the global batch> and drop_last=True, e.g."
        f" DataLoader(dataset, batch_size=256, drop_last=True) (for LitData: StreamingDataLoader(dataset,"
        f" batch_size=256, drop_last=True))"
    )


def check_dataset(
    dataset: Any,
    fields_by_tower: Mapping[str, Sequence[str]],
    batch_size: int | None,
    drop_last: bool,
    replicas_by_tower: Mapping[str, int],
    sync_groups: int = 1,
    num_samples: int | None = None,
) -> None:
    """Refuse data that distmm cannot train on, naming the cause.

    Args:
        dataset: the training DataLoader's dataset.
        fields_by_tower: the batch fields each tower reads.
        batch_size: the DataLoader's batch size, the global batch (None: a custom batch sampler,
            whose batch sizes are not known in advance; the batch checks are skipped).
        drop_last: whether the DataLoader drops a short last batch.
        replicas_by_tower: each tower's data-parallel replicas; each needs a sample of every batch.
        sync_groups: the batch-syncs of a step (2 under the ``distmm`` schedule): each replica
            needs a sample of each sync group.
        num_samples: samples of an epoch, if the sampler draws other than ``len(dataset)``.

    Raises:
        TypeError: a ``webdataset`` pipeline (it reads other shards on every rank; use
            :class:`~lightning_distmm.data.datasets.webdataset.WebDatasetPairs`), or samples that are not
            dicts keyed by field.
        ValueError: an empty dataset, an epoch with no batch, a (last) batch smaller than a
            tower's replicas, or a stream of unknown length without ``drop_last`` where the plan
            needs several samples in every batch.
        KeyError: a field a tower reads that the samples do not have.
    """
    name = type(dataset).__name__
    if isinstance(dataset, IterableDataset):
        _check_stream(dataset, fields_by_tower, batch_size, drop_last, replicas_by_tower, sync_groups)
        return
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"distmm needs a map-style Dataset with __len__ and __getitem__; {name} lacks one of them")
    size = len(dataset)
    if size == 0:
        raise ValueError(f"the training dataset {name} is empty (len 0): there is no sample to train on")
    _check_fields(name, _fields_of(dataset), fields_by_tower)
    if batch_size is not None:
        _check_batches(
            num_samples if num_samples is not None else size, batch_size, drop_last, replicas_by_tower, sync_groups
        )


def _check_stream(
    dataset: IterableDataset,
    fields_by_tower: Mapping[str, Sequence[str]],
    batch_size: int | None,
    drop_last: bool,
    replicas_by_tower: Mapping[str, int],
    sync_groups: int,
) -> None:
    """An ``IterableDataset``: every rank reads it whole (data/streams/streaming.py). A :class:`FieldStream`
    declares its fields and maybe its length; another one is checked sample by sample as it is read."""
    name = type(dataset).__name__
    stream = as_stream(dataset)  # refuses what cannot be read the same on every rank
    if isinstance(dataset, FieldStream):
        _check_fields(name, set(dataset.fields), fields_by_tower)
    if batch_size is None:
        return
    size = stream.epoch_length()
    if size == 0:
        raise ValueError(f"the training dataset {name} is empty (len 0): there is no sample to train on")
    if size is not None:
        _check_batches(size, batch_size, drop_last, replicas_by_tower, sync_groups)
        return
    _check_batches(batch_size, batch_size, True, replicas_by_tower, sync_groups)  # every batch
    if not drop_last and (sync_groups > 1 or any(r > 1 for r in replicas_by_tower.values())):
        raise ValueError(
            f"{name} does not know its length, so the last batch of an epoch may be short, and this plan needs"
            f" several samples in every batch (towers' replicas {dict(replicas_by_tower)}, {sync_groups} sync"
            f" group(s)); set drop_last=True on the DataLoader, or give the dataset a length"
        )


def _check_fields(name: str, have: set[str], fields_by_tower: Mapping[str, Sequence[str]]) -> None:
    for tower, fields in fields_by_tower.items():
        missing = [f for f in fields if f not in have]
        if missing:
            raise KeyError(
                f"tower {tower!r} reads batch field(s) {missing} that the samples of {name} do not have"
                f" (they have {sorted(have)})"
            )


def _fields_of(dataset: Any) -> set[str]:
    """The fields a sample has: a FieldDataset's declared ones, else those of sample 0."""
    if isinstance(dataset, FieldDataset):
        return set(dataset.fields)
    sample = dataset[0]
    if not isinstance(sample, Mapping):
        described = type(sample).__name__
        if isinstance(sample, tuple | list):
            described = f"a {described} of {len(sample)} (e.g. open_clip's CsvDataset returns (image, text))"
        raise TypeError(
            f"distmm needs samples that are dicts keyed by field name, so that each tower finds its inputs by name;"
            f" {type(dataset).__name__}[0] is {described}: return a dict such as {{'image': ..., 'text': ...}} from"
            f" __getitem__ (with the names the towers' Tower(input=...) give), or subclass lightning_distmm.FieldDataset"
        )
    return set(sample)


def _check_batches(
    num_samples: int, batch_size: int, drop_last: bool, replicas_by_tower: Mapping[str, int], sync_groups: int
) -> None:
    """Every batch of an epoch gives each replica of each tower a sample (of each sync group)."""
    if num_samples < batch_size and drop_last:
        raise ValueError(
            f"an epoch has no batch: {num_samples} samples are fewer than one batch of {batch_size} and the"
            f" DataLoader has drop_last=True; use a smaller batch_size or more data"
        )
    sizes = {"every batch": batch_size}
    last = num_samples % batch_size
    if last and not drop_last:
        sizes["the last batch of each epoch"] = last
    for what, n in sizes.items():
        groups = split_batch(n, None, sync_groups)
        for tower, replicas in replicas_by_tower.items():
            if min(groups) >= replicas:
                continue
            where = f"{what} has {n} samples"
            if what != "every batch":
                where += f" ({num_samples} samples in batches of {batch_size}, drop_last=False)"
            need = (
                f"each of its {sync_groups} sync groups ({groups}) must give each replica a sample"
                if sync_groups > 1
                else "a replica would get no sample"
            )
            advice = (
                "set drop_last=True on the DataLoader (or a batch_size that leaves no short last batch)"
                if what != "every batch"
                else "raise the DataLoader's batch_size or give the tower fewer replicas"
            )
            raise ValueError(f"tower {tower!r} has {replicas} data-parallel replicas, but {where}: {need}; {advice}")
