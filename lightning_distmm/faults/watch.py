"""Threads and signals that end a rank which would otherwise wait: :class:`ParentWatchdog` (the
process that started the rank is gone), :class:`PeerFailureWatch` (a peer recorded an error or died,
and NCCL leaves this rank in its collective), :func:`preemption_handler` (SIGTERM ends the rank at
once with :class:`Preempted`, a root cause the relay hands to every other rank), and
:func:`dies_with_parent`."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from lightning_distmm.faults.heartbeat import NODE_LOST, NodeHeartbeat
from lightning_distmm.faults.records import ErrorRelay, FailureRecord, earliest_cause
from lightning_distmm.faults.runs import expected_parent

_log = logging.getLogger(__name__)


class Preempted(SystemExit):
    """This rank received SIGTERM: the job stops (a ``SystemExit``, so the process exits non-zero)."""


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
    rank: int,
    forward: Callable[[int], None] | None = None,
    ended: Callable[[], str | None] | None = None,
    why: Callable[[], str | None] | None = None,
) -> Callable[..., None]:
    """A SIGTERM handler: pass the signal on (a launcher to the ranks it started), then end this rank.

    ``ended`` gives the root cause this rank already reported, if it is failing: the SIGTERM is
    then the launcher's clean-up (torchrun's, a spawn parent's), not a cause, and must not become
    the rank's last line: the rank repeats its cause and exits at once. ``why``: what else the
    rank can tell about the stop (a node whose store no longer answers), added to its error.
    """

    def handler(signum: int, frame: object) -> None:
        if forward is not None:
            forward(signum)
        cause = ended() if ended is not None else None
        if cause is not None:
            sys.stderr.write(f"{cause}\n")
            sys.stderr.flush()
            os._exit(1)
        said = f"rank {rank} received {signal.Signals(signum).name} (preemption or a stop request)"
        found = why() if why is not None else None
        raise Preempted(f"{said}; {found}, and its launcher is stopping this node's ranks" if found else said)

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
    every ``interval`` seconds (this host's folder, and the job's store when the ranks span several
    hosts: :meth:`ErrorRelay.share_across_hosts`); once a root cause recorded by another rank, or a rank of this host
    that died without a word, has been there for ``grace`` seconds while this rank recorded nothing
    (on gloo it would have failed and recorded a consequence by then), it prints that cause as
    ``[rank<N>]: distmm: ...`` and ends the process with ``code``.

    With a :class:`~lightning_distmm.faults.heartbeat.NodeHeartbeat` (``heartbeat``, jobs over
    several nodes) it also beats for its node each round; a node found lost is written to this
    host's folder, which every rank of the host reads, and ends them at once (its grace was the
    heartbeat's).
    """

    heartbeat: NodeHeartbeat | None = None

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
        local = {r.rank for r in records}
        records += [r for r in self.relay.shared_records_within() if r.rank not in local]
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
        if found.kind == NODE_LOST:
            return found  # the heartbeat waited its grace already
        first = self._seen.setdefault((found.rank, found.kind), time.monotonic())
        return found if time.monotonic() - first >= self.grace else None

    def beat(self) -> None:
        """One heartbeat round; a lost node goes to this host's folder."""
        if self.heartbeat is not None:
            lost = self.heartbeat.tick()
            if lost is not None and not self.relay.recorded():
                self.relay.note_lost(lost)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.beat()
                found = self.due()
            except Exception:  # noqa: BLE001 - a watch that cannot read the records does nothing
                continue
            if found is None:
                continue
            if found.kind == NODE_LOST:
                why = "its ranks will not join this rank's collectives"
            else:
                why = (
                    f"this rank waited {self.grace:.0f} s in a collective or host sync that rank will not join (NCCL"
                    " does not fail it, gloo would)"
                )
            sys.stderr.write(
                f"[rank{self.relay.rank}]: distmm: {found.describe()}; {why}: ending rank process {os.getpid()}"
                " instead of waiting for the collective timeout\n"
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
