"""Plans drawn at random from the schema's whole space, and what each one does.

Every plan the schema accepts must either train exactly like one process or be refused at
validation (``Plan`` itself, or the module checks the strategy runs before building any process
group), on every rank, with a message that names the key. :func:`draw_plan` draws the plain data
of a plan (towers separate, colocated or overlapping; dp, tp, pp, cp, sp, every shard, microbatch,
schedule, recompute, uneven replica batches; 2-4 ranks) for the two model kinds: ``clip`` (two
towers meeting at a contrastive loss) and ``vlm`` (a vision encoder feeding a language model).
"""

from __future__ import annotations

import random
from typing import Any

from lightning_distmm.core.plan_schema import SCHEDULES, SHARDS

KINDS = ("clip", "vlm")
TOWERS = {"clip": ("image", "text"), "vlm": ("image", "llm")}
#: the global batch each kind trains with in the plan-space runs
BATCH = {"clip": 8, "vlm": 6}


def _degrees(rng: random.Random) -> dict[str, int]:
    return {"tp": rng.choice((1, 1, 2)), "pp": rng.choice((1, 1, 2)), "cp": rng.choice((1, 1, 1, 2))}


def _ranks_for(rng: random.Random, world: int, width: int, pool: list[int]) -> list[int]:
    """A multiple of ``width`` ranks (a whole number of replicas), from ``pool`` when it is big enough."""
    counts = [n for n in range(width, world + 1, width)]
    if not counts:
        return []
    n = rng.choice(counts)
    source = pool if len(pool) >= n else list(range(world))
    return sorted(rng.sample(source, n))


def draw_plan(rng: random.Random, kind: str) -> dict[str, Any]:
    """The plain data of one plan for ``kind`` (it may or may not validate)."""
    world = rng.choice((2, 3, 4))
    names = TOWERS[kind]
    layout = rng.choice(("separate", "colocated", "overlap"))
    schedule = rng.choice(SCHEDULES)
    batch = BATCH[kind]
    towers: dict[str, dict[str, Any]] = {}
    everyone = list(range(world))
    taken: list[int] = []
    for i, name in enumerate(names):
        deg = _degrees(rng)
        width = deg["tp"] * deg["pp"] * deg["cp"]
        if width > world:
            deg = {"tp": 1, "pp": 1, "cp": 1}
            width = 1
        if layout == "colocated":
            ranks = everyone if world % width == 0 else _ranks_for(rng, world, width, everyone)
        elif layout == "separate":
            rest = [r for r in everyone if r not in taken]
            if i == len(names) - 1:
                ranks = rest if len(rest) % width == 0 and rest else _ranks_for(rng, world, width, rest)
            else:
                keep = max(1, world - 1)  # leave a rank for the next tower
                ranks = _ranks_for(rng, keep, width, everyone[:keep])
        else:
            ranks = _ranks_for(rng, world, width, everyone)
        if not ranks:
            ranks = [rng.randrange(world)]
        taken.extend(ranks)
        tower: dict[str, Any] = {"ranks": ranks, **{k: v for k, v in deg.items() if v > 1}}
        if deg["tp"] > 1 and rng.random() < 0.3:
            tower["sp"] = True
        shard = rng.choice(SHARDS)
        if shard != "none":
            tower["shard"] = shard
        if rng.random() < 0.4:
            tower["microbatch"] = rng.choice((1, 2, 3))
        if schedule != "gpipe":
            tower["schedule"] = schedule
        if rng.random() < 0.15:
            tower["recompute"] = True
        dp = len(ranks) // width if len(ranks) % width == 0 else 0
        if dp > 1 and rng.random() < 0.3:
            cuts = sorted(rng.sample(range(1, batch), dp - 1))
            tower["replica_batch"] = [b - a for a, b in zip([0, *cuts], [*cuts, batch])]
        towers[name] = tower
    # every rank must hold a tower: give idle ranks to the last tower when that keeps whole replicas
    idle = [r for r in everyone if r not in taken]
    if idle:
        last = towers[names[-1]]
        width = last.get("tp", 1) * last.get("pp", 1) * last.get("cp", 1)
        if len(idle) % width == 0:
            last["ranks"] = sorted(set(last["ranks"]) | set(idle))
            last.pop("replica_batch", None)
    data: dict[str, Any] = {"world_size": world, "towers": towers}
    if any("replica_batch" in t for t in towers.values()):
        data["global_batch"] = batch
    return data
