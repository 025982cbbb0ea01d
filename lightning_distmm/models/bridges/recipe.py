"""Weights in the recipe: ``init=`` starts training from local open_clip / Hugging Face weights,
``export.open_clip=`` / ``export.hf=`` write the trained model in those formats at the end.

``recipes/train.py`` calls these; they live here so they are tested without starting a job.

- :func:`parse_init` reads ``init``: ``open_clip:<folder>`` (a folder of ``open_clip_config.json`` and
  ``open_clip_model.safetensors`` / ``open_clip_pytorch_model.bin``: what :func:`save_open_clip` writes
  and what open_clip's hub folders hold), ``open_clip:<arch>:<weights file>`` (an open_clip arch name,
  resolved offline from open_clip's bundled configs, or a model-config JSON) or ``hf:<folder>`` (a
  ``transformers.CLIPModel.save_pretrained`` folder). Nothing is downloaded.
- :func:`finetune_optim`: starting from trained weights, the optimiser's fine-tuning values
  (``optim.finetune``: a low lr and a short warmup, as open_clip users fine-tune) replace the
  from-scratch ones, except for the keys the command line sets.
- :func:`export_problems`: why this model cannot be written in a format, asked before training so a
  user does not learn it after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_distmm.models.bridges.hf import from_hf, save_hf
from lightning_distmm.models.bridges.neutral import _check_ours
from lightning_distmm.models.bridges.openclip import from_open_clip, save_open_clip
from lightning_distmm.models.clip import CLIPModel

#: the formats ``export.<format>=<folder>`` writes
EXPORT_FORMATS = ("open_clip", "hf")
#: weight files an open_clip folder may hold, in the order they are looked for
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin", "open_clip_model.pt")
_INIT_FORMS = "open_clip:<folder>, open_clip:<arch or config.json>:<weights file>, or hf:<folder>"


@dataclasses.dataclass(frozen=True)
class InitSpec:
    """Where the starting weights come from: ``kind`` (open_clip | hf), the model config (``arch``:
    an open_clip arch name or a JSON file; None for hf) and the weights (a file, or hf's folder)."""

    kind: str
    weights: Path
    arch: str | Path | None = None

    def describe(self) -> str:
        return f"{self.kind} weights {self.weights}" + (f" (arch {self.arch})" if self.arch else "")


def parse_init(spec: str) -> InitSpec:
    """``init`` as an :class:`InitSpec`, or a ``ValueError`` that names the accepted forms."""
    kind, _, rest = str(spec).partition(":")
    if kind not in EXPORT_FORMATS or not rest:
        raise ValueError(f"init={spec!r}: expected {_INIT_FORMS}")
    if kind == "hf":
        folder = Path(rest).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"init={spec!r}: {str(folder)!r} is not a local folder (nothing is downloaded)")
        return InitSpec("hf", folder)
    folder = Path(rest).expanduser()
    if folder.is_dir():
        config = folder / "open_clip_config.json"
        weights = next((folder / f for f in OPEN_CLIP_WEIGHTS if (folder / f).is_file()), None)
        if not config.is_file() or weights is None:
            raise FileNotFoundError(
                f"init={spec!r}: an open_clip folder holds open_clip_config.json and one of {list(OPEN_CLIP_WEIGHTS)};"
                f" {str(folder)!r} has {sorted(p.name for p in folder.iterdir())}"
            )
        return InitSpec("open_clip", weights, config)
    arch, sep, weights_file = rest.partition(":")
    if not sep or not weights_file:
        raise ValueError(f"init={spec!r}: {rest!r} is not a folder; expected {_INIT_FORMS}")
    weights = Path(weights_file).expanduser()
    if not weights.is_file():
        raise FileNotFoundError(f"init={spec!r}: {str(weights)!r} is not a local file (nothing is downloaded)")
    return InitSpec("open_clip", weights, Path(arch) if arch.endswith(".json") else arch)


def load_init(spec: InitSpec, optim: Mapping[str, Any] | None = None) -> CLIPModel:
    """The :class:`CLIPModel` holding ``spec``'s weights; its ``model_cfg`` replaces the recipe's model."""
    if spec.kind == "hf":
        return from_hf(spec.weights, optim)
    assert spec.arch is not None
    return from_open_clip(spec.weights, spec.arch, optim)


def finetune_optim(optim: Mapping[str, Any], overrides: Sequence[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(optim config, what changed)``: ``optim.finetune``'s values over the from-scratch ones, except
    for keys the command line sets (``optim.lr=...`` in ``overrides``, Hydra's task overrides)."""
    out = {k: v for k, v in dict(optim).items() if k != "finetune"}
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    changed = {
        k: v for k, v in dict(optim.get("finetune") or {}).items() if f"optim.{k}" not in given and out.get(k) != v
    }
    out.update(changed)
    return out, changed


def export_problems(model: CLIPModel, formats: Sequence[str]) -> list[str]:
    """Why ``model`` cannot be exported in each of ``formats`` (empty: every one can)."""
    problems = []
    for fmt in formats:
        if fmt not in EXPORT_FORMATS:
            problems.append(f"export.{fmt}: unknown format (formats: {list(EXPORT_FORMATS)})")
            continue
        try:
            _check_ours(model)
        except ValueError as e:
            problems.append(f"export.{fmt}: {e}")
            continue
        if fmt == "hf" and "logit_bias" in dict(model.named_parameters()):
            problems.append(
                f"export.hf: this model has a logit bias ({model.loss_name} loss), which Hugging Face's CLIPModel"
                " has no place for; export.open_clip keeps it"
            )
    return problems


def export(model: CLIPModel, folders: Mapping[str, str | Path | None]) -> dict[str, Path]:
    """Write ``model`` to each ``folders[format]`` that is set; returns the folders written."""
    written = {}
    for fmt, folder in folders.items():
        if not folder:
            continue
        save = save_open_clip if fmt == "open_clip" else save_hf
        written[fmt] = save(model, Path(folder))
    return written


__all__ = ["EXPORT_FORMATS", "InitSpec", "export", "export_problems", "finetune_optim", "load_init", "parse_init"]
