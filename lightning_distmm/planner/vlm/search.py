"""The planner for a vision encoder feeding a language model (docs/vlm.md, "The planner").

Why its own search: the contrastive planner (:mod:`lightning_distmm.planner.search`) balances towers that meet at a
batch-sync; here the LLM consumes the encoder's tokens row by row, so the step is a two-module
pipeline (the encoder's microbatches stream into the LLM's) whose makespan the runtime's own lists
give (:func:`lightning_distmm.core.handoff_schedule.simulate_handoff`).

* **partitioner** (:func:`module_options`): every (tp, pp, shard, recompute, microbatches) of one
  module on ``n`` devices, priced per microbatch from its profile (:mod:`.profile`; the images
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

from lightning_distmm.core.handoff_schedule import RecvTokenGrads, RecvTokens, TokenLoss, handoff_schedules
from lightning_distmm.core.plan import Plan, TowerPlan
from lightning_distmm.core.schedule import Backward, Forward, GradSync
from lightning_distmm.planner.cost.handoff import route_seconds
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.simulate import simulate_handoff
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.vlm.partition import (
    MODULES,
    ModuleChoice,
    ModuleCost,
    _divisors,
    module_options,
    pipeline_estimate,
    price_module,
)
from lightning_distmm.planner.vlm.profile import VLMProfiles


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
