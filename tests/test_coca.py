"""CoCa end to end: the towers' packed rows, the decoder, the two losses, the config and experiment,
the planner's view of the same modules, and exactness under distmm (the decoder in the interaction)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distmm_testing import EMBED, SEQ, VOCAB, PairData, compare_with_reference, in_subprocess
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tiny_models import SGDCLIPModel, tiny_config
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.interaction import row_share
from lightning_distmm.losses import caption_loss, clip_loss
from lightning_distmm.models import coca
from lightning_distmm.models.clip import CLIP_TINY, CLIPModel, num_parameters
from lightning_distmm.models.metrics import retrieval_metrics

ROOT = Path(__file__).resolve().parents[1]

#: a CoCa over the fields and sizes of distmm_testing.PairData (3x8x8 images, 6 tokens of 20)
TINY_COCA: dict[str, Any] = {
    **tiny_config("coca_test", "coca", image_layers=2, attn_pool={"queries": 4, "heads": 2}),
    "decoder": {"width": 16, "layers": 1, "heads": 2, "mlp_ratio": 2.0},
}
SGDCoCa = SGDCLIPModel  # plain SGD with momentum, as the other exactness tests use


def _batch(n: int = 6) -> dict[str, torch.Tensor]:
    rows = [PairData().load(i, PairData.fields) for i in range(n)]
    return {k: torch.stack([r[k] for r in rows]) for k in PairData.fields}


def test_towers_pack_embedding_tokens_and_ids():
    torch.manual_seed(0)
    model = CLIPModel(TINY_COCA)
    batch = _batch()
    features = model.encode(batch)
    assert features["image"].shape == (6, 4, EMBED)  # query 0: the embedding; queries 1-3: image tokens
    text = coca.unpack_text(features["text"], EMBED, 16, model.coca.digits)
    assert text.tokens.shape == (6, SEQ, 16) and torch.equal(text.ids, batch["input_ids"])
    assert model.embedding("image", features["image"]).shape == model.embedding("text", features["text"]).shape
    assert isinstance(model.visual.norm, torch.nn.Identity)  # the pooler's own norms replace timm's final norm
    # a large vocabulary in bf16: the ids cross as base-256 digits, exactly
    ids = torch.randint(0, 49408, (3, 7))
    packed = coca.pack_text(torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(3, 7, 5), ids, coca.id_digits(49408))
    assert packed.dtype == torch.bfloat16 and torch.equal(coca.unpack_text(packed, 4, 5, 2).ids, ids)


def test_coca_loss_is_clip_plus_caption_and_splits_into_rows():
    torch.manual_seed(0)
    model = CLIPModel({**TINY_COCA, "caption_loss_weight": 2.0, "contrastive_loss_weight": 0.5})
    features = {k: v.detach().requires_grad_(True) for k, v in model.encode(_batch()).items()}
    loss = model.interaction_loss(features)
    # the definition, written out on the whole batch
    text = coca.unpack_text(features["text"], EMBED, 16, model.coca.digits)
    scale = model.logit_scale.clamp(0, 4.6052)
    logits = model.decoder(features["image"][:, 1:], text.tokens[:, :-1])
    labels = text.ids[:, 1:]
    caption = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=0)
    expected = 0.5 * clip_loss(features["image"][:, 0], text.embedding, scale) + 2.0 * caption
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # each batch-sync rank decodes its rows only; the shares add up to the loss and its gradients
    grads = torch.autograd.grad(loss, [*features.values(), *model.decoder.parameters()])
    for parts in (2, 4, 8):  # 8 > 6 rows: some ranks decode nothing
        total = torch.zeros(())
        summed = [torch.zeros_like(g) for g in grads]
        for i in range(parts):
            with row_share(i, parts) as share:
                part = model.interaction_loss(features)
            assert share.asked
            total = total + part.detach()
            for s, g in zip(summed, torch.autograd.grad(part, [*features.values(), *model.decoder.parameters()])):
                s += g
        assert total.item() == pytest.approx(loss.item(), rel=1e-6)
        assert max((a - b).abs().max().item() for a, b in zip(summed, grads)) < 1e-6


def test_caption_loss_rows_and_padding():
    logits, labels = torch.randn(4, 5, 7), torch.randint(1, 7, (4, 5))
    labels[1, 3:] = 0
    whole = caption_loss(logits, labels)
    assert whole.item() == pytest.approx(F.cross_entropy(logits.permute(0, 2, 1), labels, ignore_index=0).item())
    with row_share(1, 2):
        half = caption_loss(logits[2:], labels)
        with pytest.raises(ValueError, match="decode the rows local_rows"):
            caption_loss(logits, labels)
    with row_share(0, 2):
        assert (caption_loss(logits[:2], labels) + half).item() == pytest.approx(whole.item(), rel=1e-6)


def test_config_errors_name_the_fix():
    as_tower = copy.deepcopy(TINY_COCA)
    as_tower["towers"]["decoder"] = {"arch": "text_decoder", "input": ["input_ids"], "width": 16}
    with pytest.raises(ValueError, match="not a tower at runtime.*top-level 'decoder'"):
        CLIPModel(as_tower)
    preset = OmegaConf.load(ROOT / "conf" / "model" / "coca_vit_l14.yaml")  # the planner's: refused before building
    with pytest.raises(ValueError, match=r"towers \['decoder'\]: arch 'text_decoder'"):
        CLIPModel(preset)
    with pytest.raises(ValueError, match="must be the text tower's 16"):
        CLIPModel({**TINY_COCA, "decoder": {**TINY_COCA["decoder"], "width": 32}})
    with pytest.raises(KeyError, match="needs 'decoder'"):
        CLIPModel({k: v for k, v in TINY_COCA.items() if k != "decoder"})
    pooled = copy.deepcopy(CLIP_TINY)
    pooled["towers"]["image"]["attn_pool"] = {"queries": 4, "heads": 2}
    with pytest.raises(ValueError, match="only loss: coca reads"):
        CLIPModel(pooled)


def test_planner_profiles_count_the_runtime_modules():
    """The planner's analytic parameter counts for the pooled ViT and the decoder (a text_decoder
    entry, as the coca_vit_l14 preset writes it) match the modules the runtime builds."""
    from lightning_distmm.planner.profiles.profile import tower_profile

    cfg = copy.deepcopy(TINY_COCA)
    cfg["towers"]["image"]["qkv_bias"] = True  # timm's default, which the profile counts
    model = CLIPModel(cfg)
    assert tower_profile("image", cfg["towers"]["image"], EMBED).params == num_parameters(model.visual)
    dec = TINY_COCA["decoder"]
    decoder_cfg = {"arch": "text_decoder", "vocab_size": VOCAB, "context_length": SEQ - 1, **dec}
    decoder = tower_profile("decoder", {**decoder_cfg, "cross_tokens": 3, "cross_width": EMBED}, EMBED)
    assert decoder.params == num_parameters(model.decoder)


def test_coca_tiny_config_experiment_and_retrieval():
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "coca_tiny.yaml"))
    assert cfg["loss"] == "coca" and cfg["towers"]["text"] == CLIP_TINY["towers"]["text"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="train", overrides=["out_dir=/tmp/unused", "experiment=coca_shapes"])
    assert composed.model.name == "coca_tiny" and composed.data._target_.endswith("ShapesDataModule")
    model = CLIPModel(composed.model, composed.optim)
    assert model.coca is not None and num_parameters(model.decoder) > 0
    assert set(model.tower_specs()) == {"image", "text"}  # the decoder is an interaction module
    from lightning_distmm.data.demo.shapes import ShapesDataset

    metrics = retrieval_metrics(model, DataLoader(ShapesDataset("val", size=16), batch_size=8))
    assert metrics["n"] == 16 and 0.0 <= metrics["image->text/top1"] <= 1.0


#: the same CoCa with two text layers, so that the text tower can be cut into two stages
TWO_TEXT_LAYERS = {**TINY_COCA, "towers": {**TINY_COCA["towers"], "text": {**TINY_COCA["towers"]["text"], "layers": 2}}}

PLANS = {
    # image on one rank, text on another: both are last stages, each decodes half of the rows
    "image1+text1": (2, lambda: SGDCoCa(TINY_COCA), ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})),
    # the image tower pipelined: rank 0 (its first stage) holds the decoder but never runs it; the
    # decoder's gradients are summed over every rank like the logit scale's
    "image-pp2+text1": (
        3,
        lambda: SGDCoCa(TINY_COCA),
        ldm.Plan(3, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 5}, "text": {"ranks": [2]}}, 10),
    ),
    # uneven image replicas (6 + 4) and the distmm schedule's two sync groups
    "image-dp2-uneven+text1-distmm": (
        3,
        lambda: SGDCoCa({**TINY_COCA, "sync_groups": 2}),
        ldm.Plan(
            3,
            {
                "image": {"ranks": [0, 1], "replica_batch": [6, 4], "schedule": "distmm"},
                "text": {"ranks": [2], "schedule": "distmm"},
            },
            10,
        ),
    ),
    # the image tower sharded by tensor parallelism (the pooler replicated)
    "image-tp2+text1": (
        3,
        lambda: SGDCoCa(TINY_COCA),
        ldm.Plan(3, {"image": {"ranks": [0, 1], "tp": 2}, "text": {"ranks": [2]}}),
    ),
    # the text tower pipelined with the cached schedule: its last stage packs the token states and ids
    "text-pp2-cached+image1": (
        3,
        lambda: SGDCoCa(TWO_TEXT_LAYERS),
        ldm.Plan(
            3,
            {"image": {"ranks": [0]}, "text": {"ranks": [1, 2], "pp": 2, "microbatch": 5, "schedule": "cached"}},
            10,
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_coca_under_distmm_equals_one_process(name, tmp_path):
    """The same weights as one process after 3 SGD steps (fp32, gloo), the decoder's included."""
    devices, make, plan = PLANS[name]

    def run() -> None:
        result = compare_with_reference(make, plan, devices, 10, 3, tmp_path)
        assert len(result.distributed_losses) == 3
        result.assert_exact(1e-5)
        moved = [
            (result.reference.decoder.text_projection - result.initial.decoder.text_projection).abs().max().item(),
            (result.reference.visual.head.attn_pool.query - result.initial.visual.head.attn_pool.query)
            .abs()
            .max()
            .item(),
        ]
        assert min(moved) > 1e-4, moved  # the decoder and the pooler were trained

    in_subprocess(run, timeout=300)
