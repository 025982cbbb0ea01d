"""Per-rank data loading: every rank walks the same global batches, and loads only its part.

The user's DataLoader yields *global* batches (its ``batch_size`` is the number of samples one
contrastive loss sees). Its batch sampler, whatever it is, decides the sample indices of each
global batch; every rank runs an identical copy of it (Lightning makes shuffling reproducible
from the seed, see ``DistMMStrategy.distributed_sampler_kwargs``), so every tower sees the same
samples in the same order. This module then keeps, per global batch, only the rows this rank's
towers compute on, and asks the dataset for only their fields.

The loader is stateful: Lightning saves its position in the epoch with a checkpoint, and on
resume the sampler is advanced past the batches already trained on (indices only, nothing is
loaded), so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_distmm.core.layout import GLOBAL_BATCH_KEY, RankLayout
from lightning_distmm.data.fields import load_fields


class RankBatchSampler(Sampler[list[tuple[int, int]]]):
    """Wraps a global batch sampler; yields ``(index, global_batch_size)`` for this rank's rows."""

    def __init__(self, batch_sampler: Any, layout: RankLayout):
        self.batch_sampler = batch_sampler
        self.layout = layout
        self.skip = 0

    @property
    def sampler(self) -> Any:
        # Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``: pass it through
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        skip, self.skip = self.skip, 0
        for i, indices in enumerate(self.batch_sampler):
            if i < skip:
                continue
            indices = list(indices)
            n = len(indices)
            rows = self.layout.batch(n).rows
            yield [(indices[r], n) for r in rows]


class FieldSubsetDataset(Dataset):
    """Loads only ``fields`` of each requested sample; carries the global batch size along."""

    def __init__(self, dataset: Any, fields: Sequence[str]):
        self.dataset = dataset
        self.fields = tuple(fields)

    def __getitem__(self, item: tuple[int, int]) -> tuple[Any, int]:
        index, n = item
        return load_fields(self.dataset, index, self.fields), n

    def __len__(self) -> int:
        return len(self.dataset)


class _CollateWithGlobalBatch:
    def __init__(self, collate_fn: Callable[[list[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, items: list[tuple[Any, int]]) -> Any:
        batch = self.collate_fn([sample for sample, _ in items])
        if not isinstance(batch, dict):
            raise TypeError(
                f"distmm needs batches that are dicts keyed by field name, the collate_fn gave {type(batch).__name__}"
            )
        batch[GLOBAL_BATCH_KEY] = torch.tensor(items[0][1])
        return batch


class DistMMDataLoader(DataLoader):
    """A DataLoader over this rank's rows and fields of the user's global batches.

    ``progress`` returns how many batches of the current epoch have been trained on; it is what
    the state dict records for an exact mid-epoch resume.
    """

    def __init__(self, source: DataLoader, layout: RankLayout, progress: Callable[[], int] | None = None):
        if source.batch_sampler is None:
            raise ValueError(
                "distmm needs a DataLoader with a batch_size (the global batch); batch_size=None is not supported"
            )
        if isinstance(source.dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                "distmm's per-tower loading needs a map-style dataset; IterableDataset is not supported yet"
            )
        self.source = source
        self.layout = layout
        self.progress = progress
        kwargs: dict[str, Any] = dict(
            batch_sampler=RankBatchSampler(source.batch_sampler, layout),
            num_workers=source.num_workers,
            collate_fn=_CollateWithGlobalBatch(source.collate_fn),
            pin_memory=source.pin_memory,
            timeout=source.timeout,
            worker_init_fn=source.worker_init_fn,
            multiprocessing_context=source.multiprocessing_context,
            generator=source.generator,
            persistent_workers=source.persistent_workers,
        )
        if source.num_workers > 0:
            kwargs["prefetch_factor"] = source.prefetch_factor
        super().__init__(FieldSubsetDataset(source.dataset, layout.fields), **kwargs)

    def state_dict(self) -> dict[str, int]:
        done = self.progress() if self.progress is not None else 0
        return {"batches_done": int(done) % max(len(self.batch_sampler), 1)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batch_sampler.skip = int(state.get("batches_done", 0))  # type: ignore[union-attr]
