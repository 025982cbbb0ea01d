"""recipes/llava_shapes.py: conversations about the shapes, a tiny transformers LLaVA trained on
them under distmm (spawned ranks), answers to held-out images, the exported folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

from distmm_testing import run_recipe  # noqa: E402
from llava_shapes import COLOUR_Q, ShapesConversations, build_tokenizer  # noqa: E402

from lightning_distmm.data.demo.shapes import describe  # noqa: E402


def test_conversations_ask_about_the_image_and_target_the_answers():
    tok = build_tokenizer()
    data = ShapesConversations("train", 4, tok)
    sample = data[1]  # two exchanges
    colour, shape, _ = describe(int(data.shapes.attributes(1)["label"]))
    targets = tok.decode([t for t, y in zip(sample["input_ids"], sample["labels"]) if y != -100])
    assert targets.split() == ["it", "is", colour, "<|end|>", "a", shape, "<|end|>"]
    assert sample["n_images"] == 1 and sample["pixel_values"].shape == (3, 32, 32)
    assert COLOUR_Q in tok.decode(sample["input_ids"])


@pytest.mark.slow
def test_the_recipe_trains_answers_and_exports(tmp_path):
    out = tmp_path / "llava"
    said = run_recipe(
        "llava_shapes.py", "--steps", "10", "--batch", "8", "--held-out", "4", "--export", str(out)
    ).stdout
    assert "colour right:" in said and "(chance 12.5%)" in said, said[-2000:]
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(out), local_files_only=True)
    assert model.config.image_seq_length == 16


@pytest.mark.slow
def test_train_recipe_llava_experiment_inits_trains_and_exports(tmp_path):
    """``recipes/train.py experiment=llava_shapes`` with ``export.hf=``, then again with
    ``init=hf_llava:`` from that folder: the second run starts from the first one's weights."""

    def train(*extra: str) -> str:
        run = run_recipe("train.py", "experiment=llava_shapes", "data.held_out=4", *extra)
        return run.stdout + run.stderr

    first = train("trainer.max_steps=5", f"export.hf={tmp_path / 'first'}", f"hydra.run.dir={tmp_path / 'a'}")
    assert "exported hf:" in first and "colour right:" in first, first[-2000:]
    second = train("trainer.max_steps=2", f"init=hf_llava:{tmp_path / 'first'}", f"hydra.run.dir={tmp_path / 'b'}")
    assert f"from {tmp_path / 'first'}" in second, second[-2000:]


@pytest.mark.slow
def test_your_own_conversations_train_from_your_model(tmp_path):
    """``data=llava_json``: a LLaVA JSON, its image folder and a tokenizer folder, starting from a
    saved model (``init=hf_llava:``), exported after 3 distmm steps."""
    import json

    from test_conversations import records, tokenizer
    from test_llava import IMAGE_TOKENS, tiny_llava

    (tmp_path / "images").mkdir()
    (tmp_path / "train.json").write_text(json.dumps(records(tmp_path / "images")))
    tok = tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    tiny_llava(vocab=len(tok), image_token=tok.convert_tokens_to_ids("<image>")).save_pretrained(tmp_path / "mine")
    run = run_recipe(
        "train.py",
        "experiment=llava_shapes",
        "data=llava_json",
        f"data.records={tmp_path / 'train.json'}",
        f"data.image_folder={tmp_path / 'images'}",
        f"data.tokenizer={tmp_path / 'tok'}",
        f"data.image_tokens={IMAGE_TOKENS}",
        "data.image_size=8",
        "data.max_length=24",
        "data.batch_size=6",
        "trainer.max_steps=3",
        f"init=hf_llava:{tmp_path / 'mine'}",
        f"export.hf={tmp_path / 'out'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert (tmp_path / "out" / "config.json").is_file(), run.stdout[-2000:]
