"""The step engine: this rank's share of every step of a distmm plan, in one object.

The strategy builds one :class:`StepEngine` per run (:func:`start_engine`: every group, the local
towers prepared, the knobs as constructor arguments) and installs it on the module
(:class:`~lightning_distmm.tower.TowerRunner`); the mixin's loss, ``backward`` and clipping hooks
call it. A training step on a rank is its instruction list from
:func:`lightning_distmm.core.schedule.rank_schedule`, run in full inside :meth:`StepEngine.step_loss`
(the module's ``training_step``), every instruction in list order:

1. ``Forward``: a microbatch of a local tower through this rank's stage (the whole tower without
   pipeline), receiving its input from the previous stage and posting its output to the next;
2. ``BatchSync`` (last stages only): the sync group's features of every tower meet at the
   interaction loss (:mod:`lightning_distmm.parallel.step.batch_sync`); each microbatch takes its rows
   of the summed feature gradient. Under ``distmm`` every batch-sync but the last may be split into
   ``SyncPost`` (the gather posted, ``async_op=True``) and ``SyncWait`` with the next sync group's
   first forward between them (``overlap_batch_sync``; the same collectives and arithmetic, so the
   result is the blocking one bit for bit);
3. ``Backward``: the microbatch's backward through the stage, from its feature gradient (last
   stage) or the gradient received from the next stage, posting the input gradient back (a
   sharded tower reduce-scatters in its last backward of the step only);
4. ``GradSync``: the gradient sums (:mod:`lightning_distmm.parallel.step.gradients`). When the step's
   gradients are the optimizer step's final ones (:attr:`StepState.final`), they are posted now:
   each tower's in buckets during its last backward on the rank, the interaction parameters' here;
   otherwise they are left for the backward that ends the optimizer step.

The engine holds the one piece of state carried between Lightning's hooks, the step in progress
(:class:`~lightning_distmm.parallel.step.state.StepState`): started when Lightning starts a training
batch (:meth:`StepEngine.start_step`), marked as accumulating while Lightning blocks the backward's
sync (:meth:`StepEngine.accumulating`), checked once the optimizer step's closure ran
(:meth:`StepEngine.check_handed_back`). Outside a training batch (validation) a call gets a step of
its own. The returned loss has the whole-batch value on every rank, and :meth:`StepEngine.backward`
hands the step's gradients back around the autograd backward of that loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_distmm.core.assignment import RowAssignment
from lightning_distmm.core.layout import ASSIGNMENT_KEY, GLOBAL_BATCH_KEY, LOADER_KEYS, RankBatch, RankLayout
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import (
    Backward,
    BatchSync,
    Forward,
    GradSync,
    Instruction,
    SyncPost,
    SyncWait,
    rank_schedule,
)
from lightning_distmm.parallel.fsdp import mixed_precision_policy
from lightning_distmm.parallel.groups import Topology, build_topology
from lightning_distmm.parallel.pipeline import Stage
from lightning_distmm.parallel.prepare import prepare_local_towers, tower_parameters
from lightning_distmm.parallel.step.batch_sync import BatchSyncRunner
from lightning_distmm.parallel.step.gradients import RankGradients, SetAsideGradients
from lightning_distmm.parallel.step.handoff import HANDOFF_INSTRUCTIONS, TokenHandoff, tower_trains
from lightning_distmm.parallel.step.passes import StagePasses, take_rows
from lightning_distmm.parallel.step.state import ScheduleRun, StepState
from lightning_distmm.parallel.timing import StepTrace
from lightning_distmm.tower import TowerModule


def start_engine(
    module: TowerModule,
    plan: Plan,
    nodes: Sequence[int],
    device: torch.device,
    precision: str | None,
    bucket_cap_mb: float,
    overlap_batch_sync: bool = False,
    values_from_checkpoint: bool = False,
) -> StepEngine:
    """This rank's engine for ``plan``: every group built (:func:`~lightning_distmm.parallel.groups.build_topology`),
    the local towers prepared (remote ones released, pipeline stages cut, TP and FSDP applied).
    Collective: every rank calls it with the same plan. ``values_from_checkpoint``: the module's
    meta tensors are allocated, not initialised (a checkpoint load sets them next)."""
    topology = build_topology(plan, device, nodes, mixed_precision_policy(precision))
    return StepEngine(
        module,
        plan,
        topology,
        device,
        bucket_cap_mb=bucket_cap_mb,
        overlap_batch_sync=overlap_batch_sync,
        values_from_checkpoint=values_from_checkpoint,
    )


@dataclass
class StepResult:
    """What one run of the rank's list gives the module: ``loss``, the whole-batch loss (the same
    value on every rank; when the run learns, an autograd node whose backward hands ``run``'s
    gradients back), and ``run``, the run's bookkeeping kept in the step until then (None when
    nothing learns: validation, or every local tower frozen)."""

    loss: Tensor
    run: ScheduleRun | None


class StepEngine:
    """Runs this rank's share of every step, for every tower the rank holds: the instruction list,
    the feature exchange, the gradient hand-off and sums (``gradients``), and the step in progress.

    Args:
        module: the user's module (its towers are prepared in place: remote ones released, stages
            cut, TP and FSDP applied).
        plan: the run's plan; ``topology``: its groups, built by every rank.
        bucket_cap_mb: the gradient sums' bucket size.
        overlap_batch_sync: ``distmm`` schedules split every batch-sync but the last into a posted
            gather and its wait, running the next sync group's forwards between them. Off by
            default: it holds one more microbatch's activations on every stage (the planner's memory
            model does not count it) to hide one gather per step (docs/pipeline.md, "Asynchronous
            batch-sync").
        values_from_checkpoint: a module built on the meta device gets its tensors allocated, not
            initialised (a checkpoint load sets them next).
    """

    def __init__(
        self,
        module: TowerModule,
        plan: Plan,
        topology: Topology,
        device: torch.device,
        *,
        bucket_cap_mb: float = 25.0,
        overlap_batch_sync: bool = False,
        values_from_checkpoint: bool = False,
    ):
        self.plan = plan
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device
        self.module = module
        self.towers = module.tower_specs()
        #: every group this rank's plan needs, built before it (parallel.groups.build_topology)
        self.topology = topology
        self.groups = topology.towers
        self.layout = RankLayout(plan, self.rank, {n: t.fields for n, t in self.towers.items()})
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap_batch_sync = bool(overlap_batch_sync)
        #: this rank's stage of each local tower with pp > 1, and its gradient bookkeeping, both
        #: made once the towers are prepared
        self.stages: dict[str, Stage] = prepare_local_towers(
            module, plan, self.towers, self.layout, self.groups, device, values_from_checkpoint
        )
        self.gradients = self._gradients()
        #: a model whose towers consume each other's outputs (docs/vlm.md): its own lists and transfers
        self.handoff = (
            TokenHandoff(plan, self.towers, tower_trains(self.towers), self.groups, device, topology.host)
            if TokenHandoff.needed(self.towers)
            else None
        )
        self.passes = StagePasses(plan, self.towers, self.stages, topology, device, self.gradients, self._runs_backward)
        self.batch_sync = BatchSyncRunner(
            plan, self.layout, list(self.towers), topology, self.rank, device, self.gradients.trainable
        )
        #: instruction lists by everything a list depends on (the step's assignment; the overlap)
        self._schedules: dict[Any, list[Instruction]] = {}
        #: the step in progress, or the last one (its ``trace`` and ``stash_bytes`` read after it)
        self.step: StepState | None = None
        self._tracing = False

    def _gradients(self) -> RankGradients:
        tower_params, interaction_params = tower_parameters(self.module, self.towers)  # type: ignore[arg-type]
        return RankGradients(
            self.plan,
            self.layout,
            self.towers,
            self.groups,
            tower_params,
            interaction_params,
            self.device,
            self.bucket_cap_mb,
            self.topology.host,
        )

    # ------------------------------------------------------------------ the step's lifecycle
    def record_trace(self, on: bool = True) -> None:
        """Record (or stop recording) each training step's instruction spans in its ``StepState.trace``
        (:class:`~lightning_distmm.parallel.timing.StepTrace`: CUDA events on a GPU, read after the step)."""
        self._tracing = on

    def start_step(self, zero_after: bool) -> StepState:
        """A training batch starts; ``zero_after``: Lightning zeroes the gradients after its
        ``training_step`` (the first batch of an accumulation window)."""
        trace = StepTrace(self.device) if self._tracing else None
        self.step = StepState(zero_after=zero_after, trace=trace)
        return self.step

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Lightning accumulates this step: its gradients stay local and the sums run once, in the
        optimizer step's backward (sums are linear, so that is exact; sharded towers: the engine
        turns FSDP's reduction off from it)."""
        step = self.step
        if step is None:
            yield
            return
        before, step.ends_with_sums = step.ends_with_sums, False
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

    def _runs_backward(self, name: str) -> bool:
        """A tower's backward runs when it trains, or when it consumes a tower that does."""
        return self.gradients.trainable(name) or (self.handoff is not None and self.handoff.needs_backward(name))

    # ------------------------------------------------------------------ the step
    def global_batch_size(self, batch: Mapping[str, Any]) -> int:
        if GLOBAL_BATCH_KEY not in batch:
            raise KeyError(
                "this batch did not come through the distmm data loader (no global batch size attached): distmm"
                " wraps a torch DataLoader that batches (batch_size=<the global batch>) and leaves any other"
                " iterable as it is, so a webdataset WebLoader, a stream that batches itself or a batch built by"
                " hand reaches the step without one; give the Trainer"
                " torch.utils.data.DataLoader(dataset, batch_size=<the global batch>, drop_last=True) over a"
                " dataset that yields single samples (dicts keyed by field)"
            )
        return int(batch[GLOBAL_BATCH_KEY])

    def rank_batch(self, batch: Mapping[str, Any]) -> RankBatch:
        """This rank's part of ``batch``'s global batch: its rows, each local tower's share, the
        step's row assignment (the one the loader chose, or the plan's own split)."""
        n = self.global_batch_size(batch)
        assignment = batch.get(ASSIGNMENT_KEY)
        return self.layout.batch(n, assignment if isinstance(assignment, RowAssignment) else None)

    def batch_rows(self, batch: Mapping[str, Any]) -> Sequence[int]:
        """The sample row (of the DataLoader's global batch) of each row of this rank's ``batch``."""
        return self.rank_batch(batch).rows

    def schedule(self, assignment: RowAssignment) -> list[Instruction]:
        """This rank's instructions for a step whose rows are assigned by ``assignment`` (the plan's
        schedule, as data), cached by everything it depends on."""
        key = (assignment.sizes_key, self.overlap_batch_sync)
        if key not in self._schedules:
            if len(self._schedules) >= 256:  # balanced steps each have their own run lengths
                self._schedules.pop(next(iter(self._schedules)))
            if self.handoff is not None:
                self._schedules[key] = self.handoff.schedule(assignment)
            else:
                self._schedules[key] = rank_schedule(
                    self.plan, self.rank, assignment.n, overlap=self.overlap_batch_sync, assignment=assignment
                )
        return self._schedules[key]

    # ------------------------------------------------------------------ what the module calls
    def step_loss(self, module: TowerModule, batch: Mapping[str, Any]) -> Tensor:
        """The module's loss under distmm (the mixin's ``contrastive_loss``): this rank's list run for
        ``batch`` in the step in progress; the whole-batch loss."""
        return self.run(self._current(), module, batch).loss

    def backward(self, run_backward: Callable[[], None]) -> None:
        """The backward of a loss :meth:`step_loss` returned: the gradients accumulated so far are
        set aside, ``run_backward`` (autograd) records the upstream gradient and fills ``.grad`` with
        the terms outside the step, and the step's gradients are handed back."""
        step = self._current()
        earlier = self.gradients.take()
        run_backward()
        self.gradients.finish_backward(step, earlier)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        return self.gradients.clip_grad_norm_(max_norm, norm_type)

    # ------------------------------------------------------------------ the step
    def run(self, step: StepState, module: TowerModule, batch: Mapping[str, Any]) -> StepResult:
        """Run this rank's whole list for ``batch`` in ``step``.

        With autograd on, the run's gradients are taken out of ``.grad`` and kept in ``step`` for
        :meth:`backward`; the gradients from before it are restored when it ends, or dropped when
        ``step.zero_after`` says Lightning zeroes them anyway.
        """
        self._check_fields(batch)
        training = torch.is_grad_enabled()
        # a handoff model's rank with nothing to train (a frozen LLM's) still runs the step's gradient
        # protocol, so that every rank makes the same decisions about the sums
        learns = training and (self.gradients.learns() or self.handoff is not None)
        rank_batch = self.rank_batch(batch)
        run = ScheduleRun.of(self.schedule(rank_batch.assignment), rank_batch)
        run.trace = step.trace
        run.set_aside = self.gradients.take() if learns else []  # out of .grad: the run fills it anew
        if step.zero_after:
            run.set_aside = []  # Lightning zeroes them after this step: free them before the backward
        # Gradient sums overlapped with the backward (DDP's idea) when this step's gradients are the
        # whole optimizer step's: the same decision on every rank (it depends on the step only)
        run.sums = [] if learns and step.final else None
        if run.sums is not None:
            self.gradients.attach_bucket_views()  # autograd accumulates into the buckets the sums run on
        try:
            self._execute(run, module, batch, training, step.ends_with_sums)
        finally:
            self._release(run)
        loss = self._whole_batch_loss(run)
        if not learns:
            return StepResult(loss, None)
        run.produced = self.gradients.take()
        self.gradients.restore(run.set_aside)
        step.runs.append(run)
        anchor = torch.zeros((), device=loss.device, requires_grad=True)
        return StepResult(SetAsideGradients.apply(loss, anchor, run), run)

    def _check_fields(self, batch: Mapping[str, Any]) -> None:
        self.global_batch_size(batch)  # a batch that did not come through the distmm loader stops here
        for name in self.layout.local_towers:
            for f in self.towers[name].fields:
                if f not in batch:
                    raise KeyError(
                        f"tower {name!r} reads batch field {f!r} but the batch has only"
                        f" {sorted(k for k in batch if k not in LOADER_KEYS)}"
                    )

    def _execute(
        self, run: ScheduleRun, module: TowerModule, batch: Mapping[str, Any], training: bool, ends_with_sums: bool
    ) -> None:
        """Every instruction of ``run``'s list, in order; then every send it posted, waited for."""
        last_backward = {ins.tower: i for i, ins in enumerate(run.instructions) if isinstance(ins, Backward)}
        for i, ins in enumerate(run.instructions):
            run.sends = [s for s in run.sends if not s.done()]
            if isinstance(ins, Forward):
                rows = {f: take_rows(batch[f], run.rows[ins.tower, ins.mb]) for f in self.towers[ins.tower].fields}
                if self.handoff is not None and self.towers[ins.tower].consumes and ins.recv_from is None:
                    rows.update(self.handoff.consumed(ins.tower, ins.mb))
                self.passes.forward(ins, rows, training, run)
            elif isinstance(ins, BatchSync):
                posted = run.now()
                self.batch_sync.post(ins, run)
                self.batch_sync.meet(module, ins, run, training, posted)
            elif isinstance(ins, SyncPost):
                self.batch_sync.post(ins, run)
            elif isinstance(ins, SyncWait):
                self.batch_sync.meet(module, ins, run, training)
            elif isinstance(ins, HANDOFF_INSTRUCTIONS):
                assert self.handoff is not None
                self.handoff.run(ins, run, module, batch, training)
            elif isinstance(ins, Backward):
                if training and self._runs_backward(ins.tower):
                    self.passes.backward(ins, run, last=last_backward[ins.tower] == i, ends_with_sums=ends_with_sums)
            elif isinstance(ins, GradSync):
                self._grad_sync(run)
        for pending in run.sends:
            pending.wait()

    def _release(self, run: ScheduleRun) -> None:
        """What the run held only while its list ran (activations, sends, gathers), let go."""
        if self.handoff is not None:
            self.handoff.reset()
        run.sends.clear()
        run.gathers.clear()
        run.records.clear()
        run.outputs.clear()
        run.feature_grads.clear()

    def _whole_batch_loss(self, run: ScheduleRun) -> Tensor:
        """The loss value for every rank (the first stages hold none): one sum over the world."""
        total = run.loss.reshape(1).to(self.device, torch.float32)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total[0].to(run.loss.dtype)

    def _grad_sync(self, run: ScheduleRun) -> None:
        """``GradSync``: post the sums now if this step's gradients are final (the towers' buckets went
        during their last backwards; the interaction parameters' go here), else leave them for the
        backward that ends the optimizer step."""
        if run.sums is not None:
            run.sums.extend(self.gradients.post_interaction_sum())
