"""benchmarks/side_by_side_emulated.py: its pure parts (the link-rate arithmetic, the four plans, the
statistics and the table) on a made-up host, without namespaces or processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from forked_main import script_module

from lightning_distmm.planner import Cluster, Device, Link, model_profiles, price_plan

ROOT = Path(__file__).resolve().parents[1]


pe = script_module(ROOT / "benchmarks" / "placement_emulated.py")
sb = script_module(ROOT / "benchmarks" / "side_by_side_emulated.py")


def host() -> Cluster:
    device = Device("cpu/1t", 8e9, 50e9, 10e9, kernel_overhead=2e-6, concurrency=1.0)
    return Cluster("local_cpu", 1, 2, device, Link(0.8e9, 150e-6), Link(0.8e9, 150e-6))


def test_reference_ratio_is_the_a100_arithmetic():
    ref = sb.reference_ratio()
    assert ref["devices"] == 16 and ref["per_device_batch"] == 256 and ref["link_gbps"] == pytest.approx(100)
    # fp32 gradients of clip_vit_b32's ~151M parameters: each node sends and receives about that much
    assert 1.1e9 < ref["bytes_per_nic"] < 1.3e9
    assert ref["ratio"] == pytest.approx(ref["allreduce_s"] / ref["compute_s"])
    assert 0.3 < ref["ratio"] < 2.0  # communication comparable to compute: the regime of a 100 Gb/s network
    faster = sb.reference_ratio({**sb.REFERENCE, "cluster": "a100_8x8"})  # 400 Gb/s
    assert faster["ratio"] < ref["ratio"]


def test_matched_rate_solves_the_ratio():
    profiles = model_profiles(sb.MODEL)
    ddp = sb.baseline_plans(list(profiles), 32)["ddp"]
    opts = pe.planner_options(0.0)

    def ratio_at(mbit):
        comm, compute = sb.comm_compute(
            price_plan(ddp, profiles, pe.emulated_cluster(host(), pe.LinkSettings(mbit)), opts)
        )
        return comm / compute

    rate = sb.matched_rate(0.78, ratio_at)
    assert ratio_at(rate) == pytest.approx(0.78, rel=0.01)
    assert ratio_at(rate / 2) > 0.78 > ratio_at(rate * 2)
    assert sb.matched_rate(1e-9, ratio_at, hi=1e4) == 1e4  # unreachable: the nearest end
    assert sb.matched_rate(1e9, ratio_at, lo=2.0) == 2.0


def test_the_four_plans():
    profiles = model_profiles(sb.MODEL)
    assert profiles["image"].heads % 2 == 0 and profiles["text"].heads % 2 == 0  # tp 2 divides both
    cl = pe.emulated_cluster(host(), pe.LinkSettings(400))
    opts = pe.planner_options(0.0)
    base = sb.baseline_plans(["image", "text"], 32)
    assert all(t.ranks == [0, 1, 2, 3] for p in base.values() for t in p.towers.values())  # all colocated
    assert {t.shard for t in base["ddp"].towers.values()} == {"none"}
    assert {t.shard for t in base["fsdp"].towers.values()} == {"full"}
    assert {(t.tp, t.pp, t.microbatch) for t in base["megatron"].towers.values()} == {(2, 1, None)}
    assert "tp2" in sb.describe(base["megatron"]) and "shard full" in sb.describe(base["fsdp"])
    with pytest.raises(ValueError, match="across the namespaces"):
        sb.baseline_plans(["image", "text"], 32, tp=4)
    dm = sb.distmm_plans(profiles, cl, opts, 32)
    sep = dm["separate"]
    assert set(sep.towers["image"].ranks).isdisjoint(sep.towers["text"].ranks)  # each tower on its own ranks
    assert all(len(pe.nodes_of(t.ranks)) == 1 for t in sep.towers.values())  # placed: groups inside a node
    assert dm["auto_layout"] in ("separate", "colocated")
    tp2 = sb.separate_tp2_plan(sep)  # the Megatron-style tp pairs without data-parallel sums across the link
    assert {n: (t.ranks, t.tp) for n, t in tp2.towers.items()} == {n: (t.ranks, 2) for n, t in sep.towers.items()}
    assert sb.parse_args(["--plans", "distmm,megatron,separate_tp2"]).plans == ("distmm", "megatron", "separate_tp2")
    for plan in (*base.values(), sep, tp2):  # every plan priced on the emulated spec
        assert price_plan(plan, profiles, cl, opts).step_time > 0
    # rank 0's compute: distmm's rank 0 runs the image tower alone, DDP's runs both
    cost = price_plan(sep, profiles, cl, opts)
    fwd, bwd = sb.rank0_compute(sep, cost)
    image = cost.towers["image"]
    assert fwd == pytest.approx(
        image.forward_phase * (1 + image.contention / (image.forward_phase + image.backward_phase))
    )
    assert 0 < fwd < bwd and fwd + bwd < cost.step_time
    ddp_cost = price_plan(base["ddp"], profiles, cl, opts)
    assert sum(sb.rank0_compute(base["ddp"], ddp_cost)) == pytest.approx(
        sum(t.forward_phase + t.backward_phase + t.contention for t in ddp_cost.towers.values())
    )


def test_the_trivial_model_is_the_models_shape_at_next_to_no_cost():
    """The framework's cost per step is measured with towers of the benchmark's kinds and inputs
    whose forward and backward cost next to nothing (priced, not run, here)."""
    trivial, full = model_profiles(sb.TRIVIAL), model_profiles(sb.MODEL)
    assert set(trivial) == set(full) == set(sb.TRIVIAL["towers"])
    for name in full:
        assert sb.TRIVIAL["towers"][name]["arch"] == sb.MODEL["towers"][name]["arch"]
        assert trivial[name].flops_per_sample() * 100 < full[name].flops_per_sample()


def test_a_pairs_work_beyond_its_price_is_what_it_took_more():
    """The calibration times each tower under tp 2 and under FSDP2 on a node's two ranks; what the
    pair took beyond the priced compute and collectives (stretched as two busy ranks are) is the
    runtime's per-layer work, ``a + k * rows``, and never below 0."""
    import numpy as np

    from lightning_distmm.planner import PlannerOptions
    from lightning_distmm.planner.cost import stage_compute, tp_comm

    profile = model_profiles(sb.MODEL)["image"]
    node = pe.emulated_cluster(host(), pe.LinkSettings(400), concurrency=1.8)
    opts = PlannerOptions.from_any(pe.planner_options(0.0)).cost
    xs = np.asarray([8.0, 16.0])
    fc, bc = stage_compute(profile, node, opts, xs, 2, 1)
    tpc = tp_comm(profile, node, opts, xs, 2, 1)
    extra = 0.002 + 0.0001 * xs
    times = {
        int(b): (1.8 * (fc[i] + tpc[i] + extra[i]), 1.8 * (bc[i] + tpc[i] + 2 * extra[i])) for i, b in enumerate(xs)
    }
    fwd, bwd = pe.peer_work("tp", profile, node, opts, times)
    assert fwd == pytest.approx((0.002, 0.0001), rel=1e-6) and bwd == pytest.approx((0.004, 0.0002), rel=1e-6)
    faster = {b: (0.5 * f, 0.5 * w) for b, (f, w) in times.items()}  # quicker than priced: nothing added
    assert pe.peer_work("tp", profile, node, opts, faster) == ((0.0, 0.0), (0.0, 0.0))
    # FSDP2 over the pair: the whole tower's compute and a 2-rank group's per-layer gathers and scatters
    from lightning_distmm.planner.cost import shard_comm

    fc1, bc1 = stage_compute(profile, node, opts, xs, 1, 1)
    ag, agrs = shard_comm(profile, node, opts, 2, 1, 1, "full")
    times = {int(b): (1.8 * (fc1[i] + ag + extra[i]), 1.8 * (bc1[i] + agrs + extra[i])) for i, b in enumerate(xs)}
    fwd, bwd = pe.peer_work("fsdp", profile, node, opts, times)
    assert fwd == pytest.approx((0.002, 0.0001), rel=1e-6) and bwd == pytest.approx((0.002, 0.0001), rel=1e-6)
    # the AdamW step over DTensors: what it took beyond the plain step of the same share, added to
    # the priced step of every stage of that form (a stage of pp holds 1/pp of the tensors)
    import dataclasses

    from lightning_distmm.planner.cost import optimizer_time
    from lightning_distmm.planner.profiles.profile import MeasuredFit

    fit = MeasuredFit("cpu", [8, 16], (0.0, 0.001), (0.0, 0.002), (0.0, 1.0), profile.params, profile.params)
    fit.opt_time = 0.006
    measured = dataclasses.replace(profile, measured=fit)
    plain_tp = optimizer_time(measured, node, opts, 2, 1, "none", 2)
    assert plain_tp == pytest.approx(0.006 * 0.5, rel=0.2)  # about half the parameters per tp rank
    assert pe.peer_optimizer_work("tp", measured, node, opts, plain_tp + 0.004) == pytest.approx(0.004)
    assert pe.peer_optimizer_work("tp", measured, node, opts, 0.0) == 0.0
    fit.optimizer_overhead = {"tp": 0.004, "fsdp": 0.003}
    assert optimizer_time(measured, node, opts, 2, 2, "none", 2) == pytest.approx(
        optimizer_time(
            dataclasses.replace(profile, measured=dataclasses.replace(fit, optimizer_overhead={})),
            node,
            opts,
            2,
            2,
            "none",
            2,
        )
        + 0.002
    )
    with pytest.raises(ValueError, match="no pair measurement"):
        pe.peer_work("cp", profile, node, opts, times)


