"""Pair datasets (open_clip CSV/TSV, image folders): each decodes only the fields asked for, and
under distmm a rank decodes only its rows and its towers' fields and trains like one process."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from distmm_testing import SEQ, VOCAB, TinyCLIP, in_subprocess, max_param_diff, read_losses, run_distmm, run_reference
from PIL import Image
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.data import CaptionTokenizer, CsvPairs, ImageFolderPairs, image_transform
from lightning_distmm.data.demo.tokenizer import build_tokenizer

WORDS = ["red", "green", "blue", "circle", "square", "cross", "big", "small", "a"]
assert len(WORDS) + 4 <= VOCAB  # the tiny text tower's vocabulary


def _caption(i: int) -> str:
    return f"a {['big', 'small'][i % 2]} {WORDS[i % 3]} {WORDS[3 + i % 3]}"  # 4 words + BOS/EOS = SEQ


def _write_images(folder: Path, n: int, size: int = 8, sidecar: bool = True) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = []
    for i in range(n):
        name = f"img_{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / name)
        if sidecar:
            (folder / name).with_suffix(".txt").write_text(_caption(i) + "\n")
        names.append(name)
    return names


def _write_csv(tmp: Path, n: int, sep: str = "\t", img_key: str = "filepath", caption_key: str = "title") -> Path:
    names = _write_images(tmp / "images", n, sidecar=False)
    path = tmp / ("pairs.csv" if sep == "," else "pairs.tsv")
    lines = [f"{img_key}{sep}{caption_key}"] + [f"images/{name}{sep}{_caption(i)}" for i, name in enumerate(names)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _tiny_kwargs(log: Path | None = None) -> dict:
    return dict(
        transform=image_transform(input_size=(3, 8, 8), crop_pct=1.0, interpolation="bilinear"),
        tokenizer=CaptionTokenizer(build_tokenizer(WORDS), context_length=SEQ),
        decode_log=log,
    )


# ---------------------------------------------------------------------- one process
@pytest.mark.parametrize("sep", ["\t", ","])
def test_csv_pairs_reads_open_clip_format(tmp_path, sep):
    ds = CsvPairs(_write_csv(tmp_path, 5, sep=sep), **_tiny_kwargs())
    assert len(ds) == 5
    sample = ds[2]
    assert set(sample) == {"image", "caption", "input_ids", "attention_mask"}
    assert sample["image"].shape == (3, 8, 8) and sample["caption"] == _caption(2)
    assert sample["input_ids"].shape == (SEQ,) and int(sample["input_ids"].max()) < VOCAB
    assert sample["attention_mask"].tolist() == [1] * SEQ


def test_csv_pairs_custom_columns_and_clear_errors(tmp_path):
    path = _write_csv(tmp_path, 3, img_key="path", caption_key="caption")
    assert CsvPairs(path, img_key="path", caption_key="caption", **_tiny_kwargs())[0]["caption"] == _caption(0)
    with pytest.raises(KeyError, match=r"no column\(s\) \['filepath', 'title'\].*img_key="):
        CsvPairs(path)
    with pytest.raises(FileNotFoundError, match="no file"):
        CsvPairs(tmp_path / "nope.tsv")


def test_image_folder_pairs_sidecar_and_captions_file(tmp_path):
    _write_images(tmp_path / "side", 4)
    ds = ImageFolderPairs(tmp_path / "side", **_tiny_kwargs())
    assert len(ds) == 4 and ds.load(3, ["caption"]) == {"caption": _caption(3)}

    names = _write_images(tmp_path / "plain", 3, sidecar=False)
    with pytest.raises(FileNotFoundError, match="no sidecar caption"):
        ImageFolderPairs(tmp_path / "plain")
    table = tmp_path / "captions.json"
    table.write_text(json.dumps({n: f"caption {i}" for i, n in enumerate(names)}))
    assert ImageFolderPairs(tmp_path / "plain", captions=table)[1]["caption"] == "caption 1"
    tsv = tmp_path / "captions.tsv"
    tsv.write_text("".join(f"{n}\tline {i}\n" for i, n in enumerate(names[:2])))
    with pytest.raises(KeyError, match="no caption for 1 image"):
        ImageFolderPairs(tmp_path / "plain", captions=tsv)


def test_load_decodes_only_the_fields_asked_for(tmp_path, monkeypatch):
    log = tmp_path / "decode.log"
    ds = CsvPairs(_write_csv(tmp_path, 4), **_tiny_kwargs(log))
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    tokenized = []
    real_call = CaptionTokenizer.__call__
    monkeypatch.setattr(CaptionTokenizer, "__call__", lambda self, t: tokenized.append(t) or real_call(self, t))

    text = ds.load(1, ["input_ids", "attention_mask"])
    assert set(text) == {"input_ids", "attention_mask"} and opened == [] and tokenized == [_caption(1)]
    image = ds.load(2, ["image"])
    assert set(image) == {"image"} and len(opened) == 1 and len(tokenized) == 1
    ds.load(0, ["caption"])
    assert len(opened) == 1 and len(tokenized) == 1  # a caption alone is neither decoded nor tokenized
    assert ds.decoded == {"input_ids": 1, "attention_mask": 1, "image": 1, "caption": 1}
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        [0, 1, ["attention_mask", "input_ids"]],
        [0, 2, ["image"]],
        [0, 0, ["caption"]],
    ]
    # a field does not depend on the others loaded with it
    assert torch.equal(ds[2]["image"], image["image"]) and torch.equal(ds[1]["input_ids"], text["input_ids"])
    with pytest.raises(KeyError, match="no field"):
        ds.load(0, ["pixels"])


def test_transform_follows_the_model_pretrained_cfg():
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=4)
    out = image_transform(model=model)(Image.new("RGB", (40, 30)))
    assert out.shape == (3, 16, 16)


def test_local_tokenizer_directory(tmp_path):
    """A Hugging Face tokenizer saved to a folder loads from it (local files only)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(WORDS), pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]"
    )
    fast.save_pretrained(tmp_path / "tok")
    tok = CaptionTokenizer(tmp_path / "tok", context_length=8)
    enc = tok("a red circle")
    assert enc["input_ids"].tolist() == tok.batch(["a red circle"])["input_ids"][0].tolist()
    assert enc["attention_mask"].tolist() == [1] * 5 + [0] * 3 and int(enc["input_ids"][4]) == 3  # [EOS]
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        CaptionTokenizer(tmp_path / "missing")


