"""Each open_clip model preset's towers have the parameters of the real architecture.

open_clip (a test-only dependency, ``.[dev]``) builds the model from its own JSON config on the meta
device: no weights, nothing downloaded. Our counts follow timm's ViT (a class token, a head with a
bias) where open_clip differs by a few hundred parameters, so the bound is 0.5%.
"""

from __future__ import annotations

import pytest
import yaml

from lightning_distmm.planner.machine.config import CONF_DIR
from lightning_distmm.planner.profiles.profile import model_profiles

# our preset -> open_clip's model config name
OPEN_CLIP = {
    "clip_vit_b32": "ViT-B-32",
    "clip_vit_l14": "ViT-L-14",
    "clip_vit_h14": "ViT-H-14",
    "clip_vit_g14": "ViT-g-14",
    "clip_vit_bigg14": "ViT-bigG-14",
    "coca_vit_l14": "coca_ViT-L-14",
}


def _open_clip_towers(name: str) -> dict[str, int]:
    """Parameters per tower of open_clip's model ``name``, built on the meta device."""
    open_clip = pytest.importorskip("open_clip")
    torch = pytest.importorskip("torch")
    from open_clip.factory import get_model_config

    cfg = dict(get_model_config(name))
    cfg.pop("custom_text", None)
    with torch.device("meta"):
        model = open_clip.CoCa(**cfg) if "multimodal_cfg" in cfg else open_clip.CLIP(**cfg)

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    total = count(model) - model.logit_scale.numel()
    towers = {"image": count(model.visual)}
    if hasattr(model, "text_decoder"):
        towers["decoder"] = count(model.text_decoder)
        towers["text"] = count(model.text)
    else:  # open_clip's CLIP keeps the text tower's modules on the model itself
        towers["text"] = total - towers["image"]
    return towers


@pytest.mark.parametrize("preset", sorted(OPEN_CLIP))
def test_preset_towers_match_open_clip(preset):
    real = _open_clip_towers(OPEN_CLIP[preset])
    ours = model_profiles(yaml.safe_load((CONF_DIR / "model" / f"{preset}.yaml").read_text()))
    assert set(ours) == set(real)
    for tower, n in real.items():
        assert ours[tower].params == pytest.approx(n, rel=0.005), (preset, tower, ours[tower].params, n)


def test_g14_text_tower_is_open_clips():
    """ViT-g-14's text tower is 24 x 1024 (open_clip's config), not 12 layers."""
    p = model_profiles(yaml.safe_load((CONF_DIR / "model" / "clip_vit_g14.yaml").read_text()))["text"]
    assert (p.layers, p.width, p.heads) == (24, 1024, 16)


def test_coca_pooler_is_modelled():
    """CoCa's attentional pooler adds its 2.76M parameters (net of the plain head) to the image tower."""
    cfg = yaml.safe_load((CONF_DIR / "model" / "coca_vit_l14.yaml").read_text())
    with_pool = model_profiles(cfg)["image"]
    del cfg["towers"]["image"]["attn_pool"]
    plain = model_profiles(cfg)["image"]
    assert (with_pool.params - plain.params) / 1e6 == pytest.approx(2.76, abs=0.01)
    assert with_pool.flops_per_sample() > plain.flops_per_sample()


# long-sequence presets: our preset -> open_clip's config name and the change made to it
LONG = {
    "clip_vit_l14_448": ("ViT-L-14", "vision_cfg", {"image_size": 448}, (1025, 77)),
    "clip_vit_l14_longtext": ("ViT-L-14", "text_cfg", {"context_length": 248}, (257, 248)),
    "siglip_so400m_384": ("ViT-SO400M-14-SigLIP-384", None, {}, (729, 64)),
}


@pytest.mark.parametrize("preset", sorted(LONG))
def test_long_sequence_presets_match_open_clip(preset):
    """Parameters per tower against open_clip (timm's vit_so400m_patch14_siglip_384 for SigLIP's image
    tower) built on the meta device, and the sequence lengths the profiles give the planner."""
    open_clip = pytest.importorskip("open_clip")
    torch = pytest.importorskip("torch")
    from open_clip.factory import get_model_config

    name, part, change, (image_seq, text_seq) = LONG[preset]
    cfg = dict(get_model_config(name))
    if part is not None:
        cfg[part] = {**cfg[part], **change}
    custom = cfg.pop("custom_text", False)
    with torch.device("meta"):
        model = open_clip.CustomTextCLIP(**cfg) if custom else open_clip.CLIP(**cfg)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    image = count(model.visual)
    text = count(model.text) if custom else count(model) - image - model.logit_scale.numel()
    ours = model_profiles(yaml.safe_load((CONF_DIR / "model" / f"{preset}.yaml").read_text()))
    assert ours["image"].params == pytest.approx(image, rel=0.001), (preset, ours["image"].params, image)
    assert ours["text"].params == pytest.approx(text, rel=0.001), (preset, ours["text"].params, text)
    assert (ours["image"].seq, ours["text"].seq) == (image_seq, text_seq)
