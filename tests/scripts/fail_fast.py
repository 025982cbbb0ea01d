"""Run one bad-input case under the real popen launcher; every rank records the error it raised."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from test_errors import _run_case  # noqa: E402

torch.set_num_threads(1)
_run_case(sys.argv[1], sys.argv[2])
os._exit(0)