# ---------------------------------------------------------------------- under distmm
def _records(log: Path) -> dict[int, list[tuple[int, tuple[str, ...]]]]:
    by_rank: dict[int, list] = {}
    for line in log.read_text().splitlines():
        rank, index, fields = json.loads(line)
        by_rank.setdefault(rank, []).append((index, tuple(fields)))
    return by_rank


def _compare(make_dataset, plan: ldm.Plan, world: int, tmp_path: Path, optimizer: str = "sgd", steps: int = 3) -> None:
    """Train TinyCLIP 3 steps on ``make_dataset(None)`` in one process and on ``make_dataset(log)``
    under ``plan``: the same weights and losses.

    SGD (momentum 0.9): AdamW normalises each element by its own gradient's size, so an element
    whose true gradient is near zero (here a few of ``mlp.fc2.weight`` on noise images) turns the
    float rounding of a different summation order into visible steps (2.5e-5 after 3 steps).
    """
    batch = 8
    L.seed_everything(0)
    reference = TinyCLIP(optimizer, lr=0.05 if optimizer == "sgd" else 0.01)
    module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
    data = DataLoader(make_dataset(None), batch_size=batch, drop_last=True)
    run_reference(reference, data, steps, str(tmp_path / "ref.json"))
    log = tmp_path / "decode.log"
    data = DataLoader(make_dataset(log), batch_size=batch, drop_last=True)
    run_distmm(module, plan, world, data, steps, str(tmp_path / "dist.json"))
    assert max_param_diff(reference, module) <= 1e-5
    assert max_param_diff(reference, initial) > 1e-3
    assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)


