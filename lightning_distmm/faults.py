"""When something goes wrong in a distmm job: every rank ends, and each ends with the root cause.

Two parts, neither of which needs Lightning:

- :class:`ErrorRelay`: each rank writes the first error it saw to a file of its own in the job's
  run folder (a folder every rank can read: the Trainer's ``default_root_dir`` on a shared
  filesystem), with the time it happened and whether it is a *consequence* (a peer closed its
  connection mid-collective, a collective timed out) or a *root cause* (anything else). A rank
  that fails reads every rank's record and reports the earliest root cause, falling back to the
  earliest consequence. Files survive the death of any rank, rank 0 (which hosts the
  torch.distributed store) included.
- :class:`ParentWatchdog`: a daemon thread that ends its process when the process that started
  it (Lightning's launcher, which is rank 0 under the subprocess launcher, torchrun's agent, the
  spawn/fork parent) is gone, so no rank outlives its job waiting on a collective.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

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
    if isinstance(exception, (ConnectionError, BrokenPipeError)):
        return True
    if type(exception).__name__ in _CONSEQUENCE_TYPES:
        return True
    text = str(exception)
    return any(t in text for t in _CONSEQUENCE_TEXT)


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

    def _path(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.json"

    def record(self, exception: BaseException, when: float | None = None) -> FailureRecord:
        """Write this rank's error unless it already wrote one (the first error is the one that counts)."""
        mine = FailureRecord(
            rank=self.rank,
            time=time.time() if when is None else when,
            kind=type(exception).__name__,
            message=str(exception).strip().splitlines()[0][:2000] if str(exception).strip() else "",
            consequence=is_consequence(exception),
        )
        path = self._path(self.rank)
        if path.exists():
            existing = self._read(path)
            if existing is not None:
                return existing
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(mine)))
        os.replace(tmp, path)  # atomic: a reader sees a whole record or none
        return mine

    @staticmethod
    def _read(path: Path) -> FailureRecord | None:
        try:
            return FailureRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def records(self) -> list[FailureRecord]:
        if not self.folder.is_dir():
            return []
        found = (self._read(p) for p in sorted(self.folder.glob("rank*.json")))
        return [r for r in found if r is not None]

    def first(self, wait: float = 3.0, poll: float = 0.1) -> FailureRecord | None:
        """The job's root cause as far as the records tell, waiting up to ``wait`` seconds for one
        when only consequences are recorded so far (the failing rank may still be writing)."""
        deadline = time.monotonic() + wait
        while True:
            records = self.records()
            found = earliest_cause(records)
            if (found is not None and not found.consequence) or time.monotonic() >= deadline:
                return found
            time.sleep(poll)

    def clear(self) -> None:
        """Remove this rank's record (a run that ended well leaves nothing behind)."""
        try:
            self._path(self.rank).unlink()
        except FileNotFoundError:
            pass
        try:
            self.folder.rmdir()  # the last rank out removes the folder
        except OSError:
            pass


class ParentWatchdog(threading.Thread):
    """Ends this process (exit code ``code``) soon after its parent process is gone.

    A process whose parent dies is re-parented (to init or a subreaper), so ``os.getppid()``
    changes: that is checked every ``interval`` seconds. Started on ranks that a launcher created.
    """

    def __init__(self, interval: float = 1.0, code: int = 1, describe: str = "the launcher") -> None:
        super().__init__(name="distmm-parent-watchdog", daemon=True)
        self.parent = os.getppid()
        self.interval = interval
        self.code = code
        self.describe = describe
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            if os.getppid() != self.parent:
                sys.stderr.write(
                    f"distmm: {self.describe} (pid {self.parent}) is gone; ending rank process {os.getpid()}"
                    " instead of waiting for its collectives to time out\n"
                )
                sys.stderr.flush()
                os._exit(self.code)

    def stop(self) -> None:
        self._stop_event.set()
