"""The cost model's view of context and sequence parallelism (no processes)."""

import pytest
import yaml

from lightning_distmm.core.plan import Plan, TowerPlan
from lightning_distmm.planner.config import CONF_DIR
from lightning_distmm.planner.cost.comm import cp_comm
from lightning_distmm.planner.cost.memory import act_per_sample
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.step import rank_groups
from lightning_distmm.planner.measure import load_cluster
from lightning_distmm.planner.profile import model_profiles
from lightning_distmm.planner.search import plan_choices, price_plan, tower_plan


def _profiles(preset: str = "clip_vit_l14_448"):
    return model_profiles(yaml.safe_load((CONF_DIR / "model" / f"{preset}.yaml").read_text()))


def test_activation_memory_with_cp_and_sp():
    p, opts = _profiles()["image"], CostOptions()
    lay, bel = p.layer, opts.bytes_el
    ends = bel * (p.pre.act_rep + p.post.act_rep + p.pre.act_split + p.post.act_split)
    whole = act_per_sample(p, opts, 1, 1)
    for cp in (2, 4):  # every layer's tokens split, the ends kept whole
        assert act_per_sample(p, opts, 1, 1, cp=cp) == pytest.approx(ends + (whole - ends) / cp)
    tp2 = act_per_sample(p, opts, 2, 1)
    sp = act_per_sample(p, opts, 2, 1, sp=True)
    assert tp2 - sp == pytest.approx(bel * p.layers * lay.act_rep / 2)  # sp divides what TP replicates


def test_rank_groups_lay_replicas_out_as_the_runtime_does():
    g = rank_groups(list(range(16)), tp=2, pp=2, cp=2)
    tower = TowerPlan(ranks=list(range(16)), tp=2, pp=2, cp=2)
    assert g["replicas"] == [tower.replica_ranks(0), tower.replica_ranks(1)]
    assert g["tp"][:2] == [[0, 1], [2, 3]] and g["cp"][:2] == [[0, 2], [1, 3]]
    assert [0, 2, 8, 10] in g["dp"] and len(g["dp"]) == 4  # gradients summed over replicas x cp ranks
    assert g["pp"][0] == [0, 4]


def test_cp_and_sp_are_priced_and_round_trip():
    profiles, cluster = _profiles(), load_cluster("a100_8x8").with_world(16)
    text = {"ranks": list(range(8, 16))}
    dp = Plan(16, {"image": {"ranks": list(range(8))}, "text": text}, 16)
    cp = Plan(16, {"image": {"ranks": list(range(8)), "cp": 4}, "text": text}, 16)
    sp = Plan(16, {"image": {"ranks": list(range(8)), "tp": 4, "sp": True}, "text": text}, 16)
    tp = Plan(16, {"image": {"ranks": list(range(8)), "tp": 4}, "text": text}, 16)
    cost = {
        k: price_plan(v, profiles, cluster, None, 16).towers["image"]
        for k, v in dict(dp=dp, cp=cp, sp=sp, tp=tp).items()
    }
    assert cost["dp"].tp_comm == 0 < cost["cp"].tp_comm  # the all-to-alls
    assert cost["cp"].memory["activations"] == pytest.approx(cost["dp"].memory["activations"], rel=0.05)  # 2 rows / 4
    assert cost["sp"].memory["activations"] < 0.8 * cost["tp"].memory["activations"]
    assert cost["sp"].tp_comm > cost["tp"].tp_comm  # the regather in backward
    assert cp_comm(profiles["image"], cluster, CostOptions(), 2.0, 1, 1, 1) == 0
    choices, ranks = plan_choices(sp, 16)
    assert (choices["image"].cp, choices["image"].sp, choices["image"].dp) == (1, True, 2)
    back = tower_plan(choices["image"], ranks["image"])
    assert (back.ranks, back.tp, back.cp, back.sp) == (list(range(8)), 4, 1, True)
    choices, ranks = plan_choices(cp, 16)
    back = tower_plan(choices["image"], ranks["image"])
    assert (back.tp, back.cp, back.sp, choices["image"].dp) == (1, 4, False, 2)
