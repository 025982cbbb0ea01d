"""Tensor parallelism for the towers, applied from outside (torchtitan's ``parallelize`` style).

One function per tower family; the towers stay plain timm / transformers modules:

* :func:`apply_tp_vit` - timm ``VisionTransformer`` blocks: the fused ``attn.qkv`` is sharded so
  that each rank holds the q, k and v rows of its own heads (``_StridedShard(0, split_factor=3)``:
  a plain column shard would hand rank 0 all of q and half of k; its bias is replicated, each rank
  using its heads' rows), ``attn.proj`` row-wise,
  ``mlp.fc1`` column-wise, ``mlp.fc2`` row-wise; ``num_heads`` and ``attn_dim`` become local.
* :func:`apply_tp_clip_text` - transformers CLIP text (and BERT-like) layers: ``q/k/v_proj`` and
  ``fc1`` column-wise, ``out_proj`` and ``fc2`` row-wise (DTensor ``parallelize_module``).

Everything else (embeddings, norms, heads) stays replicated. Sharded parameters are DTensors, so
DCP checkpoints and ``full_tensor()`` see their global shapes.

The runtime applies it to each local tower whose plan has ``tp > 1``, after cutting pipeline
stages (a stage shards only its own blocks). Tested on its own (tests/test_tensor_parallel.py)
and in training (tests/test_equivalence.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement


def strided_shard(dim: int, split_factor: int) -> Placement:
    """torch's private ``_StridedShard(dim, split_factor)``: shard ``dim`` as ``split_factor`` interleaved
    blocks, each split evenly over the ranks (a fused qkv: each rank gets the q, k and v rows of its
    heads). No public placement describes this layout; it is what ``parallelize_module`` itself
    uses for nested sharding. The one private torch access under ``parallel/`` (which must not import
    the Lightning seam module); ``tests/test_lightning_seam.py`` checks it."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided(value: object) -> bool:
    """Whether ``value`` is a DTensor with a :func:`strided_shard` placement."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the partial input gradients of the tensor-parallel ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _HeadRows(torch.autograd.Function):
    """This rank's q, k and v rows of a whole fused qkv bias (``[q_r, k_r, v_r]``, the rows of its
    heads); backward puts their gradient back in place and sums it over the tensor-parallel ranks,
    each of which computed only its own rows."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, rank: int, tp: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.tp, ctx.group = rank, tp, group
        return bias.view(3, tp, -1)[:, rank].reshape(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        full = grad.new_zeros(3, ctx.tp, grad.numel() // 3)
        full[:, ctx.rank] = grad.view(3, -1)
        full = full.reshape(-1)
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=ctx.group)
        return full, None, None, None


class _FusedQKVColwise(nn.Module):
    """Runs a fused qkv Linear on this rank's heads; the parameters stay DTensors of the full layer.

    The weight is a head-aligned strided shard. The bias (``3 * dim`` numbers) is replicated over
    the tensor-parallel ranks, each using its heads' rows (:class:`_HeadRows`): a 1-D strided shard
    could only be sharded again by FSDP on the same dimension, and torch 2.14 reduce-scatters the
    gradient of that nested layout into the wrong rows (checked: a tp2 x fsdp2 bias gradient came
    back permuted, with rows lost). Replicated, FSDP shards it plainly on dim 0."""

    #: sequence parallelism: ``(x, weight, bias) -> linear(all_gather(x))`` on this rank's tokens ``x``
    gathered_linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh):
        super().__init__()
        placement = [strided_shard(0, split_factor=3)]
        self.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, placement))
        self.bias = (
            nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Replicate()]))
            if linear.bias is not None
            else None
        )
        self.group = mesh.get_group()
        self.tp, self.tp_rank = mesh.size(), mesh.get_local_rank()
        self.weight.requires_grad_(linear.weight.requires_grad)
        if self.bias is not None:
            self.bias.requires_grad_(linear.bias.requires_grad)  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None
        if self.bias is not None:
            bias = _HeadRows.apply(self.bias.to_local(), self.tp_rank, self.tp, self.group)
        if self.gathered_linear is not None:
            return self.gathered_linear(x, self.weight.to_local(), bias)
        x = _CopyToTensorParallel.apply(x, self.group)
        return F.linear(x, self.weight.to_local(), bias)


def _check_heads(heads: int, tp: int, where: str) -> None:
    if heads % tp:
        raise ValueError(f"{where}: {heads} attention heads do not divide by tp={tp}")


def _holds_all(block: nn.Module) -> bool:
    return not any(p.is_meta for p in block.parameters())


def apply_tp_vit(
    model: nn.Module, mesh: DeviceMesh, held: Callable[[nn.Module], bool] = _holds_all, sp: bool = False
) -> nn.Module:
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


def apply_tp_clip_text(
    model: nn.Module, mesh: DeviceMesh, held: Callable[[nn.Module], bool] = _holds_all, sp: bool = False
) -> nn.Module:
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


