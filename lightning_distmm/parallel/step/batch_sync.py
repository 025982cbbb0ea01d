"""The batch-sync instruction: every tower's features of a sync group meet at the interaction loss.

DistMM's batch-sync (``BatchSync``, or ``SyncPost`` + ``SyncWait`` when the gather overlaps the next
group's forwards) runs on the towers' last stages. The group's features are gathered into
whole-group tensors that become leaves, the interaction loss runs forward on this rank's rows
(:func:`lightning_distmm.interaction.row_share`) and backward, the per-rank partial feature gradients
are summed over the batch-sync ranks, and each microbatch takes its rows of that sum for its
backward. Torch has no collective for "two towers meet at one batch-level loss"; this module is
where the project writes its own (docs/design.md).

The gathered features are in step order (:mod:`lightning_distmm.core.assignment`); when a step's
rows were assigned by cost, the loss reads them put back in sample order (a gather by index, whose
backward puts each row's gradient back where the row came from), so it is the one-process loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.core.assignment import RowAssignment
from lightning_distmm.core.layout import RankLayout
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import BatchSync, SyncPost, SyncWait
from lightning_distmm.interaction import row_share
from lightning_distmm.parallel.exchange import (
    FeatureSpec,
    GatherSlot,
    allreduce_sum,
    exchange_specs,
    gather_features_async,
)
from lightning_distmm.parallel.groups import Topology
from lightning_distmm.parallel.step.state import ScheduleRun
from lightning_distmm.tower import TowerModule


class BatchSyncRunner:
    """Runs one rank's batch-sync instructions: the posted gather and the meeting at the loss."""

    def __init__(
        self,
        plan: Plan,
        layout: RankLayout,
        towers: list[str],
        topology: Topology,
        rank: int,
        device: torch.device,
        trainable: Callable[[str], bool],
    ):
        self.plan = plan
        self.layout = layout
        self.towers = towers
        self.topology = topology
        self.device = device
        self.trainable = trainable
        self.rank = rank
        #: the features' shapes and dtypes, exchanged once (the first step) over the batch-sync ranks
        self.specs: dict[str, FeatureSpec] | None = None
        self._slots: dict[Any, dict[str, GatherSlot]] = {}

    def slots(self, assignment: RowAssignment, group: int) -> dict[str, GatherSlot]:
        """Where each tower's features of sync group ``group`` come from (rows relative to the group)."""
        key = (assignment.sizes_key, group)
        if key not in self._slots:
            if len(self._slots) >= 256:  # balanced steps each have their own sizes: keep the recent ones
                self._slots.pop(next(iter(self._slots)))
            self._slots[key] = {
                name: GatherSlot([t.feature_rank(i) for i in range(t.dp)], assignment.offsets(name, group))
                for name, t in self.plan.towers.items()
            }
        return self._slots[key]

    def post(self, ins: BatchSync | SyncPost, run: ScheduleRun) -> None:
        """Post the gather of sync group ``ins.sync_group``'s features (``async_op``); :meth:`meet` waits for it."""
        start = run.now()
        local = {tower: torch.cat(outs) for (group, tower), outs in run.outputs.items() if group == ins.sync_group}
        if self.specs is None:
            self.specs = exchange_specs(local, self.towers, self.topology.batch_sync)
        run.gathers[ins.sync_group] = gather_features_async(
            local, self.slots(run.batch.assignment, ins.sync_group), self.specs, self.device, self.topology.batch_sync
        )
        if isinstance(ins, SyncPost):
            run.traced(ins, start)

    def meet(
        self,
        module: TowerModule,
        ins: BatchSync | SyncWait,
        run: ScheduleRun,
        training: bool,
        start: Any = None,
    ) -> None:
        """Sync group ``ins.sync_group``'s features meet: wait for their gather (posted by :meth:`post`),
        the loss forward and backward, the feature gradients split (traced from ``start``, the post of a
        blocking ``BatchSync``)."""
        if start is None:
            start = run.now()
        group_sizes = self.plan.group_split(run.n)
        rows = group_sizes[ins.sync_group]
        full = run.gathers.pop(ins.sync_group).wait()
        for name, feats in full.items():
            feats.requires_grad_(training and self.trainable(name))
        first = self.plan.group_offsets(run.n)[ins.sync_group]
        inverse = run.batch.assignment.group_inverse(first, first + rows)
        features = full
        if inverse is not None:  # the loss sees the batch in sample order
            index_t = torch.tensor(inverse, dtype=torch.long).to(self.device, non_blocking=True)
            features = {name: feats.index_select(0, index_t) for name, feats in full.items()}
        ranks = self.topology.batch_sync_ranks
        index, parts = ranks.index(self.rank), len(ranks)
        with row_share(index, parts) as share:
            loss = module.interaction_loss(features)
        check_loss(loss, training and any(f.requires_grad for f in full.values()))
        if not share.asked:
            # a whole-batch loss computed identically on every batch-sync rank: each contributes 1/parts of it
            loss = loss / parts
        if len(group_sizes) > 1:
            loss = loss * (rows / run.n)  # the grouped loss: each group's mean weighted by its share of rows
        run.loss = run.loss + loss.detach()
        if not (training and loss.requires_grad):
            return
        torch.autograd.backward(loss)
        grads = {}
        for name, leaf in full.items():
            if self.trainable(name):
                grads[name] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        allreduce_sum(list(grads.values()), self.topology.batch_sync)
        # each of this rank's microbatches of the group takes its rows of the summed feature gradient
        for (tower, mb), part in run.rows.items():
            if tower in grads and run.sync_group_of[tower, mb] == ins.sync_group and run.last[tower]:
                offset = run.batch.assignment.offsets(tower, ins.sync_group)[run.batch.towers[tower].replica]
                span = run.batch.towers[tower].spans[ins.sync_group]
                a = offset + part.start - span.local_start
                run.feature_grads[tower, mb] = grads[tower][a : a + part.stop - part.start]
        run.traced(ins, start)


def check_features(tower: str, x: Any, rows: int, needs_grad: bool) -> None:
    """A tower's output must be one tensor with a row per sample (and, if it trains, a graph)."""
    if not isinstance(x, Tensor):
        raise TypeError(
            f"tower {tower!r} returned a {type(x).__name__}, not a tensor: a tower must return one tensor of"
            f" features with a row per sample (wrap the encoder so it returns e.g. the pooled output or the"
            f" image embedding)"
        )
    if x.dim() == 0 or x.shape[0] != rows:
        raise ValueError(
            f"tower {tower!r} returned features of shape {list(x.shape)} for {rows} samples: a tower must"
            f" return one row per sample ([{rows}, ...])"
        )
    if needs_grad and not x.requires_grad:
        raise RuntimeError(
            f"tower {tower!r} has trainable parameters but its features carry no gradient (its forward runs"
            f" under torch.no_grad(), or detaches its output): mark it Tower(..., frozen=True) to keep it"
            f" fixed, or let its forward record gradients"
        )


def check_loss(loss: Any, needs_grad: bool) -> None:
    """``interaction_loss`` must return a scalar tensor that depends on the features it was given."""
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = list(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(
            f"interaction_loss must return a scalar tensor (the loss over the batch), got {shape}: reduce it"
            f" (e.g. .mean()) inside interaction_loss"
        )
    if needs_grad and not loss.requires_grad:
        raise RuntimeError(
            "interaction_loss returned a loss that does not depend on the features' gradients (it was detached,"
            " or computed under torch.no_grad()): the towers cannot learn from it"
        )
