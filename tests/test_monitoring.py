"""Monitoring in the recipe: the progress bar right for ``max_steps`` and streams (no
``200/781``, no ``Epoch 1/-2``, no ``v_num``), one samples/s key, ``strategy=single``'s threads, the
parameter line with CoCa's decoder, ``logger: null`` writing nothing."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from lightning_distmm.models.clip import CLIPModel
from lightning_distmm.models.progress import StepRichProgressBar, StepTQDMProgressBar
from lightning_distmm.models.throughput import Throughput

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import train  # noqa: E402


def _bar(cls, batches: float, max_steps: int, max_epochs: int | None, step: int = 0, accumulate: int = 1):
    bar = cls()
    bar._trainer = SimpleNamespace(
        num_training_batches=batches,
        max_steps=max_steps,
        max_epochs=max_epochs,
        accumulate_grad_batches=accumulate,
        global_step=step,
    )
    bar._epoch_start_step = step
    return bar


@pytest.mark.parametrize("cls", [StepRichProgressBar, StepTQDMProgressBar])
def test_the_bar_fills_at_max_steps_and_counts_a_streams_steps(cls):
    assert _bar(cls, 781, 200, 1).total_train_batches == 200  # was 781: the bar never filled
    assert _bar(cls, 781, 1000, 2, step=781).total_train_batches == 219  # the second epoch: what is left
    assert _bar(cls, 10, 200, 20).total_train_batches == 10  # a short epoch: the epoch's batches
    assert _bar(cls, float("inf"), 50, -1, accumulate=2).total_train_batches == 100  # a stream: max_steps' batches
    assert _bar(cls, 781, -1, 3).total_train_batches == 781  # no max_steps: Lightning's count


def test_the_description_names_a_last_epoch_only_when_there_is_one():
    assert _bar(StepRichProgressBar, float("inf"), 50, -1)._get_train_description(1).strip() == "Epoch 1"  # was 1/-2
    assert _bar(StepRichProgressBar, 781, 200, 1)._get_train_description(0).strip() == "Epoch 0/0"


def test_the_bar_shows_no_v_num(tmp_path):
    seen = {}

    class Peek(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):  # type: ignore[no-untyped-def]
            seen.update(trainer.progress_bar_callback.get_metrics(trainer, pl_module))

    from distmm_testing import TinyCLIP, loader

    trainer = L.Trainer(
        max_steps=2,
        logger=CSVLogger(tmp_path),
        callbacks=[StepTQDMProgressBar(), Peek()],
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(TinyCLIP(), loader(8))
    assert "train/loss" in seen and "v_num" not in seen


def test_throughput_refuses_to_run_beside_throughput_monitor():
    trainer = SimpleNamespace(callbacks=[Throughput(), ThroughputMonitor(batch_size_fn=len)])
    with pytest.raises(ValueError, match="both log train/samples_per_sec"):
        trainer.callbacks[0].setup(trainer, None, "fit")
    Throughput().setup(SimpleNamespace(callbacks=[]), None, "fit")


def test_strategy_single_takes_the_threads_of_one_rank_of_the_run_it_is_compared_with(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        cpus = len(os.sched_getaffinity(0))
        train.set_threads(OmegaConf.create({"threads": None}), 2)
        assert torch.get_num_threads() == max(1, cpus // 2) and os.environ["OMP_NUM_THREADS"] == str(max(1, cpus // 2))
        train.set_threads(OmegaConf.create({"threads": 3}), 2)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(2)
        train.set_threads(OmegaConf.create({"threads": None}), 2)  # the user's OMP_NUM_THREADS wins
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_parameter_line_counts_cocas_decoder():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["out_dir=/tmp/unused", "experiment=coca_shapes"])
    model = CLIPModel(cfg.model, cfg.optim)
    line = train.parameter_line(cfg, model, {"devices": 2}, Path("/tmp/unused"))
    decoder = sum(p.numel() for p in model.decoder.parameters())
    assert f"decoder {decoder:,}" in line and decoder > 100_000
    image, text = (sum(p.numel() for p in m.parameters()) for m in (model.visual, model.text))
    assert f"{image + text + decoder + model.logit_scale.numel():,} parameters" in line
