"""Skip and count samples that cannot be decoded (opt-in: ``PairsDataModule(skip_bad_samples=True)``,
``data.skip_bad_samples=true``), as open_clip's WebDataset pipeline does with ``warn_and_continue``.

The rule, the same on every route: a sample whose fields cannot be decoded
(:class:`~lightning_distmm.data.samples.fields.SampleDecodeError`) is replaced by the next index (cyclically)
whose fields decode, so batches keep their size and a run with bad files trains on the same batches
under every strategy.

- One process (and each DDP replica): :class:`SkipBadSamples` does it in ``__getitem__``, decoding
  every field of each candidate.
- distmm: a rank decodes only its towers' fields, so it alone cannot tell that a sample's image is
  bad when it holds the caption. Each rank marks the rows it failed to decode; per global batch the
  ranks exchange the failing indices (one ``all_gather_object``, only in this mode) and every rank
  moves each row whose index failed anywhere to the next index, until a round fails nowhere
  (:func:`resolve_rows`). Every rank thus holds the samples one process holds.

Each skipped sample is logged (rank 0 under distmm) with the decoder's message and the count so far;
:class:`SkippedSamples` logs the count as ``data/skipped_samples``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch.distributed as dist

from lightning_distmm.data.samples.fields import FieldDataset, SampleDecodeError

log = logging.getLogger(__name__)

#: give up after this many bad samples in a row (a wrong folder, not a few damaged files)
MAX_CONSECUTIVE_BAD = 64


@dataclass
class BadSample:
    """What a rank holds for a row it could not decode: the decoder's message."""

    message: str


class SkipBadSamples(FieldDataset):
    """A :class:`FieldDataset` whose undecodable samples are replaced by the next index that decodes.

    ``load`` still raises (the distmm loader marks and exchanges failures itself); ``__getitem__``
    (one process, DDP) resolves. ``skipped`` counts the bad samples this process met.

    ``eager=True`` (held-out data): every field of every sample is decoded once, at first use, and
    ``load(i, fields)`` reads the resolved sample, so the evaluation callbacks, which load each
    tower's fields on another rank with no exchange, pair the same samples on every rank.
    """

    def __init__(self, dataset: FieldDataset, eager: bool = False):
        self.dataset = dataset
        self.fields = dataset.fields
        self.skipped = 0
        self.eager = bool(eager)
        self._resolved: list[int] | None = None

    def _target(self, index: int) -> int:
        if not self.eager:
            return index
        if self._resolved is None:
            good = [not isinstance(self._try(i, self.fields), BadSample) for i in range(len(self.dataset))]
            self._resolved = [_next_good(good, i) for i in range(len(good))]
        return self._resolved[index]

    def _try(self, index: int, fields: Iterable[str]) -> dict[str, Any] | BadSample:
        try:
            return self.dataset.load(index, fields)
        except SampleDecodeError as err:
            self.note_skipped([str(err)])
            return BadSample(str(err))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # caption(i), the counters, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        return self.dataset.load(self._target(index), fields)

    def next_index(self, index: int) -> int:
        return (index + 1) % len(self.dataset)

    def try_load(self, index: int, fields: Iterable[str]) -> dict[str, Any] | BadSample:
        try:
            return self.load(index, fields)
        except SampleDecodeError as err:
            return BadSample(str(err))

    def note_skipped(self, messages: Sequence[str], announce: bool = True) -> None:
        """Count ``messages``' samples as skipped and log each (``announce``: this process logs)."""
        for message in messages:
            self.skipped += 1
            if announce:
                log.warning("skipped a sample that cannot be decoded (%d so far): %s", self.skipped, message)

    def __getitem__(self, index: int) -> dict[str, Any]:
        j = index
        for _ in range(MAX_CONSECUTIVE_BAD):
            sample = self.try_load(j, self.fields)
            if not isinstance(sample, BadSample):
                return sample
            self.note_skipped([sample.message])
            j = self.next_index(j)
        raise SampleDecodeError(too_many(index))


def _next_good(good: Sequence[bool], index: int) -> int:
    for step in range(min(MAX_CONSECUTIVE_BAD, len(good))):
        j = (index + step) % len(good)
        if good[j]:
            return j
    raise SampleDecodeError(too_many(index))


def too_many(index: int) -> str:
    return (
        f"{MAX_CONSECUTIVE_BAD} samples in a row from index {index} cannot be decoded (skip_bad_samples skips"
        " damaged files, not a wrong path or format): check the data's paths and format"
    )


