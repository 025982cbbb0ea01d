"""Sequence parallelism with tensor parallelism for transformers CLIP-style text towers (``sp: true``).

The same scheme as :mod:`.sequence_parallel` for timm ViTs (Megatron-LM's), on ``encoder.layers``:

```
embeddings (every token, every tp rank) --split at layers[0]'s input--> [B, S/tp, D]   (padded to a multiple of tp)
 layer_norm1 (local) -> [all-gather] -> q|k|v (column, one gather for the three)
      -> attention, own heads, every token: the model's causal + padding mask, padded keys masked
      -> out_proj (row) -> [reduce-scatter] -> + residual
 layer_norm2 (local) -> [all-gather] -> fc1 (column) -> act -> fc2 (row) -> [reduce-scatter] -> + residual
final_layer_norm (local) -> [all-gather, padding dropped] -> EOS pooling, projection (every tp rank)
```

q, k, v and fc1 are DTensor ``ColwiseParallel`` shards, out_proj ``RowwiseParallel(output_layouts=
Shard(1))`` (:func:`~lightning_distmm.parallel.tensor_parallel.apply_tp_clip_text` with ``sp``);
this module computes q|k|v and fc1 from their local shards through ``_GatherLinear`` (this rank's
tokens kept for backward, gathered again there) and fc2 through ``_ActLinear`` (fc1's output kept,
the activation recomputed). The attention mask is the whole-sequence ``[B, 1, S, S]`` mask the
model builds before the encoder (causal and padding), padded with masked keys. The EOS row is read
after the final gather, so pooling sees the whole sequence. Gradients of the replicated parameters
(embeddings, LayerNorms, projection) are summed over tp as for the ViT, and the feature gradient
is scaled by ``1 / tp`` (:func:`.context_parallel.head_copies`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_distmm.parallel.context_parallel import (
    SequenceSplit,
    _attend,
    _gather_output,
    _split_first_input,
    _text_layers,
    _text_mask,
)
from lightning_distmm.parallel.sp_ops import (
    _ActLinear,
    _GatherLinear,
    _ReduceScatter,
    _sum_over,
    _sums_before_forward,
)


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


def check_sp_text(module: nn.Module) -> bool:
    """Whether ``module`` is a text tower this module can split (``encoder.layers`` of CLIP-style
    layers: ``self_attn.q_proj/k_proj/v_proj/out_proj``, ``mlp.fc1/fc2/activation_fn``)."""
    found = _text_layers(module)
    if found is None:
        return False
    attn_ok = all(hasattr(la.self_attn, n) for la in found[0] for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
    mlp_ok = all(hasattr(la.mlp, n) for la in found[0] for n in ("fc1", "fc2", "activation_fn"))
    return attn_ok and mlp_ok


__all__ = ["apply_sp_text", "check_sp_text"]
