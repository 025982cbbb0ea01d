"""Zero-shot classification on a user's own classes: a class folder (ImageNet layout) with open_clip's
templates, read by ``ZeroShotClassification``, and ``zeroshot.folder=`` in the recipe."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from lightning_distmm.data.datasets.class_folder import SIMPLE_TEMPLATES, ClassFolder, templates
from lightning_distmm.data.datasets.preprocess import CaptionTokenizer, pair_preprocessing
from lightning_distmm.models.clip import CLIPModel
from lightning_distmm.models.evaluation import ZeroShotClassification

ROOT = Path(__file__).resolve().parents[1]
COLOURS = {"red": (240, 30, 25), "green": (25, 200, 40), "blue": (40, 75, 255)}


def _folder(tmp_path: Path, per_class: int = 3) -> Path:
    root = tmp_path / "classes"
    for name, rgb in COLOURS.items():
        (root / f"dark_{name}").mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (32, 32), tuple(max(0, c - 20 * i) for c in rgb)).save(root / f"dark_{name}" / f"{i}.png")
    return root


def test_a_class_folder_gives_labels_by_sorted_folder_and_readable_names(tmp_path):
    root = _folder(tmp_path)
    data = ClassFolder(root)
    assert data.classnames == ["dark blue", "dark green", "dark red"] and len(data) == 9
    assert [data.load(i, ["label"])["label"] for i in range(len(data))] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert data.load(3, ["image", "label"])["image"].shape == (3, 32, 32)
    (tmp_path / "names.json").write_text(json.dumps({"dark_blue": "navy", "dark_green": "moss", "dark_red": "wine"}))
    assert ClassFolder(root, tmp_path / "names.json").classnames == ["navy", "moss", "wine"]
    with pytest.raises(ValueError, match="2 class names for 3 class folders"):
        ClassFolder(root, ["a", "b"])
    (root / "empty").mkdir()
    with pytest.raises(ValueError, match=r"ImageNet layout.*\['empty'\] hold no images"):
        ClassFolder(root)
    (root / "empty" / "bad.png").write_bytes(b"not a png")
    with pytest.raises(OSError, match=r"bad\.png: cannot read its image"):
        ClassFolder(root).load(9, ["image"])  # the fourth folder's only image


def test_templates_are_open_clips():
    assert templates("simple") == SIMPLE_TEMPLATES and len(SIMPLE_TEMPLATES) == 7
    open_clip = pytest.importorskip("open_clip")
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    assert [t("cat") for t in SIMPLE_IMAGENET_TEMPLATES] == [t.format("cat") for t in SIMPLE_TEMPLATES]
    assert len(templates("openai")) == len(OPENAI_IMAGENET_TEMPLATES) == 80
    assert open_clip is not None
    with pytest.raises(ValueError, match="exactly one"):
        templates(["a photo"])


def test_zero_shot_over_a_class_folder_is_clips_classifier(tmp_path):
    """The callback over the folder equals CLIP's zero-shot classifier computed by hand on its images."""
    torch.manual_seed(0)
    model = CLIPModel().eval()
    transform, _ = pair_preprocessing(32)
    data = ClassFolder(_folder(tmp_path), transform=transform)
    tokenizer = CaptionTokenizer(None, 16)
    prompts = ("a {} circle", "a {} square")
    callback = ZeroShotClassification(data, data.classnames, prompts, tokenizer.batch, ks=[1, 2])
    got = callback.evaluate(model)

    with torch.no_grad():
        tokens = tokenizer.batch([p.format(c) for c in data.classnames for p in prompts])
        text = model.tower_specs()["text"].encode(tokens)
        text = torch.nn.functional.normalize(text, dim=-1).view(3, 2, -1).mean(1)
        images = torch.stack([data.load(i, ["image"])["image"] for i in range(len(data))])
        image = torch.nn.functional.normalize(model.tower_specs()["image"].encode({"image": images}), dim=-1)
    predicted = (image @ torch.nn.functional.normalize(text, dim=-1).T).argmax(1)
    labels = torch.tensor([data.load(i, ["label"])["label"] for i in range(len(data))])
    assert got["n"] == 9 and got["chance_top1"] == pytest.approx(1 / 3)
    assert got["top1"] == pytest.approx((predicted == labels).float().mean().item())


@pytest.mark.slow
def test_the_recipe_classifies_a_users_own_class_folder_above_chance(tmp_path):
    """make_csv's renders as the user's pairs; their held-out images sorted into one folder per colour;
    50 distmm steps, then ``zeroshot.folder=`` classifies the 8 colours, prompts ensembled over shapes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, str(ROOT / "recipes" / "make_csv.py"), "--out", str(tmp_path / "csv"), "--train", "1000"]
    subprocess.run([*run, "--val", "128"], check=True, env=env, capture_output=True, timeout=120)
    classes = tmp_path / "classes"
    colours = ("red", "green", "blue", "yellow", "purple", "cyan", "pink", "white")
    with open(tmp_path / "csv" / "val.csv", newline="") as f:
        for row in csv.DictReader(f):
            colour = next(w for w in row["title"].split() if w in colours)
            (classes / colour).mkdir(parents=True, exist_ok=True)
            shutil.copy(tmp_path / "csv" / row["filepath"], classes / colour)
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "experiment=clip_shapes_csv",
           f"data.path={tmp_path / 'csv' / 'train.csv'}", f"data.val_path={tmp_path / 'csv' / 'val.csv'}",
           "trainer.max_steps=50", "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0",
           "eval.enabled=false", "callbacks=none", f"zeroshot.folder={classes}",
           'zeroshot.templates=["a {} circle","a {} square","a {} triangle","a {} cross"]',
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "zero-shot: ClassFolder(" in log and "8 classes, 128 images), 4 templates" in log
    top1, chance = map(float, re.search(r"zero-shot top1 = ([\d.]+) \(chance ([\d.]+)\)", log).groups())
    print(f"zero-shot top1 {top1:.3f} (chance {chance})")
    assert chance == 0.125 and top1 > 2 * chance, log[-2000:]
