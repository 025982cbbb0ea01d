"""Context parallelism (cp) per tower: the plan's rules, and training equal to one process."""

import pytest
from distmm_testing import DeepCLIP, TinyCLIP, compare_with_reference

import lightning_distmm as ldm

CP_PLANS = {
    # TinyCLIP's ViT has 5 tokens (class + 4 patches): cp=2 pads them to 6 and masks the padded key
    "image-cp2+text1": (TinyCLIP, ldm.Plan(3, {"image": {"ranks": [0, 1], "cp": 2}, "text": {"ranks": [2]}})),
    "image-cp2-shard-full+text1": (
        TinyCLIP,
        ldm.Plan(3, {"image": {"ranks": [0, 1], "cp": 2, "shard": "full"}, "text": {"ranks": [2]}}),
    ),
    "image-dp2xcp2-shard-full+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "shard": "full"}, "text": {"ranks": [0]}}),
    ),
    "image-dp2xcp2+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "replica_batch": [5, 3]}, "text": {"ranks": [0]}}, 8),
    ),
    "image-cp2xpp2+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "pp": 2, "microbatch": 4}, "text": {"ranks": [0]}}),
    ),
    # padded captions (lengths 2..5 of 6): the causal and padding masks span the split, EOS pooling after the gather
    "text-cp2+image1": (TinyCLIP, ldm.Plan(3, {"image": {"ranks": [2]}, "text": {"ranks": [0, 1], "cp": 2}})),
    # 5 image tokens over 4 ranks: padded to 8, rank 3 holds padding only
    "image-cp4+text-cp2": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 4}, "text": {"ranks": [0, 1], "cp": 2}}),
    ),
    "image-cp2xtp2+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "tp": 2}, "text": {"ranks": [0]}}),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(CP_PLANS))
def test_context_parallel_towers_are_exact(name, optimizer, tmp_path):
    cls, plan = CP_PLANS[name]
    lr = 0.05 if optimizer == "sgd" else 0.01
    compare_with_reference(lambda: cls(optimizer, lr=lr), plan, plan.world_size, 8, 3, tmp_path).assert_exact()
