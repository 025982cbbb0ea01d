"""A checkpoint saved under one plan resumes under another: same weights, optimizer state and sample order."""

import copy

import lightning as L
import pytest
from distmm_testing import TinyCLIP, loader, max_param_diff, read_losses, run_distmm
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_distmm as ldm

DP = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})
IMAGE_SHARDED3 = ldm.Plan(4, {"image": {"ranks": [0, 1, 2], "shard": "full"}, "text": {"ranks": [3]}})
BOTH_SHARDED = ldm.Plan(
    3,
    {"image": {"ranks": [0, 1], "shard": "full"}, "text": {"ranks": [1, 2], "shard": "full", "replica_batch": [5, 3]}},
)
COLOCATED2 = ldm.Plan(2, {"image": {"ranks": [0, 1]}, "text": {"ranks": [0, 1]}})
UNEVEN4 = ldm.Plan(4, {"image": {"ranks": [0, 1, 2], "replica_batch": [4, 2, 2]}, "text": {"ranks": [3]}})
SEPARATE2 = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})

CP_SHARDED = ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "shard": "full"}, "text": {"ranks": [0]}})
ZERO1 = ldm.Plan(3, {"image": {"ranks": [0, 1], "shard": "optimizer"}, "text": {"ranks": [1, 2], "shard": "optimizer"}})
TP2_ZERO1 = ldm.Plan(
    4,
    {"image": {"ranks": [0, 1, 2, 3], "tp": 2, "shard": "optimizer"}, "text": {"ranks": [0, 2], "shard": "optimizer"}},
)
TP_SP = ldm.Plan(4, {"image": {"ranks": [0, 1], "tp": 2, "sp": True}, "text": {"ranks": [2, 3], "cp": 2}})

CHANGES = {
    "dp-to-sharded": (DP, IMAGE_SHARDED3),
    "dp-to-cp2-sharded": (DP, CP_SHARDED),
    "cp2-sharded-to-tp2-sp": (CP_SHARDED, TP_SP),
    "sharded-to-colocated": (BOTH_SHARDED, COLOCATED2),
    "4-ranks-to-2-ranks": (UNEVEN4, SEPARATE2),
    # ZeRO-1's state is saved as the whole parameters' and cut into pieces again on load
    "zero1-to-sharded": (ZERO1, IMAGE_SHARDED3),
    "colocated-to-zero1-tp2": (COLOCATED2, TP2_ZERO1),
}


def _data():
    return loader(8, size=48, shuffle=True)  # 6 batches an epoch: the checkpoint at step 2 is mid-epoch


@pytest.mark.slow
@pytest.mark.parametrize("change", list(CHANGES))
def test_resume_onto_another_plan(change, tmp_path):
    """4 steps under plan A equal 2 steps under A, a checkpoint, then 2 steps under B (AdamW: the
    optimizer state must come back re-sharded too)."""
    a, b = CHANGES[change]
    L.seed_everything(0)
    straight = TinyCLIP("adamw", lr=0.01)
    first_half, resumed = copy.deepcopy(straight), copy.deepcopy(straight)

    run_distmm(straight, a, a.world_size, _data(), 4, str(tmp_path / "straight.json"))
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    run_distmm(
        first_half,
        a,
        a.world_size,
        _data(),
        2,
        str(tmp_path / "half.json"),
        callbacks=[saver],
        enable_checkpointing=True,
    )
    folder = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    run_distmm(resumed, b, b.world_size, _data(), 4, str(tmp_path / "resumed.json"), ckpt_path=str(folder))

    losses = read_losses(tmp_path / "straight.json")
    assert read_losses(tmp_path / "resumed.json") == pytest.approx(losses[2:], abs=1e-5)
    assert max_param_diff(straight, resumed) <= 1e-5
    assert max_param_diff(straight, first_half) > 1e-4


@pytest.mark.slow
def test_a_plan_for_another_global_batch_is_refused(tmp_path):
    L.seed_everything(0)
    module = TinyCLIP("sgd", lr=0.05)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    run_distmm(module, DP, 3, loader(8), 2, str(tmp_path / "a.json"), callbacks=[saver], enable_checkpointing=True)
    other = ldm.Plan(2, {"image": {"ranks": [0], "replica_batch": [10]}, "text": {"ranks": [1]}}, 10)
    with pytest.raises(Exception, match="trained at a global batch of 8") as info:
        run_distmm(
            copy.deepcopy(module),
            other,
            2,
            loader(10),
            4,
            str(tmp_path / "b.json"),
            ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"),
        )
    assert "global_batch: 8" in str(info.value)


def test_check_plan_change_reads_the_recorded_plan(tmp_path):
    import torch

    from lightning_distmm.checkpoint import PLAN_KEY, check_plan_change, plan_record

    (tmp_path / "meta.pt").write_bytes(b"")
    torch.save({PLAN_KEY: plan_record(DP, 8)}, tmp_path / "meta.pt")
    check_plan_change(tmp_path, SEPARATE2)  # no global batch fixed: resumes at the loader's batch
    check_plan_change(tmp_path, ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}}, 8))
    with pytest.raises(ldm.PlanError, match="global batch of 8 under"):
        check_plan_change(tmp_path, ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}}, 6))
