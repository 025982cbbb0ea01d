"""transformers' LLaVA (``LlavaForConditionalGeneration``) as two distmm towers, its modules unchanged.

LLaVA's vision tower and projector feed its language model at the ``<image>`` placeholder
positions; distmm runs them as a producing tower and a consuming one (docs/vlm.md, "Your own
LLaVA"):

* :class:`LlavaVision`: ``model.vision_tower`` + ``model.multi_modal_projector``, the hidden state
  of ``vision_feature_layer`` with ``vision_feature_select_strategy`` (``default`` drops the CLS
  token) as ``LlavaModel.get_image_features`` computes it; one image per row, a row without one
  gets zeros (only the rows that carry an image run the vision tower);
* :class:`LlavaLanguage`: ``model.language_model`` + ``lm_head``, the image features put at the
  ``image_token_index`` positions of the embedded text (``masked_scatter``, as
  ``LlavaModel.forward`` does), then the decoder and the head.

The modules are transformers' own objects (moved, not copied), so their names stay transformers'
below a tower's prefix: :func:`llava_state_dict` maps a trained module back to the names
``LlavaForConditionalGeneration`` loads, and :meth:`LlavaModule.to_llava` builds one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_distmm.core.layout import SAMPLES_KEY
from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.models.llava_stages import language_stages, present_images, rows_of_images, vision_stages
from lightning_distmm.models.packing import check_budget, pack, unpack
from lightning_distmm.tower import Tower

IGNORE = -100


def register_output_recorders(module: nn.Module) -> None:
    """Register ``module``'s transformers models for output recording in this process.

    transformers (5.x) fills the registry that lets a model return ``hidden_states`` in
    ``PreTrainedModel.__init__``, keyed by class: a model unpickled in a process that never built
    one of its class (a rank started with ``spawn``) returns ``hidden_states=None``. Registering on
    unpickling gives the spawned rank what a forked one inherits."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # pragma: no cover - another transformers layout: nothing to register
        return
    for m in module.modules():
        can = getattr(m, "_can_record_outputs", None)
        if can and not _CAN_RECORD_REGISTRY.get(m):
            _CAN_RECORD_REGISTRY[m] = can


class LlavaVision(nn.Module):
    """LLaVA's image features of each row's image, ``[B, tokens, text width]`` (zeros without one)."""

    def __init__(self, vision_tower: nn.Module, multi_modal_projector: nn.Module, layer: Any, strategy: str) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = multi_modal_projector
        self.layer = layer
        self.strategy = strategy

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        register_output_recorders(self)

    def features(self, images: Tensor) -> Tensor:
        """``LlavaModel.get_image_features`` on ``images`` ``[M, C, H, W]``: ``[M, tokens, width]``."""
        hidden = self.vision_tower(images, output_hidden_states=True, return_dict=True).hidden_states
        if hidden is None:
            raise RuntimeError(
                f"{type(self.vision_tower).__name__} returned no hidden_states for output_hidden_states=True: transformers"
                f" records them only for model classes registered in this process (register_output_recorders)"
            )
        layers = [self.layer] if isinstance(self.layer, int) else list(self.layer)
        picked = [hidden[i][:, 1:] if self.strategy == "default" else hidden[i] for i in layers]
        return self.multi_modal_projector(torch.cat(picked, dim=-1))

    def forward(self, pixel_values: Tensor, n_images: Tensor) -> Tensor:
        return rows_of_images(self.features(present_images(pixel_values, n_images)), n_images)

    def pipeline_stages(self, pp: int) -> list:
        """``pp`` stages of :meth:`forward` (:func:`~lightning_distmm.models.llava_stages.vision_stages`)."""
        return vision_stages(self, pp)


