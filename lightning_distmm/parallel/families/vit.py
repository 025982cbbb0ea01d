"""What makes a timm ``VisionTransformer`` parallel: its tensor-parallel split, sequence and
context parallelism, and its pipeline cut (a tower that holds a ViT, as a VLM's vision tower holds a
ViT and a projector, gets the ViT's tensor-parallel split; the other techniques need the tower to be
the ViT).

**Tensor parallelism.** The fused ``attn.qkv`` is sharded so that each rank holds the q, k and v
rows of its own heads (``_StridedShard(0, split_factor=3)``: a plain column shard would hand rank 0
all of q and half of k; its bias is replicated, each rank using its heads' rows), ``attn.proj``
row-wise, ``mlp.fc1`` column-wise, ``mlp.fc2`` row-wise; ``num_heads`` and ``attn_dim`` become local.

**Sequence parallelism** with tensor parallelism (Megatron-LM's scheme, ``sp: true``).

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
(:func:`apply_tp_vit` with ``sp``; ``mlp.fc2``'s sharded
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

**Context parallelism** (Ulysses): the tokens after ``norm_pre`` are split over the cp ranks and
gathered after ``norm``; each attention runs all-to-alls around itself (every token, its own heads).

**Pipeline stages**: stage 0 holds the patch embedding, tokens and position embedding; the blocks
are split evenly (equal blocks cost the same); the last stage holds the final norm and the head.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_distmm.parallel.context_parallel import (
    SequenceSplit,
    _attend,
    _gather_output,
    _HeadsToSeq,
    _SeqToHeads,
    _split_output,
)
from lightning_distmm.parallel.families.registry import Family, Held, holds_all, register
from lightning_distmm.parallel.pipeline import Stage, cut_into_stages
from lightning_distmm.parallel.sp_ops import _ActLinear, _GatherLinear, _ReduceScatter, _sum_over, _sums_before_forward
from lightning_distmm.parallel.tensor_parallel import _check_heads, _FusedQKVColwise


def _is_vit(module: nn.Module) -> bool:
    blocks = getattr(module, "blocks", None)
    return blocks is not None and all(hasattr(b, "attn") and hasattr(b.attn, "qkv") for b in blocks)


def _vit_of(module: nn.Module) -> nn.Module:
    """The timm ViT a tower is or holds (a VLM's vision tower: a ViT and a projector, which stays replicated)."""
    return next(m for m in module.modules() if _is_vit(m))


def _is_the_vit(module: nn.Module, what: str) -> None:
    """Raise unless ``module`` itself is a timm ViT (sequence / context parallelism and the pipeline
    cut hook its own ``norm_pre`` and ``norm``)."""
    if not (hasattr(module, "patch_embed") and hasattr(module, "norm_pre") and hasattr(module, "blocks")):
        raise ValueError(
            f"{what} is built for a tower that is a timm VisionTransformer; this {type(module).__name__} tower"
            " holds one inside"
        )


def _static_tokens(module: nn.Module) -> None:
    if getattr(module, "dynamic_img_size", False) or not isinstance(module.patch_drop, nn.Identity):
        raise ValueError("dynamic image sizes and patch dropout change the sequence length per batch")


# ---------------------------------------------------------------------- tensor parallelism
def apply_tp_vit(model: nn.Module, mesh: DeviceMesh, held: Held = holds_all, sp: bool = False) -> nn.Module:
    """Shard a timm VisionTransformer's blocks over the 1-D tensor-parallel ``mesh`` (in place); only the
    blocks ``held`` says this rank runs (another pipeline stage's blocks are left alone). ``sp``: the
    blocks' inputs and outputs are this rank's tokens (sequence parallelism, Megatron-LM): ``attn.proj``
    and ``mlp.fc2`` reduce-scatter instead of all-reducing; ``mlp.fc1`` and the qkv's gathers are
    installed by :func:`lightning_distmm.parallel.sequence_parallel.apply_sp`, which must follow)."""
    tp = mesh.size()
    tokens = Shard(1)
    styles = (
        {
            "attn.proj": RowwiseParallel(output_layouts=tokens),
            "mlp.fc2": RowwiseParallel(output_layouts=tokens),  # mlp.fc1: apply_sp gathers its input itself
        }
        if sp
        else {"attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    )
    for i, block in enumerate(model.blocks):  # type: ignore[union-attr]
        attn = block.attn
        _check_heads(attn.num_heads, tp, f"blocks.{i}.attn")
        if not held(block):
            continue  # another pipeline stage's block
        if not isinstance(attn.norm, nn.Identity) or getattr(attn, "gate", None) is not None:
            raise ValueError(f"blocks.{i}.attn: scale-norm / gated attention mixes heads and cannot be sharded by head")
        attn.qkv = _FusedQKVColwise(attn.qkv, mesh)
        attn.num_heads //= tp
        attn.attn_dim //= tp
        parallelize_module(block, mesh, styles)
    return model


def check_tp_vit(module: nn.Module, tp: int) -> None:
    for i, block in enumerate(_vit_of(module).blocks):  # type: ignore[union-attr]
        _check_heads(block.attn.num_heads, tp, f"blocks.{i}.attn")


# ---------------------------------------------------------------------- sequence parallelism
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


def check_sp_vit(module: nn.Module) -> None:
    _is_the_vit(module, "sequence parallelism")
    _static_tokens(module)


def apply_sp_vit(module: nn.Module, mesh: DeviceMesh, held: Held) -> None:
    """Split a tensor-parallel ViT's residual stream along the sequence over the tp ``mesh`` (in place,
    after :func:`apply_tp_vit` with ``sp=True``), in the blocks ``held`` says this rank runs."""
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


# ---------------------------------------------------------------------- context parallelism
@functools.cache
def _vit_attention_class() -> type[nn.Module]:
    from timm.models.vision_transformer import Attention

    class ContextParallelAttention(Attention):
        """timm's ``Attention`` with Ulysses all-to-alls around the attention (``_distmm_cp``), padded
        keys masked (``_distmm_keys``: the split that padded them, cp or sp); same parameters."""

        _distmm_cp: SequenceSplit | None = None
        _distmm_keys: SequenceSplit

        def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
            if attn_mask is not None or is_causal:
                raise ValueError("context parallelism of a timm ViT supports no attention mask or causal ViT")
            split = self._distmm_cp
            b = x.shape[0]
            gate = self.gate(x).sigmoid() if self.gate is not None else None
            qkv = self.qkv(x)  # sp: the qkv gathers the tokens, so its output has all of them
            qkv = qkv.reshape(b, qkv.shape[1], 3, self.num_heads, self.head_dim)
            if split is not None:
                qkv = _SeqToHeads.apply(qkv, split.cp, split.group)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, heads here, S, d]
            q, k = self.q_norm(q), self.k_norm(k)
            allowed = self._distmm_keys.key_mask(q.shape[2], q.device)
            out = _attend(q, k, v, allowed, self.attn_drop.p if self.training else 0.0, None)
            out = out.transpose(1, 2).unsqueeze(2)  # [B, S, 1, heads here, d]
            if split is not None:
                out = _HeadsToSeq.apply(out, split.cp, split.group)  # [B, S/cp, 1, H, d]
            x = self.norm(out.reshape(b, out.shape[1], -1))
            if gate is not None:
                x = x * gate
            return self.proj_drop(self.proj(x))

    return ContextParallelAttention


def cp_heads_vit(module: nn.Module) -> list[tuple[str, int]]:
    _is_the_vit(module, "context parallelism")
    return [(f"blocks.{i}.attn", b.attn.num_heads) for i, b in enumerate(module.blocks)]  # type: ignore[union-attr]


def check_cp_vit(module: nn.Module) -> None:
    from timm.models.vision_transformer import Attention

    odd = [i for i, b in enumerate(module.blocks) if type(b.attn) not in (Attention, _vit_attention_class())]  # type: ignore[union-attr]
    if odd:
        raise ValueError(f"blocks {odd} use an attention other than timm's Attention")
    _static_tokens(module)


def apply_cp_vit(module: nn.Module, split: SequenceSplit) -> None:
    """The tokens after ``norm_pre`` split, gathered after ``norm``; every attention Ulysses'."""
    split.length = module.patch_embed.num_patches + module.num_prefix_tokens  # type: ignore[union-attr,operator]
    module.norm_pre.register_forward_hook(_split_output(split, static=True))  # type: ignore[union-attr]
    module.norm.register_forward_hook(_gather_output(split))  # type: ignore[union-attr]
    for block in module.blocks:  # type: ignore[union-attr]
        block.attn.__class__ = _vit_attention_class()
        block.attn._distmm_cp = block.attn._distmm_keys = split


# ---------------------------------------------------------------------- pipeline stages
def vit_stages(model: nn.Module, pp: int, fields: tuple[str, ...]) -> list[Stage]:
    """The ``pp`` stages of a timm ViT (see the module docstring)."""
    if not (hasattr(model, "patch_embed") and hasattr(model, "forward_head")):
        raise ValueError(
            f"no pipeline cut for a {type(model).__name__} tower: timm VisionTransformer is supported, or give the"
            " tower a pipeline_stages(pp) method returning lightning_distmm.parallel.pipeline.Stage objects; use pp=1"
        )
    blocks = model.blocks  # type: ignore[union-attr]
    head = [model.norm, model.fc_norm, model.head]
    if getattr(model, "attn_pool", None) is not None:
        head.append(model.attn_pool)
    cuts = cut_into_stages(
        blocks,  # type: ignore[arg-type]
        pp,
        f"a ViT with {len(blocks)} blocks cannot be cut into pp={pp} stages",
        on_first=[model.patch_embed, model.norm_pre],  # type: ignore[list-item]
        on_last=head,  # type: ignore[arg-type]
    )
    stages = []
    for a, b, first, last, own in cuts:

        def run(
            x: Tensor | None, rows: Mapping[str, Any], a: int = a, b: int = b, first: bool = first, last: bool = last
        ) -> Tensor:
            if first:
                x = model.patch_embed(rows[fields[0]])  # type: ignore[operator]
                x = model._pos_embed(x)  # type: ignore[operator]
                x = model.patch_drop(x)  # type: ignore[operator]
                x = model.norm_pre(x)  # type: ignore[operator]
            for block in blocks[a:b]:
                x = block(x)
            if last:
                x = model.norm(x)  # type: ignore[operator]
                x = model.forward_head(x)  # type: ignore[operator]
            return x  # type: ignore[return-value]

        loose = tuple(
            n for n in ("cls_token", "reg_token", "pos_embed") if first and getattr(model, n, None) is not None
        )
        stages.append(Stage(own, run, loose))
    return stages


VIT = register(
    Family(
        name="vit",
        what="timm VisionTransformer",
        matches=lambda module: any(_is_vit(m) for m in module.modules()),
        check_tp=check_tp_vit,
        apply_tp=lambda module, mesh, held, sp: apply_tp_vit(_vit_of(module), mesh, held, sp),
        check_sp=check_sp_vit,
        apply_sp=apply_sp_vit,
        cp_heads=cp_heads_vit,
        check_cp=check_cp_vit,
        apply_cp=apply_cp_vit,
        stages=vit_stages,
    )
)

__all__ = ["VIT", "apply_tp_vit", "vit_stages"]
