"""Activation memory accounting: the bytes autograd keeps for backward, live, and their peak.

Works on any device (CPU included, where allocator statistics are not available): every tensor
saved for backward inside the context is counted while the graph holds it, once per storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ActivationMeter:
    """Counts live saved-for-backward bytes; ``peak`` is their maximum since the last ``reset``."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._storages: dict[int, int] = {}

    def reset(self) -> None:
        self.peak = self.live

    @contextmanager
    def track(self) -> Iterator[ActivationMeter]:
        """Count what autograd saves inside this context until the graph lets it go."""
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(self, t), lambda saved: saved.tensor):
            yield self

    def _add(self, key: int, nbytes: int) -> None:
        count = self._storages.get(key, 0)
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._storages[key] = count + 1

    def _drop(self, key: int, nbytes: int) -> None:
        count = self._storages.get(key, 1) - 1
        if count <= 0:
            self._storages.pop(key, None)
            self.live -= nbytes
        else:
            self._storages[key] = count


class _Saved:
    """A saved tensor with a receipt: counted when saved, uncounted when autograd frees it."""

    __slots__ = ("meter", "tensor", "key", "nbytes")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor) -> None:
        self.meter, self.tensor, self.key, self.nbytes = meter, tensor, 0, 0
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter) or tensor.is_meta:
            return  # weights (and views of them) are not activations
        storage = tensor.untyped_storage()
        self.key, self.nbytes = storage.data_ptr(), storage.nbytes()
        meter._add(self.key, self.nbytes)

    def __del__(self) -> None:
        if self.key:
            self.meter._drop(self.key, self.nbytes)
