"""SigLIP end to end: the config switch, the learnable logit bias, the experiment, exactness under distmm."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distmm_testing import EMBED, compare_with_reference, in_subprocess
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tiny_models import SGDCLIPModel, tiny_config

import lightning_distmm as ldm
from lightning_distmm.models.clip import CLIP_TINY, CLIPModel

ROOT = Path(__file__).resolve().parents[1]

#: a SigLIP CLIPModel over the fields and sizes of distmm_testing.PairData (3x8x8 images, 6 tokens of 20)
TINY_SIGLIP: dict[str, Any] = tiny_config("siglip_test", "siglip")
SGDSigLIP = SGDCLIPModel  # plain SGD with momentum, as the other exactness tests use


def _pairwise_sigmoid(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The SigLIP paper's loss written pair by pair (the reference the row-local loss must equal)."""
    image, text = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
    n = image.shape[0]
    total = image.new_zeros(())
    for i in range(n):
        for j in range(n):
            z = 1.0 if i == j else -1.0
            total = total - F.logsigmoid(z * (scale.exp() * image[i] @ text[j] + bias))
    return total / n


def test_siglip_switch_adds_a_learnable_bias_with_the_papers_init():
    model = CLIPModel({**CLIP_TINY, "loss": "siglip", "init_logit_scale": math.log(10)})
    assert model.logit_bias.item() == -10.0 and model.logit_bias.requires_grad
    assert model.logit_scale.item() == pytest.approx(math.log(10))
    assert CLIPModel(TINY_SIGLIP).logit_scale.item() == pytest.approx(math.log(10))  # siglip's default scale
    assert not hasattr(CLIPModel(), "logit_bias")  # clip: none (the softmax ignores a shared shift)
    with pytest.raises(ValueError, match="not one of"):
        CLIPModel({**CLIP_TINY, "loss": "sigmoid"})


def test_siglip_loss_and_bias_gradient():
    torch.manual_seed(0)
    model = CLIPModel(TINY_SIGLIP)
    features = {"image": torch.randn(5, EMBED), "text": torch.randn(5, EMBED)}
    loss = model.interaction_loss(features)
    expected = _pairwise_sigmoid(features["image"], features["text"], model.logit_scale, model.logit_bias)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    assert model.logit_bias.grad is not None and model.logit_bias.grad.abs().item() > 0.1
    assert model.logit_scale.grad is not None
    # no weight decay on the scalars (the param groups put 0-d parameters with the embeddings)
    no_decay = next(g for g in model._param_groups() if g["weight_decay"] == 0.0)["params"]
    assert any(p is model.logit_bias for p in no_decay)


def test_siglip_tiny_config_and_experiment():
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "siglip_tiny.yaml"))
    assert cfg["loss"] == "siglip" and cfg["init_logit_bias"] == -10.0
    assert cfg["init_logit_scale"] == pytest.approx(math.log(10), abs=1e-6)
    assert cfg["towers"] == CLIP_TINY["towers"]  # the tiny model of clip_tiny, only the loss differs
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name="train", overrides=["out_dir=/tmp/unused", "experiment=siglip_shapes"])
    assert composed.model.name == "siglip_tiny" and composed.data._target_.endswith("ShapesDataModule")
    model = CLIPModel(composed.model, composed.optim)
    assert model.loss_name == "siglip" and model.logit_bias.item() == -10.0


@pytest.mark.slow
def test_siglip_under_distmm_equals_one_process(tmp_path):
    """Image on 2 ranks with uneven replica batches (6 + 4) + text on 1: the same weights as one
    process after 3 SGD steps, the logit bias (trained) included."""
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1], "replica_batch": [6, 4]}, "text": {"ranks": [2]}}, 10)

    def run() -> None:
        result = compare_with_reference(lambda: SGDSigLIP(TINY_SIGLIP), plan, 3, 10, 3, tmp_path)
        assert len(result.distributed_losses) == 3
        result.assert_exact(1e-5)
        bias = [m.logit_bias.item() for m in (result.reference, result.distributed, result.initial)]
        assert abs(bias[0] - bias[1]) <= 1e-5, bias
        assert abs(bias[0] - bias[2]) > 1e-3, bias  # the bias was trained, not left at its init

    in_subprocess(run, timeout=300)
