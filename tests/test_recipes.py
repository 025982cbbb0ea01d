"""recipes/train.py's Hydra config: groups, experiments, _target_ instantiation, the epoch count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import train  # noqa: E402


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=["out_dir=/tmp/unused", *overrides])


@pytest.mark.parametrize("experiment", ["clip_shapes", "clip_digits", "clip_csv", "clip_shapes_csv"])
def test_experiments_compose_and_instantiate(experiment):
    cfg = _compose(f"experiment={experiment}", "data.path=x.csv" if "csv" in experiment else "seed=0")
    assert "_target_" in cfg.data
    callbacks = train.instantiate_group(cfg.callbacks)
    names = {type(c).__name__ for c in callbacks}
    want = {"Retrieval", "Throughput", "SkippedSamples"}
    assert names == ({"ZeroShotClassification"} if experiment == "clip_digits" else want)


def test_logger_group_and_trainer_logger_target():
    cfg = _compose("logger=csv")
    (logger,) = train.instantiate_group(cfg.logger)
    assert type(logger).__name__ == "CSVLogger"
    cfg = _compose("+trainer.logger={_target_: lightning.pytorch.loggers.CSVLogger, save_dir: /tmp/x}")
    assert type(train.trainer_arguments(cfg)["logger"]).__name__ == "CSVLogger"


def test_max_epochs_follows_max_steps():
    from lightning_distmm.data.demo.shapes import ShapesDataModule

    dm = ShapesDataModule(batch_size=8, train_size=80)  # 10 batches an epoch
    kwargs = {"max_steps": 25, "max_epochs": None}
    train.settle_max_epochs(kwargs, dm)
    assert kwargs["max_epochs"] == 3
    kwargs = {"max_steps": 25, "max_epochs": None, "accumulate_grad_batches": 2}
    train.settle_max_epochs(kwargs, dm)
    assert kwargs["max_epochs"] == 5


def test_make_csv_writes_open_clip_format(tmp_path):
    import make_csv

    from lightning_distmm.data import CsvPairs

    train_csv, val_csv = make_csv.main(["--out", str(tmp_path), "--train", "6", "--val", "3"])
    pairs = CsvPairs(train_csv)
    assert len(pairs) == 6 and len(CsvPairs(val_csv)) == 3
    assert pairs[0]["image"].shape == (3, 32, 32) and " " in pairs[0]["caption"]


def test_retrieval_line_shows_the_callbacks_recall_next_to_chance():
    logged = {"val/retrieval/n": 256.0, "val/retrieval/image_to_text_R@1": 0.7, "val/retrieval/text_to_image_R@1": 0.75}
    logged["val/retrieval/image_to_text_R@5"] = 0.9
    line = train.retrieval_line(logged, "val/retrieval/")
    assert (
        line
        == "retrieval (callback, 256 held-out pairs): image->text R@1 = 0.700, text->image R@1 = 0.750 (chance 0.004)"
    )


def test_a_tokenizer_larger_than_the_text_towers_vocabulary_is_refused_for_any_datamodule():
    """Token ids past the text tower's embedding table failed only as ``IndexError: index out of range
    in self`` at the first batch; the recipe checks every DataModule's tokenizer against the towers."""
    from lightning_distmm.data import CaptionTokenizer
    from lightning_distmm.data.demo.tokenizer import build_tokenizer

    cfg = _compose("experiment=clip_csv", "data.path=x.csv")
    big = type("DataModule", (), {"text": CaptionTokenizer(build_tokenizer([f"w{i}" for i in range(100)]))})()
    with pytest.raises(SystemExit, match=r"model.towers.text.vocab_size=64 < the caption tokenizer's 104 tokens"):
        train.check_text_vocab(cfg, big)
    small = type("DataModule", (), {"text": CaptionTokenizer(build_tokenizer(["a", "b"]))})()
    train.check_text_vocab(cfg, small)


def test_user_data_experiments_normalise_as_clip_and_the_demo_ones_as_the_renders():
    """Your own photos get CLIP's mean and std (they got the shapes renders' 0.15 / 0.16 before)."""
    for experiment, data in (("clip_csv", "data.path=x.csv"), ("clip_wds", "data.train=x")):
        cfg = _compose(f"experiment={experiment}", data)
        assert list(cfg.data.mean) == pytest.approx([0.48145466, 0.4578275, 0.40821073])
        assert cfg.data.interpolation == "bicubic"
    for experiment, data in (("clip_shapes_csv", "data.path=x.csv"), ("clip_shapes_wds", "data.train=x")):
        assert list(_compose(f"experiment={experiment}", data).data.std) == pytest.approx([0.16] * 3)
