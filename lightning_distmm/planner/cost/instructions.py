"""Seconds of each instruction of a plan's lists (``core/schedule.py``), priced as
:func:`lightning_distmm.planner.cost.step.evaluate_plan` prices them, for drawing a plan's
predicted step (``Report.timeline``); the planner itself does not use them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from lightning_distmm.core import schedule as ir
from lightning_distmm.planner.cost.breakdown import TowerChoice
from lightning_distmm.planner.cost.comm import (
    batch_syncs,
    contrastive_features,
    pp_comm,
    shard_comm,
    sharded_stage,
    tp_comm,
)
from lightning_distmm.planner.cost.compute import stage_compute
from lightning_distmm.planner.cost.options import LAYER_SHARDS, CostOptions
from lightning_distmm.planner.cost.pipeline import recomputes
from lightning_distmm.planner.cost.step import sync_groups
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import TowerProfile


def instruction_seconds(
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster,
    opts: CostOptions,
    choices: Mapping[str, TowerChoice],
    global_batch: int,
    world: int,
    nodes: int,
) -> tuple[Callable[[int, ir.Instruction], float], Callable[[ir.Instruction], float]]:
    """Seconds of each instruction of a plan's lists, priced as :func:`evaluate_plan` prices them:
    a microbatch's forward or backward on a stage (compute and tensor-parallel all-reduces, a
    recomputing backward with its forward again), each batch-sync; and the transfer to a stage
    (the ``link`` of :func:`~lightning_distmm.planner.cost.simulate.simulate`). For drawing a plan's step, not for the planner."""
    n_contrastive, embed = contrastive_features(profiles)
    syncs = batch_syncs(cluster, opts, global_batch, embed, world, nodes, n_contrastive, sync_groups(choices))
    seconds_of_sync = syncs["per_group"]

    @functools.cache
    def micro(tower: str, rows: int) -> tuple[float, float, float]:
        c, p = choices[tower], profiles[tower]
        f, b = (float(x) for x in stage_compute(p, cluster, opts, float(rows), c.tp, c.pp))
        t = float(tp_comm(p, cluster, opts, float(rows), c.tp, c.pp))
        link = float(pp_comm(p, cluster, opts, float(rows), c.pp))
        fx, bx = f + t, b + t
        if c.shard in LAYER_SHARDS:
            ag, agrs = shard_comm(p, cluster, opts, c.dp, c.tp, c.pp, c.shard)
            overlap = opts.overlap_grad_sync
            fx = float(sharded_stage(fx, ag, p.layers // c.pp, overlap))
            bx = float(sharded_stage(bx, agrs, p.layers // c.pp, overlap))
        return fx, 0.0 if p.frozen else bx + (fx if recomputes(c.schedule) else 0.0), link

    def seconds(rank: int, ins: ir.Instruction) -> float:
        if isinstance(ins, ir.Forward):
            return micro(ins.tower, ins.rows)[0]
        if isinstance(ins, ir.Backward):
            return micro(ins.tower, ins.rows)[1]
        if isinstance(ins, ir.BatchSync):
            return seconds_of_sync[ins.sync_group]
        return 0.0

    def transfer(ins: ir.Instruction) -> float:
        return micro(ins.tower, ins.rows)[2] if isinstance(ins, (ir.Forward, ir.Backward)) else 0.0

    return seconds, transfer


__all__ = ["instruction_seconds"]
