"""Shapes data, caption tokenizer, CLIP builders and retrieval metrics (fast, one process)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_distmm.data.demo import tokenizer as tk
from lightning_distmm.data.demo.shapes import (
    NUM_COMBOS,
    PIXEL_MEAN,
    PIXEL_STD,
    ShapesDataModule,
    ShapesDataset,
    describe,
    vocabulary,
)
from lightning_distmm.models.clip import CLIP_TINY, CLIPModel, TextTower, num_parameters
from lightning_distmm.models.metrics import retrieval_from_features, retrieval_metrics
from lightning_distmm.models.tiny import quiet_trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- dataset
def test_dataset_is_deterministic():
    a, b = ShapesDataset("train", size=50, seed=3), ShapesDataset("train", size=50, seed=3)
    for i in (0, 7, 49):
        sa, sb = a[i], b[i]
        assert sa["caption"] == sb["caption"] and sa["label"] == sb["label"]
        assert torch.equal(sa["image"], sb["image"])
        assert torch.equal(sa["input_ids"], sb["input_ids"])
    other = ShapesDataset("train", size=50, seed=4)
    assert any(not torch.equal(a[i]["image"], other[i]["image"]) for i in range(5))


def test_sample_shapes_and_caption_content():
    ds = ShapesDataset("val", size=20)
    s = ds[5]
    assert s["image"].shape == (3, 32, 32) and s["image"].dtype == torch.float32
    lo, hi = (0 - PIXEL_MEAN) / PIXEL_STD, (1 - PIXEL_MEAN) / PIXEL_STD
    assert lo - 1e-5 <= float(s["image"].min()) and float(s["image"].max()) <= hi + 1e-5
    assert s["input_ids"].shape == (16,) and s["input_ids"].dtype == torch.long
    assert s["attention_mask"].shape == (16,) and s["attention_mask"].dtype == torch.long
    color, shape, position = describe(s["label"])
    assert color in s["caption"] and shape in s["caption"]
    assert set(s["caption"].split()) <= set(vocabulary())


def test_splits_are_disjoint_and_val_descriptions_unique():
    train, val = ShapesDataset("train", size=300), ShapesDataset("val", size=256)
    assert train.offset + len(train) <= val.offset
    labels = [val.load(i, ["label"])["label"] for i in range(len(val))]
    assert len(set(labels)) == len(labels)  # exact-pair retrieval is well defined
    # the same index in another split is another sample
    assert not torch.equal(train.load(0, ["image"])["image"], val.load(0, ["image"])["image"])
    # a block of NUM_COMBOS consecutive samples holds every combination once
    assert sorted(train.load(i, ["label"])["label"] for i in range(NUM_COMBOS)) == list(range(NUM_COMBOS))


def test_load_does_only_the_work_asked_for(monkeypatch):
    ds = ShapesDataset("train", size=10)
    calls = {"render": 0, "tokenize": 0}
    render, tokenize = ShapesDataset.render, ShapesDataset.tokenize

    def counting_render(self, *a, **k):
        calls["render"] += 1
        return render(self, *a, **k)

    def counting_tokenize(self, *a, **k):
        calls["tokenize"] += 1
        return tokenize(self, *a, **k)

    monkeypatch.setattr(ShapesDataset, "render", counting_render)
    monkeypatch.setattr(ShapesDataset, "tokenize", counting_tokenize)

    out = ds.load(3, ["caption"])
    assert set(out) == {"caption"} and calls == {"render": 0, "tokenize": 0}
    out = ds.load(3, ["input_ids", "attention_mask"])
    assert set(out) == {"input_ids", "attention_mask"} and calls == {"render": 0, "tokenize": 1}
    image_alone = ds.load(3, ["image"])["image"]
    assert calls == {"render": 1, "tokenize": 1}
    full = ds[3]
    assert calls == {"render": 2, "tokenize": 2}
    # a field does not depend on which other fields were loaded with it
    assert torch.equal(image_alone, full["image"])
    assert torch.equal(out["input_ids"], full["input_ids"])
    with pytest.raises(KeyError, match="no field"):
        ds.load(0, ["pixels"])


def test_field_subset_via_fields_argument():
    ds = ShapesDataset("train", size=8, fields=["image", "caption"])
    batch = next(iter(DataLoader(ds, batch_size=4)))
    assert set(batch) == {"image", "caption"} and batch["image"].shape == (4, 3, 32, 32)
    assert len(batch["caption"]) == 4


def test_datamodule_global_batch_and_seeded_shuffle():
    dm = ShapesDataModule(batch_size=16, train_size=40, val_size=20, shuffle=True, shuffle_seed=1)
    train = dm.train_dataloader()
    batches = [b["label"] for b in train]
    assert len(batches) == 2 and all(len(b) == 16 for b in batches)  # drop_last on train
    again = [
        b["label"]
        for b in ShapesDataModule(batch_size=16, train_size=40, val_size=20, shuffle_seed=1).train_dataloader()
    ]
    assert all(torch.equal(x, y) for x, y in zip(batches, again))
    val_sizes = [len(b["label"]) for b in dm.val_dataloader()]
    assert val_sizes == [16, 4]  # val keeps the partial batch
    unshuffled = ShapesDataModule(batch_size=16, train_size=40, shuffle=False).train_dataloader()
    first = next(iter(unshuffled))["label"]
    assert first.tolist() == [dm.train_dataset.load(i, ["label"])["label"] for i in range(16)]


# ---------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip_and_layout(tmp_path):
    tok = tk.build_caption_tokenizer()
    vocab = tok.get_vocab()
    assert [vocab[t] for t in tk.SPECIAL_TOKENS] == [tk.PAD_ID, tk.UNK_ID, tk.BOS_ID, tk.EOS_ID]
    assert set(vocabulary()) <= set(vocab) and tok.get_vocab_size() <= CLIP_TINY["towers"]["text"]["vocab_size"]
    ds = ShapesDataset("train", size=50)
    captions = [ds.load(i, ["caption"])["caption"] for i in range(50)]
    enc = tk.encode(captions, 16, tok)
    assert enc["input_ids"].shape == (50, 16)
    for row, caption in zip(enc["input_ids"], captions):
        assert tk.decode(row, tok) == caption
    lengths = enc["attention_mask"].sum(-1)
    last = enc["input_ids"][torch.arange(50), lengths - 1]
    assert (enc["input_ids"][:, 0] == tk.BOS_ID).all() and (last == tk.EOS_ID).all()
    assert (enc["input_ids"][enc["attention_mask"] == 0] == tk.PAD_ID).all()
    # truncation keeps [EOS]; unknown words map to [UNK]
    short = tk.encode("a picture of a purple triangle at the bottom right", 6, tok)
    assert short["input_ids"].tolist()[-1] == tk.EOS_ID and short["attention_mask"].tolist() == [1] * 6
    assert tk.encode("a zebra", 5, tok)["input_ids"].tolist() == [
        tk.BOS_ID,
        vocab["a"],
        tk.UNK_ID,
        tk.EOS_ID,
        tk.PAD_ID,
    ]
    # ids are fixed (special tokens, then the words sorted) and survive the file cache
    assert vocab == {t: i for i, t in enumerate([*tk.SPECIAL_TOKENS, *sorted(vocabulary())])}
    path = tmp_path / "tok.json"
    tk.build_caption_tokenizer(path)
    cached = tk.build_caption_tokenizer(path)
    assert cached.get_vocab() == vocab and cached.encode(captions[0]).ids == tok.encode(captions[0]).ids


# ---------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def batch():
    return next(iter(DataLoader(ShapesDataset("train", size=8), batch_size=8)))


def test_conf_model_matches_python_default():
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "clip_tiny.yaml"))
    assert cfg == CLIP_TINY


def test_clip_tiny_towers_and_size(batch):
    torch.manual_seed(0)
    model = CLIPModel()
    assert num_parameters(model) < 500_000
    towers = model.towers()
    assert set(towers) == {"image", "text"}
    assert towers["image"].module is model.visual and towers["image"].fields == ("image",)
    assert towers["text"].module is model.text and towers["text"].fields == ("input_ids", "attention_mask")
    features = model.encode(batch)
    assert features["image"].shape == (8, 64) and features["text"].shape == (8, 64)
    loss = model.contrastive_loss(batch)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(8)) < 2.0  # near chance at init


def test_sync_groups_from_the_config(batch):
    """model.sync_groups=2 makes the module compute the distmm schedule's grouped loss."""
    torch.manual_seed(0)
    model = CLIPModel({**copy.deepcopy(CLIP_TINY), "sync_groups": 2})
    assert model.sync_groups == 2
    features = model.encode(batch)
    halves = [model.interaction_loss({k: f[a:b] for k, f in features.items()}) for a, b in ((0, 4), (4, 8))]
    assert model.contrastive_loss(batch).item() == pytest.approx((sum(halves) / 2).item(), abs=1e-6)


