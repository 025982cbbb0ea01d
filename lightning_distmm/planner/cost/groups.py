"""A tower's ranks as the runtime lays them out: replicas, tensor-, context- and data-parallel
groups and pipeline boundaries (what the cost model prices traffic over), and whether the runtime's
HSDP mesh takes a layout."""

from __future__ import annotations

import functools
from collections.abc import Sequence


def hybrid_runs(replicas: Sequence[Sequence[int]], tp: int, devices_per_node: int) -> bool:
    """Whether the runtime's HSDP mesh takes these replicas (``parallel.groups.hybrid_rows``): the
    same number of replicas on every node they use, and no tensor parallelism across nodes."""
    counts: dict[int, int] = {}
    for r in replicas:
        counts[r[0] // devices_per_node] = counts.get(r[0] // devices_per_node, 0) + 1
    return len(set(counts.values())) <= 1 and (len(counts) <= 1 or tp == 1)


def rank_groups(ranks: Sequence[int], tp: int, pp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """A tower's ranks as its replicas, tensor-parallel groups, stage boundaries (pairs of
    neighbouring stages' first ranks), data-parallel groups (one per stage and tp rank: the replicas
    and their cp ranks, which sum gradients together) and context-parallel groups. A replica is
    ``pp`` stages of ``cp * tp`` ranks, tp innermost (as :class:`lightning_distmm.core.plan.TowerPlan`).
    Cached (the planner prices the same layouts many times): the lists are read-only."""
    return _rank_groups(tuple(ranks), tp, pp, cp)


@functools.lru_cache(maxsize=256)
def _rank_groups(ranks: tuple[int, ...], tp: int, pp: int, cp: int) -> dict[str, list[list[int]]]:
    st = cp * tp
    w = st * pp
    dp = len(ranks) // w
    replicas = [list(ranks[i * w : (i + 1) * w]) for i in range(dp)]
    tp_groups = [r[p * st + c * tp : p * st + (c + 1) * tp] for r in replicas for p in range(pp) for c in range(cp)]
    boundaries = [[r[p * st], r[(p + 1) * st]] for r in replicas for p in range(pp - 1)]
    dp_groups = [
        [replicas[i][p * st + c * tp + j] for i in range(dp) for c in range(cp)] for p in range(pp) for j in range(tp)
    ]
    cp_groups = [[r[p * st + c * tp + j] for c in range(cp)] for r in replicas for p in range(pp) for j in range(tp)]
    return {"replicas": replicas, "tp": tp_groups, "pp": boundaries, "dp": dp_groups, "cp": cp_groups}
