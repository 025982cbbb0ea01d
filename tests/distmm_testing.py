"""Tiny real towers (timm ViT, transformers CLIP text) and data for the distmm tests.

Importable by spawned/forked workers; a few thousand parameters so that 4 gloo ranks on 2 cores
finish in seconds.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.models import tiny
from lightning_distmm.models.tiny import quiet_trainer_kwargs, tiny_vit

EMBED = 8
VOCAB = 20
SEQ = 6


class TinyText(tiny.TinyText):
    """The tests' text tower: width 16, ``layers`` layers of 2 heads, the key bias frozen."""

    def __init__(self, layers: int = 1) -> None:
        super().__init__(VOCAB, SEQ, width=16, embed=EMBED, layers=layers)


class TinyCLIP(ldm.DistMMMixin, L.LightningModule):
    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, frozen_text: bool = False) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.lr = lr
        self.frozen_text = frozen_text
        self.visual = tiny_vit(8, 4, width=16, depth=1, heads=2, embed=EMBED)
        self.text = TinyText()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def towers(self) -> dict[str, ldm.Tower]:
        return {
            "image": ldm.Tower(self.visual, input="image"),
            "text": ldm.Tower(self.text, input=["input_ids", "attention_mask"], frozen=self.frozen_text),
        }

    def interaction_loss(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        return ldm.losses.clip_loss(features["image"], features["text"], self.logit_scale)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


class PairData(ldm.FieldDataset):
    """Random image / token pairs, deterministic per index; counts what it decodes."""

    fields = ("image", "input_ids", "attention_mask")

    def __init__(self, size: int = 64, log: str | None = None) -> None:
        self.size = size
        self.log = log

    def __len__(self) -> int:
        return self.size

    def load(self, index: int, fields: Any) -> dict[str, Any]:
        g = torch.Generator().manual_seed(index)
        image = torch.randn(3, 8, 8, generator=g)
        ids = torch.randint(1, VOCAB - 2, (SEQ,), generator=g)
        length = 2 + index % (SEQ - 2)
        ids[length - 1] = VOCAB - 1
        ids[length:] = 0
        mask = (torch.arange(SEQ) < length).long()
        full = {"image": image, "input_ids": ids, "attention_mask": mask}
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps([index, sorted(fields)]) + "\n")
        return {k: full[k] for k in fields}


