"""Every plan trains exactly like one process on the same global batches."""

import lightning as L
import pytest
import torch
from distmm_testing import DeepCLIP, GroupedDeepCLIP, TinyCLIP, compare_with_reference, loader, max_param_diff

import lightning_distmm as ldm

PLANS = {
    "colocated-2": (2, 8, ldm.Plan(2, {"image": {"ranks": [0, 1]}, "text": {"ranks": [0, 1]}})),
    "image2-text1": (3, 8, ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})),
    "b10-image3-uneven-text1": (
        4,
        10,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2], "replica_batch": [4, 3, 3]}, "text": {"ranks": [3]}}, 10),
    ),
    "b9-image2-text2": (4, 9, ldm.Plan(4, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2, 3]}})),
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(PLANS))
def test_matches_single_process(name, optimizer, tmp_path):
    world, batch, plan = PLANS[name]
    lr = 0.05 if optimizer == "sgd" else 0.01
    result = compare_with_reference(lambda: TinyCLIP(optimizer, lr=lr), plan, world, batch, 3, tmp_path)
    assert len(result.distributed_losses) == 3
    result.assert_exact()


@pytest.mark.slow
def test_frozen_tower_lit(tmp_path):
    """LiT: a frozen text tower runs without gradients on its own rank; the rest matches one process."""
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})
    result = compare_with_reference(lambda: TinyCLIP("adamw", lr=0.01, frozen_text=True), plan, 3, 8, 3, tmp_path)
    result.assert_exact()
    assert max_param_diff(result.distributed.text, result.initial.text) == 0.0


def test_registered_strategies():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, method in [("distmm", "popen"), ("distmm_spawn", "spawn"), ("distmm_notebook", "fork")]:
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, ldm.DistMMStrategy) and strategy._start_method == method
    trainer = L.Trainer(strategy="distmm_notebook", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ldm.DistMMStrategy)


@pytest.mark.slow
def test_default_plan_is_priced_and_exact(tmp_path):
    """No plan given: the plan the cost model prices cheapest from the towers' counts, still exact."""
    from lightning_distmm.parallel.flops import tower_counts

    counts = tower_counts(TinyCLIP().tower_specs(), next(iter(loader(1))))
    assert all(c["flops"] > 0 and c["ops"] > 0 and c["params"] > 0 for c in counts.values())
    assert {c["embed_dim"] for c in counts.values()} == {8}
    compare_with_reference(lambda: TinyCLIP("sgd", lr=0.05), None, 3, 8, 2, tmp_path).assert_exact()


@pytest.mark.slow
def test_recompute_is_exact(tmp_path):
    """Activation checkpointing of a tower changes memory, not the result."""
    plan = ldm.Plan(2, {"image": {"ranks": [0], "recompute": True}, "text": {"ranks": [1], "recompute": True}})
    compare_with_reference(lambda: TinyCLIP("adamw", lr=0.01), plan, 2, 8, 2, tmp_path).assert_exact()


@pytest.mark.slow
def test_auto_plan_trains_exactly(tmp_path):
    """plan='auto': rank 0 measures the towers and plans, every rank runs that plan."""
    compare_with_reference(lambda: TinyCLIP("sgd", lr=0.05), "auto", 2, 8, 2, tmp_path).assert_exact()


@pytest.mark.slow
def test_auto_plan_follows_the_modules_loss(tmp_path):
    """A module asking for two sync groups gets an auto plan with the distmm schedule (its loss)."""

    class Grouped(TinyCLIP):
        sync_groups = 2

    compare_with_reference(lambda: Grouped("sgd", lr=0.05), "auto", 2, 8, 2, tmp_path).assert_exact()


MICRO_PLANS = {
    "cached-mb3": ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "microbatch": 3, "schedule": "cached"},
            "text": {"ranks": [2], "microbatch": 3, "schedule": "cached"},
        },
    ),
    "gpipe-mb2": ldm.Plan(3, {"image": {"ranks": [0, 1], "microbatch": 2}, "text": {"ranks": [2], "microbatch": 5}}),
    "colocated-cached-mb1": ldm.Plan(
        2, {"image": {"ranks": [0, 1], "microbatch": 1, "schedule": "cached"}, "text": {"ranks": [0, 1]}}
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MICRO_PLANS))
def test_microbatched_schedules_are_exact(name, tmp_path):
    """Microbatches (gpipe keeps their activations, cached recomputes them) give the whole-batch gradient."""
    plan = MICRO_PLANS[name]
    compare_with_reference(lambda: TinyCLIP("adamw", lr=0.01), plan, plan.world_size, 10, 3, tmp_path).assert_exact()


def test_cached_recompute_replays_dropout():
    """The recomputed microbatch sees the dropout masks of its first forward."""
    import torch

    from lightning_distmm.parallel.step.passes import _restored_rng, _rng_state

    drop = torch.nn.Dropout(0.5)
    x = torch.ones(1000)
    state = _rng_state(torch.device("cpu"))
    first = drop(x)
    after = drop(x)
    with _restored_rng(state, torch.device("cpu")):
        again = drop(x)
    assert torch.equal(first, again) and not torch.equal(first, after)


