"""The data-parallel gradient sums of a step: each tower's traffic (bytes per NIC), its all-reduce
time and the part of it the backward does not hide (overlapped as DDP's buckets are)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_distmm.planner.cost.breakdown import TowerChoice, TowerCost
from lightning_distmm.planner.cost.comm import allreduce_time, exposed_allreduce, flat_ring_factor, ring_bytes
from lightning_distmm.planner.cost.memory import grad_bytes_per_device
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import TowerProfile


@dataclass
class GradientTraffic:
    """One tower's data-parallel gradient sum: ``local`` is the slowest group's latency and
    intra-node share (its NIC share is priced once for everything crossing the node), ``own_load``
    the bytes its groups push through each node's NIC, ``nodes`` the nodes they cross."""

    grad_bytes: float
    local: float = 0.0
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    nodes: set[int] = field(default_factory=set)
    own_load: dict[int, float] = field(default_factory=dict)


def gradient_traffic(
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster,
    opts: CostOptions,
    choices: Mapping[str, TowerChoice],
    groups: Mapping[str, Mapping[str, list[list[int]]]],
) -> tuple[dict[str, GradientTraffic], dict[int, float]]:
    """Every tower's :class:`GradientTraffic` and the bytes each node's NIC carries for all of them."""
    node = lambda r: r // cluster.devices_per_node  # noqa: E731
    node_load: dict[int, float] = {}
    out: dict[str, GradientTraffic] = {}
    for name, c in choices.items():
        gb = grad_bytes_per_device(profiles[name], opts, c.tp, c.pp, c.shard)
        traffic = out[name] = GradientTraffic(gb)
        for g in groups[name]["dp"]:
            counts: dict[int, int] = {}
            for r in g:
                counts[node(r)] = counts.get(node(r), 0) + 1
            m, k = len(counts), max(counts.values())
            if len(g) > 1 and gb > 0:
                local = allreduce_time(cluster, gb, len(g), m, k, nic_load=0.0)
                traffic.local = max(traffic.local, local)
                traffic.intra_bytes += sum(ring_bytes(gb, cnt) * cnt for cnt in counts.values() if cnt > 1)
                if m > 1:  # NCCL's hierarchical ring; gloo runs one flat ring (comm.flat_ring_factor)
                    crossing = ring_bytes(gb, m) * (1.0 if cluster.nccl else float(flat_ring_factor(len(g), m)))
                    traffic.inter_bytes += crossing * m
                    for nd in counts:
                        node_load[nd] = node_load.get(nd, 0.0) + crossing
                        traffic.own_load[nd] = traffic.own_load.get(nd, 0.0) + crossing
                        traffic.nodes.add(nd)
    return out, node_load


def price_gradient_sums(
    costs: Mapping[str, TowerCost],
    traffic: Mapping[str, GradientTraffic],
    node_load: Mapping[int, float],
    details: Mapping[str, Mapping[str, Any]],
    cluster: Cluster,
    opts: CostOptions,
    colocated: bool,
) -> list[str]:
    """Set each tower's gradient all-reduce and the part of it the backward does not hide; returns
    the order the towers run their last backward in.

    Separate towers reduce at the same time and share the NICs of the nodes they cross, each hiding
    its sum behind its own last backward slot. Colocated towers run one after the other, so a
    tower's all-reduce also overlaps the backward of the towers after it (one communication stream;
    the best order is taken)."""
    inter = cluster.inter.effective
    if not colocated:
        for n, tc in costs.items():
            t = traffic[n]
            a = t.local + max((node_load.get(nd, 0.0) for nd in t.nodes), default=0.0) / inter
            tc.dp_allreduce = a
            tc.dp_exposed = float(exposed_allreduce(a, details[n]["slot"], t.grad_bytes, opts)) if a > 0 else 0.0
        return list(costs)
    link = {n: max(traffic[n].own_load.values(), default=0.0) / inter for n in costs}  # the wait on the NICs
    ar = {n: traffic[n].local + link[n] for n in costs}

    def last_bucket(n: str) -> float:  # what nothing can hide: the last tower's last bucket
        gb = traffic[n].grad_bytes
        return ar[n] * min(1.0, opts.bucket_bytes / gb) if gb else 0.0

    # without overlap_grad_sync (CPU ranks: the sums' work runs on the cores the backward needs) a
    # tower's sum starts when its backward ends and only its wait on the link (no core) hides behind
    # the backwards of the towers after it: measured on the emulated two-node cluster, DDP's image
    # sum (364 ms alone) and text sum (73) left 340 ms exposed behind a 100 ms text backward
    local = sum(traffic[n].local for n in costs)
    best_exposed, best_order = math.inf, list(costs)
    for order in itertools.permutations(costs):
        clock, stream = 0.0, 0.0
        for n in order:
            clock += costs[n].segments[-1]
            if opts.overlap_grad_sync:
                stream = max(stream, clock - details[n]["slot"]) + ar[n]
            else:
                stream = max(stream, clock) + link[n]
        if opts.overlap_grad_sync:
            exposed = max(stream - clock, last_bucket(order[-1]))
        else:
            exposed = local + max(stream - clock, 0.0)
        if exposed < best_exposed:
            best_exposed, best_order = exposed, list(order)
    share = sum(ar.values()) or 1.0
    for n, tc in costs.items():
        tc.dp_allreduce, tc.dp_exposed = ar[n], best_exposed * ar[n] / share
    return best_order


__all__ = ["GradientTraffic", "gradient_traffic", "price_gradient_sums"]