class LossRecorder(L.Callback):
    """Writes the logged train loss of every step to a JSON file (rank 0)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.losses))


def loader(batch: int, size: int = 64, log: str | None = None, shuffle: bool = False) -> DataLoader:
    return DataLoader(PairData(size, log), batch_size=batch, shuffle=shuffle, drop_last=True)


def trainer_kwargs(**extra: Any) -> dict[str, Any]:
    return quiet_trainer_kwargs(**{"accelerator": "cpu", **extra})


def run_distmm(
    module: L.LightningModule,
    plan: Any,
    devices: int,
    data: DataLoader,
    steps: int,
    loss_file: str,
    callbacks: list | None = None,
    ckpt_path: str | None = None,
    **extra: Any,
) -> L.Trainer:
    """Fit ``module`` under distmm with the fork launcher; the parent's module gets the trained weights."""
    trainer = L.Trainer(
        devices=devices,
        max_steps=steps,
        strategy=plan if isinstance(plan, ldm.DistMMStrategy) else ldm.DistMMStrategy(plan=plan, start_method="fork"),
        callbacks=[LossRecorder(loss_file), *(callbacks or [])],
        **trainer_kwargs(**extra),
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def run_reference(module: L.LightningModule, data: DataLoader, steps: int, loss_file: str, **extra: Any) -> L.Trainer:
    trainer = L.Trainer(devices=1, max_steps=steps, callbacks=[LossRecorder(loss_file)], **trainer_kwargs(**extra))
    trainer.fit(module, data)
    return trainer


@contextlib.contextmanager
def rank0_log(path: Path) -> Any:
    """Lightning's INFO lines (rank 0's ``rank_zero_info``) written to ``path`` while the block runs:
    forked ranks inherit the handler; other tests may have quieted the console."""
    log, handler = logging.getLogger("lightning.pytorch"), logging.FileHandler(path)
    loggers = [log, logging.getLogger("lightning.pytorch.utilities.rank_zero")]
    levels = [x.level for x in loggers]
    log.addHandler(handler)
    for x in loggers:
        x.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        for x, level in zip(loggers, levels, strict=True):
            x.setLevel(level)
        handler.close()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def read_losses(path: str | Path) -> list[float]:
    return json.loads(Path(path).read_text())


class DeepCLIP(TinyCLIP):
    """Two ViT blocks (4 heads) and two text layers: both towers can be cut into two stages and sharded in two."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.visual = tiny_vit(8, 4, width=16, depth=2, heads=4, embed=EMBED)
        self.text = TinyText(layers=2)


class GroupedDeepCLIP(DeepCLIP):
    """The loss of the distmm schedule: two sync groups of rows, each with its own negatives."""

    sync_groups = 2


@dataclass
class Comparison:
    """One module trained twice on the same global batches: in one process and under distmm."""

    reference: nn.Module
    distributed: nn.Module
    initial: nn.Module
    reference_losses: list[float]
    distributed_losses: list[float]

    def assert_exact(self, tol: float = 1e-5) -> None:
        """Same weights and same logged losses, and the weights really moved (not trivially equal)."""
        assert max_param_diff(self.reference, self.distributed) <= tol
        assert len(self.distributed_losses) == len(self.reference_losses) > 0
        assert self.distributed_losses == pytest.approx(self.reference_losses, abs=tol)
        assert max_param_diff(self.reference, self.initial) > 1e-3


def compare_with_reference(
    make: Callable[[], L.LightningModule], plan: Any, devices: int, batch: int, steps: int, tmp_path: Path, **extra: Any
) -> Comparison:
    L.seed_everything(0)
    reference = make()
    module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
    run_reference(reference, loader(batch), steps, str(tmp_path / "ref.json"), **extra)
    run_distmm(module, plan, devices, loader(batch), steps, str(tmp_path / "dist.json"), **extra)
    return Comparison(
        reference, module, initial, read_losses(tmp_path / "ref.json"), read_losses(tmp_path / "dist.json")
    )


def compare_accumulating_and_clipping(plan: Any, optimizer: str, tmp_path: Path) -> Comparison:
    """TinyCLIP (``optimizer``: sgd at lr 0.05, adamw at 0.01) under ``plan`` on 3 ranks against the
    reference, batch 8 for 3 optimizer steps of 2 accumulated batches, clipped at a global norm of
    0.05 (active: the whole model's gradient norm is above it)."""
    lr = 0.05 if optimizer == "sgd" else 0.01
    return compare_with_reference(
        lambda: TinyCLIP(optimizer, lr=lr), plan, 3, 8, 3, tmp_path, accumulate_grad_batches=2, gradient_clip_val=0.05
    )


def recipe_stream_datamodule(experiment: str, train_dir: str | Path, val_dir: str | Path) -> tuple[Any, Any]:
    """``recipes/train.py``'s config for ``experiment`` over a stream of 10 training pairs and 4
    held-out ones at a global batch of 4, and the DataModule it builds; checks their sizes, that
    retrieval reads the held-out pairs, and the first batch's shapes (32-pixel images, 16 tokens)."""
    import sys

    from hydra import compose, initialize_config_dir

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "recipes"))
    import train

    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        overrides = [f"experiment={experiment}", f"data.train={train_dir}", f"data.val={val_dir}", "data.batch_size=4"]
        cfg = compose(config_name="train", overrides=["out_dir=/tmp/unused", *overrides])
    dm = train.build_data(cfg, 4)
    assert len(dm.train_dataset) == 10 and len(dm.val_dataset) == 4 and dm.retrieval_dataset is dm.val_dataset
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (4, 3, 32, 32) and batch["input_ids"].shape == (4, 16)
    return cfg, dm


def in_subprocess(fn: Callable[[], None], timeout: float = 300) -> None:
    """Run ``fn`` in a forked process group; a hang past ``timeout`` fails the test (and is killed)."""
    ctx = mp.get_context("fork")
    errors = ctx.Queue()

    def main() -> None:
        os.setsid()
        # the test process's objects stay out of this child's collections: traversing them costs 0.5-1 s
        # per collection and copies the pages it touches (the fork launcher does the same for its ranks)
        gc.freeze()
        try:
            fn()
            errors.put(None)
        except BaseException:
            errors.put(traceback.format_exc())

    p = ctx.Process(target=main)
    p.start()
    p.join(timeout)
    if p.is_alive():
        os.killpg(p.pid, signal.SIGKILL)
        p.join()
        pytest.fail(f"the run did not finish in {timeout}s: a hang")
    error = errors.get(timeout=5)
    assert error is None, error


def run_recipe(script: str, *args: str) -> subprocess.CompletedProcess:
    """``recipes/<script>`` with ``args`` in a fresh interpreter (no rendezvous address inherited from
    an earlier run in this process), which must succeed."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run(
        [sys.executable, str(root / "recipes" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run
