"""The per-rank runtime of a distmm plan: one executor for the schedule's instruction list.

One training step on a rank is its list from :func:`lightning_distmm.core.schedule.rank_schedule`,
run in full inside :meth:`RankRuntime.contrastive_loss` (the module's ``training_step``), every
instruction in list order:

1. ``Forward``: a microbatch of a local tower through this rank's stage (the whole tower without
   pipeline), receiving its input from the previous stage and posting its output to the next;
2. ``BatchSync`` (last stages only): the sync group's features of every tower meet at the
   interaction loss (:mod:`lightning_distmm.parallel.batch_sync`); each microbatch takes its rows
   of the summed feature gradient. Under ``distmm`` every batch-sync but the last may be split into
   ``SyncPost`` (the gather posted, ``async_op=True``) and ``SyncWait`` with the next sync group's
   first forward between them (:attr:`RankRuntime.overlap_batch_sync`; the same collectives and
   arithmetic, so the result is the blocking one bit for bit);
3. ``Backward``: the microbatch's backward through the stage, from its feature gradient (last
   stage) or the gradient received from the next stage, posting the input gradient back (a
   sharded tower reduce-scatters in its last backward of the step only);
4. ``GradSync``: the gradient sums (:mod:`lightning_distmm.parallel.gradients`). When the step's
   gradients are the optimizer step's final ones (:attr:`StepState.final`), they are posted now:
   each tower's in buckets during its last backward on the rank, the interaction parameters' here;
   otherwise they are left for the backward that ends the optimizer step.

The step's state travels in the :class:`~lightning_distmm.parallel.step.StepState` the caller
passes; the returned loss has the whole-batch value on every rank, and :meth:`RankRuntime.backward`
hands the step's gradients back around the autograd backward of that loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

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
from lightning_distmm.parallel import deferred
from lightning_distmm.parallel.batch_sync import BatchSyncRunner, check_features
from lightning_distmm.parallel.context_parallel import feature_grad_scale, head_copies
from lightning_distmm.parallel.fsdp import set_gradient_reduction
from lightning_distmm.parallel.gradients import RankGradients, SetAsideGradients
from lightning_distmm.parallel.groups import Topology
from lightning_distmm.parallel.handoff import HANDOFF_INSTRUCTIONS, TokenHandoff, tower_trains
from lightning_distmm.parallel.pipeline import Stage
from lightning_distmm.parallel.prepare import (
    check_held_tensors,
    held_names,
    prepare_rank,
    return_freed_memory,
    tower_parameters,
)
from lightning_distmm.parallel.step import Microbatch, ScheduleRun, StepState
from lightning_distmm.tower import TowerModule


class RankRuntime:
    """Runs this rank's share of every step, for every tower the rank holds: the instruction list,
    the feature exchange, the gradient hand-off and sums (``gradients``)."""

    def __init__(
        self,
        module: TowerModule,
        plan: Plan,
        topology: Topology,
        device: torch.device,
        bucket_cap_mb: float = 25.0,
        overlap_batch_sync: bool = False,
    ):
        self.plan = plan
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device
        self.towers = module.tower_specs()
        #: every group this rank's plan needs, built before it (parallel.groups.build_topology)
        self.topology = topology
        self.groups = topology.towers
        self.layout = RankLayout(plan, self.rank, {n: t.fields for n, t in self.towers.items()})
        self.module = module
        self.bucket_cap_mb = bucket_cap_mb
        self.gradients = self._gradients()
        #: a model whose towers consume each other's outputs (docs/mllm.md): its own lists and transfers
        self.handoff = (
            TokenHandoff(plan, self.towers, tower_trains(self.towers), self.groups, device, topology.host)
            if TokenHandoff.needed(self.towers)
            else None
        )
        self.batch_sync = BatchSyncRunner(
            plan, self.layout, list(self.towers), topology, self.rank, device, self.trainable
        )
        self._schedules: dict[Any, list[Instruction]] = {}
        #: ``distmm``: split every batch-sync but the last into a posted gather and its wait, running the
        #: next sync group's forwards between them (``rank_schedule(..., overlap=True)``). Off by default:
        #: it holds one more microbatch's activations on every stage (the planner's memory model does not
        #: count it) to hide one gather per step (docs/pipeline.md, "Asynchronous batch-sync");
        #: ``DistMMStrategy(overlap_batch_sync=True)`` passes it (the step lists are cached per value)
        self.overlap_batch_sync = bool(overlap_batch_sync)
        self.stages: dict[str, Stage] = {}  # this rank's stage of each local tower with pp > 1

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

    def prepare_local_towers(self, values_from_checkpoint: bool = False) -> None:
        """Keep only what this rank runs (:func:`~lightning_distmm.parallel.prepare.prepare_rank`), rebuild
        the parameter table (dropping references to replaced parameters) and hand the freed memory back.

        A module built on the meta device under :func:`~lightning_distmm.parallel.deferred.deferred_init`
        is prepared on meta, then each rank materialises what it holds (a sharded tower's shards only)
        with the values the construction would have given them. ``values_from_checkpoint``: the
        module's meta tensors are allocated uninitialised instead (a checkpoint load sets them next)."""
        refs = deferred.tensor_refs(self.module)  # type: ignore[arg-type]  # by name: sharding replaces tensors
        self.stages = prepare_rank(self.plan, self.towers, self.layout, self.groups, self.rank)
        held = held_names(self.module, self.towers, self.layout, self.stages)  # type: ignore[arg-type]
        if refs:
            deferred.materialize(self.module, refs, self.device, held)  # type: ignore[arg-type]
            deferred.release(refs)
        if values_from_checkpoint:
            deferred.allocate(self.module, self.device, held)  # type: ignore[arg-type]
        check_held_tensors(self.module, held)  # type: ignore[arg-type]
        self.gradients = self._gradients()
        return_freed_memory()

    def trainable(self, name: str) -> bool:
        return self.gradients.trainable(name)

    def _runs_backward(self, name: str) -> bool:
        """A tower's backward runs when it trains, or when it consumes a tower that does."""
        return self.trainable(name) or (self.handoff is not None and self.handoff.needs_backward(name))

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

    def contrastive_loss(self, step: StepState, module: TowerModule, batch: Mapping[str, Any]) -> Tensor:
        """Run this rank's whole list for ``batch``; return the whole-batch loss (grouped under ``distmm``).

        With autograd on, the run (its gradients, taken out of ``.grad``) is recorded in ``step``
        for :meth:`backward`; the gradients from before it are restored when it ends, or dropped
        when ``step.zero_after`` says Lightning zeroes them anyway.
        """
        self.global_batch_size(batch)  # a batch that did not come through the distmm loader stops here
        training = torch.is_grad_enabled()
        for name in self.layout.local_towers:
            for f in self.towers[name].fields:
                if f not in batch:
                    raise KeyError(
                        f"tower {name!r} reads batch field {f!r} but the batch has only"
                        f" {sorted(k for k in batch if k not in LOADER_KEYS)}"
                    )
        rank_batch = self.rank_batch(batch)
        run = ScheduleRun.of(self.schedule(rank_batch.assignment), rank_batch)
        run.trace = step.trace
        # a handoff model's rank with nothing to train (a frozen LLM's) still runs the step's gradient
        # protocol, so that every rank makes the same decisions about the sums
        learns = training and (self.gradients.learns() or self.handoff is not None)
        run.set_aside = self.gradients.take() if learns else []
        if step.zero_after:
            run.set_aside = []  # Lightning zeroes them after this step: free them before the backward
        # Gradient sums overlapped with the backward (DDP's idea) when this step's gradients are the
        # whole optimizer step's: the same decision on every rank (it depends on the step only)
        run.sums = [] if learns and step.final else None
        if run.sums is not None:
            self.gradients.attach_bucket_views()  # autograd accumulates into the buckets the sums run on
        last_backward = {ins.tower: i for i, ins in enumerate(run.instructions) if isinstance(ins, Backward)}
        try:
            for i, ins in enumerate(run.instructions):
                run.sends = [s for s in run.sends if not s.done()]
                if isinstance(ins, Forward):
                    rows = {f: _take_rows(batch[f], run.rows[ins.tower, ins.mb]) for f in self.towers[ins.tower].fields}
                    if self.handoff is not None and self.towers[ins.tower].consumes and ins.recv_from is None:
                        rows.update(self.handoff.consumed(ins.tower, ins.mb))
                    self._forward(ins, rows, training, run)
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
                        self._backward(ins, run, last=last_backward[ins.tower] == i, ends_with_sums=step.ends_with_sums)
                elif isinstance(ins, GradSync):
                    self._grad_sync(run)
            for pending in run.sends:
                pending.wait()
        finally:
            if self.handoff is not None:
                self.handoff.reset()
            run.sends.clear()
            run.gathers.clear()
            run.records.clear()
            run.outputs.clear()
            run.feature_grads.clear()
        # the loss value for every rank (the first stages hold none): one sum over the world
        total = run.loss.reshape(1).to(self.device, torch.float32)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total = total[0].to(run.loss.dtype)
        if not learns:
            return total
        run.produced = self.gradients.take()
        self.gradients.restore(run.set_aside)
        step.runs.append(run)
        anchor = torch.zeros((), device=total.device, requires_grad=True)
        return SetAsideGradients.apply(total, anchor, run)

    def backward(self, step: StepState, run_backward: Callable[[], None]) -> None:
        """The backward of a loss ``contrastive_loss`` returned in ``step``: the gradients accumulated
        so far are set aside, ``run_backward`` (autograd) records the upstream gradient and fills
        ``.grad`` with the terms outside ``contrastive_loss``, and the step's gradients are handed back."""
        earlier = self.gradients.take()
        run_backward()
        self.gradients.finish_backward(step, earlier)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        return self.gradients.clip_grad_norm_(max_norm, norm_type)

    # ------------------------------------------------------------------ instructions
    def _run_stage(self, name: str, x: Tensor | None, rows: Mapping[str, Any], training: bool) -> Tensor:
        if name in self.stages:
            return self.stages[name].run(x, rows)
        tower = self.towers[name]
        if self.plan.towers[name].recompute and training and self.trainable(name):
            # activation checkpointing: keep the tower's inputs, recompute its forward in backward
            return checkpoint(tower.encode, rows, use_reentrant=False)
        return tower.encode(rows)

    def _forward(self, ins: Forward, rows: Mapping[str, Any], training: bool, run: ScheduleRun) -> None:
        """One microbatch through this rank's stage of a tower (the whole tower without pipeline)."""
        grad = training and self._runs_backward(ins.tower)
        x_in = (
            self.topology.links.recv(ins.tower, "act", ins.recv_from, self.device)
            if ins.recv_from is not None
            else None
        )
        start = run.now()
        if grad and not ins.keep:  # cached: no activations now, recompute from the input in backward
            rng = _rng_state(self.device)
            with torch.no_grad():
                x = self._run_stage(ins.tower, x_in, rows, training)
            run.records[ins.tower, ins.mb] = Microbatch(x_in, rows, None, rng)
            if x_in is not None:
                run.stash_bytes += x_in.numel() * x_in.element_size()
        else:
            if grad and x_in is not None:
                x_in.requires_grad_(True)
            x = self._run_stage(ins.tower, x_in, rows, training)
            if grad:
                run.records[ins.tower, ins.mb] = Microbatch(x_in, rows, x, None)
        run.traced(ins, start)
        if ins.send_to is not None:
            run.sends.append(self.topology.links.send(x, ins.tower, "act", ins.send_to))
        else:
            check_features(ins.tower, x, ins.rows, grad and ins.keep)
            run.outputs.setdefault((ins.sync_group, ins.tower), []).append(x)

    def _backward(self, ins: Backward, run: ScheduleRun, last: bool, ends_with_sums: bool) -> None:
        """One microbatch backward through this rank's stage; the input gradient goes to the previous stage.

        On the tower's ``last`` backward of a run whose sums are posted during the step, its
        gradients become final during this backward, bucket by bucket, and each bucket's sum is
        posted as soon as it is. A sharded tower reduce-scatters (FSDP) in its ``last`` backward of
        a step whose backward ends with the sums (``ends_with_sums``) and in no other:
        the earlier microbatches' gradients accumulate unsharded inside FSDP and are reduced with it,
        once per step (and not at all while Lightning accumulates).
        """
        if self.gradients.sharded(ins.tower):
            set_gradient_reduction(self.towers[ins.tower].module, ends_with_sums and last)
        micro = run.records.pop((ins.tower, ins.mb))
        feature_grad = run.feature_grads.pop((ins.tower, ins.mb), None)
        buckets = self.gradients.buckets(ins.tower) if last and run.sums is not None else None
        if buckets is not None:
            buckets.arm()
        if ins.recv_from is not None:
            g_out = self.topology.links.recv(ins.tower, "grad", ins.recv_from, self.device)
        else:  # the cp (and sp) ranks all run the head: each backpropagates its share (parallel/context_parallel.py)
            t = self.plan.towers[ins.tower]
            g_out = feature_grad_scale(feature_grad, head_copies(t.cp, t.tp, t.sp))
        start = run.now()
        if micro.output is None:  # cached: recompute the stage from its saved input, same RNG
            x_in = micro.input.requires_grad_(True) if micro.input is not None else None
            with _restored_rng(micro.rng, self.device):  # type: ignore[arg-type]
                out = self._run_stage(ins.tower, x_in, micro.rows, True)
        else:
            x_in, out = micro.input, micro.output
        torch.autograd.backward(out, g_out)
        run.traced(ins, start)
        if ins.send_to is not None:
            assert x_in is not None
            run.sends.append(
                self.topology.links.send(
                    x_in.grad if x_in.grad is not None else torch.zeros_like(x_in), ins.tower, "grad", ins.send_to
                )
            )
        if buckets is not None:
            assert run.sums is not None
            run.sums.extend(buckets.finish())

    def _grad_sync(self, run: ScheduleRun) -> None:
        """``GradSync``: post the sums now if this step's gradients are final (the towers' buckets went
        during their last backwards; the interaction parameters' go here), else leave them for the
        backward that ends the optimizer step."""
        if run.sums is not None:
            run.sums.extend(self.gradients.post_interaction_sum())


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple[Tensor, Tensor | None], device: torch.device) -> Iterator[None]:
    """Replay a microbatch with the RNG state of its first forward (dropout masks match), then continue."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _take_rows(value: Any, rows: slice) -> Any:
    if isinstance(value, (Tensor, list, tuple)):
        return value[rows]
    return value
