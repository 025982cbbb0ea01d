"""Link time: collectives (the all-reduce, all-gather and their ring latency), tensor-parallel and
pipeline transfers, the data-parallel gradient sum and the batch-sync.

Collectives follow NCCL's tuning model (``src/graph/tuning.cc``): on GPU clusters
(``Cluster.nccl``) with the protocol NCCL picks by message size (:mod:`.nccl`, NCCL v2.30.7
constants), else (a measured CPU cluster, gloo) one latency per step: a ring of ``r`` ranks over ``m``
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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_distmm.core.plan import split_batch
from lightning_distmm.planner.cost import nccl
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.pipeline import recomputes
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.profiles.profile import TowerProfile


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
    intra = np.where(k > 1, ring_bytes(nbytes, k), 0.0)
    out = _ring_time(cluster, 2, ranks, nodes, intra, load)
    return float(out) if scalar else out


def allgather_time(
    cluster: Cluster,
    total_bytes: Any,
    ranks: Any,
    nodes: Any = 1,
    per_node: Any = None,
    nic_load: Any = None,
) -> Any:
    """Ring all-gather producing ``total_bytes`` on every rank (a reduce-scatter costs the same).
    ``nic_load``: the bytes the busiest node's NIC carries meanwhile (default this gather's own
    ``(m-1)/m`` share). Numbers or numpy arrays."""
    scalar = all(np.ndim(x) == 0 for x in (total_bytes, ranks, nodes, per_node, nic_load))
    ranks, nodes = np.asarray(ranks, dtype=float), np.asarray(nodes, dtype=float)
    k = np.maximum(1, np.ceil(ranks / np.maximum(nodes, 1))) if per_node is None else np.asarray(per_node, dtype=float)
    m = np.maximum(nodes, 1)
    load = (m - 1) / m * np.asarray(total_bytes, dtype=float) if nic_load is None else np.asarray(nic_load, dtype=float)
    intra = (k - 1) / k * np.asarray(total_bytes, dtype=float)
    out = _ring_time(cluster, 1, ranks, nodes, intra, load)
    return float(out) if scalar else out


def reduce_scatter_time(
    cluster: Cluster, total_bytes: Any, ranks: Any, nodes: Any = 1, per_node: Any = None, nic_load: Any = None
) -> Any:
    """A reduce-scatter of ``total_bytes`` (each rank keeps ``1/ranks``): NCCL's ring costs a gather;
    gloo has no ring reduce-scatter, torch reduces the whole tensor and keeps a shard, twice a
    gather's bytes (measured on the emulated cluster: 93 ms against 50 for a 1.8 MB block,
    benchmarks/results/collectives_emulated.txt)."""
    return allgather_time(cluster, total_bytes, ranks, nodes, per_node, nic_load) * (1 if cluster.nccl else 2)


def _ring_time(cluster: Cluster, steps_per_rank: int, ranks: Any, nodes: Any, intra: Any, load: Any) -> Any:
    """A ring collective of ``steps_per_rank`` passes (2: all-reduce, 1: all-gather): ``intra`` bytes
    each member sends inside its node, ``load`` the busiest NIC's bytes; 0 on one rank."""
    if cluster.nccl:
        eff_in, eff_out = cluster.intra.effective, cluster.inter.effective
        t = nccl.ring_time(cluster.nccl, eff_in, eff_out, steps_per_rank, ranks, nodes, intra, load)
    else:
        t = ring_latency(cluster, ranks, nodes, steps_per_rank) + intra / cluster.intra.effective
        t = t + np.where(nodes > 1, load * flat_ring_factor(ranks, nodes) / cluster.inter.effective, 0.0)
    return np.where(ranks > 1, t, 0.0)


