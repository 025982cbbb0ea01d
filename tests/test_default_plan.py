"""The default plan (``plan=None``): the cheapest of the FLOP-proportional split, colocated and the
other splits, as the cost model prices them from counts (pure planner: no processes, no torch)."""

from __future__ import annotations

import pytest

from lightning_distmm.planner import price_plan
from lightning_distmm.planner.default import (
    CountedTower,
    Host,
    candidate_plans,
    counted_profile,
    default_plan,
    describe_cpu,
    host_cluster,
    proportional_plan,
)
from lightning_distmm.planner.machine.cluster import GB
from lightning_distmm.planner.options import PlannerOptions


def cpu(ranks: int, cores: int | None = None, threads: int = 1) -> Host:
    """A described CPU host (AVX2 at 2.5 GHz): the same on every machine the tests run on."""
    return Host("cpu", ranks, cores or ranks * threads, threads, 32.0, 2.5, 16 * GB)


def transformer(gflops: float, mparams: float, ops: int = 150) -> CountedTower:
    return CountedTower(flops=gflops * 1e9, params=int(mparams * 1e6), embed_dim=128, ops=ops)


def test_unequal_towers_on_two_ranks_are_colocated():
    """An image tower with 5x the text tower's work: one tower per rank leaves the text rank idle for
    most of the step (measured at 1.44x of DDP); nothing the split can do balances it."""
    towers = {"image": transformer(0.23, 1.8), "text": transformer(0.05, 0.85)}
    choice = default_plan(towers, 2, 64, cpu(2))
    assert choice.name == "colocated" and choice.plan.colocated
    ratio = choice.seconds("proportional") / choice.seconds("colocated")
    assert ratio > 1.3  # the idle rank: (5 + 1) / 2 vs 5, less the all-reduce colocated adds
    line = choice.line()
    assert (
        line.startswith("distmm default plan: colocated") and f"{ratio:.2f}x faster than the FLOP-proportional" in line
    )


def test_balanced_towers_are_separated():
    """Equal towers: one per rank computes what colocated computes, without the all-reduce of every
    parameter over both ranks, so separation is predicted faster and chosen."""
    towers = {"image": transformer(0.1, 20.0), "text": transformer(0.1, 20.0)}
    choice = default_plan(towers, 2, 64, cpu(2))
    assert choice.name == "proportional" and not choice.plan.colocated
    assert [t.ranks for t in choice.plan.towers.values()] == [[0], [1]]
    assert choice.seconds("colocated") > choice.seconds("proportional")
    assert "faster than colocated" in choice.line()


def test_small_towers_are_separated_by_their_per_call_cost():
    """Towers whose step is mostly per-operator cost (clip_tiny-sized): each rank calls only its own
    tower's operators when separate, both towers' when colocated, whatever the batch."""
    towers = {"image": transformer(0.004, 0.12, ops=64), "text": transformer(0.003, 0.11, ops=139)}
    choice = default_plan(towers, 2, 64, cpu(2))
    assert choice.name == "proportional"
    assert choice.seconds("colocated") / choice.seconds("proportional") > 1.05


def test_the_choice_is_priced_not_a_rule():
    """The same pair of towers goes either way with the work the ranks must balance: a 3:1 pair on 4
    ranks splits 3 + 1 (every rank busy, smaller all-reduces); 20:1 has no split that balances."""
    balanced = default_plan({"image": transformer(0.3, 10.0), "text": transformer(0.1, 3.3)}, 4, 64, cpu(4))
    assert not balanced.plan.colocated
    assert [len(t.ranks) for t in balanced.plan.towers.values()] == [3, 1]
    lopsided = default_plan({"image": transformer(2.0, 10.0), "text": transformer(0.1, 3.3)}, 4, 64, cpu(4))
    assert lopsided.plan.colocated