def _llama_layers(module: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of a transformers Llama / Qwen2-style causal LM (``...layers`` of modules with
    ``self_attn.q_proj`` and ``mlp.gate_proj``), or None."""
    for name, m in module.named_modules():
        if name.endswith("layers") and isinstance(m, nn.ModuleList) and len(m) > 0:
            first = m[0]
            if hasattr(first, "self_attn") and hasattr(first.self_attn, "q_proj") and hasattr(first, "mlp"):
                if hasattr(first.mlp, "gate_proj"):
                    return m
    return None


def apply_tp_llama(model: nn.Module, mesh: DeviceMesh, held: Callable[[nn.Module], bool] = _holds_all) -> nn.Module:
    """Shard the decoder layers of a Llama / Qwen2-style causal LM (Megatron's split: q/k/v and the gated
    MLP's gate/up column-wise, o and down row-wise); embeddings, norms and the LM head stay replicated.
    The attention reshapes by ``head_dim`` (``-1`` heads), so local heads need no attribute change;
    query and key/value heads must both divide by tp."""
    tp = mesh.size()
    layers = _llama_layers(model)
    assert layers is not None
    config = getattr(model, "config", None) or next(m.config for m in model.modules() if hasattr(m, "config"))
    _check_heads(config.num_attention_heads, tp, "self_attn (query heads)")
    _check_heads(
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads, tp, "self_attn (key/value heads)"
    )
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in layers:
        if held(layer):
            parallelize_module(layer, mesh, plan)
    return model


def _is_vit(module: nn.Module) -> bool:
    blocks = getattr(module, "blocks", None)
    return blocks is not None and all(hasattr(b, "attn") and hasattr(b.attn, "qkv") for b in blocks)


def _vit_of(module: nn.Module) -> nn.Module:
    """The timm ViT a tower is or holds (a VLM's vision tower: a ViT and a projector, which stays replicated)."""
    return next(m for m in module.modules() if _is_vit(m))


def _family(module: nn.Module) -> str:
    if any(_is_vit(m) for m in module.modules()):
        return "vit"
    if any(name.endswith("encoder.layers") for name, _ in module.named_modules()):
        return "clip_text"
    if _llama_layers(module) is not None:
        return "llama"
    raise ValueError(
        f"no tensor-parallel plan for a {type(module).__name__} tower: supported are timm VisionTransformer,"
        " transformers CLIP-style text encoders (modules with 'encoder.layers') and Llama / Qwen2-style causal"
        " LMs; use tp=1 for this tower"
    )


def check_tp(module: nn.Module, tp: int, tower: str) -> None:
    """Raise if ``module`` cannot be sharded ``tp`` ways; needs only the module's structure (meta is fine),
    so every rank can check every tower and a bad plan fails everywhere at once."""
    try:
        family = _family(module)
        if family == "vit":
            for i, block in enumerate(_vit_of(module).blocks):  # type: ignore[union-attr]
                _check_heads(block.attn.num_heads, tp, f"blocks.{i}.attn")
        elif family == "llama":
            config = next(m.config for m in module.modules() if hasattr(m, "config"))
            _check_heads(config.num_attention_heads, tp, "self_attn (query heads)")
            _check_heads(config.num_key_value_heads or config.num_attention_heads, tp, "self_attn (key/value heads)")
        else:
            layers = [m for name, m in module.named_modules() if name.endswith("encoder.layers")][0]
            for i, layer in enumerate(layers):
                _check_heads(layer.self_attn.num_heads, tp, f"encoder.layers.{i}.self_attn")
    except ValueError as err:
        raise ValueError(f"tower {tower!r}, tp={tp}: {err}") from None


def apply_tp(
    module: nn.Module, mesh: DeviceMesh, held: Callable[[nn.Module], bool] = _holds_all, sp: bool = False
) -> nn.Module:
    """Shard a tower by its family: a timm ViT (``blocks[*].attn.qkv``) or a text encoder with ``encoder.layers``;
    only the blocks ``held`` says this rank runs (by default those not released to the meta device;
    a tower built on meta to be materialised later says which by its pipeline stage).

    Idempotent: a second ``Trainer`` call in the same process (fit, then validate) finds the tower
    already sharded over this mesh.
    """
    if getattr(module, "_distmm_tp_mesh", None) is not None:
        if module._distmm_tp_mesh != mesh:  # type: ignore[comparison-overlap]
            raise ValueError("this tower is already sharded over another tensor-parallel mesh")
        return module
    family = _family(module)
    if family == "vit":
        apply_tp_vit(_vit_of(module), mesh, held, sp)
    elif family == "clip_text":
        apply_tp_clip_text(module, mesh, held, sp)
    elif sp:
        raise ValueError(
            f"sp: true is built for timm ViT and CLIP-style text towers; a {type(module).__name__} tower runs tp without it"
        )
    else:
        apply_tp_llama(module, mesh, held)
    module._distmm_tp_mesh = mesh  # type: ignore[assignment]
    return module


__all__ = [
    "apply_tp",
    "check_tp",
    "apply_tp_vit",
    "apply_tp_clip_text",
    "apply_tp_llama",
    "is_strided",
    "strided_shard",
]
