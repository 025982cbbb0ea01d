import os
import sys

# the suite runs on the CPU (gloo ranks); hiding accelerators keeps the pytest process from
# initialising CUDA, which would poison every later fork ("Cannot re-initialize CUDA in forked
# subprocess") in the tests that fork a child which forks ranks
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

# the runs this process launches rendezvous on ports from the suite's own allocator: Lightning's
# picker (a kernel-chosen ephemeral port) races the other pytest workers' ranks (tests/ports.py)
import lightning.fabric.plugins.environments.lightning as _lightning_environment  # noqa: E402
from ports import free_port  # noqa: E402

_lightning_environment.find_free_network_port = free_port


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


# ---------------------------------------------------------------------- the fast lane starts no process
_STARTS: list[str] = []


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request, monkeypatch):
    """A test not marked ``slow`` (the fast lane) must not start a Python process: those starts are
    what make a test slow here (``import lightning`` alone is seconds per process; a ``tar`` or a
    ``pipe:`` stream's ``cat`` is not counted). Such a test fails and says to mark it
    ``@pytest.mark.slow``."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    import multiprocessing.process
    import subprocess

    started: list[str] = []
    popen_init = subprocess.Popen.__init__
    mp_start = multiprocessing.process.BaseProcess.start

    def counted_popen(self, args, *a, **k):  # type: ignore[no-untyped-def]
        line = args if isinstance(args, str) else " ".join(map(str, args))
        if "python" in line.split(" ")[0] or line.split(" ")[0] == sys.executable:  # a tar or a pipe's cat is cheap
            started.append(f"subprocess {line[:120]}")
        return popen_init(self, args, *a, **k)

    def counted_start(self):  # type: ignore[no-untyped-def]
        started.append(f"multiprocessing {self.name}")
        return mp_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", counted_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", counted_start)
    yield
    assert not started, f"{request.node.nodeid} starts processes ({started[:3]}): mark it @pytest.mark.slow"
