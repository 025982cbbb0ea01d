"""Link time: collectives (the all-reduce, all-gather and their ring latency), tensor-parallel and
pipeline transfers, the data-parallel gradient sum and the batch-sync.

Collectives follow NCCL's tuning model (``src/graph/tuning.cc``): a ring of ``r`` ranks over ``m``
nodes costs ``base + (steps - inter_steps) * intra_latency + inter_steps * inter_latency`` plus its
bytes over the links it crosses, computed hierarchically: the intra-node part over NVLink at the
most members one node holds, the inter-node part over the node's NIC, which everything of the node
that crosses nodes at the same time shares (``nic_load``). :func:`allreduce_time` is that formula,
the only one: the partitioner's estimate, the plan's exact pricing and the tensor-parallel
all-reduces all call it or its two terms (:func:`ring_latency`, :func:`ring_bytes`). Functions
accept numpy arrays (the partitioner's grids) as well as numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_distmm.core.plan import split_batch
from lightning_distmm.planner.cluster import Cluster
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.pipeline import recomputes
from lightning_distmm.planner.profile import TowerProfile


# ---------------------------------------------------------------------- collectives
def ring_latency(cluster: Cluster, ranks: Any, nodes: Any, steps_per_rank: int = 2) -> Any:
    """NCCL's ring latency over ``ranks`` members on ``nodes`` nodes: ``steps_per_rank`` is 2 for an
    all-reduce, 1 for an all-gather or reduce-scatter. 0 for a single rank."""
    if np.ndim(ranks) == 0 and ranks <= 1:
        return 0.0
    steps = steps_per_rank * (ranks - 1)
    inter_steps = steps_per_rank * (nodes - 1)
    return (
        cluster.collective_latency + (steps - inter_steps) * cluster.intra.latency + inter_steps * cluster.inter.latency
    )


def ring_bytes(nbytes: Any, ranks: Any) -> Any:
    """Bytes each member of a ring all-reduce of ``nbytes`` over ``ranks`` members sends: ``2 (r-1)/r``."""
    return 2 * (ranks - 1) / ranks * nbytes


def allreduce_time(
    cluster: Cluster, nbytes: Any, ranks: Any, nodes: Any = 1, per_node: Any = None, nic_load: Any = None
) -> Any:
    """Hierarchical ring all-reduce of ``nbytes`` over ``ranks`` members spread on ``nodes`` nodes.

    ``per_node`` is the most members one node holds (default ``ceil(ranks / nodes)``), their share
    goes over the intra-node link. ``nic_load`` is the bytes the busiest node pushes through its NIC
    while this runs (default: this collective alone, :func:`ring_bytes` over the nodes); several
    groups crossing the same nodes at once pass their summed load. Numbers or numpy arrays.
    """
    scalar = all(np.ndim(x) == 0 for x in (nbytes, ranks, nodes, per_node, nic_load))
    ranks, nodes = np.asarray(ranks, dtype=float), np.asarray(nodes, dtype=float)
    k = np.maximum(1, np.ceil(ranks / np.maximum(nodes, 1))) if per_node is None else np.asarray(per_node, dtype=float)
    load = ring_bytes(nbytes, np.maximum(nodes, 1)) if nic_load is None else np.asarray(nic_load, dtype=float)
    t = ring_latency(cluster, ranks, nodes, 2)
    t = t + np.where(k > 1, ring_bytes(nbytes, k) / cluster.intra.effective, 0.0)
    t = t + np.where(nodes > 1, load / cluster.inter.effective, 0.0)
    out = np.where(ranks > 1, t, 0.0)
    return float(out) if scalar else out


def allgather_time(
    cluster: Cluster, total_bytes: float, ranks: int, nodes: int = 1, per_node: int | None = None
) -> float:
    """Ring all-gather producing ``total_bytes`` on every rank (a reduce-scatter costs the same)."""
    if ranks <= 1:
        return 0.0
    k = per_node if per_node is not None else max(1, math.ceil(ranks / max(nodes, 1)))
    t = ring_latency(cluster, ranks, nodes, 1)
    if k > 1:
        t += (k - 1) / k * total_bytes / cluster.intra.effective
    if nodes > 1:
        t += (nodes - 1) / nodes * total_bytes / cluster.inter.effective
    return t


def nic_share(cluster: Cluster) -> float:
    """Bytes per second one device gets from its node's NIC when every device of the node sends."""
    return cluster.inter.effective / cluster.devices_per_node


