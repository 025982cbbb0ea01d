"""The plan against the module: every rule that needs the towers themselves, checked before any group exists.

:class:`lightning_distmm.core.plan.Plan` refuses what the plan alone decides. What it cannot know
is the towers: whether a tower's head count divides by ``tp`` (and by ``cp * tp``), whether a tower
of its kind can be cut into ``pp`` stages, split along its sequence (``cp``) or run sequence
parallelism (``sp``), and whether a model whose towers feed each other can run the plan's schedule.
:func:`check_plan_runs` asks each of these of the module's structure alone (a module on the meta
device is fine), on every rank, before the strategy builds any process group: every rank refuses
the same plan with the same :class:`~lightning_distmm.core.plan_schema.PlanError`, which names
the plan key, and nothing is left half-built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from lightning_distmm.core.handoff_schedule import check_handoff_plan
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.plan_schema import PlanError
from lightning_distmm.parallel.families import check_cp, check_sp, check_tp, tower_stages
from lightning_distmm.parallel.fsdp import transformer_blocks
from lightning_distmm.tower import Tower


def _refuse_as(key: str, check: Callable[[], object], prefix: str = "") -> None:
    """Run ``check``; its ValueError becomes a PlanError about plan key ``key``."""
    try:
        check()
    except PlanError:
        raise
    except ValueError as err:
        raise PlanError(f"{prefix}{err}", key) from None


def check_plan_runs(plan: Plan, towers: Mapping[str, Tower]) -> None:
    """Raise a :class:`PlanError` naming the key where ``plan`` cannot run ``towers`` (the module's
    ``tower_specs()``); the plan's own rules were checked when it was made. Pure: no process group,
    no data; every rank calls it with the same arguments and so fails alike."""
    consumes = {n: list(t.consumes) for n, t in towers.items() if t.consumes}
    if consumes:
        first = next(iter(plan.towers))
        _refuse_as(
            f"towers.{first}.schedule",
            lambda: check_handoff_plan(plan, consumes),
            f"tower {first!r}, schedule {plan.towers[first].schedule!r}: ",
        )
    for name, t in plan.towers.items():
        module = towers[name].module
        key = f"towers.{name}"
        if t.tp > 1:
            _refuse_as(f"{key}.tp", lambda: check_tp(module, t.tp, name))
        if t.cp > 1:
            _refuse_as(f"{key}.cp", lambda: check_cp(module, t.cp, t.tp, name, t.pp))
        if t.sp:
            _refuse_as(f"{key}.sp", lambda: check_sp(module, name, t.tp))
        if t.pp > 1:
            _refuse_as(
                f"{key}.pp", lambda: tower_stages(module, t.pp, towers[name].fields), f"tower {name!r}, pp={t.pp}: "
            )
        if t.recompute is not True and t.recompute:
            _refuse_as(f"{key}.recompute", lambda: _check_block_count(module, name, t.recompute, t.pp))


def _check_block_count(module: object, name: str, count: int, pp: int) -> None:
    """``recompute: N`` recomputes the first N blocks of each stage: every stage must have them."""
    blocks = len(transformer_blocks(module))
    if not blocks:
        raise ValueError(
            f"tower {name!r}: recompute: {count} counts transformer blocks, and the tower has none that distmm"
            " finds (timm blocks, transformers encoder.layers, open_clip resblocks); use recompute: true"
        )
    if count > blocks // pp:
        raise ValueError(
            f"tower {name!r}: recompute: {count} recomputes the first {count} blocks of each of its {pp} pipeline"
            f" stage(s), which hold {blocks // pp} at fewest ({blocks} blocks in all); use at most {blocks // pp},"
            " or true for every block"
        )


__all__ = ["check_plan_runs"]
