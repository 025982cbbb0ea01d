"""Gradient handling on a rank: set aside and restored, handed back scaled, summed, clipped.

The schedule runs its backwards inside ``training_step``, but Lightning zeroes the gradients
between ``training_step`` and the backward of the returned loss. So a run takes the gradients it
produced out of ``.grad`` and returns a loss whose autograd backward records the gradient that
reaches it (:class:`SetAsideGradients`: Lightning's 1/accumulate, or any function of the loss the
user returns); :meth:`RankGradients.finish_backward` then adds them back scaled by it. Sums, not
means: each rank's loss is its share of the whole-batch mean, so summing a tower's gradients over
its replicas (the interaction parameters' over all ranks) gives exactly the single-process
gradient, whatever the replicas' batch sizes. When a step's gradients are the whole optimizer
step's, the sums are posted during the backward in DDP-style buckets (:class:`GradientBuckets`).

A sharded tower (``shard: full | hybrid | zero2``) is summed by FSDP itself: its reduce-scatter runs in the
tower's last backward of the step (``set_gradient_divide_factor(1.0)``: a sum; the step engine turns
FSDP's gradient sync on for that backward only), so its ``.grad`` holds this rank's shard of the
summed gradient; the earlier microbatches' gradients, and while Lightning accumulates every
backward's, accumulate unsharded inside FSDP until that backward reduces their total.

A tower with ``shard: optimizer`` (ZeRO-1) keeps whole gradients through the step like an unsharded
one; when the optimizer step's gradients are complete they are reduce-scattered over its replicas
into this rank's pieces (:mod:`lightning_distmm.parallel.optimizer_shards`), which the optimizer
steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_distmm.core.layout import RankLayout
from lightning_distmm.core.plan import Plan
from lightning_distmm.parallel.buckets import FIRST_BUCKET_BYTES, GradientBuckets, local
from lightning_distmm.parallel.exchange import PendingSum, allreduce_sum, allreduce_sum_async, host_any
from lightning_distmm.parallel.groups import TowerGroups
from lightning_distmm.parallel.optimizer_shards import OptimizerShards
from lightning_distmm.parallel.step.state import Gradients, ScheduleRun, StepState
from lightning_distmm.tower import Tower


class SetAsideGradients(torch.autograd.Function):
    """The returned loss: its value is the whole-batch loss; its backward records the upstream gradient in the run."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, anchor: Tensor, run: ScheduleRun) -> Tensor:  # type: ignore[override]
        ctx.run = run
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.run.scale = grad.detach() if ctx.run.scale is None else ctx.run.scale + grad.detach()
        return None, None, None


