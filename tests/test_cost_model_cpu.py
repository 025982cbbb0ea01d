"""Cost-model terms for CPU hosts (docs/planner.md, "CPU ranks"): devices that share a
host slow each other down (``Device.concurrency``), a measured optimizer step, the runtime's cost
defaults, pricing any runtime plan. No timing assertions: measured profiles only feed orderings
that follow from the schedules' structure or from a 30x imbalance."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_distmm.planner import (
    Plan,
    make_plan,
    measure_tower,
    measured_profile,
    plan_choices,
    price_plan,
    runtime_cost_defaults,
)
from lightning_distmm.planner.cost import RECOMPUTE, CostOptions, shared_host_phases
from lightning_distmm.planner.machine.cluster import GB, Cluster, Device, Link
from lightning_distmm.planner.profiles.profile import MeasuredFit

OPTS = CostOptions(precision="32", overlap_grad_sync=False)


def cpu_cluster(concurrency: float = 1.0) -> Cluster:
    dev = Device("cpu", 8 * GB, 50e9, 20e9, 1.0, 5e-6, concurrency=concurrency)
    return Cluster("cpu2", 1, 2, dev, Link(1e9, 100e-6), Link(1e9, 100e-6))


def fit(fwd_per_sample: float, params: int = 1000, opt: float | None = None) -> MeasuredFit:
    return MeasuredFit(
        "cpu", [1, 2], (0.0, fwd_per_sample), (0.0, 2 * fwd_per_sample), (0.0, 1e3), params, params, opt_time=opt
    )


def profiles(image: float = 3e-3, text: float = 1e-3, opt: float | None = 0.0) -> dict:
    return {n: measured_profile(n, fit(t, opt=opt), False, 16) for n, t in (("image", image), ("text", text))}


COLOCATED = Plan(2, {"image": {"ranks": [0, 1]}, "text": {"ranks": [0, 1]}}, global_batch=64)
SEPARATE = Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}}, global_batch=64)


def test_shared_host_phases():
    ranks = {"image": [0], "text": [1]}
    # separate: stretched while both compute, i.e. T + (c - 1) * min(T, other)
    out = shared_host_phases({"image": 3.0, "text": 1.0}, ranks, 2, 1.5, colocated=False)
    assert out == pytest.approx({"image": 3.5, "text": 1.5})
    # a node of one device: nothing shares it
    assert shared_host_phases({"image": 3.0, "text": 1.0}, ranks, 1, 1.5, colocated=False) == {
        "image": 3.0,
        "text": 1.0,
    }
    # 4 ranks stretched 2x are 2 ranks' worth of cores: three busy share them (1.5x), then two run
    # at full speed once the text rank is done (processor sharing: the freed share serves them)
    out = shared_host_phases({"image": 3.0, "text": 1.0}, {"image": [0, 1], "text": [2]}, 4, 2.0, colocated=False)
    assert out == pytest.approx({"image": 1.5 + 2.0, "text": 1.5})
    # every rank busy: the measured stretch until the lighter tower's rank is done, then 3 on 2 cores
    out = shared_host_phases({"image": 3.0, "text": 1.0}, {"image": [0, 1, 2], "text": [3]}, 4, 2.0, colocated=False)
    assert out == pytest.approx({"image": 2.0 + 2.0 * 1.5, "text": 2.0})
    # colocated: every rank computes at once
    out = shared_host_phases({"image": 3.0, "text": 1.0}, {"image": [0, 1], "text": [0, 1]}, 2, 1.5, colocated=True)
    assert out == pytest.approx({"image": 4.5, "text": 1.5})


def test_concurrency_in_the_step():
    p = profiles()
    base = {
        name: price_plan(plan, p, cpu_cluster(1.0), {"precision": "32", "overlap_grad_sync": False})
        for name, plan in (("colocated", COLOCATED), ("separate", SEPARATE))
    }
    slow = {
        name: price_plan(plan, p, cpu_cluster(1.5), {"precision": "32", "overlap_grad_sync": False})
        for name, plan in (("colocated", COLOCATED), ("separate", SEPARATE))
    }
    c = base["colocated"]
    compute = sum(t.forward_phase + t.backward_phase + t.optimizer for t in c.towers.values())
    assert slow["colocated"].step_time - c.step_time == pytest.approx(0.5 * compute)
    # separate: only the text tower's phases overlap the image tower's
    s = base["separate"].towers
    overlap = s["text"].forward_phase + s["text"].backward_phase + s["text"].optimizer
    assert slow["separate"].step_time - base["separate"].step_time == pytest.approx(0.5 * overlap)
    assert slow["separate"].towers["image"].contention == pytest.approx(0.5 * overlap)


def test_concurrency_round_trips_and_defaults():
    cl = cpu_cluster(1.37)
    assert Cluster.from_dict(cl.to_dict()).device.concurrency == pytest.approx(1.37)
    assert "concurrency" not in cpu_cluster(1.0).to_dict()["device"]
    assert Cluster.from_dict(cpu_cluster(1.0).to_dict()).device.concurrency == 1.0


def test_measured_optimizer_step_is_used():
    p = profiles(opt=0.02)
    cost = price_plan(SEPARATE, p, cpu_cluster(), {"precision": "32"})
    assert cost.towers["image"].optimizer == pytest.approx(0.02)
    unmeasured = price_plan(SEPARATE, profiles(opt=None), cpu_cluster(), {"precision": "32"})
    assert unmeasured.towers["image"].optimizer == pytest.approx(1000 * 32 / 20e9)  # Adam traffic / bandwidth


def test_measure_tower_times_adamw_and_leaves_the_module_alone():
    import torch
    from torch import nn

    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    before = [p.detach().clone() for p in m.parameters()]
    f = measure_tower(m, lambda b: [torch.randn(b, 16)], (2, 4), repeats=1)
    assert f.opt_time is not None and f.opt_time > 0
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    frozen = measure_tower(m, lambda b: [torch.randn(b, 16)], (2,), repeats=1, frozen=True)
    assert frozen.opt_time is None


def test_runtime_cost_defaults():
    d = runtime_cost_defaults({"max_tp": 1}, "cpu")
    assert d["overlap_grad_sync"] is False and d["precision"] == "32" and d["max_tp"] == 1
    assert "precision" not in runtime_cost_defaults(None, "meta")
    assert runtime_cost_defaults(None, "meta")["overlap_grad_sync"] is True  # off CPU the buckets overlap
    kept = runtime_cost_defaults({"cost": {"precision": "bf16-mixed", "overlap_grad_sync": True}}, "cpu")
    assert "precision" not in kept and "overlap_grad_sync" not in kept


def test_plan_choices_follow_the_runtime():
    plan = Plan(
        2,
        {"image": {"ranks": [0], "microbatch": 8, "schedule": "cached"}, "text": {"ranks": [1], "recompute": True}},
        global_batch=64,
    )
    choices, ranks = plan_choices(plan)
    assert (choices["image"].microbatch, choices["image"].K, choices["image"].schedule) == (8, 8, "cached")
    assert (choices["text"].microbatch, choices["text"].K, choices["text"].schedule) == (64, 1, RECOMPUTE)
    assert ranks == {"image": [0], "text": [1]}
    uneven = Plan(3, {"image": {"ranks": [0, 1], "replica_batch": [6, 4]}, "text": {"ranks": [2]}}, global_batch=10)
    assert plan_choices(uneven)[0]["image"].replica_batch == (6, 4)


def test_structural_orderings_and_the_planners_pick():
    """Orderings that follow from the model's structure, on synthetic profiles."""
    p = profiles(image=3e-3, text=0.1e-3)
    o = {"precision": "32", "overlap_grad_sync": False}
    cl = cpu_cluster(1.1)
    t = {
        name: price_plan(plan, p, cl, o).step_time
        for name, plan in {
            "colocated": COLOCATED,
            "separate": SEPARATE,
            "recompute": Plan(
                2, {"image": {"ranks": [0, 1], "recompute": True}, "text": {"ranks": [0, 1]}}, global_batch=64
            ),
            "cached": Plan(
                2,
                {"image": {"ranks": [0, 1], "microbatch": 8, "schedule": "cached"}, "text": {"ranks": [0, 1]}},
                global_batch=64,
            ),
        }.items()
    }
    assert t["colocated"] < t["separate"]  # a 30x heavier image tower: halving it beats giving it a rank
    assert t["colocated"] < t["recompute"] and t["colocated"] < t["cached"]
    plan, report = make_plan(
        None, cl, 64, {"max_tp": 1, "max_pp": 1, "schedules": ["gpipe", "cached"], "recompute": False, **o}, profiles=p
    )
    assert plan.colocated and report.step_time <= min(t.values()) + 1e-12