def test_text_tower_pools_last_real_token():
    torch.manual_seed(0)
    tower = TextTower(vocab_size=64, context_length=16, width=32, layers=1, heads=2, mlp_ratio=2.0, embed_dim=8).eval()
    enc = tk.encode(["a red circle at the top", "a blue cross on the left"], 16)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    out = tower(ids, mask)
    assert out.shape == (2, 8)
    noisy = ids.clone()
    noisy[mask == 0] = torch.randint(4, 30, (int((mask == 0).sum()),))  # junk (even high ids) where masked
    assert torch.allclose(tower(noisy, mask), out, atol=1e-5)
    # the pooled token is the [EOS]: changing a real word changes the feature
    changed = ids.clone()
    changed[0, 2] = tk.build_caption_tokenizer().token_to_id("green")
    assert not torch.allclose(tower(changed, mask)[0], out[0])


def test_bert_text_tower_and_frozen_flag(batch):
    cfg = copy.deepcopy(CLIP_TINY)
    cfg["towers"]["text"]["arch"] = "bert"
    cfg["towers"]["image"]["frozen"] = True
    model = CLIPModel(cfg)
    assert model.encode(batch)["text"].shape == (8, 64)
    assert model.tower_specs()["image"].frozen
    assert not any(p.requires_grad for p in model.visual.parameters())
    opt = model.configure_optimizers()["optimizer"]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not in_opt & {id(p) for p in model.visual.parameters()}
    assert id(model.logit_scale) in in_opt


