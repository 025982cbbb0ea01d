"""The VLM planner's partitioner (docs/vlm.md, "Presets and the planner"): one module's choice
(devices, tp, pp, shard, recompute, microbatches) priced per microbatch from its profiles by the cost
model's own pieces, the grid of choices that fit device memory, and the balancer's closed form of
two modules. :mod:`.search` lays the best out and replays them through the runtime's lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_distmm.core.tower_plan import split_batch
from lightning_distmm.planner.cost.comm import (
    compact_dp_allreduce,
    exposed_allreduce,
    pp_comm,
    shard_comm,
    sharded_stage,
    tp_comm,
)
from lightning_distmm.planner.cost.compute import optimizer_time, stage_compute
from lightning_distmm.planner.cost.memory import grad_bytes_per_device, memory_per_device
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.pipeline import RECOMPUTE
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.vlm.profile import VLMProfiles, straggler

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

    def runnable(self, global_batch: int) -> bool:
        """Whether the runtime runs this choice: a sharded module's replicas meet in FSDP's collectives
        once per microbatch, so each must run as many microbatches (the plan's refusal otherwise:
        :meth:`lightning_distmm.core.plan.Plan.check_sharded_microbatches`)."""
        if self.shard != "full" or self.dp == 1:
            return True
        split = split_batch(global_batch, None, self.dp)
        size = math.ceil(max(split) / min(self.microbatches, max(split)))
        return len({math.ceil(rows / size) for rows in split}) == 1

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
    w, tpi = profs.workload, profs.tokens_per_image
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
            pf = float(sharded_stage(pf, ag, max(prof.layers // pp, 1), opts.overlap_grad_sync))
            pb = (
                float(sharded_stage(pb, agrs, max(prof.layers // pp, 1), opts.overlap_grad_sync))
                if not prof.frozen
                else 0.0
            )
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
    """Every choice of ``module`` on ``devices`` ranks that the runtime runs and that fits, priced (the
    partitioner's grid)."""
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
                        if not c.runnable(global_batch):
                            continue
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


__all__ = [
    "MODULES",
    "MICROBATCHES",
    "ModuleChoice",
    "ModuleCost",
    "price_module",
    "module_options",
    "pipeline_estimate",
]
