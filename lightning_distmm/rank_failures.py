"""How one rank's failure ends every rank of a distmm job with its cause: the strategy's side of
:mod:`lightning_distmm.faults`.

:class:`RankFailures` is what the strategy holds: before the rank joins its process group it
starts the watch on its launcher (a rank whose launcher died ends, naming the cause other ranks
recorded), the run's failure records (:class:`~lightning_distmm.faults.ErrorRelay`) and the watch on
its peers (NCCL leaves a survivor in its collective; :class:`~lightning_distmm.faults.PeerFailureWatch`);
after it joined, records are shared through the job's store when the job spans several hosts. On an
exception every rank records its first error and ends with the earliest root cause
(:class:`DistMMRankFailure` when that is another rank's). SIGTERM ends the rank at once with an error
every other rank reports (Lightning's handler broadcasts from inside the signal handler: a collective
the other ranks never join).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from lightning_distmm import faults
from lightning_distmm import lightning_seam as seam

_FIRST_FAILURE_KEY = "distmm/first_failure"


class DistMMRankFailure(RuntimeError):
    """Another rank failed first, or this rank stalled and the others gave up on it; the message is
    the job's root cause."""


class RankFailures:
    """This rank's failure handling for one run (see the module docstring).

    ``grace``: how long a rank blocked in a collective waits after a peer recorded an error before
    it ends with that error (None: until the collective timeout).
    """

    def __init__(self, grace: timedelta | None) -> None:
        self.grace = grace
        self.rank = 0
        self.relay: faults.ErrorRelay | None = None
        self.watchdog: faults.ParentWatchdog | None = None
        self.peer_watch: faults.PeerFailureWatch | None = None
        self._trainer_calls = 0
        #: this rank's last line once it is failing (what a later clean-up SIGTERM repeats)
        self.last_words: str | None = None

    def start(self, rank: int, world_size: int, started_by_launcher: bool) -> None:
        """Before joining the process group (the first thing that can hang)."""
        self.rank = rank
        if started_by_launcher and self.watchdog is None and threading.current_thread() is threading.main_thread():
            self.watchdog = faults.ParentWatchdog(rank=rank, cause=self.recorded_cause)
            self.watchdog.start()
        self.relay = faults.ErrorRelay(failure_folder(), rank)
        self.relay.register()
        self.last_words = None  # a new trainer call: no failure of this one yet
        seam.before_observer_ends_job(self.launcher_last_words)  # the popen launcher: its last words
        if self.grace is not None and self.peer_watch is None:
            self.peer_watch = faults.PeerFailureWatch(self.relay, world_size, grace=self.grace.total_seconds())
            self.peer_watch.start()

    @contextmanager
    def joining(self, started_by_launcher: bool) -> Iterator[None]:
        """Around joining the process group: joining the store holds the interpreter lock, so the
        watchdog's thread cannot run; a rank that our launcher started dies with it meanwhile (rank 0
        failing to bind MASTER_PORT, say). Only under our launchers, which start ranks from their main
        thread: the signal follows the *thread* that started the process, and torchrun's agent starts
        workers from a thread that ends."""
        ours = started_by_launcher and faults.started_by_our_launcher()
        with faults.dies_with_parent() if ours else contextlib.nullcontext():
            yield

    def joined(self, num_nodes: int, world_size: int) -> None:
        """After joining: each host's folder holds its own ranks' records, so share them in the store."""
        if num_nodes > 1 and self.relay is not None:
            self.relay.share_across_hosts(seam.default_store(), world_size)

    def watch_nodes(self, nodes: list[int]) -> None:
        """Over several nodes (``nodes``: the node of every rank), a heartbeat per node in the job's
        store, watched by every node (:class:`~lightning_distmm.faults.NodeHeartbeat`)."""
        if self.peer_watch is None or len(set(nodes)) < 2 or self.grace is None:
            return
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        self._trainer_calls += 1  # every rank makes the same calls: keys of one call never meet another's
        run = f"{faults.current_run_id() or 'run'}/{self._trainer_calls}"
        self.peer_watch.heartbeat = faults.NodeHeartbeat(
            seam.default_store(), run, self.rank, nodes, self.grace.total_seconds(), address
        )

    def recorded_cause(self) -> str | None:
        """The root cause other ranks recorded, if any, or that this rank stalled (what a rank says when
        its launcher is gone)."""
        found = self.relay.first(wait=2.0) if self.relay is not None else None
        if found is None or (found.rank == self.rank and found.kind != faults.STALLED):
            return None
        return self._said(found)

    def _said(self, found: faults.FailureRecord) -> str:
        """``found`` as this rank reports it: a rank named stalled says that it is the one."""
        return (
            faults.stalled_here(found) if found.rank == self.rank and found.kind == faults.STALLED else found.describe()
        )

    def stalled_words(self) -> str | None:
        """This rank's last line if the other ranks named it stalled: they waited for it until their
        collectives timed out (it woke since, or a launcher is tearing it down)."""
        found = self.relay.declared_stalled() if self.relay is not None else None
        return f"distmm: {faults.stalled_here(found)}" if found is not None else None

    def launcher_last_words(self, ended: list[tuple[int, int | None]]) -> None:
        """Said by a popen launcher before Lightning's observer SIGKILLs it and its ranks (a rank ended
        badly): the recorded root cause, or which rank ended how. Its ranks are the next global ranks."""
        relay = self.relay
        line = faults.launcher_last_words(
            [(self.rank + i, code) for i, code in ended],
            lambda: relay.first(wait=2.0) if relay is not None else None,
        )
        if line is not None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def handle_preemption(self, forward: Callable[..., object] | None) -> None:
        """SIGTERM ends this rank at once, with an error every other rank reports; ``forward``: the
        launcher's way of passing the signal on to its ranks. A rank already failing repeats its
        cause instead (the SIGTERM is then a launcher's clean-up, not a cause), and so does a rank the
        others named stalled (the launcher ends the job they failed for it)."""
        if threading.current_thread() is threading.main_thread():
            ended = lambda: self.last_words or self.stalled_words()  # noqa: E731
            signal.signal(signal.SIGTERM, faults.preemption_handler(self.rank, forward, ended, self._store_silent))

    def _store_silent(self) -> str | None:
        heartbeat = self.peer_watch.heartbeat if self.peer_watch is not None else None
        return heartbeat.store_silent() if heartbeat is not None else None

    def on_exception(self, exception: BaseException, world_size: int) -> None:
        """Record this rank's error and raise the job's first one if it is another rank's, or that this
        rank stalled (its own error is then a consequence: its peers gave up on it)."""
        first = self._first_failure(exception)
        if self.relay is not None:
            self.relay.finish(world_size)
        mine = f"rank {self.rank}: {type(exception).__name__}: {exception}"
        self.last_words = f"distmm: {first or mine}"
        stalled = first is not None and first.startswith(f"rank {self.rank}: {faults.STALLED}:")
        if first is not None and (stalled or not first.startswith(f"rank {self.rank}:")):
            raise DistMMRankFailure(f"distmm: {first}") from exception

    def _first_failure(self, exception: BaseException) -> str | None:
        stored = None
        if not faults.is_consequence(exception):
            stored = _record_first_failure(self.rank, exception)
        if self.relay is None:
            return stored
        mine = self.relay.record(exception)
        found = self.relay.first(wait=5.0 if mine.consequence else 0.0)
        if found is not None and found.consequence and stored is not None:
            return stored  # a root cause from a rank whose records this host cannot read
        return self._said(found) if found is not None else stored

    def stop(self) -> None:
        """At teardown: the watches end (the records stay until the process exits)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.peer_watch is not None and self.peer_watch.heartbeat is not None:
            self.peer_watch.heartbeat.close()
        if self.peer_watch is not None:
            self.peer_watch.stop()
            self.peer_watch = None


def failure_folder() -> Path:
    """Where the ranks of this run on this host record their failures (other runs whose processes
    are all gone are removed first; this run's folder is never touched here)."""
    root = Path(tempfile.gettempdir()) / "distmm-runs"
    run_id = faults.ensure_run_id()
    faults.remove_stale_runs(root)
    return root / run_id


def after_ranks_ended() -> None:
    """In a spawn/fork parent once every rank has ended: remove the failure records that ranks
    which were stopped from outside could not remove themselves (this run's included: no rank of it
    is left to enter its folder)."""
    faults.remove_stale_runs(Path(tempfile.gettempdir()) / "distmm-runs", include_current=True)


def _record_first_failure(rank: int, exception: BaseException) -> str | None:
    """Write this rank's error to the store unless another rank's is there; return the first one
    (the channel across nodes that share no filesystem, while the store's host, rank 0, lives)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    mine = f"rank {rank}: {type(exception).__name__}: {exception}"
    try:
        store = seam.default_store()
        first = store.compare_set(_FIRST_FAILURE_KEY, "", mine)
    except Exception:  # noqa: BLE001 - the store's host may be gone already
        return None
    return first.decode() if isinstance(first, bytes) else str(first)


__all__ = ["DistMMRankFailure", "RankFailures", "after_ranks_ended", "failure_folder"]
