"""The global batches of every epoch, drawn once and shared: rank 0 iterates the user's batch
sampler and broadcasts the index lists; each rank keeps its rows (see :mod:`lightning_distmm.data.loader.loading`).

:class:`RankBatchSampler` is the loader's position too: ``(epoch, samples of that epoch trained)``
plus the RNG states the epoch's order was drawn from, so a resumed run redraws the same order and
skips what was trained, at any batch size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, Sampler

from lightning_distmm.core.layout import RankLayout

#: rank 0 sends the batches of an epoch in chunks of about this many sample indices
CHUNK_SAMPLES = 1 << 16


class DataPositionError(ValueError):
    """A saved data position that this DataLoader cannot continue from at the next unseen sample."""


@dataclass
class _Pass:
    """One iteration of the batch sampler: which epoch's order, from which sample, how far it got."""

    epoch: int
    skip: int  # samples of the epoch trained before this pass (a resumed pass)
    base_progress: int  # the trainer's count of trained batches when the pass started
    rng: dict[str, Any] | None  # the RNG states its order was drawn from (drawing rank only)
    resumed: bool  # the first pass after ``load_state_dict``
    bound: bool  # its epoch was named by ``set_epoch`` before it started
    ends: list[int] = field(default_factory=list)  # samples of the epoch done after each batch yielded
    exhausted: bool = False


class _SetEpoch:
    """What Lightning finds at ``batch_sampler.sampler``: it calls ``set_epoch`` on it every epoch."""

    def __init__(self, owner: RankBatchSampler):
        self.owner = owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)


