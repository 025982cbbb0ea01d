"""What makes a transformers CLIP-style text encoder parallel (``encoder.layers`` of layers with
``self_attn.q_proj/k_proj/v_proj/out_proj`` and ``mlp.fc1/fc2``, and a ``final_layer_norm``):
tensor, sequence and context parallelism, and the pipeline cut a wrapper calls
(:func:`clip_text_stages`, which needs the wrapper's pooling and projection). Other encoders of
that shape (a CLIP vision tower, SigLIP's text tower) get the tensor-parallel split.

**Tensor parallelism**: ``q/k/v_proj`` and ``fc1`` column-wise, ``out_proj`` and ``fc2`` row-wise
(DTensor ``parallelize_module``); embeddings, norms and the projection stay replicated.

**Sequence parallelism** (``sp: true``): the same scheme as for timm ViTs (:mod:`.vit`, Megatron-LM's), on ``encoder.layers``:

```
embeddings (every token, every tp rank) --split at layers[0]'s input--> [B, S/tp, D]   (padded to a multiple of tp)
 layer_norm1 (local) -> [all-gather] -> q|k|v (column, one gather for the three)
      -> attention, own heads, every token: the model's causal + padding mask, padded keys masked
      -> out_proj (row) -> [reduce-scatter] -> + residual
 layer_norm2 (local) -> [all-gather] -> fc1 (column) -> act -> fc2 (row) -> [reduce-scatter] -> + residual
final_layer_norm (local) -> [all-gather, padding dropped] -> EOS pooling, projection (every tp rank)
```

q, k, v and fc1 are DTensor ``ColwiseParallel`` shards, out_proj ``RowwiseParallel(output_layouts=
Shard(1))`` (:func:`apply_tp_clip_text` with ``sp``);
this module computes q|k|v and fc1 from their local shards through ``_GatherLinear`` (this rank's
tokens kept for backward, gathered again there) and fc2 through ``_ActLinear`` (fc1's output kept,
the activation recomputed). The attention mask is the whole-sequence ``[B, 1, S, S]`` mask the
model builds before the encoder (causal and padding), padded with masked keys. The EOS row is read
after the final gather, so pooling sees the whole sequence. Gradients of the replicated parameters
(embeddings, LayerNorms, projection) are summed over tp as for the ViT, and the feature gradient
is scaled by ``1 / tp`` (:func:`.context_parallel.head_copies`).

**Context parallelism** (Ulysses): the tokens split at ``layers[0]``'s input, gathered after
``final_layer_norm``; each attention runs all-to-alls around itself with the model's mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_distmm.parallel.context_parallel import (
    SequenceSplit,
    _attend,
    _gather_output,
    _HeadsToSeq,
    _SeqToHeads,
    _split_first_input,
    _text_mask,
    tell_length,
)
from lightning_distmm.parallel.families.registry import Family, Held, holds_all, register
from lightning_distmm.parallel.pipeline import Stage, cut_into_stages
from lightning_distmm.parallel.sp_ops import (
    _ActLinear,
    _GatherLinear,
    _ReduceScatter,
    _sum_over,
    _sums_before_forward,
)
from lightning_distmm.parallel.tensor_parallel import _check_heads


def _has_layers(module: nn.Module) -> bool:
    return any(name.endswith("encoder.layers") for name, _ in module.named_modules())


def _text_layers(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """A transformers CLIP-style text encoder's ``encoder.layers`` and ``final_layer_norm``."""
    for name, sub in module.named_modules():
        if name.endswith("encoder.layers") or name == "encoder.layers":
            owner = (
                module.get_submodule(name[: -len("encoder.layers")].rstrip(".")) if name != "encoder.layers" else module
            )
            norm = getattr(owner, "final_layer_norm", None)
            if norm is not None:
                return sub, norm
    return None


# ---------------------------------------------------------------------- tensor parallelism
def apply_tp_clip_text(model: nn.Module, mesh: DeviceMesh, held: Held = holds_all, sp: bool = False) -> nn.Module:
    """Shard the layers of a transformers CLIP text encoder (any module with ``encoder.layers``) in place;
    only the layers ``held`` says this rank runs. ``sp``: out_proj and fc2 reduce-scatter the tokens
    (their inputs' gathers are :func:`lightning_distmm.parallel.sequence_parallel.apply_sp`'s, which
    must follow and computes q, k, v and fc1 from their shards)."""
    tp = mesh.size()
    layers = [m for name, m in model.named_modules() if name.endswith("encoder.layers")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no 'encoder.layers' to shard")
    for i, layer in enumerate(layers[0]):
        attn = layer.self_attn
        _check_heads(attn.num_heads, tp, f"encoder.layers.{i}.self_attn")
        if not held(layer):
            continue  # another pipeline stage's layer
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.out_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        }
        parallelize_module(layer, mesh, plan)
        attn.num_heads //= tp
        if hasattr(attn, "embed_dim"):
            attn.embed_dim //= tp
    return model


