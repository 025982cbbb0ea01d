"""Sharded towers (FSDP2 over a tower's own data-parallel ranks) train exactly like one process."""

import copy

import lightning as L
import pytest
from distmm_testing import (
    DeepCLIP,
    TinyCLIP,
    compare_accumulating_and_clipping,
    compare_with_reference,
    loader,
    max_param_diff,
    read_losses,
    run_distmm,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from timm.models.vision_transformer import VisionTransformer

import lightning_distmm as ldm

SHARDED_PLANS = {
    "image-full2+text1": (3, 8, ldm.Plan(3, {"image": {"ranks": [0, 1], "shard": "full"}, "text": {"ranks": [2]}})),
    "both-sharded-uneven": (
        4,
        9,
        ldm.Plan(
            4,
            {
                "image": {"ranks": [0, 1, 2], "replica_batch": [4, 3, 2], "shard": "full"},
                "text": {"ranks": [2, 3], "replica_batch": [5, 4], "shard": "full"},
            },
            9,
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(SHARDED_PLANS))
def test_sharded_towers_match_single_process(name, optimizer, tmp_path):
    world, batch, plan = SHARDED_PLANS[name]
    lr = 0.05 if optimizer == "sgd" else 0.01
    result = compare_with_reference(lambda: TinyCLIP(optimizer, lr=lr), plan, world, batch, 3, tmp_path)
    result.assert_exact()


MORE_PLANS = {
    # microbatches kept (gpipe) and recomputed (cached) through FSDP's hooks
    "gpipe-mb3": ldm.Plan(3, {"image": {"ranks": [0, 1], "shard": "full", "microbatch": 3}, "text": {"ranks": [2]}}),
    "cached-mb2": ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "shard": "full", "microbatch": 2, "schedule": "cached"},
            "text": {"ranks": [2], "shard": "none", "microbatch": 2, "schedule": "cached"},
        },
    ),
    "recompute-colocated": ldm.Plan(
        2, {"image": {"ranks": [0, 1], "shard": "full", "recompute": True}, "text": {"ranks": [0, 1], "shard": "full"}}
    ),
    # ZeRO-2 (FSDP2's reshard_after_forward=False): each block's weights kept whole from the forward of
    # the first of 3 microbatches to its backward
    "zero2-mb3": ldm.Plan(3, {"image": {"ranks": [0, 1], "shard": "zero2", "microbatch": 3}, "text": {"ranks": [2]}}),
    # tensor parallelism inside each replica, FSDP across the replicas: a 2-D (dp, tp) layout
    "image-tp2xfsdp2+text-colocated": ldm.Plan(
        4, {"image": {"ranks": [0, 1, 2, 3], "tp": 2, "shard": "full"}, "text": {"ranks": [0, 2], "shard": "full"}}
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MORE_PLANS))
def test_sharding_composes(name, tmp_path):
    plan = MORE_PLANS[name]
    make = (lambda: DeepCLIP("adamw", lr=0.01)) if "tp2" in name else (lambda: TinyCLIP("adamw", lr=0.01))
    compare_with_reference(make, plan, plan.world_size, 10, 3, tmp_path).assert_exact()


#: tp or pp inside a sharded tower that not every rank holds: the ranks outside it build the tower's
#: meshes too but never slice them (torch slices a mesh of several dp sub-meshes only on its own ranks)
SUBSET_PLANS = {
    f"image-{split}+{shard}-on-0-1+text-on-2": ldm.Plan(
        3, {"image": {"ranks": [0, 1], split[:2]: 2, "shard": shard}, "text": {"ranks": [2]}}
    )
    for split, shard in (("tp2", "full"), ("pp2", "full"), ("tp2", "hybrid"), ("tp2", "zero2"))
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(SUBSET_PLANS))
def test_tp_or_pp_with_sharding_on_a_subset_of_ranks(name, optimizer, tmp_path):
    lr = 0.05 if optimizer == "sgd" else 0.01
    plan = SUBSET_PLANS[name]
    compare_with_reference(lambda: DeepCLIP(optimizer, lr=lr), plan, 3, 7, 3, tmp_path).assert_exact()