class RankBatchSampler(Sampler[list[tuple[int, int]]]):
    """Yields ``(index, global_batch_size)`` for this rank's rows of each global batch.

    Rank 0 iterates ``batch_sampler`` (the user's) and broadcasts the index lists; with one process
    (or no process group) it is iterated locally. ``progress`` returns how many batches of the
    current epoch the trainer has trained on; it tells the saved position apart from batches only
    prefetched.
    """

    def __init__(
        self,
        batch_sampler: Any,
        layout: RankLayout,
        progress: Callable[[], int] | None = None,
        generators: Sequence[torch.Generator] = (),
        group: Any = None,
    ):
        self.batch_sampler = batch_sampler
        self.layout = layout
        self.progress = progress
        self.group = group
        self._generators = _unique_generators([*generators, *_sampler_generators(batch_sampler)])
        self._epoch = 0  # the epoch of the next pass
        self._skip = 0  # samples the next pass skips
        self._offset = 0  # loader epoch - Lightning's epoch
        self._pending: dict[str, Any] | None = None  # a loaded position that no pass has used yet
        self._next_bound = False  # set_epoch named the next pass's epoch
        self._pass: _Pass | None = None
        self._iter_rng: dict[str, Any] | None = None
        #: ``indices -> RowAssignment`` when each step's rows are assigned by their cost
        #: (:class:`~lightning_distmm.data.loader.step_balance.CostBalancer`); None: the plan's split
        self.balancer: Callable[[Sequence[int]], Any] | None = None

    @property
    def sampler(self) -> _SetEpoch:
        # Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``: it reaches the loader
        return _SetEpoch(self)

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return bool(getattr(self.batch_sampler, "drop_last", False))

    def __len__(self) -> int:
        return len(self.batch_sampler)

    # ------------------------------------------------------------------ position
    def set_epoch(self, epoch: int) -> None:
        """The trainer starts its epoch ``epoch``: settle which of the data's epochs that is.

        Lightning draws the first batch of a fit while setting up, before it names the epoch; that
        pass is bound here. Otherwise the next pass continues a resumed pass that the trainer cut
        short (the epoch it resumed in was shorter by its own count), or starts the next epoch.
        """
        current = self._pass
        if current is not None and not current.bound:
            self._offset = current.epoch - epoch
            current.bound = True
            return
        self._settle_next(epoch)
        self._next_bound = True

    def _settle_next(self, epoch: int | None) -> None:
        """Where the next pass starts, when the trainer names ``epoch`` (None: not named)."""
        if self._pending is not None:
            if epoch is not None:
                self._offset = self._pending["epoch"] - epoch
            return
        current = self._pass
        if current is None:
            self._epoch = self._epoch if epoch is None else epoch + self._offset
            self._skip = 0
            return
        position, finished = self._position_after(current)
        if current.resumed and not finished:
            # a resumed pass the trainer ended early: its epoch continues where training stopped
            self._epoch, self._skip = position
            if epoch is not None:
                self._offset = self._epoch - epoch
        else:
            self._epoch = current.epoch + 1 if epoch is None else epoch + self._offset
            self._skip = 0

    def _trained(self, p: _Pass) -> int:
        """Batches of pass ``p`` the trainer has trained on (all those yielded without a trainer)."""
        if self.progress is None:
            return len(p.ends)
        return min(max(int(self.progress()) - p.base_progress, 0), len(p.ends))

    def _position_after(self, p: _Pass) -> tuple[tuple[int, int], bool]:
        """``((epoch, samples trained), whether the epoch is done)`` after what was trained of ``p``."""
        trained = self._trained(p)
        done = p.ends[trained - 1] if trained else p.skip
        total = self._epoch_samples()
        if (p.exhausted and trained == len(p.ends)) or (total is not None and trained and done >= total):
            return (p.epoch + 1, 0), True
        return (p.epoch, done), False

    def _epoch_samples(self) -> int | None:
        """Samples of one whole epoch, when the batch sampler says (torch's BatchSampler over a sized
        sampler); a trainer that knows the length stops there without exhausting the iterator."""
        bs = self.batch_sampler
        if type(bs) is not BatchSampler:
            return None
        total = _length(bs.sampler)
        if total is None:
            return None
        return (total // bs.batch_size) * bs.batch_size if bs.drop_last else total

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            return dict(self._pending)
        p = self._pass
        if p is None:
            return {"epoch": self._epoch, "samples": self._skip, "rng": self._snapshot()}
        (epoch, samples), finished = self._position_after(p)
        # an epoch under way is redrawn from the RNG it was drawn from; the next one from today's RNG
        rng = self._snapshot() if finished else p.rng
        return {"epoch": epoch, "samples": samples, "rng": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "batches_done" in state and "samples" not in state:
            raise DataPositionError(
                f"this checkpoint records the data position as {state['batches_done']} batches of an unknown epoch"
                " (written by an older lightning_distmm); the loader now needs (epoch, samples): resume from a"
                " checkpoint written by this version, or start the fit without ckpt_path"
            )
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if epoch < 0 or samples < 0:
            raise DataPositionError(f"invalid data position: epoch {epoch}, sample {samples}")
        self._pending = {"epoch": epoch, "samples": samples, "rng": state.get("rng")}
        self._epoch, self._skip = epoch, samples

    # ------------------------------------------------------------------ RNG of the order
    def _draws(self) -> bool:
        """Whether this rank draws the order (rank 0, or a single process)."""
        return not _distributed(self.group) or dist.get_rank() == _source_rank(self.group)

    def _snapshot(self) -> dict[str, Any] | None:
        if not self._draws():
            return None
        return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in self._generators]}

    def _restore(self, rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"])
        states = rng.get("generators") or []
        if len(states) == len(self._generators):
            for g, s in zip(self._generators, states):
                g.set_state(s)

    def before_iter(self) -> None:
        """Called by the DataLoader's ``__iter__``, before it draws anything.

        The drawing rank notes the RNG states the coming pass will draw from; on resume it first
        puts back the states the saved epoch was drawn from, so the order (and the RNG afterwards,
        for later epochs) is what the uninterrupted run had.
        """
        if not self._draws():
            return
        if self._pending is not None and self._pending.get("rng") is not None:
            self._restore(self._pending["rng"])
        self._iter_rng = self._snapshot()

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        p = self._start_pass()
        for indices in self._global_batches(p):
            n = len(indices)
            p.ends.append((p.ends[-1] if p.ends else p.skip) + n)
            step = self.balancer(indices) if self.balancer is not None else None
            yield self._rows(indices, self.layout.batch(n, step).rows, step if step is not None else n)
        p.exhausted = True

    def _rows(self, batch: list[Any], rows: Sequence[int], n: Any) -> list[Any]:
        """What this rank's DataLoader is handed for its ``rows`` of the global ``batch``: each row's
        index with ``n``, the global batch size or the step's
        :class:`~lightning_distmm.core.assignment.RowAssignment` (one object for the whole batch:
        pickled once to a worker)."""
        return [(batch[r], n) for r in rows]

    def _start_pass(self) -> _Pass:
        if self._iter_rng is None:  # iterated directly, not through DistMMDataLoader.__iter__
            self.before_iter()
        resumed = self._pending is not None
        if resumed:
            self._pending = None
        elif self._pass is not None and not self._next_bound:
            self._settle_next(None)
        rng, self._iter_rng = self._iter_rng, None
        base = int(self.progress()) if self.progress is not None else 0
        p = _Pass(self._epoch, self._skip, base, rng, resumed, bound=self._next_bound)
        self._next_bound = False
        self._pass = p
        return p

    def _global_batches(self, p: _Pass) -> Iterator[list[int]]:
        if not _distributed(self.group):
            yield from self._draw(p)
            return
        source = _source_rank(self.group)
        draws = dist.get_rank() == source
        batches = self._draw(p) if draws else None
        while True:
            message: list[Any] = [None]
            failure: BaseException | None = None
            if draws:
                assert batches is not None
                try:
                    chunk, done = _take_chunk(batches)
                    message[0] = ("batches", chunk, done)
                except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others hang
                    failure = e
                    message[0] = ("error", type(e).__name__, str(e))
            dist.broadcast_object_list(message, src=source, group=self.group)
            kind, *rest = message[0]
            if kind == "error":
                if failure is not None:
                    raise failure
                name, text = rest
                if name == DataPositionError.__name__:
                    raise DataPositionError(text)
                raise RuntimeError(f"rank {source} failed drawing the global batches: {name}: {text}")
            chunk, done = rest
            yield from chunk
            if done:
                return

    def _draw(self, p: _Pass) -> Iterator[list[int]]:
        """The global batches of epoch ``p.epoch`` from sample ``p.skip`` on (drawing rank only)."""
        for obj in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(p.epoch)
        if p.skip == 0:
            # no further than the epoch's length: a training loop that knows the length stops there,
            # and pulling one more batch can draw from the sampler's generator (RandomSampler's tail)
            count = _length(self.batch_sampler)
            batches = iter(self.batch_sampler)
            for indices in itertools.islice(batches, count) if count is not None else batches:
                yield list(indices)
            return
        if type(self.batch_sampler) is BatchSampler:
            yield from self._draw_rebatched(p)
        else:
            yield from self._draw_whole_batches(p)

    def _draw_rebatched(self, p: _Pass) -> Iterator[list[int]]:
        """A torch ``BatchSampler``: skip ``p.skip`` indices of its sampler, batch the rest at today's size."""
        bs = self.batch_sampler
        indices = iter(bs.sampler)
        skipped = sum(1 for _ in itertools.islice(indices, p.skip))
        if skipped < p.skip:
            raise DataPositionError(
                f"the checkpoint was written {p.skip} samples into epoch {p.epoch}, but this DataLoader's epoch has"
                f" only {skipped} samples: the dataset or sampler changed since; resume with the data it was written"
                f" with, or start the fit without ckpt_path"
            )
        total = _length(bs.sampler)
        left = None if total is None else max(total - p.skip, 0)
        count = None if left is None else (left // bs.batch_size if bs.drop_last else -(-left // bs.batch_size))
        made = 0
        while count is None or made < count:
            batch = list(itertools.islice(indices, bs.batch_size))
            if not batch or (bs.drop_last and len(batch) < bs.batch_size):
                return
            made += 1
            yield batch

    def _draw_whole_batches(self, p: _Pass) -> Iterator[list[int]]:
        """Another batch sampler: skip whole batches up to ``p.skip`` samples; refuse if one straddles it."""
        done = 0
        for indices in self.batch_sampler:
            indices = list(indices)
            if done >= p.skip:
                yield indices
                continue
            if done + len(indices) > p.skip:
                raise DataPositionError(
                    f"the checkpoint was written {p.skip} samples into epoch {p.epoch}, but the batches of this"
                    f" DataLoader's {type(self.batch_sampler).__name__} end at samples {done} and"
                    f" {done + len(indices)}: a batch sampler other than torch's BatchSampler can only be resumed"
                    f" at a batch boundary; resume with the batch sampler and batch size the checkpoint was"
                    f" written with"
                )
            done += len(indices)
        if done < p.skip:
            raise DataPositionError(
                f"the checkpoint was written {p.skip} samples into epoch {p.epoch}, but this DataLoader's epoch has"
                f" only {done} samples: the dataset or sampler changed since; resume with the data it was written"
                f" with, or start the fit without ckpt_path"
            )


def _length(obj: Any) -> int | None:
    """``len(obj)``, or None for an object without a length."""
    try:
        return len(obj)
    except TypeError:
        return None


def _take_chunk(batches: Iterator[list[int]]) -> tuple[list[list[int]], bool]:
    """The next batches worth about ``CHUNK_SAMPLES`` indices, and whether the epoch ended."""
    chunk: list[list[int]] = []
    size = 0
    for indices in batches:
        chunk.append(indices)
        size += len(indices)
        if size >= CHUNK_SAMPLES:
            return chunk, False
    return chunk, True


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _source_rank(group: Any) -> int:
    """The global rank that draws the order: the group's first."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _sampler_generators(batch_sampler: Any) -> list[torch.Generator]:
    found = []
    for obj in (batch_sampler, getattr(batch_sampler, "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator):
            found.append(g)
    return found


def _unique_generators(generators: Iterable[torch.Generator]) -> list[torch.Generator]:
    out: list[torch.Generator] = []
    for g in generators:
        if all(g is not h for h in out):
            out.append(g)
    return out
