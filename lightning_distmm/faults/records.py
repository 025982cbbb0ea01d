"""Each rank's first error, readable by every rank after any rank's death: :class:`ErrorRelay`.

Each rank writes the first error it saw to a file of its own in the run's folder (and, when the job
spans several hosts, to the job's store), with the time it happened and whether it is a
*consequence* (a peer closed its connection mid-collective, a collective timed out) or a *root
cause* (anything else). A rank that fails reads every rank's record and reports the earliest root
cause, falling back to the earliest consequence; a rank of this host that died without a word, or
stalled, is named as such. A rank named stalled is told so (``rank<N>.stalled``): when it wakes, or
is torn down, its own last line says that it is the rank that stalled, not the timeouts its peers
recorded while they waited for it."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_distmm.faults.runs import _remove_tree, _write_atomically, pid_alive

_log = logging.getLogger(__name__)


#: text of errors that a rank gets because a *peer* failed: they are never the root cause
_CONSEQUENCE_TEXT = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "Socket Timeout",
    "timed out",
    "Timed out",
    "NCCL communicator was aborted",
    "remote process exited",
    "ProcessGroupNCCL's watchdog",
)

_CONSEQUENCE_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistMMRankFailure")


def is_consequence(exception: BaseException) -> bool:
    """Whether ``exception`` is what a rank sees when another rank failed (a closed connection, a
    collective timeout), as opposed to a failure of its own."""
    text = str(exception)
    if "EADDRINUSE" in text or "address already in use" in text:
        return False  # this rank could not listen: its own failure, not a peer's
    if isinstance(exception, (ConnectionError, BrokenPipeError)):
        return True
    if type(exception).__name__ in _CONSEQUENCE_TYPES:
        return True
    return any(t in text for t in _CONSEQUENCE_TEXT)


def message_line(exception: BaseException) -> str:
    """The line of ``exception``'s message a record keeps: its first; for an error that a DataLoader
    worker raised (torch re-raises it as ``Caught X in DataLoader worker process N.`` and the worker's
    traceback) the worker's own message, which is the traceback's last line."""
    lines = str(exception).strip().splitlines()
    if not lines:
        return ""
    first = lines[0]
    caught = f"Caught {type(exception).__name__} in "
    if first.startswith(caught) and len(lines) > 2 and lines[1].startswith("Original Traceback"):
        kind, _, said = lines[-1].partition(": ")
        if kind.rsplit(".", 1)[-1] == type(exception).__name__ and said:
            first = f"{said} (in {first[len(caught) :].rstrip('.')})"
    return first[:2000]


@dataclass(frozen=True)
class FailureRecord:
    """One rank's first error: when, what, and whether it is a consequence of another's."""

    rank: int
    time: float
    kind: str
    message: str
    consequence: bool

    def describe(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


#: the kind of the record that names a rank which is alive and recorded nothing while the others failed
STALLED = "RankStalled"


def stalled_here(record: FailureRecord) -> str:
    """What the rank ``record`` names stalled says of itself when it wakes or is torn down: its peers'
    timeouts are the consequence, it is the cause."""
    return (
        f"{record.describe()}; this is that rank: its peers waited for it until their collectives timed out"
        f" and named it stalled"
    )


def earliest_cause(records: Iterable[FailureRecord]) -> FailureRecord | None:
    """The earliest root cause by time; the earliest consequence when no rank saw a root cause."""
    records = list(records)
    causes = [r for r in records if not r.consequence]
    pool = causes or records
    return min(pool, key=lambda r: (r.time, r.rank)) if pool else None


class ErrorRelay:
    """Per-rank failure records in ``folder`` (``rank<N>.json``), readable after any rank's death."""

    def __init__(self, folder: str | os.PathLike, rank: int) -> None:
        self.folder = Path(folder)
        self.rank = rank
        #: the job's key-value store (rank 0's TCPStore), where records also go when the ranks span
        #: several hosts: each host's folder holds only its own ranks' records
        self.store: Any = None
        self.world_size = 0

    def share_across_hosts(self, store: Any, world_size: int) -> None:
        """Also write records to ``store`` and read other hosts' from it (``torch.distributed``'s
        default store; a ``PrefixStore`` keeps the keys apart from torch's own)."""
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"distmm-failures/{self.folder.name}", store)
        self.world_size = world_size

    def _path(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.json"

    def register(self) -> None:
        """Note this rank's process (pid, host), so that a rank that dies silently can be named.

        The note stays for as long as the process lives (every trainer call of the run, ``fit`` then
        ``validate`` say): a run folder always holds a note of each live rank, so no cleaner takes it
        from a rank that is still in the run. It is removed at the process's exit
        (:meth:`leave`), and the last rank out removes the folders.
        """
        info = {"pid": os.getpid(), "host": socket.gethostname()}
        _write_atomically(self.folder, f"rank{self.rank}.proc", json.dumps(info))
        key = (str(self.folder), self.rank)
        if key not in _LEAVING_AT_EXIT:
            _LEAVING_AT_EXIT.add(key)
            atexit.register(self.leave)

    def _silent_ranks(self, reported: set[int], stalled_too: bool) -> list[FailureRecord]:
        """Ranks on this host that recorded nothing: dead ones (killed, out of memory), and, when
        asked, live ones (stalled: the rest of the job is waiting on them)."""
        out = []
        host = socket.gethostname()
        for path in sorted(self.folder.glob("rank*.proc")):
            try:
                rank = int(path.name[4:].split(".")[0])
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if rank in reported or info.get("host") != host:
                continue
            pid = int(info["pid"])
            if not pid_alive(pid):
                message = (
                    f"rank {rank} (pid {pid}) died without reporting an error (killed by a signal, or out of memory)"
                )
                out.append(FailureRecord(rank, time.time(), "RankDied", message, False))
            elif stalled_too and pid != os.getpid():
                message = f"rank {rank} (pid {pid}) reported no error and is still running: it stalled, the others waited for it"
                out.append(FailureRecord(rank, time.time() + 1e6, STALLED, message, False))
        return out

    def record(self, exception: BaseException, when: float | None = None) -> FailureRecord:
        """Write this rank's error unless it already wrote one (the first error is the one that counts)."""
        mine = FailureRecord(
            rank=self.rank,
            time=time.time() if when is None else when,
            kind=type(exception).__name__,
            message=message_line(exception),
            consequence=is_consequence(exception),
        )
        path = self._path(self.rank)
        if path.exists():
            existing = self._read(path)
            if existing is not None:
                return existing
        _write_atomically(self.folder, path.name, json.dumps(asdict(mine)))
        if self.store is not None:
            self._publish(mine)
        return mine

    def _publish(self, record: FailureRecord, wait: float = 2.0) -> None:
        """Put ``record`` in the shared store, waiting at most ``wait`` seconds (the store's host may be
        the one that is gone: the local record is written already, and the report goes on without it)."""
        store = self.store

        def put() -> None:
            with contextlib.suppress(Exception):
                store.set(f"rank{self.rank}", json.dumps(asdict(record)))
                store.add("count", 1)

        writer = threading.Thread(target=put, name="distmm-failure-publish", daemon=True)
        writer.start()
        writer.join(wait)

    def shared_records(self) -> list[FailureRecord]:
        """Records other hosts' ranks put in the shared store (none without one). May block while the
        store's host is unreachable: see :meth:`shared_records_within` for a bounded wait."""
        if self.store is None or self.store.add("count", 0) == 0:
            return []
        out = []
        for rank in range(self.world_size):
            key = f"rank{rank}"
            if rank != self.rank and self.store.check([key]):
                with contextlib.suppress(ValueError, TypeError):
                    out.append(FailureRecord(**json.loads(self.store.get(key))))
        return out

    def shared_records_within(self, wait: float = 2.0) -> list[FailureRecord]:
        """:meth:`shared_records`, or none if the store does not answer within ``wait`` seconds."""
        if self.store is None:
            return []
        found: list[FailureRecord] = []

        def read() -> None:
            with contextlib.suppress(Exception):
                found.extend(self.shared_records())

        reader = threading.Thread(target=read, name="distmm-failure-read", daemon=True)
        reader.start()
        reader.join(wait)
        return list(found) if not reader.is_alive() else []

    @staticmethod
    def _read(path: Path) -> FailureRecord | None:
        try:
            return FailureRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def records(self) -> list[FailureRecord]:
        """Every rank's record in this host's folder, the ranks another rank named stalled and the
        nodes found lost."""
        if not self.folder.is_dir():
            return []
        paths = sorted(self.folder.glob("rank*.json")) + sorted(self.folder.glob("rank*.stalled"))
        paths += sorted(self.folder.glob("rank*.lost"))
        found = (self._read(p) for p in paths)
        return [r for r in found if r is not None]

    def note_lost(self, record: FailureRecord) -> None:
        """Write the record of a lost node (``NodeHeartbeat``) where this host's ranks read records."""
        with contextlib.suppress(OSError):
            _write_atomically(self.folder, f"rank{record.rank}.lost", json.dumps(asdict(record)))

    def _declare_stalled(self, record: FailureRecord) -> None:
        """Tell the rank ``record`` names stalled (it is alive and may read its folder later)."""
        with contextlib.suppress(OSError):
            _write_atomically(self.folder, f"rank{record.rank}.stalled", json.dumps(asdict(record)))

    def declared_stalled(self) -> FailureRecord | None:
        """The record another rank of this host wrote when it named this rank stalled, if one did."""
        return self._read(self.folder / f"rank{self.rank}.stalled")

    def first(self, wait: float = 3.0, poll: float = 0.1) -> FailureRecord | None:
        """The job's root cause as far as the records tell, waiting up to ``wait`` seconds for one
        when only consequences are recorded so far (the failing rank may still be writing).

        Without a recorded root cause, a rank of this host that died without a word is the cause;
        failing that, after the wait, a rank that is alive and recorded nothing (it stalled)."""
        deadline = time.monotonic() + wait
        while True:
            records = self.records()
            local = {r.rank for r in records}
            records += [r for r in self.shared_records_within() if r.rank not in local]
            found = earliest_cause(records)
            if found is not None and not found.consequence:
                return found
            expired = time.monotonic() >= deadline
            silent = self._silent_ranks({r.rank for r in records}, stalled_too=expired) if self.folder.is_dir() else []
            if silent:
                found = earliest_cause(silent)
                if found is not None and found.kind == STALLED:
                    self._declare_stalled(found)
                return found
            if expired:
                return found
            time.sleep(poll)

    def recorded(self) -> bool:
        """Whether this rank recorded a failure (its record must then outlive the rank's teardown)."""
        return self._path(self.rank).exists()

    def finish(self, world_size: int) -> None:
        """After a failure was reported: mark this rank done; the last rank out removes the folder."""
        try:
            (self.folder / f"rank{self.rank}.done").touch()
            done = {p.name for p in self.folder.glob("rank*.done")}
        except OSError:
            return
        if all(f"rank{r}.done" in done for r in range(world_size)):
            _remove_tree(self.folder)
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # ``distmm-runs`` too, when no other run is in it

    def clear(self) -> None:
        """A trainer call that ended well: remove this rank's failure record, if any. The process's
        note and the run folder stay, since the same ranks may start another call of the run."""
        try:
            self._path(self.rank).unlink()
        except FileNotFoundError:
            pass

    def leave(self) -> None:
        """At this process's exit: remove its note (and another rank's word that it stalled) unless it
        recorded a failure (that record and the folder are then :meth:`finish`'s, or the next start's
        stale-run cleanup), and the run folder and its parent when this rank is the last one out
        (``rmdir``: only empty folders go)."""
        if self.recorded():
            return
        for name in (f"rank{self.rank}.proc", f"rank{self.rank}.stalled"):
            with contextlib.suppress(FileNotFoundError):
                (self.folder / name).unlink()
        for folder in (self.folder, self.folder.parent):
            try:
                folder.rmdir()
            except OSError:
                break


#: (folder, rank) pairs whose :meth:`ErrorRelay.leave` this process runs at exit (registered once)
_LEAVING_AT_EXIT: set[tuple[str, int]] = set()
