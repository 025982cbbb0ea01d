"""Per-rank data loading: every rank walks the same global batches, and loads only its part.

The user's DataLoader yields *global* batches (its ``batch_size`` is the number of samples one
contrastive loss sees). Its batch sampler decides the sample indices of each global batch, in the
order it would give one process: rank 0 iterates it and broadcasts the index lists to every rank
(in chunks, over the default process group), so a sampler drawing from the global RNG, a seeded
generator, a ``DistributedSampler`` or a custom batch sampler all give every rank, and a
single-process run with the same seed, the same batches. This module then keeps, per global batch,
only the rows this rank's towers compute on, and asks the dataset for only their fields. An
``IterableDataset`` has no index to draw: every rank reads the stream itself and cuts the same
global batches, and decodes only its rows' fields (:mod:`lightning_distmm.data.streams.streaming`).

The loader is stateful. Its position is ``(epoch, samples of that epoch already trained)``, a count
of samples rather than of batches, so a run resumed with another batch size continues at the next
unseen sample. With the position, the checkpoint keeps the RNG states the epoch's order was drawn
from (rank 0's global torch RNG and the sampler's generators, taken when the DataLoader's iterator
was created), so a resumed run draws the same order again and skips what was trained (indices only,
nothing is loaded). The epoch is the loader's own: Lightning's epoch counter reads one more when a
run stopped by ``max_steps`` mid-epoch is resumed, and the loader binds its epoch to Lightning's
with an offset instead of trusting it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_distmm.core.assignment import RowAssignment
from lightning_distmm.core.layout import ASSIGNMENT_KEY, GLOBAL_BATCH_KEY, SAMPLES_KEY, RankLayout
from lightning_distmm.core.plan import Plan
from lightning_distmm.data.loader.checks import check_dataloader, prebatched_message
from lightning_distmm.data.loader.step_balance import CostBalancer, CostSpec
from lightning_distmm.data.samples.fields import load_fields
from lightning_distmm.data.samples.sampling import RankBatchSampler
from lightning_distmm.data.samples.skipping import SkipBadSamples, resolve_rows, resolve_stream_rows
from lightning_distmm.data.streams.stream_sources import as_stream
from lightning_distmm.data.streams.streaming import StreamBatchSampler, StreamFieldSubset


class FieldSubsetDataset(Dataset):
    """Loads only ``fields`` of each requested sample; carries the global batch size and the sample's
    index along. Over a :class:`SkipBadSamples` it hands on ``(index, sample or BadSample)``: the
    ranks agree on the bad rows in the main process
    (:func:`~lightning_distmm.data.samples.skipping.resolve_rows`)."""

    def __init__(self, dataset: Any, fields: Sequence[str]):
        self.dataset = dataset
        self.fields = tuple(fields)

    def __getitem__(self, item: tuple[int, int]) -> tuple[Any, ...]:
        index, n = item
        if isinstance(self.dataset, SkipBadSamples):
            return (index, self.dataset.try_load(index, self.fields)), n
        return load_fields(self.dataset, index, self.fields), n, index

    def __len__(self) -> int:
        return len(self.dataset)


class _Pending:
    """A batch whose rows may hold :class:`~lightning_distmm.data.samples.skipping.BadSample`: collated in the
    main process once the ranks agree on them. ``rows``: ``(index or row, sample)``; ``batch``: a
    stream's raw global batch (replacements are decoded from it)."""

    def __init__(self, rows: list[tuple[int, Any]], n: int | RowAssignment, batch: list[Any] | None = None):
        self.rows, self.n, self.batch = rows, n, batch


