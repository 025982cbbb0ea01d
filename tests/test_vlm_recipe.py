"""recipes/vlm_shapes.py and ``recipes/train.py experiment=vlm_shapes``: the data (0 or 2 images per
sample), the model built from conf/model/vlm_tiny.yaml, the accuracy rule, a short run end to end."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import yaml  # noqa: E402
from distmm_testing import run_recipe  # noqa: E402
from vlm_shapes import ShapesCaptions, build, build_from_config, generate, names_right  # noqa: E402

from lightning_distmm.data.demo.shapes import describe  # noqa: E402


def test_samples_have_one_image_and_word_targets() -> None:
    s = ShapesCaptions("test", 4).load(0, ShapesCaptions.fields)
    assert s["pixel_values"].shape == (1, 3, 32, 32) and int(s["n_images"]) == 1
    assert s["labels"][0] == -100 and (s["labels"][s["attention_mask"] == 0] == -100).all()
    assert (s["labels"] != -100).sum() == s["attention_mask"].sum() - 1


def test_accuracy_rule_needs_colour_and_shape_and_nothing_else() -> None:
    label = next(i for i in range(288) if describe(i)[:2] == ("red", "circle"))
    assert names_right("a red circle at the top left", label)
    assert not names_right("a red square at the top left", label)
    assert not names_right("a blue circle", label)
    assert not names_right("a red circle and a blue circle", label)


def test_generate_returns_word_ids_per_image() -> None:
    torch.manual_seed(0)
    model = build(1e-3)
    out = generate(model, torch.randn(3, 1, 3, 32, 32), steps=4)
    assert len(out) == 3 and all(len(ids) <= 4 for ids in out)


def test_samples_carry_zero_or_two_views_of_their_shape() -> None:
    data = ShapesCaptions("train", 8, max_images=2, no_image_every=4)
    none, two = (data.load(i, ShapesCaptions.fields) for i in (0, 1))
    assert int(none["n_images"]) == 0 and not none["pixel_values"].any()
    assert int(two["n_images"]) == 2 and two["pixel_values"].shape == (2, 3, 32, 32)
    first, second = two["pixel_values"]
    assert not torch.equal(first, second)  # another rendering: its own noise, jitter and tint
    # the same colour: the brightest pixels' mean colour agrees between the views (denormalised)
    top = [
        (v * 0.16 + 0.15)
        .flatten(1)[:, (v * 0.16 + 0.15).sum(0).flatten() > (v * 0.16 + 0.15).sum(0).flatten().quantile(0.9)]
        .mean(1)
        for v in (first, second)
    ]
    assert (top[0] - top[1]).abs().max() < 0.2, top
    assert [data.images(i) for i in range(8)] == [0, 2, 2, 2, 0, 2, 2, 2]


def test_model_builds_from_its_config() -> None:
    cfg = yaml.safe_load((ROOT / "conf" / "model" / "vlm_tiny.yaml").read_text())
    model = build_from_config(cfg, 1e-3)
    assert model.language.max_images == 2 and model.vision.vit.embed_dim == cfg["vit"]["width"]
    assert model.language.lm.config.num_hidden_layers == cfg["llm"]["layers"]
    assert set(model.towers()) == set(cfg["plan"]["towers"])


@pytest.mark.slow
def test_train_recipe_vlm_experiment_runs_under_distmm_and_reports(tmp_path) -> None:
    """``recipes/train.py experiment=vlm_shapes`` for a few steps on 2 ranks (encoder, LLM): the loss
    falls, rank 0 captions held-out images with the whole trained model and reports the accuracy."""
    run = run_recipe(
        "train.py", "experiment=vlm_shapes", "trainer.max_steps=8", "data.held_out=8", f"hydra.run.dir={tmp_path}"
    )
    out = run.stdout
    assert "(chance 3.1%)" in out and "generated" in out and out.count(" | ") >= 9, out[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("train loss: first"))
    first, last = (float(x) for x in re.findall(r"steps ([0-9.]+)", line))
    assert last < first, line
