"""Pipeline cuts compose back to the tower: running the stages in order equals the tower's forward."""

import pytest
import torch
from distmm_testing import TinyText
from timm.models.vision_transformer import VisionTransformer

from lightning_distmm.models.clip import TextTower
from lightning_distmm.parallel.families import tower_stages
from lightning_distmm.parallel.pipeline import owned_names


def _chain(stages, rows):
    x = None
    for stage in stages:
        x = stage.run(x, rows)
    return x


@pytest.mark.parametrize("pp", [2, 3])
def test_vit_stages_compose(pp):
    torch.manual_seed(0)
    model = VisionTransformer(img_size=8, patch_size=4, embed_dim=16, depth=3, num_heads=2, num_classes=8).eval()
    rows = {"image": torch.randn(4, 3, 8, 8)}
    stages = tower_stages(model, pp, ("image",))
    assert torch.allclose(_chain(stages, rows), model(rows["image"]), atol=1e-6)
    owned = [owned_names(model, s) for s in stages]
    assert set().union(*owned) == {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert sum(len(o) for o in owned) == len(set().union(*owned))  # no tensor in two stages


@pytest.mark.parametrize("tower", [TinyText(layers=3), TextTower(64, 6, 16, 3, 2, 2.0, 8)], ids=["tiny", "recipe"])
def test_clip_text_stages_compose(tower):
    tower.eval()
    ids = torch.randint(4, 20, (3, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    rows = {"input_ids": ids, "attention_mask": mask}
    stages = tower.pipeline_stages(3)
    assert torch.allclose(_chain(stages, rows), tower(ids, mask), atol=1e-6)
    owned = [owned_names(tower, s) for s in stages]
    assert set().union(*owned) == {n for n, _ in tower.named_parameters()} | {n for n, _ in tower.named_buffers()}
