"""When something goes wrong in a distmm job: every rank ends, and each ends with the root cause.

Three parts, none of which needs Lightning:

- :class:`ErrorRelay`: each rank writes the first error it saw to a file of its own in the run's
  folder (under the host's temporary folder; the ranks of other hosts are reached through the
  torch.distributed store while its host lives), with the time it happened and whether it is a *consequence* (a peer closed its
  connection mid-collective, a collective timed out) or a *root cause* (anything else). A rank
  that fails reads every rank's record and reports the earliest root cause, falling back to the
  earliest consequence. Files survive the death of any rank, rank 0 (which hosts the
  torch.distributed store) included.
- :class:`ParentWatchdog`: a daemon thread that ends its process when the process that started
  it (Lightning's launcher, which is rank 0 under the subprocess launcher, torchrun's agent, the
  spawn/fork parent) is gone, so no rank outlives its job waiting on a collective.
- :func:`preemption_handler`: SIGTERM (a scheduler's preemption) ends the rank that receives it
  at once with :class:`Preempted`, a root cause the relay hands to every other rank. Lightning's
  own handler broadcasts from inside the signal handler, a collective the other ranks never
  join, which leaves every rank waiting until the collective timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

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

#: environment variable carrying the run's id from the launcher to the ranks it starts
RUN_ID_ENV = "DISTMM_RUN_ID"
#: environment variable carrying the launcher's pid to the ranks it starts (their expected parent)
LAUNCHER_PID_ENV = "DISTMM_LAUNCHER_PID"


def note_launcher() -> None:
    """Called by a process about to start ranks: a fresh run id, and its pid, for the ranks it starts.

    The ranks then know their launcher even if it dies before they look. Both are set anew by every
    launch, so a second ``fit`` in a notebook, or a torchrun started from a process that launched
    before, never reads a stale value.
    """
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ[RUN_ID_ENV] = uuid.uuid4().hex[:12]


def _noted_launcher() -> int | None:
    """The pid the launcher noted, if it is this process's launcher: it is the parent, or it is gone
    (the rank started after its launcher died). A live process that is not the parent noted it for
    another launch (the variable came down through an unrelated process, torchrun's agent say)."""
    noted = os.environ.get(LAUNCHER_PID_ENV)
    if not noted or not noted.isdigit() or int(noted) == os.getpid():
        return None
    pid = int(noted)
    return pid if pid == os.getppid() or not pid_alive(pid) else None


def started_by_our_launcher() -> bool:
    """Whether a launcher of this package started this process (and noted its pid)."""
    return _noted_launcher() is not None


def expected_parent() -> int:
    """The launcher's pid when it noted it (:func:`note_launcher`), else this process's parent now."""
    noted = _noted_launcher()
    return noted if noted is not None else os.getppid()


class Preempted(SystemExit):
    """This rank received SIGTERM: the job stops (a ``SystemExit``, so the process exits non-zero)."""


def ensure_run_id() -> str:
    """The id every rank of this run shares.

    torchrun and SLURM name their runs; under this package's launchers the launcher made one
    (:func:`note_launcher`) and its ranks inherit it; otherwise one is made here.
    """
    found = current_run_id()
    if found is None:
        found = os.environ[RUN_ID_ENV] = uuid.uuid4().hex[:12]
    return found


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
                out.append(FailureRecord(rank, time.time() + 1e6, "RankStalled", message, False))
        return out

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
        _write_atomically(self.folder, path.name, json.dumps(asdict(mine)))
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
        when only consequences are recorded so far (the failing rank may still be writing).

        Without a recorded root cause, a rank of this host that died without a word is the cause;
        failing that, after the wait, a rank that is alive and recorded nothing (it stalled)."""
        deadline = time.monotonic() + wait
        while True:
            records = self.records()
            found = earliest_cause(records)
            if found is not None and not found.consequence:
                return found
            expired = time.monotonic() >= deadline
            silent = self._silent_ranks({r.rank for r in records}, stalled_too=expired) if self.folder.is_dir() else []
            if silent:
                return earliest_cause(silent)
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
        """At this process's exit: remove its note unless it recorded a failure (that record and the
        folder are then :meth:`finish`'s, or the next start's stale-run cleanup), and the run folder
        and its parent when this rank is the last one out (``rmdir``: only empty folders go)."""
        if self.recorded():
            return
        try:
            (self.folder / f"rank{self.rank}.proc").unlink()
        except FileNotFoundError:
            pass
        for folder in (self.folder, self.folder.parent):
            try:
                folder.rmdir()
            except OSError:
                break


#: (folder, rank) pairs whose :meth:`ErrorRelay.leave` this process runs at exit (registered once)
_LEAVING_AT_EXIT: set[tuple[str, int]] = set()

#: an empty run folder older than this is a leftover (a rank's note is written within milliseconds
#: of the folder being made, and stays while the rank lives)
_EMPTY_RUN_GRACE_S = 600.0


def _write_atomically(folder: Path, name: str, text: str, attempts: int = 5) -> None:
    """Write ``folder / name`` whole or not at all (a temporary file renamed over it), making
    ``folder`` and its parents as needed.

    Folders are only ever removed empty (``rmdir``) while a rank of their run may still enter them,
    so the one way the folder can vanish between ``mkdir`` and the write is that the last rank of
    another run, or a stale-run cleaner, removed the shared empty parent or this empty folder in
    that instant: the folder is made again and the write retried, with a debug line.
    """
    tmp = folder / f"{name}.tmp{os.getpid()}"
    for attempt in range(attempts):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, folder / name)  # atomic: a reader sees a whole file or none
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
            _log.debug("distmm: run folder %s vanished while writing %s; made again", folder, name)


def current_run_id() -> str | None:
    """The id of the run this process belongs to, if it has one (unlike :func:`ensure_run_id`, makes
    none)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_STEP_ID', '0')}"
    return os.environ.get(RUN_ID_ENV) or None


