"""The per-rank runtime of a distmm plan: one executor for the schedule's instruction list.

One training step on a rank is its list from :func:`lightning_distmm.core.schedule.rank_schedule`,
run in full inside :meth:`TowerRuntime.contrastive_loss` (the module's ``training_step``):

1. ``Forward``: a microbatch of a local tower through this rank's stage (the whole tower without
   pipeline), receiving its input from the previous stage and posting its output to the next;
2. ``BatchSync`` (last stages only), the four steps of DESIGN section 1: the wave's features of
   every tower are gathered into whole-group tensors, which become leaves; the interaction loss
   runs forward on this rank's rows (:mod:`lightning_distmm.interaction`) and backward; the
   per-rank partial feature gradients are summed over the last stages; each microbatch takes its
   rows of that sum;
3. ``Backward``: the microbatch's backward through the stage, from its feature gradient (last
   stage) or the gradient received from the next stage, posting the input gradient back;
4. ``GradSync``: each tower's gradients summed over its data-parallel replicas, the interaction
   parameters' over all ranks. Sums, not means: every rank's loss is its share of the whole-batch
   mean, so the sum is exactly the single-process gradient, whatever the replicas' batch sizes.

Lightning zeroes gradients between ``training_step`` and ``backward``, so the gradients the step
produced are set aside and handed back in the strategy's ``backward`` (the gradients from before
the step are set aside meanwhile, or dropped when Lightning is about to zero them anyway), scaled by the gradient that
reaches the returned loss (Lightning divides it for gradient accumulation; a user may scale it):
the returned loss has the whole-batch value on every rank and a backward that records that scale.
The gradient sums run there too, once per optimizer step.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from lightning_distmm.interaction import row_share
from lightning_distmm.tower import Tower

if TYPE_CHECKING:  # pragma: no cover
    from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.core.layout import GLOBAL_BATCH_KEY, RankBatch, RankLayout
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import (
    Backward,
    BatchSync,
    Forward,
    Instruction,
    rank_schedule,
    stage_neighbours,
    sync_ranks,
)
from lightning_distmm.parallel.exchange import (
    FeatureSpec,
    GatherSlot,
    PendingSum,
    allreduce_sum,
    allreduce_sum_async,
    exchange_specs,
    gather_features,
)
from lightning_distmm.parallel.groups import TowerGroups
from lightning_distmm.parallel.pipeline import Stage


@dataclass
class _Microbatch:
    """A microbatch on this rank's stage: its input activation (None on the first stage), batch rows,
    and either its output with the graph (kept) or the RNG state to recompute it (cached)."""

    input: Tensor | None
    rows: Mapping[str, Any]
    output: Tensor | None
    rng: tuple[Tensor, Tensor | None] | None


@dataclass
class _Step:
    """One step's state on this rank: microbatch rows and records, last-stage outputs, feature gradients."""

    n: int
    batch: RankBatch
    rows: dict[tuple[str, int], slice]
    wave_of: dict[tuple[str, int], int] = field(default_factory=dict)
    last: dict[str, bool] = field(default_factory=dict)
    records: dict[tuple[str, int], _Microbatch] = field(default_factory=dict)
    outputs: dict[tuple[int, str], list[Tensor]] = field(default_factory=dict)
    feature_grads: dict[tuple[str, int], Tensor] = field(default_factory=dict)
    loss: Tensor = field(default_factory=lambda: torch.zeros(()))


def _new_step(instructions: list[Instruction], batch: RankBatch) -> _Step:
    """A step's bookkeeping from the instructions: each (tower, microbatch)'s local rows (each wave's
    rows of the replica, cut in microbatch order), its wave, and whether this rank is a last stage."""
    step = _Step(batch.n, batch, {})
    nxt: dict[tuple[str, int], int] = {}
    for ins in instructions:
        if isinstance(ins, Forward):
            key = (ins.tower, ins.sync_group)
            a = nxt.get(key, batch.towers[ins.tower].spans[ins.sync_group].local_start)
            step.rows[ins.tower, ins.mb] = slice(a, a + ins.rows)
            step.wave_of[ins.tower, ins.mb] = ins.sync_group
            step.last[ins.tower] = ins.send_to is None
            nxt[key] = a + ins.rows
    return step


