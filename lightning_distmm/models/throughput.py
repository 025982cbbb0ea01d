"""Throughput counted once per global sample, and per-tower forward / backward time.

Under distmm every rank steps through the same global batches: the image ranks and the text
ranks all take part in each sample. A counter that adds up each rank's samples and multiplies by
the world size (Lightning's :class:`~lightning.pytorch.callbacks.ThroughputMonitor`, whose global
``samples_per_sec`` is rank 0's ``device/samples_per_sec`` times ``world_size``) therefore reports
``world_size`` times the samples a single process would count for the same batches and step time.

:class:`Throughput` logs ``train/samples_per_sec`` = samples of the global batches / wall time of
the steps, the number one process reports for the same global batch and step time, plus
``train/step_time`` and, under distmm, each tower's forward and backward seconds per step (from the
runtime's instruction trace; the slowest replica's, since the step waits for it) and the batch-sync's.

Using Lightning's ``ThroughputMonitor`` under distmm instead: give it :func:`per_device_share` as
``batch_size_fn``. It returns the global batch divided by the world size for a distmm batch (and
the batch's own length otherwise, which is right for one process and for DDP), so that its
``device/samples_per_sec`` is each rank's share of the global samples and its ``samples_per_sec``
(``device/... x world_size``) is the global rate::

    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning_distmm.models.throughput import Throughput, per_device_share

    callbacks = [Throughput()]                                      # or:
    callbacks = [ThroughputMonitor(batch_size_fn=per_device_share)]  # needs a logger; logs every log_every_n_steps

Not both: they log the same key, ``train/samples_per_sec`` (each would overwrite the other's), so
:class:`Throughput` refuses to run beside a ``ThroughputMonitor``. ``ThroughputMonitor``'s global
``batches_per_sec`` is ``device/batches_per_sec x world_size``; under distmm every rank steps through
every global batch, so it reads ``world_size`` times the step rate: the step rate is its
``device/batches_per_sec`` (or ``1 / train/step_time`` here).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_distmm.core.layout import GLOBAL_BATCH_KEY
from lightning_distmm.core.schedule import Backward, BatchSync, Forward
from lightning_distmm.parallel.step.engine import StepEngine


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def per_device_share(batch: Any) -> float:
    """``batch_size_fn`` for Lightning's ``ThroughputMonitor``: this device's share of the samples.

    A batch from the distmm loader carries its global batch size (every rank holds only its rows
    of it): the share is that size over the world size, so that ``ThroughputMonitor``'s
    ``samples_per_sec`` (the share x world size) counts each global sample once. Any other batch
    (one process, DDP: each device holds its own samples) counts its own rows.
    """
    if isinstance(batch, Mapping):
        if GLOBAL_BATCH_KEY in batch:
            return int(batch[GLOBAL_BATCH_KEY]) / _world_size()
        first = next(v for v in batch.values() if hasattr(v, "__len__"))
        return len(first)
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)


class Throughput(L.Callback):
    """Logs ``train/samples_per_sec`` counted once per global sample, the step time and per-tower times.

    A step's time is the wall time from the end of the previous training step (or from the start of
    this one after the start of training or a validation) to the end of this one: the forward and
    backward passes, the feature exchange, the optimizer step and the loading of the batch, as
    Lightning's ``ThroughputMonitor`` measures. ``samples_per_sec`` is the global batches' samples
    (``pl_module.global_batch_size(batch)``, the same number under every strategy) over the time
    of the last ``window`` steps: ``global batch / step time`` with ``window=1``.

    Every rank logs its own measurement without a collective (the ranks of a distmm step finish
    together: the batch-sync makes them wait for each other); loggers and the progress bar show
    rank 0's. Under distmm the per-tower times (``train/time/<tower>/forward``, ``.../backward``,
    ``train/time/batch_sync``: seconds of this step's instructions, the slowest rank's) are read on
    the steps Lightning logs (every ``log_every_n_steps``-th): one small all-reduce (max) on every
    rank, and on a GPU one wait for the step's timing events; the other steps wait for nothing.

    Args:
        window: steps averaged over (samples and seconds summed over the window).
        prog_bar: show ``train/samples_per_sec`` in the progress bar.
        tower_times: record and log per-tower times under distmm (``StepEngine.record_trace``: CUDA
            events on a GPU, read after the step).
    """

    def __init__(self, window: int = 10, prog_bar: bool = True, tower_times: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self.prog_bar = prog_bar
        self.tower_times = tower_times
        self._steps: deque[tuple[float, float]] = deque(maxlen=self.window)  # (samples, seconds) per step
        self._t0: float | None = None
        #: the last step's values, also for inspection: samples (global), seconds, samples/s
        self.last: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.callbacks import ThroughputMonitor

        if any(isinstance(c, ThroughputMonitor) for c in trainer.callbacks):
            raise ValueError(
                "Throughput and Lightning's ThroughputMonitor both log train/samples_per_sec, so one would overwrite"
                " the other's: keep one (the recipe: callbacks.throughput=null to keep ThroughputMonitor)"
            )

    # ------------------------------------------------------------------ timing
    def _engine(self, trainer: L.Trainer) -> StepEngine | None:
        """The distmm step engine when per-tower times are asked for (None under other strategies)."""
        engine = getattr(trainer.strategy, "engine", None) if self.tower_times else None
        return engine if isinstance(engine, StepEngine) else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._steps.clear()
        self._t0 = None
        engine = self._engine(trainer)
        if engine is not None:
            engine.record_trace(True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = self._engine(trainer)
        if engine is not None:
            engine.record_trace(False)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = None  # validation is not training time: the next step is timed from its start

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        seconds = now - (self._t0 if self._t0 is not None else now)
        self._t0 = now
        count = getattr(pl_module, "global_batch_size", None)  # DistMMMixin: the same number under every strategy
        samples = float(count(batch) if callable(count) else per_device_share(batch))
        self._steps.append((samples, seconds))
        total_samples = sum(s for s, _ in self._steps)
        total_seconds = sum(t for _, t in self._steps)
        rate = total_samples / total_seconds if total_seconds > 0 else 0.0
        self.last = {"samples": samples, "seconds": seconds, "samples_per_sec": rate}
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("train/samples_per_sec", rate, prog_bar=self.prog_bar, **log)
        pl_module.log("train/step_time", seconds, **log)
        # the steps Lightning writes to its loggers: after this batch's optimizer step, global_step is
        # the count Lightning's logger connector tests (its batches that stepped, plus this one)
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0 or trainer.should_stop:
            for name, value in self._tower_times(trainer).items():
                pl_module.log(f"train/time/{name}", value, **log)

    def _tower_times(self, trainer: L.Trainer) -> dict[str, float]:
        """This step's seconds per tower and direction, the max over ranks (collective under distmm)."""
        engine = self._engine(trainer)
        trace = engine.step.trace if engine is not None and engine.step is not None else None
        if engine is None or trace is None:
            return {}
        names = [f"{tower}/{kind}" for tower in engine.plan.towers for kind in ("forward", "backward")]
        names.append("batch_sync")
        seconds = dict.fromkeys(names, 0.0)
        for ins, start, end in trace:
            if isinstance(ins, Forward):
                seconds[f"{ins.tower}/forward"] += end - start
            elif isinstance(ins, Backward):
                seconds[f"{ins.tower}/backward"] += end - start
            elif isinstance(ins, BatchSync):
                seconds["batch_sync"] += end - start
        values = torch.tensor([seconds[n] for n in names], dtype=torch.float64)
        if _world_size() > 1:  # every rank holds only its towers' times: the step waits for the slowest
            values = values.to(trainer.strategy.root_device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return dict(zip(names, values.cpu().tolist()))


__all__ = ["Throughput", "per_device_share"]
