"""The planner's report: what it decided and why, as a table, a dict (``plan_report.yaml``) and a
timeline of one predicted step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_distmm.core.plan import Plan
from lightning_distmm.planner.cost.plans import Evaluated
from lightning_distmm.planner.machine.cluster import GB, Cluster
from lightning_distmm.planner.options import PlannerOptions
from lightning_distmm.planner.profiles.profile import TowerProfile
from lightning_distmm.planner.search.balance import Balance
from lightning_distmm.planner.search.baselines import BASELINES, LABELS


@dataclass
class Report:
    """What the planner decided and why: the chosen plan's costs, the baselines, the solve time."""

    model: str
    cluster: Cluster
    global_batch: int
    plan: Plan
    chosen: Evaluated
    candidates: dict[str, Evaluated | None]
    baselines: dict[str, Evaluated | None]
    profiles: dict[str, TowerProfile]
    solve_time: float
    options: PlannerOptions
    balance: Balance | None = None
    placement_scores: dict[str, float] = field(default_factory=dict)
    #: what ``planner.sequence`` changed (planner.search.sequence.refine_sequence), one line per tower
    sequence_notes: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return self.chosen.step_time

    def timeline(self, max_ranks: int = 64) -> list[Any]:
        """The chosen plan's step, every rank's instruction list simulated with the cost model's
        durations (:func:`lightning_distmm.planner.cost.simulate.simulate`); draw it with ``timeline_svg``."""
        from lightning_distmm.core.schedule import schedules
        from lightning_distmm.planner.cost import instruction_seconds
        from lightning_distmm.planner.cost.simulate import simulate

        world = self.plan.world_size
        if world > max_ranks:
            raise ValueError(f"the plan has {world} ranks; a timeline draws at most {max_ranks} (max_ranks=)")
        nodes = len({r // self.cluster.devices_per_node for r in range(world)})
        seconds, transfer = instruction_seconds(
            self.profiles, self.cluster, self.options.cost, self.chosen.choices, self.global_batch, world, nodes
        )
        return simulate(schedules(self.plan, self.global_batch), seconds, transfer)

    def model_flops(self) -> float:
        """Model FLOPs of one step: every tower's forward GEMM and attention FLOPs per sample, times
        three when it trains (forward, input and weight gradients; recomputation not counted), times
        the global batch (the MFU convention of Korthikanti et al. 2022 and MosaicML's benchmarks)."""
        return sum(p.train_flops_per_sample() for p in self.profiles.values()) * self.global_batch

    @property
    def mfu(self) -> float:
        """Predicted model FLOPs utilisation of the chosen plan: model FLOPs of a step over the
        step time, the device count and the device's datasheet peak."""
        cl = self.cluster
        return self.model_flops() / (self.step_time * cl.world_size * cl.device.peak_flops)

    def memory_per_rank(self, ev: Evaluated | None = None) -> float:
        """Bytes on the fullest device of ``ev`` (the chosen plan by default): every tower's busiest
        stage, summed where towers share devices."""
        ev = ev or self.chosen
        if "peak_memory" in ev.cost.extra:
            return float(ev.cost.extra["peak_memory"])
        return max(t.memory.get("total_device", t.memory["total"]) for t in ev.cost.towers.values())

    def picked_baseline(self) -> str | None:
        """The baseline whose own plan the planner picked (its speedup over it is 1.00x by
        construction, no DistMM gain), or None when the pick is one of DistMM's plans. A colocated
        plan DistMM found itself counts as the baseline's when it is the same plan (same choices and
        ranks per tower), as FSDP's is whenever every tower takes pure sharded data parallelism."""
        if self.chosen.name in self.baselines:
            return self.chosen.name
        for k, b in self.baselines.items():
            if b is not None and b.choices == self.chosen.choices and b.ranks == self.chosen.ranks:
                return k
        return None

    def pick_label(self) -> str:
        """What the planner picked, in a few words: ``separate`` or ``colocated`` DistMM plan, or
        ``= fsdp`` (a baseline's own plan, which DistMM's options include)."""
        k = self.picked_baseline()
        return f"= {k} ({describe(self.chosen)})" if k else f"DistMM {self.chosen.name} ({describe(self.chosen)})"

    def best_baseline(self) -> Evaluated | None:
        """The fastest baseline plan that fits, if any."""
        fits = [b for b in self.baselines.values() if b is not None]
        return min(fits, key=lambda b: b.step_time) if fits else None

    def speedup(self, baseline: str) -> float | None:
        b = self.baselines.get(baseline)
        return None if b is None else b.step_time / self.step_time

    # ------------------------------------------------------------------ printing
    def table(self) -> str:
        c = self.chosen
        head = (
            "tower",
            "params",
            "devices",
            "dp/tp/pp",
            "replica batch",
            "micro x K",
            "schedule",
            "compute",
            "comm",
            "bubble",
            "mem/dev",
            "intra",
            "inter",
        )
        rows = []
        for name, ch in c.choices.items():
            tc = c.cost.towers[name]
            rb = ch.replica_batch
            batch = f"{rb[0]}" if len(set(rb)) == 1 else f"{max(rb)}/{min(rb)}"
            batch += f" x{len(rb)}" if len(rb) > 1 else ""
            rows.append(
                (
                    name,
                    _count(self.profiles[name].params) + (" frozen" if self.profiles[name].frozen else ""),
                    str(ch.n),
                    f"{ch.dp}/{ch.tp}/{ch.pp}" + (f" cp{ch.cp}" if ch.cp > 1 else "") + (" +sp" if ch.sp else ""),
                    batch,
                    f"{ch.microbatch} x{ch.K}",
                    ch.schedule,
                    _ms(tc.compute),
                    _ms(tc.comm),
                    _ms(tc.bubble),
                    f"{tc.memory.get('total_device', tc.memory['total']) / GB:.1f} GB",
                    f"{tc.bytes_intra / GB:.2f} GB",
                    f"{tc.bytes_inter / GB:.2f} GB",
                )
            )
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        cl = self.cluster
        lines = [
            f"DistMM plan: model {self.model}, cluster {cl.name} ({cl.nodes} x {cl.devices_per_node} {cl.device.name}),"
            f" global batch {self.global_batch}, layout {c.cost.layout}"
            + (f" (= {self.picked_baseline()}'s own plan: no gain over it)" if self.picked_baseline() else ""),
            fmt.format(*head),
            *(fmt.format(*r) for r in rows),
            f"batch sync (feature all-gather, loss, gradient scatter): {_ms(c.cost.sync['total'])}",
            f"predicted step time: {_ms(self.step_time)}  ({self.global_batch / self.step_time:,.0f} samples/s,"
            f" MFU {self.mfu:.1%})",
            *(f"sequence: {note}" for note in self.sequence_notes),
        ]
        for name in BASELINES:
            if name not in self.baselines:
                continue
            b = self.baselines[name]
            if b is None:
                lines.append(f"  vs {LABELS[name]}: no configuration fits")
            else:
                outside = sorted({ch.shard for ch in b.choices.values()} - set(self.options.shards))
                why = f" (its sharding {outside} is not in planner.shards)" if outside else ""
                lines.append(
                    f"  vs {LABELS[name]}: {_ms(b.step_time)} ({describe(b)}) -> speedup"
                    f" {b.step_time / self.step_time:.2f}x{why}"
                )
        best = self.best_baseline()
        for name, ev in self.candidates.items():
            if ev is not None and ev is not c:
                vs = f", {best.step_time / ev.step_time:.2f}x vs the best baseline" if best is not None else ""
                lines.append(f"  best {name} plan considered: {_ms(ev.step_time)}{vs}")
        lines.append(
            f"solve time: {self.solve_time * 1e3:.0f} ms"
            + ("" if self.balance is None or self.balance.exact else " (balancer sampled phi)")
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        def ev(e: Evaluated | None) -> dict[str, Any] | None:
            if e is None:
                return None
            return {
                "step_time": e.step_time,
                "layout": e.cost.layout,
                "towers": {
                    n: {
                        **dataclasses.asdict(ch),
                        "replica_batch": list(ch.replica_batch),
                        **_tower_cost(e.cost.towers[n]),
                    }
                    for n, ch in e.choices.items()
                },
                "sync": e.cost.sync,
            }

        return {
            "model": self.model,
            "cluster": self.cluster.name,
            "world_size": self.cluster.world_size,
            "global_batch": self.global_batch,
            "step_time": self.step_time,
            "samples_per_second": self.global_batch / self.step_time,
            "mfu": self.mfu,
            "memory_per_rank": self.memory_per_rank(),
            "solve_time": self.solve_time,
            "chosen": ev(self.chosen),
            "baselines": {k: ev(v) for k, v in self.baselines.items()},
            "speedup": {k: self.speedup(k) for k in self.baselines},
            "candidates": {k: (None if v is None else v.step_time) for k, v in self.candidates.items()},
            "options": {
                **{k: v for k, v in dataclasses.asdict(self.options).items() if k != "cost"},
                "cost": dataclasses.asdict(self.options.cost),
            },
            "profiles": {n: p.summary() for n, p in self.profiles.items()},
        }


ZERO_LABELS = {"optimizer": "zero1", "zero2": "zero2", "full": "zero3", "hybrid": "hsdp"}


def describe(ev: Evaluated) -> str:
    """A plan in one line: per tower its devices, tp/pp/dp, microbatch x count, schedule and sharding
    (towers with the same configuration merged)."""
    parts: dict[str, list[str]] = {}
    for name, ch in ev.choices.items():
        shard = "" if ch.shard == "none" else f" {ZERO_LABELS[ch.shard]}"
        sched = ch.schedule if ch.recompute_layers is None else f"{ch.schedule}({ch.recompute_layers}/stage)"
        key = f"{ch.n}dev tp{ch.tp} pp{ch.pp} dp{ch.dp} mb{ch.microbatch}x{ch.K} {sched}{shard}"
        parts.setdefault(key, []).append(name)
    return "; ".join(f"{'+'.join(names)}: {k}" for k, names in parts.items())


def _tower_cost(tc: Any) -> dict[str, Any]:
    d = dataclasses.asdict(tc)
    d.pop("name", None)
    return d


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:,.0f}M" if n >= 1e6 else f"{n / 1e3:,.0f}K"


def _ms(t: float) -> str:
    return f"{t * 1e3:,.1f} ms" if t < 100 else f"{t:,.2f} s"


__all__ = ["Report", "describe"]