def remove_stale_runs(root: str | os.PathLike, include_current: bool = False) -> None:
    """Remove run folders under ``root`` whose every rank process on this host is gone (a failed run
    whose ranks could not all finish, e.g. one was killed), empty run folders left for longer than
    a start takes, and ``root`` itself once it is empty.

    This process's own run (:func:`current_run_id`) is never touched, whatever it holds: a rank of
    that run may be entering it right now, and a process of the run that ended (its note's pid is
    dead) does not make the run stale. ``include_current`` is for the spawn/fork parent once every
    rank it started has ended, when no rank is left to enter.
    """
    root = Path(root)
    if not root.is_dir():
        return
    keep = None if include_current else current_run_id()
    host = socket.gethostname()
    for run in root.iterdir():
        if run.name == keep or not run.is_dir():
            continue
        procs = list(run.glob("rank*.proc"))
        try:
            infos = [json.loads(p.read_text()) for p in procs]
        except (OSError, ValueError):
            continue
        if infos and all(i.get("host") == host and not pid_alive(int(i["pid"])) for i in infos):
            _remove_tree(run)
        elif not infos and not any(run.iterdir()) and _age(run) > _EMPTY_RUN_GRACE_S:
            with contextlib.suppress(OSError):
                run.rmdir()
    try:
        root.rmdir()  # when no run is left
    except OSError:
        pass


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _remove_tree(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@contextlib.contextmanager
def dies_with_parent(sig: int = signal.SIGKILL) -> Iterator[None]:
    """While inside, the kernel sends ``sig`` to this process when its parent dies (Linux ``prctl``).

    For blocking calls that hold the interpreter lock (joining the torch.distributed store), when
    :class:`ParentWatchdog`'s thread cannot run; elsewhere (not Linux) it does nothing.
    """
    libc = None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            libc = None
    parent = expected_parent()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)
    try:
        yield
    finally:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, 0)


_PR_SET_PDEATHSIG = 1


def preemption_handler(
    rank: int, forward: Callable[[int], None] | None = None, ended: Callable[[], str | None] | None = None
) -> Callable[..., None]:
    """A SIGTERM handler: pass the signal on (a launcher to the ranks it started), then end this rank.

    ``ended`` gives the root cause this rank already reported, if it is failing: the SIGTERM is
    then the launcher's clean-up (torchrun's, a spawn parent's), not a cause, and must not become
    the rank's last line: the rank repeats its cause and exits at once.
    """

    def handler(signum: int, frame: object) -> None:
        if forward is not None:
            forward(signum)
        cause = ended() if ended is not None else None
        if cause is not None:
            sys.stderr.write(f"{cause}\n")
            sys.stderr.flush()
            os._exit(1)
        raise Preempted(f"rank {rank} received {signal.Signals(signum).name} (preemption or a stop request)")

    return handler


