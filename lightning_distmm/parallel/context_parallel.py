"""Context parallelism for the towers: each row's tokens split over the ``cp`` ranks of a replica.

Applied from outside, like tensor parallelism; the towers stay plain timm / transformers modules
(same parameter names, same state dict). The scheme is DeepSpeed-Ulysses:

* **split**: right after the embeddings (timm ViT: the output of ``norm_pre``, after the patch and
  position embedding and the class / register tokens; transformers CLIP text: the input of the
  first encoder layer) the ``[B, S, D]`` tokens are padded to a multiple of ``cp`` and rank ``r``
  keeps tokens ``[r*S/cp, (r+1)*S/cp)``. Everything per token (norms, MLPs, residuals, dropout)
  then runs on the local chunk only.
* **attention**: q, k, v are projected on the local tokens, then one all-to-all turns
  ``[B, S/cp, H, d]`` (every head, some tokens) into ``[B, S, H/cp, d]`` (some heads, every token);
  attention is computed exactly per head over the whole sequence (padded keys masked; the text
  tower's causal and padding masks are the whole-sequence masks the model builds anyway), and a
  second all-to-all returns ``[B, S/cp, H, d]`` before the output projection. Needs the (local)
  head count to divide by ``cp``; the sequence is padded, so any length works.
* **gather**: after the final norm the chunks are all-gathered (padding dropped), so pooling (class
  token, mean, EOS) and the head see the whole sequence; its backward reduce-scatters.

Gradients. The cp ranks of a replica run the post-gather part (pooling, head) on the same input,
so the feature gradient each of them backpropagates is scaled by ``1 / cp``
(:func:`feature_grad_scale`): the head's gradients then sum to the true one over the cp ranks, and
the gather's reduce-scatter gives each chunk exactly its gradient. Every parameter's gradient is a
partial sum over this rank's tokens; the runtime sums it over the replicas and cp ranks together
(``TowerGroups.sum_mesh``), in the same buckets as data parallelism.

Why Ulysses and not ring attention, and what it needs: docs/runtime.md, "Sequence and context
parallelism" (heads divisible by ``cp * tp``; any length, padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_distmm.parallel.exchange import all_gather_single, reduce_scatter_single


@dataclass
class SequenceSplit:
    """One tower's split on this rank: the cp group, this rank's chunk, the true sequence length."""

    group: dist.ProcessGroup
    cp: int
    rank: int
    #: tokens before padding: fixed for a ViT, set by the split of each forward for a text tower (a
    #: pipelined one's later stages: by the stage, :func:`tell_length`)
    length: int | None = None
    #: the tower's name in the plan (for messages)
    tower: str = ""

    def padded(self, length: int) -> int:
        return -(-length // self.cp) * self.cp

    def key_mask(self, padded: int, device: torch.device) -> Tensor | None:
        """``[1, 1, 1, padded]`` bools, True for real keys (None when nothing is padded)."""
        assert self.length is not None
        if padded == self.length:
            return None
        return (torch.arange(padded, device=device) < self.length)[None, None, None]


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``x[j]`` goes to rank ``j``; ``out[i]`` came from rank ``i`` (dim 0 has the group's size)."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: Tensor, cp: int, group: dist.ProcessGroup) -> Tensor:
    """``[B, s, G, H, d]`` (local tokens, every head) -> ``[B, cp*s, G, H/cp, d]`` (every token, own heads)."""
    b, s, g, h, d = x.shape
    send = x.reshape(b, s, g, cp, h // cp, d).permute(3, 0, 1, 2, 4, 5)  # [dest, B, s, G, h/cp, d]
    got = _all_to_all(send, group)  # [source chunk, B, s, G, h/cp, d]
    return got.permute(1, 0, 2, 3, 4, 5).reshape(b, cp * s, g, h // cp, d)


def _heads_to_seq(x: Tensor, cp: int, group: dist.ProcessGroup) -> Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    b, n, g, h, d = x.shape
    send = x.reshape(b, cp, n // cp, g, h, d).permute(1, 0, 2, 3, 4, 5)  # [dest chunk, B, s, G, h, d]
    got = _all_to_all(send, group)  # [source head group, B, s, G, h, d]
    return got.permute(1, 2, 3, 0, 4, 5).reshape(b, n // cp, g, cp * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: int, group: dist.ProcessGroup) -> Tensor:
        ctx.cp, ctx.group = cp, group
        return _seq_to_heads(x, cp, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _heads_to_seq(grad, ctx.cp, ctx.group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: int, group: dist.ProcessGroup) -> Tensor:
        ctx.cp, ctx.group = cp, group
        return _heads_to_seq(x, cp, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _seq_to_heads(grad, ctx.cp, ctx.group), None, None


class _Split(torch.autograd.Function):
    """Pad ``[B, S, D]`` to a multiple of cp and keep this rank's chunk; backward puts its gradient in place."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, split: SequenceSplit) -> Tensor:
        ctx.shape = x.shape
        padded = split.padded(x.shape[1])
        ctx.chunk = chunk = padded // split.cp
        x = F.pad(x, (0, 0, 0, padded - x.shape[1])) if padded != x.shape[1] else x
        ctx.start = split.rank * chunk
        return x[:, ctx.start : ctx.start + chunk].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        full = grad.new_zeros(ctx.shape[0], max(ctx.shape[1], ctx.start + ctx.chunk), *ctx.shape[2:])
        full[:, ctx.start : ctx.start + ctx.chunk] = grad
        return full[:, : ctx.shape[1]], None


