"""Host syncs per training step in the package's own code (the default path, colocated on 2 ranks).

On a GPU every ``.item()``, ``.tolist()``, ``int(t)``, ``float(t)`` or ``bool(t)`` of a device tensor
waits for the device. On the CPU nothing waits, so the test counts the calls themselves: each rank
patches those methods of ``torch.Tensor`` and counts the calls made from ``lightning_distmm/`` during
each step (Lightning's own, e.g. its progress bar, are not counted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from distmm_testing import DeepCLIP, TinyCLIP, loader, run_distmm

PACKAGE = str(Path(__file__).resolve().parents[1] / "lightning_distmm")
SYNCING = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


class CountHostSyncs(L.Callback):
    """Counts, per step, the calls of :data:`SYNCING` on tensors whose caller is in the package."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.steps: list[dict[str, int]] = []
        self._on = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name in SYNCING:
            original = getattr(torch.Tensor, name)

            def counted(t: torch.Tensor, *args: Any, _name: str = name, _original: Any = original) -> Any:
                if self._on:
                    caller = sys._getframe(1).f_code.co_filename
                    if caller.startswith(PACKAGE):
                        where = f"{Path(caller).name}:{sys._getframe(1).f_lineno} {_name}"
                        self.steps[-1][where] = self.steps[-1].get(where, 0) + 1
                return _original(t, *args)

            setattr(torch.Tensor, name, counted)

    def on_train_batch_start(self, *args: Any) -> None:
        self.steps.append({})
        self._on = True

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._on = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_host_syncs_per_step_in_the_default_path(tmp_path, precision):
    """Colocated on 2 ranks, 4 steps: before, 4 per step on every rank (the global batch size read from
    a tensor twice, ``executor.py``, the second time for the log's batch size; the flag of gradient
    terms outside ``contrastive_loss``, ``gradients.py`` ``.item()``; whether the upstream gradient
    is exactly 1, ``bool``). Now none: the batch size travels as a Python number, the upstream
    gradient multiplies the gradients whatever its value (exact when it is 1), and the flag is
    exchanged over a group of CPU collectives and read from host memory (``exchange.host_any``).
    The same under ``bf16-mixed``."""
    run_distmm(
        TinyCLIP(),
        "colocated",
        2,
        loader(8),
        4,
        str(tmp_path / "loss.json"),
        callbacks=[CountHostSyncs(tmp_path)],
        precision=precision,
    )
    for rank in range(2):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        counts = [sum(s.values()) for s in steps]
        print(f"{precision} rank {rank}: host syncs per step {counts}; steady state: {steps[-1]}")
        assert len(steps) == 4 and max(counts[1:]) == 0, steps
        assert not any("executor.py" in where for where in steps[-1]), steps[-1]


@pytest.mark.slow
def test_host_syncs_per_step_on_pipeline_stages(tmp_path):
    """Image in 2 stages over ranks 0 and 1 (3 microbatches), text on rank 1: before, every receive
    read its shape header back from the device (``pipeline.py``, 5 reads per tensor: 15 per step on
    each stage); the headers now travel on the host group, and no stage reads its device back."""
    import lightning_distmm as ldm

    plan = ldm.Plan(2, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 3}, "text": {"ranks": [1]}})
    run_distmm(DeepCLIP(), plan, 2, loader(9), 3, str(tmp_path / "loss.json"), callbacks=[CountHostSyncs(tmp_path)])
    for rank in range(2):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        counts = [sum(s.values()) for s in steps]
        print(f"rank {rank} (stage {rank}): host syncs per step {counts}; steady state: {steps[-1]}")
        assert len(steps) == 3 and max(counts[1:]) == 0, steps


@pytest.mark.slow
def test_host_syncs_per_step_in_an_encoder_llm_handoff_balanced_by_cost(tmp_path):
    """An encoder (2 replicas) feeding a language model on a third rank, each step's rows assigned by
    their cost: the assignment is computed from the batch's cost fields, which the loader keeps on
    the host, and the handoff's routes from it; no rank reads its device back."""
    from vlm_testing import SkewedVLMData, vlm_loader

    import lightning_distmm as ldm
    from lightning_distmm.models.vlm import VLM

    plan = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "llm": {"ranks": [2]}})
    cost = {"image": "n_images", "llm": {"n_images": 5, "n_tokens": 1}}
    run_distmm(
        VLM(cost=cost),
        plan,
        3,
        vlm_loader(6, data=SkewedVLMData),
        3,
        str(tmp_path / "loss.json"),
        callbacks=[CountHostSyncs(tmp_path)],
    )
    for rank in range(3):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        counts = [sum(s.values()) for s in steps]
        print(f"rank {rank}: host syncs per step {counts}; steady state: {steps[-1]}")
        assert len(steps) == 3 and max(counts[1:]) == 0, steps
