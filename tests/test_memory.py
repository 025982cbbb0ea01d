"""A rank keeps only the towers it runs: the others' parameters are released and the memory returns."""

import json
from pathlib import Path

import lightning as L
import psutil
import pytest
from distmm_testing import EMBED, TinyCLIP, loader, trainer_kwargs
from timm.models.vision_transformer import VisionTransformer

import lightning_distmm as ldm


class BigImageCLIP(TinyCLIP):
    def __init__(self) -> None:
        super().__init__()
        # ~25M parameters (~100 MB fp32): large enough to see in the resident set size
        self.visual = VisionTransformer(
            img_size=8, patch_size=4, embed_dim=512, depth=8, num_heads=8, num_classes=EMBED
        )


class MemoryProbe(L.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.before = 0

    def setup(self, trainer, pl_module, stage) -> None:  # type: ignore[no-untyped-def]
        self.before = psutil.Process().memory_info().rss

    def on_fit_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        held = sum(p.numel() * p.element_size() for p in pl_module.parameters() if not p.is_meta)
        after = psutil.Process().memory_info().rss
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(
            json.dumps({"before": self.before, "after": after, "held": held})
        )


@pytest.mark.slow
def test_remote_towers_are_released(tmp_path):
    module = BigImageCLIP()
    image_bytes = sum(p.numel() * p.element_size() for p in module.visual.parameters())
    text_bytes = sum(p.numel() * p.element_size() for p in module.text.parameters())
    plan = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})
    trainer = L.Trainer(
        devices=2,
        max_steps=1,
        strategy=ldm.DistMMStrategy(plan, start_method="fork"),
        callbacks=[MemoryProbe(str(tmp_path))],
        **trainer_kwargs(),
    )
    trainer.fit(module, loader(4))
    image_rank = json.loads((tmp_path / "rank0.json").read_text())
    text_rank = json.loads((tmp_path / "rank1.json").read_text())
    assert image_rank["held"] == image_bytes + 4  # + logit_scale
    assert text_rank["held"] == text_bytes + 4
    # the text rank gave back (nearly) all of the image tower's memory
    assert text_rank["before"] - text_rank["after"] > 0.8 * image_bytes


@pytest.mark.slow
def test_pipeline_stages_hold_only_their_part(tmp_path):
    from distmm_testing import DeepCLIP

    module = DeepCLIP()
    image_bytes = sum(p.numel() * p.element_size() for p in module.visual.parameters())
    text_bytes = sum(p.numel() * p.element_size() for p in module.text.parameters())
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2}, "text": {"ranks": [2]}})
    trainer = L.Trainer(
        devices=3,
        max_steps=1,
        strategy=ldm.DistMMStrategy(plan, start_method="fork"),
        callbacks=[MemoryProbe(str(tmp_path))],
        **trainer_kwargs(),
    )
    trainer.fit(module, loader(4))
    held = [json.loads((tmp_path / f"rank{r}.json").read_text())["held"] - 4 for r in range(3)]
    assert held[2] == text_bytes
    assert 0 < held[0] < image_bytes and 0 < held[1] < image_bytes
    assert held[0] + held[1] == image_bytes  # the two stages partition the tower
