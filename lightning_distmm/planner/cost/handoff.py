"""Seconds of a consuming tower's handoff (docs/vlm.md): a route's rows of image tokens, and their
gradient back, over the link between its two ranks; and a step's makespan from the same lists the
runtime executes (:func:`lightning_distmm.core.handoff_schedule.simulate_handoff`).

A route's bytes are ``rows x tokens per row x width x bytes per element``; it crosses the intra-node
fabric when both ranks lie on one node (consecutive ranks fill nodes of ``devices_per_node``), else
each device's share of its node's NIC (:func:`~lightning_distmm.planner.cost.comm.nic_share`), plus
the link's latency; a rank handing rows to itself costs nothing. The forward and backward seconds
of each tower's microbatch come from the caller (a profile of the encoder with its images per
sample, of the LLM with its sequence including image tokens: the planner's next step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lightning_distmm.core import schedule as ir
from lightning_distmm.core.handoff_schedule import (
    RecvTokenGrads,
    RecvTokens,
    Route,
    SendTokenGrads,
    SendTokens,
    TokenLoss,
    handoff_schedules,
)
from lightning_distmm.core.plan import Plan
from lightning_distmm.planner.cost.comm import nic_share
from lightning_distmm.planner.cost.simulate import simulate_handoff
from lightning_distmm.planner.machine.cluster import Cluster


def route_seconds(route: Route, cluster: Cluster, tokens_per_row: int, width: int, bytes_el: int) -> float:
    """Seconds to move ``route``'s rows of tokens (or their gradient: the same bytes) between its ranks."""
    if route.src == route.dst:
        return 0.0
    nbytes = float(route.stop - route.start) * tokens_per_row * width * bytes_el
    if route.src // cluster.devices_per_node == route.dst // cluster.devices_per_node:
        return cluster.intra.latency + nbytes / cluster.intra.effective
    return cluster.inter.latency + nbytes / nic_share(cluster)


def handoff_step_seconds(
    plan: Plan,
    consumes: Mapping[str, Sequence[str]],
    order: Sequence[str],
    trains: Mapping[str, bool],
    n: int,
    compute: Callable[[str, int, bool], float],
    cluster: Cluster,
    tokens_per_row: int,
    width: int,
    bytes_el: int = 2,
    loss_seconds: float = 0.0,
) -> float:
    """A step's makespan: ``compute(tower, rows, backward)`` seconds per microbatch, the routes priced
    by :func:`route_seconds` (a transfer is the receive's link time), sends and the loss as given."""
    lists = handoff_schedules(plan, consumes, order, trains, n)

    def seconds(rank: int, ins: object) -> float:
        if isinstance(ins, (ir.Forward, ir.Backward)):
            return compute(ins.tower, ins.rows, isinstance(ins, ir.Backward))
        if isinstance(ins, TokenLoss):
            return loss_seconds
        return 0.0  # posting a send, receiving what has arrived, the sums (priced by the planner's gradient model)

    def link(ins: object) -> float:
        if isinstance(ins, (RecvTokens, RecvTokenGrads, SendTokens, SendTokenGrads)):
            return route_seconds(ins.route, cluster, tokens_per_row, width, bytes_el)
        return 0.0

    last_stages = {
        name: [rank for r in range(t.dp) for rank in t.replica_ranks(r)[(t.pp - 1) * t.tp :]]
        for name, t in plan.towers.items()
        if name in consumes
    }
    intervals = simulate_handoff(lists, seconds, link, last_stages)
    return max(i.end for i in intervals) - min(i.start for i in intervals)


__all__ = ["route_seconds", "handoff_step_seconds"]
