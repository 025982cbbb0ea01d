"""``benchmarks/gpu_first_run.py --cpu-smoke``: the script a lent GPU runs first, on the CPU (gloo, one
rank per check), so that it cannot rot between GPU sessions: every check passes, one process each,
with a PASS line per check, the summary line and the JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch
from forked_main import main_in_fork

ROOT = Path(__file__).resolve().parents[1]


def _script():
    """``benchmarks/gpu_first_run.py`` as a module (it imports what the test process has loaded)."""
    spec = importlib.util.spec_from_file_location("gpu_first_run", ROOT / "benchmarks" / "gpu_first_run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_first_run"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.slow
def test_gpu_first_run_cpu_smoke(tmp_path):
    """The script's ``main`` in a forked child of this process (its own session; the checks fork from
    it as from the script's process), so that no fresh interpreter imports lightning first."""
    out, log = tmp_path / "first_run.json", tmp_path / "first_run.log"
    start = time.monotonic()
    # this process runs torch on 1 thread (conftest); OMP_NUM_THREADS keeps Lightning's launcher from
    # raising it to cores / processes for the distmm half of a comparison only (sharded_eval's weights
    # then differed by 3.8e-5 from its one-thread reference: fp32 sums in another order)
    env = {"MASTER_PORT": None, "MASTER_ADDR": None, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    _, code = main_in_fork(_script().main, ["--cpu-smoke", "--out", str(out)], log, timeout=300, env=env)
    seconds = time.monotonic() - start
    stdout = log.read_text()
    assert code == 0, stdout[-8000:]
    report = json.loads(out.read_text())
    names = ["mesh_async_gather", "bf16_clip", "fp32_equivalence", "async_vs_blocking", "sharded_eval"]
    names += ["deferred_init", "checkpoint"]
    assert list(report["checks"]) == names
    for name in names:
        assert f"PASS {name} (" in stdout
        assert report["checks"][name]["status"] == "PASS"
    assert report["checks"]["async_vs_blocking"]["details"]["max_abs_diff"] == 0.0
    assert report["checks"]["bf16_clip"]["details"]["grad_dtypes"] == ["torch.float32"]
    assert report["summary"].startswith("gpu_first_run: 7/7 checks PASS on cpu") and report["summary"] in stdout
    assert "calibration" not in report  # the GPU's remaining time only
    print(f"gpu_first_run --cpu-smoke: {seconds:.1f} s; {report['summary']}")
