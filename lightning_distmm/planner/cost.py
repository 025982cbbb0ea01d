"""Cost model: time, memory and link bytes of one training step of a plan.

Why one model for everything: the DistMM plan, the colocated DDP baseline and the Megatron-style
baseline are all priced by the functions below, so a comparison between them measures the plans,
not two different models. The functions accept numpy arrays (the partitioner evaluates thousands
of (replicas, microbatches) combinations at once) and plain numbers (the final evaluation).

A replica's pipeline is priced from the schedule the runtime runs: :func:`replica_timeline`
simulates (``schedule.simulate``) the instruction lists ``schedule.schedules`` emits for a
one-tower plan of the replica's pipeline depth, microbatch and schedule, with per-microbatch
forward and backward durations, the batch-sync durations and the stage-to-stage transfer time.
Its result is cut at the batch-syncs into *segments*: the time before the first batch-sync,
between the batch-syncs, after the last. :func:`phases` gives the same segments in closed form
(uniform microbatches; numpy arrays over many candidates), derived from that simulation and
checked against it by the tests; the partitioner uses it, and :func:`evaluate_plan` when a
replica's lists are too long to simulate quickly.

A batch-sync (features of its rows -> loss -> feature gradients) is a barrier between the towers'
segments, so for towers on *separate* devices (DESIGN.md section 4, contrastive loss)

    step = sum_w max_t segment_w,t + syncs + max_t (last segment_t + exposed all-reduce_t + optimizer_t)

(``gpipe``, ``cached``: one batch-sync, ``max F + sync + max B``; ``distmm``: two, each over half
of the global batch). Towers *colocated* on the same devices run one after the other: every
segment is a sum over the towers instead of a max.

Per tower replica with ``K`` microbatches over ``P`` stages, stage times ``f`` and ``b`` per
microbatch and transfer time ``L`` between stages (:func:`phases`):

* ``gpipe``  before (K+P-1) f + (P-1) L, after (K+P-1) b + (P-1) L; keeps all K microbatches.
* ``cached`` forward without keeping activations, batch-sync, then per microbatch recompute and
  backward: after (K+P-1) (f+b) + (P-1) L; keeps at most min(K, P) microbatches.
* ``distmm`` two sync groups (waves) of K0 and K1 microbatches (half of the replica's rows each):
  wave 0's forwards, its batch-sync, then 1F1B between the waves (stage ``s`` first runs
  ``P-1-s`` of wave 1's forwards, then one wave-0 backward and one wave-1 forward per slot), wave
  1's batch-sync and backwards: before (K0+P-1) f + (P-1) L, between K1 f + K0 b + 2 (K1 -
  ceil(K1/P)) L, after (K1+P-1) b + (P-1) L; keeps one wave's microbatches plus P-1 (stage 0).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_distmm.core import schedule as ir
from lightning_distmm.core.plan import Plan, TowerPlan, split_batch
from lightning_distmm.planner.cluster import Cluster
from lightning_distmm.planner.profile import Block, TowerProfile

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
    def from_dict(cls, d: Mapping[str, Any] | None) -> CostOptions:
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


def stage_compute(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int
) -> tuple[np.ndarray, np.ndarray]:
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


def _analytic_stage(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int
) -> np.ndarray:
    layer = block_time(profile.layer, cluster, opts, mb, tp) * (profile.layers // pp)
    pre, post = block_time(profile.pre, cluster, opts, mb, tp), block_time(profile.post, cluster, opts, mb, tp)
    return layer + (pre + post if pp == 1 else np.maximum(pre, post))


def tp_comm(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, tp: int, pp: int, cross_node: bool = False
) -> np.ndarray:
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


def pp_comm(
    profile: TowerProfile, cluster: Cluster, opts: CostOptions, mb: Any, pp: int, cross_node: bool = False
) -> np.ndarray:
    """Seconds to send one microbatch's activations to the next stage (the gradient back costs the same)."""
    mb = np.asarray(mb, dtype=float)
    if pp <= 1:
        return np.zeros_like(mb)
    nbytes = opts.bytes_el * mb * profile.layer.boundary
    if cross_node:
        return cluster.inter.latency + nbytes / (cluster.inter.effective / cluster.devices_per_node)
    return cluster.intra.latency + nbytes / cluster.intra.effective