class LlavaLanguage(nn.Module):
    """LLaVA's language model on the embedded text with each row's image features at its
    ``<image>`` placeholders; the logits ``[B, S, vocab]``."""

    def __init__(
        self, language_model: nn.Module, lm_head: nn.Module, image_token_index: int, pack_tokens: int | None = None
    ) -> None:
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.image_token_index = int(image_token_index)
        #: pack each call's rows into sequences of this many tokens (``models.packing``); None: padded rows
        self.pack_tokens = pack_tokens

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, n_images: Tensor, image_features: Tensor
    ) -> Tensor:
        """``labels`` is not read here: a tower's inputs are the fields its ranks load, and the loss
        (:meth:`LlavaModule.token_loss`) reads them on the rows this tower computed."""
        embeds = self._embed({"input_ids": input_ids, "n_images": n_images, "image_features": image_features})
        if self.pack_tokens is None:
            hidden = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state
            return self.lm_head(hidden)
        # right-padded rows laid end to end; transformers keeps attention inside each sample from the
        # restarting positions (no attention_mask), and the head runs on the packed tokens only
        packed, positions, where = pack(embeds, attention_mask, self.pack_tokens)
        hidden = self.language_model(inputs_embeds=packed, position_ids=positions, use_cache=False).last_hidden_state
        return unpack(self.lm_head(hidden), where)

    def _embed(self, rows: Mapping[str, Tensor]) -> Tensor:
        """The embedded text with each row's image features at its placeholders."""
        input_ids, n_images = rows["input_ids"], rows["n_images"]
        embeds = self.language_model.get_input_embeddings()(input_ids)
        slots = input_ids == self.image_token_index  # [B, S]
        present = n_images > 0
        features = rows["image_features"][present].to(embeds.dtype)  # [M, tokens, width]
        per_row = slots.sum(dim=1)
        wrong = ((per_row != 0) & ~present) | (present & (per_row != features.shape[1]))
        if bool(wrong.any()):
            row = int(wrong.nonzero()[0, 0])
            raise ValueError(
                f"row {row} has {int(per_row[row])} <image> placeholder tokens (id {self.image_token_index}) and"
                f" {int(n_images[row])} image(s) of {features.shape[1]} tokens: a row with an image needs as many"
                f" placeholders as its image has tokens, a row without one none"
            )
        return embeds.masked_scatter(slots[..., None].expand_as(embeds), features.reshape(-1, features.shape[-1]))

    def pipeline_stages(self, pp: int) -> list:
        """``pp`` stages of :meth:`forward` (:func:`~lightning_distmm.models.llava_stages.language_stages`)."""
        return language_stages(self, pp)


def llava_towers(model: nn.Module) -> tuple[LlavaVision, LlavaLanguage]:
    """A ``LlavaForConditionalGeneration``'s modules as the two towers (the same module objects)."""
    inner, config = model.model, model.config  # type: ignore[union-attr]
    vision = LlavaVision(
        inner.vision_tower,
        inner.multi_modal_projector,
        config.vision_feature_layer,
        config.vision_feature_select_strategy,
    )
    language = LlavaLanguage(inner.language_model, model.lm_head, config.image_token_index)  # type: ignore[arg-type]
    return vision, language


#: a LlavaModule's parameter prefixes -> LlavaForConditionalGeneration's
HF_NAMES = {
    "vision.vision_tower.": "model.vision_tower.",
    "vision.multi_modal_projector.": "model.multi_modal_projector.",
    "language.language_model.": "model.language_model.",
    "language.lm_head.": "lm_head.",
}


