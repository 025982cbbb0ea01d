"""The cost model's price of the handoff (planner/cost/handoff.py)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_distmm.core.handoff_schedule import Route, routes
from lightning_distmm.core.plan import Plan
from lightning_distmm.planner.cost.handoff import handoff_step_seconds, route_seconds
from lightning_distmm.planner.measure.local import load_cluster

CONSUMES = {"llm": ["image"]}


def test_route_prices_bytes_over_the_link_it_crosses() -> None:
    cluster = load_cluster("a100_8x8")
    # LLaVA-1.5: 576 tokens of width 4096 in bf16 per image, 4 rows
    local = Route("image", "llm", 0, 4, 0, 0, 0, 0)
    intra = Route("image", "llm", 0, 4, 0, 3, 0, 0)
    inter = Route("image", "llm", 0, 4, 0, 9, 0, 0)
    seconds = [route_seconds(r, cluster, 576, 4096, 2) for r in (local, intra, inter)]
    nbytes = 4 * 576 * 4096 * 2
    assert seconds[0] == 0.0
    assert seconds[1] == pytest.approx(cluster.intra.latency + nbytes / cluster.intra.effective)
    assert seconds[2] > seconds[1]


def test_step_pays_the_transfers_on_its_critical_path() -> None:
    """Encoder on rank 0, LLM on rank 1: the step is both computes plus the tokens there and their gradient back."""
    plan = Plan(2, {"image": {"ranks": [0]}, "llm": {"ranks": [1]}})
    cluster = load_cluster("a100_8x8")

    def compute(tower: str, rows: int, backward: bool) -> float:
        return rows * (1e-3 if tower == "image" else 3e-3) * (2 if backward else 1)

    kw = dict(compute=compute, tokens_per_row=576, width=4096)
    near = handoff_step_seconds(
        plan, CONSUMES, ["image", "llm"], {"image": True, "llm": True}, 8, cluster=cluster, **kw
    )
    apart = dataclasses.replace(cluster, devices_per_node=1, nodes=64)  # the two ranks on two nodes
    far = handoff_step_seconds(plan, CONSUMES, ["image", "llm"], {"image": True, "llm": True}, 8, cluster=apart, **kw)
    route = routes(plan, CONSUMES, 8)[0]
    assert near == pytest.approx(8 * (1 + 3 + 6 + 2) * 1e-3 + 2 * route_seconds(route, cluster, 576, 4096, 2))
    assert far == pytest.approx(8 * (1 + 3 + 6 + 2) * 1e-3 + 2 * route_seconds(route, apart, 576, 4096, 2))
    assert far > near
