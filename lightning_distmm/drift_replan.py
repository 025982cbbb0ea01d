"""``DistMMStrategy(replan="drift")``: the job re-plans itself when its measured tower times drift.

Every ``every`` steps each rank sums its towers' forward and backward instruction spans over the
steps since the last check (the step trace: :class:`~lightning_distmm.parallel.timing.StepTrace`),
rank 0 gathers them and applies :class:`~lightning_distmm.planner.replan.DriftWatch` (what drifted,
the plans priced on the measurements, switch or keep), logs one line, and every rank learns the
answer. A switch goes through the resume path every plan change takes: the job saves a checkpoint
(``replan-step=<N>`` beside the run's checkpoints), ends this fit after the step, and the launcher
fits again from that checkpoint under the new plan (:class:`~lightning_distmm.lightning_seam.launchers.Refitting`),
the module rebuilt in place from a copy of it taken before the first plan cut it up (on the meta
device: the values come from the checkpoint). The module object the user holds is the one trained.

The first step of each fit is not measured (warm-up: the groups' first collectives, the
allocator); neither is a step Lightning accumulates into the next (its trace is partial).
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_distmm import lightning_seam as seam
from lightning_distmm.core.plan import Plan, PlanError
from lightning_distmm.core.schedule import Backward, Forward
from lightning_distmm.parallel.flops import tower_counts
from lightning_distmm.plan_choice import describe_host, producer_consumer

_log = logging.getLogger(__name__)


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters are on the meta device (no memory): buffers are
    copied as they are (small, and non-persistent ones are not in a checkpoint); Lightning's
    trainer reference is not copied (``LightningModule.__getstate__``)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(module, memo)


def rebuild_in_place(module: nn.Module, blueprint: nn.Module) -> None:
    """Make ``module`` a fresh copy of ``blueprint`` (its parameters on the meta device), keeping the
    object: the user's reference to the module stays the module that trains."""
    fresh = meta_copy(blueprint)
    module.__dict__.clear()
    module.__dict__.update(fresh.__dict__)