def test_bad_config_errors():
    cfg = copy.deepcopy(CLIP_TINY)
    cfg["towers"]["image"]["arch"] = "resnet9000"
    with pytest.raises(ValueError, match="unknown tower arch"):
        CLIPModel(cfg)
    cfg = copy.deepcopy(CLIP_TINY)
    del cfg["towers"]["text"]["width"]
    with pytest.raises(KeyError, match="width"):
        CLIPModel(cfg)
    cfg = copy.deepcopy(CLIP_TINY)
    cfg["towers"]["image"]["pretrained_path"] = "/nonexistent/vit.pt"
    with pytest.raises(FileNotFoundError, match="not a local file"):
        CLIPModel(cfg)


def test_pretrained_path_loads_local_weights(tmp_path):
    torch.manual_seed(0)
    source = CLIPModel()
    path = tmp_path / "vit.pt"
    torch.save(source.visual.state_dict(), path)
    cfg = copy.deepcopy(CLIP_TINY)
    cfg["towers"]["image"]["pretrained_path"] = str(path)
    torch.manual_seed(1)
    loaded = CLIPModel(cfg)
    for (k, a), b in zip(source.visual.state_dict().items(), loaded.visual.state_dict().values()):
        assert torch.equal(a, b), k


# ---------------------------------------------------------------------- metrics
def test_retrieval_from_features():
    eye = torch.eye(10)
    assert retrieval_from_features(eye, eye) == {1: 1.0, 5: 1.0}
    collapsed = torch.ones(10, 4)
    assert retrieval_from_features(collapsed, collapsed) == {1: 0.0, 5: 0.0}  # ties count against
    shifted = eye.roll(1, dims=0)
    assert retrieval_from_features(eye, shifted)[1] == 0.0


def test_retrieval_counts_any_pair_with_the_same_caption_as_a_match():
    """32 pairs, 8 unique captions: a perfect model (each image nearest its caption's text) scores
    R@1 = 1 both ways, not the 0.25 that counting duplicates against the query capped it at."""
    captions = [i % 8 for i in range(32)]
    text = torch.eye(8)[captions]  # equal captions encode to the same text feature
    image = text + 0.01 * torch.randn(32, 8)
    assert retrieval_from_features(image, text)[1] <= 0.25 + 1e-9  # without keys: ties count against
    keys = [("caption", c) for c in captions]
    assert retrieval_from_features(image, text, (1,), keys) == {1: 1.0}
    assert retrieval_from_features(text, image, (1,), keys) == {1: 1.0}
    collapsed = torch.ones(32, 8)  # still no credit for a collapsed model
    assert retrieval_from_features(collapsed, collapsed, (1,), keys) == {1: 0.0}


