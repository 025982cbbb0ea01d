"""What the module calls under distmm: the runtime, with the step in progress.

The strategy creates one :class:`StepRunner` per run and installs it on the module
(:class:`~lightning_distmm.tower.TowerRunner`); the mixin's ``contrastive_loss``, ``backward`` and
clipping hooks call it directly. It holds the one piece of state carried between Lightning's hooks,
the :class:`~lightning_distmm.parallel.step.StepState`: started when Lightning starts a training
batch (:meth:`start_step`), marked as accumulating while Lightning blocks the backward's sync
(:meth:`accumulating`), checked once the optimizer step's closure ran (:meth:`check_handed_back`).
Outside a training batch (validation, ``trainer.validate``) a call gets a step of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.core.plan import Plan
from lightning_distmm.parallel.executor import RankRuntime
from lightning_distmm.parallel.fsdp import mixed_precision_policy
from lightning_distmm.parallel.groups import build_topology
from lightning_distmm.parallel.step import StepState
from lightning_distmm.parallel.timing import StepTrace
from lightning_distmm.tower import TowerModule


def start_runner(
    module: TowerModule,
    plan: Plan,
    nodes: Sequence[int],
    device: torch.device,
    precision: str | None,
    bucket_cap_mb: float,
    overlap_batch_sync: bool = False,
    values_from_checkpoint: bool = False,
) -> StepRunner:
    """This rank's runtime for ``plan``: every group built (:func:`~lightning_distmm.parallel.groups.build_topology`),
    the local towers prepared (remote ones released, pipeline stages cut, TP and FSDP applied), and
    the runner the module calls. Collective: every rank calls it with the same plan.
    ``values_from_checkpoint``: the module's meta tensors are allocated, not initialised (a checkpoint
    load sets them next: :meth:`RankRuntime.prepare_local_towers`)."""
    topology = build_topology(plan, device, nodes, mixed_precision_policy(precision))
    runtime = RankRuntime(module, plan, topology, device, bucket_cap_mb, overlap_batch_sync)
    runtime.prepare_local_towers(values_from_checkpoint)
    return StepRunner(runtime)


class StepRunner:
    """The runtime and the step in progress (see the module docstring)."""

    def __init__(self, runtime: RankRuntime) -> None:
        self.runtime = runtime
        #: the step in progress, or the last one (its ``trace`` and ``stash_bytes`` read after it)
        self.step: StepState | None = None
        self._tracing = False

    def record_trace(self, on: bool = True) -> None:
        """Record (or stop recording) each training step's instruction spans in its ``StepState.trace``
        (:class:`~lightning_distmm.parallel.timing.StepTrace`: CUDA events on a GPU, read after the step)."""
        self._tracing = on

    # ------------------------------------------------------------------ the step's lifecycle
    def start_step(self, zero_after: bool) -> StepState:
        """A training batch starts; ``zero_after``: Lightning zeroes the gradients after its
        ``training_step`` (the first batch of an accumulation window)."""
        trace = StepTrace(self.runtime.device) if self._tracing else None
        self.step = StepState(zero_after=zero_after, trace=trace)
        return self.step

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Lightning accumulates this step: its gradients stay local and the sums run once, in the
        optimizer step's backward (sums are linear, so that is exact)."""
        step = self.step
        if step is None:
            yield
            return
        before, step.ends_with_sums = (
            step.ends_with_sums,
            False,
        )  # sharded towers: the executor turns FSDP's reduction off from it
        try:
            yield
        finally:
            step.ends_with_sums = before

    def check_handed_back(self) -> None:
        """After the optimizer step's closure: every loss of the step had its gradients handed back."""
        if self.step is not None:
            self.step.check_handed_back()

    def _current(self) -> StepState:
        if self.step is None:
            self.step = StepState()
        return self.step

    # ------------------------------------------------------------------ what the module calls
    def contrastive_loss(self, module: TowerModule, batch: Mapping[str, Any]) -> Tensor:
        return self.runtime.contrastive_loss(self._current(), module, batch)

    def global_batch_size(self, batch: Mapping[str, Any]) -> int:
        return self.runtime.global_batch_size(batch)

    def batch_rows(self, batch: Mapping[str, Any]) -> Sequence[int]:
        return self.runtime.batch_rows(batch)

    def backward(self, run_backward: Callable[[], None]) -> None:
        self.runtime.backward(self._current(), run_backward)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        return self.runtime.clip_grad_norm_(max_norm, norm_type)


__all__ = ["StepRunner", "start_runner"]
