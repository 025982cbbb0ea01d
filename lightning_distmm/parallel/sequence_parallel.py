"""Sequence parallelism with tensor parallelism (Megatron-LM's scheme), for timm ViT towers (``sp: true``).

Under plain TP every tensor-parallel rank holds the whole ``[B, S, D]`` residual stream: the
LayerNorms, residual adds, dropouts and their saved activations are replicated ``tp`` times.
With ``sp`` the stream between the tensor-parallel regions is split along the sequence:

```
tokens (after norm_pre) --split--> [B, S/tp, D] per tp rank
  norm1 (local) -> all-gather -> qkv (column) -> attention (own heads, padded keys masked)
       -> proj (row) -> reduce-scatter -> [B, S/tp, D] + residual
  norm2 (local) -> all-gather -> fc1 (column) -> act -> fc2 (row) -> reduce-scatter -> + residual
final norm (local) -> all-gather -> pooling, head (every tp rank)
```

What each block keeps for backward (``S`` tokens, width ``D``, MLP width ``M``): the LayerNorm
inputs and the gathered linears' inputs as this rank's ``S/tp`` tokens (Megatron's scheme: the qkv
and fc1 regather in backward), q, k, v and the attention output of this rank's heads, and fc1's
output ``[S, M/tp]``. The MLP's activation output is not kept: fc2 (``_ActLinear``) keeps the
activation's input, which the activation's backward needs anyway, and recomputes the activation
in backward (an elementwise op; timm's ``Mlp`` would keep both, ``2 S M / tp``). Nothing of the
whole sequence at full width is kept inside a block.

An all-gather before and a reduce-scatter after each tensor-parallel region replace TP's
all-reduce (the same bytes on a ring). ``fc1`` / ``proj`` / ``fc2`` use DTensor's
``ColwiseParallel(input_layouts=Shard(1))`` / ``RowwiseParallel(output_layouts=Shard(1))``
(:func:`lightning_distmm.parallel.tensor_parallel.apply_tp_vit` with ``sp``; ``mlp.fc2``'s sharded
parameters are then used by :class:`_ActLinear` and this module's reduce-scatter); the fused qkv's gather
and the split / gather of the stream are this package's (:mod:`.context_parallel`), which pads the
sequence to a multiple of ``tp`` (197 ViT tokens work).

Gradients. The parameters TP leaves replicated (patch and position embedding, class token, every
LayerNorm, the head) now see only this rank's tokens, so their gradients are partial sums: a
gradient hook sums each over the tp group when its backward produces it (the tp ranks run the same
graph, so in the same order). The hooks are put on before each module's forward, not once here: a
tower built on the meta device gets new Parameter objects when it is materialised. The head runs on every tp rank on the same gathered tokens, so the
feature gradient is scaled by ``1 / tp`` (:func:`.context_parallel.head_copies`); the gather's
reduce-scatter then gives every chunk exactly its gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_distmm.parallel.context_parallel import (
    SequenceSplit,
    _gather_output,
    _split_output,
    _vit_attention_class,
)
from lightning_distmm.parallel.sequence_parallel_text import apply_sp_text, check_sp_text
from lightning_distmm.parallel.sp_ops import _ActLinear, _GatherLinear, _ReduceScatter, _sum_over, _sums_before_forward


def check_sp(module: nn.Module, tower: str, tp: int) -> None:
    """Raise, naming the tower and the rule, where ``sp: true`` cannot run on ``module`` (meta modules
    are fine). The rules the plan alone decides (sp needs tp > 1, and neither cp nor sharding) are
    the plan's own (:func:`lightning_distmm.core.plan_schema.check_sequence_split`)."""
    where = f"tower {tower!r}, tp={tp}, sp: true"
    vit = hasattr(module, "patch_embed") and hasattr(module, "norm_pre") and hasattr(module, "blocks")
    if not vit and not check_sp_text(module):
        raise ValueError(
            f"{where}: sequence parallelism is built for timm VisionTransformer towers and transformers CLIP-style"
            f" text encoders; a {type(module).__name__} tower runs tp without it (set sp: false) or splits its"
            " sequence with cp"
        )
    if vit and (getattr(module, "dynamic_img_size", False) or not isinstance(module.patch_drop, nn.Identity)):
        raise ValueError(f"{where}: dynamic image sizes and patch dropout change the sequence length per batch")