class _CollateWithGlobalBatch:
    def __init__(self, collate_fn: Callable[[list[Any]], Any], pending: bool = False):
        self.collate_fn = collate_fn
        self.pending = pending

    def __call__(self, items: list[tuple[Any, int]]) -> Any:
        if self.pending:
            batch = next((row[2] for row, _ in items if len(row) > 2 and row[2] is not None), None)
            return _Pending([(row[0], row[1]) for row, _ in items], items[0][1], batch)
        indices = [item[2] for item in items] if len(items[0]) > 2 else None
        return self.collate([item[0] for item in items], items[0][1], indices)

    def collate(self, samples: list[Any], step: int | RowAssignment, indices: Sequence[int] | None = None) -> Any:
        """The user's collate over ``samples``, with the global batch size, the step's assignment
        and (``indices``: the dataset index of each sample) the samples' indices added."""
        batch = self.collate_fn(samples)
        if not isinstance(batch, dict):
            raise TypeError(
                f"distmm needs batches that are dicts keyed by field name, the collate_fn gave {type(batch).__name__}"
            )
        # a Python number, not a tensor: Lightning moves tensors to the device, and reading one back
        # (the executor and the log's batch size, every step) would wait for the device each time
        if isinstance(step, RowAssignment):
            batch[GLOBAL_BATCH_KEY] = step.n
            batch[ASSIGNMENT_KEY] = step
        else:
            batch[GLOBAL_BATCH_KEY] = int(step)
        if indices is not None:
            batch[SAMPLES_KEY] = tuple(int(i) for i in indices)
        return batch


class DistMMDataLoader(DataLoader):
    """A DataLoader over this rank's rows and fields of the user's global batches.

    Args:
        source: the user's DataLoader; its batch sampler (sampler, shuffling, generator) is used as is; over an
            ``IterableDataset`` its batch size and ``drop_last`` cut the stream every rank reads.
        layout: which rows and fields this rank loads.
        progress: how many batches of the current epoch the trainer has trained on (Lightning's
            ``fit_loop.epoch_loop.batch_progress.current.processed``); the saved position counts
            those, not the batches already prefetched.
        group: the process group over which rank 0 sends the batches (default: the default group).
        check_every: over a stream, the ranks check that they read the same samples every this many
            global batches (and on each epoch's first and at its end; :mod:`~lightning_distmm.data.streams.agreement`).
    """

    def __init__(
        self,
        source: DataLoader,
        layout: RankLayout,
        progress: Callable[[], int] | None = None,
        group: Any = None,
        check_every: int = 1,
    ):
        if source.batch_sampler is None:
            raise ValueError(prebatched_message(source.dataset))
        self.source = source
        self.layout = layout
        generators = [source.generator] if source.generator is not None else []
        dataset: Dataset
        stream = None
        if isinstance(source.dataset, IterableDataset):
            # a stream: every rank reads it and cuts the same global batches (data/streams/streaming.py)
            stream = as_stream(source.dataset)
            bs = source.batch_sampler
            sampler: RankBatchSampler = StreamBatchSampler(
                stream, bs.batch_size, bs.drop_last, layout, progress, generators, group, check_every
            )
            dataset = StreamFieldSubset(stream, layout.fields)
        else:
            sampler = RankBatchSampler(source.batch_sampler, layout, progress, generators, group)
            dataset = FieldSubsetDataset(source.dataset, layout.fields)
        self.stream = stream
        self.skipping = isinstance(source.dataset, SkipBadSamples) or (
            self.stream is not None and self.stream.__dict__.get("skip_bad_samples") is True
        )
        self.group = group
        kwargs: dict[str, Any] = dict(
            batch_sampler=sampler,
            num_workers=source.num_workers,
            collate_fn=_CollateWithGlobalBatch(source.collate_fn, pending=self.skipping),
            pin_memory=source.pin_memory,
            timeout=source.timeout,
            worker_init_fn=source.worker_init_fn,
            multiprocessing_context=source.multiprocessing_context,
            generator=source.generator,
            persistent_workers=source.persistent_workers,
        )
        if source.num_workers > 0:
            kwargs["prefetch_factor"] = source.prefetch_factor
        super().__init__(dataset, **kwargs)

    @property
    def rank_sampler(self) -> RankBatchSampler:
        assert isinstance(self.batch_sampler, RankBatchSampler)
        return self.batch_sampler

    def __iter__(self) -> Any:
        self.rank_sampler.before_iter()
        if self.skipping:
            return self._resolved(super().__iter__())
        return super().__iter__()

    def _resolved(self, batches: Any) -> Any:
        """Skip mode: the ranks agree on the rows none of them may train on, then collate."""
        collate = self.collate_fn
        assert isinstance(collate, _CollateWithGlobalBatch)
        for pending in batches:
            if self.stream is not None:
                assert pending.batch is not None
                samples = resolve_stream_rows(pending.rows, pending.batch, self.stream, self.layout.fields, self.group)
            else:
                samples = resolve_rows(pending.rows, self.source.dataset, self.layout.fields, self.group)
            yield collate.collate(samples, pending.n)

    def state_dict(self) -> dict[str, Any]:
        """The data position: ``{"epoch", "samples"}`` trained, and the RNG states of the epoch's order."""
        return self.rank_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rank_sampler.load_state_dict(state)


