"""Fault handling parts on their own: the error relay's choice of root cause, the parent watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_distmm.faults import ErrorRelay, FailureRecord, earliest_cause, is_consequence


class DistBackendError(RuntimeError):
    """Stands in for torch.distributed's: classified by name, as the relay does."""


def test_connection_errors_and_timeouts_are_consequences():
    assert is_consequence(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"))
    assert is_consequence(RuntimeError("Read error [127.0.0.1]:39558: Connection reset by peer"))
    assert is_consequence(DistBackendError("anything"))
    assert is_consequence(ConnectionResetError("reset"))
    assert not is_consequence(RuntimeError("stage 1 exploded in its forward"))
    assert not is_consequence(KeyError("tower 'image' reads batch field 'image'"))


def test_the_earliest_root_cause_wins_over_earlier_consequences():
    records = [
        FailureRecord(2, 10.0, "RuntimeError", "Connection closed by peer", True),
        FailureRecord(1, 11.0, "RuntimeError", "stage 1 exploded", False),
        FailureRecord(0, 12.0, "ValueError", "later root cause", False),
    ]
    assert earliest_cause(records).rank == 1
    only_consequences = [records[0], FailureRecord(0, 9.0, "RuntimeError", "Connection reset by peer", True)]
    assert earliest_cause(only_consequences).rank == 0
    assert earliest_cause([]) is None


def test_relay_keeps_each_ranks_first_error_and_survives_any_rank(tmp_path):
    folder = tmp_path / "run"
    relays = [ErrorRelay(folder, r) for r in range(3)]
    relays[2].record(RuntimeError("Connection closed by peer"), when=1.0)
    relays[1].record(RuntimeError("stage 1 exploded in its forward"), when=2.0)
    relays[1].record(RuntimeError("a later error on the same rank"), when=3.0)  # ignored: the first counts
    # rank 0 never wrote (it died): the others still read every record
    first = relays[2].first(wait=0.0)
    assert first is not None and first.describe() == "rank 1: RuntimeError: stage 1 exploded in its forward"
    assert len(relays[0].records()) == 2
    for relay in relays:
        relay.clear()
    assert not folder.exists()


def test_relay_waits_for_a_root_cause_while_only_consequences_are_recorded(tmp_path):
    relay = ErrorRelay(tmp_path, 0)
    relay.record(RuntimeError("Connection closed by peer"))
    start = time.monotonic()
    found = relay.first(wait=0.5, poll=0.05)
    assert found is not None and found.consequence and time.monotonic() - start >= 0.45


_CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    # the grandchild watches its parent (this process) and must end when this process is killed
    code = (
        "import time, sys; from lightning_distmm.faults import ParentWatchdog; "
        "ParentWatchdog(interval=0.2).start(); print('ready', flush=True); time.sleep(120)"
    )
    grandchild = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert grandchild.stdout.readline().strip() == "ready"
    print(grandchild.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.slow
def test_a_rank_whose_launcher_dies_ends_within_seconds():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGKILL)  # the launcher dies without a word
        child.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(grandchild):
            time.sleep(0.1)
        assert not _alive(grandchild), "the rank outlived its launcher by more than 10 s"
    finally:
        child.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not reaped by its new parent, is not)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(") ")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to tell a zombie from a live process")
def test_alive_tells_a_finished_process():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not _alive(proc.pid) and _alive(os.getpid())
