"""Preparing a rank for a plan: keep only what it runs, cut its pipelines, shard it (tensor parallelism, FSDP).

Applied to the user's plain module from outside (torchtitan's ``parallelize`` style), once, before
the optimizer sees the parameters: towers this rank does not run go to the meta device, a
pipelined tower keeps only this rank's stage, a tower with ``tp > 1`` is sharded over its
tensor-parallel mesh, a tower with ``compile: true`` has its blocks compiled, a tower with ``recompute`` its blocks
recomputed in the backward, and a tower with ``shard: full | hybrid | zero2`` is wrapped with FSDP2 over its
data-parallel mesh (a pipelined one stage by stage, over the stage's replicas). Whether the plan can
be applied to the module at all was checked on every rank before any group was built
(:func:`lightning_distmm.parallel.plan_checks.check_plan_runs`).
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable, Mapping

import torch
from torch import nn

from lightning_distmm.core.layout import RankLayout
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import stage_neighbours
from lightning_distmm.parallel import deferred
from lightning_distmm.parallel.compile import compile_tower
from lightning_distmm.parallel.families import apply_cp, apply_sp, apply_tp, tower_stages
from lightning_distmm.parallel.fsdp import apply_fsdp
from lightning_distmm.parallel.groups import TowerGroups
from lightning_distmm.parallel.pipeline import Stage, owned_names, release_unowned
from lightning_distmm.parallel.recompute import recompute_blocks
from lightning_distmm.tower import Tower


def prepare_rank(
    plan: Plan, towers: Mapping[str, Tower], layout: RankLayout, groups: Mapping[str, TowerGroups], rank: int
) -> dict[str, Stage]:
    """Release remote towers, cut pipelines, shard for TP, then for FSDP; return this rank's stage of
    each pipelined tower.

    Each step may swap in new Parameter objects (``Module.to("meta")``, DTensor sharding): the
    caller builds its parameter table afterwards (an older one would keep the released storages
    alive) and then calls :func:`return_freed_memory`.
    """
    release_remote_towers(towers, layout)
    stages = cut_pipelines(plan, towers, layout, rank)
    parallelize_local_towers(plan, towers, layout, groups, stages)
    recompute_local_towers(plan, towers, layout, stages)
    compile_local_towers(plan, towers, layout, stages)
    return shard_local_towers(plan, towers, layout, groups, stages)


def release_remote_towers(towers: Mapping[str, Tower], layout: RankLayout) -> None:
    """Move the parameters of towers this rank does not run to the meta device."""
    for name, tower in towers.items():
        if name not in layout.local_towers:
            tower.module.to("meta")


def cut_pipelines(plan: Plan, towers: Mapping[str, Tower], layout: RankLayout, rank: int) -> dict[str, Stage]:
    """For towers with pp > 1: keep only this rank's stage of the tower, release the rest."""
    stages: dict[str, Stage] = {}
    for name in layout.local_towers:
        tower = plan.towers[name]
        if tower.pp == 1:
            continue
        stage = stage_neighbours(plan, name, rank)[1]
        stages[name] = tower_stages(towers[name].module, tower.pp, towers[name].fields)[stage]
        release_unowned(towers[name].module, stages[name])
    return stages


def _stage_holds(stage: Stage | None) -> Callable[[nn.Module], bool]:
    """Whether a block belongs to this rank's ``stage`` of a pipelined tower (every block without one)."""
    if stage is None:
        return lambda block: True
    mine = {id(m) for top in stage.modules for m in top.modules()}
    return lambda block: id(block) in mine


def compile_local_towers(
    plan: Plan, towers: Mapping[str, Tower], layout: RankLayout, stages: Mapping[str, Stage] | None = None
) -> None:
    """Compile the blocks this rank runs of the local towers whose plan says ``compile: true`` (after
    tensor, sequence and context parallelism and recomputation, before FSDP2, as torchtitan orders them)."""
    for name in layout.local_towers:
        if plan.towers[name].compile:
            stage = (stages or {}).get(name)
            compile_tower(name, towers[name].module, _stage_holds(stage), pipelined=stage is not None)


def recompute_local_towers(
    plan: Plan, towers: Mapping[str, Tower], layout: RankLayout, stages: Mapping[str, Stage] | None = None
) -> None:
    """Recompute the blocks of the local towers whose plan says ``recompute: true`` (every block this
    rank runs) or ``recompute: N`` (the first N of its stage), before compilation (torch.compile then
    traces the checkpoint, torchtitan's order: a compiled function must not run inside a
    checkpoint's recomputation, where dynamo is disabled) and before FSDP2."""
    for name in layout.local_towers:
        count = plan.towers[name].recompute
        if count:  # true, or a positive number of blocks
            stage = (stages or {}).get(name)
            recompute_blocks(towers[name].module, count, _stage_holds(stage), pipelined=stage is not None)


def parallelize_local_towers(
    plan: Plan,
    towers: Mapping[str, Tower],
    layout: RankLayout,
    groups: Mapping[str, TowerGroups],
    stages: Mapping[str, Stage] | None = None,
) -> None:
    """Shard the local towers that the plan gives tensor parallelism (tp > 1) over their tp mesh (a
    pipelined tower: its stage's blocks), then split the sequence of those with context parallelism
    (cp > 1) over their cp ranks."""
    for name in layout.local_towers:
        tower = plan.towers[name]
        if tower.tp > 1:
            held = _stage_holds((stages or {}).get(name))
            apply_tp(towers[name].module, groups[name].mesh["tp"], held, tower.sp)
            if tower.sp:
                apply_sp(towers[name].module, groups[name].mesh["tp"], held)
        if tower.cp > 1:
            mesh = groups[name].mesh
            apply_cp(towers[name].module, mesh.get_group("cp"), tower.cp, mesh.get_local_rank("cp"), tower.pp, name)


