"""``DistMMStrategy(replan="drift")``: a job whose image resolution steps up mid-run re-plans itself
once, through a checkpoint, and trains exactly as one process does; the decision rule on its own."""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning as L
import pytest
import torch
from distmm_testing import (
    EMBED,
    SEQ,
    VOCAB,
    TinyText,
    max_param_diff,
    rank0_log,
    read_losses,
    run_distmm,
    run_reference,
)
from torch import nn
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.planner.default import CountedTower, Host
from lightning_distmm.planner.replan import DriftWatch, MeasuredTower

BATCH, STEPS, SWITCH_AT = 12, 10, 4  # the resolution steps up at step 4 (from 1)
START = ldm.Plan(3, {"image": {"ranks": [0]}, "text": {"ranks": [1, 2]}})


class ConvImage(nn.Module):
    """An image tower whose work grows with the image's area (global pooling: any resolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 16, 3, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, EMBED),
        )  # fmt: skip

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.body(image)


class ProgressiveCLIP(ldm.DistMMMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.visual = ConvImage()
        self.text = TinyText()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def towers(self) -> dict[str, ldm.Tower]:
        return {
            "image": ldm.Tower(self.visual, input="image"),
            "text": ldm.Tower(self.text, input=["input_ids", "attention_mask"]),
        }

    def interaction_loss(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        return ldm.losses.clip_loss(features["image"], features["text"], self.logit_scale)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class ProgressivePairs(ldm.FieldDataset):
    """Pairs whose images are 8x8 for the first steps, then 96x96 (a progressive-resizing schedule:
    144x the image tower's work, a drift that per-sample times measured on a busy host still show
    plainly), deterministic per index."""

    fields = ("image", "input_ids", "attention_mask")

    def __len__(self) -> int:
        return BATCH * STEPS

    def load(self, index: int, fields: Any) -> dict[str, Any]:
        g = torch.Generator().manual_seed(index)
        side = 8 if index // BATCH < SWITCH_AT - 1 else 96
        ids = torch.randint(1, VOCAB - 2, (SEQ,), generator=g)
        length = 2 + index % (SEQ - 2)
        ids[length - 1], ids[length:] = VOCAB - 1, 0
        full = {"image": torch.randn(3, side, side, generator=g), "input_ids": ids}
        full["attention_mask"] = (torch.arange(SEQ) < length).long()
        return {k: full[k] for k in fields}


def data() -> DataLoader:
    return DataLoader(ProgressivePairs(), batch_size=BATCH, drop_last=True)


def test_the_drift_rule_acts_once_per_drift():
    """The first window is the reference; noise within the margin keeps the plan; a tower 25x
    heavier is priced and switched from once; the same times after it are the new plan's reference."""
    counted = {
        "image": CountedTower(flops=1e5, params=2_000, embed_dim=EMBED, ops=12),
        "text": CountedTower(flops=1e5, params=5_000, embed_dim=EMBED, ops=40),
    }
    host = Host("cpu", 3, cores=3, threads=1)
    watch = DriftWatch(margin=0.10)

    def times(image: float, text: float) -> dict[str, MeasuredTower]:
        return {"image": MeasuredTower(image, 2 * image, 120, 10), "text": MeasuredTower(text, 2 * text, 120, 20)}

    first = watch.check(3, times(0.01, 0.04), 0.02, counted, START, host, BATCH)
    assert first.reference is None and first.switch_to is None and "the reference for this plan" in first.line()
    steady = watch.check(6, times(0.0105, 0.039), 0.02, counted, START, host, BATCH)
    assert steady.pricing is None and steady.switch_to is None and "plan kept" in steady.line()
    heavy = watch.check(9, times(0.25, 0.04), 0.05, counted, START, host, BATCH)
    assert heavy.switch_to is not None and len(heavy.switch_to.towers["image"].ranks) > 1, heavy.line()
    assert "switching" in heavy.line() and "the running plan (image@0, text@1-2)" in heavy.line()
    after = watch.check(12, times(0.12, 0.04), 0.03, counted, heavy.switch_to, host, BATCH)
    assert after.reference is None and after.switch_to is None  # the new plan's first window: its reference


@pytest.mark.slow
def test_a_resolution_step_up_replans_once_and_trains_exactly(tmp_path):
    """3 ranks start with the image tower on rank 0 and the text tower on ranks 1-2. The images grow
    144x in area at step 4; the check at step 6 sees the image tower's per-sample time drift, prices
    the plans on the measurements, saves ``replan-step=6`` and continues under the plan it found
    faster, whose first window (step 9) is its reference. Losses and final weights equal one process's
    over the whole run."""
    torch.manual_seed(0)
    reference = ProgressiveCLIP()
    distmm = copy.deepcopy(reference)
    run_reference(reference, data(), STEPS, str(tmp_path / "ref.json"))
    strategy = ldm.DistMMStrategy(plan=START, start_method="fork", replan="drift", replan_every=3, replan_margin=0.15)
    with rank0_log(tmp_path / "rank0.log"):  # rank 0's lines, to a file
        run_distmm(distmm, strategy, 3, data(), STEPS, str(tmp_path / "d.json"), default_root_dir=str(tmp_path))
    said = (tmp_path / "rank0.log").read_text()
    lines = [
        line for line in said.splitlines() if any(k in line for k in ("drift check", "re-planning", "switch took"))
    ]
    print("\n" + "\n".join(lines))
    switching = [line for line in lines if "switching" in line]
    assert len(switching) == 1 and "drift check at step 6:" in switching[0], lines
    assert any("the switch took" in line for line in lines)
    assert "drift check at step 9:" in lines[-1] and "the reference for this plan" in lines[-1]
    assert (tmp_path / "checkpoints" / "replan-step=6" / "meta.pt").is_file()
    assert read_losses(tmp_path / "d.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
    assert max_param_diff(reference, distmm) <= 1e-5
