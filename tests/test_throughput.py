"""Throughput counted once per global sample: distmm logs what one process counts for the same global
batch and step time; Lightning's ThroughputMonitor is right under distmm with ``per_device_share``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from distmm_testing import TinyCLIP, in_subprocess, loader, trainer_kwargs
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

import lightning_distmm as ldm
from lightning_distmm.core.layout import GLOBAL_BATCH_KEY
from lightning_distmm.models.throughput import Throughput, per_device_share

BATCH, STEPS = 8, 4
TWO_RANKS = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})


class StepRecorder(L.Callback):
    """After :class:`Throughput` (listed before it): each step's counted samples, seconds, logged rate, per rank."""

    def __init__(self, throughput: Throughput, folder: Path) -> None:
        self.throughput, self.folder, self.rows = throughput, folder, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        self.rows.append({**self.throughput.last, "logged": logged})
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


class MemoryLogger(Logger):
    """Every metrics dict Lightning logs on rank 0, written to a JSON file (the other ranks' calls are
    dropped, as Lightning's own loggers drop them: they would overwrite the file)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path, self.records = path, []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append({k: float(v) for k, v in metrics.items()})
        self.path.write_text(json.dumps(self.records))


def _fit(folder: Path, devices: int, strategy: Any, callbacks: list, **extra: Any) -> None:
    L.seed_everything(0)
    trainer = L.Trainer(
        devices=devices, max_steps=STEPS, strategy=strategy, callbacks=callbacks, **trainer_kwargs(**extra)
    )
    trainer.fit(TinyCLIP("sgd", lr=0.05), loader(BATCH))


def _run_throughput(folder: Path, distributed: bool) -> None:
    folder.mkdir()
    throughput = Throughput(window=1)
    strategy = ldm.DistMMStrategy(plan=TWO_RANKS, start_method="fork") if distributed else "auto"
    # tower times are read on the steps Lightning logs: every step here
    _fit(folder, 2 if distributed else 1, strategy, [throughput, StepRecorder(throughput, folder)], log_every_n_steps=1)


def _check_steps(rows: list[dict]) -> None:
    assert len(rows) == STEPS
    for row in rows:
        assert row["samples"] == BATCH  # the global batch, once: not per rank, not the rank's rows
        assert row["seconds"] > 0
        assert row["samples_per_sec"] == pytest.approx(BATCH / row["seconds"], rel=1e-9)
        assert row["logged"]["train/samples_per_sec"] == pytest.approx(row["samples_per_sec"], rel=1e-6)
        assert row["logged"]["train/step_time"] == pytest.approx(row["seconds"], rel=1e-6)


def test_per_device_share():
    distmm_batch = {"image": torch.zeros(6, 3), GLOBAL_BATCH_KEY: torch.tensor(10)}
    assert per_device_share(distmm_batch) == 10  # one process: world size 1
    assert per_device_share({"image": torch.zeros(6, 3), "ids": torch.zeros(6, 2)}) == 6  # DDP / one process
    assert per_device_share((torch.zeros(5, 2), torch.zeros(5))) == 5
    with pytest.raises(ValueError, match="window"):
        Throughput(window=0)


@pytest.mark.slow
def test_samples_per_sec_is_global_batch_over_step_time(tmp_path):
    """One process and distmm (image on rank 0, text on rank 1) count the same samples: each logs
    global batch / step time, and every distmm rank counts the global batch once."""
    in_subprocess(lambda: _run_throughput(tmp_path / "one", distributed=False), timeout=240)
    in_subprocess(lambda: _run_throughput(tmp_path / "dist", distributed=True), timeout=240)
    _check_steps(json.loads((tmp_path / "one" / "rank0.json").read_text()))
    for rank in (0, 1):
        rows = json.loads((tmp_path / "dist" / f"rank{rank}.json").read_text())
        _check_steps(rows)
        for row in rows:  # per-tower times of the step, the same on every rank (max over ranks)
            times = {k: v for k, v in row["logged"].items() if k.startswith("train/time/")}
            assert set(times) == {f"train/time/{t}/{d}" for t in ("image", "text") for d in ("forward", "backward")} | {
                "train/time/batch_sync"
            }
            assert all(v > 0 for v in times.values()), times
            assert sum(times.values()) <= row["seconds"] * 2  # the towers overlap on their own ranks
    dist0 = json.loads((tmp_path / "dist" / "rank0.json").read_text())
    dist1 = json.loads((tmp_path / "dist" / "rank1.json").read_text())
    for a, b in zip(dist0, dist1):
        assert {k: v for k, v in a["logged"].items() if "/time/" in k} == {
            k: v for k, v in b["logged"].items() if "/time/" in k
        }


@pytest.mark.slow
def test_lightning_throughput_monitor_with_per_device_share(tmp_path):
    """ThroughputMonitor(batch_size_fn=per_device_share) under distmm counts each global sample once."""
    out = tmp_path / "metrics.json"

    def run() -> None:
        monitor = ThroughputMonitor(batch_size_fn=per_device_share, window_size=2)
        strategy = ldm.DistMMStrategy(plan=TWO_RANKS, start_method="fork")
        _fit(tmp_path, 2, strategy, [monitor], logger=MemoryLogger(out), log_every_n_steps=1)

    in_subprocess(run, timeout=240)
    records = [r for r in json.loads(out.read_text()) if "train/samples" in r]
    assert len(records) == STEPS
    last = records[-1]
    assert last["train/samples"] * 2 == pytest.approx(STEPS * BATCH)  # the share x world size = global samples
    assert last["train/samples_per_sec"] == pytest.approx(2 * last["train/device/samples_per_sec"])
    # the global rate is global samples / time over the window: (BATCH per step) / seconds per step
    two_steps = records[-1]["train/time"] - records[-2]["train/time"]
    assert last["train/samples_per_sec"] == pytest.approx(BATCH / two_steps, rel=1e-6)


@pytest.mark.slow
def test_tower_times_reach_the_logger_in_every_epoch(tmp_path):
    """Tower times are read on the steps Lightning logs, counted over the whole fit: with 3 batches
    per epoch and log_every_n_steps=2 the logged steps fall at batch 1 of epoch 0, batch 0 of epoch 1
    and so on (a count of batches within an epoch would miss every one after the first epoch)."""
    out = tmp_path / "metrics.json"

    def run() -> None:
        L.seed_everything(0)
        strategy = ldm.DistMMStrategy(plan=TWO_RANKS, start_method="fork")
        trainer = L.Trainer(
            devices=2,
            max_steps=6,
            strategy=strategy,
            callbacks=[Throughput(window=1)],
            **trainer_kwargs(logger=MemoryLogger(out), log_every_n_steps=2),
        )
        trainer.fit(TinyCLIP("sgd", lr=0.05), loader(BATCH, size=3 * BATCH))

    in_subprocess(run, timeout=240)
    logged = [r for r in json.loads(out.read_text()) if "train/samples_per_sec" in r]
    with_times = [r for r in logged if "train/time/image/forward" in r]
    assert len(logged) == 3 and len(with_times) == 3, logged
