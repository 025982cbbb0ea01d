"""Analytic tower profiles agree with the real timm / transformers modules (parameters within 2%)."""

from __future__ import annotations

import pytest
import yaml

from lightning_distmm.planner.machine.cluster import CONF_DIR
from lightning_distmm.planner.profiles.profile import model_profiles, tower_profile

E = 32


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    "cfg",
    [
        dict(img_size=32, patch_size=8, width=64, layers=2, heads=2, mlp_ratio=4.0),
        dict(img_size=64, patch_size=14, width=96, layers=3, heads=4, mlp_ratio=4.3637),
        dict(img_size=48, patch_size=16, width=128, layers=4, heads=8, mlp_ratio=2.0),
    ],
)
def test_vit_params_match_timm(cfg):
    from timm.models.vision_transformer import VisionTransformer

    real = VisionTransformer(
        img_size=cfg["img_size"],
        patch_size=cfg["patch_size"],
        embed_dim=cfg["width"],
        depth=cfg["layers"],
        num_heads=cfg["heads"],
        mlp_ratio=cfg["mlp_ratio"],
        num_classes=E,
    )
    ours = tower_profile("image", {"arch": "vit", **cfg}, E).params
    assert ours == pytest.approx(n_params(real), rel=0.02)


@pytest.mark.parametrize("width, layers, heads, vocab, ctx", [(64, 2, 2, 64, 16), (96, 3, 4, 500, 24)])
def test_clip_text_params_match_transformers(width, layers, heads, vocab, ctx):
    import transformers

    cfg = transformers.CLIPTextConfig(
        vocab_size=vocab,
        max_position_embeddings=ctx,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    real = n_params(transformers.CLIPTextModel(cfg)) + width * E  # + the linear projection to embed_dim
    ours = tower_profile(
        "text",
        {
            "arch": "clip_text",
            "vocab_size": vocab,
            "context_length": ctx,
            "width": width,
            "layers": layers,
            "heads": heads,
        },
        E,
    ).params
    assert ours == pytest.approx(real, rel=0.02)


@pytest.mark.parametrize("pooler", [True, False])
@pytest.mark.parametrize("width, layers, heads", [(64, 2, 2), (128, 3, 4)])
def test_bert_params_match_transformers(width, layers, heads, pooler):
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=300,
        max_position_embeddings=32,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
    )
    real = n_params(transformers.BertModel(cfg, add_pooling_layer=pooler)) + width * E + E
    ours = tower_profile(
        "text",
        {
            "arch": "bert",
            "vocab_size": 300,
            "context_length": 32,
            "width": width,
            "layers": layers,
            "heads": heads,
            "pooler": pooler,
        },
        E,
    ).params
    assert ours == pytest.approx(real, rel=0.02)


@pytest.mark.parametrize(
    "name, image_m, text_m",
    [("clip_vit_b32", 88, 63), ("clip_vit_l14", 304, 124), ("clip_vit_h14", 632, 354), ("clip_vit_bigg14", 1845, 695)],
)
def test_presets_match_open_clip_sizes(name, image_m, text_m):
    profiles = model_profiles(yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text()))
    assert profiles["image"].params / 1e6 == pytest.approx(image_m, rel=0.02)
    assert profiles["text"].params / 1e6 == pytest.approx(text_m, rel=0.02)


def test_every_model_preset_profiles():
    sizes = {}
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        if cfg.get("kind") in ("vlm", "llava"):  # an encoder feeding an LLM: planner.vlm.profile (test_vlm_planner.py)
            with pytest.raises(ValueError, match=f"kind: {cfg['kind']}"):
                model_profiles(cfg)
            continue
        profiles = model_profiles(cfg)
        assert set(profiles) == set(cfg["towers"])
        sizes[cfg["name"]] = sum(p.params for p in profiles.values())
    # the paper's range, 1.1B to 26B
    assert 1.0e9 < sizes["distmm_1b"] < 1.3e9 and 24e9 < sizes["distmm_26b"] < 27e9


def test_flops_follow_the_megatron_formula():
    """24 s h^2 (1 + s / 6h) per block forward for MLP ratio 4 (Megatron-LM, Narayanan et al. 2021)."""
    p = tower_profile(
        "text", {"arch": "clip_text", "vocab_size": 100, "context_length": 77, "width": 512, "layers": 1, "heads": 8}, E
    )
    s, h = 77, 512
    assert p.layer.flops() == pytest.approx(24 * s * h * h * (1 + s / (6 * h)))