@dataclass
class _StepGradients:
    """Gradients one ``contrastive_loss`` produced, set aside until the strategy's ``backward``."""

    grads: list[tuple[nn.Parameter, Tensor]]
    scale: Tensor | None = None  # the gradient that reached the returned loss
    #: the sums over replicas, posted during the step's backward (None: sums run in ``backward``)
    sums: list[PendingSum] | None = None


class _DeferredGradients(torch.autograd.Function):
    """The returned loss: its value is the whole-batch loss; its backward records the upstream gradient."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, anchor: Tensor, pending: _StepGradients) -> Tensor:  # type: ignore[override]
        ctx.pending = pending
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.pending.scale = grad.detach() if ctx.pending.scale is None else ctx.pending.scale + grad.detach()
        return None, None, None


def tower_prefixes(module: nn.Module, towers: Mapping[str, Tower]) -> dict[str, str]:
    """Each tower's submodule path inside ``module`` (found by identity), e.g. ``{"image": "visual"}``."""
    prefixes: dict[str, str] = {}
    for fqn, sub in module.named_modules():
        for name, tower in towers.items():
            if sub is tower.module and name not in prefixes:
                prefixes[name] = fqn
    missing = [n for n in towers if n not in prefixes]
    if missing:
        raise ValueError(f"tower(s) {missing}: the Tower's module is not a submodule of {type(module).__name__}")
    return prefixes


def tower_parameters(
    module: nn.Module, towers: Mapping[str, Tower]
) -> tuple[dict[str, dict[str, nn.Parameter]], dict[str, nn.Parameter]]:
    """Split ``module``'s parameters by tower (by module identity); the rest are interaction parameters."""
    prefixes = tower_prefixes(module, towers)
    per_tower: dict[str, dict[str, nn.Parameter]] = {n: {} for n in towers}
    rest: dict[str, nn.Parameter] = {}
    owner_of: dict[int, str] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        owners = [n for n, pre in prefixes.items() if fqn.startswith(pre + ".")]
        if len(owners) > 1:
            raise ValueError(f"parameter {fqn!r} lies in several towers {owners}; towers must not nest")
        if owners:
            if owner_of.setdefault(id(p), owners[0]) != owners[0]:
                raise ValueError(f"parameter {fqn!r} is shared between towers {owner_of[id(p)]!r} and {owners[0]!r}")
            per_tower[owners[0]][fqn] = p
        elif id(p) not in owner_of:
            rest[fqn] = p
    return per_tower, rest