def agree_bad(bad: dict[int, str], group: Any = None) -> dict[int, str]:
    """The failing indices of every rank in ``group`` (with a message each), the same on every rank."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return dict(bad)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, bad, group=group)
    merged: dict[int, str] = {}
    for part in gathered:
        merged.update(part)
    return merged


def resolve_rows(
    rows: list[tuple[int, Any]], dataset: SkipBadSamples, fields: Sequence[str], group: Any = None
) -> list[Any]:
    """This rank's samples of one global batch with every row that failed on any rank moved to the
    next index that decodes everywhere (collective: every rank of ``group`` calls it per batch)."""
    current = [[index, sample] for index, sample in rows]
    announce = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    for _ in range(MAX_CONSECUTIVE_BAD + 1):
        bad = {int(i): s.message for i, s in current if isinstance(s, BadSample)}
        agreed = agree_bad(bad, group)
        if not agreed:
            return [sample for _, sample in current]
        dataset.note_skipped([agreed[i] for i in sorted(agreed)], announce)
        for row in current:
            if row[0] in agreed:
                row[0] = dataset.next_index(row[0])
                row[1] = dataset.try_load(row[0], fields)
    raise SampleDecodeError(too_many(int(rows[0][0]) if rows else 0))


# ---------------------------------------------------------------------- streams
# A stream has no "next index": its batches are cut from the stream on every rank before anything is
# decoded. The rule there: a bad row of a global batch is replaced by the batch's next row (cyclically)
# whose fields all decode, in one process by :class:`SkipBadRows` (the collate), under distmm by
# :func:`resolve_stream_rows` (each rank holds the batch's raw samples, so it can decode any row).


@dataclass
class StreamRow:
    """A stream row handed to a rank in skip mode: the raw sample, its row in the global batch and,
    with the first row of each batch only, the batch's raw samples (a replacement may be any row)."""

    raw: Any
    row: int
    batch: list[Any] | None


def decode_or_mark(stream: Any, raw: Any, fields: Sequence[str]) -> dict[str, Any] | BadSample:
    try:
        return stream.decode(raw, fields)
    except SampleDecodeError as err:
        return BadSample(str(err))


def note_stream_skipped(stream: Any, messages: Sequence[str], announce: bool = True) -> None:
    """Count and log skipped stream samples on the stream object (``skipped``)."""
    for message in messages:
        stream.skipped = int(getattr(stream, "skipped", 0)) + 1
        if announce:
            log.warning("skipped a sample that cannot be decoded (%d so far): %s", stream.skipped, message)


def _next_good_row(row: int, bad: set[int], n: int) -> int:
    for step in range(1, n):
        candidate = (row + step) % n
        if candidate not in bad:
            return candidate
    raise SampleDecodeError(f"every sample of a global batch of {n} failed to decode: check the data's format")


class SkipBadRows:
    """One process's collate for a skipping stream: each bad row is replaced by the batch's next row
    that decoded, then ``collate`` (default: torch's) runs."""

    def __init__(self, stream: Any, collate: Any = None):
        from torch.utils.data import default_collate

        self.stream, self.collate = stream, collate or default_collate

    def __call__(self, samples: list[Any]) -> Any:
        bad = {i for i, s in enumerate(samples) if isinstance(s, BadSample)}
        if bad:
            note_stream_skipped(self.stream, [samples[i].message for i in sorted(bad)])
            samples = [samples[_next_good_row(i, bad, len(samples))] if i in bad else s for i, s in enumerate(samples)]
        return self.collate(samples)


def resolve_stream_rows(
    rows: list[tuple[int, Any]], batch: list[Any], stream: Any, fields: Sequence[str], group: Any = None
) -> list[Any]:
    """This rank's samples of one global batch of a stream, each row that failed on any rank replaced
    by the batch's next row that decoded everywhere (collective: every rank calls it per batch)."""
    announce = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    current = [[row, sample] for row, sample in rows]
    known: dict[int, str] = {}
    for _ in range(len(batch) + 1):
        mine = {int(src): s.message for src, s in current if isinstance(s, BadSample)}
        agreed = {r: m for r, m in agree_bad(mine, group).items() if r not in known}
        if not agreed:
            return [sample for _, sample in current]
        known.update(agreed)
        note_stream_skipped(stream, [agreed[r] for r in sorted(agreed)], announce)
        for entry in current:
            if entry[0] in known:
                entry[0] = _next_good_row(entry[0], set(known), len(batch))
                entry[1] = decode_or_mark(stream, batch[entry[0]], fields)
    raise SampleDecodeError(f"every sample of a global batch of {len(batch)} failed to decode")


class SkippedSamples(L.Callback):
    """Logs ``data/skipped_samples``: how many samples the training data skipped so far (only when
    its dataset skips, :class:`SkipBadSamples`; with ``num_workers > 0`` the one-process count lives
    in the workers and only their log lines show it)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        dataset = skipping_dataset(trainer)
        if dataset is not None:
            pl_module.log("data/skipped_samples", float(dataset.skipped), on_step=True, on_epoch=False)


def _skips(obj: Any) -> bool:
    return isinstance(obj, SkipBadSamples) or (
        not isinstance(obj, type) and obj.__dict__.get("skip_bad_samples") is True
    )


def skipping_dataset(trainer: L.Trainer) -> Any:
    """The training data that skips (a :class:`SkipBadSamples`, or a stream with ``skip_bad_samples``;
    either counts ``skipped``), found through the DataModule or the train loader (under distmm a
    loader over a per-field view of it), or None."""
    seen = [getattr(getattr(trainer, "datamodule", None), "train_dataset", None), trainer.train_dataloader]
    for _ in range(4):
        for obj in seen:
            if obj is not None and hasattr(obj, "__dict__") and _skips(obj):
                return obj
        seen = [getattr(obj, name, None) for obj in seen for name in ("dataset", "stream") if obj is not None]
    return None


__all__ = [
    "BadSample",
    "SkipBadRows",
    "SkipBadSamples",
    "SkippedSamples",
    "StreamRow",
    "agree_bad",
    "decode_or_mark",
    "resolve_rows",
    "resolve_stream_rows",
]
