"""Two "nodes" on this machine, launched as people launch them, train like one process."""

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from distmm_testing import TinyCLIP, loader, run_reference
from ports import free_port

SCRIPT = Path(__file__).parent / "scripts" / "multinode_train.py"
ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    return free_port()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    env.update(PYTHONPATH=f"{ROOT}:{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def _slurm_env(rank: int, port: str, job: str, **extra: str) -> dict[str, str]:
    """The variables srun sets for task ``rank`` of two, one task per "node"."""
    return _env(
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID="0",
        SLURM_NODEID=str(rank),
        SLURM_NNODES="2",
        SLURM_JOB_ID=job,
        SLURM_JOB_NAME="distmm-test",
        SLURM_NODELIST="127.0.0.1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        **extra,
    )


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """One "node" (or task), its output to a file: a pipe nobody reads fills and stalls the writer."""
    with open(log, "wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def _finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 420) -> None:
    """Wait for every process; on a timeout or a failure, kill the rest and fail with each one's log tail."""
    timed_out = False
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
    assert not timed_out, f"not finished within {timeout} s\n{tails}"
    assert all(p.returncode == 0 for p in procs), tails


def _check_against_one_process(out: Path, tmp_path: Path) -> dict:
    L.seed_everything(0)
    reference = TinyCLIP("sgd", lr=0.05)
    initial = copy.deepcopy(reference)
    run_reference(reference, loader(8), 3, str(tmp_path / "ref.json"))
    trained = torch.load(out / "weights.pt")
    expected = reference.state_dict()
    assert trained.keys() == expected.keys()
    assert max((trained[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
    assert max((initial.state_dict()[k] - expected[k]).abs().max().item() for k in expected) > 1e-3
    return json.loads((out / "nodes.json").read_text())


@pytest.mark.slow
def test_torchrun_two_nodes_equals_one_process(tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d` started twice (two "nodes")."""
    endpoint = f"127.0.0.1:{_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "distmm-test"]
    command += ["--rdzv-conf", "join_timeout=300"]
    command += [str(SCRIPT), str(tmp_path)]
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    procs = [_start(command, _env(), log) for log in logs]
    _finish(procs, logs)
    placed = _check_against_one_process(tmp_path, tmp_path)
    nodes = placed["nodes"]
    assert sorted(nodes) == [0, 0, 1, 1]  # the launcher's node ranks (GROUP_RANK), two ranks each
    # HSDP: one row per node (shard inside it), the launcher's real node of every rank
    assert placed["image_mesh"] == [[r for r in range(4) if nodes[r] == n] for n in (0, 1)]


@pytest.mark.slow
def test_slurm_environment_two_nodes_equals_one_process(tmp_path):
    """The variables SLURM's srun sets per task (Lightning's SLURMEnvironment), two "nodes" of one task
    each (the torchrun test above has two ranks per node)."""
    port = str(_port())
    procs, logs = [], []
    for rank in range(2):
        env = _slurm_env(rank, port, "4242")
        command = [sys.executable, str(SCRIPT), str(tmp_path), "1"]
        logs.append(tmp_path / f"task{rank}.log")
        procs.append(_start(command, env, logs[-1]))
    _finish(procs, logs)
    placed = _check_against_one_process(tmp_path, tmp_path)
    assert placed["nodes"] == [0, 1]
    assert placed["image_mesh"] == [[0], [1]]  # HSDP: a node's shard group is its one rank


@pytest.mark.slow
@pytest.mark.parametrize("lost", [0, 1])
def test_a_lost_node_ends_the_other_nodes_ranks_naming_it(tmp_path, lost):
    """Two "nodes" of one task each (SLURM-style), each with its own temporary folder (as two machines
    have), both stuck in step 2 as NCCL leaves a rank whose peer vanished. Every process of one node
    is SIGKILLed: the node holding rank 0 (and the job's store), or the other. The survivor ends by
    itself within the grace and a few seconds, naming the lost node."""
    import signal
    import time

    grace = 4.0
    port = str(_port())
    script = Path(__file__).parent / "scripts" / "node_loss.py"
    procs, logs = [], []
    for rank in range(2):
        folder = tmp_path / f"node{rank}-tmp"
        folder.mkdir()
        env = _slurm_env(rank, port, "4343", TMPDIR=str(folder))
        logs.append(tmp_path / f"node{rank}.log")
        procs.append(_start([sys.executable, str(script), str(tmp_path), str(grace)], env, logs[-1]))
    try:
        _wait_until_ready(tmp_path, procs, logs)
        procs[lost].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = procs[1 - lost]
        survivor.wait(timeout=grace + 60)
        seconds = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = logs[1 - lost].read_text(errors="replace")
    print(f"\nnode {lost} killed: node {1 - lost}'s rank exited with {survivor.returncode} after {seconds:.1f} s")
    print("\n".join(line for line in said.splitlines() if "distmm" in line)[-1500:])
    assert survivor.returncode != 0
    assert f"node {lost} (rank {lost}) is lost" in said, said[-3000:]
    assert seconds <= grace + 10


def _wait_until_ready(out: Path, procs: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> None:
    """Until every node's rank wrote ``out/ready<rank>`` (``scripts/node_loss.py``: held in step 2);
    a node that ended or a timeout fails with every node's log tail."""
    import time

    deadline = time.monotonic() + timeout
    while not all((out / f"ready{r}").exists() for r in range(len(procs))):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            log.read_text(errors="replace")[-2000:] for log in logs
        ]
        time.sleep(0.2)


def wait_for_listener(endpoint: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until something listens on ``endpoint`` (a first torchrun agent's rendezvous), while ``proc`` runs."""
    import time

    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"the first node's rendezvous never listened on {endpoint}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc): an agent's workers and theirs."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.slow
def test_under_torchrun_a_lost_rendezvous_node_is_named_by_the_survivors(tmp_path):
    """Two torchrun agents (``--nnodes 2 --rdzv-backend c10d``), one rank each, both held in step 2.
    The first node (the rendezvous and the job's store, rank 0) is SIGKILLed, agent and rank. The
    surviving agent stops its rank at once (the rendezvous is gone), before the heartbeat's grace:
    the rank's last line still names the node whose store stopped answering."""
    import signal
    import time

    grace = 4.0
    endpoint = f"127.0.0.1:{_port()}"
    script = Path(__file__).parent / "scripts" / "node_loss.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    command += ["--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "loss"]
    command += ["--monitor-interval", "0.5", str(script), str(tmp_path), str(grace)]
    procs, logs = [], []
    for node in range(2):
        folder = tmp_path / f"node{node}-tmp"
        folder.mkdir()
        logs.append(tmp_path / f"node{node}.log")
        procs.append(_start(command, _env(TMPDIR=str(folder)), logs[-1]))
        if node == 0:  # the first agent hosts the rendezvous (and the ranks' store): the second joins it
            wait_for_listener(endpoint, procs[0])
    try:
        _wait_until_ready(tmp_path, procs, logs)
        for pid in [procs[0].pid, *_descendants(procs[0].pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed = time.monotonic()
        procs[1].wait(timeout=grace + 60)
        seconds = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = logs[1].read_text(errors="replace")
    print(f"\nthe first node killed: the second exited with {procs[1].returncode} after {seconds:.1f} s")
    print("\n".join(line for line in said.splitlines() if "distmm" in line or "SIGTERM (" in line)[-1500:])
    assert procs[1].returncode != 0 and seconds <= grace + 10
    assert "node 0 (rank 0), which hosts the job's store" in said or "node 0 (rank 0) is lost" in said, said[-3000:]
