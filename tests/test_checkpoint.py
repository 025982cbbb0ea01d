"""Sharded checkpoints: exact resume mid-epoch with shuffling, and a plain export."""

import copy

import lightning as L
import pytest
import torch
from distmm_testing import DeepCLIP, GroupedDeepCLIP, loader, max_param_diff, read_losses, run_distmm
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_distmm as ldm

PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})
TP_PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1], "tp": 2}, "text": {"ranks": [2]}})
PP_PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 4}, "text": {"ranks": [2]}})
DISTMM = {"microbatch": 2, "schedule": "distmm"}
DISTMM_PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, **DISTMM}, "text": {"ranks": [2], **DISTMM}})
CP_PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1], "cp": 2}, "text": {"ranks": [2]}})
SP_PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1], "tp": 2, "sp": True}, "text": {"ranks": [2]}})
PLANS = [PLAN, TP_PLAN, PP_PLAN, DISTMM_PLAN, CP_PLAN, SP_PLAN]
IDS = ["dp", "image-tp2", "image-pp2", "image-pp2-distmm", "image-cp2", "image-tp2-sp"]


def model(plan: ldm.Plan, *args, **kwargs) -> DeepCLIP:
    """The test module, computing the loss the plan's schedule computes."""
    return (GroupedDeepCLIP if plan.sync_groups == 2 else DeepCLIP)(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS, ids=IDS)
def test_resume_continues_exactly(plan, tmp_path):
    PLAN = plan  # noqa: N806 - the plan under test
    L.seed_everything(0)
    straight = model(plan, "adamw", lr=0.01)
    first_half = copy.deepcopy(straight)
    resumed = copy.deepcopy(straight)
    data = lambda: loader(8, size=48, shuffle=True)  # noqa: E731 - 6 batches an epoch: step 2 is mid-epoch

    run_distmm(straight, PLAN, 3, data(), 4, str(tmp_path / "straight.json"))
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    run_distmm(
        first_half, PLAN, 3, data(), 2, str(tmp_path / "half.json"), callbacks=[saver], enable_checkpointing=True
    )
    folder = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert folder.is_dir() and (folder / "meta.pt").is_file()
    run_distmm(resumed, PLAN, 3, data(), 4, str(tmp_path / "resumed.json"), ckpt_path=str(folder))

    assert max_param_diff(straight, resumed) <= 1e-6
    losses = read_losses(tmp_path / "straight.json")
    assert read_losses(tmp_path / "half.json") == pytest.approx(losses[:2], abs=1e-6)
    assert read_losses(tmp_path / "resumed.json") == pytest.approx(losses[2:], abs=1e-6)
    assert max_param_diff(straight, first_half) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS, ids=IDS)
def test_export_loads_into_plain_module(plan, tmp_path):
    PLAN = plan  # noqa: N806 - the plan under test
    L.seed_everything(0)
    module = model(plan, "sgd", lr=0.05)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    run_distmm(module, PLAN, 3, loader(8), 2, str(tmp_path / "l.json"), callbacks=[saver], enable_checkpointing=True)

    state = ldm.export_checkpoint(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", tmp_path / "plain.pt")
    plain = DeepCLIP()
    plain.load_state_dict(torch.load(tmp_path / "plain.pt"), strict=True)
    assert state.keys() == plain.state_dict().keys()
    # the fork launcher hands the parent the consolidated weights: the export matches them
    assert max_param_diff(plain, module) == 0.0
    batch = next(iter(loader(8)))
    with torch.no_grad():
        for name, feats in plain.encode(batch).items():
            assert torch.equal(feats, module.encode(batch)[name])


def test_a_checkpoint_of_another_model_names_the_towers_it_lacks():
    """Resuming another model's checkpoint failed with ``CheckpointException ... Missing key in
    checkpoint state_dict: optimizer_0.state.visual.blocks.1.norm1.weight.step``, naming neither the
    folder nor the difference."""
    from lightning_distmm.checkpoint import describe_missing

    have = {"state_dict.visual.proj", "state_dict.text.emb", "optimizer_0.state.visual.proj.step"}
    wanted = {"state_dict.visual.proj", "state_dict.visual.blocks.1.norm1.weight", "state_dict.audio.w"}
    message = describe_missing(wanted, have)
    assert message is not None
    assert "lacks 2 of this rank's 3 tensors, weights of ['audio', 'visual']" in message
    assert "it holds weights of ['text', 'visual']" in message
    assert describe_missing({"state_dict.text.emb"}, have) is None
    only_optimizer = describe_missing({"state_dict.text.emb", "optimizer_0.state.text.emb.exp_avg"}, have)
    assert only_optimizer is not None and "the optimizer differs" in only_optimizer