def test_predicted_ordering_on_measured_towers():
    """A measured tower far heavier than the other (32 tokens through a 190K-parameter MLP vs one
    small linear layer): colocated is predicted faster than separate."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    heavy = nn.Sequential(nn.Linear(96, 384), nn.GELU(), nn.Linear(384, 384), nn.GELU(), nn.Linear(384, 16))
    light = nn.Linear(4, 16)
    measured = {
        "image": measured_profile(
            "image", measure_tower(heavy, lambda b: [torch.randn(b, 32, 96)], (8, 32), repeats=2), False, 16
        ),
        "text": measured_profile(
            "text", measure_tower(light, lambda b: [torch.randn(b, 4)], (8, 32), repeats=2), False, 16
        ),
    }
    cl = dataclasses.replace(cpu_cluster(), device=dataclasses.replace(cpu_cluster().device, concurrency=1.0))
    o = {"precision": "32", "overlap_grad_sync": False}
    assert price_plan(COLOCATED, measured, cl, o).step_time < price_plan(SEPARATE, measured, cl, o).step_time


def test_concurrency_is_cached_only_when_measured_quietly(tmp_path, monkeypatch):
    from lightning_distmm.planner.measure import local as measure_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(measure_mod, "_measure_concurrency", lambda devices, threads: (2.5, False))
    busy = measure_mod.measure_local_cpu(devices=2, measure_gloo=False, measure_concurrency=True)
    assert busy.device.concurrency == 2.5  # used for this call ...
    monkeypatch.setattr(measure_mod, "_measure_concurrency", lambda devices, threads: (1.1, True))
    quiet = measure_mod.measure_local_cpu(devices=2, measure_gloo=False, measure_concurrency=True)
    assert quiet.device.concurrency == 1.1  # ... but not cached: measured again
    monkeypatch.setattr(
        measure_mod, "_measure_concurrency", lambda devices, threads: pytest.fail("cached value not used")
    )
    assert (
        measure_mod.measure_local_cpu(devices=2, measure_gloo=False, measure_concurrency=True).device.concurrency == 1.1
    )
    assert measure_mod.measure_local_cpu(devices=1, measure_gloo=False).device.concurrency == 1.0


@pytest.mark.slow
def test_concurrency_probe_measures_this_host():
    from lightning_distmm.planner import ConcurrencyProbe, host_busy_seconds

    before = host_busy_seconds()
    with ConcurrencyProbe(2, 1) as probe:
        c = probe.measure(rounds=1, iters=3, attempts=1)
    assert c >= 1.0 and isinstance(probe.quiet, bool) and not probe.procs
    if before is not None:
        assert host_busy_seconds() > before