def launcher_last_words(
    ended: Iterable[tuple[int, int | None]], cause: Callable[[], FailureRecord | None]
) -> str | None:
    """What a launcher says when a rank it started ended badly and the launcher is about to end the
    job (Lightning's process observer kills it with SIGKILL, leaving no word otherwise): the root
    cause the ranks recorded, or which rank ended how. ``ended``: ``(global rank, return code)``."""
    failed = [(rank, code) for rank, code in ended if code]
    if not failed:
        return None
    found = cause()
    if found is not None:
        return f"distmm: {found.describe()} (the launcher ends the job)"
    rank, code = failed[0]
    assert code is not None
    how = f"was ended by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return (
        f"distmm: rank {rank} {how} without recording an error (a signal from outside, the out-of-memory"
        " killer, a crash); the launcher ends the job"
    )


class PeerFailureWatch(threading.Thread):
    """Ends this rank ``grace`` seconds after another rank failed, unless this rank failed too.

    gloo fails a collective at once when a peer's process ends or raises; NCCL does not: a rank
    whose peer raised (and lingers in its error handling) or died stays blocked in a collective or a
    host sync until NCCL's watchdog ends it at the collective timeout (10 minutes by default), so
    its ``on_exception`` and the relay's report never run. This thread reads the relay's records
    every ``interval`` seconds; once a root cause recorded by another rank, or a rank of this host
    that died without a word, has been there for ``grace`` seconds while this rank recorded nothing
    (on gloo it would have failed and recorded a consequence by then), it prints that cause as
    ``[rank<N>]: distmm: ...`` and ends the process with ``code``.
    """

    def __init__(
        self, relay: ErrorRelay, world_size: int, grace: float = 30.0, interval: float = 1.0, code: int = 1
    ) -> None:
        super().__init__(name="distmm-peer-failure-watch", daemon=True)
        self.relay = relay
        self.world_size = world_size
        self.grace = grace
        self.interval = interval
        self.code = code
        self._stop_event = threading.Event()
        self._seen: dict[tuple[int, str], float] = {}  # a cause -> when this rank first saw it

    def cause(self) -> FailureRecord | None:
        """Another rank's recorded root cause, or a rank of this host that died silently (None while
        this rank has a record of its own: its error handling reports)."""
        if self.relay.recorded():
            return None
        records = self.relay.records()
        causes = [r for r in records if not r.consequence and r.rank != self.relay.rank]
        try:
            causes += self.relay._silent_ranks({r.rank for r in records}, stalled_too=False)
        except OSError:
            pass
        return earliest_cause(causes)

    def due(self) -> FailureRecord | None:
        """The cause, once it has been seen for ``grace`` seconds."""
        found = self.cause()
        if found is None:
            return None
        first = self._seen.setdefault((found.rank, found.kind), time.monotonic())
        return found if time.monotonic() - first >= self.grace else None

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                found = self.due()
            except Exception:  # noqa: BLE001 - a watch that cannot read the records does nothing
                continue
            if found is None:
                continue
            sys.stderr.write(
                f"[rank{self.relay.rank}]: distmm: {found.describe()}; this rank waited {self.grace:.0f} s in a"
                f" collective or host sync that rank will not join (NCCL does not fail it, gloo would): ending"
                f" rank process {os.getpid()} instead of waiting for the collective timeout\n"
            )
            sys.stderr.flush()
            self.relay.finish(self.world_size)
            os._exit(self.code)

    def stop(self) -> None:
        self._stop_event.set()


class ParentWatchdog(threading.Thread):
    """Ends this process (exit code ``code``) soon after its parent process is gone.

    A process whose parent dies is re-parented (to init or a subreaper), so ``os.getppid()``
    changes: that is checked every ``interval`` seconds. Started on ranks that a launcher created.
    Before it ends the process it prints, as ``[rank<N>]: ...``, what ``cause`` says stopped the
    job (the relay's root cause), so the rank's last words name it.
    """

    def __init__(
        self,
        interval: float = 1.0,
        code: int = 1,
        rank: int | None = None,
        cause: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__(name="distmm-parent-watchdog", daemon=True)
        self.parent = expected_parent()
        self.interval = interval
        self.code = code
        self.rank = rank
        self.cause = cause
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            if os.getppid() != self.parent:
                why = None
                if self.cause is not None:
                    try:
                        why = self.cause()
                    except Exception:  # noqa: BLE001 - the process ends either way
                        why = None
                prefix = f"[rank{self.rank}]: " if self.rank is not None else ""
                sys.stderr.write(
                    f"{prefix}distmm: {why + '; ' if why else ''}the launcher (pid {self.parent}) is gone: ending"
                    f" rank process {os.getpid()} instead of waiting for its collectives to time out\n"
                )
                sys.stderr.flush()
                os._exit(self.code)

    def stop(self) -> None:
        self._stop_event.set()