def flat_ring_factor(ranks: Any, nodes: Any) -> Any:
    """How many times the hierarchical NIC load a flat ring puts on each node's link: gloo runs one
    ring over all ``ranks`` members, whose edge leaving each node carries ``(r-1)/r`` of the bytes per
    pass where a hierarchical ring's carries ``(m-1)/m`` (1.5x for 4 ranks on 2 nodes; measured on the
    emulated two-node cluster: 360 ms for the 4-rank all-reduce of 7.3 MB the hierarchical price puts
    at 242, the flat one at 357, benchmarks/results/collectives_emulated.txt). 1 for one member per node."""
    ranks, nodes = np.asarray(ranks, dtype=float), np.maximum(np.asarray(nodes, dtype=float), 1)
    flat, hier = (ranks - 1) / np.maximum(ranks, 1), (nodes - 1) / nodes
    return np.where(hier > 0, flat / np.where(hier > 0, hier, 1.0), 1.0)


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


def cp_comm(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, cp: int, pp: int
) -> np.ndarray:
    """Seconds of context parallelism's all-to-alls (DeepSpeed-Ulysses) of one stage for one microbatch,
    forward (backward equal): per attention, q/k/v to head-sharded (``3 s h / (cp tp)`` elements per
    rank, ``(cp - 1) / cp`` of them leave it) and the output back (a third of that), plus the final
    all-gather of the tokens. The cp group stays inside a node (``cp * tp`` ranks)."""
    mb = np.asarray(mb, dtype=float)
    if cp <= 1 or not profile.analytic:
        return np.zeros_like(mb)
    local = opts.bytes_el * mb * profile.seq * profile.width / (cp * tp)  # one [B, S/cp, h/tp] tensor
    out = (cp - 1) / cp * local
    per_attention = 2 * cluster.intra.latency + 4 * out / cluster.intra.effective
    attentions = len(profile.layer.attn) * (profile.layers // pp)
    gather = cluster.intra.latency + (cp - 1) * local * tp / cluster.intra.effective
    return per_attention * attentions + gather


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
def _compact_dp_groups(cluster: Cluster, dp: Any, tp: int, pp: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A tower's data-parallel groups when its ``dp * tp * pp`` devices are packed from a node start:
    the nodes one group spans, its most members on one node, and how many groups (one per stage and
    tp rank) cross each node's NIC at once."""
    dp = np.asarray(dp, dtype=float)
    w = tp * pp
    dpn = cluster.devices_per_node
    if w <= dpn:
        return np.ceil(dp * w / dpn), np.minimum(dp, dpn // w), w  # the groups span every node of the tower
    return dp, np.ones_like(dp), dpn  # one member per replica, each replica on its own nodes


def compact_dp_allreduce(cluster: Cluster, grad_bytes: float, dp: Any, tp: int, pp: int) -> np.ndarray:
    """Gradient all-reduce seconds when the tower's ``dp * tp * pp`` devices are packed from a node start.

    Each (stage, tp-rank) shard has its own data-parallel group of ``dp`` members; the groups run
    together and share the NICs of the nodes they span (the partitioner's estimate before placement;
    placement prices the real layout).
    """
    nodes, per_node, groups = _compact_dp_groups(cluster, dp, tp, pp)
    load = ring_bytes(grad_bytes * groups, np.maximum(nodes, 1))
    return allreduce_time(cluster, grad_bytes, np.asarray(dp, dtype=float), nodes, per_node, load)


def shard_comm(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, dp: Any, tp: int, pp: int, shard: str = "full"
) -> tuple[Any, Any]:
    """A fully sharded (ZeRO-3 / FSDP2) stage's collectives per microbatch: the all-gather of its
    weights (forward, and again for the backward, as ``reshard_after_forward`` does) and the
    reduce-scatter of its gradients (in the gradient dtype), over the tower's compactly packed
    data-parallel groups. FSDP issues one all-gather and one reduce-scatter per layer, so each
    layer's collective pays its own latency (NCCL's per-call base and per-step hops): the stage's
    bytes are priced as ``layers`` collectives of one layer's bytes. ``zero2`` gathers the weights
    once, in the forward, and keeps them for the backward. Returns (forward, backward) seconds for
    the whole stage."""
    from lightning_distmm.planner.cost.memory import stage_params

    params = stage_params(profile, tp, pp)
    pol = opts.policy
    calls = max(profile.layers // pp, 1) if profile.analytic else 1
    if shard == "hybrid":
        return _hybrid_comm(profile, cluster, opts, dp, tp, pp, params, calls)
    nodes, per_node, groups = _compact_dp_groups(cluster, dp, tp, pp)
    m = np.maximum(nodes, 1)

    def per_layer(collective: Any, nbytes: float) -> Any:
        per = nbytes / calls
        return calls * collective(
            cluster, per, np.asarray(dp, dtype=float), nodes, per_node, groups * (m - 1) / m * per
        )

    ag = per_layer(allgather_time, params * pol.weights)
    rs = 0.0 if profile.frozen else per_layer(reduce_scatter_time, params * pol.grads)
    return ag, (rs + 0 * ag if shard == "zero2" else ag + rs)


def _hybrid_comm(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, dp: Any, tp: int, pp: int, params: float, calls: int
) -> tuple[Any, Any]:
    """HSDP's collectives per microbatch, per layer: the all-gather and reduce-scatter over the
    node's replicas (NVLink), and each gradient shard's all-reduce across the nodes, one member per
    node; the node's ``g`` shard groups all cross its NIC at once, so it carries the whole layer's
    gradient ring traffic."""
    dp = np.asarray(dp, dtype=float)
    g = np.minimum(dp, max(cluster.devices_per_node // (tp * pp), 1))
    r = np.maximum(np.ceil(dp / g), 1)  # nodes (replica groups) the tower spans
    pol = opts.policy

    def gather(nbytes: float) -> Any:
        return calls * allgather_time(cluster, nbytes / calls, g, 1, g)

    ag = gather(params * pol.weights)
    if profile.frozen:
        return ag, ag
    rs = gather(params * pol.grads)
    layer_grads = params * pol.grads / calls
    shard_bytes = layer_grads / g
    across = calls * allreduce_time(cluster, shard_bytes, r, r, 1, ring_bytes(layer_grads * tp * pp, r))
    return ag, ag + rs + np.where(r > 1, across, 0.0)


def sharded_stage(compute: Any, comm: Any, layers: int, overlap: bool = True) -> Any:
    """Seconds of a fully sharded stage's forward or backward: each layer's collective overlaps the
    previous layer's compute (FSDP2 prefetches one layer ahead), so the stage takes the longer of
    its compute and its collectives, plus the first layer's collective, which nothing hides.
    Without ``overlap`` (``CostOptions.overlap_grad_sync`` off: CPU ranks, whose gloo collectives
    run on the cores the compute needs) the collectives add to the compute: measured on the emulated
    two-node cluster, FSDP took 576 ms a step against 373 for DDP, where the overlapping rule
    predicted 362 (benchmarks/results/emulated_side_by_side_fast.md)."""
    comm = np.asarray(comm, dtype=float)
    if not overlap:
        return np.asarray(compute, dtype=float) + comm
    return np.maximum(compute, comm) + comm / max(layers, 1)


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


def link_waits(segments: Sequence[float], forward: float, backward: float) -> tuple[float, ...]:
    """The link seconds inside each segment: the forwards' in the first, the backwards' in the last
    (a sharded tower's gathers run where its layers do), never more than the segment."""
    if not forward and not backward:
        return ()
    waits = [0.0] * len(segments)
    waits[0] = min(segments[0], forward)
    waits[-1] = min(segments[-1] - (waits[0] if len(segments) == 1 else 0.0), backward + waits[-1])
    return tuple(waits)


__all__ = [
    "reduce_scatter_time",
    "link_waits",
    "ring_latency",
    "ring_bytes",
    "allreduce_time",
    "allgather_time",
    "nic_share",
    "tp_comm",
    "cp_comm",
    "pp_comm",
    "cross_attention_time",
    "compact_dp_allreduce",
    "shard_comm",
    "sharded_stage",
    "last_slot",
    "exposed_allreduce",
    "contrastive_features",
    "sync_time",
    "batch_syncs",
]