class _ResharedAfterForward(L.Callback):
    """Rank 0 (an image rank) writes whether each FSDP unit of the image tower reshards its weights
    after its forward (FSDP2 keeps the mesh it reshards to; none under reshard_after_forward=False)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        from lightning_distmm.parallel.fsdp import fsdp_modules

        if trainer.global_rank == 0:
            units = list(fsdp_modules(pl_module.visual))
            kept = [u._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for u in units]
            with open(self.out, "w") as f:
                f.write(" ".join(map(str, kept)))


@pytest.mark.slow
def test_zero2_keeps_weights_whole_from_forward_to_backward(tmp_path):
    """``shard: zero2`` is FSDP2's reshard_after_forward=False on every unit of the tower; ``full``
    reshards each unit after its forward (ZeRO-3)."""
    for shard in ("zero2", "full"):
        plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "shard": shard}, "text": {"ranks": [2]}})
        out = tmp_path / f"{shard}.txt"
        run_distmm(
            TinyCLIP(),
            plan,
            3,
            loader(8),
            1,
            str(tmp_path / f"{shard}.json"),
            callbacks=[_ResharedAfterForward(str(out))],
        )
        reshards = out.read_text().split()
        assert len(reshards) >= 2 and set(reshards) == {"False" if shard == "zero2" else "True"}, (shard, reshards)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_accumulation_and_clipping_with_sharding(optimizer, tmp_path):
    """FSDP's gradient sync is off while Lightning accumulates; clipping uses the global norm with a
    sharded tower's shards each counted once. Clipping is active (the norm is above 0.05)."""
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "shard": "full"}, "text": {"ranks": [1, 2], "shard": "full"}})
    result = compare_accumulating_and_clipping(plan, optimizer, tmp_path)
    result.assert_exact()
    assert len(result.distributed_losses) == 6


def test_shard_in_plan_yaml_round_trip_and_validation():
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "shard": "full"}, "text": {"ranks": [2], "shard": "hybrid"}})
    again = ldm.Plan.from_yaml(plan.to_yaml())
    assert again.towers["image"].shard == "full" and again.towers["text"].shard == "hybrid"
    assert again.towers["image"].sharded and not ldm.Plan(1, {"a": {"ranks": [0]}}).towers["a"].sharded
    assert "full" in plan.table()
    zero2 = ldm.Plan.from_yaml(
        ldm.Plan(2, {"image": {"ranks": [0, 1], "shard": "zero2"}, "text": {"ranks": [1]}}).to_yaml()
    )
    assert zero2.towers["image"].shard == "zero2" and zero2.towers["image"].sharded
    with pytest.raises(ldm.PlanError, match="unknown shard 'zero3'"):
        ldm.Plan(1, {"image": {"ranks": [0], "shard": "zero3"}})
    with pytest.raises(ldm.PlanError, match="towers.image.shard: expected one of none, optimizer, zero2, full, hybrid"):
        ldm.Plan.from_dict({"world_size": 1, "towers": {"image": {"ranks": [0], "shard": True}}})


def test_hybrid_rows_follow_the_launchers_nodes():
    from lightning_distmm.parallel.groups import hybrid_rows

    tower = ldm.TowerPlan(ranks=[0, 1, 2, 3], shard="hybrid")
    assert hybrid_rows("image", tower, [0, 0, 1, 1]) == [[0, 1], [2, 3]]
    assert hybrid_rows("image", tower, [1, 0, 1, 0]) == [[1, 3], [0, 2]]
    assert hybrid_rows("image", tower, None) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="unevenly over nodes"):
        hybrid_rows("image", ldm.TowerPlan(ranks=[0, 1, 2], shard="hybrid"), [0, 0, 1])