def check_tp_clip_text(module: nn.Module, tp: int) -> None:
    layers = [m for name, m in module.named_modules() if name.endswith("encoder.layers")][0]
    for i, layer in enumerate(layers):
        _check_heads(layer.self_attn.num_heads, tp, f"encoder.layers.{i}.self_attn")


# ---------------------------------------------------------------------- sequence parallelism
def _local(p: nn.Parameter | None) -> Tensor | None:
    return None if p is None else p.to_local()  # type: ignore[attr-defined]


@functools.cache
def _sp_text_attention_class(base: type[nn.Module]) -> type[nn.Module]:
    class SequenceParallelCLIPAttention(base):  # type: ignore[valid-type,misc]
        """transformers' ``CLIPAttention`` on this rank's tokens: q|k|v gathered once, own heads over
        every token, out_proj reduce-scattered; same parameters."""

        _distmm_sp: SequenceSplit

        def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Any:
            split, b = self._distmm_sp, hidden_states.shape[0]
            projs = (self.q_proj, self.k_proj, self.v_proj)
            weight = torch.cat([_local(p.weight) for p in projs])  # type: ignore[misc]
            biases = [_local(p.bias) for p in projs]
            bias = None if any(x is None for x in biases) else torch.cat(biases)  # type: ignore[arg-type]
            qkv = _GatherLinear.apply(hidden_states, weight, bias, split)  # [B, n, 3 * local width]
            n = qkv.shape[1]
            q, k, v = qkv.view(b, n, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            allowed = _text_mask(attention_mask, kwargs.get("is_causal", self.is_causal), split, n, q.device)
            out = _attend(q, k, v, allowed, self.dropout if self.training else 0.0, self.scale)
            return self.out_proj(out.transpose(1, 2).reshape(b, n, -1)), None

    return SequenceParallelCLIPAttention


@functools.cache
def _sp_text_mlp_class(base: type[nn.Module]) -> type[nn.Module]:
    class SequenceParallelCLIPMLP(base):  # type: ignore[valid-type,misc]
        """transformers' ``CLIPMLP`` on this rank's tokens: fc1 gathers, fc2 keeps fc1's output only
        (the activation recomputed in backward), reduce-scattered, then fc2's replicated bias."""

        _distmm_sp: SequenceSplit

        def forward(self, hidden_states: Tensor) -> Tensor:
            split = self._distmm_sp
            h = _GatherLinear.apply(hidden_states, _local(self.fc1.weight), _local(self.fc1.bias), split)
            y = _ReduceScatter.apply(_ActLinear.apply(h, _local(self.fc2.weight), self.activation_fn), split)
            if self.fc2.bias is not None:
                bias = _local(self.fc2.bias)
                if bias.requires_grad:  # type: ignore[union-attr]
                    bias.register_hook(_sum_over(split.group))  # type: ignore[union-attr]
                y = y + bias
            return y

    return SequenceParallelCLIPMLP


def check_sp_text(module: nn.Module) -> bool:
    """Whether ``module`` is a text tower this module can split (``encoder.layers`` of CLIP-style
    layers: ``self_attn.q_proj/k_proj/v_proj/out_proj``, ``mlp.fc1/fc2/activation_fn``)."""
    found = _text_layers(module)
    if found is None:
        return False
    attn_ok = all(hasattr(la.self_attn, n) for la in found[0] for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
    mlp_ok = all(hasattr(la.mlp, n) for la in found[0] for n in ("fc1", "fc2", "activation_fn"))
    return attn_ok and mlp_ok


def check_sp_clip_text(module: nn.Module) -> None:
    if not check_sp_text(module):
        raise ValueError(
            "sequence parallelism is built for timm VisionTransformer towers and transformers CLIP-style text"
            f" encoders; a {type(module).__name__} tower runs tp without it (set sp: false) or splits its"
            " sequence with cp"
        )


def apply_sp_text(module: nn.Module, mesh: DeviceMesh, held: Callable[[nn.Module], bool]) -> nn.Module:
    """Split a tensor-parallel CLIP text tower's stream along the sequence over the tp ``mesh`` (in
    place, after ``apply_tp(..., sp=True)``), in the layers ``held`` says this rank runs; the
    replicated parameters' gradients summed over tp (hooks put on before each module's forward)."""
    found = _text_layers(module)
    assert found is not None
    layers, norm = found
    group, tp = mesh.get_group(), mesh.size()
    split = SequenceSplit(group, tp, mesh.get_local_rank())
    layers[0].register_forward_pre_hook(_split_first_input(split), with_kwargs=True)
    norm.register_forward_hook(_gather_output(split))
    for layer in layers:
        if not held(layer):
            continue  # another pipeline stage's layer
        layer.self_attn.__class__ = _sp_text_attention_class(type(layer.self_attn))
        layer.mlp.__class__ = _sp_text_mlp_class(type(layer.mlp))
        layer.self_attn._distmm_sp = layer.mlp._distmm_sp = split
    for sub in module.modules():
        if any(True for _ in sub.parameters(recurse=False)):
            sub.register_forward_pre_hook(_sums_before_forward(group, [sub]))
    module._distmm_sp = split  # type: ignore[assignment]
    return module


# ---------------------------------------------------------------------- context parallelism
@functools.cache
def _clip_attention_class() -> type[nn.Module]:
    from transformers.models.clip.modeling_clip import CLIPAttention

    class ContextParallelCLIPAttention(CLIPAttention):
        """transformers' ``CLIPAttention`` with Ulysses all-to-alls; same parameters."""

        _distmm_cp: SequenceSplit

        def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Any:
            split = self._distmm_cp
            b, s, _ = hidden_states.shape
            qkv = [
                proj(hidden_states).view(b, s, 1, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj)
            ]
            q, k, v = _SeqToHeads.apply(torch.cat(qkv, 2), split.cp, split.group).permute(2, 0, 3, 1, 4).unbind(0)
            n = q.shape[2]
            allowed = _text_mask(attention_mask, kwargs.get("is_causal", self.is_causal), split, n, q.device)
            out = _attend(q, k, v, allowed, self.dropout if self.training else 0.0, self.scale)
            out = _HeadsToSeq.apply(out.transpose(1, 2).unsqueeze(2), split.cp, split.group)
            return self.out_proj(out.reshape(b, s, -1)), None

    return ContextParallelCLIPAttention


def cp_heads_clip_text(module: nn.Module) -> list[tuple[str, int]]:
    found = _text_layers(module)
    if found is None:
        raise ValueError(
            f"no context-parallel plan for a {type(module).__name__} tower: supported are timm VisionTransformer and"
            " transformers CLIP-style text encoders (encoder.layers + final_layer_norm); use cp=1 for this tower"
        )
    return [(f"encoder.layers.{i}.self_attn", layer.self_attn.num_heads) for i, layer in enumerate(found[0])]


def apply_cp_clip_text(module: nn.Module, split: SequenceSplit) -> None:
    """The tokens split at the first layer's input, gathered after ``final_layer_norm``; every
    attention Ulysses'."""
    layers, norm = _text_layers(module)  # type: ignore[misc]
    cls = _clip_attention_class()
    layers[0].register_forward_pre_hook(_split_first_input(split), with_kwargs=True)
    norm.register_forward_hook(_gather_output(split))
    for layer in layers:
        layer.self_attn.__class__ = cls
        layer.self_attn._distmm_cp = split


# ---------------------------------------------------------------------- pipeline stages
def clip_text_stages(
    text_model: nn.Module,
    pp: int,
    epilogue: Callable[[Tensor, Mapping[str, Any]], Tensor],
    epilogue_modules: list[nn.Module],
    ids_field: str = "input_ids",
    mask_field: str | None = "attention_mask",
) -> list[Stage]:
    """Stages of a transformers ``CLIPTextModel``: embeddings on stage 0, ``encoder.layers`` split
    evenly, ``final_layer_norm`` then ``epilogue(hidden, rows)`` (the wrapper's pooling and
    projection) on the last. Every stage rebuilds the causal + padding mask from the batch rows."""
    from transformers.masking_utils import create_causal_mask

    layers = text_model.encoder.layers  # type: ignore[union-attr]
    cuts = cut_into_stages(
        layers,  # type: ignore[arg-type]
        pp,
        f"a text encoder with {len(layers)} layers cannot be cut into pp={pp} stages",
        on_first=[text_model.embeddings],  # type: ignore[list-item]
        on_last=[text_model.final_layer_norm, *epilogue_modules],  # type: ignore[list-item]
    )
    stages = []
    for a, b, first, last, own in cuts:

        def run(
            x: Tensor | None, rows: Mapping[str, Any], a: int = a, b: int = b, first: bool = first, last: bool = last
        ) -> Tensor:
            if first:
                x = text_model.embeddings(input_ids=rows[ids_field])  # type: ignore[operator]
            assert x is not None
            mask = rows[mask_field] if mask_field is not None else None
            # the mask of the whole sequence: a stage of a cp / sp tower receives its share of the tokens
            # (padded to a multiple of cp), so the length comes from the batch rows and its split is told
            length = rows[ids_field].shape[1]
            like = x if x.shape[1] == length else x.new_empty(x.shape[0], length, x.shape[2])
            tell_length(layers[a:b], length)
            attn = create_causal_mask(config=text_model.config, inputs_embeds=like, attention_mask=mask, cache=None)
            for layer in layers[a:b]:
                x = layer(x, attn, is_causal=True)
            if last:
                x = epilogue(text_model.final_layer_norm(x), rows)  # type: ignore[operator]
            return x

        stages.append(Stage(own, run))
    return stages


CLIP_TEXT = register(
    Family(
        name="clip_text",
        what="transformers CLIP-style text encoders (modules with 'encoder.layers')",
        matches=_has_layers,
        check_tp=check_tp_clip_text,
        apply_tp=apply_tp_clip_text,
        check_sp=check_sp_clip_text,
        apply_sp=apply_sp_text,
        cp_heads=cp_heads_clip_text,
        apply_cp=apply_cp_clip_text,
    )
)

__all__ = ["CLIP_TEXT", "apply_tp_clip_text", "clip_text_stages"]
