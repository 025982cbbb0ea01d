"""The planner for a vision encoder feeding a language model (issue 21; docs/mllm.md, "The planner").

Why its own search: the contrastive planner (:mod:`.search`) balances towers that meet at a
batch-sync; here the LLM consumes the encoder's tokens row by row, so the step is a two-module
pipeline (the encoder's microbatches stream into the LLM's) whose makespan the runtime's own lists
give (:func:`lightning_distmm.core.handoff.simulate_handoff`).

* **partitioner** (:func:`module_options`): every (tp, pp, shard, recompute, microbatches) of one
  module on ``n`` devices, priced per microbatch from its profile (:mod:`.vlm_profile`; the images
  per sample as a distribution: the slowest replica's load) and kept when it fits device memory;
* **balancer** (:func:`vlm_plan`): every split ``n_e + n_l = N`` of the devices (separate modules)
  and every pair of choices on all ``N`` (colocated: one module after the other on each rank),
  ranked by a closed form of the two-module pipeline;
* **placement**: the best few are laid out (the encoder's ranks first or the LLM's; tensor-parallel
  groups inside a node) and priced by replaying the runtime's handoff lists with each route's bytes
  over the link its ranks share (:func:`~lightning_distmm.planner.cost.handoff.route_seconds`).

The baselines go through the same pricing: FSDP over the whole model (both modules on every rank,
``shard: full``, dp = N) and a uniform Megatron-style plan (the same tp for both modules, the LLM
cut into pp stages, the encoder's replicas over the same ranks, cut into the same pp stages unless the
ViT is frozen, which the runtime does not cut; the distributed optimizer priced).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from lightning_distmm.core.handoff import RecvTokenGrads, RecvTokens, TokenLoss, handoff_schedules, simulate_handoff
from lightning_distmm.core.plan import Plan, TowerPlan
from lightning_distmm.core.schedule import Backward, Forward, GradSync
from lightning_distmm.planner.cluster import Cluster
from lightning_distmm.planner.cost.comm import (
    compact_dp_allreduce,
    exposed_allreduce,
    pp_comm,
    shard_comm,
    sharded_stage,
    tp_comm,
)
from lightning_distmm.planner.cost.compute import optimizer_time, stage_compute
from lightning_distmm.planner.cost.handoff import route_seconds
from lightning_distmm.planner.cost.memory import grad_bytes_per_device, memory_per_device
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.pipeline import RECOMPUTE
from lightning_distmm.planner.vlm_presets import PRESETS
from lightning_distmm.planner.vlm_profile import VLMProfiles, straggler

MODULES = ("image", "llm")
MICROBATCHES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ModuleChoice:
    """One module's share: ``devices`` ranks as ``dp`` replicas of ``tp x pp``; ``microbatches`` per replica."""

    module: str
    devices: int
    tp: int = 1
    pp: int = 1
    shard: str = "none"
    recompute: bool = False
    microbatches: int = 1

    @property
    def dp(self) -> int:
        return self.devices // (self.tp * self.pp)

    def label(self) -> str:
        extra = (f" {self.shard}" if self.shard != "none" else "") + (" recompute" if self.recompute else "")
        return f"{self.devices} dev: dp{self.dp} tp{self.tp} pp{self.pp} mb{self.microbatches}{extra}"


@dataclass
class ModuleCost:
    """A choice priced: the slowest stage's seconds per microbatch, the replica's forward and backward
    phases (pipeline fill included), the exposed gradient sum, the optimizer step, peak bytes."""

    choice: ModuleChoice
    f: float
    b: float
    fwd: float
    bwd: float
    grads: float
    optimizer: float
    memory: float
    rows: int  # the largest replica's rows
    pp_link: float = 0.0

    @property
    def alone(self) -> float:
        return self.fwd + self.bwd + self.grads + self.optimizer


def _units(profs: VLMProfiles, module: str, rows: float, replica_rows: int, dp: int) -> float:
    """What ``rows`` samples weigh in the module's profile units: images for the encoder (the mean
    images per sample times the slowest replica's excess), samples for the LLM (at the mean sequence,
    times the slowest replica's token excess)."""
    w, tpi = profs.workload, PRESETS[profs.workload.preset].tokens_per_image
    if module == "image":
        return rows * w.mean_images * straggler(w, replica_rows, dp)
    return rows * straggler(w, replica_rows, dp, tpi, w.text_tokens)