class QKVBiasCLIP(DeepCLIP):
    """DeepCLIP whose ViT's fused qkv has a bias (timm's default): a 1-D head-aligned strided TP shard
    that FSDP shards again on dim 0."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.visual = VisionTransformer(
            img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=4, mlp_ratio=2.0, num_classes=8, qkv_bias=True
        )


TP_FSDP = ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "tp": 2, "shard": "full"}, "text": {"ranks": [0, 2]}})
PP_FSDP = ldm.Plan(
    4, {"image": {"ranks": [0, 1, 2, 3], "pp": 2, "shard": "full"}, "text": {"ranks": [1, 3], "shard": "full"}}
)


@pytest.mark.slow
def test_tp_with_fsdp_trains_a_fused_qkv_bias(tmp_path):
    """tp2 x fsdp2 with a qkv bias equals one process (SGD: the key bias's true gradient is exactly
    zero, and Adam would turn its float noise into +-lr steps)."""
    compare_with_reference(lambda: QKVBiasCLIP("sgd", lr=0.05), TP_FSDP, 4, 8, 3, tmp_path).assert_exact()


@pytest.mark.slow
def test_resume_from_tp_x_fsdp_onto_sharded_pipeline_stages(tmp_path):
    """4 steps under tp2 x fsdp2 (qkv bias) equal 2 steps there, a checkpoint, and 2 steps with the
    image tower in 2 sharded pipeline stages: the checkpoint holds the nested strided qkv bias and
    weight in the right order, and each stage loads its shards (momentum state included)."""
    L.seed_everything(0)
    straight = QKVBiasCLIP("sgd", lr=0.05)
    first_half, resumed = copy.deepcopy(straight), copy.deepcopy(straight)
    run_distmm(straight, TP_FSDP, 4, loader(8), 4, str(tmp_path / "straight.json"))
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    run_distmm(
        first_half, TP_FSDP, 4, loader(8), 2, str(tmp_path / "half.json"), callbacks=[saver], enable_checkpointing=True
    )
    folder = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    run_distmm(resumed, PP_FSDP, 4, loader(8), 4, str(tmp_path / "resumed.json"), ckpt_path=str(folder))
    assert read_losses(tmp_path / "resumed.json") == pytest.approx(
        read_losses(tmp_path / "straight.json")[2:], abs=1e-5
    )
    assert max_param_diff(straight, resumed) <= 1e-5
    assert max_param_diff(straight, first_half) > 1e-4


def test_the_planner_plans_every_sharding_the_runtime_runs_and_no_other():
    from lightning_distmm.planner.options import PlannerOptions

    every = ("none", "optimizer", "zero2", "full", "hybrid")
    assert PlannerOptions(shards=every).shards == every
    with pytest.raises(ValueError, match=r"planner.shards=\['none', 'zero1'\]: choose from none, optimizer"):
        PlannerOptions(shards=("none", "zero1"))


def _hybrid_mesh_worker(rank, init, errors):
    import torch.distributed as dist

    from lightning_distmm.parallel.groups import build_tower_groups

    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
        plan = ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "pp": 2, "shard": "hybrid"}, "text": {"ranks": [1, 3]}})
        groups = build_tower_groups(plan, "cpu", nodes=[0, 0, 1, 1])
        # replica 0 = ranks 0, 1 (node 0), replica 1 = ranks 2, 3 (node 1): each stage shards inside a
        # node (one rank there) and replicates across the two nodes
        expected = [[0], [2]] if rank in (0, 2) else [[1], [3]]
        mesh = groups["image"].shard_mesh
        assert mesh.mesh.tolist() == expected and mesh.mesh_dim_names == ("replicate", "shard"), mesh
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {err!r}")
        raise


@pytest.mark.slow
def test_hybrid_shards_each_pipeline_stage_over_its_own_ranks(tmp_path):
    import os

    import torch.multiprocessing as mp

    from lightning_distmm.parallel.groups import hybrid_rows

    tower = ldm.TowerPlan(ranks=[0, 1, 2, 3], pp=2, shard="hybrid")
    assert [hybrid_rows("image", tower, [0, 0, 1, 1], s) for s in (0, 1)] == [[[0], [2]], [[1], [3]]]
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    init = f"file://{os.path.join(tmp_path, 'store')}"
    mp.start_processes(_hybrid_mesh_worker, args=(init, errors), nprocs=4, start_method="fork", join=True)
    assert errors.empty()