@pytest.mark.slow
def test_csv_pairs_under_distmm_equal_one_process_and_decode_per_rank(tmp_path):
    """Image on ranks 0, 1 (4 rows each of a batch of 8), text on rank 2: each rank decoded only
    its rows and its tower's fields, and the weights equal one process's after 3 steps."""
    csv_path = _write_csv(tmp_path, 24)
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})
    in_subprocess(lambda: _compare(lambda log: CsvPairs(csv_path, **_tiny_kwargs(log)), plan, 3, tmp_path, "sgd"))
    records = _records(tmp_path / "decode.log")
    image, text = ("image",), ("attention_mask", "input_ids")
    assert {f for r in records.values() for _, f in r} == {image, text}
    assert all(f == image for _, f in records[0] + records[1]) and all(f == text for _, f in records[2])
    # 3 steps of 8 rows (Lightning may prefetch one batch more): rank 0 rows 0-3, rank 1 rows 4-7 of each batch
    steps = {i // 8 for i, _ in records[2]}
    assert steps >= {0, 1, 2}
    for step in steps:
        assert sorted(i for i, _ in records[0] if i // 8 == step) == list(range(8 * step, 8 * step + 4))
        assert sorted(i for i, _ in records[1] if i // 8 == step) == list(range(8 * step + 4, 8 * step + 8))
        assert sorted(i for i, _ in records[2] if i // 8 == step) == list(range(8 * step, 8 * step + 8))


@pytest.mark.slow
def test_image_folder_pairs_under_distmm_equal_one_process(tmp_path):
    _write_images(tmp_path / "images", 24)
    plan = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})
    in_subprocess(
        lambda: _compare(
            lambda log: ImageFolderPairs(tmp_path / "images", **_tiny_kwargs(log)), plan, 2, tmp_path, "sgd"
        )
    )
    records = _records(tmp_path / "decode.log")
    assert {f for _, f in records[0]} == {("image",)}
    assert {f for _, f in records[1]} == {("attention_mask", "input_ids")}
    assert [i for i, _ in records[0]] == [i for i, _ in records[1]]  # the same rows, in the same order


# ---------------------------------------------------------------------- tokenizers that cannot read the data
def _digit_csv(tmp: Path, n: int = 12) -> Path:
    names = _write_images(tmp / "images", n, sidecar=False)
    path = tmp / "digits.tsv"
    rows = [f"images/{name}\ta photo of the digit {i % 10}" for i, name in enumerate(names)]
    path.write_text("filepath\ttitle\n" + "\n".join(rows) + "\n")
    return path


def test_captions_the_tokenizer_cannot_read_are_refused_before_training(tmp_path):
    """The embedded tokenizer knows only the shapes captions' words: ``a photo of the digit 7``
    reads as ``a [UNK] of the [UNK] [UNK]`` and every digit caption reads the same, which trained to
    exactly chance with no error. The DataModule refuses it and names the fix; a tokenizer that
    knows the words passes."""
    from lightning_distmm.data.datasets.datamodule import PairsDataModule

    path = _digit_csv(tmp_path)
    with pytest.raises(ValueError) as err:
        PairsDataModule(str(path), val_size=2, image_size=8, tokenizer=None)
    message = str(err.value)
    assert "unknown to the embedded tokenizer" in message and "digits.tsv" in message
    assert "10 different captions read as 1" in message and "data.tokenizer" in message

    words = ["a", "photo", "of", "the", "digit", *map(str, range(10))]
    tokenizer_file = tmp_path / "tokenizer.json"
    build_tokenizer(words).save(str(tokenizer_file))
    dm = PairsDataModule(str(path), val_size=2, image_size=8, tokenizer=str(tokenizer_file))
    assert dm.text.unknown_share(["a photo of the digit 7"]) == 0.0


def test_a_broken_image_names_its_csv_row_and_file(tmp_path):
    """A PNG cut mid-data failed as ``OSError: image file is truncated`` with no file name."""
    path = _write_csv(tmp_path, 4)
    broken = tmp_path / "images" / "img_002.png"
    broken.write_bytes(broken.read_bytes()[:60])
    ds = CsvPairs(path, **_tiny_kwargs())
    from lightning_distmm.data.datasets.pairs import SampleDecodeError

    with pytest.raises(SampleDecodeError, match=r"pairs\.tsv row 4 \(image 'images/img_002\.png'"):
        ds.load(2, ("image",))
    assert ds.load(2, ("input_ids",))["input_ids"].shape == (SEQ,)  # text ranks never open it


def test_csv_separator_and_empty_file_and_small_data_messages(tmp_path):
    from lightning_distmm.data.datasets.datamodule import PairsDataModule

    path = _write_csv(tmp_path, 6, sep="\t")
    assert len(CsvPairs(path, sep="\\t", **_tiny_kwargs())) == 6  # a Hydra override's backslash-t
    assert len(CsvPairs(path, sep="tab", **_tiny_kwargs())) == 6
    with pytest.raises(ValueError, match="one character"):
        CsvPairs(path, sep="::", **_tiny_kwargs())
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        CsvPairs(empty, **_tiny_kwargs())
    tok = tmp_path / "tokenizer.json"
    build_tokenizer(WORDS).save(str(tok))
    with pytest.raises(ValueError, match="val_size=0.1"):
        PairsDataModule(str(path), image_size=8, tokenizer=str(tok))  # the default 256 of 6 pairs
    dm = PairsDataModule(str(path), image_size=8, tokenizer=str(tok), val_size=0.34)
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (4, 2)


def test_pair_options_are_recorded_with_their_defaults_and_a_misspelt_one_is_named(tmp_path):
    """The pairs DataModules take their eleven shared keys through PairOptions: every key, given or
    default, is in the hyperparameters a checkpoint records, and a misspelt key is refused by name."""
    from lightning_distmm.data.datasets.datamodule import PairsDataModule

    path = _write_csv(tmp_path, 6, sep="\t")
    tok = tmp_path / "tokenizer.json"
    build_tokenizer(WORDS).save(str(tok))
    dm = PairsDataModule(str(path), image_size=8, tokenizer=str(tok), val_size=2, batch_size=4)
    assert dm.hparams["image_size"] == 8 and dm.hparams["val_size"] == 2 and dm.hparams["context_length"] == 77
    assert dm.hparams["skip_bad_samples"] is False and (dm.batch_size, dm.val_batch_size) == (4, 4)
    with pytest.raises(TypeError, match=r"PairsDataModule\(\) got unexpected keyword argument\(s\) \['image_sise'\]"):
        PairsDataModule(str(path), image_sise=8, tokenizer=str(tok), val_size=2)


def test_open_clip_tokenizer_gives_open_clips_ids_offline():
    """open_clip's tokenizer could not be passed (``'list' object has no attribute 'ids'``)."""
    open_clip = pytest.importorskip("open_clip")
    texts = ["a photo of the digit 7", "a diagram"]
    for spec in ("open_clip:ViT-B-32", open_clip.get_tokenizer("ViT-B-32")):
        tok = CaptionTokenizer(spec, context_length=16)
        rows = tok.batch(texts)
        assert torch.equal(rows["input_ids"], open_clip.tokenize(texts, context_length=16))
        assert rows["attention_mask"].sum(dim=1).tolist() == [8, 4]  # <start> + tokens + <end>
        assert tok.vocab_size == 49408 and tok.unknown_share(texts) == 0.0
