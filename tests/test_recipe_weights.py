"""Weights in the recipe: ``init=`` starts from local open_clip / Hugging Face weights with
fine-tuning defaults, ``export.open_clip=`` / ``export.hf=`` write the trained model, every shipped
open_clip-named config exports, and a config that cannot export is refused before training."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_distmm.models.bridges import from_open_clip, open_clip_compatible, save_hf, save_open_clip, to_open_clip
from lightning_distmm.models.bridges.neutral import FINETUNE_OPTIM
from lightning_distmm.models.bridges.recipe import export_problems, finetune_optim, load_init, parse_init
from lightning_distmm.models.clip import CLIP_TINY, CLIPModel
from lightning_distmm.planner.machine.config import CONF_DIR

open_clip = pytest.importorskip("open_clip")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import train  # noqa: E402

# the shipped configs named after open_clip's models -> open_clip's arch
OPEN_CLIP_NAMED = {
    "clip_vit_b32": "ViT-B-32",
    "clip_vit_l14": "ViT-L-14",
    "clip_vit_h14": "ViT-H-14",
    "clip_vit_g14": "ViT-g-14",
    "clip_vit_bigg14": "ViT-bigG-14",
}


def _tiny_openclip(seed: int = 0) -> CLIPModel:
    torch.manual_seed(seed)
    model = CLIPModel(yaml.safe_load((CONF_DIR / "model" / "clip_tiny_openclip.yaml").read_text())).eval()
    with torch.no_grad():  # off the LayerNorm 1/0 and zero-bias init, so a missed weight shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _batch(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 64, (n, 16), generator=g)
    mask = torch.zeros(n, 16, dtype=torch.long)
    for row in range(n):
        length = 3 + 2 * row
        ids[row, 0], ids[row, length - 1], ids[row, length:] = 2, 3, 0
        mask[row, :length] = 1
    return {"image": torch.randn(n, 3, 32, 32, generator=g), "input_ids": ids, "attention_mask": mask}


def _features(model: CLIPModel, batch: dict) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return model.eval().encode(batch)


@pytest.mark.parametrize("preset", sorted(OPEN_CLIP_NAMED))
def test_every_open_clip_named_config_exports_to_open_clips_own_architecture(preset):
    """Built on the meta device (shapes only): the exported state has open_clip's keys and shapes."""
    from open_clip.factory import get_model_config

    theirs = dict(get_model_config(OPEN_CLIP_NAMED[preset]))
    theirs.pop("custom_text", None)
    cfg = yaml.safe_load((CONF_DIR / "model" / f"{preset}.yaml").read_text())
    with torch.device("meta"):
        model = CLIPModel(cfg)
        exported_cfg, state = to_open_clip(model)
        reference = open_clip.CLIP(**theirs).state_dict()
    assert export_problems(model, ["open_clip", "hf"]) == []
    assert set(state) == set(reference)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in reference.items()}
    assert exported_cfg["quick_gelu"] == bool(theirs.get("quick_gelu", False))


def test_a_config_that_cannot_export_is_refused_before_training():
    with pytest.raises(SystemExit, match=r"not training: export.open_clip: .*not CLIP's ViT.*model=clip_tiny_openclip"):
        train.check_exportable(CLIPModel(), {"open_clip": "out"})
    siglip = open_clip_compatible(copy.deepcopy(CLIP_TINY))
    siglip["loss"] = "siglip"
    problems = export_problems(CLIPModel(siglip), ["open_clip", "hf", "onnx"])
    assert len(problems) == 2
    assert (
        problems[0].startswith("export.hf: this model has a logit bias") and "export.open_clip keeps it" in problems[0]
    )
    assert problems[1].startswith("export.onnx: unknown format")
    train.check_exportable(CLIPModel(), {})  # nothing to export: nothing refused


def test_init_forms_are_parsed_and_bad_ones_named(tmp_path):
    folder = save_open_clip(_tiny_openclip(), tmp_path / "oc")
    spec = parse_init(f"open_clip:{folder}")
    assert (spec.kind, spec.weights.name, Path(spec.arch).name) == (
        "open_clip",
        "open_clip_model.safetensors",
        "open_clip_config.json",
    )
    spec = parse_init(f"open_clip:ViT-B-32:{folder / 'open_clip_model.safetensors'}")
    assert (spec.arch, spec.weights) == ("ViT-B-32", folder / "open_clip_model.safetensors")
    with pytest.raises(ValueError, match="expected open_clip:<folder>"):
        parse_init("timm:vit")
    with pytest.raises(FileNotFoundError, match="not a local file"):
        parse_init("open_clip:ViT-B-32:/nowhere/ViT-B-32.pt")
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        parse_init("hf:/nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds open_clip_config.json"):
        parse_init(f"open_clip:{tmp_path / 'empty'}")


def test_init_loads_open_clip_and_hugging_face_weights_with_their_features(tmp_path):
    source, batch = _tiny_openclip(), _batch()
    want = _features(source, batch)
    from_oc = load_init(parse_init(f"open_clip:{save_open_clip(source, tmp_path / 'oc')}"))
    from_hf = load_init(parse_init(f"hf:{save_hf(source, tmp_path / 'hf')}"))
    for loaded in (from_oc, from_hf):
        assert (loaded.optim_cfg["lr"], loaded.optim_cfg["warmup_steps"]) == (1e-5, 20)  # fine-tuning, not 3e-3
        got = _features(loaded, batch)
        for tower in ("image", "text"):
            assert (got[tower] - want[tower]).abs().max() <= 1e-6