def price_module(
    profs: VLMProfiles, c: ModuleChoice, global_batch: int, cluster: Cluster, opts: CostOptions
) -> ModuleCost | None:
    """``c`` priced, or None when its replicas hold no rows or the heaviest device overflows memory."""
    if c.dp < 1 or c.devices % (c.tp * c.pp) or global_batch < c.dp:
        return None
    rows = math.ceil(global_batch / c.dp)
    m = min(c.microbatches, rows)
    mb_rows = math.ceil(rows / m)
    m = math.ceil(rows / mb_rows)
    u_mb, u_rep = _units(profs, c.module, mb_rows, rows, c.dp), _units(profs, c.module, rows, rows, c.dp)
    sched = RECOMPUTE if c.recompute else "gpipe"
    parts = [(profs.vision, c.tp, c.pp), (profs.projector, 1, 1)] if c.module == "image" else [(profs.llm, c.tp, c.pp)]
    f = b = grads = opt = mem = 0.0
    ppc = 0.0
    for prof, tp, pp in parts:
        pf, pb = (float(x) for x in stage_compute(prof, cluster, opts, u_mb, tp, pp))
        tpc = float(tp_comm(prof, cluster, opts, u_mb, tp, pp, False))
        pf, pb = pf + tpc, pb + (tpc if not prof.frozen else 0.0)
        if c.recompute and not prof.frozen:
            pb += pf
        if c.shard == "full" and c.dp > 1:  # per-layer gathers and gradient scatters (FSDP2)
            ag, agrs = shard_comm(prof, cluster, opts, c.dp, tp, pp, "full")
            pf = float(sharded_stage(pf, ag, max(prof.layers // pp, 1)))
            pb = float(sharded_stage(pb, agrs, max(prof.layers // pp, 1))) if not prof.frozen else 0.0
        elif not prof.frozen and c.dp > 1:
            gb = grad_bytes_per_device(prof, opts, tp, pp, "none")
            ar = float(compact_dp_allreduce(cluster, gb, c.dp, tp, pp))
            grads += float(exposed_allreduce(ar, pb, gb, opts))
        ppc = max(ppc, float(pp_comm(prof, cluster, opts, u_mb, pp, tp * pp > cluster.devices_per_node)))
        f, b = f + pf, b + pb
        shard = c.shard if c.dp > 1 else "none"
        opt += optimizer_time(prof, cluster, opts, tp, pp, shard, c.dp)
        mm = memory_per_device(prof, opts, sched, u_mb, m, u_rep, tp, pp, 0.0, shard, c.dp)
        mem += float(mm["total"])
    f, b = max(f, ppc), max(b, ppc) if b else 0.0
    if mem > cluster.device.memory * opts.memory_margin:
        return None
    fill = c.pp - 1  # GPipe: all forwards, then all backwards
    return ModuleCost(c, f, b, (m + fill) * f, (m + fill) * b, grads, opt, mem, rows, ppc)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def module_options(
    profs: VLMProfiles,
    module: str,
    devices: int,
    global_batch: int,
    cluster: Cluster,
    opts: CostOptions,
    shards: tuple[str, ...] = ("none", "full"),
    tps: tuple[int, ...] | None = None,
    pps: tuple[int, ...] | None = None,
) -> list[ModuleCost]:
    """Every choice of ``module`` on ``devices`` ranks that fits, priced (the partitioner's grid)."""
    prof = profs.vision if module == "image" else profs.llm
    dpn = cluster.devices_per_node
    tp_ok = tps or tuple(t for t in _divisors(dpn) if prof.heads % t == 0)
    # a frozen ViT is not cut into stages (the runtime refuses it: VisionProjector.pipeline_stages)
    pp_ok = pps or ((1,) if module == "image" and prof.frozen else tuple(p for p in _divisors(prof.layers) if p <= 16))
    out = []
    for tp in tp_ok:
        for pp in pp_ok:
            if devices % (tp * pp):
                continue
            for shard in shards:
                for recompute in (False, True) if not prof.frozen else (False,):
                    for m in MICROBATCHES:
                        if m < pp and pp > 1:
                            continue
                        c = ModuleChoice(module, devices, tp, pp, shard, recompute, m)
                        priced = price_module(profs, c, global_batch, cluster, opts)
                        if priced is not None:
                            out.append(priced)
    return out


def pipeline_estimate(e: ModuleCost, lm: ModuleCost, colocated: bool) -> float:
    """The balancer's closed form: colocated modules run one after the other; separate ones as a
    two-stage pipeline whose slower side sets the pace, plus one microbatch of the other to fill it."""
    tail = (
        max(e.grads + e.optimizer, lm.grads + lm.optimizer)
        if not colocated
        else e.grads + e.optimizer + lm.grads + lm.optimizer
    )
    if colocated:
        return e.fwd + lm.fwd + lm.bwd + e.bwd + tail
    fwd = max(e.fwd + lm.f, e.f + lm.fwd)
    bwd = max(lm.bwd + e.b, lm.b + e.bwd)
    return fwd + bwd + tail


# ---------------------------------------------------------------------- placement + replay
def _ranks(cluster: Cluster, e: ModuleChoice, lm: ModuleChoice, order: str) -> dict[str, list[int]] | None:
    """Consecutive ranks per module (``order``: which module's come first), or every rank for both
    when colocated; None when a tensor-parallel group would straddle two nodes."""
    N = e.devices if e.devices == lm.devices and order == "colocated" else e.devices + lm.devices
    if order == "colocated":
        ranks = {"image": list(range(N)), "llm": list(range(N))}
    else:
        first, second = (e, lm) if order == "image" else (lm, e)
        ranks = {first.module: list(range(first.devices)), second.module: list(range(first.devices, N))}
    dpn = cluster.devices_per_node
    for c in (e, lm):
        r = ranks[c.module]
        for i in range(0, len(r), c.tp):
            if len({x // dpn for x in r[i : i + c.tp]}) > 1:
                return None
    return ranks


def simulate_step(
    profs: VLMProfiles,
    e: ModuleCost,
    lm: ModuleCost,
    order: str,
    global_batch: int,
    cluster: Cluster,
    opts: CostOptions,
) -> tuple[float, Plan] | None:
    """A step's seconds by replaying the runtime's handoff lists of the laid-out plan (routes priced by
    their bytes over their link, pipeline sends by the stage boundary), and the plan; None when the
    layout puts a tensor-parallel group across nodes."""
    ranks = _ranks(cluster, e.choice, lm.choice, order)
    if ranks is None:
        return None
    world = len(set(ranks["image"]) | set(ranks["llm"]))
    towers = {}
    for mc in (e, lm):
        c = mc.choice
        towers[c.module] = TowerPlan(
            ranks=ranks[c.module],
            tp=c.tp,
            pp=c.pp,
            microbatch=math.ceil(mc.rows / min(c.microbatches, mc.rows)),
            shard=c.shard if c.shard in ("none", "full") else "none",  # (the distributed optimizer: priced only)
            recompute=c.recompute,
        )
    plan = Plan(world, towers, global_batch)
    trains = {"image": True, "llm": not profs.workload.frozen_llm}
    lists = handoff_schedules(plan, {"llm": ["image"]}, ["image", "llm"], trains, global_batch)
    cost = {"image": e, "llm": lm}
    tpr, width, bel = profs.tokens_per_row, profs.width, opts.bytes_el
    tail = {r: 0.0 for r in range(world)}
    for mc in (e, lm):
        for r in ranks[mc.choice.module]:
            tail[r] += mc.grads + mc.optimizer

    def seconds(rank: int, ins: object) -> float:
        if isinstance(ins, (Forward, Backward)):
            mc = cost[ins.tower]
            per_row = (mc.f if isinstance(ins, Forward) else mc.b) / math.ceil(
                mc.rows / min(mc.choice.microbatches, mc.rows)
            )
            return per_row * ins.rows
        if isinstance(ins, GradSync):
            return tail[rank]
        if isinstance(ins, TokenLoss):
            return 0.0  # (the LM head and cross entropy are in the LLM profile's last block)
        return 0.0

    def link(ins: object) -> float:
        if isinstance(ins, (RecvTokens, RecvTokenGrads)):
            return route_seconds(ins.route, cluster, round(tpr), width, bel)
        if isinstance(ins, (Forward, Backward)):
            return cost[ins.tower].pp_link
        return 0.0

    last = {
        "llm": [
            r
            for i in range(plan.towers["llm"].dp)
            for r in plan.towers["llm"].replica_ranks(i)[(lm.choice.pp - 1) * lm.choice.tp :]
        ]
    }
    intervals = simulate_handoff(lists, seconds, link, last)
    return max(i.end for i in intervals) - min(i.start for i in intervals) + opts.step_overhead, plan


@dataclass
class VLMPick:
    """A priced plan: its kind (``separate``, ``colocated``, ``fsdp``, ``megatron``), each module's
    choice, the simulated step and the closed form, the samples per second, the plan."""

    kind: str
    image: ModuleChoice
    llm: ModuleChoice
    step: float
    estimate: float
    plan: Plan
    order: str = "colocated"
    memory: tuple[float, float] = (0.0, 0.0)

    @property
    def throughput(self) -> float:
        return self.plan.global_batch / self.step if self.plan.global_batch else 0.0

    def describe(self) -> str:
        where = "colocated" if self.order == "colocated" else f"separate ({self.order} first)"
        return f"image {self.image.label()}; llm {self.llm.label()}; {where}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "order": self.order,
            "image": asdict(self.image),
            "llm": asdict(self.llm),
            "step_seconds": self.step,
            "estimate_seconds": self.estimate,
            "plan": self.plan.to_dict(),
        }


def _finalists(
    pairs: list[tuple[float, ModuleCost, ModuleCost, str]], keep: int
) -> list[tuple[float, ModuleCost, ModuleCost, str]]:
    return sorted(pairs, key=lambda x: x[0])[:keep]


def _replay(
    kind: str, pairs: list, profs: VLMProfiles, global_batch: int, cluster: Cluster, opts: CostOptions
) -> VLMPick | None:
    best: VLMPick | None = None
    for est, e, lm, where in pairs:
        orders = ["colocated"] if where == "colocated" else ["image", "llm"]
        for order in orders:
            got = simulate_step(profs, e, lm, order, global_batch, cluster, opts)
            if got is None:
                continue
            step, plan = got
            if best is None or step < best.step:
                best = VLMPick(kind, e.choice, lm.choice, step, est, plan, order, (e.memory, lm.memory))
    return best


def _colocated_pairs(es: list[ModuleCost], ls: list[ModuleCost], limit: float, top: int = 40) -> list:
    es, ls = sorted(es, key=lambda c: c.alone)[:top], sorted(ls, key=lambda c: c.alone)[:top]
    return [
        (pipeline_estimate(e, lm, True), e, lm, "colocated") for e in es for lm in ls if e.memory + lm.memory <= limit
    ]


def vlm_plan(
    profs: VLMProfiles,
    cluster: Cluster,
    global_batch: int,
    opts: CostOptions | None = None,
    keep: int = 6,
) -> dict[str, VLMPick | None]:
    """The planner's pick and the baselines on ``cluster.world_size`` devices: ``distmm`` (the fastest
    of the separate and colocated plans with each module's own degrees and FSDP's), ``separate`` and ``colocated``
    (the best of each layout), ``fsdp`` and ``megatron`` (the best of each baseline's grid). Each is
    the fastest of its ``keep`` best closed forms, replayed."""
    opts = opts or CostOptions()
    N, limit = cluster.world_size, cluster.device.memory * opts.memory_margin
    by_n = {m: {} for m in MODULES}
    for n in range(1, N + 1):
        for m in MODULES:
            opts_n = module_options(profs, m, n, global_batch, cluster, opts)
            by_n[m][n] = sorted(opts_n, key=lambda c: c.alone)
    separate = [
        (pipeline_estimate(es[0], ls[0], False), es[0], ls[0], "separate")
        for n in range(1, N)
        if (es := by_n["image"][n]) and (ls := by_n["llm"][N - n])
    ]
    colocated = _colocated_pairs(by_n["image"][N], by_n["llm"][N], limit)
    out: dict[str, VLMPick | None] = {
        "separate": _replay("separate", _finalists(separate, keep), profs, global_batch, cluster, opts),
        "colocated": _replay("colocated", _finalists(colocated, keep), profs, global_batch, cluster, opts),
    }
    fsdp = _colocated_pairs(
        [c for c in by_n["image"][N] if c.choice.shard == "full" and c.choice.tp == 1],
        [c for c in by_n["llm"][N] if c.choice.shard == "full" and c.choice.tp == c.choice.pp == 1],
        limit,
    )
    out["fsdp"] = _replay("fsdp", _finalists(fsdp, keep), profs, global_batch, cluster, opts)
    uniform = []
    for t in (
        t for t in _divisors(cluster.devices_per_node) if profs.vision.heads % t == 0 and profs.llm.heads % t == 0
    ):
        es = module_options(profs, "image", N, global_batch, cluster, opts, ("none", "optimizer"), (t,))
        ls = module_options(profs, "llm", N, global_batch, cluster, opts, ("none", "optimizer"), (t,))
        same = lambda e, lm: e.shard == lm.shard and (e.pp == lm.pp or profs.vision.frozen)  # noqa: E731
        uniform += [p for p in _colocated_pairs(es, ls, limit, top=200) if same(p[1].choice, p[2].choice)]
    out["megatron"] = _replay("megatron", _finalists(uniform, keep), profs, global_batch, cluster, opts)
    # the pick: the fastest plan the runtime runs (FSDP's is one of them; Megatron's distributed
    # optimizer is priced only); ``kind`` says which search found it
    mine = [p for p in (out["separate"], out["colocated"], out["fsdp"]) if p is not None]
    out["distmm"] = min(mine, key=lambda p: p.step) if mine else None
    return out


__all__ = [
    "MODULES",
    "ModuleChoice",
    "ModuleCost",
    "VLMPick",
    "price_module",
    "module_options",
    "pipeline_estimate",
    "simulate_step",
    "vlm_plan",
]
