"""The autograd pieces of sequence parallelism (the families' files use them:
:mod:`.families.vit` for timm ViTs, :mod:`.families.clip_text` for CLIP-style text towers): a linear on the gathered tokens that
keeps only this rank's, a linear on an activation that keeps only the activation's input, the
reduce-scatter back to this rank's tokens, and the tp sums of the replicated parameters' gradients."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_distmm.parallel.context_parallel import SequenceSplit, gather_tokens, scatter_tokens


class _GatherLinear(torch.autograd.Function):
    """``linear(all_gather(x), weight, bias)`` keeping only this rank's tokens ``x`` for backward, which
    gathers them again (Megatron-LM's choice: the gathered input would be ``tp`` times the chunk); the
    input gradient is reduce-scattered back to the chunks."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, split: SequenceSplit) -> Tensor:
        ctx.split, ctx.bias = split, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(gather_tokens(x, split), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gw = gb = None
        if ctx.needs_input_grad[1]:
            full = gather_tokens(x, ctx.split)
            gw = g2.t() @ full.reshape(-1, full.shape[-1])
        if ctx.bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return scatter_tokens(grad @ weight, ctx.split), gw, gb, None


class _ActLinear(torch.autograd.Function):
    """``linear(act(h), weight)`` keeping ``h`` (the activation's input) and not ``act(h)``: backward
    recomputes the activation (elementwise, cheap) for the weight gradient and the activation's own
    backward. ``h`` is ``[B, S, M/tp]``; the output is this rank's partial sum ``[B, S, D]``."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, act: nn.Module) -> Tensor:
        ctx.act = act
        ctx.save_for_backward(h, weight)
        return F.linear(act(h), weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, None]:
        h, weight = ctx.saved_tensors
        with torch.enable_grad():
            leaf = h.detach().requires_grad_(True)
            g = ctx.act(leaf)
        gw = None
        if ctx.needs_input_grad[1]:
            gw = grad.reshape(-1, grad.shape[-1]).t() @ g.detach().reshape(-1, g.shape[-1])
        (gh,) = torch.autograd.grad(g, leaf, grad @ weight)
        return gh, gw, None


class _ReduceScatter(torch.autograd.Function):
    """Sum ``[B, S, D]`` partial outputs over the tp ranks, keep this rank's tokens; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, split: SequenceSplit) -> Tensor:
        ctx.split = split
        return scatter_tokens(x, split)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return gather_tokens(grad, ctx.split), None


def _sum_over(group: dist.ProcessGroup) -> Any:
    """A gradient hook that sums the gradient over ``group``, in a copy of its own: the tensor autograd
    hands the hook may be a view of a gradient that still flows elsewhere (a class token's gradient
    at batch 1 is a slice of the concatenation's, which the patch embedding's backward reads next),
    so an in-place sum on it would add the other ranks' share to that gradient too."""

    def hook(grad: Tensor) -> Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return grad

    return hook


def _sums_before_forward(group: dist.ProcessGroup, owners: list[nn.Module]) -> Any:
    """A forward pre-hook that puts the tp sum on each replicated parameter of ``owners`` (their own, not
    their children's) that lacks it. At forward time, not once at preparation: a tower built on the
    meta device gets new Parameter objects when it is materialised, after this module prepared it."""

    def hook(module: nn.Module, args: Any) -> None:
        for owner in owners:
            for p in owner.parameters(recurse=False):
                if p.requires_grad and not p.is_meta and not isinstance(p, DTensor) and not hasattr(p, "_distmm_sp"):
                    p.register_hook(_sum_over(group))
                    p._distmm_sp = True  # type: ignore[attr-defined]

    return hook
