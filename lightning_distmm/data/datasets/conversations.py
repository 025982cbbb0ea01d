"""LLaVA-format conversations with images, as the fields :class:`~lightning_distmm.models.llava.LlavaModule`
reads (docs/vlm.md, "Your own LLaVA").

A record is LLaVA's instruction format: ``{"image": "path.jpg", "conversations": [{"from": "human",
"value": "<image>\\nWhat is ...?"}, {"from": "gpt", "value": "..."}, ...]}`` (``image`` absent for a
text-only sample; ``human`` / ``user`` and ``gpt`` / ``assistant`` both read). The conversation goes
through the tokenizer's chat template; the ``<image>`` placeholder (a special token of the tokenizer)
is expanded to the image's tokens; only the assistant's turns are targets (``labels`` -100
elsewhere): each assistant turn's tokens are those the template adds to the conversation before it
with the generation prompt, so any template whose output grows turn by turn works.

Per-field loading as the other datasets: a rank that computes only the vision tower decodes images
and never tokenizes; the language model's ranks tokenize and never decode an image.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_distmm.data.samples.fields import FieldDataset

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
IGNORE = -100


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """A JSON list or JSON lines of LLaVA records."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class ConversationPairs(FieldDataset):
    """LLaVA-format records (a JSON or JSONL file, or a list) with their images under ``image_folder``.

    Fields: ``pixel_values`` ``[3, H, W]`` (zeros without an image), ``n_images`` (0 or 1),
    ``input_ids``, ``attention_mask``, ``labels`` (padded or cut to ``max_length``).

    Args:
        records: the records, or the file holding them.
        image_folder: where the records' image paths are relative to.
        tokenizer: a transformers tokenizer with a chat template and ``image_token`` among its tokens.
        image_tokens: tokens one image becomes (the vision tower's, e.g. ``(336 // 14) ** 2`` for
            LLaVA-1.5 with the CLS dropped).
        transform: a PIL image -> ``[3, H, W]`` tensor (the vision tower's preprocessing).
        max_length: tokens per sample after expansion; longer samples are cut, shorter padded.
        image_token: the placeholder as it appears in the text and in the tokenizer.
    """

    fields = ("pixel_values", "n_images", "input_ids", "attention_mask", "labels")

    def __init__(
        self,
        records: str | os.PathLike | Sequence[dict[str, Any]],
        image_folder: str | os.PathLike,
        tokenizer: Any,
        image_tokens: int,
        transform: Callable[[Any], Tensor],
        max_length: int = 2048,
        image_token: str = "<image>",
    ) -> None:
        self.records = read_records(records) if isinstance(records, (str, os.PathLike)) else list(records)
        self.image_folder = Path(image_folder)
        self.tokenizer = tokenizer
        self.image_tokens = int(image_tokens)
        self.transform = transform
        self.max_length = int(max_length)
        self.image_token = image_token
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template: ConversationPairs renders each conversation"
                f" with tokenizer.apply_chat_template; set tokenizer.chat_template (a Jinja string) first"
            )
        self.image_id = tokenizer.convert_tokens_to_ids(image_token)
        if self.image_id is None or self.image_id == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(
                f"the tokenizer has no token {image_token!r}: add it (tokenizer.add_special_tokens("
                f"{{'additional_special_tokens': [{image_token!r}]}})) so each placeholder is one token"
            )
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def __len__(self) -> int:
        return len(self.records)

    def load(self, index: int, fields: Iterable[str]) -> dict[str, Any]:
        fields = tuple(fields)
        record = self.records[index]
        image = record.get("image")
        placeholders = sum(str(turn.get("value", "")).count(self.image_token) for turn in record["conversations"])
        if placeholders != (1 if image else 0):
            raise ValueError(
                f"sample {index}: {placeholders} {self.image_token} placeholder(s) in its conversation but"
                f" {'one image' if image else 'no image'} ({image!r}): a sample with an image needs exactly one"
                f" placeholder, a sample without none"
            )
        out: dict[str, Any] = {}
        if "n_images" in fields:
            out["n_images"] = 1 if image else 0
        if "pixel_values" in fields:
            out["pixel_values"] = self._pixels(index, image)
        if any(f in fields for f in ("input_ids", "attention_mask", "labels")):
            ids, labels = self._tokens(index, record)
            pad = self.max_length - len(ids)
            tokens = {
                "input_ids": torch.tensor(ids + [self.pad_id] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "labels": torch.tensor(labels + [IGNORE] * pad),
            }
            out.update({k: v for k, v in tokens.items() if k in fields})
        return out

    def _pixels(self, index: int, image: str | None) -> Tensor:
        from PIL import Image

        if not image:
            probe = self.transform(Image.new("RGB", (8, 8)))
            return torch.zeros_like(probe)
        path = self.image_folder / image
        try:
            with Image.open(path) as im:
                return self.transform(im.convert("RGB"))
        except (OSError, ValueError) as err:
            raise ValueError(f"sample {index}: image {str(path)!r} could not be read ({err})") from err

    def _tokens(self, index: int, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        messages: list[dict[str, str]] = []
        for turn in record["conversations"]:
            role = ROLES.get(str(turn.get("from", turn.get("role", ""))))
            if role is None:
                raise ValueError(f"sample {index}: a turn from {turn.get('from')!r}; expected one of {sorted(ROLES)}")
            messages.append({"role": role, "content": str(turn.get("value", turn.get("content", "")))})
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"sample {index}: no assistant turn, so nothing to train on (every label would be -100)")
        ids: list[int] = []
        labels: list[int] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], prompt=True)
            after = self._render(messages[: i + 1], prompt=False)
            if after[: len(before)] != before or before[: len(ids)] != ids:
                raise ValueError(
                    f"sample {index}: the chat template does not grow turn by turn (the tokens before turn {i} change"
                    f" when it is added), so the assistant's tokens cannot be told apart"
                )
            labels += [IGNORE] * (len(before) - len(ids)) + after[len(before) :]
            ids = after
        tail = self._render(messages, prompt=False)
        labels += [IGNORE] * (len(tail) - len(ids))
        ids = tail
        ids, labels = self._expand(ids, labels)
        if len(ids) > self.max_length:
            if self.image_id in ids[self.max_length :] and self.image_id in ids[: self.max_length]:
                raise ValueError(
                    f"sample {index}: max_length={self.max_length} cuts its image's {self.image_tokens} tokens apart"
                )
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        return ids, labels

    def _render(self, messages: list[dict[str, str]], prompt: bool) -> list[int]:
        if not messages:
            return []
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def _expand(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """Each placeholder token becomes ``image_tokens`` of them (never a target)."""
        out_ids: list[int] = []
        out_labels: list[int] = []
        for t, y in zip(ids, labels):
            if t == self.image_id:
                out_ids += [t] * self.image_tokens
                out_labels += [IGNORE] * self.image_tokens
            else:
                out_ids.append(t)
                out_labels.append(y)
        return out_ids, out_labels


class ConversationsData(L.LightningDataModule):
    """Your LLaVA-format JSON (or JSONL) and image folder as a DataModule (``conf/data/llava_json.yaml``).

    Args:
        records: the JSON / JSONL file.
        image_folder: where its image paths are relative to.
        tokenizer: a local tokenizer folder (``AutoTokenizer``, never downloads) or a tokenizer; it
            needs a chat template and ``<image>`` as a token.
        image_tokens: tokens one image becomes (the model's ``image_seq_length``).
        image_size: the side the images are resized to; ``mean`` / ``std``: their normalisation
            (CLIP's by default).
        batch_size: the global batch; ``max_length``: tokens per sample.
    """

    def __init__(
        self,
        records: str,
        image_folder: str,
        tokenizer: Any,
        image_tokens: int,
        image_size: int = 336,
        batch_size: int = 32,
        max_length: int = 2048,
        mean: Sequence[float] = (0.48145466, 0.4578275, 0.40821073),
        std: Sequence[float] = (0.26862954, 0.26130258, 0.27577711),
    ) -> None:
        super().__init__()
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        transform = _ClipTransform(int(image_size), tuple(mean), tuple(std))
        self.train = ConversationPairs(records, image_folder, tokenizer, image_tokens, transform, max_length)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)


class _ClipTransform:
    """Resize to a square side, to a tensor, normalise (picklable, for spawned ranks and workers)."""

    def __init__(self, size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.size, self.mean, self.std = size, mean, std

    def __call__(self, image: Any) -> Tensor:
        from torchvision.transforms.functional import normalize, resize, to_tensor

        return normalize(to_tensor(resize(image, [self.size, self.size])), list(self.mean), list(self.std))


__all__ = ["ConversationPairs", "ConversationsData", "read_records"]
