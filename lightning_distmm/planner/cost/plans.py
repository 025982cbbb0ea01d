"""Plans as the cost model sees them and back: a priced plan (:class:`Evaluated`), the runtime's
:class:`Plan` for it (:func:`to_plan`), and any runtime plan's per-tower choices and ranks
(:func:`plan_choices`), so that a plan written is the plan priced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_distmm.core.plan import Plan, TowerPlan
from lightning_distmm.planner.cost.breakdown import StepCost, TowerChoice
from lightning_distmm.planner.cost.options import PLANNABLE_SHARDS
from lightning_distmm.planner.cost.pipeline import RECOMPUTE, cost_schedule, runtime_schedule


@dataclass
class Evaluated:
    """A complete priced plan: per-tower choices, ranks and the step cost."""

    name: str
    choices: dict[str, TowerChoice]
    ranks: dict[str, list[int]]
    cost: StepCost

    @property
    def step_time(self) -> float:
        return self.cost.step_time


def to_plan(ev: Evaluated, world: int, global_batch: int) -> Plan:
    """The runtime's :class:`Plan` for a priced plan: every field the cost model priced (ranks,
    replica batches, tp, pp, microbatch, schedule and recomputation, sharding), so that
    :func:`plan_choices` gives the same choices back."""
    return Plan(
        world_size=world,
        towers={n: tower_plan(ch, ev.ranks[n]) for n, ch in ev.choices.items()},
        global_batch=global_batch,
    )


def tower_plan(choice: TowerChoice, ranks: Sequence[int]) -> TowerPlan:
    """A priced tower choice as the runtime's :class:`TowerPlan` (the inverse of :func:`tower_choice`)."""
    if choice.shard not in PLANNABLE_SHARDS:
        raise ValueError(
            f"tower {choice.name!r}: shard {choice.shard!r} is priced for a baseline but the runtime does not run"
            f" it; a plan holds {', '.join(PLANNABLE_SHARDS)}"
        )
    schedule, recompute = runtime_schedule(choice.schedule)
    if recompute and choice.recompute_layers is not None:  # the first N blocks of each stage
        recompute = int(choice.recompute_layers)
    return TowerPlan(
        ranks=list(ranks),
        replica_batch=list(choice.replica_batch),
        tp=choice.tp,
        pp=choice.pp,
        microbatch=choice.microbatch,
        schedule=schedule,
        recompute=recompute,
        shard=choice.shard,
        cp=choice.cp,
        sp=choice.sp,
    )


def tower_choice(name: str, tower: TowerPlan, global_batch: int) -> TowerChoice:
    """The cost model's view of one runtime :class:`TowerPlan` (the inverse of :func:`tower_plan`)."""
    if tower.shard not in PLANNABLE_SHARDS:
        raise ValueError(
            f"tower {name!r}: shard {tower.shard!r} runs but the cost model does not price it yet"
            f" (it prices {', '.join(PLANNABLE_SHARDS)})"
        )
    rb = tuple(tower.split(int(global_batch)))
    mb = min(tower.microbatch, max(rb)) if tower.microbatch else max(rb)
    schedule = cost_schedule(tower.schedule, bool(tower.recompute))
    # ``recompute: N``: the first N blocks of each stage (partial); ``true``: every block
    layers = None if isinstance(tower.recompute, bool) or schedule != RECOMPUTE else int(tower.recompute)
    return TowerChoice(
        name,
        len(tower.ranks),
        tower.tp,
        tower.pp,
        mb,
        schedule,
        rb,
        tower.shard,
        cp=tower.cp,
        sp=tower.sp,
        recompute_layers=layers,
    )


def plan_choices(plan: Plan, global_batch: int | None = None) -> tuple[dict[str, TowerChoice], dict[str, list[int]]]:
    """The cost model's view of a runtime :class:`Plan`: per tower its :class:`TowerChoice` and ranks."""
    G = global_batch if global_batch is not None else plan.global_batch
    if G is None:
        raise ValueError("plan_choices needs the global batch (the plan has none)")
    choices = {name: tower_choice(name, t, int(G)) for name, t in plan.towers.items()}
    return choices, {name: list(t.ranks) for name, t in plan.towers.items()}


__all__ = ["Evaluated", "to_plan", "tower_plan", "tower_choice", "plan_choices"]
