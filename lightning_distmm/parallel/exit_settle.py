"""Let gloo's worker threads finish with the interpreter before the interpreter ends.

A gloo process group runs its collectives on worker threads (``pt_gloo_runloop``). A collective's
work object holds its tensors, and when the worker drops the last reference to a tensor whose
Python object the work kept alive, the worker has to take the interpreter lock to free it. Once
the interpreter has begun to finalise, CPython (3.11 and earlier) ends any thread that asks for
the lock with ``pthread_exit``; that unwinds through torch's ``noexcept`` destructor and the whole
process aborts (``terminate called without an active exception``, SIGABRT), after its work had
succeeded. A core file of such an abort shows the worker in
``AsyncAllgatherWork::~AsyncAllgatherWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
``PyThread_exit_thread``.

The window is short (a collective that has just completed, whose work the worker has not yet
dropped), but a busy host can stretch it past the end of a script. torch cannot close it for us:
gloo groups have no call that joins their workers (``shutdown`` and ``abort`` leave them running)
and a module's DTensors keep their groups alive until finalisation. So at exit, while the
interpreter is still whole, :func:`settle_collective_threads` waits until every gloo worker is
idle: asleep, and not woken once during a pause in which the main thread does not hold the lock.
A worker waiting for the lock would have taken it in that pause.
"""

from __future__ import annotations

import atexit
import time
from pathlib import Path

#: the thread name torch gives gloo's per-group worker threads
GLOO_WORKER = "pt_gloo_runloop"

_TASKS = Path("/proc/self/task")
_registered = False


def _worker_states(names: tuple[str, ...]) -> dict[int, tuple[str, int]] | None:
    """``{thread id: (state letter, context switches)}`` for this process's threads named in
    ``names``; ``None`` where ``/proc`` cannot tell (not Linux)."""
    if not _TASKS.is_dir():
        return None
    states: dict[int, tuple[str, int]] = {}
    for task in _TASKS.iterdir():
        try:
            if (task / "comm").read_text().strip() not in names:
                continue
            # the state follows the parenthesised name, which may itself hold spaces
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            switches = 0
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches:" in line:  # voluntary and involuntary
                    switches += int(line.split()[1])
            states[int(task.name)] = (state, switches)
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return states


def settle_collective_threads(
    timeout: float = 3.0, pause: float = 0.05, rounds: int = 2, names: tuple[str, ...] = (GLOO_WORKER,)
) -> bool:
    """Wait until every thread named in ``names`` is idle; ``True`` when they are, ``False`` when
    ``timeout`` seconds passed first (a collective still running: a failed job's peer gone, say).

    Idle means asleep (state ``S``) and not woken once across ``rounds`` pauses of ``pause`` seconds
    each, spent in ``time.sleep``, which releases the interpreter lock: a worker that wanted the lock
    gets it in a pause and shows up as woken, so it is waited for. The pauses are long enough for
    a loaded host to schedule such a worker (at 5 ms, a torchrun rank of a busy host was judged idle
    and aborted). Without ``/proc`` this sleeps ``rounds`` pauses.
    """
    before = _worker_states(names)
    if before is None:
        time.sleep(rounds * pause)
        return True
    deadline = time.monotonic() + timeout
    quiet = 0
    while True:
        time.sleep(pause)
        after = _worker_states(names) or {}
        quiet = quiet + 1 if after == before and all(state == "S" for state, _ in after.values()) else 0
        if quiet >= rounds:
            return True
        if time.monotonic() >= deadline:
            return False
        before = after


def _settle_at_exit() -> None:
    try:
        settle_collective_threads()
    except Exception:  # noqa: BLE001 - never fail an ending process over this
        pass


def settle_collectives_at_exit() -> None:
    """Register :func:`settle_collective_threads` to run at this process's exit (once per process;
    a forked child inherits the registration).

    Called when a rank joins its process groups; ``atexit`` runs it while the interpreter is still
    whole, before the finalisation during which a worker asking for the lock would abort the process.
    """
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_settle_at_exit)
