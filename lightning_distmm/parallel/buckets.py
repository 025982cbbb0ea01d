"""DDP's reducer for one tower: gradients in fixed buckets whose sums are posted during the backward
as soon as each bucket's gradients are final, on buffers the gradients are views of."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_distmm.parallel.exchange import PendingSum, allreduce_sum_async


def local(t: Tensor) -> Tensor:
    """The tensor this rank stores: a DTensor's local shard (collectives and in-place ops act on it).

    ``DTensor.to_local()`` returns the local shard itself, or a view of it when autograd is on:
    in-place ops and collectives on it write the DTensor's storage either way.
    """
    return t.to_local() if isinstance(t, DTensor) else t


#: the first bucket's cap (DDP's ``dist._DEFAULT_FIRST_BUCKET_BYTES``): the last layers' sum starts early
FIRST_BUCKET_BYTES = 2**20


class GradientBuckets:
    """DDP's reducer, for one tower: the parameters in fixed buckets (reverse order: the last layers'
    gradients are final first), the first of up to ``first_cap`` bytes and the others of up to
    ``cap`` (DDP's 1 MiB first bucket, so that a sum starts early in the backward); a bucket's sum over
    ``group`` is posted once all its gradients are final, buckets in order, so every replica posts the
    same sequence.

    As DDP's ``gradient_as_bucket_view``: a bucket of plain tensors of one dtype and device owns one
    flat buffer, and :meth:`attach` makes each parameter's ``.grad`` a view of it before the step's
    backwards, so autograd accumulates into the buffer and the sum runs on it in place (no copy into a
    concatenated buffer that lives until the end of the backward, no copy back). Buckets of DTensors
    (tensor-parallel towers) are concatenated when posted. Built once per tower; :meth:`arm` before
    the tower's last backward of a step, :meth:`finish` after it posts what the backward did not reach.
    """

    def __init__(
        self, params: list[nn.Parameter], group: dist.ProcessGroup | None, cap: int, first_cap: int | None = None
    ):
        self.group = group
        self.buckets: list[list[nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            nbytes = local(p).numel() * local(p).element_size()
            limit = cap if len(self.buckets) > 1 or first_cap is None else min(cap, first_cap)
            if not self.buckets or (size + nbytes > limit and self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {id(q): i for i, b in enumerate(self.buckets) for q in b}
        #: per bucket, its flat buffer (None: concatenated when posted)
        self.flat: list[Tensor | None] = [None] * len(self.buckets)
        for i, bucket in enumerate(self.buckets):
            kinds = {(p.dtype, p.device) for p in bucket}
            if len(kinds) == 1 and not any(isinstance(p, DTensor) for p in bucket):
                dtype, device = kinds.pop()
                self.flat[i] = torch.empty(sum(p.numel() for p in bucket), dtype=dtype, device=device)
        self.pending: list[int] = []
        self.next = 0
        self.posted: list[PendingSum] = []
        self.hooks: list[Any] = []

    def attach(self) -> None:
        """Zero the flat buffers and make every bucketed parameter's ``.grad`` a view of its bucket's
        (before the step's first backward of the tower, while ``.grad`` is empty)."""
        for bucket, flat in zip(self.buckets, self.flat):
            if flat is None:
                continue
            flat.zero_()
            start = 0
            for p in bucket:
                assert p.grad is None, "bucket views are attached while the gradients are set aside"
                p.grad = flat[start : start + p.numel()].view_as(p)
                start += p.numel()

    def arm(self) -> GradientBuckets:
        """Post each bucket's sum as soon as its gradients are final in the coming backward."""
        self.pending = [len(b) for b in self.buckets]
        self.next = 0
        self.posted = []
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_ready) for b in self.buckets for p in b]
        return self

    def _on_ready(self, p: Tensor) -> None:
        self.pending[self.bucket_of[id(p)]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] <= 0:
            self._post()

    def _post(self) -> None:
        flat = self.flat[self.next]
        if flat is not None and all(_views(p.grad, flat) for p in self.buckets[self.next]):
            self.posted.append(allreduce_sum_async([flat], self.group))
        else:
            grads = []
            for p in self.buckets[self.next]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local(p.grad))
            self.posted.append(allreduce_sum_async(grads, self.group))
        self.next += 1

    def finish(self) -> list[PendingSum]:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        while self.next < len(self.buckets):
            self._post()
        return self.posted


def _views(g: Tensor | None, flat: Tensor) -> bool:
    """Whether the gradient ``g`` is a view of the bucket buffer ``flat`` (autograd accumulated into it)."""
    return g is not None and g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
