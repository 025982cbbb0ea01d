"""``benchmarks/gpu_first_run.py --cpu-smoke``: the script a lent GPU runs first, on the CPU (gloo, one
rank per check), so that it cannot rot between GPU sessions: every check passes, one process each,
with a PASS line per check, the summary line and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_first_run_cpu_smoke(tmp_path):
    out = tmp_path / "first_run.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "OMP_NUM_THREADS")}
    env["PYTHONWARNINGS"] = "ignore"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_first_run.py"), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    names = ["mesh_async_gather", "bf16_clip", "fp32_equivalence", "async_vs_blocking", "sharded_eval"]
    names += ["deferred_init", "checkpoint", "zero2_mixed_kernels", "llava", "llava_packed"]
    assert list(report["checks"]) == names
    for name in names:
        assert f"PASS {name} (" in done.stdout
        assert report["checks"][name]["status"] == "PASS"
    assert report["checks"]["async_vs_blocking"]["details"]["max_abs_diff"] == 0.0
    assert report["checks"]["bf16_clip"]["details"]["grad_dtypes"] == ["torch.float32"]
    assert report["summary"].startswith("gpu_first_run: 10/10 checks PASS on cpu") and report["summary"] in done.stdout
    assert "calibration" not in report  # the GPU's remaining time only
    print(f"gpu_first_run --cpu-smoke: {seconds:.1f} s; {report['summary']}")
