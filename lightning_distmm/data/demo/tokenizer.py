"""A tiny word-level tokenizer for the captions of :mod:`lightning_distmm.data.demo.shapes`.

It is a real :mod:`tokenizers` ``Tokenizer`` (normaliser, pre-tokenizer, WordLevel model,
``[BOS] ... [EOS]`` post-processor), built in-process from the closed caption vocabulary, so
nothing is downloaded. The vocabulary is fixed and ordered (special tokens first, then the words
sorted), so ids are the same on every machine, every process and every run; the tokenizer can be
cached to a JSON file and read back.

Ids of the special tokens::

    [PAD] = 0, [UNK] = 1, [BOS] = 2, [EOS] = 3

:func:`encode` pads on the right with ``[PAD]`` and truncates *keeping* ``[EOS]``, so the last
attended token of every row is ``[EOS]``: a text tower may pool there (``attention_mask.sum(-1) - 1``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from lightning_distmm.data.demo.captions import vocabulary

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(4)


def caption_words() -> list[str]:
    """Every word the shapes caption generator can produce, sorted."""
    return sorted(set(vocabulary()))


def build_tokenizer(words: Iterable[str]) -> Tokenizer:
    """A word-level tokenizer over ``words`` (lower-cased, split on whitespace and punctuation)."""
    words = sorted({w.lower() for w in words} - set(SPECIAL_TOKENS))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # already in the vocabulary: ids unchanged, marked special
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        pair=f"{BOS} $A {EOS} $B:1 {EOS}:1",
        special_tokens=[(BOS, BOS_ID), (EOS, EOS_ID)],
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
    return tok


@functools.cache
def _cached_caption_tokenizer() -> Tokenizer:
    return build_tokenizer(caption_words())


def build_caption_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer for shapes captions.

    Args:
        path: optional JSON cache. If it exists it is read (``Tokenizer.from_file``); otherwise the
            tokenizer is built and written there. Without a path the tokenizer is built in memory
            (and memoised in this process).
    """
    if path is None:
        return _cached_caption_tokenizer()
    path = Path(path)
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = build_tokenizer(caption_words())
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def encode(
    texts: str | Sequence[str], context_length: int, tokenizer: Tokenizer | None = None
) -> dict[str, torch.Tensor]:
    """Tokenize ``texts`` to ``{"input_ids", "attention_mask"}`` LongTensors of width ``context_length``.

    A single string gives ``[context_length]`` tensors, a list gives ``[N, context_length]``. Rows
    are ``[BOS] words... [EOS] [PAD]...``; a caption too long is cut to ``context_length`` with its
    ``[EOS]`` kept as the last token.
    """
    if context_length < 2:
        raise ValueError(f"context_length must be at least 2 (room for [BOS] and [EOS]), got {context_length}")
    tok = tokenizer if tokenizer is not None else build_caption_tokenizer()
    single = isinstance(texts, str)
    batch = [texts] if single else list(texts)
    ids = torch.full((len(batch), context_length), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), context_length), dtype=torch.long)
    for row, enc in enumerate(tok.encode_batch(batch) if len(batch) > 1 else [tok.encode(b) for b in batch]):
        seq = enc.ids
        if len(seq) > context_length:
            seq = seq[: context_length - 1] + [seq[-1]]  # keep [EOS]
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    if single:
        out = {k: v[0] for k, v in out.items()}
    return out


def decode(ids: Sequence[int] | torch.Tensor, tokenizer: Tokenizer | None = None) -> str:
    """Token ids back to the caption (special tokens and padding dropped)."""
    tok = tokenizer if tokenizer is not None else build_caption_tokenizer()
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return tok.decode(list(ids), skip_special_tokens=True)


__all__ = [
    "SPECIAL_TOKENS",
    "PAD_ID",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "build_tokenizer",
    "build_caption_tokenizer",
    "caption_words",
    "encode",
    "decode",
]
