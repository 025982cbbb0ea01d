"""Checkpoint saves that do not hold the step: DCP's ``async_save`` with one save in flight.

``DistMMStrategy(async_save=True)`` saves a checkpoint in two parts. In the step, every rank copies
its shards to CPU memory (DCP's default stager: a copy, so the optimizer step that follows cannot
change what is written) and rank 0 serialises ``meta.pt`` (loops, callbacks, schedulers) to bytes;
a background thread then writes the shards, DCP's coordinator writes ``.metadata``, and only when
that succeeded does rank 0 write ``meta.pt`` (to a temporary name, then renamed). A folder is
complete when all three are there (:func:`lightning_distmm.elastic.is_complete`), so a save that
a lost node interrupted never becomes the newest checkpoint.

Why a process group of its own: the background thread's collectives (DCP gathers the ranks' save
plans and results) run while the step's own collectives run on the main thread; on one group the
two orders would interleave differently on different ranks. torchtitan's async checkpointing makes
the same separate gloo group.

One save is in flight at a time: the next save, a load, the end of fit and
:meth:`AsyncSaver.wait` wait for it first and raise its error there. A checkpoint removal
Lightning asks for while a save is in flight (``ModelCheckpoint(save_top_k=...)`` drops the
previous best as soon as it *started* the new one) waits for that save: the folder being removed
may be the only complete one.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_distmm.checkpoint import META_FILE, split_for_dcp


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` under a temporary name, then rename it: readers see all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def remove_checkpoint_path(path: Path) -> None:
    """Remove a checkpoint folder or file (what Lightning's ``remove_checkpoint`` does for a folder)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


class AsyncSaver:
    """The ranks' saves in the background, one at a time (module docstring).

    ``setup`` on every rank, in the same order as the other groups are made (it creates a process
    group); ``save`` on every rank with its part of the state; ``wait`` before anything that reads
    the folder or ends the ranks.
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._pending: Future | None = None
        self._pending_path: Path | None = None
        self._removals: list[Path] = []
        self._meta_error: OSError | None = None
        #: set once rank 0's ``meta.pt`` write (in the writer thread, after the future's result) ended
        self._meta_done: threading.Event | None = None
        #: seconds each save held the step (the copy to CPU and the plan): the benchmark reads it
        self.blocking_seconds: list[float] = []

    def setup(self) -> None:
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def save(self, state: dict[str, Any], path: Path, meta: dict[str, Any] | None) -> None:
        """Start writing ``state`` (DCP shards) into ``path``; ``meta`` is rank 0's ``meta.pt``
        content (None on the other ranks), written once the shards and ``.metadata`` are."""
        self.wait()  # one save in flight; its error surfaces here, at the next save
        started = time.perf_counter()
        meta_bytes = None
        if meta is not None:
            buffer = io.BytesIO()
            torch.save(meta, buffer)  # now: the loops' state changes with the next step
            meta_bytes = buffer.getvalue()
        from torch.distributed.checkpoint import async_save

        future = async_save(state, checkpoint_id=path, process_group=self._group)
        if meta_bytes is not None:
            written = self._meta_done = threading.Event()
            future.add_done_callback(lambda done: self._finish(done, path, meta_bytes, written))
        self._pending, self._pending_path = future, path
        self.blocking_seconds.append(time.perf_counter() - started)

    def save_folder(self, checkpoint: dict[str, Any], path: Path, writes_meta: bool) -> None:
        """:meth:`save` Lightning's ``checkpoint`` into the folder ``path`` (a file there replaced), as
        ``ModelParallelStrategy`` lays it out; ``writes_meta``: this rank writes ``meta.pt`` (rank 0)."""
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        tensors, meta = split_for_dcp(checkpoint)
        self.save(tensors, path, meta if writes_meta else None)

    def _finish(self, done: Future, path: Path, meta_bytes: bytes, written: threading.Event) -> None:
        # in the writer thread, as soon as the shards and .metadata are written (a node lost later
        # still leaves a complete folder); an error here is raised by the next ``wait``
        try:
            if done.exception() is None:
                write_atomically(path / META_FILE, meta_bytes)
        except OSError as err:
            self._meta_error = err
        finally:
            written.set()

    def remove(self, path: Path) -> None:
        """Remove a checkpoint, once the last save is known to have succeeded (at the next ``wait``)."""
        if self._pending is not None:
            self._removals.append(path)
        else:
            remove_checkpoint_path(path)

    def wait(self) -> None:
        """Block until the save in flight has completed; raise its error if it failed."""
        pending, path, written = self._pending, self._pending_path, self._meta_done
        self._meta_done = None
        removals, self._removals = self._removals, []
        self._pending = self._pending_path = None
        if pending is None:
            return
        try:
            pending.result()
            if written is not None:  # the future's waiters wake before its callbacks run
                written.wait()
            if self._meta_error is not None:
                raise self._meta_error
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            self._meta_error = None
            # the removals wait with it: the folders Lightning wanted gone may be the newest complete ones
            raise RuntimeError(
                f"the asynchronous checkpoint save into {path} failed ({type(err).__name__}: {err}); the folder"
                " is incomplete and is never resumed from (lightning_distmm.last_checkpoint finds the newest"
                f" complete one); kept, since it failed: {[str(r) for r in removals] or 'nothing'}"
            ) from err
        for removal in removals:
            remove_checkpoint_path(removal)

    def close(self) -> None:
        """Wait for the last save; the group ends with the default one."""
        self.wait()
