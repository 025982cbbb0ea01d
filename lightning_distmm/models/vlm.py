"""A vision encoder feeding a language model (LLaVA-style): timm ViT + MLP projector + a transformers
causal LM, as two towers where the LLM consumes the vision tower's image tokens (docs/vlm.md).

Samples carry 0 to ``max_images`` images: ``pixel_values`` is ``[B, K, C, H, W]`` with ``K =
max_images`` (absent images' slots are ignored) and ``n_images`` ``[B]`` says how many are real. The
vision tower returns one row per sample, ``[B, K, T, D]`` (``T`` tokens per image, absent slots
zero). The language model reads the present images' tokens as a prefix of the text (absent slots
masked, positions counted over present tokens only) and returns the text positions' logits; the
loss is next-token cross-entropy over the target tokens (``labels`` not ``-100``), a token mean
over the whole batch (:meth:`VLM.token_loss`).

A batch is checked against that contract before it moves to the device
(:func:`~lightning_distmm.models.vlm_batch.check_images`, from
:meth:`VLM.on_before_batch_transfer`): a sample whose ``n_images`` is negative, above ``max_images``,
or counts a slot that is all zeros (an absent image's padding) stops the run with its row and fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from lightning_distmm.core.layout import SAMPLES_KEY
from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.models import tiny
from lightning_distmm.models.packing import check_budget, pack, unpack
from lightning_distmm.models.vlm_batch import check_images
from lightning_distmm.tower import Tower

IGNORE = -100


def present_images(pixel_values: Tensor, present: Tensor) -> Tensor:
    """The present images of a batch, ``[M, C, H, W]``; one blank image when none is present.

    A microbatch of rows without images still runs the ViT once, on a blank image whose tokens land
    in no row (``index_put`` with an empty mask) and reach the loss multiplied by zero: every layout
    then takes the same path (a tensor-parallel ViT's DTensor layers refuse an empty batch, and a
    sharded one's replicas must all run its collectives), and the gradients are exactly those of the
    present images.
    """
    images = pixel_values[present]
    if images.shape[0] == 0:
        images = pixel_values.new_zeros(1, *pixel_values.shape[2:])
    return images


class VisionProjector(nn.Module):
    """A ViT's tokens of each present image through an MLP projector into the LLM's width (LLaVA's
    connector). ``freeze_vit``: the ViT keeps its weights and only the projector trains (LLaVA's
    first stage)."""

    def __init__(self, vit: nn.Module, vit_width: int, llm_width: int, freeze_vit: bool = False) -> None:
        super().__init__()
        self.vit = vit
        self.projector = nn.Sequential(nn.Linear(vit_width, llm_width), nn.GELU(), nn.Linear(llm_width, llm_width))
        self.freeze_vit = freeze_vit
        if freeze_vit:
            self.vit.requires_grad_(False)

    def forward(self, pixel_values: Tensor, n_images: Tensor) -> Tensor:
        b, k = pixel_values.shape[:2]
        present = torch.arange(k, device=pixel_values.device)[None, :] < n_images[:, None]  # [B, K]
        images = present_images(pixel_values, present)  # [M, C, H, W]
        if self.freeze_vit:
            with torch.no_grad():
                tokens = self.vit.forward_features(images)
        else:
            tokens = self.vit.forward_features(images)
        tokens = self.projector(tokens)  # [M, T, D]
        out = tokens.new_zeros(b, k, *tokens.shape[1:])
        # the rows keep a graph even with no present image (the projector's parameters get a zero
        # gradient); with none present, the blank image's tokens broadcast into no row
        return out.index_put((present,), tokens) + 0.0 * tokens.sum()

    def pipeline_stages(self, pp: int) -> list:
        """``pp`` stages of the same computation as :meth:`forward`: stage 0 picks the present images
        and embeds their patches, the ViT blocks are split evenly, the last stage normalises, projects
        and puts each image's tokens back in its row's slot (rows of a microbatch travel between stages
        as ``[present images, tokens, width]``)."""
        from lightning_distmm.parallel.pipeline import Stage, cut_into_stages

        vit, blocks = self.vit, self.vit.blocks  # type: ignore[union-attr]
        if self.freeze_vit:
            raise ValueError("a frozen ViT (freeze_vit=True) cannot be cut into pipeline stages yet: use pp=1")
        cuts = cut_into_stages(
            blocks,  # type: ignore[arg-type]
            pp,
            f"a ViT with {len(blocks)} blocks cannot be cut into pp={pp} stages",
            on_first=[vit.patch_embed, vit.norm_pre],  # type: ignore[list-item]
            on_last=[vit.norm, self.projector],  # type: ignore[list-item]
        )
        stages = []
        for a, b, first, last, own in cuts:

            def run(
                x: Tensor | None, rows: Any, a: int = a, b: int = b, first: bool = first, last: bool = last
            ) -> Tensor:
                pixels, n_images = rows["pixel_values"], rows["n_images"]
                k = pixels.shape[1]
                present = torch.arange(k, device=pixels.device)[None, :] < n_images[:, None]
                if first:
                    x = vit.patch_embed(present_images(pixels, present))  # type: ignore[operator]
                    x = vit.norm_pre(vit.patch_drop(vit._pos_embed(x)))  # type: ignore[operator]
                assert x is not None
                for block in blocks[a:b]:
                    x = block(x)
                if not last:
                    return x
                tokens = self.projector(vit.norm(x))  # type: ignore[operator]
                out = tokens.new_zeros(pixels.shape[0], k, *tokens.shape[1:])
                return out.index_put((present,), tokens) + 0.0 * tokens.sum()

            loose = tuple(
                f"vit.{n}"
                for n in ("cls_token", "reg_token", "pos_embed")
                if first and getattr(vit, n, None) is not None
            )
            stages.append(Stage(own, run, loose))
        return stages


class LanguageModel(nn.Module):
    """A causal LM that reads image tokens as a prefix: returns ``[B, S, V]`` logits of the text positions.

    ``max_images`` image slots of ``tokens_per_image`` tokens each lead every sequence (absent images'
    slots masked, positions counted over present tokens only). The forward is written as prologue,
    decoder layers and epilogue so that :meth:`pipeline_stages` cuts the same computation into stages.
    """

    def __init__(
        self, lm: PreTrainedModel, max_images: int, tokens_per_image: int, pack_tokens: int | None = None
    ) -> None:
        super().__init__()
        self.lm = lm
        self.max_images = max_images
        self.tokens_per_image = tokens_per_image
        #: run the rows' present tokens packed into sequences of this many (``models.packing``): no
        #: absent image slot and no padding computed; None: every slot and pad computed, masked
        self.pack_tokens = pack_tokens

    @property
    def prefix(self) -> int:
        return self.max_images * self.tokens_per_image

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, n_images: Tensor, image_embeds: Tensor
    ) -> Tensor:
        rows = {"input_ids": input_ids, "attention_mask": attention_mask, "n_images": n_images}
        x = self._prologue(rows, image_embeds)
        if self.pack_tokens is not None:
            return self._packed(x, rows)
        x = self._layers(x, rows, 0, len(self.lm.model.layers))
        return self._epilogue(x)

    def _packed(self, x: Tensor, rows: Any) -> Tensor:
        """The layers on the present tokens packed (positions restart per sample, attention inside
        each: transformers' packed-sequence mask), the head on them, the logits back at the rows' places."""
        packed, positions, where = pack(x, self._present(x, rows), self.pack_tokens)  # type: ignore[arg-type]
        causal = create_causal_mask(
            config=self.lm.config, inputs_embeds=packed, attention_mask=None, cache=None, position_ids=positions
        )
        if torch.is_tensor(causal) and causal.is_floating_point():
            causal = causal.clamp(min=torch.finfo(torch.float32).min)  # as in _context
        rotary = self.lm.model.rotary_emb(packed, position_ids=positions)
        for layer in self.lm.model.layers:
            packed = layer(
                packed, attention_mask=causal, position_embeddings=rotary, position_ids=positions, use_cache=False
            )
        logits = self.lm.lm_head(self.lm.model.norm(packed))
        return unpack(logits, where)[:, self.prefix :]

    def _present(self, x: Tensor, rows: Any) -> Tensor:
        """``[B, prefix + S]``: 1 where a token is computed (a present image's slots, the text's mask)."""
        present = torch.arange(self.max_images, device=x.device)[None, :] < rows["n_images"][:, None]
        attention_mask = rows["attention_mask"]
        image_mask = present.repeat_interleave(self.tokens_per_image, dim=1).to(attention_mask.dtype)
        return torch.cat([image_mask, attention_mask], dim=1)

    def _prologue(self, rows: Any, image_embeds: Tensor) -> Tensor:
        b, k, t, d = image_embeds.shape
        if (k, t) != (self.max_images, self.tokens_per_image):
            raise ValueError(
                f"image_embeds has {k} images of {t} tokens per sample; the language model was built for"
                f" {self.max_images} of {self.tokens_per_image}"
            )
        text = self.lm.get_input_embeddings()(rows["input_ids"])
        return torch.cat([image_embeds.reshape(b, k * t, d).to(text.dtype), text], dim=1)

    def _context(self, x: Tensor, rows: Any) -> tuple[Any, tuple[Tensor, Tensor], Tensor]:
        """The causal mask, rotary embeddings and positions of the image + text sequence ``x``."""
        mask = self._present(x, rows)
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # present tokens numbered 0, 1, ... per sample
        causal = create_causal_mask(
            config=self.lm.config, inputs_embeds=x, attention_mask=mask, cache=None, position_ids=positions
        )
        if torch.is_tensor(causal) and causal.is_floating_point():
            # transformers' eager attention takes its softmax in float32: a float64 model's mask value
            # (float64's min) becomes -inf there, and a row with no key to attend (an absent image's
            # slot) NaN. float32's min is the same mask for every dtype (identity in float32).
            causal = causal.clamp(min=torch.finfo(torch.float32).min)
        return causal, self.lm.model.rotary_emb(x, position_ids=positions), positions

    def _layers(self, x: Tensor, rows: Any, a: int, b: int) -> Tensor:
        causal, rotary, positions = self._context(x, rows)
        for layer in self.lm.model.layers[a:b]:
            x = layer(x, attention_mask=causal, position_embeddings=rotary, position_ids=positions, use_cache=False)
        return x

    def _epilogue(self, x: Tensor) -> Tensor:
        return self.lm.lm_head(self.lm.model.norm(x))[:, self.prefix :]

    def pipeline_stages(self, pp: int) -> list:
        """``pp`` stages: the embeddings and the image prefix first, the decoder layers split evenly, the
        final norm and the LM head last (each stage keeps the rotary table, which has no parameters)."""
        if self.pack_tokens is not None:
            raise ValueError("a packed language model (pack_tokens) cannot be cut into pipeline stages yet: use pp 1")
        from lightning_distmm.parallel.pipeline import Stage, cut_into_stages

        layers = self.lm.model.layers
        cuts = cut_into_stages(
            layers,
            pp,
            f"{len(layers)} decoder layers cannot be cut into {pp} pipeline stages",
            on_first=[self.lm.get_input_embeddings()],
            on_last=[self.lm.model.norm, self.lm.lm_head],
            on_every=[self.lm.model.rotary_emb],
        )
        stages = []
        for a, b, first, last, own in cuts:

            def run(
                x: Tensor | None, rows: Any, a: int = a, b: int = b, first: bool = first, last: bool = last
            ) -> Tensor:
                if first:
                    x = self._prologue(rows, rows["image_embeds"])
                assert x is not None
                x = self._layers(x, rows, a, b)
                return self._epilogue(x) if last else x

            stages.append(Stage(own, run))
        return stages


def tiny_llama_config(vocab: int = 32, width: int = 32, layers: int = 2, heads: int = 4) -> LlamaConfig:
    """A Llama-style config of a few ten thousand parameters (random init, offline)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",  # fully masked padding rows stay finite (no NaN in their gradients)
    )


def tiny_vit(
    img_size: int = 8, patch_size: int = 4, width: int = 16, depth: int = 1, heads: int = 2, qkv_bias: bool = True
) -> VisionTransformer:
    """The VLM's tiny vision tower: :func:`lightning_distmm.models.tiny.tiny_vit` without a head or
    pooling, so that it returns every token for the projector."""
    return tiny.tiny_vit(img_size, patch_size, width, depth, heads, embed=0, qkv_bias=qkv_bias, global_pool="")


class VLM(DistMMMixin, L.LightningModule):
    """Vision tower (ViT + projector) feeding a causal LM; the loss is the batch's next-token token mean.

    ``vit`` / ``lm``: built tiny at random when None; pass e.g. ``AutoModelForCausalLM.from_pretrained(dir,
    local_files_only=True)`` (see :func:`load_language_model`) and a timm ViT for real weights.
    ``cost``: each tower's ``Tower(cost=...)``, e.g. ``{"image": "n_images", "llm": {"n_images": 5,
    "n_tokens": 1}}`` (an image's tokens and the caption's): each step's rows then balanced by it.
    ``pack_tokens``: the LM computes only each row's present tokens, packed into sequences of this
    many (absent image slots and padding skipped; :mod:`lightning_distmm.models.packing`).
    """

    def __init__(
        self,
        vit: nn.Module | None = None,
        lm: PreTrainedModel | None = None,
        vit_width: int = 16,
        freeze_vit: bool = False,
        frozen_llm: bool = False,
        max_images: int = 2,
        optimizer: str = "sgd",
        lr: float = 0.1,
        eps: float = 1e-8,
        cost: Mapping[str, Any] | None = None,
        pack_tokens: int | None = None,
    ) -> None:
        super().__init__()
        lm = lm if lm is not None else LlamaForCausalLM(tiny_llama_config())
        self.vision = VisionProjector(
            vit if vit is not None else tiny_vit(width=vit_width), vit_width, lm.config.hidden_size, freeze_vit
        )
        tokens = self.vision.vit.patch_embed.num_patches + self.vision.vit.num_prefix_tokens  # type: ignore[operator]
        self.language = LanguageModel(lm, max_images, int(tokens), pack_tokens)
        self.frozen_llm = frozen_llm
        self.optimizer_name = optimizer
        self.lr = lr
        self.eps = eps  # AdamW's epsilon (torch's default)
        self.cost = dict(cost or {})  # tower -> Tower(cost=...): each step's rows balanced by it

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning's hook on the batch before it moves to the device: its image counts checked
        against the images it carries (:func:`check_images`), in one process and on every distmm
        rank for the rows and fields it loaded. A module overriding this hook calls ``super()``."""
        if isinstance(batch, Mapping) and ("n_images" in batch or "pixel_values" in batch):
            rows = self.batch_rows(batch) if self._distmm_runner is not None else None
            samples = batch.get(SAMPLES_KEY)
            language = self.language
            check_images(batch.get("n_images"), batch.get("pixel_values"), language.max_images, rows, samples)
            mask, counts = batch.get("attention_mask"), batch.get("n_images")
            if language.pack_tokens is not None and isinstance(mask, Tensor) and isinstance(counts, Tensor):
                lengths = mask.sum(1) + counts.clamp(min=0) * language.tokens_per_image
                what = f"the attention_mask's tokens and {language.tokens_per_image} per image of n_images"
                check_budget(lengths, language.pack_tokens, what, rows, samples)
        return super().on_before_batch_transfer(batch, dataloader_idx)

    def towers(self) -> dict[str, Tower]:
        return {
            "image": Tower(self.vision, input=["pixel_values", "n_images"], cost=self.cost.get("image")),
            "llm": Tower(
                self.language,
                input=["input_ids", "attention_mask", "labels", "n_images"],
                consumes={"image": "image_embeds"},
                frozen=self.frozen_llm,
                cost=self.cost.get("llm"),
            ),
        }

    def token_loss(self, outputs: Tensor, batch: Any) -> tuple[Tensor, Tensor]:
        """Next-token cross-entropy summed over these rows' target tokens, and their count."""
        labels = batch["labels"][:, 1:]
        logits = outputs[:, :-1]
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return total, (labels != IGNORE).sum()

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01, eps=self.eps)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


def load_language_model(path: str) -> PreTrainedModel:
    """A causal LM from a local Hugging Face folder (never downloads)."""
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="eager")