class SigLIP(TinyCLIP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logit_bias = torch.nn.Parameter(torch.tensor(-10.0))

    def interaction_loss(self, features):
        return ldm.losses.siglip_loss(features["image"], features["text"], self.logit_scale, self.logit_bias)


class ThreeTowers(TinyCLIP):
    """A third tower (a second image encoder on a coarser view) and pairwise CLIP losses."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from distmm_testing import EMBED
        from timm.models.vision_transformer import VisionTransformer

        self.coarse = VisionTransformer(
            img_size=8, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=EMBED, qkv_bias=False
        )

    def towers(self):
        return {**super().towers(), "coarse": ldm.Tower(self.coarse, input="image")}

    def interaction_loss(self, f):
        clip = ldm.losses.clip_loss
        return (
            clip(f["image"], f["text"], self.logit_scale)
            + clip(f["coarse"], f["text"], self.logit_scale)
            + 0.5 * clip(f["image"], f["coarse"], self.logit_scale)
        )


class WholeBatchLoss(TinyCLIP):
    """A loss that never asks for its rows: computed on every rank, still counted once."""

    def interaction_loss(self, f):
        return ((f["image"] - f["text"]) ** 2).mean() + 0.0 * self.logit_scale


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls, plan",
    [
        (SigLIP, ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})),
        (ThreeTowers, ldm.Plan(4, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}, "coarse": {"ranks": [3]}})),
        (
            ThreeTowers,
            ldm.Plan(3, {"image": {"ranks": [0, 1, 2]}, "text": {"ranks": [0]}, "coarse": {"ranks": [1, 2]}}),
        ),
        (WholeBatchLoss, ldm.Plan(3, {"image": {"ranks": [0]}, "text": {"ranks": [1, 2]}})),
    ],
    ids=["siglip", "three-towers-separate", "three-towers-overlapping", "whole-batch-loss"],
)
def test_other_losses_and_towers(cls, plan, tmp_path):
    compare_with_reference(lambda: cls("adamw", lr=0.01), plan, plan.world_size, 9, 3, tmp_path).assert_exact()


TP_PLANS = {
    "image-tp2+text1": ldm.Plan(3, {"image": {"ranks": [0, 1], "tp": 2}, "text": {"ranks": [2]}}),
    "image-dp2xtp2": ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "tp": 2}, "text": {"ranks": [0, 2]}}),
    "text-tp2+image-cached": ldm.Plan(
        3, {"image": {"ranks": [0], "microbatch": 4, "schedule": "cached"}, "text": {"ranks": [1, 2], "tp": 2}}
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, optimizer, clip",
    [(n, "adamw", None) for n in TP_PLANS] + [("image-dp2xtp2", "sgd", 0.5)],
)
def test_tensor_parallel_towers_are_exact(name, optimizer, clip, tmp_path):
    """TP changes float summation order; with AdamW + clipping Adam amplifies those 1e-7 differences
    in near-zero gradient entries past 1e-5, so clipping is checked with SGD (the norm is what matters)."""
    plan = TP_PLANS[name]
    lr = 0.01 if optimizer == "adamw" else 0.05
    compare_with_reference(
        lambda: TinyCLIP(optimizer, lr=lr), plan, plan.world_size, 10, 3, tmp_path, gradient_clip_val=clip
    ).assert_exact()


PP_PLANS = {
    "image-pp2+text1": ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 3}, "text": {"ranks": [2]}}),
    "image-pp2-cached+text1": ldm.Plan(
        3, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 2, "schedule": "cached"}, "text": {"ranks": [2]}}
    ),
    "image-tp2xpp2+text-colocated": ldm.Plan(
        4, {"image": {"ranks": [0, 1, 2, 3], "pp": 2, "tp": 2, "microbatch": 4}, "text": {"ranks": [0]}}
    ),
    "text-pp2-cached+image1": ldm.Plan(
        3, {"image": {"ranks": [0]}, "text": {"ranks": [1, 2], "pp": 2, "microbatch": 3, "schedule": "cached"}}
    ),
    "text-tp2xpp2+image-colocated": ldm.Plan(
        4, {"image": {"ranks": [3]}, "text": {"ranks": [0, 1, 2, 3], "pp": 2, "tp": 2, "microbatch": 5}}
    ),
    "image-dp2xpp2+text1": ldm.Plan(
        4, {"image": {"ranks": [0, 1, 2, 3], "pp": 2, "replica_batch": [6, 4]}, "text": {"ranks": [0]}}, 10
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PP_PLANS))
def test_pipeline_parallel_towers_are_exact(name, tmp_path):
    plan = PP_PLANS[name]
    compare_with_reference(lambda: DeepCLIP("adamw", lr=0.01), plan, plan.world_size, 10, 2, tmp_path).assert_exact()


DISTMM_PLANS = {
    "image-pp2+text1": ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "pp": 2, "microbatch": 2, "schedule": "distmm"},
            "text": {"ranks": [2], "microbatch": 2, "schedule": "distmm"},
        },
    ),
    "image-tp2xpp2+text-colocated": ldm.Plan(
        4,
        {
            "image": {"ranks": [0, 1, 2, 3], "pp": 2, "tp": 2, "microbatch": 2, "schedule": "distmm"},
            "text": {"ranks": [0], "schedule": "distmm"},
        },
    ),
    "lit-frozen-text": ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "pp": 2, "microbatch": 2, "schedule": "distmm"},
            "text": {"ranks": [2], "schedule": "distmm"},
        },
    ),
    "text-pp2+image-dp2-uneven": ldm.Plan(
        4,
        {
            "image": {"ranks": [0, 3], "replica_batch": [6, 3], "schedule": "distmm"},
            "text": {"ranks": [1, 2], "pp": 2, "microbatch": 2, "schedule": "distmm"},
        },
        9,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISTMM_PLANS))
def test_distmm_schedule_is_exact_for_its_grouped_loss(name, tmp_path):
    """DistMM-Pipe (two sync groups, a batch-sync each) against one process computing the same grouped loss."""
    plan = DISTMM_PLANS[name]
    batch = plan.global_batch or 10
    frozen = name.startswith("lit")
    compare_with_reference(
        lambda: GroupedDeepCLIP("adamw", lr=0.01, frozen_text=frozen), plan, plan.world_size, batch, 2, tmp_path
    ).assert_exact()


def test_grouped_loss_is_not_the_whole_batch_loss():
    """The two losses really differ (so the test above would notice a schedule that ignored the groups),
    and each group's loss only sees its own rows."""
    L.seed_everything(0)
    module = GroupedDeepCLIP()
    batch = next(iter(loader(10)))
    with torch.no_grad():
        grouped = module.contrastive_loss(batch)
        module.sync_groups = 1
        whole = module.contrastive_loss(batch)
        features = module.encode(batch)
    assert abs(float(grouped) - float(whole)) > 1e-3
    halves = [module.interaction_loss({k: f[a:b] for k, f in features.items()}) for a, b in ((0, 5), (5, 10))]
    assert float(grouped) == pytest.approx(float(sum(halves) / 2), abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["colocated-2", "image-dp2xtp2", "image-dp2xpp2+text1"])
def test_gradient_buckets_are_exact(name, tmp_path):
    """Gradient sums posted bucket by bucket during the backward (1 KB buckets: many per tower),
    for replicas spanning the world, tensor-parallel ones (DTensor gradients) and pipelined ones."""
    plan = {"colocated-2": PLANS["colocated-2"][2], **TP_PLANS, **PP_PLANS}[name]
    strategy = ldm.DistMMStrategy(plan, start_method="fork", bucket_cap_mb=0.001)
    compare_with_reference(
        lambda: DeepCLIP("adamw", lr=0.01), strategy, plan.world_size, 10, 2, tmp_path
    ).assert_exact()


def test_the_first_gradient_bucket_is_small(tmp_path):
    """As in DDP, the first bucket (the last layers) holds up to ``first_cap`` bytes and the others up
    to ``cap``, so the first sum is posted early in the backward; the hooks still post every bucket."""
    import torch.distributed as dist

    from lightning_distmm.parallel.buckets import GradientBuckets

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
        params = list(model.parameters())
        buckets = GradientBuckets(params, None, cap=10_000, first_cap=140)  # last weight (128 B) + bias (8 B)
        assert [len(b) for b in buckets.buckets] == [2, 4]
        assert buckets.buckets[0] == [params[-1], params[-2]]
        buckets.arm()
        model(torch.randn(3, 16)).sum().backward()
        assert buckets.next == 2
        for posted in buckets.finish():
            posted.wait()
    finally:
        dist.destroy_process_group()


def test_gradient_buckets_post_during_the_backward(tmp_path):
    """The buckets' sums are posted by the gradient hooks as the backward makes them final, in
    bucket order, before finish() (one-rank gloo group)."""
    import torch.distributed as dist

    from lightning_distmm.parallel.buckets import GradientBuckets

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        params = list(model.parameters())
        buckets = GradientBuckets(params, None, cap=40)  # a bias or weight or two per bucket
        assert len(buckets.buckets) > 2 and buckets.buckets[0][0] is params[-1]  # last layer first
        x = torch.randn(3, 4)
        model(x).sum().backward()
        expected = [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        buckets.attach()  # the gradients become views of the buckets' buffers
        buckets.arm()
        model(x).sum().backward()
        assert buckets.next == len(buckets.buckets)  # all posted by the hooks
        for posted in buckets.finish():
            posted.wait()
        assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))  # a sum over one rank
        flats = {f.untyped_storage().data_ptr() for f in buckets.flat if f is not None}
        assert {p.grad.untyped_storage().data_ptr() for p in params} <= flats  # accumulated in place, no copy
        assert not any(p._post_accumulate_grad_hooks for p in params)  # hooks removed
    finally:
        dist.destroy_process_group()
