"""HSDP (``shard: hybrid``) priced as the runtime runs it: ZeRO-3 over the tower's replicas inside a
node, replicated across nodes, each layer's gradient shard all-reduced across the nodes. The
planner may now write it; the plan it writes is the plan it priced (the runtime's equivalence
with one process is tests/test_sharding.py's hybrid tests)."""

from __future__ import annotations

import pytest
import yaml

from lightning_distmm.planner import make_plan
from lightning_distmm.planner.cost import CostOptions, TowerChoice, evaluate_plan, shard_comm, shard_group
from lightning_distmm.planner.cost.memory import gathered_layers_bytes
from lightning_distmm.planner.cost.plans import plan_choices, tower_choice, tower_plan
from lightning_distmm.planner.machine.cluster import CONF_DIR
from lightning_distmm.planner.measure.local import load_cluster
from lightning_distmm.planner.price import price_plan
from lightning_distmm.planner.profiles.profile import model_profiles


def model(name: str) -> dict:
    return yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())


def colocated(profiles, world: int, shard: str, mb: int = 16) -> dict:
    return {n: TowerChoice(n, world, 1, 1, mb, "gpipe", (mb,) * world, shard) for n in profiles}


def test_inside_one_node_hsdp_is_fsdp():
    cl = load_cluster("a100_8x8").with_world(8)
    profiles = model_profiles(model("clip_vit_l14"))
    ranks = {n: list(range(8)) for n in profiles}
    full = evaluate_plan(profiles, cl, CostOptions(), colocated(profiles, 8, "full"), ranks, 128)
    hybrid = evaluate_plan(profiles, cl, CostOptions(), colocated(profiles, 8, "hybrid"), ranks, 128)
    assert hybrid.step_time == pytest.approx(full.step_time)
    assert hybrid.extra["peak_memory"] == pytest.approx(full.extra["peak_memory"])


def test_across_nodes_hsdp_shards_in_the_node_and_all_reduces_across():
    """On 8 nodes of 8: the state is split 8 ways (not 64), the weight gathers ride NVLink only, and
    the backward adds each gradient shard's all-reduce across the 8 nodes."""
    cl = load_cluster("a100_8x8")
    o = CostOptions()
    p = model_profiles(model("clip_vit_bigg14"))["image"]
    assert shard_group("hybrid", 64, 1, 1, 8) == 8 and shard_group("full", 64, 1, 1, 8) == 64
    ag_h, bwd_h = (float(x) for x in shard_comm(p, cl, o, 64, 1, 1, "hybrid"))
    ag_f, bwd_f = (float(x) for x in shard_comm(p, cl, o, 64, 1, 1, "full"))
    ag_node, _ = (float(x) for x in shard_comm(p, cl.with_world(8), o, 8, 1, 1, "full"))
    assert ag_h == pytest.approx(ag_node) and ag_h < ag_f  # the gathers stay inside the node
    assert bwd_h > 2 * ag_h  # gather + reduce-scatter in the node, plus the all-reduce across nodes
    profiles = {"image": p}
    ranks = {"image": list(range(64))}
    for shard, split in (("hybrid", 8), ("full", 64)):
        ch = {"image": TowerChoice("image", 64, 1, 1, 16, "gpipe", (16,) * 64, shard)}
        static = evaluate_plan(profiles, cl, o, ch, ranks, 1024).towers["image"].memory["static"]
        assert static == pytest.approx(p.params * 18 / split + gathered_layers_bytes(p, o, 1))


def test_hsdp_the_runtime_refuses_is_never_a_fit():
    """The runtime's HSDP mesh needs as many replicas on every node: 12 devices over nodes of 8
    (8 + 4) do not fit, whatever the memory."""
    cl = load_cluster("a100_8x8").with_world(16)
    profiles = model_profiles(model("clip_vit_b32"))
    choices = {
        "image": TowerChoice("image", 12, 1, 1, 8, "gpipe", (8,) * 12, "hybrid"),
        "text": TowerChoice("text", 4, 1, 1, 24, "gpipe", (24,) * 4, "none"),
    }
    ranks = {"image": list(range(12)), "text": list(range(12, 16))}
    assert not evaluate_plan(profiles, cl, CostOptions(), choices, ranks, 96).extra["fits"]


@pytest.mark.parametrize(
    "name, cluster, batch", [("clip_vit_bigg14", "a100_8x8", 4096), ("distmm_4b", "h100_8x8", 2048)]
)
def test_a_hybrid_plan_written_is_the_plan_priced(name, cluster, batch):
    """With ``shards: [hybrid]`` the planner writes HSDP towers; every field survives planning ->
    Plan -> YAML -> the cost model's choices, and the written plan prices to the chosen step."""
    from lightning_distmm.core.plan import Plan

    plan, rep = make_plan(model(name), cluster, batch, {"shards": ["hybrid"]})
    assert {t.shard for t in plan.towers.values()} == {"hybrid"}
    again = Plan.from_yaml(plan.to_yaml())
    choices, ranks = plan_choices(again, batch)
    for n, ch in rep.chosen.choices.items():
        assert choices[n] == ch and ranks[n] == rep.chosen.ranks[n]
        assert tower_choice(n, tower_plan(ch, ranks[n]), batch) == ch
    assert price_plan(again, rep.profiles, rep.cluster, rep.options, batch).step_time == pytest.approx(rep.step_time)
