"""Cost-model terms for gloo collectives on CPU nodes joined by a link (docs/planner.md, "Gloo across a link"):
one flat ring, a reduce-scatter that reduces the whole tensor, waits on the link that take no core
(a shared host does not stretch them) and gradient sums whose link part hides behind the backwards
that follow. Each measured on the emulated two-node cluster
(benchmarks/results/collectives_emulated.txt); here the formulas' structure only."""

from __future__ import annotations

import pytest

from lightning_distmm.core.plan import Plan
from lightning_distmm.planner import model_profiles, price_plan
from lightning_distmm.planner.cost import CostOptions
from lightning_distmm.planner.cost.comm import allreduce_time, flat_ring_factor, shard_comm
from lightning_distmm.planner.machine.cluster import GB, Cluster, Device, Link

OPTS = CostOptions(precision="32", overlap_grad_sync=False)
PRICE = {"precision": "32", "overlap_grad_sync": False}
MODEL = {
    "embed_dim": 32,
    "towers": {
        "image": {"arch": "vit", "img_size": 32, "patch_size": 8, "width": 64, "layers": 2, "heads": 2},
        "text": {"arch": "clip_text", "vocab_size": 64, "context_length": 16, "width": 32, "layers": 2, "heads": 2},
    },
}


def two_nodes(concurrency: float = 1.0, link: float = 30e6) -> Cluster:
    dev = Device("cpu", 8 * GB, 50e9, 20e9, 1.0, 5e-6, concurrency=concurrency)
    return Cluster("cpu2x2", 2, 2, dev, Link(1e9, 50e-6), Link(link, 100e-6))


def test_a_flat_ring_loads_each_link_with_r_minus_1_over_r():
    assert flat_ring_factor(4, 2) == pytest.approx(1.5)
    assert flat_ring_factor(2, 2) == pytest.approx(1.0)  # one member per node: the same ring
    assert flat_ring_factor(4, 1) == pytest.approx(1.0)  # no link crossed
    cl = two_nodes()
    B = 8e6
    fast = Cluster("x", 2, 2, cl.device, cl.intra, Link(1e15, 100e-6))
    link_part = allreduce_time(cl, B, 4, 2) - allreduce_time(fast, B, 4, 2)
    assert link_part == pytest.approx(1.5 * B / cl.inter.effective, rel=1e-6)


def test_a_gloo_reduce_scatter_moves_twice_a_gather():
    p = model_profiles(MODEL)["image"]
    fwd, bwd = shard_comm(p, two_nodes(), OPTS, 4, 1, 1)
    assert bwd == pytest.approx(3 * fwd)  # the weights gathered again, and a scatter of twice the bytes


def plan(**tower: object) -> Plan:
    return Plan(4, {n: {"ranks": [0, 1, 2, 3], **tower} for n in ("image", "text")}, global_batch=32)


def test_waits_on_the_link_are_not_stretched_by_a_shared_host():
    profiles = model_profiles(MODEL)
    for conc in (1.5, 1.8):
        cost = price_plan(plan(shard="full"), profiles, two_nodes(conc), PRICE)
        for tc in cost.towers.values():
            assert tc.link_waits and all(w > 0 for w in (tc.link_waits[0], tc.link_waits[-1]))
            busy = sum(tc.segments) + tc.optimizer - sum(tc.link_waits)
            # colocated on 2 ranks per node: every phase stretched by conc, its waits not
            assert tc.contention == pytest.approx((conc - 1) * busy, rel=1e-6)


def test_cpu_gradient_sums_hide_their_link_wait_behind_the_backwards_after_them():
    profiles = model_profiles(MODEL)
    cost = price_plan(plan(), profiles, two_nodes(), PRICE)
    towers = cost.towers.values()
    total = sum(tc.dp_allreduce for tc in towers)
    exposed = sum(tc.dp_exposed for tc in towers)
    assert 0 < exposed < total  # the first tower's link wait overlaps the second's backward
    assert exposed >= min(tc.dp_allreduce for tc in towers)  # the last tower's sum is all exposed
    # with a link too fast to matter only the sums' own work is left, and nothing hides it
    quick = price_plan(plan(), profiles, two_nodes(link=1e15), PRICE)
    assert sum(t.dp_exposed for t in quick.towers.values()) == pytest.approx(
        sum(t.dp_allreduce for t in quick.towers.values())
    )


def test_the_runtimes_own_work_is_priced_where_it_runs():
    import dataclasses

    from lightning_distmm.planner import measured_profile
    from lightning_distmm.planner.profiles.profile import MeasuredFit

    base = model_profiles(MODEL)
    fit = MeasuredFit("cpu", [4, 16], (0.0, 1e-3), (0.0, 2e-3), (0.0, 1e3), 1000, 1000)
    over = {"tp": ((0.010, 0.0), (0.020, 0.0)), "fsdp": ((0.004, 0.0), (0.006, 0.0))}
    profiles = {
        n: measured_profile(n, dataclasses.replace(fit, runtime_overhead=over), False, 32, p) for n, p in base.items()
    }
    plain = {n: measured_profile(n, fit, False, 32, p) for n, p in base.items()}
    cl = two_nodes()

    def forward(plan_: Plan, profs: dict) -> float:
        return sum(t.forward_phase for t in price_plan(plan_, profs, cl, PRICE).towers.values())

    # tp: one microbatch per replica, 10 ms more forward per tower; the replicated plan pays nothing
    assert forward(plan(tp=2), profiles) - forward(plan(tp=2), plain) == pytest.approx(2 * 0.010)
    assert forward(plan(), profiles) == pytest.approx(forward(plan(), plain))
    assert forward(plan(shard="full"), profiles) - forward(plan(shard="full"), plain) == pytest.approx(2 * 0.004)


def test_measure_wrapped_says_what_a_wrapper_adds():
    import torch
    from torch import nn

    from lightning_distmm.planner import measure_wrapped

    class Twice(nn.Module):  # the same work done twice: what a wrapper adds is the module's own time
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.inner(x))

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512))
    got = measure_wrapped(module, lambda b: [torch.randn(b, 512)], {"twice": Twice, "same": lambda m: m})
    assert set(got) == {"twice", "same"}
    for (fa, fc), (ba, bc) in got.values():
        assert min(fa, fc, ba, bc) >= 0
    twice = got["twice"][0][0] + 16 * got["twice"][0][1]
    same = got["same"][0][0] + 16 * got["same"][0][1]
    assert twice > same  # the extra pass shows; a wrapper that adds nothing adds about nothing