def test_retrieval_metrics_runs_on_a_module():
    model = CLIPModel()
    loader = DataLoader(ShapesDataset("val", size=40), batch_size=16)
    m = retrieval_metrics(model, loader)
    assert m["n"] == 40 and m["chance/top1"] == pytest.approx(1 / 40) and m["chance/top5"] == pytest.approx(5 / 40)
    for key in ("image->text/top1", "text->image/top1", "image->text/top5", "text->image/top5"):
        assert 0.0 <= m[key] <= 1.0
    assert model.training  # restored


# ---------------------------------------------------------------------- training
class _Losses(L.Callback):
    def __init__(self):
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


def test_training_reduces_loss_and_checkpoint_restores(tmp_path):
    # From scratch, CLIP first collapses to the chance loss log(B) and only leaves it after ~100
    # steps on fresh data; 30 steps on 64 samples (two batches, cycled) must get well below chance.
    L.seed_everything(0)
    model = CLIPModel(optim={"lr": 1e-3, "warmup_steps": 0, "scheduler": "constant"})
    dm = ShapesDataModule(batch_size=32, train_size=64, val_size=32)
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=30,
        gradient_clip_val=1.0,
        callbacks=[losses],
        default_root_dir=str(tmp_path),
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, datamodule=dm)
    assert len(losses.values) == 30
    first, last = sum(losses.values[:5]) / 5, sum(losses.values[-5:]) / 5
    assert last < math.log(32) - 0.3 and last < first - 0.5, (first, last)  # seeds 0-4: 2.4-2.9

    path = tmp_path / "clip.ckpt"
    trainer.save_checkpoint(path)
    restored = CLIPModel.load_from_checkpoint(path)
    assert restored.model_cfg == model.model_cfg and restored.optim_cfg["lr"] == 1e-3
    for (k, a), b in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), k


class _LRs(L.Callback):
    def __init__(self):
        self.values: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.values.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_warmup_cosine_schedule_steps_per_step(tmp_path):
    model = CLIPModel(optim={"lr": 1e-3, "warmup_steps": 4, "scheduler": "cosine", "min_lr_ratio": 0.1})
    lrs = _LRs()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=12, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[lrs],
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(model, datamodule=ShapesDataModule(batch_size=8, train_size=96, val_size=8))
    expected = [1e-3 * (i + 1) / 4 for i in range(4)]
    expected += [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 8))) for i in range(8)]
    assert lrs.values == pytest.approx(expected)


# ---------------------------------------------------------------------- hydra configs
def test_hydra_configs_compose():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["strategy=single"])
        assert cfg.strategy.name == "single" and cfg.data.batch_size == 64
        assert cfg.data.image_size == cfg.model.towers.image.img_size
        assert cfg.data.context_length == cfg.model.towers.text.context_length
        for strategy in ("distmm", "ddp"):
            assert compose(config_name="train", overrides=[f"strategy={strategy}"]).strategy.name == strategy
        plan = compose(config_name="train").strategy.plan  # the main job names its plan: a tower per rank
        from lightning_distmm.planner.machine.config import to_plain

        assert to_plain(plan) == {"world_size": 2, "towers": {"image": {"ranks": [0]}, "text": {"ranks": [1]}}}
        assert compose(config_name="train", overrides=["strategy.plan=null"]).strategy.plan is None


def test_contrastive_losses_name_a_width_or_dtype_mismatch():
    """Towers of different widths failed as ``mat1 and mat2 shapes cannot be multiplied (4x8 and
    16x8)`` and a float64 tower as ``expected m1 and m2 to have the same dtype``."""
    from lightning_distmm.losses import clip_loss, siglip_loss

    scale = torch.tensor(1.0)
    with pytest.raises(ValueError, match="image features are 16 wide and the text features 8"):
        clip_loss(torch.randn(4, 16), torch.randn(4, 8), scale)
    with pytest.raises(TypeError, match="torch.float64 and the text features torch.float32"):
        siglip_loss(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8), scale, torch.tensor(0.0))
