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


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