# ---------------------------------------------------------------------- inside a tower
def tp_comm(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int, cross_node: bool = False
) -> np.ndarray:
    """Seconds of tensor-parallel all-reduces of one stage for one microbatch, forward (backward equal).

    A group inside a node is :func:`allreduce_time` on one node; one straddling two nodes (naive
    placement) runs its ring at each device's share of the NIC."""
    mb = np.asarray(mb, dtype=float)
    if tp <= 1 or not profile.analytic:
        return np.zeros_like(mb)
    count = 2 * len(profile.layer.attn)  # after attention and after the MLP of every residual block
    per = opts.bytes_el * mb * profile.layer.tp_allreduce / max(count, 1)
    if cross_node:
        one = ring_latency(cluster, tp, 2, 2) + ring_bytes(per, tp) / nic_share(cluster)
    else:
        one = allreduce_time(cluster, per, tp, 1, tp)
    return one * count * (profile.layers // pp)


def pp_comm(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, pp: int, cross_node: bool = False
) -> np.ndarray:
    """Seconds to send one microbatch's activations to the next stage (the gradient back costs the same)."""
    mb = np.asarray(mb, dtype=float)
    if pp <= 1:
        return np.zeros_like(mb)
    nbytes = opts.bytes_el * mb * profile.layer.boundary
    if cross_node:
        return cluster.inter.latency + nbytes / nic_share(cluster)
    return cluster.intra.latency + nbytes / cluster.intra.effective


def cross_attention_time(cluster: Cluster, nbytes: Any, same_node: bool) -> Any:
    """Seconds to bring another tower's ``nbytes`` of context (a decoder's cross-attention input) to
    a tower on other devices: over the intra-node link when both lie on the one same node, else at
    each device's share of the NIC."""
    return nbytes / cluster.intra.effective if same_node else nbytes / nic_share(cluster)


# ---------------------------------------------------------------------- data-parallel gradients
def compact_dp_allreduce(cluster: Cluster, grad_bytes: float, dp: Any, tp: int, pp: int) -> np.ndarray:
    """Gradient all-reduce seconds when the tower's ``dp * tp * pp`` devices are packed from a node start.

    Each (stage, tp-rank) shard has its own data-parallel group of ``dp`` members; the groups run
    together and share the NICs of the nodes they span (the partitioner's estimate before placement;
    placement prices the real layout).
    """
    dp = np.asarray(dp, dtype=float)
    w = tp * pp
    dpn = cluster.devices_per_node
    if w <= dpn:
        nodes = np.ceil(dp * w / dpn)  # the groups span every node of the tower
        per_node = np.minimum(dp, dpn // w)
        node_bytes = grad_bytes * w  # each of the w shard groups crosses every node's NIC
    else:
        nodes = dp  # one member per replica, each replica on its own nodes
        per_node = np.ones_like(dp)
        node_bytes = grad_bytes * dpn
    return allreduce_time(cluster, grad_bytes, dp, nodes, per_node, ring_bytes(node_bytes, np.maximum(nodes, 1)))


def last_slot(schedule: str, f: Any, b: Any) -> Any:
    """Backward work of the last microbatch on a stage, which can hide the data-parallel all-reduce.

    Gradients accumulate over the microbatches, and the runtime posts its DDP-style buckets during
    each tower's last backward when the step is a whole optimizer step, so only this slot overlaps
    the gradient sum (:func:`exposed_allreduce`)."""
    return (np.asarray(f) + np.asarray(b)) if recomputes(schedule) else np.asarray(b)


def exposed_allreduce(ar: Any, backward: Any, grad_bytes: float, opts: CostOptions) -> Any:
    """The part of the gradient all-reduce not hidden behind ``backward`` seconds of overlappable work
    (all of it without ``overlap_grad_sync``; at least the last bucket with it)."""
    if not opts.overlap_grad_sync:
        return ar
    last = min(1.0, opts.bucket_bytes / grad_bytes) if grad_bytes > 0 else 1.0
    return np.maximum(np.asarray(ar) - np.asarray(backward), np.asarray(ar) * last)


# ---------------------------------------------------------------------- batch sync
def contrastive_features(profiles: Mapping[str, TowerProfile]) -> tuple[int, int]:
    """How many towers feed the contrastive loss (a text decoder does not) and their feature width."""
    contrastive = [n for n, p in profiles.items() if p.arch != "text_decoder"]
    return len(contrastive), max((profiles[n].embed_dim for n in contrastive), default=0)


def sync_time(
    cluster: Cluster,
    opts: CostOptions,
    global_batch: int,
    embed_dim: int,
    world: int,
    nodes: int,
    n_contrastive: int,
) -> dict[str, float]:
    """One batch-sync over ``global_batch`` rows (a sync group): feature all-gather + this rank's
    loss rows forward and backward + feature-gradient reduce-scatter (as large as the gather)."""
    if n_contrastive < 2:
        return {"gather": 0.0, "loss": 0.0, "total": 0.0}
    total = n_contrastive * global_batch * embed_dim * opts.feature_bytes
    per_node = max(1, math.ceil(world / max(nodes, 1)))
    gather = allgather_time(cluster, total, world, nodes, per_node)
    rows = math.ceil(global_batch / max(world, 1))
    pairs = n_contrastive * (n_contrastive - 1) // 2
    flops = 12.0 * rows * global_batch * embed_dim * 2 * pairs
    loss = float(
        cluster.device.gemm_time(flops, 4.0 * (rows + global_batch) * embed_dim * 2 + 4.0 * rows * global_batch * 3)
    )
    return {"gather": gather, "loss": loss, "total": 2 * gather + loss}


def batch_syncs(
    cluster: Cluster,
    opts: CostOptions,
    global_batch: int,
    embed_dim: int,
    world: int,
    nodes: int,
    n_contrastive: int,
    groups: int = 1,
) -> dict[str, Any]:
    """Every batch-sync of a step: one over the global batch, or under ``distmm`` one per sync
    group (half of the batch each). ``per_group``: seconds of each; the other keys sum them."""
    each = [
        sync_time(cluster, opts, rows, embed_dim, world, nodes, n_contrastive)
        for rows in split_batch(global_batch, None, groups)
    ]
    out: dict[str, Any] = {k: sum(e[k] for e in each) for k in ("gather", "loss", "total")}
    out["per_group"] = [e["total"] for e in each]
    return out


__all__ = [
    "ring_latency",
    "ring_bytes",
    "allreduce_time",
    "allgather_time",
    "nic_share",
    "tp_comm",
    "pp_comm",
    "cross_attention_time",
    "compact_dp_allreduce",
    "last_slot",
    "exposed_allreduce",
    "contrastive_features",
    "sync_time",
    "batch_syncs",
]
