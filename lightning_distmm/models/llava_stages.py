"""The LLaVA towers cut into pipeline stages: the same computation as their forwards, stage by stage
(:class:`~lightning_distmm.models.llava.LlavaVision` and
:class:`~lightning_distmm.models.llava.LlavaLanguage` call these from ``pipeline_stages``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_distmm.models.packing import packing_of, place, unpack


def present_images(pixel_values: Tensor, n_images: Tensor) -> Tensor:
    """The rows' images; a blank one when no row here carries an image (its tokens land nowhere)."""
    images = pixel_values[n_images > 0]
    return images if images.shape[0] else pixel_values.new_zeros(1, *pixel_values.shape[1:])


def rows_of_images(tokens: Tensor, n_images: Tensor) -> Tensor:
    """Each image's tokens at its row, zeros for a row without one; every row keeps a graph (zero
    gradients for the rows without an image)."""
    present = n_images > 0
    out = tokens.new_zeros(n_images.shape[0], *tokens.shape[1:])
    return out.index_put((present,), tokens[: int(present.sum())]) + 0.0 * tokens.sum()


def vision_stages(vision: Any, pp: int) -> list:
    """``pp`` stages of ``LlavaVision.forward`` (an ``int`` ``vision_feature_layer``): the patch embedding
    first, the encoder layers up to the one whose hidden state LLaVA reads split evenly, the
    selection and the projector last. The layers after that one (their output unused, as in
    transformers' forward) and the post-norm are held by the last stage, unrun: no gradient,
    as in one process."""
    from lightning_distmm.parallel.pipeline import Stage, cut_into_stages

    if not isinstance(vision.layer, int):
        raise ValueError(
            f"vision_feature_layer={vision.layer!r}: a vision tower reading several layers' hidden states cannot"
            " be cut into pipeline stages yet: use pp 1 for the vision tower"
        )
    tower = vision.vision_tower
    layers = tower.encoder.layers
    depth = vision.layer % (len(layers) + 1)  # hidden state ``depth``: the output of ``depth`` layers
    unrun = [*layers[depth:], *(m for m in (getattr(tower, "post_layernorm", None),) if m is not None)]
    cuts = cut_into_stages(
        layers[:depth],
        pp,
        f"the vision tower's features are the output of its first {depth} layer(s)"
        f" (vision_feature_layer={vision.layer}): they cannot be cut into {pp} pipeline stages",
        on_first=[tower.embeddings, tower.pre_layrnorm],
        on_last=[vision.multi_modal_projector, *unrun],
    )
    stages = []
    for a, b, first, last, own in cuts:

        def run(
            x: Tensor | None,
            rows: Mapping[str, Any],
            a: int = a,
            b: int = b,
            first: bool = first,
            last: bool = last,
        ) -> Tensor:
            if first:
                x = tower.pre_layrnorm(tower.embeddings(present_images(rows["pixel_values"], rows["n_images"])))
            assert x is not None
            for layer in layers[a:b]:
                x = layer(x, None)
            if not last:
                return x
            picked = x[:, 1:] if vision.strategy == "default" else x
            return rows_of_images(vision.multi_modal_projector(picked), rows["n_images"])

        stages.append(Stage(own, run))
    return stages


def language_stages(language: Any, pp: int) -> list:
    """``pp`` stages of the same computation as ``LlavaLanguage.forward`` (``LlamaModel.forward`` without a
    cache): the embeddings and the image features first, the decoder layers split evenly, the final
    norm and the head last; each stage rebuilds the causal mask and the rotary table (no parameters)."""
    from transformers.masking_utils import create_causal_mask

    from lightning_distmm.parallel.pipeline import Stage, cut_into_stages

    lm = language.language_model
    budget = language.pack_tokens
    layers = lm.layers

    def context(x: Tensor, rows: Mapping[str, Any], positions: Tensor | None) -> tuple[Any, Any, Tensor]:
        # packed sequences (``positions`` given): transformers keeps attention inside each sample
        # from the restarting positions, with no attention mask, as in :meth:`forward`
        mask = rows["attention_mask"] if positions is None else None
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)[None]
        causal = create_causal_mask(
            config=lm.config,
            inputs_embeds=x,
            attention_mask=mask,
            cache=None,
            position_ids=positions,
        )
        return causal, lm.rotary_emb(x, position_ids=positions), positions

    cuts = cut_into_stages(
        layers,
        pp,
        f"{len(layers)} decoder layers cannot be cut into {pp} pipeline stages",
        on_first=[lm.get_input_embeddings()],
        on_last=[lm.norm, language.lm_head],
        on_every=[lm.rotary_emb],
    )
    stages = []
    for a, b, first, last, own in cuts:

        def run(
            x: Tensor | None,
            rows: Mapping[str, Any],
            a: int = a,
            b: int = b,
            first: bool = first,
            last: bool = last,
        ) -> Tensor:
            packed_positions, where = None, None
            if budget is not None:  # every stage finds the packing from the rows' mask alone
                packed_positions, where = packing_of(rows["attention_mask"], budget)
            if first:
                x = language._embed(rows)
                if where is not None:
                    x = place(x, where)
            assert x is not None
            if packed_positions is not None:
                packed_positions = packed_positions.to(x.device)
            causal, rotary, positions = context(x, rows, packed_positions)
            for layer in layers[a:b]:
                x = layer(x, attention_mask=causal, position_embeddings=rotary, position_ids=positions, use_cache=False)
            if not last:
                return x
            out = language.lm_head(lm.norm(x))
            return out if where is None else unpack(out, where)

        stages.append(Stage(own, run))
    return stages
