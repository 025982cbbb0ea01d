"""``load_from_checkpoint`` for distmm's checkpoint folders.

A distmm checkpoint is a torch.distributed.checkpoint *folder* (shards + ``meta.pt``), named like
Lightning's files (``epoch=0-step=2.ckpt``), so ``LightningModule.load_from_checkpoint(folder)``
fails with ``IsADirectoryError``. :func:`load_checkpoint` reads such a folder in one process: the
hyperparameters from ``meta.pt`` (what ``save_hyperparameters`` recorded), the weights converted
with ``dcp_to_torch_save`` (what :func:`lightning_distmm.export_checkpoint` does), and builds the
module as Lightning would; a file is handed to Lightning's own ``load_from_checkpoint``.

Only torch and Lightning are imported, so this can live next to ``export_checkpoint``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, TypeVar

import torch

M = TypeVar("M")

#: the metadata file of a distmm (Lightning ``ModelParallelStrategy``) checkpoint folder
METADATA = "meta.pt"


def is_checkpoint_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / METADATA).is_file()


def read_checkpoint_folder(path: str | Path) -> dict[str, Any]:
    """The whole checkpoint of a folder as one dict (``state_dict``, ``hyper_parameters``, loops, ...)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    if not is_checkpoint_folder(path):
        raise FileNotFoundError(f"{path} is not a distmm checkpoint folder (a directory with {METADATA} and shards)")
    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp) / "full.pt"
        dcp_to_torch_save(path, flat)
        shards = torch.load(flat, weights_only=False)
    meta = torch.load(path / METADATA, weights_only=False)
    return {**meta, **shards}


def load_checkpoint(
    cls: type[M],
    checkpoint_path: str | Path,
    map_location: Any = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> M:
    """``cls.load_from_checkpoint`` that also reads distmm checkpoint folders.

    Args:
        cls: the ``LightningModule`` class (its ``__init__`` takes the saved hyperparameters).
        checkpoint_path: a checkpoint folder, or a file (passed to Lightning).
        map_location: where to put the tensors (default: the CPU).
        strict: whether every key must match (default True).
        kwargs: arguments overriding the saved hyperparameters, as in Lightning.
    """
    if not is_checkpoint_folder(checkpoint_path):
        if Path(checkpoint_path).is_dir():
            raise IsADirectoryError(
                f"{checkpoint_path} is a folder without {METADATA}: not a distmm checkpoint folder; pass the"
                f" folder ModelCheckpoint wrote (epoch=...-step=....ckpt, a directory with {METADATA})"
            )
        return cls.load_from_checkpoint(checkpoint_path, map_location=map_location, strict=strict, **kwargs)  # type: ignore[attr-defined]
    checkpoint = read_checkpoint_folder(checkpoint_path)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams.update(kwargs)
    module = cls(**hparams)
    state = checkpoint["state_dict"]
    if map_location is not None:
        state = {k: v.to(map_location) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    module.load_state_dict(state, strict=True if strict is None else strict)  # type: ignore[attr-defined]
    hook = getattr(module, "on_load_checkpoint", None)
    if callable(hook):
        hook(checkpoint)
    return module


__all__ = ["load_checkpoint", "read_checkpoint_folder", "is_checkpoint_folder"]