class _SeqColwise(nn.Module):
    """``mlp.fc1`` under sequence parallelism: the weight and bias column-sharded (DTensors of the full
    layer, ``Shard(0)``, as ``ColwiseParallel`` makes them), its input gathered by :class:`_GatherLinear`."""

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, split: SequenceSplit):
        super().__init__()
        self.split = split
        self.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
        self.weight.requires_grad_(linear.weight.requires_grad)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Shard(0)]))
            self.bias.requires_grad_(linear.bias.requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias.to_local() if self.bias is not None else None
        return _GatherLinear.apply(x, self.weight.to_local(), bias, self.split)


def _fusable(mlp: nn.Module) -> bool:
    """timm's ``Mlp`` (its own forward: fc1, act, drop1, norm, fc2, drop2; not ``GluMlp`` / ``SwiGLU``,
    which gate) whose activation output goes straight into fc2 (no dropout, no norm between)."""
    from timm.layers import Mlp

    drop, norm = getattr(mlp, "drop1", None), getattr(mlp, "norm", None)
    plain_drop = isinstance(drop, nn.Identity) or (isinstance(drop, nn.Dropout) and drop.p == 0)
    return type(mlp).forward is Mlp.forward and plain_drop and isinstance(norm, nn.Identity)


@functools.cache
def _sp_mlp_class(base: type[nn.Module]) -> type[nn.Module]:
    class SequenceParallelMlp(base):  # type: ignore[valid-type,misc]
        """timm's ``Mlp`` under sp: fc1 gathers (:class:`_SeqColwise`), fc2 is :class:`_ActLinear` on
        its local shard, reduce-scattered, then fc2's replicated bias (its gradient summed over tp);
        same parameters and names."""

        _distmm_sp: SequenceSplit

        def forward(self, x: Tensor) -> Tensor:
            split = self._distmm_sp
            y = _ActLinear.apply(self.fc1(x), self.fc2.weight.to_local(), self.act)
            y = _ReduceScatter.apply(y, split)
            if self.fc2.bias is not None:
                bias = self.fc2.bias.to_local()
                if bias.requires_grad:
                    bias.register_hook(_sum_over(split.group))
                y = y + bias
            return self.drop2(y)

    return SequenceParallelMlp


def apply_sp(module: nn.Module, mesh: DeviceMesh, held: Callable[[nn.Module], bool] = lambda block: True) -> nn.Module:
    """Split a tensor-parallel ViT's (a CLIP text tower's: :mod:`.sequence_parallel_text`) residual
    stream along the sequence over the tp ``mesh`` (in place,
    after :func:`~lightning_distmm.parallel.tensor_parallel.apply_tp` with ``sp=True``), in the blocks
    ``held`` says this rank runs (its pipeline stage's); idempotent."""
    if getattr(module, "_distmm_sp", None) is not None:
        return module
    if not hasattr(module, "patch_embed"):  # a transformers CLIP-style text tower
        return apply_sp_text(module, mesh, held)
    group, tp = mesh.get_group(), mesh.size()
    split = SequenceSplit(group, tp, mesh.get_local_rank())
    split.length = module.patch_embed.num_patches + module.num_prefix_tokens  # type: ignore[union-attr,operator]
    module.norm_pre.register_forward_hook(_split_output(split, static=True))  # type: ignore[union-attr]
    module.norm.register_forward_hook(_gather_output(split))  # type: ignore[union-attr]
    for block in module.blocks:  # type: ignore[union-attr]
        if not held(block):
            continue  # another pipeline stage's block
        block.attn.__class__ = _vit_attention_class()
        block.attn._distmm_cp, block.attn._distmm_keys = None, split
        block.attn.qkv.gathered_linear = lambda x, w, b: _GatherLinear.apply(x, w, b, split)
        block.mlp.fc1 = _SeqColwise(block.mlp.fc1, mesh, split)
        if _fusable(block.mlp):  # fc2 keeps the activation's input only (else DTensor's RowwiseParallel runs it)
            block.mlp.__class__ = _sp_mlp_class(type(block.mlp))
            block.mlp._distmm_sp = split
    # the parameters TP leaves replicated get partial gradients: each module puts the tp sum on its
    # own before it runs (the tower's loose tensors, class token and position embedding, with patch_embed)
    for sub in module.modules():
        if sub is not module and any(True for _ in sub.parameters(recurse=False)):
            sub.register_forward_pre_hook(_sums_before_forward(group, [sub]))
    module.patch_embed.register_forward_pre_hook(_sums_before_forward(group, [module]))  # type: ignore[union-attr]
    module._distmm_sp = split  # type: ignore[assignment]
    return module


__all__ = ["apply_sp", "check_sp"]
