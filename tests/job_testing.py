"""Whole jobs started as a user starts them (a script under the real launchers), for the fault and
exit tests: a clean environment, a free port, each case's start and finish, and whether a process
is still alive. Every rank of a ``scripts/fault_case.py`` job writes its pid, so a test can check
that no process outlives the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ports import free_port  # noqa: F401  (the suite's one port helper, re-exported for the job tests)

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[1]


#: Python source that imports ``lightning_distmm.faults`` alone, under a bare stand-in for the package:
#: the package's own import loads Lightning (it registers the strategy), seconds of CPU per process,
#: and ``faults/`` needs only the standard library
FAULTS_ALONE = (
    "import sys, types\n"
    f"package = types.ModuleType('lightning_distmm'); package.__path__ = [{str(ROOT / 'lightning_distmm')!r}]\n"
    "sys.modules['lightning_distmm'] = package\n"
    "from lightning_distmm import faults\n"
    "assert 'lightning' not in sys.modules and 'torch' not in sys.modules\n"
)


def clean_env() -> dict[str, str]:
    """This process's environment without the thread count and rendezvous a launcher sets."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT", "MASTER_ADDR")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not reaped by its new parent, is not)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(") ")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def expected_threads(local_ranks: int) -> int:
    """The intra-op threads Lightning's launchers give each of ``local_ranks`` ranks on this host."""
    return max(1, len(os.sched_getaffinity(0)) // local_ranks)


def start_case(case: str, folder: Path, **env: str) -> subprocess.Popen:
    """``scripts/fault_case.py CASE FOLDER`` in a session of its own (so that it can be killed whole)."""
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "fault_case.py"), case, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**clean_env(), "MASTER_PORT": str(free_port()), **env},
        start_new_session=True,
    )


def wait_for(path_glob: str, folder: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list(folder.glob(path_glob))) < count:
        time.sleep(0.2)
    assert len(list(folder.glob(path_glob))) >= count, f"only {sorted(folder.iterdir())} after {timeout} s"


def finish(job: subprocess.Popen, folder: Path, within: float) -> tuple[int, str, float]:
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
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"rank processes {left} outlived the job:\n{out[-3000:]}"
    return job.returncode, out, time.monotonic() - start


def failed_job_output(job: subprocess.Popen, folder: Path, within: float) -> str:
    """:func:`finish` for a job that must fail: its exit code is checked non-zero; its output."""
    code, out, _ = finish(job, folder, within)
    assert code != 0, f"the job ended with 0:\n{out[-3000:]}"
    return out
