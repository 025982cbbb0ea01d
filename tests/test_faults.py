"""Fault handling parts on their own: the error relay's choice of root cause, the parent watchdog, the
launcher pid a rank trusts. Whole jobs that fail: ``test_fault_jobs.py``; how ranks end: ``test_rank_exit.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from job_testing import FAULTS_ALONE, ROOT, alive, clean_env

from lightning_distmm.faults import (
    ErrorRelay,
    FailureRecord,
    Preempted,
    earliest_cause,
    is_consequence,
    preemption_handler,
)


class DistBackendError(RuntimeError):
    """Stands in for torch.distributed's: classified by name, as the relay does."""


def test_connection_errors_and_timeouts_are_consequences():
    assert is_consequence(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"))
    assert is_consequence(RuntimeError("Read error [127.0.0.1]:39558: Connection reset by peer"))
    assert is_consequence(DistBackendError("anything"))
    assert is_consequence(ConnectionResetError("reset"))
    assert not is_consequence(RuntimeError("stage 1 exploded in its forward"))
    assert not is_consequence(DistBackendError("port: 29500, code: -98, name: EADDRINUSE, address already in use"))
    assert not is_consequence(KeyError("tower 'image' reads batch field 'image'"))


def test_a_dataloader_workers_error_is_recorded_with_its_own_message(tmp_path):
    """torch re-raises a worker's error as "Caught X in DataLoader worker process 0." and the worker's
    traceback: the record (what every other rank ends with) keeps the worker's message, not that line."""
    from torch.utils.data._utils import ExceptionWrapper

    class MissingChunkError(FileNotFoundError):
        pass

    try:
        raise MissingChunkError("LitData chunk /data/lit/chunk-0-6.bin does not exist: it was deleted")
    except MissingChunkError:
        wrapped = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    with pytest.raises(MissingChunkError) as raised:
        wrapped.reraise()
    assert str(raised.value).startswith("Caught MissingChunkError in DataLoader worker process 0.")
    record = ErrorRelay(tmp_path, 1).record(raised.value)
    assert record.describe() == (
        "rank 1: MissingChunkError: LitData chunk /data/lit/chunk-0-6.bin does not exist: it was deleted"
        " (in DataLoader worker process 0)"
    )
    plain = ErrorRelay(tmp_path, 2).record(ValueError("Caught in the act\nsecond line"))
    assert plain.message == "Caught in the act"  # any other error: its first line


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
        relay.clear()  # each trainer call that ends well removes its rank's record
        relay.leave()  # each process's exit: the last one out removes the folder
    assert not folder.exists()


def test_relay_waits_for_a_root_cause_while_only_consequences_are_recorded(tmp_path):
    relay = ErrorRelay(tmp_path, 0)
    relay.record(RuntimeError("Connection closed by peer"))
    start = time.monotonic()
    found = relay.first(wait=0.5, poll=0.05)
    assert found is not None and found.consequence and time.monotonic() - start >= 0.45


def test_records_cross_hosts_through_the_store(tmp_path):
    """Two hosts, each with its own folder (no shared filesystem), one job store (a real TCPStore, as
    rank 0 serves it): rank 1 on host B records its error; the peer watch of rank 0 on host A finds it
    in the store (under NCCL rank 0 would otherwise wait in its collective for the timeout), and a
    consequence on host A is reported with host B's root cause."""
    import torch.distributed as dist

    from lightning_distmm.faults import PeerFailureWatch

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run = "run-x"
    host_a, host_b = ErrorRelay(tmp_path / "a" / run, 0), ErrorRelay(tmp_path / "b" / run, 1)
    for relay in (host_a, host_b):
        relay.share_across_hosts(store, world_size=2)
    watch = PeerFailureWatch(host_a, world_size=2, grace=0.0)
    assert watch.due() is None  # nothing recorded anywhere yet
    host_b.record(RuntimeError("stage 1 exploded in its forward"))
    assert not (tmp_path / "a" / run / "rank1.json").exists()  # not in host A's folder
    found = watch.due()
    assert found is not None and found.describe() == "rank 1: RuntimeError: stage 1 exploded in its forward"
    host_a.record(RuntimeError("Connection closed by peer"))
    first = host_a.first(wait=0.0)
    assert first is not None and first.rank == 1 and not first.consequence


@pytest.mark.slow
def test_a_rank_that_died_silently_is_named(tmp_path):
    """SIGKILL leaves no record: the survivors' connection errors point at the rank whose process is gone."""
    relay = ErrorRelay(tmp_path, 0)
    relay.register()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "rank1.proc").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    relay.record(RuntimeError("Connection closed by peer"))
    found = relay.first(wait=0.0)
    assert found is not None and found.rank == 1 and "died without reporting an error" in found.message


