"""CoCa's two loss terms logged apart (``train/contrastive_loss``, ``train/caption_loss``): under
distmm the ranks' row shares are summed, so the logged terms equal one process's and weight up to
``train/loss``; the recipe's parameter line counts the decoder."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from distmm_testing import in_subprocess, loader, run_distmm, trainer_kwargs
from test_coca import TINY_COCA, SGDCoCa

import lightning_distmm as ldm

KEYS = ("train/loss", "train/contrastive_loss", "train/caption_loss")


class TermRecorder(L.Callback):
    def __init__(self, path: str) -> None:
        self.path, self.rows = path, []

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:  # type: ignore[no-untyped-def]
        self.rows.append([float(trainer.callback_metrics[k]) for k in KEYS])
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.rows))


def run_reference(module: L.LightningModule, steps: int, path: str) -> None:
    trainer = L.Trainer(devices=1, max_steps=steps, callbacks=[TermRecorder(path)], **trainer_kwargs())
    trainer.fit(module, loader(10))


def test_one_process_logs_both_terms_that_weight_up_to_the_loss(tmp_path):
    L.seed_everything(0)
    run_reference(SGDCoCa(TINY_COCA), 2, str(tmp_path / "t.json"))
    for loss, contrastive, caption in json.loads((tmp_path / "t.json").read_text()):
        assert contrastive > 0 and caption > 0
        assert loss == pytest.approx(1.0 * contrastive + 2.0 * caption, abs=1e-6)  # CoCa's default weights


@pytest.mark.slow
def test_distmm_logs_the_whole_batch_terms_one_process_logs(tmp_path):
    """Image on rank 0, text on rank 1: each rank decodes half the rows; the logged terms are the sums."""

    def run() -> None:
        L.seed_everything(0)
        reference = SGDCoCa(TINY_COCA)
        module = copy.deepcopy(reference)
        run_reference(reference, 3, str(tmp_path / "rt.json"))
        plan = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})
        terms = [TermRecorder(str(tmp_path / "dt.json"))]
        run_distmm(module, plan, 2, loader(10), 3, str(tmp_path / "d.json"), callbacks=terms)
        ref, dist = (json.loads((tmp_path / f).read_text()) for f in ("rt.json", "dt.json"))
        assert len(ref) == len(dist) == 3
        for a, b in zip(ref, dist):
            assert b == pytest.approx(a, abs=1e-5)
            assert b[0] == pytest.approx(b[1] + 2.0 * b[2], abs=1e-5)

    in_subprocess(run)