def llava_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A :class:`LlavaModule`'s state dict in ``LlavaForConditionalGeneration``'s names."""
    out = {}
    for name, value in state.items():
        for ours, theirs in HF_NAMES.items():
            if name.startswith(ours):
                out[theirs + name[len(ours) :]] = value
                break
    return out


class LlavaModule(DistMMMixin, L.LightningModule):
    """A ``LlavaForConditionalGeneration`` trained under distmm: the vision tower (with the projector)
    and the language model (with the head) as two towers, the next-token loss on the targets
    (``labels``, -100 elsewhere) as transformers computes it.

    Batches: ``pixel_values`` ``[B, C, H, W]`` (any values in a row without an image), ``n_images``
    ``[B]`` (0 or 1), ``input_ids`` with ``image_token_index`` placeholders, ``attention_mask``,
    ``labels``. ``freeze_vision``: LLaVA's second stage (the projector trains, the vision encoder
    does not, so it stays one tower whose encoder has no gradients); ``freeze_language``: its first.
    ``pack_tokens``: the language model runs each microbatch's rows packed into sequences of this
    many tokens, without their padding (``models.packing``; right-padded rows, the same loss).
    """

    def __init__(
        self,
        model: nn.Module,
        freeze_vision: bool = False,
        freeze_language: bool = False,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        pack_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.config = model.config  # type: ignore[union-attr]
        self.vision, self.language = llava_towers(model)
        self.language.pack_tokens = pack_tokens
        if freeze_vision:
            self.vision.vision_tower.requires_grad_(False)
        if freeze_language:
            self.language.requires_grad_(False)
        self.freeze_language = freeze_language
        self.optimizer_name, self.lr, self.eps, self.weight_decay = optimizer, lr, eps, weight_decay

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning's hook on the batch before it moves to the device: with ``pack_tokens``, a sample
        longer than the budget stops the run naming it (on the ranks that load the text). A module
        overriding this hook calls ``super()``."""
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if self.language.pack_tokens is not None and isinstance(mask, Tensor):
            rows = self.batch_rows(batch) if self._distmm_runner is not None else None
            check_budget(mask.sum(1), self.language.pack_tokens, "its attention_mask", rows, batch.get(SAMPLES_KEY))
        return super().on_before_batch_transfer(batch, dataloader_idx)

    def towers(self) -> dict[str, Tower]:
        return {
            "vision": Tower(self.vision, input=["pixel_values", "n_images"]),
            "language": Tower(
                self.language,
                input=["input_ids", "attention_mask", "labels", "n_images"],
                consumes={"vision": "image_features"},
                frozen=self.freeze_language,
            ),
        }

    def token_loss(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """Next-token cross-entropy summed over these rows' targets, and their count."""
        labels = batch["labels"][:, 1:]
        flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE, reduction="sum"), (labels != IGNORE).sum()

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)

    @classmethod
    def from_pretrained(cls, folder: str, **kwargs: Any) -> LlavaModule:
        """A module from a ``LlavaForConditionalGeneration`` saved in a local folder (never downloads);
        ``kwargs`` as :class:`LlavaModule`'s."""
        from transformers import LlavaForConditionalGeneration

        return cls(LlavaForConditionalGeneration.from_pretrained(folder, local_files_only=True), **kwargs)

    def save_pretrained(self, folder: str) -> None:
        """This module's weights as a folder ``LlavaForConditionalGeneration.from_pretrained`` loads.
        The module must hold every tower's weights: after ``fit`` under ``distmm_spawn`` or
        ``distmm_notebook`` it does; under torchrun or SLURM, pass the consolidated state
        (``ldm.consolidated_state_dict(trainer)`` on every rank) to :func:`save_llava` on rank 0."""
        save_llava(self.state_dict(), self.config, folder)

    def to_llava(self) -> nn.Module:
        """A ``LlavaForConditionalGeneration`` holding this module's weights (on the CPU)."""
        return llava_from_state(self.state_dict(), self.config)


def llava_from_state(state: Mapping[str, Tensor], config: Any) -> nn.Module:
    """A ``LlavaForConditionalGeneration`` of ``config`` holding a :class:`LlavaModule`'s state dict
    (its own names), on the CPU."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(config)
    model.load_state_dict({k: v.detach().cpu() for k, v in llava_state_dict(state).items()}, strict=True)
    return model


def save_llava(state: Mapping[str, Tensor], config: Any, folder: str) -> None:
    """A :class:`LlavaModule`'s state dict (its own names) saved as a ``LlavaForConditionalGeneration``
    folder of ``config``."""
    llava_from_state(state, config).save_pretrained(folder)


__all__ = [
    "HF_NAMES",
    "LlavaLanguage",
    "LlavaModule",
    "LlavaVision",
    "llava_from_state",
    "llava_state_dict",
    "llava_towers",
    "save_llava",
]
