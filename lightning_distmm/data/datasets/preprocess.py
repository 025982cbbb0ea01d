"""Image transforms and caption tokenizers for the pair datasets, built from local things only.

- :func:`image_transform`: timm's ``create_transform``, configured from explicit arguments or
  from a model's ``pretrained_cfg`` (``timm.data.resolve_data_config``), as timm's own scripts do.
- :class:`CaptionTokenizer`: a caption to fixed-width ``input_ids`` / ``attention_mask`` tensors,
  with a Hugging Face tokenizer read from a local directory (``AutoTokenizer.from_pretrained(path,
  local_files_only=True)``: nothing is downloaded), a ``tokenizer.json`` file, a ``tokenizers``
  ``Tokenizer`` object, or the embedded word-level tokenizer of :mod:`lightning_distmm.data.demo.tokenizer`.

Rows end in the tokenizer's end token and are padded on the right, so the last attended token is
the end token: the recipe's text towers pool there (open_clip's ``pool_type='eos'``, Hugging
Face ``CLIPTextModel`` with its ``eos_token_id``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: CLIP's image normalisation (OpenAI), the default of open_clip models
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def image_transform(
    input_size: int | tuple[int, int] | tuple[int, int, int] | None = None,
    model: torch.nn.Module | None = None,
    is_training: bool = False,
    **kwargs: Any,
) -> Callable[[Any], Tensor]:
    """A PIL image -> ``[3, H, W]`` tensor transform from ``timm.data.create_transform``.

    Args:
        input_size: the side (or ``(C, H, W)``) of the tower's input; taken from ``model`` when None.
        model: a timm model whose ``pretrained_cfg`` (mean, std, interpolation, crop_pct, input
            size) the transform follows; explicit ``kwargs`` override it.
        is_training: timm's training augmentation (random resized crop, flip, colour jitter).
            Random augmentation draws from the decoding process's RNG, so a distmm run and a
            one-process run see different augmentations of a sample; use ``False`` (the default)
            where the two must match.
        kwargs: any other ``create_transform`` argument (``mean``, ``std``, ``crop_pct``,
            ``interpolation``, ...).
    """
    from timm.data import create_transform, resolve_data_config

    cfg: dict[str, Any] = {}
    if model is not None:
        resolved = resolve_data_config({}, model=model)
        cfg.update(
            {k: resolved[k] for k in ("input_size", "interpolation", "mean", "std", "crop_pct") if k in resolved}
        )
        pretrained_size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size")
        patch_embed = getattr(model, "patch_embed", None)
        if pretrained_size is None and getattr(patch_embed, "img_size", None) is not None:
            # a ViT built from a config has no pretrained_cfg: its own image size, not timm's default 224
            cfg["input_size"] = (int(getattr(patch_embed.proj, "in_channels", 3)), *patch_embed.img_size)
    if input_size is not None:
        cfg["input_size"] = input_size
    if "input_size" not in cfg:
        raise ValueError("image_transform needs input_size or a model to read it from")
    cfg.update(kwargs)
    return create_transform(**cfg, is_training=is_training)


def pair_preprocessing(
    image_size: int,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
    interpolation: str = "bicubic",
    crop_pct: float = 1.0,
    tokenizer: Any = None,
    context_length: int = 77,
) -> tuple[Callable[[Any], Tensor], CaptionTokenizer]:
    """The eval image transform and the caption tokenizer the pair DataModules build from their
    arguments (square images of ``image_size``)."""
    transform = image_transform(
        input_size=(3, int(image_size), int(image_size)),
        mean=tuple(mean),
        std=tuple(std),
        interpolation=interpolation,
        crop_pct=crop_pct,
    )
    return transform, CaptionTokenizer(tokenizer, context_length)


class CaptionTokenizer:
    """Captions to ``{"input_ids", "attention_mask"}`` LongTensors of width ``context_length``.

    Args:
        tokenizer: ``None`` (the embedded word-level tokenizer of the shapes captions), a local
            directory holding a Hugging Face tokenizer (``AutoTokenizer.from_pretrained``, local
            files only), a ``tokenizer.json`` file, ``"open_clip:<model>"`` (open_clip's tokenizer
            for that model, e.g. ``open_clip:ViT-B-32``: CLIP's BPE, bundled with open_clip), or a
            tokenizer object (``tokenizers.Tokenizer``, ``transformers``, ``open_clip.get_tokenizer``).
        context_length: the token width of every row (longer captions are cut, keeping the end token).
    """

    def __init__(self, tokenizer: Any = None, context_length: int = 77):
        self.context_length = int(context_length)
        #: whether this is the embedded word-level tokenizer of the shapes captions (``tokenizer=None``)
        self.embedded = tokenizer is None
        self.tokenizer = _resolve(tokenizer)

    @property
    def vocab_size(self) -> int:
        tok = self.tokenizer
        if hasattr(tok, "get_vocab_size"):
            return int(tok.get_vocab_size())
        if _is_open_clip(tok):
            return int(tok.vocab_size)
        return len(tok)

    def __call__(self, text: str) -> dict[str, Tensor]:
        tok = self.tokenizer
        if _is_open_clip(tok):  # ids as open_clip.tokenize gives them: <start> ... <end>, 0-padded
            ids = tok([text], context_length=self.context_length)[0].long()
            return {"input_ids": ids, "attention_mask": (ids != 0).long()}
        if _is_transformers(tok):
            enc = tok(text, padding="max_length", truncation=True, max_length=self.context_length, return_tensors="pt")
            return {"input_ids": enc["input_ids"][0].long(), "attention_mask": enc["attention_mask"][0].long()}
        from lightning_distmm.data.demo.tokenizer import encode

        return encode(text, self.context_length, tok)

    def batch(self, texts: list[str]) -> dict[str, Tensor]:
        """Several captions as ``[N, context_length]`` tensors."""
        rows = [self(t) for t in texts]
        return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask")}

    def _unknown_id(self) -> int | None:
        tok = self.tokenizer
        if _is_open_clip(tok):
            return None  # byte-level BPE: every string has tokens
        if _is_transformers(tok):
            return tok.unk_token_id
        for name in ("[UNK]", "<unk>", "<|unk|>"):
            found = tok.token_to_id(name) if hasattr(tok, "token_to_id") else None
            if found is not None:
                return int(found)
        return None

    def _pieces(self, text: str) -> list[int]:
        tok = self.tokenizer
        if _is_open_clip(tok):
            return list(tok.encode(text))
        if _is_transformers(tok):
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok.encode(text, add_special_tokens=False).ids)

    def unknown_share(self, texts: Sequence[str]) -> float:
        """The share of the tokens of ``texts`` that the tokenizer maps to its unknown token (0 for a
        tokenizer without one, such as CLIP's byte-level BPE)."""
        unk = self._unknown_id()
        if unk is None:
            return 0.0
        ids = [i for t in texts for i in self._pieces(t)]
        return sum(i == unk for i in ids) / max(1, len(ids))

    def check_captions(self, texts: Sequence[str], where: str, max_unknown: float = 0.2) -> None:
        """Refuse captions the tokenizer cannot read: a text tower trained on ``[UNK]`` learns
        nothing (the shapes-vocabulary tokenizer on captions such as ``a photo of the digit 7``,
        half unknown tokens, trained to exactly chance with no error). ``where`` names the data in
        the message. A tokenizer for the captions' language leaves well under 1% unknown; the bar is
        ``max_unknown`` of the probed tokens."""
        texts = [t for t in texts if t]
        share = self.unknown_share(texts)
        if share <= max_unknown:
            return
        distinct = len(set(texts))
        readings = len({tuple(self._pieces(t)) for t in set(texts)})
        worst = max(texts, key=lambda t: self.unknown_share([t]))
        shown = self.decode(self._pieces(worst))
        which = (
            "the embedded tokenizer (it knows only the words of the bundled shapes captions)"
            if self.embedded
            else f"the tokenizer {type(self.tokenizer).__name__}"
        )
        raise ValueError(
            f"{where}: {share:.0%} of the tokens of {len(texts)} probed captions are unknown to {which};"
            f" for example {worst!r} reads as {shown!r}, and {distinct} different captions read as {readings}."
            " A text tower trained on unknown tokens learns nothing. Pass a tokenizer that knows the captions' words: open_clip's CLIP BPE"
            " (tokenizer='open_clip:ViT-B-32', offline; in the recipe data.tokenizer=open_clip:ViT-B-32 with"
            " model.towers.text.vocab_size=49408), a local Hugging Face tokenizer folder or a tokenizer.json"
        )

    def decode(self, ids: Sequence[int]) -> str:
        tok = self.tokenizer
        if _is_open_clip(tok):
            return str(tok.decode(list(ids)))
        if _is_transformers(tok):
            return str(tok.decode(list(ids)))
        return str(tok.decode(list(ids), skip_special_tokens=False))


def _is_open_clip(tok: Any) -> bool:
    """open_clip's tokenizers (``open_clip.get_tokenizer``): called with a list of texts and a
    ``context_length``, they return the padded id rows themselves."""
    return type(tok).__module__.startswith("open_clip") and callable(tok)


def _is_transformers(tok: Any) -> bool:
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover
        return False
    return isinstance(tok, PreTrainedTokenizerBase)


def _resolve(tokenizer: Any) -> Any:
    if tokenizer is None:
        from lightning_distmm.data.demo.tokenizer import build_caption_tokenizer

        return build_caption_tokenizer()
    if isinstance(tokenizer, str) and tokenizer.startswith("open_clip:"):
        try:
            import open_clip
        except ImportError as err:  # pragma: no cover - open_clip_torch is a dev dependency
            raise ImportError(f"tokenizer={tokenizer!r} needs open_clip (pip install open_clip_torch)") from err
        # CLIP's BPE ships inside open_clip (bpe_simple_vocab_16e6.txt.gz): nothing is downloaded
        return open_clip.get_tokenizer(tokenizer.split(":", 1)[1])
    if isinstance(tokenizer, str | Path):
        path = Path(tokenizer).expanduser()
        if path.is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(path))
        if path.is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        raise FileNotFoundError(
            f"tokenizer {str(path)!r} is neither a local tokenizer directory nor a tokenizer.json file"
            " (nothing is downloaded)"
        )
    if isinstance(tokenizer, Mapping):
        raise TypeError("tokenizer must be None, a local path, or a tokenizer object, not a mapping")
    return tokenizer


__all__ = ["OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "CaptionTokenizer", "image_transform"]
