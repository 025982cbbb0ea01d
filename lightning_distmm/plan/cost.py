"""Cost model: time, memory and link bytes of one training step of a plan, and a pipeline simulator.

Why one model for everything: the DistMM plan, the colocated DDP baseline and the Megatron-style
baseline are all priced by the functions below, so a comparison between them measures the plans,
not two different models. The functions accept numpy arrays (the partitioner evaluates thousands
of (replicas, microbatches) combinations at once) and plain numbers (the final evaluation).

A step of towers on *separate* devices (DESIGN.md section 4, contrastive loss):

    step = max_t Fphase_t + sync + max_t (Bphase_t + exposed gradient all-reduce_t + optimizer_t)

because the batch sync (features of the whole batch -> loss -> feature gradients) is a barrier
between every tower's forward and every tower's backward. Towers *colocated* on the same devices
run one after the other: ``sum_t Fphase_t + sync + sum_t Bphase_t + ...``.

Per tower replica with ``K`` microbatches of ``mb`` samples over ``P`` pipeline stages, stage
slot times ``f`` and ``b`` (compute + tensor-parallel all-reduces + stage-to-stage sends):

* ``gpipe``  Fphase = (K+P-1) f, Bphase = (K+P-1) b; keeps the activations of all K microbatches.
* ``distmm`` as gpipe, but the features of the first half of the microbatches are exchanged while
  the second half runs forward, hiding half of the tower's share of the feature all-gather.
* ``cached`` forward without keeping activations, sync, then 1F1B of (recompute, backward):
  Fphase = (K+P-1) f, Bphase = (K+P-1) (f + b); keeps at most min(K, P) microbatches.

:func:`simulate_pipeline` runs the same schedules instruction by instruction; tests check that
the closed forms equal the simulation.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from lightning_distmm.plan.cluster import Cluster
from lightning_distmm.plan.profile import Block, TowerProfile

SCHEDULE_NAMES = ("gpipe", "distmm", "cached")
# Baseline-only variant: gpipe with full activation checkpointing (Megatron-LM --recompute-granularity
# full, open_clip --grad-checkpointing): keeps each layer's input, recomputes the layer in backward.
RECOMPUTE = "gpipe+recompute"


@dataclass
class CostOptions:
    """Software-side assumptions of the cost model (not hardware constants).

    ``precision``: ``bf16-mixed`` (2-byte activations/weights/grads, fp32 master weights and Adam
    moments: 16 bytes of static memory per trainable parameter, as in ZeRO, Rajbhandari et al. 2020)
    or ``32`` (4 + 4 + 8 = 16 bytes as well). A frozen tower keeps only its weights.
    ``flash_attention``: attention probabilities are not stored (FlashAttention / SDPA kernels).
    ``overlap_grad_sync``: gradient all-reduce overlaps the backward, as DDP's buckets do
    (``bucket_bytes`` = DDP's default 25 MB); the last bucket is always exposed.
    ``memory_margin``: fraction of device memory a plan may fill (allocator fragmentation, CUDA
    context, workspace).
    ``step_overhead``: seconds per step the training framework spends outside what is priced here
    (the Lightning loop and hooks, logging, the runtime's bookkeeping and its small collectives);
    0 unless measured (docs/planner.md section 12: 5-7 ms for 2 CPU ranks on the development VM).
    """

    precision: str = "bf16-mixed"
    flash_attention: bool = True
    overlap_grad_sync: bool = True
    bucket_bytes: float = 25e6
    memory_margin: float = 0.9
    feature_bytes: int = 4
    step_overhead: float = 0.0

    @property
    def bytes_el(self) -> int:
        return 2 if str(self.precision).startswith(("bf16", "16")) else 4

    @property
    def static_bytes_trainable(self) -> float:
        return 16.0

    @property
    def static_bytes_frozen(self) -> float:
        return float(self.bytes_el)

    @property
    def optimizer_traffic(self) -> float:
        """HBM bytes one Adam step reads and writes per parameter (weights, grads, master, moments)."""
        return 2.0 * self.static_bytes_trainable

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "CostOptions":
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


# ---------------------------------------------------------------------- compute
def block_time(block: Block, cluster: Cluster, opts: CostOptions, mb: Any, tp: int) -> np.ndarray:
    """Forward seconds of ``block`` for ``mb`` samples on one device of a ``tp``-way split."""
    dev = cluster.device
    bel = opts.bytes_el
    mb = np.asarray(mb, dtype=float)
    t = np.zeros_like(mb)
    for g in block.gemms:
        k, n = (g.k, g.n / tp) if g.split == "col" else (g.k / tp, g.n) if g.split == "row" else (g.k, g.n)
        T = mb * g.tokens
        t = t + dev.gemm_time(2.0 * T * k * n, bel * (T * k + k * n + T * n), T, n)
    for a in block.attn:
        width = a.width / tp
        flops = 4.0 * mb * a.q * a.kv * width
        io = bel * mb * (2 * a.q + 2 * a.kv) * width
        if not opts.flash_attention:
            io = io + 2 * bel * mb * a.q * a.kv * a.heads / tp
        # one (query block x head dim) output tile per (sample, head): FlashAttention's work split
        t = t + dev.gemm_time(flops, io, a.q, a.width / a.heads, mb * max(a.heads // tp, 1))
    t = t + bel * mb * (block.elem_rep + block.elem_split / tp) / dev.memory_bandwidth
    return t + block.kernels * dev.kernel_overhead


def stage_compute(profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward compute seconds of the slowest pipeline stage for one microbatch."""
    mb = np.asarray(mb, dtype=float)
    fit = profile.measured
    if not profile.analytic:
        if fit is None or tp != 1 or pp != 1:
            raise ValueError(f"tower {profile.name!r} has only a measured profile: it can only run with tp = pp = 1")
        f, b = fit.fwd_time(mb), fit.bwd_time(mb)
    else:
        f = _analytic_stage(profile, cluster, opts, mb, tp, pp)
        b = 2.0 * f
        if fit is not None:
            ref = _analytic_stage(profile, cluster, opts, mb, 1, 1)
            scale = f / np.maximum(ref, 1e-30)
            f, b = fit.fwd_time(mb) * scale, fit.bwd_time(mb) * scale
    if profile.frozen:
        b = np.zeros_like(f)
    return np.asarray(f, dtype=float), np.asarray(b, dtype=float)


def _analytic_stage(profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int) -> np.ndarray:
    layer = block_time(profile.layer, cluster, opts, mb, tp) * (profile.layers // pp)
    pre, post = block_time(profile.pre, cluster, opts, mb, tp), block_time(profile.post, cluster, opts, mb, tp)
    return layer + (pre + post if pp == 1 else np.maximum(pre, post))


def tp_comm(profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int, cross_node: bool = False) -> np.ndarray:
    """Seconds of tensor-parallel all-reduces of one stage for one microbatch, forward (backward equal)."""
    mb = np.asarray(mb, dtype=float)
    if tp <= 1 or not profile.analytic:
        return np.zeros_like(mb)
    count = 2 * len(profile.layer.attn)  # after attention and after the MLP of every residual block
    per = opts.bytes_el * mb * profile.layer.tp_allreduce / max(count, 1)
    nodes = 2 if cross_node else 1
    lat = cluster.ring_latency(tp, nodes, 2)
    link = cluster.inter.effective / cluster.devices_per_node if cross_node else cluster.intra.effective
    one = lat + 2 * (tp - 1) / tp * per / link
    return one * count * (profile.layers // pp)


def pp_comm(profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, pp: int, cross_node: bool = False) -> np.ndarray:
    """Seconds to send one microbatch's activations to the next stage (the gradient back costs the same)."""
    mb = np.asarray(mb, dtype=float)
    if pp <= 1:
        return np.zeros_like(mb)
    nbytes = opts.bytes_el * mb * profile.layer.boundary
    if cross_node:
        return cluster.inter.latency + nbytes / (cluster.inter.effective / cluster.devices_per_node)
    return cluster.intra.latency + nbytes / cluster.intra.effective


def phases(schedule: str, frozen: bool, K: Any, P: int, f: Any, b: Any) -> tuple[Any, Any, Any]:
    """Closed-form forward phase, backward phase and bubble of one replica's pipeline."""
    K = np.asarray(K, dtype=float)
    slots = K + P - 1
    if frozen:
        return slots * f, np.zeros_like(slots * f), (P - 1) * f
    if schedule in ("cached", RECOMPUTE):
        return slots * f, slots * (f + b), (P - 1) * (2 * f + b)
    if schedule in ("gpipe", "distmm"):
        return slots * f, slots * b, (P - 1) * (f + b)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")


# ---------------------------------------------------------------------- memory
def stage_params(profile: TowerProfile, tp: int, pp: int) -> float:
    """Parameters held by one device of the heaviest stage (layer weights split tp ways)."""
    if not profile.analytic:
        return float(profile.params)
    layers = profile.layers // pp * profile.layer.params / tp
    ends = profile.pre.params + profile.post.params if pp == 1 else max(profile.pre.params, profile.post.params)
    return layers + ends


def act_per_sample(profile: TowerProfile, opts: CostOptions, tp: int, pp: int, mb: Any = 1.0) -> Any:
    """Activation bytes kept for backward per sample on the heaviest stage."""
    if not profile.analytic:
        fit = profile.measured
        assert fit is not None
        mb = np.asarray(mb, dtype=float)
        return (fit.act_bytes[0] + fit.act_bytes[1] * mb) / np.maximum(mb, 1.0)
    lay = profile.layer
    per_layer = lay.act_rep + lay.act_split / tp + (0.0 if opts.flash_attention else lay.act_scores / tp)
    ends = profile.pre.act_rep + profile.post.act_rep + (profile.pre.act_split + profile.post.act_split) / tp
    if pp > 1:
        ends = max(profile.pre.act_rep + profile.pre.act_split / tp, profile.post.act_rep + profile.post.act_split / tp)
    return opts.bytes_el * (profile.layers // pp * per_layer + ends)


def memory_per_device(
    profile: TowerProfile, opts: CostOptions, schedule: str, mb: Any, K: Any, replica_batch: Any, tp: int, pp: int, loss_bytes: Any = 0.0
) -> dict[str, Any]:
    """Peak bytes on the busiest device of a replica: static (weights, grads, optimizer), activations, loss."""
    mb = np.asarray(mb, dtype=float)
    K = np.asarray(K, dtype=float)
    per = stage_params(profile, tp, pp)
    if profile.frozen:
        static = per * opts.static_bytes_frozen
    else:
        trainable_frac = profile.trainable_params / max(profile.params, 1)
        static = per * (trainable_frac * opts.static_bytes_trainable + (1 - trainable_frac) * opts.static_bytes_frozen)
    aps = act_per_sample(profile, opts, tp, pp, mb)
    layer_act = aps / max(profile.layers // pp, 1)
    if profile.frozen:
        act = mb * layer_act * 2  # no-grad forward: a layer's input and output at a time
    elif schedule == "cached":
        act = np.minimum(K, pp) * mb * aps + mb * layer_act * 2
    elif schedule == RECOMPUTE:
        ckpt = opts.bytes_el * (profile.layers // pp * profile.layer.boundary) if profile.analytic else aps
        act = np.asarray(replica_batch, dtype=float) * ckpt + mb * layer_act * 2
    else:
        act = np.asarray(replica_batch, dtype=float) * aps
    return {"static": static + 0 * mb, "activations": act, "loss": np.asarray(loss_bytes, dtype=float) + 0 * mb, "total": static + act + loss_bytes}


def loss_bytes(global_batch: int, world: int, n_contrastive: int, opts: CostOptions, embed_dim: int) -> float:
    """Gathered features plus this rank's rows of the logits (forward, softmax, gradient)."""
    rows = math.ceil(global_batch / max(world, 1))
    feats = n_contrastive * global_batch * embed_dim * opts.feature_bytes * 2
    return feats + 3.0 * 4 * rows * global_batch * max(n_contrastive - 1, 1) * 2


# ---------------------------------------------------------------------- data-parallel gradients
def grad_bytes_per_device(profile: TowerProfile, opts: CostOptions, tp: int, pp: int) -> float:
    if profile.frozen:
        return 0.0
    frac = profile.trainable_params / max(profile.params, 1)
    return stage_params(profile, tp, pp) * frac * opts.bytes_el


def optimizer_time(profile: TowerProfile, cluster: Cluster, opts: CostOptions, tp: int, pp: int) -> float:
    """One Adam step on a device: measured when the profile has a timed step (its share of the
    tower's parameters for tp/pp splits), else the optimizer's memory traffic over HBM bandwidth."""
    if profile.frozen:
        return 0.0
    fit = profile.measured
    if fit is not None and fit.opt_time is not None:
        return fit.opt_time * stage_params(profile, tp, pp) / max(profile.params, 1)
    frac = profile.trainable_params / max(profile.params, 1)
    return stage_params(profile, tp, pp) * frac * opts.optimizer_traffic / cluster.device.memory_bandwidth


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
    steps = 2 * (dp - 1)
    inter_steps = 2 * (nodes - 1)
    lat = np.where(dp > 1, cluster.collective_latency + (steps - inter_steps) * cluster.intra.latency + inter_steps * cluster.inter.latency, 0.0)
    intra = np.where(per_node > 1, 2 * (per_node - 1) / per_node * grad_bytes / cluster.intra.effective, 0.0)
    inter = np.where(nodes > 1, 2 * (nodes - 1) / np.maximum(nodes, 1) * node_bytes / cluster.inter.effective, 0.0)
    return np.where(dp > 1, lat + intra + inter, 0.0)


def last_slot(schedule: str, f: Any, b: Any) -> Any:
    """Backward work of the last microbatch on a stage: gradients are accumulated over the
    microbatches, so only this last slot can hide the data-parallel all-reduce (DDP ``no_sync``,
    GradCache and pipelines all reduce once per step)."""
    return (np.asarray(f) + np.asarray(b)) if schedule in ("cached", RECOMPUTE) else np.asarray(b)


def exposed_allreduce(ar: Any, backward: Any, grad_bytes: float, opts: CostOptions) -> Any:
    """The part of the gradient all-reduce not hidden behind ``backward`` seconds of overlappable work."""
    if not opts.overlap_grad_sync:
        return ar
    last = min(1.0, opts.bucket_bytes / grad_bytes) if grad_bytes > 0 else 1.0
    return np.maximum(np.asarray(ar) - np.asarray(backward), np.asarray(ar) * last)


# ---------------------------------------------------------------------- batch sync
def sync_time(
    cluster: Cluster,
    opts: CostOptions,
    global_batch: int,
    embed_dim: int,
    world: int,
    nodes: int,
    n_contrastive: int,
    distmm_fraction: float = 0.0,
) -> dict[str, float]:
    """Feature all-gather + loss rows of this rank forward and backward + feature-gradient reduce-scatter.

    ``distmm_fraction``: share of the gathered features that come from ``distmm`` towers, half of
    which are exchanged while the tower's second wave still runs forward.
    """
    if n_contrastive < 2:
        return {"gather": 0.0, "loss": 0.0, "total": 0.0}
    total = n_contrastive * global_batch * embed_dim * opts.feature_bytes
    per_node = max(1, math.ceil(world / max(nodes, 1)))
    gather = cluster.allgather_time(total, world, nodes, per_node)
    rows = math.ceil(global_batch / max(world, 1))
    pairs = n_contrastive * (n_contrastive - 1) // 2
    flops = 12.0 * rows * global_batch * embed_dim * 2 * pairs
    loss = float(cluster.device.gemm_time(flops, 4.0 * (rows + global_batch) * embed_dim * 2 + 4.0 * rows * global_batch * 3))
    exposed_gather = gather * (1.0 - 0.5 * distmm_fraction)
    return {"gather": gather, "loss": loss, "total": exposed_gather + gather + loss}


# ---------------------------------------------------------------------- breakdowns
@dataclass
class TowerCost:
    """One tower's share of a step (seconds, bytes). ``memory`` is per device."""

    name: str
    forward_phase: float
    backward_phase: float
    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_allreduce: float
    dp_exposed: float
    optimizer: float
    cross_comm: float
    memory: dict[str, float]
    bytes_intra: float
    bytes_inter: float
    contention: float = 0.0  # seconds the tower's compute is stretched by other devices of its node (Device.concurrency)

    @property
    def comm(self) -> float:
        return self.tp_comm + self.pp_comm + self.dp_exposed + self.cross_comm

    @property
    def busy(self) -> float:
        return self.forward_phase + self.backward_phase + self.dp_exposed + self.optimizer


@dataclass
class StepCost:
    """A whole step: per-tower costs, the batch sync and the step time."""

    towers: dict[str, TowerCost]
    sync: dict[str, float]
    step_time: float
    layout: str
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- pipeline simulator
@dataclass
class Op:
    stage: int
    kind: str  # F (forward, keeps activations), N (forward without keeping), R (recompute), B (backward)
    mb: int
    start: float = 0.0
    end: float = 0.0


def schedule_ops(schedule: str, K: int, P: int) -> list[list[tuple[str, int]]]:
    """Per-stage instruction order of one replica (the batch sync sits between forward and backward)."""
    orders: list[list[tuple[str, int]]] = []
    for s in range(P):
        if schedule in ("gpipe", "distmm"):
            orders.append([("F", j) for j in range(K)] + [("B", j) for j in range(K)])
        elif schedule == "cached":
            warm = min(P - s - 1, K)
            order = [("N", j) for j in range(K)] + [("R", j) for j in range(warm)]
            r, bnext = warm, 0
            while bnext < K:
                if r < K:
                    order.append(("R", r))
                    r += 1
                order.append(("B", bnext))
                bnext += 1
            orders.append(order)
        else:
            raise ValueError(f"unknown schedule {schedule!r}")
    return orders


def simulate_pipeline(schedule: str, K: int, P: int, f: float, b: float, sync: float = 0.0, others_forward_end: float = 0.0) -> dict[str, Any]:
    """Event simulation of one replica: every stage runs its instructions in order, each as soon as
    its input is ready. Backward of the last stage waits for the batch sync, which starts when this
    replica's forwards (and ``others_forward_end``, the other towers') are done and lasts ``sync``.
    Returns the forward-phase end, the step end and the ops with their times."""
    orders = schedule_ops(schedule, K, P)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * P
    pos = [0] * P
    ops: list[Op] = []
    fwd_kinds = ("F", "N")
    sync_ready: float | None = None
    total = sum(len(o) for o in orders)
    while len(ops) < total:
        progressed = False
        if sync_ready is None and all(("F" if schedule != "cached" else "N", P - 1, j) in done for j in range(K)):
            fwd_end = max(done[("F" if schedule != "cached" else "N", P - 1, j)] for j in range(K))
            sync_ready = max(fwd_end, others_forward_end) + sync
        for s in range(P):
            while pos[s] < len(orders[s]):
                kind, j = orders[s][pos[s]]
                deps: list[float] = []
                ok = True
                if kind in fwd_kinds or kind == "R":
                    if s > 0:
                        key = (kind, s - 1, j)
                        ok = key in done
                        deps.append(done.get(key, 0.0))
                    if kind == "R" and ok and sync_ready is None:
                        ok = False  # recompute starts after the batch sync (see module docstring)
                    elif kind == "R" and ok:
                        deps.append(sync_ready)  # type: ignore[arg-type]
                else:  # B
                    if s == P - 1:
                        ok = sync_ready is not None
                        deps.append(sync_ready or 0.0)
                        if schedule == "cached":
                            ok = ok and ("R", s, j) in done
                    else:
                        ok = ("B", s + 1, j) in done
                        deps.append(done.get(("B", s + 1, j), 0.0))
                if not ok:
                    break
                start = max([free[s], *deps])
                dur = b if kind == "B" else f
                end = start + dur
                done[(kind, s, j)] = end
                free[s] = end
                ops.append(Op(s, kind, j, start, end))
                pos[s] += 1
                progressed = True
        if not progressed and len(ops) < total:
            raise RuntimeError("pipeline simulation deadlocked (inconsistent instruction orders)")
    fkind = "F" if schedule != "cached" else "N"
    fwd_end = max(done[(fkind, P - 1, j)] for j in range(K))
    return {"forward_end": fwd_end, "sync_ready": sync_ready, "end": max(o.end for o in ops), "ops": ops}


# ---------------------------------------------------------------------- devices sharing a host
def shared_host_phases(
    times: Mapping[str, float], ranks: Mapping[str, Sequence[int]], devices_per_node: int, concurrency: float, colocated: bool
) -> dict[str, float]:
    """Wall time of each tower's phase when devices of a node slow each other down.

    ``concurrency`` (``Device.concurrency``, measured for CPU processes) is the factor by which
    compute stretches while other devices of the node compute too. Colocated towers run on every
    rank at once, so each phase stretches by it whenever a node holds two or more of the ranks.
    For separate towers, a tower is stretched only while a device it shares a node with is busy:
    with ``T`` its phase alone and ``O`` the longest phase of the other busy devices of its nodes
    (its own other replicas included, ``O >= T`` then), everyone progresses at ``1/concurrency``
    until the shorter of the two ends, so the wall time is ``T + (concurrency - 1) * min(T, O)``.
    """
    node = lambda r: r // devices_per_node  # noqa: E731
    extra = concurrency - 1.0
    if colocated:
        shared = any(sum(1 for r in rs if node(r) == nd) > 1 for rs in ranks.values() for nd in {node(r) for r in rs})
        return {n: t * (concurrency if shared else 1.0) for n, t in times.items()}
    out = {}
    for n, t in times.items():
        counts: dict[int, int] = {}
        for r in ranks[n]:
            counts[node(r)] = counts.get(node(r), 0) + 1
        other = t if any(k > 1 for k in counts.values()) else 0.0
        for m, rs in ranks.items():
            if m != n and any(node(r) in counts for r in rs):
                other = max(other, times[m])
        out[n] = t + extra * min(t, other)
    return out


# ---------------------------------------------------------------------- whole plans
@dataclass(frozen=True)
class TowerChoice:
    """One tower's parallelism: devices, degrees, microbatching and schedule."""

    name: str
    n: int
    tp: int
    pp: int
    microbatch: int
    schedule: str
    replica_batch: tuple[int, ...]

    @property
    def dp(self) -> int:
        return self.n // (self.tp * self.pp)

    @property
    def max_batch(self) -> int:
        return max(self.replica_batch)

    @property
    def K(self) -> int:
        return math.ceil(self.max_batch / self.microbatch)


def even_split(global_batch: int, dp: int) -> tuple[int, ...]:
    return tuple(global_batch // dp + (1 if i < global_batch % dp else 0) for i in range(dp))


def _groups(ranks: Sequence[int], tp: int, pp: int) -> dict[str, list[list[int]]]:
    w = tp * pp
    dp = len(ranks) // w
    replicas = [list(ranks[i * w : (i + 1) * w]) for i in range(dp)]
    tp_groups = [r[p * tp : (p + 1) * tp] for r in replicas for p in range(pp)]
    boundaries = [[r[p * tp], r[(p + 1) * tp]] for r in replicas for p in range(pp - 1)]
    dp_groups = [[replicas[i][p * tp + j] for i in range(dp)] for p in range(pp) for j in range(tp)]
    return {"replicas": replicas, "tp": tp_groups, "pp": boundaries, "dp": dp_groups}


def evaluate_plan(
    profiles: Mapping[str, TowerProfile],
    cluster: Cluster,
    opts: CostOptions,
    choices: Mapping[str, TowerChoice],
    ranks: Mapping[str, Sequence[int]],
    global_batch: int,
) -> StepCost:
    """Price a complete plan (towers, degrees, microbatches, schedules and physical ranks).

    Towers either hold disjoint ranks (*separate*) or all hold the same ranks (*colocated*, run one
    after the other). Link contention: the gradient all-reduces of all groups that cross nodes run
    together and share each node's NIC; a group's inter-node time is set by its busiest node.
    """
    dpn = cluster.devices_per_node
    node = lambda r: r // dpn  # noqa: E731
    sets = {name: frozenset(r) for name, r in ranks.items()}
    colocated = len(set(sets.values())) == 1 and len(sets) > 1
    if not colocated and sum(len(s) for s in sets.values()) != len(frozenset().union(*sets.values())):
        raise ValueError("towers must hold either disjoint ranks or all the same ranks")
    world = len(frozenset().union(*sets.values()))
    used_nodes = {node(r) for s in sets.values() for r in s}
    bel = opts.bytes_el
    contrastive = [n for n, p in profiles.items() if p.arch != "text_decoder"]
    embed = max(profiles[n].embed_dim for n in contrastive) if contrastive else 0
    lb = loss_bytes(global_batch, world, len(contrastive), opts, embed)

    groups = {name: _groups(list(ranks[name]), c.tp, c.pp) for name, c in choices.items()}
    node_load: dict[int, float] = {}
    own_load: dict[str, dict[int, float]] = {name: {} for name in choices}
    dp_info: dict[str, dict[str, float]] = {}
    for name, c in choices.items():
        p = profiles[name]
        gb = grad_bytes_per_device(p, opts, c.tp, c.pp)
        worst_local, span_nodes, intra_bytes, inter_bytes = 0.0, set(), 0.0, 0.0
        for g in groups[name]["dp"]:
            counts: dict[int, int] = {}
            for r in g:
                counts[node(r)] = counts.get(node(r), 0) + 1
            m, k = len(counts), max(counts.values())
            if len(g) > 1 and gb > 0:
                local = cluster.ring_latency(len(g), m, 2) + (2 * (k - 1) / k * gb / cluster.intra.effective if k > 1 else 0.0)
                worst_local = max(worst_local, local)
                intra_bytes += sum(2 * (cnt - 1) / cnt * gb * cnt for cnt in counts.values() if cnt > 1)
                if m > 1:
                    crossing = 2 * (m - 1) / m * gb
                    inter_bytes += crossing * m
                    for nd in counts:
                        node_load[nd] = node_load.get(nd, 0.0) + crossing
                        own_load[name][nd] = own_load[name].get(nd, 0.0) + crossing
                        span_nodes.add(nd)
        dp_info[name] = {"local": worst_local, "intra_bytes": intra_bytes, "inter_bytes": inter_bytes, "grad_bytes": gb}
        dp_info[name]["nodes"] = span_nodes  # type: ignore[assignment]

    costs: dict[str, TowerCost] = {}
    mem_by_rank: dict[int, float] = {}
    details: dict[str, dict[str, Any]] = {}
    for name, c in choices.items():
        p = profiles[name]
        g = groups[name]
        tp_cross = any(len({node(r) for r in grp}) > 1 for grp in g["tp"])
        pp_cross = any(node(a) != node(b) for a, b in g["pp"])
        mb, K, P = c.microbatch, c.K, c.pp
        fc, bc = (float(x) for x in stage_compute(p, cluster, opts, mb, c.tp, c.pp))
        tpc = float(tp_comm(p, cluster, opts, mb, c.tp, c.pp, tp_cross))
        ppc = float(pp_comm(p, cluster, opts, mb, c.pp, pp_cross))
        f = fc + tpc + ppc
        b = (bc + tpc + ppc) if not p.frozen else 0.0
        Fp, Bp, bubble = (float(x) for x in phases(c.schedule, p.frozen, K, P, f, b))
        cross = 0.0
        if p.cross_from and p.cross_from in ranks:
            src_nodes = {node(r) for r in ranks[p.cross_from]}
            mine = {node(r) for r in ranks[name]}
            nbytes = bel * c.max_batch * p.cross_elems
            if colocated:
                cross = 0.0
            elif src_nodes == mine and len(mine) == 1:
                cross = nbytes / cluster.intra.effective
            else:
                cross = nbytes / (cluster.inter.effective / dpn)
            Fp += cross
            Bp += cross if not p.frozen else 0.0
        recompute = c.schedule in ("cached", RECOMPUTE) and not p.frozen
        compute = K * (fc + bc + (fc if recompute else 0.0))
        mem = {k: float(v) for k, v in memory_per_device(p, opts, c.schedule, mb, K, c.max_batch, c.tp, c.pp, lb).items()}
        for r in ranks[name]:
            # the loss buffers exist once per rank, however many towers it holds
            mem_by_rank[r] = mem_by_rank.get(r, lb) + mem["total"] - lb
        # link bytes of this tower per step
        msg = bel * mb * (p.layer.tp_allreduce / max(2 * len(p.layer.attn), 1)) if p.analytic else 0.0
        tp_bytes = 0.0
        if c.tp > 1:
            calls = 2 * len(p.layer.attn) * (p.layers // P) * K * (1 if p.frozen else (3 if recompute else 2))
            tp_bytes = calls * 2 * (c.tp - 1) / c.tp * msg * c.tp * c.dp * P
        pp_bytes = (P - 1) * K * c.dp * bel * mb * p.layer.boundary * (1 if p.frozen else 2 if not recompute else 3)
        info = dp_info[name]
        intra_b = info["intra_bytes"] + (0.0 if tp_cross else tp_bytes) + (0.0 if pp_cross else pp_bytes)
        inter_b = info["inter_bytes"] + (tp_bytes if tp_cross else 0.0) + (pp_bytes if pp_cross else 0.0)
        if cross and not colocated:
            inter_b += 2 * bel * global_batch * p.cross_elems
        costs[name] = TowerCost(
            name=name,
            forward_phase=Fp,
            backward_phase=Bp,
            compute=compute,
            tp_comm=(tpc * (K + P - 1) * (1 if p.frozen else 2 + (1 if recompute else 0))),
            pp_comm=(ppc * (K + P - 1) * (1 if p.frozen else 2 + (1 if recompute else 0))),
            bubble=bubble,
            dp_allreduce=0.0,
            dp_exposed=0.0,
            optimizer=optimizer_time(p, cluster, opts, c.tp, c.pp),
            cross_comm=cross * (1 if p.frozen else 2),
            memory=mem,
            bytes_intra=intra_b,
            bytes_inter=inter_b,
        )
        details[name] = {"tp_cross_node": tp_cross, "pp_cross_node": pp_cross, "f": f, "b": b, "K": K, "slot": float(last_slot(c.schedule, f, b)) if not p.frozen else 0.0}

    # gradient all-reduce. Separate towers reduce at the same time and share the NICs of the nodes
    # they cross; colocated towers run one after the other, so a tower's all-reduce overlaps the
    # backward of the towers after it (on one communication stream, in the best order).
    order_used: list[str] = list(choices)
    if colocated:
        ar = {n: dp_info[n]["local"] + max(own_load[n].values(), default=0.0) / cluster.inter.effective for n in choices}
        best_exposed, best_order = math.inf, list(choices)
        for order in itertools.permutations(choices):
            clock, stream = 0.0, 0.0
            for n in order:
                clock += costs[n].backward_phase
                stream = max(stream, clock - details[n]["slot"]) + ar[n]
            gb_total = sum(dp_info[n]["grad_bytes"] for n in choices)
            total_ar = sum(ar.values())
            floor = total_ar * min(1.0, opts.bucket_bytes / gb_total) if (gb_total and opts.overlap_grad_sync) else total_ar
            exposed = max(stream - clock, floor) if opts.overlap_grad_sync else total_ar
            if exposed < best_exposed:
                best_exposed, best_order = exposed, list(order)
        total_ar = sum(ar.values()) or 1.0
        for n, tc in costs.items():
            tc.dp_allreduce, tc.dp_exposed = ar[n], best_exposed * ar[n] / total_ar
        order_used = best_order
    else:
        for n, tc in costs.items():
            a = dp_info[n]["local"] + max((node_load.get(nd, 0.0) for nd in dp_info[n]["nodes"]), default=0.0) / cluster.inter.effective  # type: ignore[union-attr]
            tc.dp_allreduce = a
            tc.dp_exposed = float(exposed_allreduce(a, details[n]["slot"], dp_info[n]["grad_bytes"], opts)) if a > 0 else 0.0

    n_distmm = sum(1 for n in contrastive if choices[n].schedule == "distmm")
    sync = sync_time(cluster, opts, global_batch, embed, world, len(used_nodes), len(contrastive), n_distmm / max(len(contrastive), 1))
    fwd = {n: c.forward_phase for n, c in costs.items()}
    bwd = {n: c.backward_phase + c.optimizer for n, c in costs.items()}
    conc = cluster.device.concurrency
    if conc != 1.0:
        fwd = shared_host_phases(fwd, ranks, dpn, conc, colocated)
        bwd = shared_host_phases(bwd, ranks, dpn, conc, colocated)
        for n, tc in costs.items():
            tc.contention = fwd[n] - tc.forward_phase + bwd[n] - tc.backward_phase - tc.optimizer
    if colocated:
        step = sum(fwd.values()) + sync["total"] + sum(bwd.values()) + sum(c.dp_exposed for c in costs.values())
    else:
        step = max(fwd.values()) + sync["total"] + max(bwd[n] + c.dp_exposed for n, c in costs.items())
    step += opts.step_overhead
    limit = cluster.device.memory * opts.memory_margin
    if colocated:
        for tc in costs.values():
            tc.memory["total_device"] = max(mem_by_rank.values())
    peak = max(mem_by_rank.values())
    return StepCost(
        towers=costs,
        sync=sync,
        step_time=float(step),
        layout="colocated" if colocated else "separate",
        extra={"fits": peak <= limit, "peak_memory": peak, "memory_limit": limit, "details": details, "world": world, "backward_order": order_used},
    )


__all__ = [
    "CostOptions",
    "SCHEDULE_NAMES",
    "RECOMPUTE",
    "block_time",
    "stage_compute",
    "tp_comm",
    "pp_comm",
    "phases",
    "stage_params",
    "act_per_sample",
    "memory_per_device",
    "loss_bytes",
    "grad_bytes_per_device",
    "optimizer_time",
    "compact_dp_allreduce",
    "exposed_allreduce",
    "last_slot",
    "sync_time",
    "shared_host_phases",
    "TowerCost",
    "StepCost",
    "Op",
    "schedule_ops",
    "simulate_pipeline",
    "TowerChoice",
    "even_split",
    "evaluate_plan",
]