class DriftReplanner(pl.Callback):
    """The strategy's callback for ``replan="drift"`` (module docstring)."""

    def __init__(self, every: int = 50, margin: float = 0.10) -> None:
        from lightning_distmm.planner.replan import DriftWatch

        if int(every) < 2:
            raise ValueError(f"replan_every={every}: a check needs at least 2 steps (the first of a fit is warm-up)")
        if not 0 < float(margin) < 1:
            raise ValueError(f"replan_margin={margin}: a fraction between 0 and 1 (0.1: 10%)")
        self.every, self.margin = int(every), float(margin)
        self.watch = DriftWatch(self.margin)
        self.blueprint: nn.Module | None = None
        self.counted: dict[str, Any] | None = None  # rank 0: the towers' counts (CountedTower)
        self.host: Any = None
        #: ``(plan, checkpoint path)`` once a switch was decided, until the launcher fits again
        self.pending: tuple[Plan, str] | None = None
        self.switches: list[tuple[int, Plan, Plan]] = []
        self._traces: list[Any] = []  # the measured steps' traces since the last check
        self._times: list[float] = []
        self._started = 0.0
        self._switched_at: float | None = None
        self._warm = False
        self._last_step = 0

    # ------------------------------------------------------------------ the strategy's calls
    def prepare(self, strategy: Any, trainer: pl.Trainer, module: Any) -> None:
        """Before the plan cuts the module up (every fit's setup): keep the blueprint, count the
        towers on rank 0 (once) and put this callback among the trainer's."""
        towers = module.tower_specs()
        if producer_consumer(towers) is not None or any(t.consumes for t in towers.values()):
            raise PlanError(
                "replan='drift' re-plans towers that meet at a loss; a tower feeding another (an encoder"
                " and its language model) is not re-planned: leave replan unset"
            )
        if self.blueprint is None:
            self.blueprint = meta_copy(module)
        if self.counted is None and strategy.global_rank == 0:
            from lightning_distmm.planner.default import CountedTower

            with seam.random_state_kept(strategy.root_device):
                counts = tower_counts(towers, seam.example_batch(trainer))
            self.counted = {n: CountedTower(**c) for n, c in counts.items()}
            self.host = describe_host(strategy.root_device, max(1, strategy.num_processes))
        if self not in trainer.callbacks:
            trainer.callbacks.append(self)

    def refit(self, strategy: Any, module: nn.Module) -> str | None:
        """After a fit the switch ended: the new plan set on ``strategy``, ``module`` rebuilt;
        return the checkpoint to fit again from (None when no switch is pending)."""
        if self.pending is None:
            return None
        plan, path = self.pending
        self.pending = None
        strategy.plan = strategy._plan_spec = plan
        strategy.engine = None
        assert self.blueprint is not None
        rebuild_in_place(module, self.blueprint)
        return path

    # ------------------------------------------------------------------ Lightning's hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.engine.record_trace(True)
        if self._switched_at is not None:
            seconds, self._switched_at = time.perf_counter() - self._switched_at, None
            rank_zero_info(f"distmm: the switch took {seconds:.1f} s (checkpoint, the fit ended, setup, restore)")
        self._traces, self._times, self._warm = [], [], False
        self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        elapsed = time.perf_counter() - self._started
        step = trainer.strategy.engine.step
        # a whole step: the optimizer stepped (Lightning accumulates the others into the next one)
        whole = step is not None and step.trace is not None and trainer.global_step > self._last_step
        self._last_step = trainer.global_step
        if whole and self._warm:
            self._times.append(elapsed)
            self._traces.append(step.trace)  # read at the check: on a GPU, reading waits for the device
        self._warm = self._warm or whole
        if whole and trainer.global_step % self.every == 0 and self._traces:
            self._check(trainer, trainer.strategy)

    # ------------------------------------------------------------------ the check
    def _check(self, trainer: pl.Trainer, strategy: Any) -> None:
        from lightning_distmm.planner.replan import MeasuredTower

        window: dict[str, list[float]] = {}  # tower: forward seconds, backward seconds, forward calls
        for trace in self._traces:
            for ins, start, end in trace:
                if isinstance(ins, (Forward, Backward)):
                    sums = window.setdefault(ins.tower, [0.0, 0.0, 0.0])
                    sums[0 if isinstance(ins, Forward) else 1] += end - start
                    sums[2] += isinstance(ins, Forward)
        gathered: list[Any] = [None] * strategy.world_size
        dist.all_gather_object(gathered, (window, len(self._traces), statistics.median(self._times)))
        answer = None
        if strategy.global_rank == 0:
            steps = gathered[0][1]
            batch = int(seam.train_batch_size(trainer) or strategy.plan.global_batch)
            measured = {}
            for name in strategy.plan.towers:
                f = sum(w[0].get(name, [0.0])[0] for w in gathered)
                b = sum(w[0].get(name, [0.0, 0.0])[1] for w in gathered)
                calls = int(sum(w[0].get(name, [0.0, 0.0, 0.0])[2] for w in gathered))
                measured[name] = MeasuredTower(f, b, steps * batch, calls)
            precision = str(getattr(strategy.precision_plugin, "precision", "32-true"))
            found = self.watch.check(
                trainer.global_step, measured, gathered[0][2], self.counted, strategy.plan, self.host, batch, precision
            )
            rank_zero_info(found.line())
            answer = found.switch_to.to_dict() if found.switch_to is not None else None
        answer = strategy.broadcast(answer, src=0)
        self._traces, self._times = [], []
        if answer is not None:
            self._switch(trainer, strategy, Plan.from_dict(answer))

    def _switch(self, trainer: pl.Trainer, strategy: Any, plan: Plan) -> None:
        callback = trainer.checkpoint_callback
        folder = getattr(callback, "dirpath", None) or Path(trainer.default_root_dir) / "checkpoints"
        path = str(Path(folder) / f"replan-step={trainer.global_step}")
        self._switched_at = time.perf_counter()
        trainer.save_checkpoint(path)
        self.switches.append((trainer.global_step, strategy.plan, plan))
        self.pending = (plan, path)
        trainer.should_stop = True
        rank_zero_info(
            f"distmm: re-planning at step {trainer.global_step}: saved {path}; continuing under the new plan"
        )


__all__ = ["DriftReplanner", "meta_copy", "rebuild_in_place"]
