"""The seeded shuffle the bundled DataModules train with.

One permutation per epoch from a fixed seed, the same under every strategy: a single process and a
distmm run (which iterates the whole dataset on every rank) draw the same batches, and DDP takes its
usual share of them. The seed is the module's own or else ``PL_GLOBAL_SEED`` (``seed_everything``),
the seed distmm also uses for an unseeded shuffle.
"""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler


def seeded_shuffle(dataset: Dataset, trainer: Any | None, seed: int | None = None) -> DistributedSampler:
    """A shuffling ``DistributedSampler`` over ``dataset``, sharded as ``trainer``'s strategy asks
    (``distributed_sampler_kwargs``; one replica without a trainer) and resumable by epoch."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)
    kwargs: dict[str, Any] = {"num_replicas": 1, "rank": 0}
    if trainer is not None:
        kwargs.update(getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {})
    return DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=False, **kwargs)


def train_loader(
    dataset: Dataset,
    batch_size: int,
    trainer: Any | None,
    shuffle: bool,
    num_workers: int,
    seed: int | None = None,
    **loader: Any,
) -> DataLoader:
    """The training loader of the bundled map-style DataModules: whole global batches (a last partial
    one dropped) in the seeded shuffle's order when ``shuffle``, workers kept across epochs;
    ``loader``: further ``DataLoader`` arguments (``pin_memory``)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=seeded_shuffle(dataset, trainer, seed) if shuffle else None,
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        **loader,
    )


__all__ = ["seeded_shuffle", "train_loader"]
