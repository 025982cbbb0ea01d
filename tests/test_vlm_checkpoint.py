"""A VLM plan's sharded checkpoint resumes exactly mid-epoch (AdamW, shuffled
data, the encoder on two replicas and the LLM on its own rank), and exports to a plain state dict."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from distmm_testing import max_param_diff, read_losses, run_distmm
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from vlm_testing import VLMData

import lightning_distmm as ldm
from lightning_distmm.models.vlm import VLM

PLAN = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "llm": {"ranks": [2]}})


@pytest.mark.slow
def test_vlm_resume_continues_exactly_and_exports(tmp_path) -> None:
    L.seed_everything(0)
    straight = VLM(optimizer="adamw", lr=0.01)
    first_half, resumed = copy.deepcopy(straight), copy.deepcopy(straight)
    data = lambda: DataLoader(VLMData(48), batch_size=6, shuffle=True, drop_last=True)  # noqa: E731 - 8 batches an epoch

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

    # the checkpoint, exported offline, is the first half's trained model with no distmm
    ldm.export_checkpoint(folder, tmp_path / "plain.pt")
    plain = VLM()
    plain.load_state_dict(torch.load(tmp_path / "plain.pt"), strict=True)
    assert max_param_diff(plain, first_half) == 0.0
