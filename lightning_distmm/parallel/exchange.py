"""Feature exchange between towers: the collective half of the batch-sync instruction.

``gather_features`` assembles every tower's features of the whole batch on every rank from the
replicas that computed them: each rank sends only the rows it owns, packed, padded to the largest
rank's payload (one ``all_gather`` per dtype carries all towers at once; :class:`GatherLayout`,
:func:`gather_bytes`). ``allreduce_sum`` adds
per-rank partial gradients of those features, so each replica can take its own rows of the
complete gradient and resume its backward. ``gather_features_async`` posts the gather and returns
a :class:`PendingGather` to wait for later (the asynchronous batch-sync: the same collective and
the same arithmetic, completed after the caller has run other work).

These are explicit steps rather than autograd functions on purpose: the order of collectives is
then the program order on every rank (no dependence on the autograd engine's scheduling), and the
pipeline executor can call the same steps between microbatches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.14 renamed all_gather_into_tensor and reduce_scatter_tensor (and deprecated the old names);
# older torch has only those
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class FeatureSpec:
    """The trailing shape and dtype of one tower's per-sample features."""

    tail: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.tail)


@dataclass(frozen=True)
class GatherSlot:
    """Where a tower's features come from: for replica ``i``, ``owners[i]`` holds rows ``offsets[i]:offsets[i+1]``."""

    owners: Sequence[int]
    offsets: Sequence[int]

    @property
    def max_rows(self) -> int:
        return max(b - a for a, b in zip(self.offsets[:-1], self.offsets[1:]))


def exchange_specs(
    local: Mapping[str, Tensor], names: Sequence[str], group: dist.ProcessGroup | None = None
) -> dict[str, FeatureSpec]:
    """Tell every rank of ``group`` the feature shape of every tower (each rank only computed its own towers)."""
    mine = {name: (tuple(t.shape[1:]), str(t.dtype).removeprefix("torch.")) for name, t in local.items()}
    everyone: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine, group=group)
    specs: dict[str, FeatureSpec] = {}
    for name in names:
        seen = {d[name] for d in everyone if name in d}
        if len(seen) != 1:
            raise RuntimeError(f"tower {name!r}: replicas produced features of different shapes/dtypes: {sorted(seen)}")
        tail, dtype = seen.pop()
        specs[name] = FeatureSpec(tuple(tail), getattr(torch, dtype))
    return specs


@dataclass(frozen=True)
class GatherLayout:
    """Where each replica's features sit in one dtype's all-gather: every rank sends only the rows it
    owns, packed (its towers in ``names`` order), padded to the largest rank's payload, the one
    size an ``all_gather`` needs. ``segments[(name, replica)]`` is ``(owner, start, length)`` in
    elements within the owner's chunk."""

    names: tuple[str, ...]
    chunk: int
    segments: Mapping[tuple[str, int], tuple[int, int, int]]

    @staticmethod
    def of(names: Sequence[str], slots: Mapping[str, GatherSlot], specs: Mapping[str, FeatureSpec]) -> GatherLayout:
        filled: dict[int, int] = {}
        segments: dict[tuple[str, int], tuple[int, int, int]] = {}
        for name in names:
            slot = slots[name]
            for i, (owner, a, b) in enumerate(zip(slot.owners, slot.offsets[:-1], slot.offsets[1:])):
                start = filled.get(owner, 0)
                length = (b - a) * specs[name].numel
                segments[(name, i)] = (owner, start, length)
                filled[owner] = start + length
        return GatherLayout(tuple(names), max(filled.values(), default=0), segments)

    def padded_chunk(self, slots: Mapping[str, GatherSlot], specs: Mapping[str, FeatureSpec]) -> int:
        """The chunk every rank sent before packing: a slot of every tower's largest replica."""
        return sum(slots[n].max_rows * specs[n].numel for n in self.names)


def gather_bytes(slots: Mapping[str, GatherSlot], specs: Mapping[str, FeatureSpec], world: int) -> tuple[int, int]:
    """Bytes one rank receives per feature gather, ``(packed, padded)``: what it receives now (every
    rank's own rows, padded to the largest payload) and what it received with a slot of every tower
    from every rank."""
    packed = padded = 0
    for dtype, names in _by_dtype(slots, specs).items():
        layout = GatherLayout.of(names, slots, specs)
        size = torch.empty((), dtype=dtype).element_size()
        packed += world * layout.chunk * size
        padded += world * layout.padded_chunk(slots, specs) * size
    return packed, padded