class RankLoaders:
    """Makes this rank's loader of each DataLoader the Trainer hands the strategy
    (``Strategy.process_dataloader``), saying once what it notices about their batches.

    Args:
        progress: samples of the epoch already trained (read when a loader's iterator starts).
        check_every: over an iterable dataset, the ranks compare what they read every this many
            global batches (:mod:`lightning_distmm.data.streams.agreement`).
        note: where a line for the user goes (rank 0's log).
    """

    def __init__(self, progress: Callable[[], int], check_every: int, note: Callable[[str], None]) -> None:
        if int(check_every) < 1:
            raise ValueError(
                f"stream_check_every={check_every}: the ranks compare what they read every N >= 1 global"
                f" batches; to skip the check for a dataset, declare it with lightning_distmm.data.rank_independent"
            )
        self.progress, self.check_every, self._note = progress, int(check_every), note
        self._noted: set[str] = set()

    def wrap(
        self,
        dataloader: DataLoader,
        plan: Plan,
        layout: RankLayout,
        fields: Mapping[str, Sequence[str]],
        costs: Mapping[str, CostSpec] | None = None,
    ) -> DistMMDataLoader:
        """The rank's loader over the user's ``dataloader`` for ``plan``.

        Every rank checks every tower's fields, so a bad dataset fails everywhere at once, before
        training; a batch size the plan's global batch does not match is refused, and one it splits
        differently from the plan's replica batches is stated (once). ``costs``: what a row of each
        tower costs (``Tower(cost=...)``); each step's rows then go to the replicas by their cost
        (:mod:`~lightning_distmm.data.loader.step_balance`).
        """
        check_dataloader(dataloader, fields, {name: t.dp for name, t in plan.towers.items()}, plan.sync_groups)
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
        if batch_size is not None:
            plan.check_global_batch(batch_size)
            said = plan.batch_note(batch_size)
            if said is not None and said not in self._noted:
                self._noted.add(said)
                self._note(said)
        loader = DistMMDataLoader(dataloader, layout, progress=self.progress, check_every=self.check_every)
        if costs:
            if loader.stream is not None:
                self._say_once(
                    "the rows of a stream are split by count, not by the towers' cost (balancing reads every"
                    " row's cost fields before loading, which a map-style dataset allows)"
                )
            else:
                dataset = dataloader.dataset
                loader.rank_sampler.balancer = CostBalancer(
                    plan, costs, lambda index, f: load_fields(dataset, index, f), type(dataset).__name__
                )
                towers = ", ".join(f"{t} by {c!r}" for t, c in costs.items())
                self._say_once(f"each step's rows go to the replicas by their cost: {towers}")
        return loader

    def _say_once(self, line: str) -> None:
        if line not in self._noted:
            self._noted.add(line)
            self._note(line)
