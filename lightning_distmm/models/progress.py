"""A progress bar that is right for runs bounded by ``max_steps`` and for streams.

Lightning's bar counts an epoch's batches: with ``max_steps=200`` on a 781-batch epoch it stops at
``200/781`` and never fills; over a stream (no length, ``max_epochs`` unbounded) it reads ``Epoch
1/-2``; and it shows the logger's ``v_num`` (``0.000`` with Rich's float formatting), which says
nothing about the run. This bar's total is the batches the run will really train this epoch (the
epoch's, or fewer when ``max_steps`` ends it first, or those ``max_steps`` leaves for a stream), its
description names the last epoch only when there is one, and it drops ``v_num``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE


class _StepBounded:
    """What the Rich and the tqdm bars share (mixed in before Lightning's class)."""

    _epoch_start_step = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start_step = int(trainer.global_step)
        super().on_train_epoch_start(trainer, pl_module)  # type: ignore[misc]

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer  # type: ignore[attr-defined]
        total = trainer.num_training_batches  # (Lightning's own bound, for max_epochs=-1 only, forgets accumulation)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            accumulate = int(trainer.accumulate_grad_batches or 1)
            left = max(0, (int(trainer.max_steps) - self._epoch_start_step) * accumulate)
            total = left if total is None or math.isinf(total) else min(total, left)
        return total

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        items.pop("v_num", None)
        return items


class StepRichProgressBar(_StepBounded, RichProgressBar):
    """Lightning's Rich bar, bounded by ``max_steps``; ``Epoch N/last`` only when there is a last epoch."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        if len(self.validation_description) > len(description):
            description = f"{description:{len(self.validation_description)}}"
        return description


class StepTQDMProgressBar(_StepBounded, TQDMProgressBar):
    """Lightning's tqdm bar, bounded by ``max_steps``."""


def progress_bar() -> RichProgressBar | TQDMProgressBar:
    """The bar Lightning would choose (Rich when installed, else tqdm), bounded by ``max_steps``."""
    return StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()


__all__ = ["StepRichProgressBar", "StepTQDMProgressBar", "progress_bar"]
