"""Fault handling parts on their own: the error relay's choice of root cause, the parent watchdog."""

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


def test_sigterm_handler_forwards_then_ends_the_rank():
    forwarded = []
    handler = preemption_handler(3, forwarded.append)
    with pytest.raises(Preempted, match="rank 3 received SIGTERM"):
        handler(signal.SIGTERM, None)
    assert forwarded == [signal.SIGTERM]
    assert not is_consequence(Preempted("rank 3 received SIGTERM"))


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


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to tell a zombie from a live process")
def test_alive_tells_a_finished_process():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not _alive(proc.pid) and _alive(os.getpid())


# ---------------------------------------------------------------------------- whole jobs
SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[1]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT", "MASTER_ADDR")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(case: str, folder: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "fault_case.py"), case, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_clean_env(), "MASTER_PORT": str(_free_port()), **env},
        start_new_session=True,
    )


def _wait_for(path_glob: str, folder: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list(folder.glob(path_glob))) < count:
        time.sleep(0.2)
    assert len(list(folder.glob(path_glob))) >= count, f"only {sorted(folder.iterdir())} after {timeout} s"


def _finish(job: subprocess.Popen, folder: Path, within: float) -> tuple[int, str, float]:
    """Wait for the launcher and every rank to be gone; the launcher's code, output and seconds taken."""
    start = time.monotonic()
    try:
        out, _ = job.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        raise AssertionError(f"the job did not end within {within} s:\n{out[-3000:]}") from None
    pids = [int(p.read_text()) for p in folder.glob("pid*")]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"rank processes {left} outlived the job:\n{out[-3000:]}"
    return job.returncode, out, time.monotonic() - start


@pytest.mark.slow
def test_sigterm_to_one_rank_ends_every_rank(tmp_path):
    """A scheduler's preemption of one node: every rank stops within seconds, non-zero, saying why."""
    job = _start("sigterm", tmp_path)
    _wait_for("step*", tmp_path, 2, timeout=120)
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGTERM)
    code, out, _ = _finish(job, tmp_path, within=60)
    assert code != 0
    assert "SIGTERM" in out, out[-3000:]


@pytest.mark.slow
def test_sigkill_of_one_rank_names_it(tmp_path):
    job = _start("sigkill", tmp_path)
    _wait_for("step*", tmp_path, 2, timeout=120)
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    code, out, _ = _finish(job, tmp_path, within=60)
    assert code != 0
    assert re.search(r"rank 1 .*(died|killed|signal)", out), out[-3000:]


@pytest.mark.slow
def test_an_error_on_rank_0_reaches_every_rank(tmp_path):
    """Rank 0 hosts the store; its error must still be what the other ranks end with."""
    job = _start("rank0-raises", tmp_path)
    code, out, _ = _finish(job, tmp_path, within=120)
    assert code != 0
    assert re.search(r"\[rank1\].*rank 0: RuntimeError: boom on rank 0", out), out[-4000:]


