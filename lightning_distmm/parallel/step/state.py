"""The state of one training step on a rank, passed explicitly from the step's start to its backward.

A step starts when Lightning starts a training batch; :class:`StepState` then carries what is
decided there (does Lightning zero the gradients after this ``training_step``: ``zero_after``)
and where Lightning decides it (does this step's backward end with the gradient sums:
``ends_with_sums``, off while Lightning accumulates), and, when traced, its instructions' spans.
The engine's :meth:`~lightning_distmm.parallel.step.engine.StepEngine.run` takes it as an argument
and records one :class:`ScheduleRun` in it per call (the rank batch and rows, the instruction list,
the gradients set aside and produced, the sums posted); its ``backward`` hands those gradients
back, scaled by the upstream gradient that autograd recorded in the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_distmm.core.layout import RankBatch
from lightning_distmm.core.schedule import Forward, Instruction
from lightning_distmm.parallel.exchange import PendingGather, PendingSum
from lightning_distmm.parallel.pipeline import PendingSend
from lightning_distmm.parallel.timing import StepTrace

#: a parameter and a gradient tensor of it, taken out of ``.grad``
Gradients = list[tuple[nn.Parameter, Tensor]]


@dataclass
class Microbatch:
    """A microbatch on this rank's stage: its input activation (None on the first stage), batch rows,
    and either its output with the graph (kept) or the RNG state to recompute it (cached)."""

    input: Tensor | None
    rows: Mapping[str, Any]
    output: Tensor | None
    rng: tuple[Tensor, Tensor | None] | None


@dataclass
class ScheduleRun:
    """One run of this rank's instruction list (one :meth:`StepEngine.run`) and what it leaves for the backward.

    ``rows[tower, mb]`` are the microbatch's rows of this rank's batch (each sync group's rows of the
    replica, cut in microbatch order), ``sync_group_of`` its sync group, ``last[tower]`` whether this rank
    is the tower's last stage. ``records``, ``outputs`` and ``feature_grads`` live while the list
    runs. ``set_aside`` holds the gradients from before the run (restored when it ends),
    ``produced`` the gradients it made (handed back in the backward, times ``scale``, the gradient
    that reached the returned loss), ``sums`` the gradient sums its ``GradSync`` posted.
    """

    instructions: list[Instruction]
    batch: RankBatch
    rows: dict[tuple[str, int], slice] = field(default_factory=dict)
    sync_group_of: dict[tuple[str, int], int] = field(default_factory=dict)
    last: dict[str, bool] = field(default_factory=dict)
    records: dict[tuple[str, int], Microbatch] = field(default_factory=dict)
    outputs: dict[tuple[int, str], list[Tensor]] = field(default_factory=dict)
    feature_grads: dict[tuple[str, int], Tensor] = field(default_factory=dict)
    loss: Tensor = field(default_factory=lambda: torch.zeros(()))
    set_aside: Gradients = field(default_factory=list)
    produced: Gradients = field(default_factory=list)
    sums: list[PendingSum] | None = None  # None: the sums are left for the optimizer step's backward
    scale: Tensor | None = None
    #: the run's pipeline sends in flight, and its batch-sync gathers in flight by sync group
    sends: list[PendingSend] = field(default_factory=list)
    gathers: dict[int, PendingGather] = field(default_factory=dict)
    #: bytes of stage-boundary activations the run kept outside autograd (cached schedule)
    stash_bytes: int = 0
    #: where the run records its instructions' spans (its step's trace), when the step is traced
    trace: StepTrace | None = None

    def now(self) -> Any:
        """A timestamp for the trace (0.0 when the step is not traced)."""
        return self.trace.now() if self.trace is not None else 0.0

    def traced(self, ins: Instruction, start: Any) -> None:
        """Record that ``ins`` ran from ``start`` to now, when the step is traced."""
        if self.trace is not None:
            self.trace.add(ins, start)

    @property
    def n(self) -> int:
        """The global batch size."""
        return self.batch.n

    @classmethod
    def of(cls, instructions: list[Instruction], batch: RankBatch) -> ScheduleRun:
        """A run's bookkeeping from its instructions: each (tower, microbatch)'s rows, sync group and stage."""
        run = cls(instructions, batch)
        nxt: dict[tuple[str, int], int] = {}
        for ins in instructions:
            if isinstance(ins, Forward):
                key = (ins.tower, ins.sync_group)
                a = nxt.get(key, batch.towers[ins.tower].spans[ins.sync_group].local_start)
                run.rows[ins.tower, ins.mb] = slice(a, a + ins.rows)
                run.sync_group_of[ins.tower, ins.mb] = ins.sync_group
                run.last[ins.tower] = ins.send_to is None
                nxt[key] = a + ins.rows
        return run


@dataclass
class StepState:
    """One training step on this rank.

    Args:
        ends_with_sums: this step's backward ends with the gradient sums (False while Lightning accumulates:
            sums are linear, so one sum per optimizer step is exact).
        zero_after: Lightning zeroes the gradients after this ``training_step`` (the first batch of
            an accumulation window), so the gradients from before it may be dropped at once.
        trace: when set, the spans of the step's instructions on this rank (CUDA events on a GPU).
    """

    ends_with_sums: bool = True
    zero_after: bool = False
    trace: StepTrace | None = None
    runs: list[ScheduleRun] = field(default_factory=list)

    @property
    def stash_bytes(self) -> int:
        """The most stage-boundary activation bytes one of the step's runs kept outside autograd."""
        return max((run.stash_bytes for run in self.runs), default=0)

    @property
    def final(self) -> bool:
        """The gradients this step produces are the whole optimizer step's: its ``GradSync`` may post
        the sums during the step (nothing from before is added to them afterwards)."""
        return self.ends_with_sums and self.zero_after

    def check_handed_back(self) -> None:
        """Raise if autograd reached a loss of this step whose gradients were never handed back."""
        if any(run.scale is not None for run in self.runs):
            raise RuntimeError(
                "distmm: the loss from contrastive_loss() was backpropagated but its gradients were not handed"
                " back; a LightningModule.backward override must call super().backward(loss)"
            )
