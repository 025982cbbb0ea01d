"""LitData's ``StreamingDataset`` under distmm: every rank reads the order one process reads, and
decodes only its rows.

LitData (``pip install litdata``; Lightning AI's streaming format written by ``litdata.optimize``)
assigns its chunks to ranks and DataLoader workers: ``StreamingDataset`` reads the process's rank
and world size when it is built (``torch.distributed``, or the ``WORLD_SIZE`` / ``GLOBAL_RANK``
environment) and, with ``shuffle=True``, each rank reads its own share of the chunks in its own
order. Under distmm every rank must read the whole stream in the same order and keep its rows of
each global batch; left alone, LitData gave the image rank and the text rank different samples.

:class:`LitDataStream` reads the dataset as a single process with ``num_workers=0`` reads it
(``StreamingDataLoader(ds, batch_size=B)`` in one process): before each epoch it tells the dataset
that it is alone (world size 1, rank 0: its ``distributed_env``, the one attribute LitData reads
the process's place from; one worker), resets any state it was resumed into and sets its epoch to
LitData's numbering (its ``StreamingDataLoader`` counts epochs from 1). The order is LitData's own:
its seed, its chunk permutation and in-chunk shuffle of that epoch.

The raw samples are the items' global indices, in that order: LitData's ``__iter__`` lays out the
epoch (each chunk's interval, and the shuffler that orders the items in it) without reading an
item, and its ``__next__`` hands each index to ``__getitem__``. Every rank computes the indices of
the epoch (no item is read), and a rank decodes only its rows' items, by index (in the
DataLoader's workers when it has some); the index is the key the ranks compare, and a resumed run
skips indices, reading nothing. That lay-out reads four of the dataset's attributes
(``worker_chunks``, ``worker_intervals``, ``shuffler``, ``_shuffle_num_chunks``); where they are
missing (another LitData version, an elastic resume), the dataset is iterated instead, every rank
decoding every item (the order is the same), and the items are fingerprinted.
``tests/test_stream_agreement.py`` compares the indices with LitData's own iteration.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from lightning_distmm.data.streams.streaming import PlainStream, one_pass, skip_samples


class LitIndex(int):
    """A LitData item's global index, as a raw sample (decoded by ``dataset[index]``)."""


class LitDataStream(PlainStream):
    """A ``litdata.StreamingDataset`` read as one process reads it (see the module)."""

    def __init__(self, dataset: Any):
        super().__init__(dataset)
        self._alone()
        self._cache_pid = os.getpid()

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
        indices = self._indices()
        source = indices if indices is not None else self._read_whole(one_pass(self.dataset))
        return skip_samples(source, skip, epoch, self.name)

    def _read_whole(self, items: Iterator[Any]) -> Iterator[Any]:
        """LitData's own iteration (its lay-out not readable), a missing chunk named as missing."""
        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            except FileNotFoundError as err:
                self._raise_if_chunk_missing(err, None)
                raise
            yield item

    def _indices(self) -> Iterator[LitIndex] | None:
        """The epoch's item indices in LitData's order, or None where its lay-out is not readable."""
        ds = self.dataset
        ds.__iter__()  # lays out the epoch (chunks, intervals, shuffler); reads no item
        self._cache_pid = os.getpid()
        try:
            chunks, intervals, shuffler = ds.worker_chunks, ds.worker_intervals, ds.shuffler
            num_chunks, current = ds._shuffle_num_chunks, ds.current_epoch
        except AttributeError:
            return None
        if getattr(ds, "_elastic_item_lists", None) is not None or shuffler is None:
            return None
        import numpy as np

        def order() -> Iterator[LitIndex]:
            for chunk, interval in zip(chunks, intervals):
                items = shuffler(np.arange(interval[1], interval[2]), num_chunks, current, int(chunk))
                yield from (LitIndex(int(i)) for i in items)

        return order()

    def item(self, sample: Any) -> Any:
        """The item a raw sample stands for: read by index (``dataset[index]``), or the item itself."""
        if not isinstance(sample, LitIndex):
            return sample
        if self._cache_pid != os.getpid():
            # a DataLoader worker: the reader the main process opened is not this process's
            self.dataset.cache = None
            self._cache_pid = os.getpid()
        try:
            return self.dataset[int(sample)]
        except FileNotFoundError as err:
            self._raise_if_chunk_missing(err, int(sample))
            raise

    def _raise_if_chunk_missing(self, err: FileNotFoundError, index: int | None) -> None:
        """Raise :class:`MissingChunkError` when ``err`` is LitData failing to find a chunk of a folder on
        this machine that no longer holds it. LitData waits for a chunk file it does not find (2 s for a
        local folder), as if a download were under way, and then reports a hung download; a folder read
        through a cache of a remote store (``s3://...``) may be downloading, and keeps LitData's error."""
        path = getattr(err, "path", None) or err.filename
        source = _chunk_source(self.dataset, os.fspath(path)) if path else None
        if source is None or os.path.exists(source):
            return
        item = f"item {index} is in it" if index is not None else "the epoch reads it"
        raise MissingChunkError(
            f"LitData chunk {source} does not exist: it was deleted or moved after the dataset was opened ({item};"
            f" LitData waited {getattr(err, 'waited_s', 0):.0f} s for the file, as for a download, then gave up)."
            f" Put the chunk back, or write the folder again (litdata.optimize) and start the run again"
        ) from None  # LitData's error calls it a hung download: a consequence's words, not the cause's

    def decode(self, sample: Any, fields: Iterable[str]) -> dict[str, Any]:
        return super().decode(self.item(sample), fields)

    def sample_key(self, sample: Any) -> Any:
        # the item's index; an item read whole (LitData's lay-out not readable) is fingerprinted
        return ("index", int(sample)) if isinstance(sample, LitIndex) else None


class MissingChunkError(FileNotFoundError):
    """A chunk of a LitData folder on this machine is gone while the run reads the folder."""


def _chunk_source(dataset: Any, path: str) -> str | None:
    """Where the chunk LitData looked for at ``path`` comes from when it is a file on this machine: the
    path itself for a local folder, the same name in the source folder of a ``local:`` copy; None for
    a remote store (its chunks are downloaded to ``path``, and one not there yet may be on its way)."""
    input_dir = getattr(dataset, "input_dir", None)
    url = getattr(input_dir, "url", None)
    if input_dir is None:
        return None
    if url is None:
        return path
    if str(url).startswith("local:"):
        return os.path.join(str(url)[len("local:") :], os.path.basename(path))
    return None


__all__ = ["LitDataStream", "LitIndex", "MissingChunkError"]
