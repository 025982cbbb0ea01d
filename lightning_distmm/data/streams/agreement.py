"""Every rank reads the same samples: checked while training, for every stream.

Under distmm every rank reads an iterable dataset itself and keeps its rows of each global batch
(:mod:`lightning_distmm.data.streams.streaming`). That is right only if every rank reads the *same* samples
in the same order. A stream whose order depends on the process (its rank or world size, as LitData's
shuffle, Hugging Face's ``split_dataset_by_node`` or a dataset reading ``torch.distributed.get_rank()``
do) gives the image rank other samples than the text rank: every image is trained against another
sample's caption, the loss still falls, and nothing fails. So the ranks compare what they read.

Each rank derives a key per sample of a global batch (every rank reads every sample of it): the
dataset's own (:meth:`FieldStream.sample_key`, a ``sample_key`` method, a ``__key__`` or
``__index__`` field), or else a fingerprint of the sample's fields (small ones whole, large arrays
by a few hundred evenly spaced elements). The keys of a batch fold into one 64-bit digest, and the
ranks all-gather ``(status, batches, digest)``, three integers, every ``every`` batches (and always
on an epoch's first batch, and at its end, so a stream that ends early on one rank is caught too).
The first batch is compared before anything trains on it; the later comparisons are asynchronous,
settled at the next one, so they add no meeting of the ranks to a step.
When the digests differ, the ranks exchange the keys of the unchecked batches (only then) and all
stop with the same message: the dataset, the epoch and global batch, the first row that differs and
what each rank read there. A stream whose samples cannot be told apart (no field to fingerprint, or
every sample of a batch the same) is refused with the fix, unless it was declared rank-independent
with :func:`rank_independent`, which also skips the check.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: fields that name a sample (webdataset's and torchdata's conventions); read as the key when present
KEY_FIELDS = ("__key__", "__index__")
#: an array or buffer larger than this many elements is fingerprinted by this many evenly spaced ones
SPREAD = 256
#: the attribute :func:`rank_independent` sets on a dataset
DECLARED = "__distmm_rank_independent__"

_STATUS_BATCHES, _STATUS_ENDED, _STATUS_UNKNOWN = 1, 0, 2


class StreamMismatchError(RuntimeError):
    """The ranks read different samples of a stream (raised on every rank, with the same message)."""


class UnidentifiableSampleError(TypeError):
    """A sample with nothing to tell it from another one by, so the ranks cannot compare what they read."""


def rank_independent(dataset: Any) -> Any:
    """Declare that ``dataset`` gives every process the same samples in the same order; returns it.

    distmm then skips its check that the ranks read the same samples (for a stream whose samples
    cannot be told apart, or to save the check's cost). A wrong declaration trains each tower on
    other samples than the others, silently: declare only what you know.
    """
    setattr(dataset, DECLARED, True)
    return dataset


def declared_rank_independent(dataset: Any) -> bool:
    return bool(getattr(dataset, DECLARED, False))


# ---------------------------------------------------------------------- keys
def key_of(sample: Any) -> tuple[int, str]:
    """A sample's 64-bit key and how it reads in a message.

    A ``__key__`` / ``__index__`` field is the key; otherwise every field is fingerprinted.

    Raises:
        UnidentifiableSampleError: nothing in the sample can be fingerprinted.
    """
    if isinstance(sample, Mapping):
        named = [(f, sample[f]) for f in KEY_FIELDS if f in sample]
        if named and all(_plain_scalar(v) for _, v in named):
            text = ", ".join(f"{f}={v!r}" for f, v in named)
            return _hash_text(text), text
    h = hashlib.blake2b(digest_size=8)
    if not _feed(h, sample):
        raise UnidentifiableSampleError(
            f"a sample of type {type(sample).__name__} has no field distmm can fingerprint ({_describe(sample)})"
        )
    value = int.from_bytes(h.digest(), "little", signed=True)
    return value, f"fingerprint {value & (2**64 - 1):016x}"


def explicit_key(key: Any) -> tuple[int, str]:
    """A key a dataset gave (:meth:`FieldStream.sample_key`): hashed, and shown as it is."""
    text = repr(key)
    return _hash_text(text), f"key {text}"


def _plain_scalar(value: Any) -> bool:
    return isinstance(value, str | bytes | int | float) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _hash_text(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _feed(h: Any, value: Any) -> bool:
    """Feed a fingerprint of ``value`` to ``h``; whether anything in it could be fingerprinted."""
    if isinstance(value, torch.Tensor):
        try:
            array = value.numpy()  # no copy; refused on an accelerator, with a gradient, or for bfloat16
        except (TypeError, RuntimeError):
            array = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        _feed_array(h, array)
        return True
    if isinstance(value, str):
        h.update(value.encode())
        return True
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value) if not isinstance(value, bytes) else value
        h.update(struct.pack("<q", len(data)))
        h.update(data if len(data) <= 4 * SPREAD else data[:: len(data) // (4 * SPREAD)])
        return True
    if isinstance(value, bool | int | float | complex) or value is None:
        h.update(repr(value).encode())
        return True
    if isinstance(value, Mapping):
        found = False
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            found = _feed(h, value[k]) or found
        return found
    if isinstance(value, list | tuple):
        found = False
        for item in value:
            found = _feed(h, item) or found
        return found
    array = _as_array(value)
    if array is not None:
        _feed_array(h, array)
        return True
    return False


def _feed_array(h: Any, array: Any) -> None:
    """A numpy array's element count, dtype and at most about ``SPREAD`` evenly spaced elements."""
    flat = array.reshape(-1)
    n = flat.shape[0]
    if n > SPREAD:
        flat = flat[:: n // SPREAD]
    h.update(struct.pack("<q", n))
    h.update(flat.dtype.str.encode())
    h.update(flat.tobytes())


def _as_array(value: Any) -> Any:
    """A numpy array, a numpy scalar or a PIL image as a numpy array of numbers; None for anything else."""
    if not (hasattr(value, "__array_interface__") or hasattr(value, "__array__")):
        return None
    try:
        import numpy as np

        array = np.asarray(value)
    except (TypeError, ValueError):
        return None
    return array if array.dtype.kind in "biufc" else None


def _describe(sample: Any) -> str:
    if isinstance(sample, Mapping):
        return "fields " + ", ".join(f"{k}: {type(v).__name__}" for k, v in sample.items())
    return repr(sample)[:80]


# ---------------------------------------------------------------------- the check
class StreamAgreement:
    """Checks that every rank of ``group`` reads the same global batches of one stream.

    Args:
        name: the dataset, as messages name it.
        key: a sample's ``(64-bit key, text)`` (:func:`key_of`, or the stream's own).
        every: compare every this many global batches (and on an epoch's first and at its end).
        group: the process group (default: the default group); all its ranks read the stream.
    """

    def __init__(self, name: str, key: Callable[[Any], tuple[int, str]], every: int = 1, group: Any = None):
        if int(every) < 1:
            raise ValueError(f"the stream check runs every N >= 1 global batches, got every={every}")
        self.name, self.key, self.every, self.group = name, key, int(every), group

    def batches(self, batches: Iterator[list[Any]], epoch: int, skip: int) -> Iterator[list[Any]]:
        """``batches`` (one epoch's global batches from sample ``skip`` on), checked as they pass.

        The first batch is compared before it is yielded: a stream whose order depends on the rank
        stops before anything trains on it. Later comparisons are posted (an asynchronous
        all-gather) when a batch is read and settled when the next comparison is due, so the ranks
        do not meet an extra time per step; a difference that appears later stops the run one
        comparison after it was read. The end of the epoch is compared when the stream ends.
        Whether to settle is decided from the batch count alone, the same on every rank, so every
        rank posts and settles the same collectives in the same order.
        """
        pending: list[tuple[int, int, list[tuple[int, str]] | str]] = []  # (batch number, first sample, keys)
        posted: _Posted | None = None
        done, number = skip, 0
        for batch in batches:
            number += 1
            pending.append((number, done, self._keys(batch)))
            done += len(batch)
            if number == 1 or number % self.every == 0:
                if posted is not None:
                    self._settle(posted, epoch)
                posted = self._post(pending, ended=False)
                pending = []
                if number == 1:
                    self._settle(posted, epoch)
                    posted = None
            yield batch
        if posted is not None:
            self._settle(posted, epoch)
        self._settle(self._post(pending, ended=True), epoch)

    def _keys(self, batch: list[Any]) -> list[tuple[int, str]] | str:
        """The batch's keys, or why its samples cannot be told apart."""
        try:
            keys = [self.key(s) for s in batch]
        except UnidentifiableSampleError as e:
            return str(e)
        if len(batch) > 1 and len({k for k, _ in keys}) == 1:
            return f"all {len(batch)} samples of the batch have the same {keys[0][1]}"
        return keys

    def _post(self, pending: list[tuple[int, int, Any]], ended: bool) -> _Posted:
        """Start the all-gather of ``(status, batches, digest)`` of the batches since the last one."""
        unknown = any(isinstance(keys, str) for _, _, keys in pending)
        status = _STATUS_UNKNOWN if unknown else (_STATUS_ENDED if ended else _STATUS_BATCHES)
        digest = hashlib.blake2b(digest_size=8)
        for number, _, keys in pending:
            digest.update(struct.pack("<q", number))
            if not isinstance(keys, str):
                digest.update(struct.pack(f"<{len(keys)}q", *(k for k, _ in keys)))
        mine = torch.tensor(
            [status, len(pending), int.from_bytes(digest.digest(), "little", signed=True)], dtype=torch.int64
        )
        device = _device(self.group)
        mine = mine.to(device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        work = dist.all_gather(out, mine, group=self.group, async_op=True)
        return _Posted(work, mine, out, status, pending)

    def _settle(self, posted: _Posted, epoch: int) -> None:
        """Wait for a posted comparison; on a difference, exchange the keys and raise on every rank."""
        posted.work.wait()
        gathered = [t.cpu() for t in posted.out]
        if all(torch.equal(g, gathered[0]) for g in gathered) and posted.status != _STATUS_UNKNOWN:
            return
        everyone: list[Any] = [None] * len(gathered)
        dist.all_gather_object(everyone, (posted.status, posted.pending), group=self.group)  # only when wrong
        raise self._error(everyone, epoch)

    def _error(self, everyone: list[tuple[int, list[tuple[int, int, Any]]]], epoch: int) -> Exception:
        ranks = [_global_rank(i, self.group) for i in range(len(everyone))]
        for rank, (status, pending) in zip(ranks, everyone):
            if status == _STATUS_UNKNOWN:
                number, _, reason = next(p for p in pending if isinstance(p[2], str))
                return UnidentifiableSampleError(
                    f"distmm cannot check that every rank reads the same samples of {self.name}: {reason}"
                    f" (rank {rank}, epoch {epoch}, global batch {number}). Under distmm every rank reads the"
                    f" stream and keeps its rows, so a stream whose order depends on the rank pairs each tower"
                    f" with other samples, silently. Give the samples a '__key__' (or '__index__') field, or the"
                    f" dataset a sample_key(sample) method, that names each sample; or, if its order follows from"
                    f" the epoch and a seed alone, declare it: lightning_distmm.data.rank_independent(dataset)"
                )
        tables = [{number: (first, keys) for number, first, keys in pending} for _, pending in everyone]
        ends = [status == _STATUS_ENDED for status, _ in everyone]
        for number in sorted(set().union(*tables)):
            rows = [t.get(number) for t in tables]
            if any(r is None for r in rows):
                missing = [rank for rank, r in zip(ranks, rows) if r is None]
                had = [rank for rank, r in zip(ranks, rows) if r is not None]
                return StreamMismatchError(
                    f"the ranks read different samples of {self.name}: in epoch {epoch} the stream ended before"
                    f" global batch {number} on rank(s) {missing} but not on rank(s) {had}; {_CAUSE}"
                )
            first = rows[0][0]
            keys = [r[1] for r in rows]
            width = max(len(k) for k in keys)
            for row in range(width):
                seen = [k[row] if row < len(k) else None for k in keys]
                if any(s is None or s[0] != seen[0][0] for s in seen):  # type: ignore[index]
                    read = "; ".join(
                        f"rank {rank} read {s[1] if s is not None else 'nothing'}" for rank, s in zip(ranks, seen)
                    )
                    return StreamMismatchError(
                        f"the ranks read different samples of {self.name}: epoch {epoch}, global batch {number}"
                        f" read (samples {first} to {first + width - 1} of the epoch), row {row} differs first:"
                        f" {read}. {_CAUSE}"
                    )
        if any(ends) and not all(ends):
            return StreamMismatchError(
                f"the ranks read different samples of {self.name}: in epoch {epoch} the stream ended on rank(s)"
                f" {[r for r, e in zip(ranks, ends) if e]} and went on on rank(s)"
                f" {[r for r, e in zip(ranks, ends) if not e]}; {_CAUSE}"
            )
        return StreamMismatchError(f"the ranks read different samples of {self.name} in epoch {epoch}; {_CAUSE}")


_CAUSE = (
    "Under distmm every rank reads the stream itself and keeps its rows of each global batch, so the stream must"
    " give every process the same samples in the same order: its order follows from the epoch and a seed alone,"
    " never from the rank, the world size or the process (torch.distributed.get_rank(), Hugging Face's"
    " split_dataset_by_node, a generator seeded per process, LitData's or webdataset's own splitting). Give the"
    " whole stream to the DataLoader and let distmm cut it: each rank loads only its rows"
)


@dataclass
class _Posted:
    """An all-gather in flight: its work, its tensors (kept alive until it ends) and what it compares."""

    work: Any
    mine: torch.Tensor
    out: list[torch.Tensor]
    status: int
    pending: list[tuple[int, int, Any]]


def _device(group: Any) -> torch.device:
    """Where the group gathers: the CPU under gloo, this rank's GPU under NCCL (CUDA tensors only)."""
    if "gloo" not in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_rank(i: int, group: Any) -> int:
    return i if group is None else dist.get_global_rank(group, i)


__all__ = [
    "StreamAgreement",
    "StreamMismatchError",
    "UnidentifiableSampleError",
    "declared_rank_independent",
    "explicit_key",
    "key_of",
    "rank_independent",
]