@pytest.mark.slow
def test_a_live_silent_rank_is_named_stalled_after_the_wait(tmp_path):
    relay = ErrorRelay(tmp_path, 0)
    relay.record(RuntimeError("Socket Timeout"))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "rank2.proc").write_text(json.dumps({"pid": live.pid, "host": socket.gethostname()}))
        found = relay.first(wait=0.3, poll=0.05)
        assert found is not None and found.rank == 2 and "stalled" in found.message
    finally:
        live.kill()


def test_a_rank_named_stalled_ends_saying_it_is_the_one(tmp_path):
    """Rank 0 timed out waiting for rank 2 and named it stalled. Rank 2's own last line, whether its
    launcher is gone, a launcher's SIGTERM tears it down or it wakes into a failed collective, names
    rank 2 as the rank that stalled; before, it repeated rank 0's timeout, a consequence. (Rank 2's
    note carries this test process's parent's pid: a live process that is not the one asking.)"""
    from lightning_distmm.rank_failures import DistMMRankFailure, RankFailures

    folder = tmp_path / "run"
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation")
    ErrorRelay(folder, 0).record(timeout, when=1.0)
    (folder / "rank2.proc").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    found = ErrorRelay(folder, 0).first(wait=0.0)
    assert found is not None and found.rank == 2 and found.kind == "RankStalled"

    stalled = RankFailures(None)
    stalled.rank, stalled.relay = 2, ErrorRelay(folder, 2)
    itself = r"rank 2: RankStalled: rank 2 \(pid \d+\) .*stalled.*; this is that rank: its peers waited for it"
    assert re.match(itself, stalled.recorded_cause() or ""), stalled.recorded_cause()  # the launcher is gone
    assert re.match(f"distmm: {itself}", stalled.stalled_words() or ""), stalled.stalled_words()  # a SIGTERM
    with pytest.raises(DistMMRankFailure, match=f"^distmm: {itself}"):  # it wakes; its collective fails
        stalled.on_exception(RuntimeError("Connection closed by peer"), world_size=3)
    assert RankFailures(None).stalled_words() is None  # no relay, no word
    assert ErrorRelay(folder, 1).declared_stalled() is None  # only the rank named


def test_sigterm_handler_forwards_then_ends_the_rank():
    forwarded = []
    handler = preemption_handler(3, forwarded.append)
    with pytest.raises(Preempted, match="rank 3 received SIGTERM"):
        handler(signal.SIGTERM, None)
    assert forwarded == [signal.SIGTERM]
    assert not is_consequence(Preempted("rank 3 received SIGTERM"))


#: the launcher: starts a rank that watches its parent (this process) and must end when it is killed
_CHILD = textwrap.dedent(
    f"""
    import subprocess, sys, time
    code = {FAULTS_ALONE + "faults.ParentWatchdog(interval=0.2).start(); print('ready', flush=True); import time; time.sleep(120)"!r}
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
        while time.monotonic() < deadline and alive(grandchild):
            time.sleep(0.1)
        assert not alive(grandchild), "the rank outlived its launcher by more than 10 s"
    finally:
        child.kill()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to tell a zombie from a live process")
def test_alive_tells_a_finished_process():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not alive(proc.pid) and alive(os.getpid())


@pytest.mark.slow
def test_a_launcher_pid_noted_for_another_launch_is_ignored():
    """A rank trusts the noted launcher pid only when it is its parent (or gone): a value that came
    down through an unrelated process (pytest, then torchrun's agent) must not end the rank."""
    # faults/runs.py loaded from its file: the package's import of Lightning is seconds per process
    code = (
        "import importlib.util, os; "
        f"spec = importlib.util.spec_from_file_location('faults', {str(ROOT / 'lightning_distmm' / 'faults' / 'runs.py')!r}); "
        "import sys; faults = sys.modules['faults'] = importlib.util.module_from_spec(spec); "
        "spec.loader.exec_module(faults); "
        "print(faults.started_by_our_launcher(), faults.expected_parent() == os.getppid())"
    )
    # noted = this test process, which is the child's parent: trusted
    env = {**clean_env(), "DISTMM_LAUNCHER_PID": str(os.getpid())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
    # noted = a live process that is not the parent: ignored
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        env["DISTMM_LAUNCHER_PID"] = str(other.pid)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
    finally:
        other.kill()
