"""Contrastive and captioning losses, exact in one process and row-local under distmm.

Each loss is written once as a sum of per-row terms over the rows that :func:`local_rows` hands
this process, divided by the whole-batch normaliser. In one process every row is local and the
result is the ordinary mean loss; under distmm each rank computes its share of the rows against
the features of the whole batch and the shares add up to the same number (open_clip's
``ClipLoss(local_loss=True, gather_with_grad=True)``, without its world-size scaling of
gradients: the runtime sums rank contributions, it does not average them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_distmm.interaction import local_rows


def _check_pair(loss: str, image: Tensor, text: Tensor) -> None:
    """The two towers' features must pair up row by row in one space: the same number of rows, the
    same width, the same dtype (a mismatch failed deep in a matmul, naming neither tower)."""
    if image.shape[0] != text.shape[0]:
        raise ValueError(f"{loss} needs as many image as text rows, got {image.shape[0]} and {text.shape[0]}")
    if image.shape[-1] != text.shape[-1]:
        raise ValueError(
            f"{loss}: the image features are {image.shape[-1]} wide and the text features {text.shape[-1]}; a"
            " contrastive loss compares them in one space: project both towers to the same embedding width"
        )
    if image.dtype != text.dtype:
        raise TypeError(
            f"{loss}: the image features are {image.dtype} and the text features {text.dtype}; return both"
            " towers' features in one dtype (for example .float() at the end of the tower that differs)"
        )


def clip_loss(image: Tensor, text: Tensor, logit_scale: Tensor, normalize: bool = True) -> Tensor:
    """Symmetric InfoNCE (CLIP): mean of image->text and text->image cross-entropy over the batch.

    Args:
        image, text: ``[B, D]`` features of the whole batch; row ``i`` of each is a matching pair.
        logit_scale: the log of the temperature's inverse (CLIP learns it; ``exp`` is applied here).
        normalize: L2-normalise the features first.
    """
    _check_pair("clip_loss", image, text)
    if normalize:
        image, text = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
    n = image.shape[0]
    rows = local_rows(n)
    scale = logit_scale.exp()
    targets = torch.arange(rows.start, rows.stop, device=image.device)
    logits_image = scale * image[rows] @ text.T
    logits_text = scale * text[rows] @ image.T
    total = F.cross_entropy(logits_image, targets, reduction="sum") + F.cross_entropy(
        logits_text, targets, reduction="sum"
    )
    return total / (2 * n)


def siglip_loss(image: Tensor, text: Tensor, logit_scale: Tensor, logit_bias: Tensor, normalize: bool = True) -> Tensor:
    """Sigmoid loss (SigLIP): every pair is a binary match / no-match, summed over pairs, divided by ``B``."""
    _check_pair("siglip_loss", image, text)
    if normalize:
        image, text = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
    n = image.shape[0]
    rows = local_rows(n)
    logits = logit_scale.exp() * image[rows] @ text.T + logit_bias
    labels = -torch.ones_like(logits)
    labels[torch.arange(logits.shape[0]), torch.arange(rows.start, rows.stop)] = 1.0
    return -F.logsigmoid(labels * logits).sum() / n


def caption_loss(logits: Tensor, labels: Tensor, pad_id: int = 0) -> Tensor:
    """Next-token cross-entropy (CoCa's captioning loss): the mean over the whole batch's non-pad labels.

    Args:
        logits: ``[r, T, V]`` of this process's rows only, ``local_rows(B)`` (the decoder that gives
            them is the expensive part, so the caller runs it on those rows alone).
        labels: ``[B, T]`` token ids of the whole batch; ``pad_id`` positions are ignored.

    Each row's term is the sum over its tokens, divided by the number of non-pad labels in the whole
    batch, so the rows' shares add up to open_clip's ``CoCaLoss`` caption term on the whole batch
    (``CrossEntropyLoss(ignore_index=pad_id)``).
    """
    n = labels.shape[0]
    rows = local_rows(n)
    mine = labels[rows]
    if logits.shape[:2] != mine.shape:
        raise ValueError(
            f"caption_loss needs the logits of rows {rows.start}:{rows.stop} of the batch ({list(mine.shape)} labels),"
            f" got logits of shape {list(logits.shape)}: decode the rows local_rows(B) gives"
        )
    count = (labels != pad_id).sum().clamp(min=1)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), mine.reshape(-1), ignore_index=pad_id, reduction="sum"
    )
    return total / count


__all__ = ["caption_loss", "clip_loss", "siglip_loss"]