class RankGradients:
    """The gradients of this rank's parameters: each local tower's and the interaction parameters'."""

    def __init__(
        self,
        plan: Plan,
        layout: RankLayout,
        towers: Mapping[str, Tower],
        groups: Mapping[str, TowerGroups],
        tower_params: Mapping[str, Mapping[str, nn.Parameter]],
        interaction_params: Mapping[str, nn.Parameter],
        device: torch.device,
        bucket_cap_mb: float = 25.0,
        host_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.plan = plan
        self.layout = layout
        self.towers = towers
        self.groups = groups
        self.tower_params = tower_params
        self.interaction_params = interaction_params
        self.device = device
        #: size of the gradient buckets summed during the backward (DDP's ``bucket_cap_mb``)
        self.bucket_cap_mb = bucket_cap_mb
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        #: every rank, exchanging host-side flags (:func:`~lightning_distmm.parallel.groups.host_group`)
        self.host_group = host_group
        self._buckets: dict[str, GradientBuckets] = {}
        #: upstream gradients of the runs whose sharded towers' gradients FSDP holds unreduced
        self._held_scales: list[Tensor] = []
        #: the ZeRO-1 towers held here (``shard: optimizer`` with more than one replica)
        self.shards = OptimizerShards(
            {
                name: (
                    [p for p in tower_params[name].values() if p.requires_grad and not p.is_meta],
                    groups[name].dp_group,
                )
                for name in layout.local_towers
                if plan.towers[name].shard == "optimizer"
                and plan.towers[name].dp * plan.towers[name].cp > 1
                and self.trainable(name)
            },
            int(bucket_cap_mb * 2**20),
        )

    def sharded(self, name: str) -> bool:
        """Tower ``name`` is sharded by FSDP on this rank (its gradient sums are FSDP's)."""
        return self.plan.towers[name].sharded and name in self.layout.local_towers

    def trainable(self, name: str) -> bool:
        return not self.towers[name].frozen and any(p.requires_grad for p in self.tower_params[name].values())

    def learns(self) -> bool:
        """Whether a backward on this rank changes any gradient it holds."""
        return any(self.trainable(t) for t in self.layout.local_towers) or any(
            p.requires_grad for p in self.interaction_params.values()
        )

    def local_parameters(self) -> list[nn.Parameter]:
        params = list(self.interaction_params.values())
        for name in self.layout.local_towers:
            params.extend(self.tower_params[name].values())
        return params

    # ------------------------------------------------------------------ set aside, hand back
    def take(self) -> Gradients:
        """Remove and return the gradients of this rank's parameters (leaving ``.grad`` empty)."""
        taken = []
        for p in self.local_parameters():
            if p.grad is not None:
                taken.append((p, p.grad))
                p.grad = None
        return taken

    @staticmethod
    def restore(grads: Gradients) -> None:
        for p, g in grads:
            p.grad = g

    def finish_backward(self, step: StepState, earlier: Gradients) -> None:
        """After the autograd backward of the returned loss: complete ``.grad`` and sum it.

        ``.grad`` then holds the gradients of the terms the training_step added outside
        ``contrastive_loss`` (a regulariser): every rank that holds a parameter computed them, and
        the gradient sums would count them once per rank, so they are averaged over those ranks
        first (DDP's rule). Then the gradients set aside before the backward (``earlier``:
        accumulation) are added back, and each run's gradients, scaled by the upstream gradient of
        the loss it returned (the same on every rank, so it may scale a sum already taken during
        the step). The sums run here when the runs left them (``GradSync`` of a step whose
        gradients were not final) and this backward ends an optimizer step.
        """
        runs, step.runs = step.runs, []
        used = [run for run in runs if run.scale is not None]
        if not used:
            self.restore(earlier)
            raise RuntimeError(
                "distmm: backward() was called on a loss that does not come from contrastive_loss() in this step;"
                " the training_step must return (a function of) the loss that DistMMMixin.contrastive_loss(batch) gave"
            )
        for p, copies in self.copies():
            if p.grad is not None and copies > 1:
                local(p.grad).div_(copies)
        self._check_held_scales(step, used)
        summed = all(run.sums is not None for run in used)
        if summed:
            assert step.ends_with_sums and not earlier, "sums were posted during a step that accumulates"
            for run in used:
                for posted in run.sums or ():
                    posted.wait()
            # the terms outside contrastive_loss still need their sums, if any rank has one
            if host_any(any(p.grad is not None for p, _ in self.copies()), self.host_group):
                self.sum_all()
        handed_back = [(p, g) for run in used for p, g in scaled_all(run.produced, run.scale)]
        for p, g in [*earlier, *handed_back]:
            if p.grad is None:
                p.grad = g
            else:
                local(p.grad).add_(local(g))
        if step.ends_with_sums and not summed:
            self.sum_all()
        if step.ends_with_sums:
            for tower in self.shards.towers.values():
                tower.reduce_scatter()

    def _check_held_scales(self, step: StepState, used: list[ScheduleRun]) -> None:
        """FSDP reduces the *total* of the gradients it accumulated unsynced, which the last run's
        upstream gradient then scales: exact when every run of the window had the same one
        (Lightning's ``1/accumulate_grad_batches``); anything else is refused rather than wrong."""
        if not any(self.sharded(n) and self.trainable(n) for n in self.layout.local_towers):
            return
        scales = [run.scale for run in used if run.scale is not None]
        if not step.ends_with_sums:
            self._held_scales.extend(scales)
            return
        held, self._held_scales = self._held_scales, []
        if held and any(not torch.equal(h.to(scales[0].device), scales[0]) for h in held[1:] + scales):
            raise RuntimeError(
                "distmm: a sharded tower accumulates its gradients inside FSDP, which reduces their total once;"
                " the losses of the accumulated batches reached backward with different scales"
                f" ({[float(h) for h in held + scales]}), which that total cannot express. Return the loss"
                " unscaled per batch (Lightning's 1/accumulate_grad_batches is fine) or use shard: none"
            )

    # ------------------------------------------------------------------ sums
    def buckets(self, name: str) -> GradientBuckets | None:
        """Buckets of tower ``name``'s gradients, summed over its replicas as they become final (None:
        one replica, or a sharded tower, which FSDP sums). Built once: their buffers are the
        gradients' storage on the steps whose sums are posted during the step."""
        tower = self.plan.towers[name]
        if tower.dp * tower.cp == 1 or self.sharded(name) or name in self.shards or not self.trainable(name):
            return None
        if name not in self._buckets:
            group = None if tower.dp * tower.cp == self.world else self.groups[name].dp_group
            params = [p for p in self.tower_params[name].values() if p.requires_grad and not p.is_meta]
            self._buckets[name] = GradientBuckets(
                params, group, int(self.bucket_cap_mb * 2**20), first_cap=FIRST_BUCKET_BYTES
            )
        return self._buckets[name]

    def attach_bucket_views(self) -> None:
        """Before a step whose sums are posted during it: every local tower's gradients become views
        of its buckets (:meth:`GradientBuckets.attach`)."""
        for name in self.layout.local_towers:
            buckets = self.buckets(name)
            if buckets is not None:
                buckets.attach()

    def post_interaction_sum(self) -> list[PendingSum]:
        """Post the sum of the interaction parameters' gradients over all ranks (nothing if there are none)."""
        grads = self._grads_for(self.interaction_params)
        return [allreduce_sum_async(grads)] if grads else []

    def copies(self) -> list[tuple[nn.Parameter, int]]:
        """Each local parameter with the number of ranks that hold the same copy of it (the interaction
        parameters: every rank; a tower's: its data-parallel replicas)."""
        out = [(p, self.world) for p in self.interaction_params.values()]
        for name in self.layout.local_towers:
            tower = self.plan.towers[name]
            out.extend((p, tower.dp * tower.cp) for p in self.tower_params[name].values())
        return out

    def _grads_for(self, params: Mapping[str, nn.Parameter]) -> list[Tensor]:
        out = []
        for p in params.values():
            if not p.requires_grad or p.is_meta:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(local(p.grad))
        return out

    def sum_all(self) -> None:
        """Sum gradients over each tower's replicas and the interaction parameters over all ranks."""
        world_grads = self._grads_for(self.interaction_params)
        for name in self.layout.local_towers:
            tower = self.plan.towers[name]
            if tower.dp * tower.cp == 1 or not self.trainable(name) or self.sharded(name) or name in self.shards:
                continue  # one copy, nothing to learn, or summed by FSDP or by the ZeRO-1 reduce-scatter
            grads = self._grads_for(self.tower_params[name])
            if tower.dp * tower.cp == self.world:
                world_grads.extend(grads)  # the replicas span the world: one collective for all
            else:
                allreduce_sum(grads, self.groups[name].dp_group)
        if world_grads:
            allreduce_sum(world_grads)

    # ------------------------------------------------------------------ clipping
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm of the gradient of the whole model, across all towers and ranks.

        Each tower's gradient is counted once, by its first replica: tensor-parallel shards by
        every rank of that replica's first cp rank, replicated parameters by the first tensor- and
        context-parallel rank of each pipeline stage (stages hold different parameters); a sharded tower's (FSDP) shards by every
        rank holding a distinct one (each ``DTensor``'s rank at coordinate 0 of its replicated mesh
        dimensions); the interaction parameters once (by rank 0). Then every rank scales its own
        gradients.
        """
        norm_type = float(norm_type)
        counted: list[Tensor] = []
        if self.rank == 0:
            counted.extend(p.grad for p in self.interaction_params.values() if p.grad is not None)
        for name in self.layout.local_towers:
            tower = self.plan.towers[name]
            if self.sharded(name):
                counted.extend(local(p.grad) for p in self.tower_params[name].values() if counts_once(p.grad))
                continue
            if name in self.shards:  # every rank's pieces are its own; a tp-replicated one counted on tp rank 0
                tp_rank = self.groups[name].mesh.get_local_rank("tp")
                pieces = self.shards.towers[name].gradients()
                counted.extend(g for p, g in pieces if is_sharded(p) or tp_rank == 0)
                continue
            if self.rank not in tower.replica_ranks(0):
                continue
            # position in the stage: (cp, tp); the cp ranks hold the same summed gradients, count the first
            cp_rank, tp_rank = divmod(tower.replica_ranks(0).index(self.rank) % tower.stage_width, tower.tp)
            for p in self.tower_params[name].values():
                if p.grad is not None and cp_rank == 0 and (is_sharded(p) or tp_rank == 0):
                    counted.append(local(p.grad))
        if math.isinf(norm_type):
            part = torch.stack([g.detach().abs().max() for g in counted]).max() if counted else torch.zeros(())
            part = part.to(self.device, torch.float32)
            dist.all_reduce(part, op=dist.ReduceOp.MAX)
            total = part
        else:
            norms = [torch.linalg.vector_norm(g.detach(), norm_type) for g in counted]
            part = (torch.stack(norms) ** norm_type).sum() if norms else torch.zeros(())
            part = part.to(self.device, torch.float32)
            dist.all_reduce(part, op=dist.ReduceOp.SUM)
            total = part ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        pieces = [g for tower in self.shards.towers.values() for _, g in tower.gradients()]
        for grad in [local(p.grad) for p in self.local_parameters() if p.grad is not None] + pieces:
            grad.detach().mul_(coef.to(grad.device, grad.dtype))
        return total


def scaled_all(produced: Gradients, scale: Tensor | None) -> Gradients:
    """``produced``'s gradients multiplied in place by the upstream gradient ``scale``, one fused
    multiply per device and dtype. Multiplied even when ``scale`` is 1 (exact: ``g * 1.0 == g``):
    finding out that it is 1 would read the device's value back, a wait for the device every step."""
    if scale is None or not produced:
        return produced
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for _, g in produced:
        t = local(g)
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), grads in by_kind.items():
        torch._foreach_mul_(grads, scale.to(device, dtype))
    return produced


def counts_once(g: Tensor | None) -> bool:
    """Whether this rank's piece of the DTensor ``g`` is one no other rank counts: its coordinate is
    0 along every mesh dimension where ``g`` is replicated (a plain tensor on a sharded tower: never)."""
    if not isinstance(g, DTensor):
        return False
    coordinate = g.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, pl in zip(coordinate, g.placements) if isinstance(pl, Replicate))


def is_sharded(t: Tensor) -> bool:
    return isinstance(t, DTensor) and any(not isinstance(pl, Replicate) for pl in t.placements)
