"""Sharded pipeline stages and the ``distmm`` schedule with sharded towers train exactly like one process.

A pipelined tower with ``shard: full`` shards each stage over that stage's replicas (FSDP2 over the
stage's blocks and a module for the rest of the stage); the ``distmm`` schedule interleaves one
sync group's backwards with the next sync group's forwards through FSDP's hooks.
"""

import pytest
from distmm_testing import DeepCLIP, GroupedDeepCLIP, compare_with_reference

import lightning_distmm as ldm

PLANS = {
    # image: 2 replicas x 2 stages (stage 0 on ranks 0 and 2, stage 1 on 1 and 3), each stage sharded
    # over its two replicas; text sharded over the last stages' ranks
    "image-pp2-gpipe": ldm.Plan(
        4,
        {
            "image": {"ranks": [0, 1, 2, 3], "pp": 2, "shard": "full", "microbatch": 2},
            "text": {"ranks": [1, 3], "shard": "full"},
        },
    ),
    "image-pp2-cached": ldm.Plan(
        4,
        {
            "image": {"ranks": [0, 1, 2, 3], "pp": 2, "shard": "full", "microbatch": 2, "schedule": "cached"},
            "text": {"ranks": [1, 3], "shard": "full", "schedule": "cached"},
        },
    ),
    "image-pp2-distmm": ldm.Plan(
        4,
        {
            "image": {"ranks": [0, 1, 2, 3], "pp": 2, "shard": "full", "microbatch": 2, "schedule": "distmm"},
            "text": {"ranks": [1, 3], "shard": "full", "schedule": "distmm"},
        },
    ),
    # pp = 1: the distmm schedule's two sync groups of microbatches through one sharded tower
    "image-distmm-mb": ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "shard": "full", "microbatch": 2, "schedule": "distmm"},
            "text": {"ranks": [2], "microbatch": 2, "schedule": "distmm"},
        },
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(PLANS))
def test_sharded_pipelines_and_distmm_match_single_process(name, optimizer, tmp_path):
    plan = PLANS[name]
    lr = 0.05 if optimizer == "sgd" else 0.01
    model = GroupedDeepCLIP if "distmm" in name else DeepCLIP
    # 12 rows: 6 per replica (3 per replica and sync group under distmm), in microbatches of 2
    result = compare_with_reference(lambda: model(optimizer, lr=lr), plan, plan.world_size, 12, 3, tmp_path)
    result.assert_exact()


def test_uneven_microbatch_counts_of_a_sharded_tower_are_refused():
    """FSDP's collectives pair the replicas' microbatches one for one: a batch that gives a sharded
    tower's replicas different numbers of microbatches would hang, so it is refused (on every rank)."""
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "shard": "full", "microbatch": 2}, "text": {"ranks": [2]}})
    plan.check_global_batch(8)  # 4 + 4 rows: 2 + 2 microbatches
    with pytest.raises(ldm.PlanError, match=r"replicas get \[3, 2\] rows .* into \[2, 1\] microbatches"):
        plan.check_global_batch(5)
    grouped = ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "shard": "full", "microbatch": 2, "schedule": "distmm"},
            "text": {"ranks": [2], "schedule": "distmm"},
        },
    )
    grouped.check_global_batch(12)
    with pytest.raises(ldm.PlanError, match="in sync group 0 \\(5 rows\\)"):
        grouped.check_global_batch(10)
    unsharded = ldm.Plan(3, {"image": {"ranks": [0, 1], "microbatch": 2}, "text": {"ranks": [2]}})
    unsharded.check_global_batch(5)  # replicated towers do not pair their microbatches


def test_sharded_pipeline_plans_are_accepted():
    plan = ldm.Plan(2, {"image": {"ranks": [0, 1], "pp": 2, "shard": "full"}, "text": {"ranks": [1]}})
    again = ldm.Plan.from_yaml(plan.to_yaml())
    assert again.towers["image"].pp == 2 and again.towers["image"].sharded


@pytest.mark.slow
def test_sharded_stages_accumulate_and_clip(tmp_path):
    """Each stage's shards count once in the global norm; accumulated batches reduce once, in the
    optimizer step's last backward of each stage."""
    plan = PLANS["image-pp2-gpipe"]
    result = compare_with_reference(
        lambda: DeepCLIP("adamw", lr=0.01),
        plan,
        plan.world_size,
        8,
        3,
        tmp_path,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    )
    result.assert_exact()