@pytest.mark.slow
def test_master_port_in_use_ends_every_rank(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = _start("port", tmp_path, MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1")
        code, out, took = _finish(job, tmp_path, within=90)
    assert code != 0
    assert re.search(r"(address already in use|EADDRINUSE|port)", out, re.IGNORECASE), out[-3000:]


def _run_in_own_temp(case: str, tmp_path: Path) -> tuple[int, str, Path]:
    """Run ``case`` with ``TMPDIR`` a fresh folder of its own; its exit code, output and that folder."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    job = _start(case, tmp_path, TMPDIR=str(temp))
    code, out, _ = _finish(job, tmp_path, within=180)
    return code, out, temp


@pytest.mark.slow
def test_a_failed_spawn_run_leaves_no_files_in_the_temp_dir(tmp_path):
    """torch's spawn names a ``pytorch-errorfile-*.pickle`` per rank that a failed rank fills and
    nobody removes; distmm's launcher keeps them out of the temp directory, and the ranks' failure
    records go when the run is over."""
    code, out, temp = _run_in_own_temp("spawn-rank1-raises", tmp_path)
    assert code != 0 and "boom on rank 1" in out, out[-3000:]
    left = [str(p.relative_to(temp)) for p in temp.rglob("*")]
    assert not left, left


@pytest.mark.slow
def test_a_spawn_run_that_ends_well_leaves_no_files_in_the_temp_dir(tmp_path):
    """Rank 0 hands the parent the trained weights in a file of a ``mkdtemp`` folder; Lightning's
    parent removes the file but not the folder. distmm writes it into the launch's scratch folder."""
    code, out, temp = _run_in_own_temp("spawn-ok", tmp_path)
    assert code == 0, out[-3000:]
    left = [
        str(p.relative_to(temp))
        for p in temp.rglob("*")
        if not p.relative_to(temp).parts[0].startswith("torchinductor_")
    ]
    assert not left, left


@pytest.mark.slow
def test_survivors_of_a_peer_that_fails_without_closing_its_connections_end_with_its_error(tmp_path):
    """Rank 1 raises and then lingers with its connections open, as an NCCL peer looks to the others
    (gloo fails their collective at once when a peer's process ends). The other ranks end within a
    minute with rank 1's error (failure_grace 5 s here, 30 s by default); before, they waited in their
    collective for the timeout (10 minutes)."""
    job = _start("rank1-raises-and-lingers", tmp_path)
    code, out, took = _finish(job, tmp_path, within=90)
    assert code != 0
    assert re.search(r"\[rank0\]: distmm: rank 1: RuntimeError: boom on rank 1", out), out[-3000:]


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_at_the_collective_timeout(tmp_path):
    job = _start("rank1-stalls", tmp_path)
    code, out, took = _finish(job, tmp_path, within=150)
    assert code != 0


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["popen", "spawn", "fork", "torchrun"])
def test_every_rank_gets_its_share_of_the_cores(launcher, tmp_path):
    """Lightning's launchers give each of n local ranks cpus // n intra-op threads; so must distmm's,
    whoever starts the processes (under torchrun the script itself is the rank)."""
    script = str(SCRIPTS / "thread_count.py")
    env = {**_clean_env(), "MASTER_PORT": str(_free_port())}
    if launcher == "torchrun":
        port = _free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
        cmd += [script, "popen", str(tmp_path)]
    else:
        cmd = [sys.executable, script, launcher, str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    cpus = len(os.sched_getaffinity(0))
    expected = max(1, cpus // 2)
    threads = {p.name: int(p.read_text()) for p in tmp_path.glob("rank*")}
    assert threads == {"rank0": expected, "rank1": expected}, threads


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["colocated", "tp"])
def test_a_spawned_rank_ends_without_its_process_groups(plan, tmp_path):
    """A spawned rank's work done, its process groups are gone before the interpreter exits (with a
    plan whose module holds no DTensors, no gloo or store thread is left), the handlers the run
    registered with ``atexit`` still run, and every rank exits with 0. Before, the towers' meshes kept
    their gloo groups alive into the interpreter's finalisation, where a finished rank could abort."""
    script = str(SCRIPTS / "rank_exit.py")
    env = {**_clean_env(), "MASTER_PORT": str(_free_port())}
    done = subprocess.run(
        [sys.executable, script, plan, str(tmp_path)], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "parent").exists()
    threads = {r: (tmp_path / f"rank{r}").read_text().split() for r in (0, 1)}  # the atexit handlers ran
    if plan == "colocated":
        left = {r: [t for t in names if "gloo" in t or "tcpstore" in t] for r, names in threads.items()}
        assert left == {0: [], 1: []}, left


@pytest.mark.slow
def test_a_rank_ending_while_its_collectives_complete_exits_cleanly():
    """A script rank whose last collectives complete while its interpreter ends exits with 0: the
    hook the strategy registers lets gloo's workers free the gathered tensors first. Without it
    (``SETTLE`` 0) the same script aborted in 5 of 6 runs on this machine (docs/runtime.md)."""
    script = str(SCRIPTS / "exit_settle.py")
    env = _clean_env()
    for _ in range(3):
        port = str(_free_port())
        peer = subprocess.Popen([sys.executable, script, "0", port, "1"], env=env, stderr=subprocess.PIPE, text=True)
        try:
            done = subprocess.run(
                [sys.executable, script, "1", port, "1"], env=env, capture_output=True, text=True, timeout=120
            )
            assert peer.wait(timeout=60) == 0, peer.stderr.read()[-2000:] if peer.stderr else ""
        finally:
            if peer.poll() is None:
                peer.kill()
        assert done.returncode == 0, done.stderr[-2000:]
        assert "terminate called" not in done.stderr


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
    env = {**_clean_env(), "DISTMM_LAUNCHER_PID": str(os.getpid())}
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
