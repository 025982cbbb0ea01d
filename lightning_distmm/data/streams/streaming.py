"""Iterable datasets under distmm: every rank reads the same stream, and decodes only its rows.

A map-style dataset is drawn by index (:mod:`lightning_distmm.data.samples.sampling`); a stream has no
index to draw, so every rank reads it, in the same order, and cuts it into the same global
batches. What makes that cheap is the split of a sample into its *raw* form (the bytes of a tar
member, a caption's bytes) and its decoded fields: a :class:`FieldStream` yields raw samples, which
every rank reads, and decodes a raw sample's fields on request, which a rank does only for its
rows and its towers' fields. Reading is I/O and tar parsing; decoding (JPEG/PNG, resizing,
tokenizing) is most of the work of a data pipeline, and it is what each rank does only for its part.

The raw samples of a rank's rows travel as a DataLoader's "indices": the batch sampler (in the
rank's main process) reads the stream, and the DataLoader's workers decode, so ``num_workers``
parallelises decoding and the stream is read once per rank whatever the number of workers.

The position is the map-style one: ``(epoch, samples of that epoch trained)``. A stream's order
must follow from the epoch alone (and the dataset's own seed), never from the rank, the worker or
the process's RNG, so a resumed run reads the epoch again and skips what was trained: raw samples,
read and dropped, nothing decoded (a :class:`FieldStream` may skip cheaper, e.g. whole shards).

Any other ``IterableDataset`` of dict samples works too, with no saving: every rank iterates it
whole (its samples are decoded wherever it decodes them) and keeps its rows and fields.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from lightning_distmm.core.layout import RankLayout
from lightning_distmm.data.samples.fields import select_fields
from lightning_distmm.data.samples.sampling import DataPositionError, RankBatchSampler, _distributed
from lightning_distmm.data.samples.skipping import StreamRow, decode_or_mark
from lightning_distmm.data.streams.agreement import StreamAgreement, declared_rank_independent, explicit_key, key_of


class FieldStream(IterableDataset):
    """An iterable dataset whose samples are read raw and decoded per field.

    Subclasses give :meth:`samples` (the epoch's raw samples, in an order that depends on the epoch
    only) and :meth:`decode`; :meth:`epoch_length` when the epoch's size is known without reading it.
    Iterated plainly (one process, no distmm) it yields every sample decoded whole; the epoch is
    the number of earlier iterations in this process, or what :meth:`set_epoch` said. With
    DataLoader workers outside distmm, worker ``w`` of ``W`` decodes samples ``w, w + W, ...``
    (each reads the whole stream): the batches then differ from ``num_workers=0``, and non-persistent
    workers start from this object's epoch every time (use ``persistent_workers=True`` or
    :meth:`set_epoch`). Under distmm the order does not depend on the workers.
    """

    #: every field a sample has
    fields: tuple[str, ...] = ()

    _epoch: int = 0

    def samples(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        """The raw samples of ``epoch`` from sample ``skip`` on; skipping decodes nothing, and an epoch of
        fewer than ``skip`` samples raises :class:`~lightning_distmm.data.samples.sampling.DataPositionError`
        (see :func:`skip_samples`)."""
        raise NotImplementedError

    def decode(self, sample: Any, fields: Iterable[str]) -> dict[str, Any]:
        """Decode only ``fields`` of the raw ``sample``."""
        raise NotImplementedError

    def epoch_length(self) -> int | None:
        """Samples of one epoch, or None when only reading the epoch would tell."""
        return None

    def sample_key(self, sample: Any) -> Any:
        """What names the raw ``sample`` (a str, an int, a tuple of them), compared across ranks to
        check that every rank reads the same samples; None: a fingerprint of the raw sample is
        (:mod:`lightning_distmm.data.streams.agreement`)."""
        return None

    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)

    def example(self) -> dict[str, Any] | None:
        """The first sample of epoch 0, decoded whole (what the default plan counts FLOPs on)."""
        first = self.first_sample()
        return None if first is None else self.decode(first, self.fields)

    def first_sample(self) -> Any:
        """The first raw sample of epoch 0 (None for an empty stream); the rest is not read."""
        samples = self.samples(0)
        try:
            return next(iter(samples), None)
        finally:
            close = getattr(samples, "close", None)
            if callable(close):
                close()

    _replicas: tuple[int, int, int] | None = None

    def split_replicas(self, rank: int, num_replicas: int, batch_size: int) -> None:
        """Plain iteration under data parallelism (DDP): replica ``rank`` yields its ``batch_size``
        samples of every global batch of ``num_replicas * batch_size`` (the batches one process draws
        with the global batch); an incomplete last global batch is dropped on every replica, so
        each has as many batches."""
        self._replicas = (int(rank), int(num_replicas), int(batch_size)) if num_replicas > 1 else None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch = self._epoch
        self._epoch = epoch + 1
        samples = self.samples(epoch)
        if self._replicas is not None:
            samples = _replica_rows(samples, *self._replicas)
        info = get_worker_info()
        skip = self.__dict__.get("skip_bad_samples") is True  # bad samples marked; the collate replaces them
        for i, sample in enumerate(samples):
            if info is None or i % info.num_workers == info.id:
                yield decode_or_mark(self, sample, self.fields) if skip else self.decode(sample, self.fields)

    def __len__(self) -> int:
        n = self.epoch_length()
        if n is None:
            raise TypeError(f"{type(self).__name__}: the number of samples is not known without reading the stream")
        if self._replicas is not None:
            _, replicas, batch = self._replicas
            return n // (replicas * batch) * batch
        return n


def _replica_rows(samples: Iterator[Any], rank: int, replicas: int, batch: int) -> Iterator[Any]:
    while True:
        block = list(itertools.islice(samples, replicas * batch))
        if len(block) < replicas * batch:
            return
        yield from block[rank * batch : (rank + 1) * batch]


class PlainStream(FieldStream):
    """Any other ``IterableDataset`` of dict samples, seen as a stream: its samples are already
    decoded, so a rank keeps its rows' fields of them (and skipping on resume still builds them)."""

    def __init__(self, dataset: IterableDataset):
        self.dataset = dataset

    def samples(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return skip_samples(one_pass(self.dataset), skip, epoch, type(self.dataset).__name__)

    def decode(self, sample: Any, fields: Iterable[str]) -> dict[str, Any]:
        name = type(self.dataset).__name__
        return select_fields(sample, tuple(fields), name, f"{name} yielded")

    def epoch_length(self) -> int | None:
        try:
            return len(self.dataset)  # type: ignore[arg-type]
        except TypeError:
            return None

    def sample_key(self, sample: Any) -> Any:
        own = getattr(self.dataset, "sample_key", None)
        return own(sample) if callable(own) else None

    @property
    def name(self) -> str:
        return type(self.dataset).__name__


def stream_name(stream: FieldStream) -> str:
    """The dataset a stream reads, as messages name it."""
    inner = getattr(stream, "dataset", None)
    return type(inner if inner is not None else stream).__name__


class _StreamBatches:
    """A stream's epoch cut into global batches of ``batch_size`` (what a BatchSampler is to indices)."""

    def __init__(self, stream: FieldStream, batch_size: int, drop_last: bool):
        self.stream, self.batch_size, self.drop_last = stream, int(batch_size), bool(drop_last)

    def epoch_samples(self) -> int | None:
        n = self.stream.epoch_length()
        if n is None:
            return None
        return (n // self.batch_size) * self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        n = self.stream.epoch_length()
        if n is None:
            raise TypeError(f"{type(self.stream).__name__} does not know its length")
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batches(self, epoch: int, skip: int) -> Iterator[list[Any]]:
        n = self.stream.epoch_length()
        if n is not None and skip > n:
            raise DataPositionError(
                f"the checkpoint was written {skip} samples into epoch {epoch}, but an epoch of"
                f" {type(self.stream).__name__} has {n} samples: the data changed since; resume with the data it"
                f" was written with, or start the fit without ckpt_path"
            )
        left = None if n is None else n - skip  # batched from the position on, as torch's BatchSampler is
        samples = self.stream.samples(epoch, skip)
        try:
            made = 0
            while left is None or made < left:
                want = self.batch_size if left is None else min(self.batch_size, left - made)
                batch = list(itertools.islice(samples, want))
                if not batch or (self.drop_last and len(batch) < self.batch_size):
                    return
                made += len(batch)
                yield batch
        finally:
            close = getattr(samples, "close", None)
            if callable(close):
                close()  # a generator over open shards: closed now, not when it is collected


def one_pass(dataset: Any) -> Iterator[Any]:
    """One iteration of ``dataset``, as a generator: a dataset that is its own iterator (LitData's
    ``StreamingDataset``, whose ``__iter__`` starts the epoch again and returns itself) is iterated
    once, however often the generator is handed to ``iter``."""
    iterator = iter(dataset)
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        yield item


def skip_samples(samples: Iterator[Any], skip: int, epoch: int, name: str, before: int = 0) -> Iterator[Any]:
    """``samples`` from the ``skip``-th on (``before`` samples were skipped already, unread); a stream
    shorter than that is a changed dataset."""
    skipped = sum(1 for _ in itertools.islice(samples, skip))
    if skipped < skip:
        raise DataPositionError(
            f"the checkpoint was written {before + skip} samples into epoch {epoch}, but this epoch of {name} has"
            f" only {before + skipped} samples: the data changed since; resume with the data it was written with,"
            f" or start the fit without ckpt_path"
        )
    yield from samples


class StreamBatchSampler(RankBatchSampler):
    """:class:`RankBatchSampler` over a stream: every rank reads it (nothing is broadcast) and
    yields ``(raw sample, global batch size)`` for its rows of each global batch."""

    def __init__(
        self,
        stream: FieldStream,
        batch_size: int,
        drop_last: bool,
        layout: RankLayout,
        progress: Any = None,
        generators: Sequence[torch.Generator] = (),
        group: Any = None,
        check_every: int = 1,
    ):
        super().__init__(_StreamBatches(stream, batch_size, drop_last), layout, progress, generators, group)
        inner = getattr(stream, "dataset", stream)
        self.agreement: StreamAgreement | None = None
        if not (declared_rank_independent(stream) or declared_rank_independent(inner)):
            self.agreement = StreamAgreement(stream_name(stream), self._key, check_every, group)

    @property
    def stream(self) -> FieldStream:
        return self.batch_sampler.stream

    def _key(self, sample: Any) -> tuple[int, str]:
        own = self.stream.sample_key(sample)
        return key_of(sample) if own is None else explicit_key(own)

    def _epoch_samples(self) -> int | None:
        return self.batch_sampler.epoch_samples()

    def _rows(self, batch: list[Any], rows: Sequence[int], n: int) -> list[Any]:
        if self.stream.__dict__.get("skip_bad_samples") is not True:
            return super()._rows(batch, rows, n)
        # skip mode: a bad row's replacement may be any row of the batch, so the batch goes along (once)
        return [(StreamRow(batch[r], r, batch if i == 0 else None), n) for i, r in enumerate(rows)]

    def _global_batches(self, p: Any) -> Iterator[list[Any]]:
        batches = self.batch_sampler.batches(p.epoch, p.skip)
        if self.agreement is None or not _distributed(self.group):
            return batches
        # every rank read the batch: the ranks compare what they read before anything trains on it
        return self.agreement.batches(batches, p.epoch, p.skip)


class StreamFieldSubset(Dataset):
    """Decodes ``fields`` of a raw sample handed over by :class:`StreamBatchSampler` (in the
    DataLoader's workers when it has some)."""

    def __init__(self, stream: FieldStream, fields: Sequence[str]):
        self.stream = stream
        self.fields = tuple(fields)

    def __getitem__(self, item: tuple[Any, int]) -> tuple[Any, int]:
        sample, n = item
        if isinstance(sample, StreamRow):  # skip mode: the ranks agree on bad rows in the main process
            return (sample.row, decode_or_mark(self.stream, sample.raw, self.fields), sample.batch), n
        return self.stream.decode(sample, self.fields), n


__all__ = [
    "FieldStream",
    "PlainStream",
    "StreamBatchSampler",
    "StreamFieldSubset",
    "one_pass",
    "skip_samples",
    "stream_name",
]
