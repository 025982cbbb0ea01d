"""Placement manager: which physical devices (ranks) each tower group gets.

Bandwidth-aware (``hetero``): the unit of placement is a tensor-parallel group, which must stay
inside one node (it all-reduces twice per layer and microbatch). Candidate layouts:

1. *node-packed*: every tower first gets ``n // devices_per_node`` whole nodes (its replicas, its
   pipeline neighbours and most of its data-parallel group on NVLink), then the remainders share
   the leftover nodes, packed largest tensor-parallel group first (with power-of-two group sizes
   that never splits a group across nodes);
2. *contiguous*: towers one after the other in some order, kept only if no TP group straddles.

Each candidate, for every order of the towers, is priced by the full cost model
(:func:`lightning_distmm.planner.cost.evaluate_plan`, which knows which groups cross nodes and how
much each node's NIC carries) and the fastest is kept. Within a tower, ranks are listed
data-parallel outermost, then pipeline stage, then tensor-parallel rank, as :class:`Plan` expects.

``naive`` gives ranks contiguously in the towers' order without looking at nodes (a TP group may
straddle two nodes and then pays the inter-node link): the ablation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

from lightning_distmm.planner.machine.cluster import Cluster

Layout = dict[str, list[int]]


def _pack(
    order: Sequence[str], sizes: Mapping[str, int], tps: Mapping[str, int], cluster: Cluster, whole_nodes_first: bool
) -> Layout | None:
    dpn = cluster.devices_per_node
    D = cluster.world_size
    out: dict[str, list[int]] = {n: [] for n in order}
    cursor = 0
    if whole_nodes_first:
        for name in order:
            full = sizes[name] // dpn * dpn
            out[name].extend(range(cursor, cursor + full))
            cursor += full
        rest = sorted(order, key=lambda n: (-tps[n], list(order).index(n)))
        for name in rest:
            need = sizes[name] - len(out[name])
            out[name].extend(range(cursor, cursor + need))
            cursor += need
    else:
        for name in order:
            out[name].extend(range(cursor, cursor + sizes[name]))
            cursor += sizes[name]
    if cursor != D:
        return None
    return out


def tp_groups_inside_nodes(ranks: Sequence[int], tp: int, devices_per_node: int) -> bool:
    """True when every consecutive group of ``tp`` ranks (a TP group) lies in one node."""
    return all(len({r // devices_per_node for r in ranks[i : i + tp]}) == 1 for i in range(0, len(ranks), tp))


def candidate_layouts(
    sizes: Mapping[str, int], tps: Mapping[str, int], cluster: Cluster, max_orders: int = 24
) -> list[Layout]:
    """Distinct node-aware layouts whose TP groups all stay inside nodes."""
    names = list(sizes)
    orders = (
        list(itertools.permutations(names))[:max_orders]
        if len(names) <= 4
        else [tuple(sorted(names, key=lambda n: -sizes[n]))]
    )
    seen: set[tuple[tuple[int, ...], ...]] = set()
    out: list[Layout] = []
    for order in orders:
        for whole in (True, False):
            lay = _pack(order, sizes, tps, cluster, whole)
            if lay is None:
                continue
            if not all(tp_groups_inside_nodes(lay[n], tps[n], cluster.devices_per_node) for n in names):
                continue
            key = tuple(tuple(lay[n]) for n in names)
            if key not in seen:
                seen.add(key)
                out.append(lay)
    return out


def place(
    sizes: Mapping[str, int],
    tps: Mapping[str, int],
    cluster: Cluster,
    strategy: str = "hetero",
    score: Callable[[Layout], float] | None = None,
) -> tuple[Layout, dict[str, float]]:
    """Ranks per tower for separate towers of ``sizes`` devices (summing to the world size).

    Returns the layout and the scores of the candidates tried (by a short description).
    """
    D = cluster.world_size
    if sum(sizes.values()) != D:
        raise ValueError(f"tower sizes {dict(sizes)} do not add up to the {D} devices")
    if strategy == "naive":
        lay = _pack(list(sizes), sizes, tps, cluster, False)
        assert lay is not None
        return lay, {}
    if strategy != "hetero":
        raise ValueError(f"unknown placement strategy {strategy!r}; choose hetero or naive")
    layouts = candidate_layouts(sizes, tps, cluster)
    if not layouts:
        raise ValueError(
            f"no layout keeps every tensor-parallel group inside a node for sizes {dict(sizes)} and tp {dict(tps)}"
            f" on nodes of {cluster.devices_per_node}"
        )
    if score is None or len(layouts) == 1:
        return layouts[0], {}
    scored = [(score(lay), i, lay) for i, lay in enumerate(layouts)]
    scored.sort(key=lambda x: (x[0], x[1]))
    return scored[0][2], {_describe(lay, cluster): s for s, _, lay in scored}


def _describe(lay: Layout, cluster: Cluster) -> str:
    dpn = cluster.devices_per_node
    return "; ".join(f"{n}: nodes {sorted({r // dpn for r in rs})}" for n, rs in lay.items())


__all__ = ["Layout", "place", "candidate_layouts", "tp_groups_inside_nodes"]
