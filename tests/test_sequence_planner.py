"""The cost model's view of context and sequence parallelism (no processes)."""

import pytest
import yaml

from lightning_distmm.core.plan import Plan, TowerPlan
from lightning_distmm.planner.cost.comm import cp_comm
from lightning_distmm.planner.cost.memory import act_per_sample
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.plans import plan_choices, tower_plan
from lightning_distmm.planner.cost.step import rank_groups
from lightning_distmm.planner.machine.config import CONF_DIR
from lightning_distmm.planner.measure.local import load_cluster
from lightning_distmm.planner.price import price_plan
from lightning_distmm.planner.profiles.profile import model_profiles


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
    # sp divides what TP replicates, and its fc2 recomputes the MLP activation's output (M/tp per token)
    assert lay.act_sp_recomputed == p.seq * p.width * 4
    assert tp2 - sp == pytest.approx(bel * p.layers * (lay.act_rep + lay.act_sp_recomputed) / 2)


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


def test_sequence_variants_follow_the_runtime_rules():
    from lightning_distmm.planner.search.sequence import sequence_variants

    profiles = _profiles()
    image = sequence_variants(profiles["image"], TowerPlan(ranks=list(range(8))), 8)
    assert {"cp": 2, "tp": 1, "sp": False} in image and {"cp": 1, "tp": 2, "sp": True} in image
    assert all(v["cp"] * v["tp"] <= 8 and 16 % (v["cp"] * v["tp"]) == 0 for v in image)
    assert not any(v["sp"] and v["cp"] > 1 for v in image)
    sharded = sequence_variants(profiles["image"], TowerPlan(ranks=list(range(8)), shard="full"), 8)
    assert not any(v["sp"] for v in sharded) and any(v["cp"] > 1 for v in sharded)
    # 12 heads, 77 tokens, pipelined: padded for cp (its later stages are told the length), sp too
    text = sequence_variants(profiles["text"], TowerPlan(ranks=list(range(8)), pp=2), 8)
    assert {v["cp"] * v["tp"] for v in text} <= {1, 2, 4} and {"cp": 2, "tp": 1, "sp": False} in text
    assert {"cp": 1, "tp": 2, "sp": True} in text and not any(v["sp"] and v["cp"] > 1 for v in text)
    bert = model_profiles(yaml.safe_load((CONF_DIR / "model" / "lit_l16_bert_large.yaml").read_text()))["text"]
    assert bert.arch == "bert" and all(v["cp"] == 1 for v in sequence_variants(bert, TowerPlan(ranks=[0, 1]), 8))


def test_the_search_chooses_cp_when_the_batch_is_below_the_devices():
    """ViT-L/14 at 448 px, 2 samples on 16 A100s: the image tower's 8 GPUs hold 2 replicas; without
    ``sequence`` the search gives it tp4; with it the search itself (the balancer's candidates, not
    the pass after it) gives cp2 x tp2, predicted faster, at least as fast as the pass alone."""
    from lightning_distmm.planner.price import price_plan
    from lightning_distmm.planner.search.search import make_plan
    from lightning_distmm.planner.search.sequence import refine_sequence

    cfg = yaml.safe_load((CONF_DIR / "model" / "clip_vit_l14_448.yaml").read_text())
    options = {"world_size": 16, "shards": ["none", "full"]}
    plain, plain_report = make_plan(cfg, "a100_8x8", 2, options)
    plan, report = make_plan(cfg, "a100_8x8", 2, {**options, "sequence": True})
    assert all(t.cp == 1 for t in plain.towers.values()) and not plain_report.sequence_notes
    assert (plan.towers["image"].cp, plan.towers["image"].tp) == (2, 2)
    assert report.step_time < plain_report.step_time and "cp2" in report.table()
    # the local pass after the plain search (the sequence pass) finds no faster plan
    profiles, cluster = model_profiles(cfg), load_cluster("a100_8x8").with_world(16)
    price = lambda pl: price_plan(pl, profiles, cluster, {**options, "sequence": True}, 2)  # noqa: E731
    _, local, _ = refine_sequence(plain, profiles, cluster, price, 2)
    assert report.step_time <= local.step_time * (1 + 1e-9)


def test_tower_candidates_enumerate_cp_and_sp_with_the_other_degrees():
    """With ``sequence`` the balancer's candidates hold cp and sp configurations (each a valid runtime
    plan on its devices), priced by the same terms as the plan pricing; without it, none."""
    from lightning_distmm.planner.cost import CostOptions
    from lightning_distmm.planner.cost.plans import tower_plan
    from lightning_distmm.planner.search.job import SearchJob
    from lightning_distmm.planner.search.partition import SearchSpace, tower_candidates, tower_space

    profiles, cluster = _profiles(), load_cluster("a100_8x8").with_world(16)
    image = profiles["image"]
    tps, pps = tower_space(image, cluster, 16, None, None, None, None)
    for sequence in (False, True):
        space = SearchSpace({"image": tps}, {"image": pps}, ("gpipe",), 8, ("none", "full"), sequence=sequence)
        cands = tower_candidates(image, SearchJob(cluster, CostOptions(), 64, 16, space), max_devices=8)
        assert cands.cp is not None and cands.sp is not None
        if not sequence:
            assert (cands.cp == 1).all() and not cands.sp.any()
            continue
        assert (cands.cp > 1).any() and cands.sp.any()
        for i in range(len(cands)):
            ch = cands.choice(i)
            assert ch.n == ch.dp * ch.cp * ch.tp * ch.pp and not (ch.sp and (ch.cp > 1 or ch.shard != "none"))
            tower_plan(ch, list(range(ch.n)))  # the runtime's validation accepts it


def test_the_placement_picture_lays_cp_replicas_out_as_the_runtime_does():
    from lightning_distmm.planner.pictures.placement_map import device_roles, heavy_links, placement_svg

    plan = Plan(8, {"image": {"ranks": list(range(8)), "cp": 2, "tp": 2}, "text": {"ranks": list(range(8))}})
    roles = device_roles(plan)
    assert roles[3][0].label(plan.towers["image"]) == "rep 0 / cp 1 / tp 1"
    assert roles[6][0].label(plan.towers["image"]) == "rep 1 / cp 1 / tp 0"
    links = {(g.kind, g.ranks) for g in heavy_links(plan, 8) if g.tower == "image"}
    assert ("tp", (2, 3)) in links and ("dp", (0, 2, 4, 6)) in links and ("dp", (1, 3, 5, 7)) in links
    assert "cp 1" in placement_svg(plan, 8)