def wave_rows(schedule: str, rows: Any) -> tuple[Any, ...]:
    """Rows of a replica's sync groups: ``distmm`` halves them (the first wave takes the odd row)."""
    if schedule == "distmm":
        rows = np.asarray(rows)
        return (rows - rows // 2, rows // 2)
    return (rows,)


def phases(
    schedule: str, frozen: bool, K: Any, P: int, f: Any, b: Any, link: Any = 0.0, K1: Any = None
) -> tuple[tuple[Any, ...], Any]:
    """Closed form of :func:`replica_timeline` for microbatches of equal durations.

    ``K`` microbatches (``distmm``: ``K`` in wave 0 and ``K1`` in wave 1, ``K1`` in ``{K, K-1}``,
    default ``K``), ``P`` stages, ``f``/``b`` forward/backward seconds of a microbatch on a stage
    (``cached`` and ``gpipe+recompute`` add the recompute ``f`` to each backward), ``link`` seconds
    from a stage's send to the next stage's receive. Returns the segments (before the first
    batch-sync, between the batch-syncs, after the last) and the bubble (their sum less a stage's
    compute). Every argument but ``schedule``, ``frozen`` and ``P`` may be a numpy array.

    The formulas are the critical paths of the schedule's instruction lists (the tests check them
    against the simulation). They do not depend on the batch-sync durations: every critical path
    after a batch-sync runs through it. ``distmm``'s middle segment is 1F1B between the waves:
    stage ``s`` has run ``P-1-s`` of wave 1's forwards before wave 0's batch-sync ends (as if the
    forward stream of wave 0 went on), then runs one wave-0 backward and one wave-1 forward per
    slot. Without transfer time that packs the last stage exactly (``K1 (f+b)``, plus one ``b``
    when wave 0 has one microbatch more); every critical path to the last stage's last wave-1
    forward does the same work, so the transfer time adds ``L`` per message on the path with the
    most: a gradient going ``m <= P-1`` stages down and activations coming back up cost ``2 m L``
    over ``m+1`` of the last stage's slots, so the longest path carries ``2 (K1 - ceil(K1/P))``
    transfers: middle ``K1 f + K b + 2 (K1 - ceil(K1/P)) L``. By then the other stages have finished wave 0's backwards (wave 1's gradients reach them
    later along the same path), so the last segment is ``gpipe``'s backward of ``K1`` microbatches.
    """
    if schedule not in (*SCHEDULE_NAMES, RECOMPUTE):
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    K = np.asarray(K, dtype=float)
    fill = (P - 1) * link
    first = (K + P - 1) * f + fill
    zero = 0.0 * first
    if schedule != "distmm":
        if frozen:
            return (first, zero), first - K * f
        back = f + b if schedule in ("cached", RECOMPUTE) else b
        last = (K + P - 1) * back + fill
        return (first, last), first + last - K * (f + back)
    K1 = K if K1 is None else np.asarray(K1, dtype=float)
    if frozen:
        middle = K1 * f + zero
        return (first, middle, zero), first + middle - (K + K1) * f
    middle = K1 * f + K * b + 2.0 * (K1 - np.ceil(K1 / P)) * link
    last = (K1 + P - 1) * b + fill
    return (first, middle, last), first + middle + last - (K + K1) * (f + b)


# ---------------------------------------------------------------------- the schedule, simulated
SIMULATE_MAX_INSTRUCTIONS = 2048
"""Above this many instructions (all stages of a replica) :func:`evaluate_plan` uses the closed
form :func:`phases` instead of simulating (a long simulation takes a noticeable fraction of a second)."""


@dataclass(frozen=True)
class ReplicaTimeline:
    """One replica's pipeline, simulated: segments between the batch-syncs and the bubble (seconds)."""

    segments: tuple[float, ...]
    bubble: float
    microbatches: tuple[int, ...]  # rows of each microbatch, in the order a stage runs them


def replica_plan(schedule: str, P: int, microbatch: int | None) -> Plan:
    """A one-tower plan of one replica: ``P`` stages on ranks ``0..P-1`` (``gpipe+recompute`` is
    ``gpipe`` with ``recompute``)."""
    tower = TowerPlan(
        ranks=list(range(P)),
        pp=P,
        microbatch=microbatch,
        schedule="gpipe" if schedule == RECOMPUTE else schedule,
        recompute=schedule == RECOMPUTE,
    )
    return Plan(P, {"tower": tower})


@functools.lru_cache(maxsize=512)
def _replica_lists(
    schedule: str, P: int, rows: int, microbatch: int | None, frozen: bool
) -> dict[int, tuple[ir.Instruction, ...]]:
    lists = ir.schedules(replica_plan(schedule, P, microbatch), rows)
    # a frozen tower's backward is skipped by the runtime: no compute, no gradient sent or awaited
    return {r: tuple(i for i in ins if not (frozen and isinstance(i, ir.Backward))) for r, ins in lists.items()}


def microbatch_rows(schedule: str, rows: int, microbatch: int | None) -> tuple[list[int], set[int]]:
    """Per sync group, how many microbatches ``schedule.rank_schedule`` cuts a replica's ``rows``
    into, and the distinct microbatch sizes (without listing them)."""
    counts, sizes = [], set()
    for w in wave_rows(schedule, int(rows)):
        w = int(w)
        mb = w if microbatch is None or microbatch >= w else int(microbatch)
        counts.append(max(1, math.ceil(w / mb)) if mb else 1)
        sizes.update({mb, w % mb} - {0} if mb else {0})
    return counts, sizes


def replica_instructions(schedule: str, P: int, rows: int, microbatch: int | None) -> int:
    """How many instructions all stages of such a replica run in a step (without building them)."""
    counts, _ = microbatch_rows(schedule, rows, microbatch)
    return P * (2 * sum(counts) + 1) + len(counts)


def replica_timeline(
    schedule: str,
    frozen: bool,
    P: int,
    rows: int,
    microbatch: int | None,
    forward: float | Callable[[int], float],
    backward: float | Callable[[int], float],
    link: float | Callable[[int], float] = 0.0,
    syncs: Sequence[float] = (),
) -> ReplicaTimeline:
    """Price one replica's pipeline by simulating the runtime's instruction lists.

    The lists are ``schedule.schedules`` of a one-tower plan (:func:`replica_plan`) on ``rows``
    samples; ``forward``, ``backward`` and ``link`` are the seconds of a microbatch's forward and
    backward on a stage and of its transfer to the next stage (activations) or previous one
    (gradient), each a number or a function of the microbatch's rows; a recomputing backward
    (``cached``, ``gpipe+recompute``) lasts forward + backward. ``syncs``: seconds of each
    batch-sync (0 when omitted). A frozen tower's backwards are left out, as the runtime skips them.
    """
    lists = _replica_lists(schedule, P, int(rows), None if microbatch is None else int(microbatch), frozen)
    sizes = sorted({i.rows for i in lists[P - 1] if isinstance(i, ir.Forward)})
    table = tuple((r, *(float(x(r)) if callable(x) else float(x) for x in (forward, backward, link))) for r in sizes)
    return _simulate_replica(schedule, frozen, P, int(rows), microbatch, table, tuple(float(x) for x in syncs))


@functools.lru_cache(maxsize=4096)
def _simulate_replica(
    schedule: str, frozen: bool, P: int, rows: int, microbatch: int | None, table: tuple, syncs: tuple[float, ...]
) -> ReplicaTimeline:
    lists = _replica_lists(schedule, P, rows, microbatch, frozen)
    by_rows = {r: (f, b, L) for r, f, b, L in table}
    recompute = schedule in ("cached", RECOMPUTE)

    def duration(rank: int, ins: ir.Instruction) -> float:
        if isinstance(ins, ir.Forward):
            return by_rows[ins.rows][0]
        if isinstance(ins, ir.Backward):
            f, b, _ = by_rows[ins.rows]
            return b + (f if recompute else 0.0)
        if isinstance(ins, ir.BatchSync):
            return syncs[ins.sync_group] if ins.sync_group < len(syncs) else 0.0
        return 0.0

    intervals = ir.simulate(lists, duration, lambda ins: by_rows[ins.rows][2])
    last = sorted(
        (i for i in intervals if i.rank == P - 1 and isinstance(i.instruction, ir.BatchSync)),
        key=lambda i: i.instruction.sync_group,
    )
    end = max(i.end for i in intervals)
    segments, clock = [], 0.0
    for i in last:
        segments.append(i.start - clock)
        clock = i.end
    segments.append(end - clock)
    work = max(
        sum(i.end - i.start for i in intervals if i.rank == r and isinstance(i.instruction, (ir.Forward, ir.Backward)))
        for r in range(P)
    )
    mbs = tuple(i.rows for i in lists[P - 1] if isinstance(i, ir.Forward))
    return ReplicaTimeline(tuple(segments), sum(segments) - work, mbs)


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
    profile: TowerProfile,
    opts: CostOptions,
    schedule: str,
    mb: Any,
    K: Any,
    replica_batch: Any,
    tp: int,
    pp: int,
    loss_bytes: Any = 0.0,
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
    elif schedule == "distmm":
        # one wave's microbatches, plus the P-1 wave-1 forwards stage 0 runs ahead of its first
        # backward (1F1B between the waves; stage s runs P-1-s, so stage 0 is the heaviest)
        wave0, wave1 = wave_rows("distmm", np.asarray(replica_batch, dtype=float))
        act = (wave0 + np.minimum((pp - 1) * mb, wave1)) * aps
    else:
        act = np.asarray(replica_batch, dtype=float) * aps
    return {
        "static": static + 0 * mb,
        "activations": act,
        "loss": np.asarray(loss_bytes, dtype=float) + 0 * mb,
        "total": static + act + loss_bytes,
    }


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
    lat = np.where(
        dp > 1,
        cluster.collective_latency
        + (steps - inter_steps) * cluster.intra.latency
        + inter_steps * cluster.inter.latency,
        0.0,
    )
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
) -> dict[str, float]:
    """One batch-sync over ``global_batch`` rows (a sync group): feature all-gather + this rank's
    loss rows forward and backward + feature-gradient reduce-scatter (as large as the gather)."""
    if n_contrastive < 2:
        return {"gather": 0.0, "loss": 0.0, "total": 0.0}
    total = n_contrastive * global_batch * embed_dim * opts.feature_bytes
    per_node = max(1, math.ceil(world / max(nodes, 1)))
    gather = cluster.allgather_time(total, world, nodes, per_node)
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
    group (half of the batch each). ``waves``: seconds of each; the other keys sum them."""
    each = [
        sync_time(cluster, opts, rows, embed_dim, world, nodes, n_contrastive)
        for rows in split_batch(global_batch, None, groups)
    ]
    out: dict[str, Any] = {k: sum(e[k] for e in each) for k in ("gather", "loss", "total")}
    out["waves"] = [e["total"] for e in each]
    return out


def sync_groups(choices: Mapping[str, TowerChoice]) -> int:
    """Batch-syncs per step: 2 when the towers run ``distmm`` (every tower must), else 1."""
    uses = {c.schedule == "distmm" for c in choices.values()}
    if len(uses) > 1:
        odd = sorted(n for n, c in choices.items() if c.schedule == "distmm")
        raise ValueError(
            f"schedule 'distmm' is on tower(s) {odd} but not on all towers: it splits the whole batch into two sync groups"
        )
    return 2 if True in uses else 1


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
    (the ``link`` of :func:`schedule.simulate`). For drawing a plan's step, not for the planner."""
    contrastive = [n for n, p in profiles.items() if p.arch != "text_decoder"]
    embed = max((profiles[n].embed_dim for n in contrastive), default=0)
    syncs = batch_syncs(cluster, opts, global_batch, embed, world, nodes, len(contrastive), sync_groups(choices))[
        "waves"
    ]

    @functools.cache
    def micro(tower: str, rows: int) -> tuple[float, float, float]:
        c, p = choices[tower], profiles[tower]
        f, b = (float(x) for x in stage_compute(p, cluster, opts, float(rows), c.tp, c.pp))
        t = float(tp_comm(p, cluster, opts, float(rows), c.tp, c.pp))
        link = float(pp_comm(p, cluster, opts, float(rows), c.pp))
        recompute = c.schedule in ("cached", RECOMPUTE)
        return f + t, 0.0 if p.frozen else b + t + (f + t if recompute else 0.0), link

    def seconds(rank: int, ins: ir.Instruction) -> float:
        if isinstance(ins, ir.Forward):
            return micro(ins.tower, ins.rows)[0]
        if isinstance(ins, ir.Backward):
            return micro(ins.tower, ins.rows)[1]
        if isinstance(ins, ir.BatchSync):
            return syncs[ins.sync_group]
        return 0.0

    def transfer(ins: ir.Instruction) -> float:
        return micro(ins.tower, ins.rows)[2] if isinstance(ins, (ir.Forward, ir.Backward)) else 0.0

    return seconds, transfer


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
    contention: float = (
        0.0  # seconds the tower's compute is stretched by other devices of its node (Device.concurrency)
    )
    segments: tuple[float, ...] = ()  # before the first batch-sync, between the batch-syncs, after the last

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