def _by_dtype(slots: Mapping[str, GatherSlot], specs: Mapping[str, FeatureSpec]) -> dict[torch.dtype, list[str]]:
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in slots:
        by_dtype.setdefault(specs[name].dtype, []).append(name)
    return by_dtype


@dataclass
class PendingGather:
    """A posted feature gather (:func:`gather_features_async`): :meth:`wait` completes it and returns
    the whole-batch features of every tower, exactly what :func:`gather_features` returns."""

    #: per dtype: (work, send buffer kept alive while in flight, receive buffer, its layout)
    works: list[tuple[Any, Tensor, Tensor, GatherLayout]]
    slots: Mapping[str, GatherSlot]
    specs: Mapping[str, FeatureSpec]
    row_of: dict[int, int]

    def wait(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for work, _send, recv, layout in self.works:
            work.wait()
            view = recv.view(len(self.row_of), -1)
            for name in layout.names:
                slot, spec = self.slots[name], self.specs[name]
                parts = []
                for i, (a, b) in enumerate(zip(slot.offsets[:-1], slot.offsets[1:])):
                    owner, start, length = layout.segments[(name, i)]
                    parts.append(view[self.row_of[owner], start : start + length].view(b - a, *spec.tail))
                out[name] = torch.cat(parts)
        self.works = []
        return out


def gather_features_async(
    local: Mapping[str, Tensor],
    slots: Mapping[str, GatherSlot],
    specs: Mapping[str, FeatureSpec],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> PendingGather:
    """Post the gather of :func:`gather_features` (one ``all_gather`` per dtype, ``async_op=True``) and
    return without waiting: the caller computes beside it and calls :meth:`PendingGather.wait`."""
    rank, world = dist.get_rank(), dist.get_world_size(group)
    members = dist.get_process_group_ranks(group) if group is not None else range(world)
    row_of = {r: i for i, r in enumerate(members)}  # a global rank's row in the gathered tensor
    works = []
    for dtype, names in _by_dtype(slots, specs).items():
        layout = GatherLayout.of(names, slots, specs)
        send = torch.zeros(max(layout.chunk, 1), dtype=dtype, device=device)
        for name in names:
            if name not in local:
                continue
            for i, owner in enumerate(slots[name].owners):
                if owner == rank:
                    _, start, length = layout.segments[(name, i)]
                    send[start : start + length] = local[name].detach().reshape(-1)
        recv = torch.empty(world * send.numel(), dtype=dtype, device=device)
        work = all_gather_single(recv, send, group=group, async_op=True)
        works.append((work, send, recv, layout))
    return PendingGather(works, slots, specs, row_of)


def gather_features(
    local: Mapping[str, Tensor],
    slots: Mapping[str, GatherSlot],
    specs: Mapping[str, FeatureSpec],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Tensor]:
    """Whole-batch features of every tower on every rank of ``group`` (detached; no autograd across ranks).

    ``slots`` name owners by global rank; the gather runs over ``group`` (the last stages).
    """
    return gather_features_async(local, slots, specs, device, group).wait()


@dataclass
class PendingSum:
    """Posted in-place sums (``allreduce_sum_async``): :meth:`wait` completes them and writes back."""

    works: list[tuple[object, Tensor, list[Tensor]]]  # (work, flat buffer or the tensor itself, tensors)

    def wait(self) -> None:
        for work, flat, same in self.works:
            work.wait()  # type: ignore[attr-defined]
            if len(same) == 1 and flat is same[0]:
                continue
            start = 0
            for t in same:
                t.copy_(flat[start : start + t.numel()].view_as(t))
                start += t.numel()
        self.works = []


def allreduce_sum_async(tensors: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> PendingSum:
    """Post the in-place sum over ``group`` of several tensors, one collective per dtype (flattened)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    works = []
    for same in by_dtype.values():
        flat = same[0] if len(same) == 1 else torch.cat([t.reshape(-1) for t in same])
        works.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), flat, same))
    return PendingSum(works)


def allreduce_sum(tensors: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """In-place sum over ``group`` of several tensors with one collective per dtype (flatten, reduce, copy back)."""
    allreduce_sum_async(tensors, group).wait()


def host_any(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``flag`` is true on any rank of ``group``, a group of CPU collectives
    (:func:`~lightning_distmm.parallel.groups.host_group`).

    The count travels in host memory and is read through ``numpy()``, which refuses a device
    tensor: this exchange waits for the other ranks' hosts, never for a device.
    """
    count = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(count, group=group)
    return bool(count.numpy()[0] > 0)
