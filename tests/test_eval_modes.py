"""A sharded tower under ``trainer.validate`` / ``test`` / ``predict`` as NCCL runs them (Lightning's
standalone evaluation loops under ``torch.inference_mode``), then trained again in the same processes:
the losses and the weights equal one process's (``tests/scripts/eval_modes.py`` runs the sequence)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "eval_modes.py"


def _run(name: str, out: Path) -> dict:
    """The script under the script launcher (2 ranks) or in one process (``reference``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MASTER_PORT", "MASTER_ADDR")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), name, str(out)], capture_output=True, text=True, env=env, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("reference")
    return _run("reference", out), out


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["mesh1", "mesh2"])
def test_sharded_tower_evaluates_under_inference_mode_and_trains_again(plan, reference, tmp_path):
    """``validate``, ``fit`` (validating after each step), ``validate``, ``test``, ``predict``, then a
    second ``fit``, with the image tower sharded over one rank and over two. Before, with Lightning's
    loops seeing a non-gloo backend: the first ``validate`` failed on the one-rank mesh (``Inference
    tensors do not track version counter``), the ``fit`` after it on the two-rank mesh (``Inplace
    update to inference tensor outside InferenceMode``); without inference mode the ``fit`` after a
    ``validate`` left the root unit's parameters out of the step (they did not learn)."""
    expected, ref_out = reference
    got = _run(plan, tmp_path)
    assert not any(got["inference"])  # every evaluation step ran under no_grad instead
    for key in ("before", "val", "test", "predict"):
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    ref_weights, weights = torch.load(ref_out / "weights.pt"), torch.load(tmp_path / "weights.pt")
    assert ref_weights.keys() == weights.keys()
    assert max((ref_weights[k] - weights[k]).abs().max().item() for k in weights) <= 1e-5