def test_the_chosen_plan_is_the_cheapest_candidate_priced_by_the_cost_model():
    towers = {"image": transformer(0.23, 1.8), "text": transformer(0.05, 0.85)}
    host = cpu(4, cores=2)
    choice = default_plan(towers, 4, 64, host)
    cluster = host_cluster(host, 4)
    profiles = {n: counted_profile(n, t, cluster) for n, t in towers.items()}
    options = PlannerOptions.from_any({"precision": "32", "overlap_grad_sync": False})
    names = [n for n, _, _ in choice.predicted]
    assert names[:2] == ["proportional", "colocated"] and set(names[2:]) == {"separate"}
    for _, plan, seconds in choice.predicted:  # what the default compared is what price_plan says
        assert price_plan(plan, profiles, cluster, options, 64).step_time == pytest.approx(seconds)
    assert choice.seconds(choice.name) == min(s for _, _, s in choice.predicted)
    with pytest.raises(ValueError, match="load_cluster"):  # pricing never measures this machine
        price_plan(choice.plan, profiles, {"name": "here", "measure": True}, options, 64)


def test_candidates():
    flops = {"image": 3.0, "text": 1.0}
    plans = candidate_plans(flops, 4)
    assert plans[0] == ("proportional", proportional_plan(flops, 4)) and plans[1][0] == "colocated"
    splits = sorted(tuple(len(t.ranks) for t in p.towers.values()) for n, p in plans if n == "separate")
    assert splits == [(1, 3), (2, 2)]  # 3 + 1 is the proportional one, listed once
    assert [n for n, _ in candidate_plans(flops, 1)] == ["proportional", "colocated"]  # both colocated on 1 rank
    three = candidate_plans({"a": 1.0, "b": 1.0, "c": 1.0}, 5)
    assert len(three) == 2 + 6 - 1  # C(4, 2) splits, the proportional one among them
    assert len(candidate_plans(flops, 200)) == 2  # too many splits to price: proportional and colocated only


def test_host_descriptions():
    cl = host_cluster(cpu(4, cores=2), 4)
    assert cl.device.concurrency == 2.0  # 4 single-threaded ranks on 2 cores
    assert host_cluster(cpu(2), 2).device.concurrency == 1.0
    assert cl.device.peak_flops == pytest.approx(32 * 2.5e9)
    gpu = host_cluster(Host("cuda", 8, memory=80 * GB, name="NVIDIA H100 80GB HBM3"), 16)
    assert gpu.name.startswith("h100") and (gpu.nodes, gpu.devices_per_node) == (2, 8)
    here = describe_cpu(2, 1)
    assert here.cores >= 1 and here.flops_per_cycle in (8.0, 32.0, 64.0) and here.ghz > 0 and here.memory > 0


def test_gpu_default_plan():
    towers = {"image": transformer(80.0, 300.0), "text": transformer(6.0, 120.0)}
    choice = default_plan(towers, 8, 1024, Host("cuda", 8, memory=80 * GB, name="NVIDIA A100-SXM4-80GB"), "bf16-mixed")
    assert choice.seconds(choice.name) == min(s for _, _, s in choice.predicted)
    assert "NVIDIA A100" in choice.line()


def test_a_split_other_than_the_proportional_one_names_both_ratios():
    """Tiny towers on 4 ranks: per-call cost dominates, the FLOP split (2 + 2) is not the cheapest."""
    towers = {"image": transformer(0.00003, 0.003, ops=37), "text": transformer(0.00002, 0.003, ops=94)}
    choice = default_plan(towers, 4, 8, cpu(4, cores=2))
    assert choice.name == "separate" and [len(t.ranks) for t in choice.plan.towers.values()] == [3, 1]
    line = choice.line()
    assert "faster than the FLOP-proportional split (image@0-1, text@2-3" in line and "faster than colocated" in line


def test_a_frozen_tower_costs_no_backward():
    frozen = CountedTower(flops=1e8, params=10**6, embed_dim=64, ops=100, frozen=True)
    cl = host_cluster(cpu(2), 2)
    profile = counted_profile("text", frozen, cl)
    assert profile.frozen and profile.trainable_params == 0
    trained = counted_profile("text", CountedTower(flops=1e8, params=10**6, embed_dim=64, ops=100), cl)
    assert trained.measured.bwd[1] == pytest.approx(2 * trained.measured.fwd[1])
    # equal forward FLOPs: two trained towers are split (one per rank), but a frozen one has a third
    # of the trained tower's work (no backward), which the FLOP-proportional split does not see
    assert default_plan({"image": transformer(0.1, 1.0), "text": transformer(0.1, 1.0)}, 2, 64, cpu(2)).name == (
        "proportional"
    )
    assert default_plan({"image": transformer(0.1, 1.0), "text": frozen}, 2, 64, cpu(2)).name == "colocated"
