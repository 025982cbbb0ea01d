"""LLaVA-format conversations (``ConversationPairs``): the chat template, ``<image>`` expanded,
targets on the assistant's turns only, per-field loading, bad records named, and a LLaVA trained on
them under distmm exactly as in one process."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distmm_testing import read_losses, run_distmm, run_reference
from PIL import Image
from test_llava import IMAGE_TOKENS, OneProcess, tiny_llava
from torch.utils.data import DataLoader

import lightning_distmm as ldm
from lightning_distmm.data.datasets.conversations import ConversationPairs
from lightning_distmm.models.llava import LlavaModule, llava_state_dict

WORDS = "what colour is the shape a red green blue circle square it is where on left right".split()
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tokenizer(template: str | None = TEMPLATE) -> Any:
    """A word-level tokenizer built here (no download) with the roles and ``<image>`` as tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<unk>", "<image>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    vocab = {w: i for i, w in enumerate(special + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": special[2:]})
    fast.chat_template = template
    return fast


def records(folder: Path, n: int = 24) -> list[dict[str, Any]]:
    colours = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}
    out = []
    for i in range(n):
        name = list(colours)[i % 3]
        if i % 4 == 3:  # text only
            out.append(
                {"conversations": [{"from": "human", "value": "what is a circle"}, {"from": "gpt", "value": "a shape"}]}
            )
            continue
        Image.new("RGB", (8, 8), colours[name]).save(folder / f"{i}.png")
        turns = [
            {"from": "human", "value": "<image>\nwhat colour is the shape"},
            {"from": "gpt", "value": f"it is {name}"},
        ]
        if i % 2:
            turns += [{"from": "human", "value": "where"}, {"from": "gpt", "value": "on the left"}]
        out.append({"image": f"{i}.png", "conversations": turns})
    return out


def to_tensor(image: Any) -> torch.Tensor:
    from torchvision.transforms.functional import to_tensor as tt

    return tt(image.resize((8, 8)))


def dataset(tmp_path: Path, **kw: Any) -> ConversationPairs:
    path = tmp_path / "data.json"
    if not path.exists():
        path.write_text(json.dumps(records(tmp_path)))
    args: dict[str, Any] = dict(tokenizer=tokenizer(), image_tokens=IMAGE_TOKENS, transform=to_tensor, max_length=24)
    args.update(kw)
    return ConversationPairs(path, tmp_path, **args)


def test_the_assistants_turns_are_the_only_targets(tmp_path):
    data = dataset(tmp_path)
    tok = data.tokenizer
    sample = data[1]  # an image and two exchanges
    ids, labels, mask = sample["input_ids"].tolist(), sample["labels"].tolist(), sample["attention_mask"].tolist()
    assert ids.count(data.image_id) == IMAGE_TOKENS and sample["n_images"] == 1
    targets = tok.decode([t for t, y in zip(ids, labels) if y != -100])
    assert targets.split() == "it is green <|end|> on the left <|end|>".split()
    assert all(y == -100 for y, m in zip(labels, mask) if m == 0)
    text_only = data[3]
    assert text_only["n_images"] == 0 and not text_only["pixel_values"].any()
    assert data.image_id not in text_only["input_ids"].tolist()


def test_only_the_fields_asked_for_are_decoded(tmp_path):
    class NoTemplateCalls:
        """A tokenizer that fails if asked to tokenize."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            if name == "apply_chat_template":
                raise AssertionError("tokenized for a vision-only load")
            return getattr(self.inner, name)

    data = dataset(tmp_path, tokenizer=NoTemplateCalls(tokenizer()))
    assert set(data.load(0, ("pixel_values", "n_images"))) == {"pixel_values", "n_images"}
    (tmp_path / "0.png").unlink()  # a text-field load never opens the image
    full = dataset(tmp_path)
    assert set(full.load(0, ("input_ids", "labels"))) == {"input_ids", "labels"}


def test_bad_records_are_named(tmp_path):
    data = dataset(tmp_path)
    data.records[2] = {
        "image": "2.png",
        "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a"}],
    }
    with pytest.raises(ValueError, match=r"sample 2: 0 <image> placeholder\(s\) in its conversation but one image"):
        data.load(2, ("input_ids",))
    data.records[5] = {
        "image": "missing.png",
        "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "a"}],
    }
    with pytest.raises(ValueError, match=r"sample 5: image '.*missing.png' could not be read"):
        data.load(5, ("pixel_values",))
    data.records[6] = {"conversations": [{"from": "human", "value": "what"}]}
    with pytest.raises(ValueError, match=r"sample 6: no assistant turn"):
        data.load(6, ("labels",))
    with pytest.raises(ValueError, match="has no chat template"):
        dataset(tmp_path, tokenizer=tokenizer(template=None))


@pytest.mark.slow
def test_a_llava_trains_on_conversations_like_one_process(tmp_path):
    data = dataset(tmp_path)
    model = tiny_llava(vocab=len(data.tokenizer), image_token=data.image_id)
    reference = OneProcess(copy.deepcopy(model), "adamw", 0.01, None)
    module = LlavaModule(copy.deepcopy(model), optimizer="adamw", lr=0.01, eps=1e-6)

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(0))

    plan = ldm.Plan(3, {"vision": {"ranks": [0, 1]}, "language": {"ranks": [2]}})
    run_reference(reference, loader(), 3, str(tmp_path / "ref.json"))
    run_distmm(module, plan, 3, loader(), 3, str(tmp_path / "dist.json"))
    assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
    ours, theirs = llava_state_dict(module.state_dict()), reference.model.state_dict()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) <= 1e-5
