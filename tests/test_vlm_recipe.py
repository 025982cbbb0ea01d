"""recipes/vlm_shapes.py: its data, its accuracy rule, a short run end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

from vlm_shapes import ShapesCaptions, build, generate, names_right  # noqa: E402

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


@pytest.mark.slow
def test_recipe_runs_under_distmm_and_reports() -> None:
    # a rendezvous address left in this process's environment by an earlier run must not reach it
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "vlm_shapes.py"), "--steps", "6", "--held-out", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "train loss: first" in run.stdout and "(chance 3.1%)" in run.stdout