# ---------------------------------------------------------------------- devices sharing a host
def shared_host_phases(
    times: Mapping[str, float],
    ranks: Mapping[str, Sequence[int]],
    devices_per_node: int,
    concurrency: float,
    colocated: bool,
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
    waves = sync_groups(choices)
    sync = batch_syncs(cluster, opts, global_batch, embed, world, len(used_nodes), len(contrastive), waves)
    lb = loss_bytes(split_batch(global_batch, None, waves)[0], world, len(contrastive), opts, embed)

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
                local = cluster.ring_latency(len(g), m, 2) + (
                    2 * (k - 1) / k * gb / cluster.intra.effective if k > 1 else 0.0
                )
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
        mb, P = c.microbatch, c.pp
        if c.schedule == "distmm" and c.max_batch < 2:
            raise ValueError(
                f"tower {name!r}: schedule 'distmm' needs at least 2 rows per replica (one per sync group), got {c.max_batch}"
            )
        # seconds per microbatch, by its rows: compute + tensor-parallel all-reduces of a stage (never
        # below the transfer: a stage cannot pass microbatches on faster than its link carries
        # them), and the transfer to the next stage
        counts, distinct = microbatch_rows(c.schedule, c.max_batch, mb)
        K = sum(counts)
        sizes = sorted(distinct | {mb})
        at = float(sizes[0]) if len(sizes) == 1 else np.asarray(sizes, dtype=float)  # (scalars are quicker)
        fc_r, bc_r = (np.atleast_1d(x) for x in stage_compute(p, cluster, opts, at, c.tp, c.pp))
        tpc_r = np.atleast_1d(tp_comm(p, cluster, opts, at, c.tp, c.pp, tp_cross))
        ppc_r = np.atleast_1d(pp_comm(p, cluster, opts, at, c.pp, pp_cross))
        f_r = np.maximum(fc_r + tpc_r, ppc_r)
        b_r = np.zeros_like(f_r) if p.frozen else np.maximum(bc_r + tpc_r, ppc_r)
        row = {r: i for i, r in enumerate(sizes)}
        fc, bc, f, b, ppc = (float(x[row[mb]]) for x in (fc_r, bc_r, f_r, b_r, ppc_r))
        if replica_instructions(c.schedule, P, c.max_batch, mb) <= SIMULATE_MAX_INSTRUCTIONS:
            timeline = replica_timeline(
                c.schedule,
                p.frozen,
                P,
                c.max_batch,
                mb,
                lambda r: f_r[row[r]],
                lambda r: b_r[row[r]],
                lambda r: ppc_r[row[r]],
                sync["waves"],
            )
            segments, bubble, mbs = list(timeline.segments), timeline.bubble, list(timeline.microbatches)
        else:  # too long to simulate quickly: the closed form of the same lists (microbatches of ``mb`` rows)
            closed, closed_bubble = phases(c.schedule, p.frozen, counts[0], P, f, b, ppc, counts[-1])
            segments, bubble, mbs = [float(x) for x in closed], float(closed_bubble), [mb] * K
        pp_critical = 0.0  # the transfers' share of the critical path
        if P > 1:
            with_link, no_link = (
                phases(c.schedule, p.frozen, counts[0], P, f, b, x, counts[-1])[0] for x in (ppc, 0.0)
            )
            pp_critical = float(sum(with_link) - sum(no_link))
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
            segments[0] += cross
            segments[-1] += cross if not p.frozen else 0.0
        Fp, Bp = segments[0], sum(segments[1:])
        recompute = c.schedule in ("cached", RECOMPUTE) and not p.frozen
        compute = sum(
            float(fc_r[row[r]] + (0.0 if p.frozen else bc_r[row[r]] + (fc_r[row[r]] if recompute else 0.0)))
            for r in mbs
        )
        mem = {
            k: float(v) for k, v in memory_per_device(p, opts, c.schedule, mb, K, c.max_batch, c.tp, c.pp, lb).items()
        }
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
            tp_comm=sum(float(tpc_r[row[r]]) for r in mbs) * (1 if p.frozen else 2 + (1 if recompute else 0)),
            pp_comm=pp_critical,
            bubble=bubble,
            dp_allreduce=0.0,
            dp_exposed=0.0,
            optimizer=optimizer_time(p, cluster, opts, c.tp, c.pp),
            cross_comm=cross * (1 if p.frozen else 2),
            memory=mem,
            bytes_intra=intra_b,
            bytes_inter=inter_b,
            segments=tuple(segments),
        )
        details[name] = {
            "tp_cross_node": tp_cross,
            "pp_cross_node": pp_cross,
            "f": f,
            "b": b,
            "K": K,
            "slot": float(last_slot(c.schedule, f, b)) if not p.frozen else 0.0,
        }

    # gradient all-reduce. Separate towers reduce at the same time and share the NICs of the nodes
    # they cross; colocated towers run one after the other, so a tower's all-reduce overlaps the
    # backward of the towers after it (on one communication stream, in the best order).
    order_used: list[str] = list(choices)
    if colocated:
        ar = {
            n: dp_info[n]["local"] + max(own_load[n].values(), default=0.0) / cluster.inter.effective for n in choices
        }
        best_exposed, best_order = math.inf, list(choices)
        for order in itertools.permutations(choices):
            clock, stream = 0.0, 0.0
            for n in order:
                clock += costs[n].segments[-1]
                stream = max(stream, clock - details[n]["slot"]) + ar[n]
            gb_total = sum(dp_info[n]["grad_bytes"] for n in choices)
            total_ar = sum(ar.values())
            floor = (
                total_ar * min(1.0, opts.bucket_bytes / gb_total) if (gb_total and opts.overlap_grad_sync) else total_ar
            )
            exposed = max(stream - clock, floor) if opts.overlap_grad_sync else total_ar
            if exposed < best_exposed:
                best_exposed, best_order = exposed, list(order)
        total_ar = sum(ar.values()) or 1.0
        for n, tc in costs.items():
            tc.dp_allreduce, tc.dp_exposed = ar[n], best_exposed * ar[n] / total_ar
        order_used = best_order
    else:
        for n, tc in costs.items():
            a = (
                dp_info[n]["local"]
                + max((node_load.get(nd, 0.0) for nd in dp_info[n]["nodes"]), default=0.0) / cluster.inter.effective
            )  # type: ignore[union-attr]
            tc.dp_allreduce = a
            tc.dp_exposed = (
                float(exposed_allreduce(a, details[n]["slot"], dp_info[n]["grad_bytes"], opts)) if a > 0 else 0.0
            )

    # the segments between the batch-syncs; the optimizer step ends the last one
    seg = {n: [*c.segments[:-1], c.segments[-1] + c.optimizer] for n, c in costs.items()}
    parts = [{n: seg[n][w] for n in costs} for w in range(waves + 1)]
    conc = cluster.device.concurrency
    if conc != 1.0:
        parts = [shared_host_phases(part, ranks, dpn, conc, colocated) for part in parts]
        for n, tc in costs.items():
            tc.contention = sum(part[n] for part in parts) - sum(seg[n])
    if colocated:
        step = sum(sum(part.values()) for part in parts) + sync["total"] + sum(c.dp_exposed for c in costs.values())
    else:
        step = (
            sum(max(part.values()) for part in parts[:-1])
            + sync["total"]
            + max(parts[-1][n] + c.dp_exposed for n, c in costs.items())
        )
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
        extra={
            "fits": peak <= limit,
            "peak_memory": peak,
            "memory_limit": limit,
            "details": details,
            "world": world,
            "backward_order": order_used,
        },
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
    "batch_syncs",
    "sync_groups",
    "wave_rows",
    "SIMULATE_MAX_INSTRUCTIONS",
    "ReplicaTimeline",
    "replica_plan",
    "microbatch_rows",
    "replica_instructions",
    "replica_timeline",
    "shared_host_phases",
    "TowerCost",
    "StepCost",
    "TowerChoice",
    "even_split",
    "evaluate_plan",
]
