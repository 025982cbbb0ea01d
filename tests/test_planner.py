"""Planner: balancer == brute force, the cost model's closed forms == the simulated schedule IR,
distmm priced as two half-batch syncs, placement keeps TP in nodes, plans fit memory, never slower
than the baselines, YAML round trip, infeasibility messages, solve time, recipes."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_distmm.core.plan import split_batch
from lightning_distmm.core.schedule import Backward, BatchSync, Forward, schedules
from lightning_distmm.planner import (
    Plan,
    PlanError,
    auto_plan,
    barrier_allocation,
    brute_force_barrier,
    brute_force_minmax,
    load_cluster,
    make_plan,
    minmax_allocation,
    plan_choices,
    price_plan,
    tp_groups_inside_nodes,
)
from lightning_distmm.planner.auto import TowerInfo
from lightning_distmm.planner.cost import (
    RECOMPUTE,
    CostOptions,
    TowerChoice,
    allreduce_time,
    compact_dp_allreduce,
    evaluate_plan,
    memory_per_device,
    phases,
    pp_comm,
    replica_plan,
    replica_timeline,
    ring_bytes,
    stage_compute,
    sync_group_rows,
    sync_time,
)
from lightning_distmm.planner.cost.simulate import simulate
from lightning_distmm.planner.machine.cluster import CONF_DIR, GB, Cluster, Device, Link
from lightning_distmm.planner.options import DEFAULT_SCHEDULES, PlannerOptions
from lightning_distmm.planner.profiles.profile import model_profiles
from lightning_distmm.planner.search.balance import compositions
from lightning_distmm.planner.search.partition import Candidates, InfeasibleError
from lightning_distmm.planner.search.placement import candidate_layouts, place

ROOT = Path(__file__).resolve().parents[1]


def model(name: str) -> dict:
    return yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())


def small_cluster(nodes: int = 2, dpn: int = 4, memory_gb: float = 80.0) -> Cluster:
    a100 = load_cluster("a100_8x8")
    return dataclasses.replace(
        a100, nodes=nodes, devices_per_node=dpn, device=dataclasses.replace(a100.device, memory=memory_gb * GB)
    )


# ---------------------------------------------------------------------- balancer
@pytest.mark.parametrize("seed", range(12))
def test_minmax_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    K = int(rng.integers(2, 5))
    D = int(rng.integers(K, 11))
    tables = []
    for _ in range(K):
        t = rng.uniform(0.1, 10.0, D + 1)
        t[rng.random(D + 1) < 0.3] = math.inf
        tables.append(t)
    value, alloc = minmax_allocation(tables, D)
    assert value == brute_force_minmax(tables, D)
    if math.isfinite(value):
        assert sum(alloc) == D and min(alloc) >= 1
        assert max(t[n] for t, n in zip(tables, alloc)) == value


def _random_candidates(rng, name: str, D: int) -> Candidates:
    rows = []
    for n in range(1, D + 1):
        for _ in range(int(rng.integers(0, 4))):
            rows.append((n, rng.uniform(0.1, 5.0), rng.uniform(0.0, 5.0) if rng.random() > 0.2 else 0.0))
    if not rows:
        rows.append((1, 1.0, 1.0))
    n, F, B = (np.array(x) for x in zip(*rows))
    k = len(n)
    z = np.ones(k, dtype=int)
    return Candidates(name, n.astype(int), F, B, z, z, 0 * z, z, z, np.zeros(k), ("gpipe",), 8)


@pytest.mark.parametrize("seed", range(12))
def test_barrier_balancer_equals_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    K = int(rng.integers(2, 4))
    D = int(rng.integers(K, 8))
    cands = [_random_candidates(rng, f"t{i}", D) for i in range(K)]
    want = brute_force_barrier(cands, D)
    if not math.isfinite(want):
        with pytest.raises(InfeasibleError):
            barrier_allocation(cands, D)
        return
    got = barrier_allocation(cands, D)
    assert got.exact
    assert got.objective == pytest.approx(want, rel=1e-12)
    assert sum(got.alloc.values()) == D


def test_balancer_on_real_towers_equals_brute_force():
    """Real candidate tables (three towers, uneven replica batches, a frozen-free CoCa) vs brute force."""
    from lightning_distmm.planner.cost import CostOptions, loss_bytes
    from lightning_distmm.planner.profiles.profile import model_profiles
    from lightning_distmm.planner.search.job import SearchJob
    from lightning_distmm.planner.search.partition import SearchSpace, tower_candidates, tower_space

    cl = small_cluster(2, 4)
    profiles = model_profiles(model("coca_vit_l14"))
    co = CostOptions()
    degrees = {n: tower_space(p, cl, 8, None, None, None, None) for n, p in profiles.items()}
    space = SearchSpace({n: d[0] for n, d in degrees.items()}, {n: d[1] for n, d in degrees.items()})
    lb = loss_bytes(100, 8, 2, co, 768)
    job = SearchJob(cl, co, 100, 8, space, lb)
    cands = [tower_candidates(p, job, max_devices=6) for p in profiles.values()]
    got = barrier_allocation(cands, 8)
    assert got.objective == pytest.approx(brute_force_barrier(cands, 8), rel=1e-12)


def test_frozen_tower_has_no_backward_and_lit_balances_on_the_barrier():
    plan, rep = make_plan(model("lit_l16_bert_large"), "a100_8x8_eth100", 4096, {"layouts": ["separate"]})
    image = rep.chosen.cost.towers["image"]
    assert image.backward_phase == 0 and image.dp_allreduce == 0 and image.optimizer == 0
    assert image.memory["static"] == pytest.approx(
        rep.profiles["image"].params * 2 / rep.chosen.choices["image"].tp, rel=0.05
    )


def test_uneven_replica_batches_follow_the_global_batch():
    plan, _ = make_plan(model("clip_vit_b32"), "a100_8x8", 1000, {"layouts": ["separate"]})
    for t in plan.towers.values():
        assert sum(t.replica_batch) == 1000 and max(t.replica_batch) - min(t.replica_batch) <= 1


# ---------------------------------------------------------------------- cost model
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "cached", RECOMPUTE, "distmm"])
def test_closed_forms_equal_the_simulated_instruction_lists(schedule, frozen):
    """cost.phases (the partitioner's fast path) == schedule.simulate over the runtime's own lists of
    a one-tower plan, for every schedule, over a grid of microbatch counts, stages, stage times,
    transfer times and batch-sync durations."""
    recompute = schedule in ("cached", RECOMPUTE)
    for P in (1, 2, 3, 4, 5, 6):
        for rows in (2, 3, 5, 8, 13, 22):
            for mb in (1, 2):
                for f, b, link, syncs in (
                    (1.0, 2.3, 0.0, (0.7, 0.4)),
                    (1.0, 0.4, 0.3, (0.0, 2.0)),
                    (0.2, 1.0, 1.7, (5.0, 0.1)),
                    (3.0, 0.5, 5.0, (0.0, 0.0)),
                ):
                    b = 0.0 if frozen else b
                    lists = schedules(replica_plan(schedule, P, mb), rows)
                    if frozen:  # the runtime skips a frozen tower's backward
                        lists = {r: [i for i in ins if not isinstance(i, Backward)] for r, ins in lists.items()}

                    def duration(rank, ins):
                        if isinstance(ins, Forward):
                            return f
                        if isinstance(ins, Backward):
                            return b + (f if recompute else 0.0)
                        return syncs[ins.sync_group] if isinstance(ins, BatchSync) else 0.0

                    intervals = simulate(lists, duration, lambda ins: link)
                    groups = (rows - rows // 2, rows // 2) if schedule == "distmm" else (rows,)
                    counts = [math.ceil(g / mb) for g in groups]
                    segments, bubble = phases(schedule, frozen, counts[0], P, f, b, link, counts[-1])
                    segments = [float(x) for x in segments]
                    # the first batch-sync starts after the first segment, the step ends after all of them
                    first = min(i.start for i in intervals if isinstance(i.instruction, BatchSync))
                    assert first == pytest.approx(segments[0])
                    assert max(i.end for i in intervals) == pytest.approx(sum(segments) + sum(syncs[: len(groups)]))
                    timeline = replica_timeline(schedule, frozen, P, rows, mb, f, b, link, syncs)
                    assert timeline.segments == pytest.approx(segments)
                    assert timeline.bubble == pytest.approx(float(bubble))


def test_simulate_takes_a_transfer_time_per_message():
    """schedule.simulate's link may be a function of the receiving instruction: activations and
    gradients of different sizes take different times."""
    lists = schedules(replica_plan("gpipe", 2, 1), 2)
    intervals = simulate(
        lists,
        lambda r, i: 1.0 if isinstance(i, (Forward, Backward)) else 0.0,
        lambda ins: 0.5 if isinstance(ins, Forward) else 2.0,
    )
    end = max(i.end for i in intervals)
    assert end == pytest.approx(3 + 0.5 + 3 + 2.0)  # (K+P-1) slots each way, one transfer of each kind
    same = [max(i.end for i in simulate(lists, lambda r, i: 1.0, link)) for link in (0.5, lambda ins: 0.5)]
    assert same[0] == pytest.approx(same[1])


def _clip_choices(schedule: str, image_pp: int = 1, image_mb: int = 2, text_mb: int = 4, G: int = 16):
    """clip_vit_b32 on 3 GPUs: image on ranks 0-1 (``image_pp`` stages), text on rank 2."""
    dp = 2 // image_pp
    choices = {
        "image": TowerChoice("image", 2, 1, image_pp, image_mb, schedule, tuple(split_batch(G, None, dp))),
        "text": TowerChoice("text", 1, 1, 1, text_mb, schedule, (G,)),
    }
    return choices, {"image": [0, 1], "text": [2]}


def test_distmm_is_priced_as_two_half_batch_syncs_and_one_wave_of_activations():
    profiles = model_profiles(model("clip_vit_b32"))
    cl, co = load_cluster("a100_8x8").with_world(3), CostOptions()
    G = 64
    priced = {s: evaluate_plan(profiles, cl, co, *_clip_choices(s, 1, 4, 8, G), G) for s in ("gpipe", "distmm")}
    embed = max(p.embed_dim for p in profiles.values())
    whole, half = (sync_time(cl, co, rows, embed, 3, 1, 2)["total"] for rows in (G, G // 2))
    assert priced["gpipe"].sync["per_group"] == pytest.approx([whole])
    assert priced["distmm"].sync["per_group"] == pytest.approx([half, half])  # no "hidden half of the gather"
    assert priced["distmm"].sync["total"] == pytest.approx(2 * half)
    for name in ("image", "text"):
        g, d = priced["gpipe"].towers[name], priced["distmm"].towers[name]
        assert len(d.segments) == 3 and len(g.segments) == 2
        assert d.memory["activations"] == pytest.approx(g.memory["activations"] / 2)  # one sync group at pp = 1
        assert d.compute == pytest.approx(g.compute)
    # pipelined: one sync group plus the P-1 microbatches stage 0 runs ahead (1F1B between the groups)
    piped = evaluate_plan(profiles, cl, co, *_clip_choices("distmm", 2, 2, 4, 16), 16)
    gpiped = evaluate_plan(profiles, cl, co, *_clip_choices("gpipe", 2, 2, 4, 16), 16)
    assert piped.towers["image"].memory["activations"] == pytest.approx(
        gpiped.towers["image"].memory["activations"] * (8 + 2) / 16
    )
    image = profiles["image"]
    for pp, mb, rows, held in (
        (4, 1, 16, 8 + 3),
        (4, 2, 16, 8 + 6),
        (3, 3, 11, 6 + 5),
        (6, 1, 4, 2 + 2),
        (1, 2, 16, 8),
    ):
        acts = {s: memory_per_device(image, co, s, mb, 0, rows, 1, pp)["activations"] for s in ("gpipe", "distmm")}
        assert float(acts["distmm"]) == pytest.approx(float(acts["gpipe"]) * held / rows)
    with pytest.raises(ValueError, match="distmm"):
        mixed = _clip_choices("distmm")[0]
        evaluate_plan(
            profiles,
            cl,
            co,
            {**mixed, "text": dataclasses.replace(mixed["text"], schedule="gpipe")},
            _clip_choices("gpipe")[1],
            16,
        )


@pytest.mark.parametrize("schedule", ["gpipe", "cached", "distmm"])
def test_segments_compose_to_the_simulated_whole_plan(schedule):
    """Separate towers, a pipelined one among them: the cost model's segments and batch-syncs add up
    (sum over the syncs of the slowest tower's segment) to the simulation of the whole plan's lists."""
    profiles = model_profiles(model("clip_vit_b32"))
    cl, co = load_cluster("a100_8x8").with_world(3), CostOptions()
    choices, ranks = _clip_choices(schedule, image_pp=2)
    cost = evaluate_plan(profiles, cl, co, choices, ranks, 16)
    plan = Plan(
        3,
        {
            n: {"ranks": ranks[n], "pp": c.pp, "microbatch": c.microbatch, "schedule": schedule}
            for n, c in choices.items()
        },
    )
    slot = {}
    for n, c in choices.items():
        fc, bc = (float(x) for x in stage_compute(profiles[n], cl, co, c.microbatch, 1, c.pp))
        ppc = float(pp_comm(profiles[n], cl, co, c.microbatch, c.pp))
        slot[n] = (max(fc, ppc), max(bc, ppc), ppc)

    def duration(rank, ins):
        if isinstance(ins, Forward):
            return slot[ins.tower][0]
        if isinstance(ins, Backward):
            return slot[ins.tower][1] + (slot[ins.tower][0] if ins.recompute else 0.0)
        return cost.sync["per_group"][ins.sync_group] if isinstance(ins, BatchSync) else 0.0

    end = max(i.end for i in simulate(schedules(plan, 16), duration, lambda ins: slot[ins.tower][2]))
    groups = len(cost.sync["per_group"])
    composed = sum(max(t.segments[g] for t in cost.towers.values()) for g in range(groups + 1)) + cost.sync["total"]
    assert end == pytest.approx(composed)


def test_the_planner_keeps_distmm_on_every_tower_or_none():
    plan, rep = make_plan(model("clip_vit_b32"), "a100_8x8", 4096, {"schedules": ["distmm"], "layouts": ["separate"]})
    assert {t.schedule for t in plan.towers.values()} == {"distmm"} and plan.sync_groups == 2
    assert len(rep.chosen.cost.sync["per_group"]) == 2
    for options in ({}, {"layouts": ["colocated"]}, {"schedules": ["gpipe", "distmm"]}):
        plan, _ = make_plan(model("lit_l16_bert_large"), "a100_8x8", 4096, options)  # a frozen tower among them
        assert len({t.schedule == "distmm" for t in plan.towers.values()}) == 1


@pytest.mark.parametrize(
    "name, cluster, batch", [("clip_vit_bigg14", "a100_8x8", 4096), ("distmm_4b", "a100_8x8", 4096)]
)
def test_distmm_only_when_listed(name, cluster, batch):
    """distmm changes the loss (two sync groups, each with its own negatives): the default options
    (and conf/planner/default.yaml) never plan it; listing it lets the planner pick it, on every tower."""
    assert PlannerOptions().schedules == DEFAULT_SCHEDULES == ("gpipe", "cached")
    conf = PlannerOptions.from_any(yaml.safe_load((CONF_DIR / "planner" / "default.yaml").read_text()))
    assert "distmm" not in conf.schedules
    plan, rep = make_plan(model(name), cluster, batch)
    assert plan.sync_groups == 1 and all(t.schedule != "distmm" for t in plan.towers.values())
    for ev in [*rep.candidates.values(), *rep.baselines.values()]:
        assert ev is None or all(c.schedule != "distmm" for c in ev.choices.values())
    opted, orep = make_plan(model(name), cluster, batch, {"schedules": ["gpipe", "cached", "distmm"]})
    assert {t.schedule for t in opted.towers.values()} == {"distmm"} and opted.sync_groups == 2
    assert len(orep.chosen.cost.sync["per_group"]) == 2
    assert orep.step_time < rep.step_time


def test_small_microbatches_underuse_a_gpu():
    dev = load_cluster("a100_8x8").device
    eff = [float(dev.wave_efficiency(77 * mb, 3840)) for mb in (1, 4, 16, 64)]
    assert eff[0] < 0.5 < eff[-1] and eff == sorted(eff)


def test_collectives_follow_the_link_they_cross():
    cl = load_cluster("a100_8x8_eth100")
    inside = allreduce_time(cl, 1e9, 8, nodes=1)
    across = allreduce_time(cl, 1e9, 8, nodes=8, per_node=1)
    assert across > 10 * inside


def test_one_allreduce_formula_for_estimate_and_exact_pricing():
    """The partitioner's packed estimate is the same all-reduce the cost model prices: one node,
    then across nodes with the NIC shared by the stage shards' groups."""
    cl = load_cluster("a100_8x8_eth100")
    gb = 3e8
    assert compact_dp_allreduce(cl, gb, np.array([8.0]), 1, 1)[0] == allreduce_time(cl, gb, 8, 1, 8)
    assert compact_dp_allreduce(cl, gb, np.array([16.0]), 2, 1)[0] == allreduce_time(
        cl, gb, 16, 4, 4, nic_load=ring_bytes(2 * gb, 4)
    )
    assert sync_group_rows("distmm", 7) == (4, 3) and sync_group_rows("gpipe", 7) == (7,)


# ---------------------------------------------------------------------- placement
@pytest.mark.parametrize(
    "sizes, tps, dpn",
    [
        ({"a": 12, "b": 4}, {"a": 4, "b": 2}, 8),
        ({"a": 6, "b": 6, "c": 4}, {"a": 2, "b": 2, "c": 4}, 8),
        ({"a": 10, "b": 6}, {"a": 2, "b": 2}, 4),
    ],
)
def test_placement_keeps_tp_groups_inside_nodes(sizes, tps, dpn):
    D = sum(sizes.values())
    cl = small_cluster(D // dpn, dpn)
    layouts = candidate_layouts(sizes, tps, cl)
    assert layouts
    for lay in layouts:
        assert sorted(r for rs in lay.values() for r in rs) == list(range(D))
        for name, ranks in lay.items():
            assert len(ranks) == sizes[name] and tp_groups_inside_nodes(ranks, tps[name], dpn)
    lay, _ = place(sizes, tps, cl, "hetero")
    assert all(tp_groups_inside_nodes(lay[n], tps[n], dpn) for n in sizes)


@pytest.mark.parametrize(
    "name, cluster, batch",
    [("distmm_26b", "a100_8x8", 2048), ("distmm_10b", "a100_8x8_eth100", 1024), ("coca_vit_l14", "h100_8x8", 4096)],
)
def test_chosen_plans_keep_tp_inside_nodes_and_fit_memory(name, cluster, batch):
    plan, rep = make_plan(model(name), cluster, batch)
    dpn = rep.cluster.devices_per_node
    for t in plan.towers.values():
        for i in range(t.dp):
            replica = t.replica_ranks(i)
            assert tp_groups_inside_nodes(replica, t.tp, dpn)
    limit = rep.cluster.device.memory * rep.options.cost.memory_margin
    assert rep.chosen.cost.extra["fits"] and rep.chosen.cost.extra["peak_memory"] <= limit
    for ev in [*rep.baselines.values(), *rep.candidates.values()]:
        if ev is not None:
            assert ev.cost.extra["peak_memory"] <= limit


def test_tensor_parallel_plans_exist_and_fit():
    """A 26B model cannot run data parallel: the plan must split it, and every device must fit."""
    plan, rep = make_plan(model("distmm_26b"), "a100_8x8", 512)
    image = plan.towers["image"]
    assert image.tp * image.pp > 1
    assert rep.chosen.cost.extra["fits"]


# ---------------------------------------------------------------------- baselines
@pytest.mark.parametrize(
    "name, cluster, batch, shards",
    [
        ("clip_vit_b32", "a100_8x8_eth100", 1024, ["none"]),
        ("clip_vit_l14", "a100_8x8", 1024, ["none", "full"]),
        ("distmm_10b", "a100_8x8", 4096, ["none", "full"]),
        ("distmm_26b", "h100_8x8", 8192, ["none", "full"]),
        ("lit_l16_bert_large", "h100_8x8", 2048, ["none", "full"]),
        ("coca_vit_l14", "a100_8x8", 4096, ["none"]),
    ],
)
def test_the_plan_written_is_the_plan_priced(name, cluster, batch, shards):
    """Every field the planner priced survives planning -> Plan -> YAML -> Plan -> the cost model's
    view of it (ranks, replica batches, tp, pp, microbatch, schedule and recomputation, sharding), and
    pricing the written plan gives the predicted step."""
    plan, rep = make_plan(model(name), cluster, batch, {"shards": shards})
    again = Plan.from_yaml(plan.to_yaml())
    choices, ranks = plan_choices(again, batch)
    assert choices == rep.chosen.choices
    assert ranks == rep.chosen.ranks
    assert {t.shard for t in again.towers.values()} == {c.shard for c in rep.chosen.choices.values()}
    assert price_plan(again, rep.profiles, cluster, {"shards": shards}).step_time == pytest.approx(rep.step_time)


def test_a_sharded_choice_is_written_into_the_plan():
    """The 10B preset on 64 A100s at 4,096: the planner shards the image tower (ZeRO-3) when allowed,
    and the plan it returns says so (it said ``shard: none`` before)."""
    plan, rep = make_plan(model("distmm_10b"), "a100_8x8", 4096, {"shards": ["none", "full"]})
    sharded = {n for n, c in rep.chosen.choices.items() if c.shard == "full"}
    assert sharded, "the preset no longer picks a sharded tower: choose another case"
    assert {n for n, t in plan.towers.items() if t.shard == "full"} == sharded


def test_the_report_says_when_it_picks_a_baselines_own_plan():
    """DistMM's options include the colocated plans DDP and FSDP run; when one of them is the fastest,
    the report names it instead of counting a 1.00x win."""
    for name, cluster, batch in [("clip_vit_b32", "a100_8x8", 4096), ("clip_vit_l14", "h200_8x8", 4096)]:
        _, rep = make_plan(model(name), cluster, batch)
        k = rep.picked_baseline()
        if k is not None:
            assert rep.speedup(k) == pytest.approx(1.0)
            assert f"= {k}'s own plan" in rep.table() and rep.pick_label().startswith(f"= {k}")
        else:
            assert rep.pick_label().startswith("DistMM ")


def test_separate_towers_win_on_a_slow_network():
    _, rep = make_plan(model("clip_vit_h14"), "a100_8x8_eth100", 1024)
    assert rep.chosen.cost.layout == "separate"
    assert rep.speedup("megatron") > 1.2


def test_data_parallel_only_option():
    plan, _ = make_plan(
        model("clip_vit_l14"), "a100_8x8", 4096, {"max_tp": 1, "max_pp": 1, "schedules": ["gpipe", "cached"]}
    )
    assert all(t.tp == 1 and t.pp == 1 and t.schedule in ("gpipe", "cached") for t in plan.towers.values())


# ---------------------------------------------------------------------- YAML
def test_plan_yaml_round_trip(tmp_path):
    plan, rep = make_plan(model("coca_vit_l14"), "a100_8x8", 4096)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    again = Plan.from_yaml(path)
    assert again == plan and set(again.towers) == {"image", "text", "decoder"}
    assert yaml.safe_load(yaml.safe_dump(rep.to_dict()))["step_time"] == pytest.approx(rep.step_time)


def test_plan_without_recompute_key_still_loads():
    plan = Plan.from_yaml("world_size: 2\ntowers:\n  image: {ranks: [0]}\n  text: {ranks: [1], schedule: cached}\n")
    assert plan.towers["image"].recompute is False
    with pytest.raises(PlanError, match="recompute.*true, false or a number of blocks"):
        Plan.from_dict({"world_size": 1, "towers": {"image": {"ranks": [0], "recompute": "yes"}}})


def test_cluster_presets_load_and_cite_their_constants():
    for name in ("a100_8x8", "a100_8x8_eth100", "h100_8x8", "h200_8x8"):
        cl = load_cluster(name)
        assert cl.world_size == 64 and cl.inter.bandwidth < cl.intra.bandwidth
        text = (CONF_DIR / "cluster" / f"{name}.yaml").read_text()
        for line in text.splitlines():
            if re.match(r"^\s+\w+:\s*[\d.]+\s*(#.*)?$", line) and not line.strip().startswith(
                ("nodes", "devices_per_node")
            ):
                assert "#" in line, f"{name}: constant without a source: {line.strip()}"
        assert Cluster.from_dict(cl.to_dict()).to_dict() == cl.to_dict()


# ---------------------------------------------------------------------- infeasible
def test_infeasible_tower_fits_no_device():
    with pytest.raises(InfeasibleError) as err:
        make_plan(model("distmm_26b"), small_cluster(1, 2, memory_gb=16), 64)
    msg = str(err.value)
    assert "tower 'image'" in msg and "fits no device even split" in msg and re.search(r"over by [\d.]+ GB", msg)


def test_infeasible_global_batch_below_replica_count():
    with pytest.raises(InfeasibleError) as err:
        make_plan(model("clip_vit_b32"), "a100_8x8", 4, {"max_tp": 1, "max_pp": 1})
    msg = str(err.value)
    assert "global batch 4 is below the replica count" in msg and "short by" in msg and "tower '" in msg


def test_infeasible_tp_divides_no_head_count():
    with pytest.raises(InfeasibleError) as err:
        make_plan(model("clip_vit_b32"), small_cluster(1, 6), 64, {"tp": 5})
    msg = str(err.value)
    assert (
        "tp=5 divides no tower's head count" in msg
        and "image has 12 heads (12 % 5 = 2)" in msg
        and "text has 8 heads (8 % 5 = 3)" in msg
    )
    with pytest.raises(
        InfeasibleError, match=r"tower 'text': tp=3 does not divide its 8 attention heads \(8 % 3 = 2\)"
    ):
        make_plan(model("clip_vit_b32"), small_cluster(1, 6), 64, {"tp": 3})
    with pytest.raises(InfeasibleError, match=r"tp=16 exceeds the 8 devices of a node by 8"):
        make_plan(model("clip_vit_b32"), "a100_8x8", 64, {"tp": 16})


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="planner.balancer='magic'"):
        make_plan(model("clip_vit_b32"), "a100_8x8", 64, {"balancer": "magic"})
    with pytest.raises(ValueError, match=r"unknown planner option\(s\) \['colour'\]"):
        make_plan(model("clip_vit_b32"), "a100_8x8", 64, {"colour": 1})


# ---------------------------------------------------------------------- speed
def test_plans_at_64_and_4096_devices():
    """The search scales to 4096 devices (benchmarks/planner.py prints the solve times)."""
    cfg = model("clip_vit_bigg14")
    plan, _ = make_plan(cfg, "a100_8x8", 32768)
    assert plan.world_size == 64
    big = dataclasses.replace(load_cluster("a100_8x8"), nodes=512)
    plan, rep = make_plan(cfg, big, 65536)
    assert plan.world_size == 4096 and rep.chosen.cost.extra["fits"]


# ---------------------------------------------------------------------- auto
def test_auto_plan_measures_live_towers():
    """The timings decide the split: on separate ranks the tower measured heavier (named ``text``
    here, second in order, so neither the name nor the order favours it) gets more ranks. One
    thread while measuring: on a shared host a tiny op can wait milliseconds for a second thread."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dev = Device("cpu", 8 * GB, 20e9, 10e9, 1.0, 5e-6)
    cl = Cluster("cpu4", 1, 4, dev, Link(200e9, 5e-6), Link(200e9, 5e-6))
    # ~70 MFLOP per sample over 64 tokens, few parameters (a cheap optimizer step): time grows with rows
    heavy = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.Flatten(), nn.Linear(64 * 256, 32))
    light = nn.Sequential(nn.Linear(16, 32))
    towers = {
        "image": TowerInfo(light, lambda b: [torch.randn(b, 16)]),
        "text": TowerInfo(heavy, lambda b: [torch.randn(b, 64, 256)]),
    }
    options = {"max_tp": 1, "max_pp": 1, "layouts": ["separate"], "recompute": False}
    try:
        plan = auto_plan(towers, 4, 64, cluster=cl, options=options, batch_sizes=(4, 16, 32))
    finally:
        torch.set_num_threads(threads)
    assert plan.world_size == 4 and plan.global_batch == 64
    assert len(plan.towers["text"].ranks) > len(plan.towers["image"].ranks)


def test_measure_tower_fits_time_and_activations():
    import torch
    from torch import nn

    from lightning_distmm.planner import measure_tower

    m = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 8))
    fit = measure_tower(m, lambda b: [torch.randn(b, 32)], (2, 8), repeats=1)
    assert fit.params == sum(p.numel() for p in m.parameters())
    assert fit.fwd_time(8) > 0 and fit.bwd_time(8) > 0
    assert fit.act_bytes[1] > 0  # activations grow with the microbatch


def test_measured_fit_prices_between_timed_sizes_by_their_times():
    """A convex CPU tower (time per row growing with the rows): the least-squares line runs through
    the origin and underprices one row; between timed sizes the times themselves set the price,
    beyond them the nearest timed size plus the line's slope, and without two timed sizes the line."""
    import numpy as np

    from lightning_distmm.planner.profiles.profile import MeasuredFit

    raw = [{"batch": b, "fwd": f, "bwd": 2 * f} for b, f in ((1, 5.0), (4, 12.0), (16, 44.0), (32, 106.0))]
    fit = MeasuredFit("cpu", [1, 4, 16, 32], (0.0, 3.2), (0.0, 6.4), (0.0, 0.0), 1, 1, raw=raw)
    assert fit.fwd_time(1) == 5.0 and fit.bwd_time(1) == 10.0  # the line says 3.2 and 6.4
    assert fit.fwd_time(2) == pytest.approx(5.0 + 7.0 / 3)  # between 1 and 4 rows
    assert 16 * fit.fwd_time(1) > fit.fwd_time(16)  # sixteen one-row microbatches cost more than one of 16
    assert fit.fwd_time(64) == pytest.approx(106.0 + 3.2 * 32)  # beyond: the largest timed plus the slope
    assert fit.fwd_time(0.5) == pytest.approx(5.0 - 3.2 * 0.5)  # (above the line's 1.6)
    low = MeasuredFit("cpu", [4, 16], (2.0, 3.0), (0.0, 6.0), (0.0, 0.0), 1, 1, raw=raw[1:3])
    assert low.fwd_time(1) == 5.0  # 12 - 3 * 3 = 3 would undercut the line's 2 + 3: never cheaper than the line
    got = fit.fwd_time(np.array([1.0, 2.0, 64.0]))
    assert got.shape == (3,) and got[0] == 5.0
    hiccup = [*raw[:2], {"batch": 16, "fwd": 150.0, "bwd": 300.0}, raw[3]]  # 16 rows slower than 32
    bumpy = MeasuredFit("cpu", [1, 4, 16, 32], (0.0, 3.2), (0.0, 6.4), (0.0, 0.0), 1, 1, raw=hiccup)
    assert bumpy.fwd_time(16) == 106.0 and bumpy.fwd_time(24) == 106.0 and bumpy.fwd_time(4) == 12.0
    line = MeasuredFit("cpu", [8], (1.0, 3.0), (2.0, 6.0), (0.0, 0.0), 1, 1, raw=raw[:1])
    assert line.fwd_time(4) == 13.0 and line.bwd_time(4) == 26.0  # one timed size: the line


def test_measure_tower_in_the_runs_precision():
    """Timed under the run's forward context (bf16 autocast here): the activations autograd saves
    are counted in the dtype the run keeps them in, about half of fp32's for a linear stack."""
    import torch
    from torch import nn

    from lightning_distmm.planner import measure_tower

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 8))
    make = lambda b: [torch.randn(b, 64)]  # noqa: E731
    fp32 = measure_tower(m, make, (4, 16), repeats=1)
    bf16 = measure_tower(m, make, (4, 16), repeats=1, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    ratio = bf16.act_bytes[1] / fp32.act_bytes[1]
    print(
        f"activation bytes per sample: fp32 {fp32.act_bytes[1]:.0f}, bf16 autocast {bf16.act_bytes[1]:.0f} ({ratio:.2f}x)"
    )
    assert 0.4 < ratio < 0.7, ratio
    assert next(m.parameters()).dtype == torch.float32 and next(m.parameters()).device.type == "cpu"


def test_local_cpu_is_measured():
    from lightning_distmm.planner import measure_local_cpu

    cl = measure_local_cpu(devices=2, measure_gloo=False, cache=False)
    assert cl.device.peak_flops > 1e8 and cl.device.memory_bandwidth > 1e8 and cl.devices_per_node == 2


# ---------------------------------------------------------------------- recipe
def _plan_recipe(argv: list[str]) -> None:
    """``python recipes/plan.py ARGV`` as the forked child runs it (sys.argv is what Hydra reads)."""
    import runpy

    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # a compose() of this process's other tests is not this run's
    sys.argv = [str(ROOT / "recipes" / "plan.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


@pytest.mark.slow
def test_recipe_multirun_writes_plans(tmp_path):
    """A Hydra multirun of the planning recipe, in a forked child of this process (no fresh
    interpreter importing the package first): one plan per job, the table and speedups printed."""
    from forked_main import main_in_fork

    argv = ["-m", "model=clip_vit_b32", "cluster=a100_8x8", "global_batch=2048", "planner.balancer=dp,even"]
    argv.append(f"hydra.sweep.dir={tmp_path}")
    log = tmp_path.parent / f"{tmp_path.name}.log"
    _, code = main_in_fork(_plan_recipe, argv, log, timeout=120)
    said = log.read_text()
    assert code == 0, said[-2000:]
    assert "predicted step time" in said and "speedup" in said
    plans = sorted(tmp_path.glob("*/plan.yaml"))
    assert len(plans) == 2
    for p in plans:
        assert Plan.from_yaml(p).world_size == 64


def test_compositions_cover_everything():
    assert len(list(compositions(6, 3))) == math.comb(5, 2)


def test_report_draws_the_predicted_step():
    """Report.timeline: every rank's instruction list simulated with the cost model's durations; the
    drawn step is the priced step less what the lists leave out (gradient sums, optimizer, overhead)."""
    from lightning_distmm.planner.pictures.timeline import timeline_svg

    plan, report = make_plan(model("clip_vit_l14"), "a100_8x8", 1024)
    intervals = report.timeline()
    assert {i.rank for i in intervals} == set(range(plan.world_size))
    span = max(i.end for i in intervals)
    assert 0.7 * report.step_time < span <= report.step_time
    assert timeline_svg(intervals).count("rank ") == plan.world_size
    with pytest.raises(ValueError, match="at most 8"):
        report.timeline(max_ranks=8)


@pytest.mark.slow
def test_planner_imports_without_torch_or_lightning():
    """The planner is pure Python above core: importing it (the package's own __init__ bypassed,
    which registers the Lightning strategies) loads neither torch nor Lightning."""
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('lightning_distmm'); pkg.__path__ = [sys.argv[1]]\n"
        "sys.modules['lightning_distmm'] = pkg\n"
        "import lightning_distmm.planner, lightning_distmm.planner.auto\n"
        "print(sorted({'torch', 'torch.distributed', 'lightning'} & set(sys.modules)))\n"
    )
    package = str(Path(__file__).resolve().parents[1] / "lightning_distmm")
    out = subprocess.run([sys.executable, "-c", code, package], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