def shard_local_towers(
    plan: Plan,
    towers: Mapping[str, Tower],
    layout: RankLayout,
    groups: Mapping[str, TowerGroups],
    stages: Mapping[str, Stage] | None = None,
) -> dict[str, Stage]:
    """Shard the local towers whose plan says ``shard: full | hybrid | zero2`` over their data-parallel mesh
    (FSDP2, after tensor parallelism so that the two compose as 2-D); return ``stages`` with each
    sharded pipeline stage run through its FSDP stage module."""
    out = dict(stages or {})
    for name in layout.local_towers:
        mesh = groups[name].shard_mesh
        if plan.towers[name].sharded and mesh is not None:
            stage = out.get(name)
            zero2 = plan.towers[name].shard == "zero2"
            root = apply_fsdp(towers[name].module, mesh, groups[name].mp_policy, stage, reshard_after_forward=not zero2)
            if stage is not None:
                out[name] = Stage(stage.modules, root, stage.extra)
    return out


def held_names(
    module: nn.Module, towers: Mapping[str, Tower], layout: RankLayout, stages: Mapping[str, Stage]
) -> Callable[[str], bool]:
    """Whether this rank holds the parameter or buffer of ``module`` with a given name: those of its
    local towers (of a pipelined tower, its stage's) and every tensor outside the towers."""
    prefixes = tower_prefixes(module, towers)
    owned = {
        name: {f"{prefixes[name]}.{n}" if prefixes[name] else n for n in owned_names(towers[name].module, stage)}
        for name, stage in stages.items()
    }

    def held(fqn: str) -> bool:
        for name, prefix in prefixes.items():
            if not prefix or fqn.startswith(prefix + "."):
                return name in layout.local_towers and (name not in owned or fqn in owned[name])
        return True

    return held


def check_held_tensors(module: nn.Module, held: Callable[[str], bool]) -> None:
    """Raise if a tensor this rank runs is still on the meta device (built on meta without a recording
    of its initialisation to materialise it from)."""
    missing = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta and held(n)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"{shown}: on the meta device with nothing to materialise it from; build the module as usual, or"
            " under trainer.init_module(empty_init=True) (distmm records the initialisation and each rank"
            " materialises its share)"
        )


def tower_prefixes(module: nn.Module, towers: Mapping[str, Tower]) -> dict[str, str]:
    """Each tower's submodule path inside ``module`` (found by identity), e.g. ``{"image": "visual"}``."""
    prefixes: dict[str, str] = {}
    for fqn, sub in module.named_modules():
        for name, tower in towers.items():
            if sub is tower.module and name not in prefixes:
                prefixes[name] = fqn
    missing = [n for n in towers if n not in prefixes]
    if missing:
        raise ValueError(f"tower(s) {missing}: the Tower's module is not a submodule of {type(module).__name__}")
    return prefixes


def tower_parameters(
    module: nn.Module, towers: Mapping[str, Tower]
) -> tuple[dict[str, dict[str, nn.Parameter]], dict[str, nn.Parameter]]:
    """Split ``module``'s parameters by tower (by module identity); the rest are interaction parameters."""
    prefixes = tower_prefixes(module, towers)
    per_tower: dict[str, dict[str, nn.Parameter]] = {n: {} for n in towers}
    rest: dict[str, nn.Parameter] = {}
    owner_of: dict[int, str] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        owners = [n for n, pre in prefixes.items() if fqn.startswith(pre + ".")]
        if len(owners) > 1:
            raise ValueError(f"parameter {fqn!r} lies in several towers {owners}; towers must not nest")
        if owners:
            if owner_of.setdefault(id(p), owners[0]) != owners[0]:
                raise ValueError(f"parameter {fqn!r} is shared between towers {owner_of[id(p)]!r} and {owners[0]!r}")
            per_tower[owners[0]][fqn] = p
        elif id(p) not in owner_of:
            rest[fqn] = p
    return per_tower, rest


def return_freed_memory() -> None:
    """Hand freed host memory back to the OS.

    glibc keeps freed blocks below its (adaptive) mmap threshold in the heap, so releasing a
    tower would not lower the resident set size; ``malloc_trim`` returns those pages. Device
    memory freed by the caching allocator is returned with ``empty_cache``.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prepare_local_towers(
    module: nn.Module,
    plan: Plan,
    towers: Mapping[str, Tower],
    layout: RankLayout,
    groups: Mapping[str, TowerGroups],
    device: torch.device,
    values_from_checkpoint: bool = False,
) -> dict[str, Stage]:
    """Keep only what this rank runs (:func:`prepare_rank`) and hand the freed memory back; return
    this rank's pipeline stages.

    A module built on the meta device under :func:`~lightning_distmm.parallel.deferred.deferred_init`
    is prepared on meta, then each rank materialises what it holds (a sharded tower's shards only)
    with the values the construction would have given them. ``values_from_checkpoint``: the
    module's meta tensors are allocated uninitialised instead (a checkpoint load sets them next)."""
    refs = deferred.tensor_refs(module)  # by name: sharding replaces tensors
    stages = prepare_rank(plan, towers, layout, groups, layout.rank)
    held = held_names(module, towers, layout, stages)
    if refs:
        deferred.materialize(module, refs, device, held)
        deferred.release(refs)
    if values_from_checkpoint:
        deferred.allocate(module, device, held)
    check_held_tensors(module, held)
    return_freed_memory()
    return stages