def test_statistics_and_table():
    s = sb.spread([1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0])
    assert (s["median"], s["q1"], s["q3"], s["min"], s["max"]) == (3.0, 2.0, 4.0, 1.0, 5.0)
    sp = sb.speedups({"distmm": 0.5, "ddp": 1.0, "fsdp": 0.4})
    assert sp["distmm"]["ddp"] == 2.0 and sp["ddp"]["distmm"] == 0.5 and sp["distmm"]["fsdp"] == pytest.approx(0.8)
    v = sb.verdicts({"distmm": 0.5, "ddp": 1.0, "fsdp": 0.4}, {"distmm": 0.5, "ddp": 0.9, "fsdp": 0.6})
    assert v[0] == "distmm wins against ddp: 2.00x measured, 1.80x predicted (the model agrees: -10%)"
    assert v[1].startswith("distmm loses to fsdp: 0.80x measured, 1.20x predicted (the model predicted the opposite)")
    # a measured tie has no winner to name: the prediction is judged by how far it is
    v = sb.verdicts({"distmm": 0.299, "ddp": 0.299}, {"distmm": 0.291, "ddp": 0.281})
    assert v[0] == "distmm ties with ddp: 1.00x measured, 0.97x predicted (the model agrees: -3%)"
    # the fast-link run: the right winner, the speedup 29% short
    v = sb.verdicts({"distmm": 0.486, "fsdp": 0.707}, {"distmm": 0.416, "fsdp": 0.432})
    assert (
        v[0]
        == "distmm wins against fsdp: 1.45x measured, 1.04x predicted (the right winner, but the predicted speedup is -29% off)"
    )
    times = {"distmm": 0.5, "ddp": 1.0, "fsdp": 0.4, "megatron": 0.8}
    plans = {
        k: {"towers": k, "predicted_s": t, "measured": sb.spread([t, t * 1.1, t * 0.9], [t])} for k, t in times.items()
    }
    result = {
        "plans": plans,
        "speedup": {"measured": sb.speedups(times), "predicted": sb.speedups(times)},
        "link": {"rate_mbit": 450, "measured_mbit": 430, "ratio": 0.78},
        "reference": {"ratio": 0.78, "model": "clip_vit_b32", "link_gbps": 100.0},
        "model": {"name": "m", "params": {"image": 1.8e6, "text": 3.7e5}},
        "batch": 32,
        "rounds": 3,
        "timed_steps": 6,
        "foreign_cores": 0.4,
        "verdicts": sb.verdicts(times, times),
        "notes": ["a note"],
    }
    plans["ddp"] |= {
        "rank0_parts_s": [[1.0, 0.5, 0.3, 0.5, 0.0]],
        "rank0_predicted_s": {"forward": 0.2, "backward": 0.4},
    }
    text = sb.markdown(result)
    assert "| ddp | 200 / 300 | 400 / 500 | 400 / 200 |" in text  # rest: 1000 - 300 - 500 measured
    assert "| fsdp | fsdp | 400 | 400 (380-420; 400) | +0% | 0.80x | 0.80x |" in text
    assert "| distmm | - | 2.00 (2.00) | 0.80 (0.80) | 1.60 (1.60) |" in text
    assert "distmm loses to fsdp" in text and "- a note" in text and "450 Mbit/s" in text
    # the seconds inside collectives, predicted beside what the worker's clock measured
    plans["ddp"] |= {
        "rank0_parts_s": [[1.0, 0.5, 0.3, 0.5, 0.0, 0.01, 0.02, 0.15]],
        "rank0_waits_s": {"forward": 0.0, "backward": 0.0, "other": 0.2},
    }
    assert "| ddp | 0 / 10 | 0 / 20 | 200 / 150 |" in sb.markdown(result)