def test_fine_tuning_defaults_replace_the_from_scratch_ones_unless_the_command_line_sets_them():
    optim = {"lr": 3e-3, "warmup_steps": 100, "weight_decay": 0.1, "finetune": {"lr": 1e-5, "warmup_steps": 20}}
    out, changed = finetune_optim(optim)
    assert out == {"lr": 1e-5, "warmup_steps": 20, "weight_decay": 0.1} and changed == {"lr": 1e-5, "warmup_steps": 20}
    out, changed = finetune_optim({**optim, "lr": 5e-5}, ["optim.lr=5e-5", "init=hf:x"])
    assert out["lr"] == 5e-5 and out["warmup_steps"] == 20 and changed == {"warmup_steps": 20}
    shipped = yaml.safe_load((CONF_DIR / "optim" / "adamw.yaml").read_text())
    assert shipped["finetune"]["lr"] < shipped["lr"] and shipped["finetune"]["warmup_steps"] < shipped["warmup_steps"]
    assert shipped["finetune"] == FINETUNE_OPTIM  # the recipe's and the bridges' defaults are one


@pytest.mark.slow
def test_init_train_export_round_trip_through_the_recipe(tmp_path):
    """open_clip weights in -> 10 distmm steps on 2 ranks -> open_clip and Hugging Face folders out:
    both libraries compute the trained model's features (<= 1e-5), the weights moved off the init,
    and the retrieval the recipe printed is the exported model's."""
    from transformers import CLIPModel as HFCLIPModel

    from lightning_distmm.data.demo.shapes import ShapesDataModule
    from lightning_distmm.models.metrics import retrieval_metrics

    start = _tiny_openclip(seed=1)
    init = save_open_clip(start, tmp_path / "init")
    out_oc, out_hf, run = tmp_path / "out_oc", tmp_path / "out_hf", tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), f"init=open_clip:{init}",
           f"export.open_clip={out_oc}", f"export.hf={out_hf}", "trainer.max_steps=10", "data.train_size=640",
           "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", "+trainer.limit_val_batches=0",
           f"hydra.run.dir={run}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "fine-tuning with optim.lr=1e-05, optim.warmup_steps=20" in log
    assert f"exported open_clip: {out_oc}" in log and f"exported hf: {out_hf}" in log
    # logger: null (the default) writes no lightning_logs/; Hydra's train.log holds what was said
    assert not (run / "lightning_logs").exists() and not (tmp_path / "lightning_logs").exists()
    job_log = (run / "train.log").read_text()
    assert "init: open_clip weights" in job_log and "model open_clip:" in job_log and "exported hf:" in job_log

    ours = from_open_clip(out_oc / "open_clip_model.safetensors", out_oc / "open_clip_config.json").eval()
    moved = max((a - b).abs().max().item() for a, b in zip(ours.state_dict().values(), start.state_dict().values()))
    assert moved > 1e-5  # trained (10 steps of Adam at <= 1e-5 in warmup), not the init written back
    batch = _batch()
    want = _features(ours, batch)
    oc = open_clip.create_model(f"local-dir:{out_oc}").eval()
    hf = HFCLIPModel.from_pretrained(str(out_hf), local_files_only=True).eval()
    with torch.no_grad():
        got_oc = {"image": oc.encode_image(batch["image"]), "text": oc.encode_text(batch["input_ids"])}
        got_hf = {
            "image": hf.get_image_features(pixel_values=batch["image"]),
            "text": hf.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]),
        }
    for got in (got_oc, got_hf):
        for tower in ("image", "text"):
            feats = getattr(got[tower], "pooler_output", got[tower])  # transformers 5 returns an output object
            assert (feats - want[tower]).abs().max() <= 1e-5, tower

    printed = json.loads((run / "metrics.json").read_text())
    dm = ShapesDataModule(batch_size=64, train_size=640, val_size=256, image_size=32, context_length=16)
    held_out = getattr(dm, "retrieval_dataset", None) or dm.val_dataset
    again = retrieval_metrics(ours, torch.utils.data.DataLoader(held_out, batch_size=256))
    assert again["image->text/top1"] == printed["image->text/top1"]
    assert again["text->image/top1"] == printed["text->image/top1"]


@pytest.mark.slow
def test_init_by_open_clip_arch_name_loads_a_real_vit_b32_checkpoint(tmp_path):
    """``init=open_clip:ViT-B-32:<file>``: open_clip's own ViT-B-32 (random weights, nothing downloaded)
    saved as a checkpoint file loads with open_clip's features (<= 1e-5) and fine-tuning defaults."""
    torch.manual_seed(0)
    oc = open_clip.create_model("ViT-B-32").eval()
    torch.save(oc.state_dict(), tmp_path / "ViT-B-32.pt")
    model = load_init(parse_init(f"open_clip:ViT-B-32:{tmp_path / 'ViT-B-32.pt'}")).eval()
    assert model.optim_cfg["lr"] == 1e-5 and model.model_cfg["towers"]["text"]["vocab_size"] == 49408
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    ids = tokenizer(["a photo of a cat", "a diagram of the digit seven"])
    mask = (ids != 0).long()
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_image, want_text = oc.encode_image(images), oc.encode_text(ids)
        got = model.encode({"image": images, "input_ids": ids, "attention_mask": mask})
    assert (got["image"] - want_image).abs().max() <= 1e-5
    assert (got["text"] - want_text).abs().max() <= 1e-5
