"""A run's identity and its folder of failure records on this host: the run id every rank of a
launch shares, the launcher's pid, the folder's atomic writes and the removal of stale runs'
folders (never the current run's)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

_log = logging.getLogger(__name__)


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


def ensure_run_id() -> str:
    """The id every rank of this run shares.

    torchrun and SLURM name their runs; under this package's launchers the launcher made one
    (:func:`note_launcher`) and its ranks inherit it; otherwise one is made here.
    """
    found = current_run_id()
    if found is None:
        found = os.environ[RUN_ID_ENV] = uuid.uuid4().hex[:12]
    return found


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
    try:
        runs = list(root.iterdir())
    except FileNotFoundError:  # another run on this host found the root empty and removed it meanwhile
        return
    for run in runs:
        if run.name == keep or not run.is_dir():
            continue
        try:
            procs = list(run.glob("rank*.proc"))
            infos = [json.loads(p.read_text()) for p in procs]
        except (OSError, ValueError):  # removed meanwhile by another run's cleanup, or half written
            continue
        if infos and all(i.get("host") == host and not pid_alive(int(i["pid"])) for i in infos):
            _remove_tree(run)
        elif not infos and _age(run) > _EMPTY_RUN_GRACE_S:
            with contextlib.suppress(OSError):  # not empty (rmdir refuses), or removed meanwhile
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
