"""LitData's ``StreamingDataset`` under distmm: every rank reads the order one process reads.

LitData (``pip install litdata``; Lightning AI's streaming format written by ``litdata.optimize``)
assigns its chunks to ranks and DataLoader workers: ``StreamingDataset`` reads the process's rank
and world size when it is built (``torch.distributed``, or the ``WORLD_SIZE`` / ``GLOBAL_RANK``
environment) and, with ``shuffle=True``, each rank reads its own share of the chunks in its own
order. Under distmm every rank must read the whole stream in the same order and keep its rows of
each global batch; left alone, LitData gave the image rank and the text rank different samples.

:class:`LitDataStream` reads the dataset as a single process with ``num_workers=0`` reads it
(``StreamingDataLoader(ds, batch_size=B)`` in one process): before each epoch it tells the dataset
that it is alone (world size 1, rank 0: its ``distributed_env``, the one attribute LitData reads
the process's place from), resets any state it was resumed into and sets its epoch to LitData's
numbering (its ``StreamingDataLoader`` counts epochs from 1), then iterates it in the rank's main
process. The order is LitData's own: its seed, its chunk permutation and in-chunk shuffle of that
epoch. Every rank decodes every sample of a global batch (LitData deserializes whole items as it
reads them), and keeps its rows' fields. The position is distmm's ``(epoch, samples)``, not
``StreamingDataLoader``'s state; a resumed run reads the epoch again up to the position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning_distmm.data.streaming import PlainStream, one_pass, skip_samples


class LitDataStream(PlainStream):
    """A ``litdata.StreamingDataset`` read as one process reads it (see the module)."""

    def __init__(self, dataset: Any):
        super().__init__(dataset)
        self._alone()

    def _alone(self) -> None:
        """Make the dataset see one process: its ``distributed_env`` says world size 1, rank 0, and
        one worker (the rank's main process reads it, so its length counts what that reads)."""
        env = self.dataset.distributed_env
        if (env.world_size, env.global_rank) != (1, 0):
            self.dataset.distributed_env = type(env)(world_size=1, global_rank=0, num_nodes=1)
            self.dataset.shuffler = None  # its chunk assignment was computed for the old world
        set_workers = getattr(self.dataset, "set_num_workers", None)
        if callable(set_workers):
            set_workers(0)  # LitData counts the main process as one worker

    def samples(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        self._alone()
        reset = getattr(self.dataset, "reset_state_dict", None)
        if callable(reset):
            reset()  # a state loaded by StreamingDataLoader.load_state_dict would override the epoch
        self.dataset.set_epoch(epoch + 1)  # StreamingDataLoader's first epoch is 1
        return skip_samples(one_pass(self.dataset), skip, epoch, self.name)

    def sample_key(self, sample: Any) -> Any:
        return None  # LitData yields items without their index: a fingerprint of the item


__all__ = ["LitDataStream"]
