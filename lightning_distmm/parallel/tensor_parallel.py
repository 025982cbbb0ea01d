"""Tensor parallelism's shared pieces, applied from outside the towers (torchtitan's ``parallelize``
style): the strided shard of a fused q|k|v weight (each rank the q, k and v rows of its own heads),
the fused-qkv column-parallel linear, the copy into a tensor-parallel region, the head-count check.
Each model family's split, which linears are column- and which row-parallel, is in its own file
(:mod:`lightning_distmm.parallel.families`); ``families.apply_tp`` finds a tower's family.

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
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
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


__all__ = ["is_strided", "strided_shard"]