class TowerRuntime:
    """Runs this rank's share of every step: its towers, the feature exchange, the gradient sums."""

    def __init__(self, module: DistMMMixin, plan: Plan, groups: Mapping[str, TowerGroups], device: torch.device):
        self.plan = plan
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device
        self.towers = module.tower_specs()
        self.groups = groups
        self.layout = RankLayout(plan, self.rank, {n: t.fields for n, t in self.towers.items()})
        self.module = module
        self.tower_params, self.interaction_params = tower_parameters(module, self.towers)  # type: ignore[arg-type]
        self.specs: dict[str, FeatureSpec] | None = None
        self._pending: list[_StepGradients] = []
        self._slots: dict[int, dict[str, GatherSlot]] = {}
        #: the ranks that meet at the batch-sync (every rank of a last stage) and their process group
        self.sync_ranks = sync_ranks(plan)
        self.sync_group = dist.new_group(list(self.sync_ranks)) if len(self.sync_ranks) < self.world else None
        self._sends: list[Any] = []
        #: per pipelined tower, one process group for activations and one for gradients (see send_tensor)
        self.p2p_groups = {
            (name, kind): dist.new_group(list(range(self.world)))
            for name, t in plan.towers.items()
            if t.pp > 1
            for kind in ("act", "grad")
        }
        #: set by the strategy when Lightning will zero the gradients after this training_step
        self.discard_earlier_gradients = False
        #: set by the strategy: whether this step's backward ends with the gradient sums (not accumulating)
        self.sync_this_step = True
        #: size of the gradient buckets summed during the backward (DDP's ``bucket_cap_mb``)
        self.bucket_cap_mb = 25.0
        self._schedules: dict[int, list[Instruction]] = {}
        #: when a list, the executor appends ``(instruction, start, end)`` of its compute (perf_counter)
        self.trace: list[tuple[Instruction, float, float]] | None = None
        self.stages: dict[str, Stage] = {}  # this rank's stage of each local tower with pp > 1
        #: bytes of stage-boundary activations the last forward kept outside autograd (cached schedule)
        self.stash_bytes = 0

    # ------------------------------------------------------------------ memory
    def prepare_local_towers(self) -> None:
        """Keep only what this rank runs: release remote towers, cut pipelines, shard for TP.

        Each step may swap in new Parameter objects (``Module.to("meta")``, DTensor sharding), so
        the parameter table is rebuilt once at the end, dropping references to the old ones, and
        the freed memory is handed back.
        """
        self.release_remote_towers()
        self.cut_pipelines()
        self.parallelize_local_towers()
        self.tower_params, self.interaction_params = tower_parameters(self.module, self.towers)  # type: ignore[arg-type]
        return_freed_memory()

    def release_remote_towers(self) -> None:
        """Move the parameters of towers this rank does not run to the meta device."""
        for name, tower in self.towers.items():
            if name not in self.layout.local_towers:
                tower.module.to("meta")

    def cut_pipelines(self) -> None:
        """For towers with pp > 1: keep only this rank's stage of the tower, release the rest."""
        from lightning_distmm.parallel.pipeline import release_unowned, tower_stages

        for name, tower in self.plan.towers.items():  # every rank checks every cut: fail together
            if tower.pp > 1:
                try:
                    tower_stages(self.towers[name].module, tower.pp, self.towers[name].fields)
                except ValueError as err:
                    raise ValueError(f"tower {name!r}, pp={tower.pp}: {err}") from None
        for name in self.layout.local_towers:
            tower = self.plan.towers[name]
            if tower.pp == 1:
                continue
            stage = stage_neighbours(self.plan, name, self.rank)[1]
            self.stages[name] = tower_stages(self.towers[name].module, tower.pp, self.towers[name].fields)[stage]
            release_unowned(self.towers[name].module, self.stages[name])

    def parallelize_local_towers(self) -> None:
        """Shard the local towers that the plan gives tensor parallelism (tp > 1) over their tp mesh."""
        from lightning_distmm.parallel.tensor_parallel import apply_tp, check_tp

        for name, tower in self.plan.towers.items():  # every rank checks every tower: fail together
            if tower.tp > 1:
                check_tp(self.towers[name].module, tower.tp, name)
        for name in self.layout.local_towers:
            if self.plan.towers[name].tp > 1:
                apply_tp(self.towers[name].module, self.groups[name].mesh["tp"])

    def trainable(self, name: str) -> bool:
        return not self.towers[name].frozen and any(p.requires_grad for p in self.tower_params[name].values())

    # ------------------------------------------------------------------ forward
    def global_batch_size(self, batch: Mapping[str, Any]) -> int:
        if GLOBAL_BATCH_KEY not in batch:
            raise KeyError(
                "this batch did not come through the distmm data loader (no global batch size attached);"
                " feed data through the Trainer's dataloaders"
            )
        return int(batch[GLOBAL_BATCH_KEY])

    def slots(self, n: int) -> dict[str, GatherSlot]:
        """Where each tower's features of a sync group of ``n`` rows come from (rows relative to the group)."""
        if n not in self._slots:
            self._slots[n] = {
                name: GatherSlot([t.feature_rank(i) for i in range(t.dp)], self.layout.offsets(name, n))
                for name, t in self.plan.towers.items()
            }
        return self._slots[n]

    def schedule(self, n: int) -> list[Instruction]:
        """This rank's instructions for a global batch of ``n`` (the plan's schedule, as data)."""
        if n not in self._schedules:
            self._schedules[n] = rank_schedule(self.plan, self.rank, n)
        return self._schedules[n]

    def contrastive_loss(self, module: DistMMMixin, batch: Mapping[str, Any]) -> Tensor:
        """Run this rank's whole schedule for the step; return the whole-batch loss (grouped under ``distmm``)."""
        n = self.global_batch_size(batch)
        rank_batch = self.layout.batch(n)
        training = torch.is_grad_enabled()
        for name in self.layout.local_towers:
            for f in self.towers[name].fields:
                if f not in batch:
                    raise KeyError(
                        f"tower {name!r} reads batch field {f!r} but the batch has only"
                        f" {sorted(k for k in batch if k != GLOBAL_BATCH_KEY)}"
                    )
        instructions = self.schedule(n)
        learns = training and (
            any(self.trainable(t) for t in self.layout.local_towers)
            or any(p.requires_grad for p in self.interaction_params.values())
        )
        earlier = self._take_gradients() if learns else []
        if self.discard_earlier_gradients:
            earlier = []  # Lightning zeroes them after this step: free them before the backward
        step = _new_step(instructions, rank_batch)
        self.stash_bytes = 0
        # Gradient sums overlapped with the backward (DDP's idea): when this step's gradients are the
        # whole optimizer step's (no accumulation, nothing set aside), each tower's sum is posted as
        # soon as its last backward on this rank is done, the interaction parameters' at the end.
        # The same decision on every rank (it depends on the strategy's flags only).
        overlap = learns and self.sync_this_step and self.discard_earlier_gradients
        last_backward = (
            {ins.tower: i for i, ins in enumerate(instructions) if isinstance(ins, Backward)} if overlap else {}
        )
        sums: list[PendingSum] = []
        try:
            for i, ins in enumerate(instructions):
                self._sends = [s for s in self._sends if not s.done()]
                if isinstance(ins, Forward):
                    rows = {
                        f: _take_rows(batch[f], step.rows[ins.tower, ins.mb]) for f in self.towers[ins.tower].fields
                    }
                    self._forward(ins, rows, training, step)
                elif isinstance(ins, BatchSync):
                    self._batch_sync(module, ins, step, training)
                elif isinstance(ins, Backward):
                    if training and self.trainable(ins.tower):
                        # the tower's last backward on this rank: its gradients become final during it,
                        # bucket by bucket, and each bucket's sum is posted as soon as it is
                        buckets = self._gradient_buckets(ins.tower) if last_backward.get(ins.tower) == i else None
                        self._backward(
                            ins,
                            step.records.pop((ins.tower, ins.mb)),
                            step.feature_grads.pop((ins.tower, ins.mb), None),
                        )
                        if buckets is not None:
                            sums.extend(buckets.finish())
                # GradSync: posted above when overlapping, else in finish_backward (once per optimizer step)
            for pending in self._sends:
                pending.wait()
            if overlap:
                grads = self._grads_for(self.interaction_params)
                sums.extend([allreduce_sum_async(grads)] if grads else [])
        finally:
            self._sends = []
        # the loss value for every rank (the first stages hold none): one sum over the world
        total = step.loss.reshape(1).to(self.device, torch.float32)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total = total[0].to(step.loss.dtype)
        if not learns:
            return total
        produced = _StepGradients(self._take_gradients(), sums=sums if overlap else None)
        self._restore_gradients(earlier)
        self._pending.append(produced)
        anchor = torch.zeros((), device=total.device, requires_grad=True)
        return _DeferredGradients.apply(total, anchor, produced)

    # ------------------------------------------------------------------ instructions
    def _run_stage(self, name: str, x: Tensor | None, rows: Mapping[str, Any], training: bool) -> Tensor:
        if name in self.stages:
            return self.stages[name].run(x, rows)
        tower = self.towers[name]
        if self.plan.towers[name].recompute and training and self.trainable(name):
            # activation checkpointing: keep the tower's inputs, recompute its forward in backward
            return checkpoint(tower.encode, rows, use_reentrant=False)
        return tower.encode(rows)

    def _forward(self, ins: Forward, rows: Mapping[str, Any], training: bool, step: _Step) -> None:
        """One microbatch through this rank's stage of a tower (the whole tower without pipeline)."""
        from lightning_distmm.parallel.pipeline import recv_tensor, send_tensor

        grad = training and self.trainable(ins.tower)
        x_in = (
            recv_tensor(ins.recv_from, self.device, self.p2p_groups.get((ins.tower, "act")))
            if ins.recv_from is not None
            else None
        )
        start = time.perf_counter()
        if grad and not ins.keep:  # cached: no activations now, recompute from the input in backward
            rng = _rng_state(self.device)
            with torch.no_grad():
                x = self._run_stage(ins.tower, x_in, rows, training)
            step.records[ins.tower, ins.mb] = _Microbatch(x_in, rows, None, rng)
            if x_in is not None:
                self.stash_bytes += x_in.numel() * x_in.element_size()
        else:
            if grad and x_in is not None:
                x_in.requires_grad_(True)
            x = self._run_stage(ins.tower, x_in, rows, training)
            if grad:
                step.records[ins.tower, ins.mb] = _Microbatch(x_in, rows, x, None)
        if self.trace is not None:
            self.trace.append((ins, start, time.perf_counter()))
        if ins.send_to is not None:
            self._sends.append(send_tensor(x, ins.send_to, self.p2p_groups.get((ins.tower, "act"))))
        else:
            step.outputs.setdefault((ins.sync_group, ins.tower), []).append(x)

    def _batch_sync(self, module: DistMMMixin, ins: BatchSync, step: _Step, training: bool) -> None:
        """Wave ``ins.sync_group``'s features meet: gather, the loss forward and backward, the feature gradients split."""
        start = time.perf_counter()
        group_sizes = self.plan.group_split(step.n)
        rows = group_sizes[ins.sync_group]
        local = {tower: torch.cat(outs) for (wave, tower), outs in step.outputs.items() if wave == ins.sync_group}
        if self.specs is None:
            self.specs = exchange_specs(local, list(self.towers), self.sync_group)
        full = gather_features(local, self.slots(rows), self.specs, self.device, self.sync_group)
        for name, feats in full.items():
            feats.requires_grad_(training and self.trainable(name))
        index, parts = self.sync_ranks.index(self.rank), len(self.sync_ranks)
        with row_share(index, parts) as share:
            loss = module.interaction_loss(full)
        if not share.asked:
            # a whole-batch loss computed identically on every rank: each contributes 1/parts of it
            loss = loss / parts
        if len(group_sizes) > 1:
            loss = loss * (rows / step.n)  # the grouped loss: each group's mean weighted by its share of rows
        step.loss = step.loss + loss.detach()
        if not (training and loss.requires_grad):
            return
        torch.autograd.backward(loss)
        grads = {}
        for name, leaf in full.items():
            if self.trainable(name):
                grads[name] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        allreduce_sum(list(grads.values()), self.sync_group)
        # each of this rank's microbatches of the wave takes its rows of the summed feature gradient
        for (tower, mb), part in step.rows.items():
            if tower in grads and step.wave_of[tower, mb] == ins.sync_group and step.last[tower]:
                offset = self.layout.offsets(tower, rows)[step.batch.towers[tower].replica]
                span = step.batch.towers[tower].spans[ins.sync_group]
                a = offset + part.start - span.local_start
                step.feature_grads[tower, mb] = grads[tower][a : a + part.stop - part.start]
        if self.trace is not None:
            self.trace.append((ins, start, time.perf_counter()))

    def _backward(self, ins: Backward, micro: _Microbatch, feature_grad: Tensor | None) -> None:
        """One microbatch backward through this rank's stage; the input gradient goes to the previous stage."""
        from lightning_distmm.parallel.pipeline import recv_tensor, send_tensor

        group = self.p2p_groups.get((ins.tower, "grad"))
        g_out = recv_tensor(ins.recv_from, self.device, group) if ins.recv_from is not None else feature_grad
        start = time.perf_counter()
        if micro.output is None:  # cached: recompute the stage from its saved input, same RNG
            x_in = micro.input.requires_grad_(True) if micro.input is not None else None
            with _restored_rng(micro.rng, self.device):  # type: ignore[arg-type]
                out = self._run_stage(ins.tower, x_in, micro.rows, True)
        else:
            x_in, out = micro.input, micro.output
        torch.autograd.backward(out, g_out)
        if self.trace is not None:
            self.trace.append((ins, start, time.perf_counter()))
        if ins.send_to is not None:
            assert x_in is not None
            self._sends.append(
                send_tensor(x_in.grad if x_in.grad is not None else torch.zeros_like(x_in), ins.send_to, group)
            )

    # ------------------------------------------------------------------ gradients
    def _take_gradients(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Remove and return the gradients of this rank's parameters (leaving ``.grad`` empty)."""
        taken = []
        for p in self.local_parameters():
            if p.grad is not None:
                taken.append((p, p.grad))
                p.grad = None
        return taken

    @staticmethod
    def _restore_gradients(grads: list[tuple[nn.Parameter, Tensor]]) -> None:
        for p, g in grads:
            p.grad = g

    def set_aside_gradients(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Before the strategy's autograd backward: take the accumulated gradients out of ``.grad``,
        so that what the backward adds there is known to come from terms outside ``contrastive_loss``."""
        return self._take_gradients()

    def finish_backward(self, sync: bool, earlier: list[tuple[nn.Parameter, Tensor]] = ()) -> None:  # type: ignore[assignment]
        """In the strategy's ``backward``, after autograd's: complete ``.grad`` and sum it (``GradSync``).

        ``.grad`` then holds the gradients of the terms the training_step added outside
        ``contrastive_loss`` (a regulariser): every rank that holds a parameter computed them, and
        the gradient sums would count them once per rank, so they are averaged over those ranks
        first (DDP's rule). Then the gradients set aside before the backward (``earlier``:
        accumulation) are added back, and the schedule's gradients, scaled by the upstream gradient
        of the loss that ``contrastive_loss`` returned (the same on every rank, so it may scale a
        sum already taken during the step).
        """
        pending, self._pending = self._pending, []
        used = [p for p in pending if p.scale is not None]
        if not used:
            self._restore_gradients(list(earlier))
            raise RuntimeError(
                "distmm: backward() was called on a loss that does not come from contrastive_loss() in this step;"
                " the training_step must return (a function of) the loss that DistMMMixin.contrastive_loss(batch) gave"
            )
        for p, copies in self._copies():
            if p.grad is not None and copies > 1:
                _local(p.grad).div_(copies)
        summed = all(s.sums is not None for s in used)
        if summed:
            assert sync and not earlier, "sums were posted during a step that accumulates"
            for produced in used:
                for posted in produced.sums or ():
                    posted.wait()
            # the terms outside contrastive_loss still need their sums, if any rank has one
            extra = torch.tensor([float(any(p.grad is not None for p, _ in self._copies()))], device=self.device)
            dist.all_reduce(extra)
            if extra.item() > 0:
                self.sync_gradients()
        for p, g in [*earlier, *((p, _scaled(g, s.scale)) for s in used for p, g in s.grads)]:
            if p.grad is None:
                p.grad = g
            else:
                _local(p.grad).add_(_local(g))
        if sync and not summed:
            self.sync_gradients()

    def _gradient_buckets(self, name: str) -> _GradientBuckets | None:
        """Buckets of tower ``name``'s gradients, summed over its replicas as they become final (None: one replica)."""
        tower = self.plan.towers[name]
        if tower.dp == 1:
            return None
        group = None if tower.dp == self.world else self.groups[name].dp_group
        params = [p for p in self.tower_params[name].values() if p.requires_grad and not p.is_meta]
        return _GradientBuckets(params, group, int(self.bucket_cap_mb * 2**20))

    def _copies(self) -> list[tuple[nn.Parameter, int]]:
        """Each local parameter with the number of ranks that hold the same copy of it (the interaction
        parameters: every rank; a tower's: its data-parallel replicas)."""
        out = [(p, self.world) for p in self.interaction_params.values()]
        for name in self.layout.local_towers:
            out.extend((p, self.plan.towers[name].dp) for p in self.tower_params[name].values())
        return out

    def _grads_for(self, params: Mapping[str, nn.Parameter]) -> list[Tensor]:
        out = []
        for p in params.values():
            if not p.requires_grad or p.is_meta:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(_local(p.grad))
        return out

    def sync_gradients(self) -> None:
        """Sum gradients over each tower's replicas and the interaction parameters over all ranks."""
        world_grads = self._grads_for(self.interaction_params)
        for name in self.layout.local_towers:
            tower = self.plan.towers[name]
            if tower.dp == 1 or not self.trainable(name):
                continue
            grads = self._grads_for(self.tower_params[name])
            if tower.dp == self.world:
                world_grads.extend(grads)  # the replicas span the world: one collective for all
            else:
                allreduce_sum(grads, self.groups[name].dp_group)
        if world_grads:
            allreduce_sum(world_grads)

    # ------------------------------------------------------------------ clipping
    def local_parameters(self) -> list[nn.Parameter]:
        params = list(self.interaction_params.values())
        for name in self.layout.local_towers:
            params.extend(self.tower_params[name].values())
        return params

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm of the gradient of the whole model, across all towers and ranks.

        Each tower's gradient is counted once, by its first replica: tensor-parallel shards by
        every rank of that replica, replicated parameters by the first tensor-parallel rank of each
        pipeline stage (stages hold different parameters); the interaction
        parameters once (by rank 0). Then every rank scales its own gradients.
        """
        norm_type = float(norm_type)
        counted: list[Tensor] = []
        if self.rank == 0:
            counted.extend(p.grad for p in self.interaction_params.values() if p.grad is not None)
        for name in self.layout.local_towers:
            tower = self.plan.towers[name]
            if self.rank not in tower.replica_ranks(0):
                continue
            first_tp = tower.replica_ranks(0).index(self.rank) % tower.tp == 0
            for p in self.tower_params[name].values():
                if p.grad is not None and (_is_sharded(p) or first_tp):
                    counted.append(_local(p.grad))
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
        for p in self.local_parameters():
            if p.grad is not None:
                grad = _local(p.grad)
                grad.detach().mul_(coef.to(grad.device, grad.dtype))
        return total


class _GradientBuckets:
    """DDP's reducer, for one tower during its last backward of the step: the parameters in fixed
    buckets of up to ``cap`` bytes (reverse order: the last layers' gradients are final first); a
    bucket's sum over ``group`` is posted once all its gradients are final, buckets in order, so
    every replica posts the same sequence. :meth:`finish` posts what the backward did not reach."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, cap: int):
        self.group = group
        self.buckets: list[list[nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            nbytes = _local(p).numel() * _local(p).element_size()
            if not self.buckets or (size + nbytes > cap and self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.ready: set[int] = set()
        self.next = 0
        self.posted: list[PendingSum] = []
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_ready) for p in params]

    def _on_ready(self, p: Tensor) -> None:
        self.ready.add(id(p))
        while self.next < len(self.buckets) and all(id(q) in self.ready for q in self.buckets[self.next]):
            self._post()

    def _post(self) -> None:
        grads = []
        for p in self.buckets[self.next]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        self.posted.append(allreduce_sum_async(grads, self.group))
        self.next += 1

    def finish(self) -> list[PendingSum]:
        for hook in self.hooks:
            hook.remove()
        while self.next < len(self.buckets):
            self._post()
        return self.posted


def _scaled(g: Tensor, scale: Tensor | None) -> Tensor:
    """``g`` multiplied in place by the upstream gradient ``scale`` (skipped when it is exactly 1)."""
    if scale is not None and not bool(torch.all(scale == 1)):
        _local(g).mul_(scale.to(g.device, g.dtype))
    return g


def _local(t: Tensor) -> Tensor:
    """The tensor this rank stores: a DTensor's local shard (collectives and in-place ops act on it)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _is_sharded(t: Tensor) -> bool:
    return isinstance(t, DTensor) and any(not isinstance(pl, Replicate) for pl in t.placements)


def return_freed_memory() -> None:
    """Hand freed host memory back to the OS.

    glibc keeps freed blocks below its (adaptive) mmap threshold in the heap, so releasing a
    tower would not lower the resident set size; ``malloc_trim`` returns those pages. Device
    memory freed by the caching allocator is returned with ``empty_cache``.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
