"""A sharded tower under ``trainer.validate`` / ``test`` / ``predict`` as NCCL runs them (Lightning's
standalone evaluation loops under ``torch.inference_mode``), then trained again in the same processes:
the losses and the weights equal one process's (``tests/scripts/eval_modes.py`` runs the sequence)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distmm_testing import in_subprocess
from forked_main import script_module
from ports import free_port

SCRIPT = Path(__file__).parent / "scripts" / "eval_modes.py"
PLANS = ["mesh1", "mesh2"]


def _results(out: Path) -> tuple[dict, dict]:
    return json.loads((out / "result.json").read_text()), torch.load(out / "weights.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """One launch of the script (2 ranks, the script launcher) running the sequence for every plan
    in turn; meanwhile the reference runs in a forked child of this process (the same script's
    ``run_sequence`` on one process). Each plan's and the reference's result and weights."""
    out = tmp_path_factory.mktemp("eval_modes")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT", "MASTER_ADDR")}
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONWARNINGS"] = "ignore"
    # the ranks at the reference's 1 thread on any host: unset, Lightning's launcher would give them
    # cores / 2 (1 only on a 2-core host), and fp32 sums in another order drift past 1e-5 under AdamW
    env["OMP_NUM_THREADS"] = "1"
    launch = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), *PLANS],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        script = script_module(SCRIPT, "eval_modes_script")  # imported, not started: no second import lightning
        in_subprocess(lambda: script.run_sequence(None, out / "reference"))
        output, _ = launch.communicate(timeout=400)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)  # the launch and the rank it started
            launch.wait()
    assert launch.returncode == 0, output[-6000:]
    return {name: _results(out / name) for name in ["reference", *PLANS]}


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_sharded_tower_evaluates_under_inference_mode_and_trains_again(plan, runs):
    """``validate``, ``fit`` (validating after each step), ``validate``, ``test``, ``predict``, then a
    second ``fit``, with the image tower sharded over one rank and over two. Before, with Lightning's
    loops seeing a non-gloo backend: the first ``validate`` failed on the one-rank mesh (``Inference
    tensors do not track version counter``), the ``fit`` after it on the two-rank mesh (``Inplace
    update to inference tensor outside InferenceMode``); without inference mode the ``fit`` after a
    ``validate`` left the root unit's parameters out of the step (they did not learn)."""
    (expected, ref_weights), (got, weights) = runs["reference"], runs[plan]
    assert not any(got["inference"])  # every evaluation step ran under no_grad instead
    for key in ("before", "val", "test", "predict"):
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    assert ref_weights.keys() == weights.keys()
    assert max((ref_weights[k] - weights[k]).abs().max().item() for k in weights) <= 1e-5