def test_rank0_waits_price_the_collectives_where_the_clock_sees_them():
    profiles = model_profiles(sb.MODEL)
    cluster = pe.emulated_cluster(host(), pe.LinkSettings(500))
    options = pe.planner_options(0.0)
    plans = sb.baseline_plans(list(sb.MODEL["towers"]), 32)
    waits = {
        k: sb.rank0_waits(p, price_plan(p, profiles, cluster, options), profiles, cluster, options)
        for k, p in plans.items()
    }
    assert waits["ddp"]["forward"] == waits["ddp"]["backward"] == 0.0 and waits["ddp"]["other"] > 0
    assert (
        waits["fsdp"]["forward"] > 0 and waits["fsdp"]["backward"] > waits["fsdp"]["forward"]
    )  # gathers, then scatters too
    assert waits["megatron"]["forward"] == waits["megatron"]["backward"] > 0  # tp's all-reduces, half in each


def test_the_collective_clock_splits_its_intervals_by_the_steps_instructions():
    clock = script_module(ROOT / "benchmarks" / "collective_clock.py")
    spans = [("Forward", 0.0, 1.0), ("Backward", 1.0, 3.0)]
    got = clock.CollectiveClock.split([("a", 0.5, 1.5), ("b", 2.0, 2.5), ("c", 3.0, 3.25)], spans)
    assert got == {"Forward": 0.5, "Backward": 1.0, "other": 0.25}


def test_the_collective_clock_times_torch_distributed_and_puts_it_back(tmp_path):
    import torch
    import torch.distributed as dist

    from lightning_distmm.parallel import exchange

    if dist.is_initialized():
        pytest.skip("a process group of another test is still up in this worker")
    mod = script_module(ROOT / "benchmarks" / "collective_clock.py")
    original, bound = dist.all_reduce, exchange.all_gather_single
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    clock = mod.CollectiveClock()
    try:
        clock.install()
        assert dist.all_reduce is not original and exchange.all_gather_single is not bound
        dist.all_reduce(torch.ones(3))
        exchange.allreduce_sum([torch.ones(2)])  # posted, then waited: the wait is timed
        out = torch.empty(2)
        exchange.all_gather_single(out, torch.ones(2))
        names = [name for name, *_ in clock.take()]
        assert names == ["all_reduce", "all_reduce", "gradient_sum_wait", exchange.all_gather_single.__name__]
        assert clock.take() == []
    finally:
        clock.uninstall()
        dist.destroy_process_group()
    assert dist.all_reduce is original and exchange.all_gather_single is bound