def gather_tokens(x: Tensor, split: SequenceSplit) -> Tensor:
    """All-gather every rank's ``[B, s, ...]`` chunk into ``[B, cp*s, ...]`` (padding kept)."""
    out = x.new_empty(split.cp * x.shape[0], *x.shape[1:])
    all_gather_single(out, x.contiguous(), group=split.group)
    return out.view(split.cp, *x.shape).transpose(0, 1).reshape(x.shape[0], split.cp * x.shape[1], *x.shape[2:])


def scatter_tokens(grad: Tensor, split: SequenceSplit) -> Tensor:
    """The backward of :func:`gather_tokens`: sum ``[B, cp*s, ...]`` over the ranks, keep this rank's chunk."""
    b, n = grad.shape[:2]
    s = n // split.cp
    send = grad.reshape(b, split.cp, s, *grad.shape[2:]).transpose(0, 1).reshape(split.cp * b, s, *grad.shape[2:])
    out = grad.new_empty(b, s, *grad.shape[2:])
    reduce_scatter_single(out, send.contiguous(), op=dist.ReduceOp.SUM, group=split.group)
    return out


class _Gather(torch.autograd.Function):
    """All-gather the chunks into ``[B, S, D]`` (padding dropped); backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, split: SequenceSplit) -> Tensor:
        ctx.split, ctx.shape = split, x.shape
        assert split.length is not None
        return gather_tokens(x, split)[:, : split.length]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        split, (b, s) = ctx.split, ctx.shape[:2]
        padded = grad.new_zeros(b, split.cp * s, *grad.shape[2:])
        padded[:, : grad.shape[1]] = grad
        return scatter_tokens(padded, split), None


def head_copies(cp: int, tp: int, sp: bool) -> int:
    """How many ranks of a stage run a tower's head on the same gathered tokens and sum its gradients:
    the cp ranks, times the tp ranks under sequence parallelism."""
    return cp * (tp if sp else 1)


def feature_grad_scale(grad: Tensor | None, copies: int) -> Tensor | None:
    """The feature gradient each of ``copies`` ranks (:func:`head_copies`) backpropagates: ``1 / copies``
    of it (see the module's docstring)."""
    return grad if copies == 1 or grad is None else grad / copies


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, dropout: float, scale: float | None) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale)


def _text_mask(mask: Tensor | None, causal: bool, split: SequenceSplit, padded: int, device: torch.device) -> Tensor:
    """The whole-sequence mask the model built (``[B, 1, S, S]``, bools or additive floats; None:
    causal only), as bools over the padded length, padded keys masked."""
    length = split.length
    assert length is not None
    if mask is None:
        allowed = torch.ones(length, length, dtype=torch.bool, device=device)
        allowed = torch.tril(allowed) if causal else allowed
        allowed = allowed[None, None]
    else:
        allowed = mask if mask.dtype == torch.bool else mask == 0
        if causal and mask.shape[-1] == length:
            allowed = allowed & torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))
    if padded == length:
        return allowed
    out = torch.zeros(*allowed.shape[:2], padded, padded, dtype=torch.bool, device=device)
    out[..., :length, :length] = allowed
    out[..., length:, 0] = True  # padded queries (dropped later) attend to one real key: no empty row
    return out


def _split_output(split: SequenceSplit, static: bool) -> Any:
    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        if static and output.shape[1] != split.length:
            raise ValueError(
                f"context parallelism: the ViT produced {output.shape[1]} tokens, not the {split.length} its"
                " patch grid and prefix tokens give (dynamic image sizes and patch dropout are not supported)"
            )
        split.length = output.shape[1]
        return _Split.apply(output, split)

    return hook


def _split_first_input(split: SequenceSplit) -> Any:
    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = args[0] if args else kwargs["hidden_states"]
        split.length = x.shape[1]
        if args:
            return (_Split.apply(x, split), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _Split.apply(x, split)}

    return hook


def tell_length(layers: Any, length: int) -> None:
    """Give the cp / sp split of these text layers the whole sequence's length (a pipelined tower's
    later stage receives padded chunks; ``clip_text_stages`` reads the length from the batch rows)."""
    for layer in layers:
        for split in (getattr(layer.self_attn, "_distmm_cp", None), getattr(layer.self_attn, "_distmm_sp", None)):
            if isinstance(split, SequenceSplit):
                split.length = length


def _gather_output(split: SequenceSplit) -> Any:
    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        return _Gather.apply(output, split)

    return hook


__all__ = ["SequenceSplit", "feature_grad_scale", "gather_tokens", "head_copies", "scatter_tokens", "tell_length"]
