"""The batch contract of the VLM (:mod:`lightning_distmm.models.vlm`): how many images
each sample carries and where they are, checked on the CPU before the batch moves to a device.

Samples carry 0 to ``max_images`` images: ``pixel_values`` is ``[B, K, C, H, W]`` with ``K =
max_images`` and ``n_images`` ``[B]`` says how many slots, from the first, hold real images; the
other slots are all zeros. A sample that breaks this would train silently on its padding, so the
error names the sample's row and the field to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.core.layout import row_name

#: values of each image slot read first; only a slot whose probe is all zeros is read whole
_PROBE = 64


def check_images(
    n_images: Any,
    pixel_values: Any,
    max_images: int,
    rows: Sequence[int] | None = None,
    samples: Sequence[int] | None = None,
) -> None:
    """Refuse a batch whose image counts do not match the images its samples carry, naming the sample.

    Each sample's ``n_images`` images fill its ``pixel_values`` slots ``0 .. n_images - 1``; the other
    slots, up to ``max_images``, are absent and all zeros. Either field may be missing (a distmm rank
    loads only the fields of its towers). ``rows``: the row of the DataLoader's batch of each row here
    (a distmm rank holds some of them; default: every row, in order); ``samples``: the dataset index
    of each row, where the distmm loader gives it (the message then names the sample).

    The values are read only from tensors on the CPU (the DataLoader's batch before it moves), so the
    check never waits for a device: one pass over ``_PROBE`` values of each present slot, and a whole
    read of a slot only where those are all zeros. Tensors already on an accelerator get the shape
    check alone.

    Raises:
        ValueError: ``n_images`` below 0 or above ``max_images``; ``pixel_values`` with other than
            ``max_images`` slots per sample; a counted slot that is all zeros.
    """
    counts = None
    if n_images is not None:
        counts = (n_images if isinstance(n_images, Tensor) else torch.as_tensor(n_images)).reshape(-1)
        if counts.device.type != "cpu" or not counts.numel():
            counts = None
    if counts is not None:
        bad = ((counts < 0) | (counts > max_images)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            v = int(counts[i])
            where = f"{row_name(i, rows, samples)} has n_images={v}"
            if v < 0:
                raise ValueError(
                    f"{where}: n_images is how many images the sample carries in its pixel_values slots 0 to"
                    f" n_images-1, from 0 to the model's max_images={max_images}; set it to the number of images"
                    f" the sample carries"
                )
            raise ValueError(
                f"{where}, more than the model's max_images={max_images} (the pixel_values image slots of a"
                f" sample): give the sample at most {max_images}"
                f" image{'' if max_images == 1 else 's'}, or build the model with max_images={v}"
                f" and pad every sample's pixel_values to {v} slots"
            )
    if not isinstance(pixel_values, Tensor):
        return
    shape = list(pixel_values.shape)
    if pixel_values.dim() != 5:
        raise ValueError(
            f"pixel_values has shape {shape}, not [batch, max_images, channels, height, width]: give each sample"
            f" its images stacked in max_images={max_images} slots (those past its n_images all zeros), a"
            f" [{max_images}, channels, height, width] tensor, even for one image"
        )
    if shape[1] != max_images:
        raise ValueError(
            f"pixel_values has {shape[1]} image slots per sample (shape {shape}) but the model was built with"
            f" max_images={max_images}: give every sample's pixel_values {max_images} slots (those past its"
            f" n_images all zeros), or build the model with max_images={shape[1]}"
        )
    if counts is None or pixel_values.device.type != "cpu":
        return
    b, k = pixel_values.shape[:2]
    present = torch.arange(k)[None, :] < counts[:, None]  # [B, K]
    if not bool(present.any()):
        return
    flat = pixel_values.reshape(b, k, -1)
    step = max(1, flat.shape[-1] // _PROBE)
    suspects = (present & ~flat[..., ::step].any(-1)).nonzero().tolist()
    for i, s in suspects:
        if bool(flat[i, s].any()):
            continue
        v = int(counts[i])
        empty = [j for j in range(v) if not bool(flat[i, j].any())]
        carried = v - len(empty)
        which = f"slot {empty[0]} is" if len(empty) == 1 else f"slots {empty} are"
        raise ValueError(
            f"{row_name(i, rows, samples)} has n_images={v}, but its pixel_values {which} all"
            f" zeros (the padding of an absent image): the sample carries {carried}"
            f" image{'' if carried == 1 else 's'}, not {v}. A sample's n_images images fill its pixel_values"
            f" slots 0 to n_images-1; set n_images to the images the sample carries, in its first slots"
        )
