"""open_clip and Hugging Face round trips: the other library, given our exported weights, computes
the same features as our model (max abs diff <= 1e-6), and our model, given theirs, the same as theirs."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_distmm.models.bridges import (
    from_hf,
    from_open_clip,
    open_clip_compatible,
    save_hf,
    save_open_clip,
    to_open_clip,
)
from lightning_distmm.models.clip import CLIP_TINY, CLIPModel

open_clip = pytest.importorskip("open_clip")

TOL = 1e-6


def _tiny(act: str = "gelu") -> CLIPModel:
    cfg = open_clip_compatible(copy.deepcopy(CLIP_TINY))
    for tower in cfg["towers"].values():
        tower["act"] = act
    torch.manual_seed(0)
    model = CLIPModel(cfg).eval()
    with torch.no_grad():  # move every weight off its init (LayerNorms at 1/0, zero biases) so a swap shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _inputs(n: int = 4, seq: int = 16, vocab: int = 64, eos: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    image = torch.randn(n, 3, 32, 32, generator=g)
    ids = torch.randint(4, vocab, (n, seq), generator=g)
    mask = torch.zeros(n, seq, dtype=torch.long)
    for row, length in enumerate([5, 9, 16, 2][:n]):
        ids[row, 0], ids[row, length - 1], ids[row, length:] = 2, eos, 0
        mask[row, :length] = 1
    return {"image": image, "input_ids": ids, "attention_mask": mask}


def _ours(model: CLIPModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        f = model.encode(batch)
    return f["image"], f["text"]


def test_the_default_tiny_vit_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="not CLIP's ViT.*open_clip_compatible"):
        to_open_clip(CLIPModel())


def test_every_mismatch_is_named_at_once_and_the_shipped_config_exports(tmp_path):
    import yaml

    from lightning_distmm.models.bridges import to_hf

    with pytest.raises(ValueError, match="not CLIP's ViT.*different activations.*model=clip_tiny_openclip"):
        to_open_clip(CLIPModel())
    save_open_clip(CLIPModel(open_clip_compatible(CLIP_TINY)), tmp_path / "oc")  # the helper's config exports
    from pathlib import Path

    shipped = yaml.safe_load((Path(__file__).parents[1] / "conf/model/clip_tiny_openclip.yaml").read_text())
    to_hf(CLIPModel(shipped))
    coca = {**open_clip_compatible(CLIP_TINY), "loss": "coca"}
    with pytest.raises(ValueError, match="CoCa"):
        from lightning_distmm.models.bridges.neutral import _check_ours

        _check_ours(type("M", (), {"model_cfg": coca})())


@pytest.mark.parametrize("act", ["gelu", "quick_gelu"])
def test_open_clip_create_model_gives_our_features(tmp_path, act):
    model, batch = _tiny(act), _inputs()
    folder = save_open_clip(model, tmp_path / "oc")
    oc = open_clip.create_model(f"local-dir:{folder}").eval()
    with torch.no_grad():
        image, text = oc.encode_image(batch["image"]), oc.encode_text(batch["input_ids"])
    ours_image, ours_text = _ours(model, batch)
    assert (image - ours_image).abs().max() <= TOL and (text - ours_text).abs().max() <= TOL
    assert torch.equal(oc.logit_scale.detach(), model.logit_scale.detach())


def test_open_clip_checkpoint_loads_into_ours(tmp_path):
    """An open_clip arch registered from a JSON config (as open_clip's model_configs/*.json) and a
    state_dict file of it: create_model(arch) + load_state_dict, and our model built from both."""
    import json

    cfg, _ = to_open_clip(_tiny())
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-test-clip.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path / "configs")
    torch.manual_seed(3)
    oc = open_clip.create_model("tiny-test-clip").eval()
    torch.save(oc.state_dict(), tmp_path / "oc.pt")
    fresh = open_clip.create_model("tiny-test-clip").eval()
    fresh.load_state_dict(torch.load(tmp_path / "oc.pt"))

    model = from_open_clip(tmp_path / "oc.pt", "tiny-test-clip").eval()
    batch = _inputs()
    with torch.no_grad():
        image, text = fresh.encode_image(batch["image"]), fresh.encode_text(batch["input_ids"])
    ours_image, ours_text = _ours(model, batch)
    assert (image - ours_image).abs().max() <= TOL and (text - ours_text).abs().max() <= TOL
    # and back: the export is the checkpoint it came from
    _, state = to_open_clip(model)
    reference = {k: v for k, v in oc.state_dict().items() if k != "attn_mask"}
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)


def test_open_clip_features_without_a_counterpart_are_named():
    from lightning_distmm.models.bridges import from_open_clip_config

    with pytest.raises(NotImplementedError, match="vision_cfg.timm_model_name"):
        from_open_clip_config({"embed_dim": 8, "vision_cfg": {"timm_model_name": "vit_tiny"}, "text_cfg": {}})


def test_a_siglip_model_keeps_its_bias_in_open_clip_and_is_refused_by_hugging_face(tmp_path):
    from lightning_distmm.models.bridges import to_hf

    model = _tiny()
    model = CLIPModel({**model.model_cfg, "loss": "siglip", "init_logit_bias": -7.5}).eval()
    with pytest.raises(ValueError, match="logit bias.*save_open_clip"):
        to_hf(model)
    oc = open_clip.create_model(f"local-dir:{save_open_clip(model, tmp_path / 'oc')}")
    assert torch.equal(oc.logit_bias.detach(), model.logit_bias.detach())


def test_hugging_face_round_trip(tmp_path):
    from transformers import CLIPModel as HFCLIPModel

    model, batch = _tiny("quick_gelu"), _inputs()
    save_hf(model, tmp_path / "hf")
    hf = HFCLIPModel.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        image = hf.get_image_features(pixel_values=batch["image"])
        text = hf.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    image = getattr(image, "pooler_output", image)
    text = getattr(text, "pooler_output", text)
    ours_image, ours_text = _ours(model, batch)
    assert (image - ours_image).abs().max() <= TOL and (text - ours_text).abs().max() <= TOL

    back = from_hf(tmp_path / "hf").eval()
    back_image, back_text = _ours(back, batch)
    assert (back_image - ours_image).abs().max() <= TOL and (back_text - ours_text).abs().max() <= TOL
    assert back.state_dict().keys() == model.state_dict().keys()


# ---------------------------------------------------------------------- checkpoints
def _fit(tmp_path, strategy, devices: int, ckpt_every: int = 2):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_distmm.data.demo.shapes import ShapesDataModule

    L.seed_everything(0)
    model = _tiny()
    model.train()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=2,
        logger=False,
        callbacks=[saver],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=ShapesDataModule(batch_size=8, train_size=32, shuffle=False))
    return model


@pytest.mark.slow
def test_load_from_checkpoint_reads_a_distmm_folder(tmp_path):
    """CLIPModel.load_from_checkpoint on the folder ModelCheckpoint wrote under distmm gives the
    trained weights (the fork launcher hands the parent the consolidated ones), and exports."""
    from distmm_testing import in_subprocess

    import lightning_distmm as ldm

    def run() -> None:
        plan = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})
        trained = _fit(tmp_path, ldm.DistMMStrategy(plan=plan, start_method="fork"), 2)
        folder = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
        assert folder.is_dir()
        loaded = CLIPModel.load_from_checkpoint(folder)
        assert loaded.model_cfg == trained.model_cfg
        a, b = loaded.state_dict(), trained.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        to_open_clip(loaded)  # the loaded model exports

    in_subprocess(run)


@pytest.mark.slow
def test_load_from_checkpoint_still_reads_files_and_names_bad_folders(tmp_path):
    from distmm_testing import in_subprocess

    from lightning_distmm.models.checkpoints import load_checkpoint

    def run() -> None:  # in a child: a fit in the pytest process would keep later tests from forking ranks
        trained = _fit(tmp_path, "auto", 1)
        loaded = CLIPModel.load_from_checkpoint(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
        assert all(torch.equal(v, trained.state_dict()[k]) for k, v in loaded.state_dict().items())

    in_subprocess(run)

    (tmp_path / "empty").mkdir()
    with pytest.raises(IsADirectoryError, match="not a distmm checkpoint folder"):
        load_checkpoint(CLIPModel, tmp_path / "empty")
