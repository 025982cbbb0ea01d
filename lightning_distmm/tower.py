"""``Tower``: one encoder of a contrastive model and the batch field(s) it reads; the two small
protocols through which the module and the runtime meet.

The unit every layer above the plan talks about: the user names towers in
:meth:`lightning_distmm.DistMMMixin.towers`, the runtime runs them, the planner prices them.
:class:`TowerModule` is what the runtime needs of the user's module, :class:`TowerRunner` what
the module needs of whatever runs its towers across ranks; both live here, below the runtime
and the mixin, so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn


@dataclass(eq=False)
class Tower:
    """An encoder and the batch field(s) it reads.

    Args:
        module: the encoder, a plain ``nn.Module`` attribute of the LightningModule (timm,
            transformers, anything); parallel code wraps it from outside.
        input: the batch field passed positionally, or several fields passed in order.
        frozen: a frozen tower (LiT) is run without gradients and has no optimizer state.
    """

    module: nn.Module
    input: str | Sequence[str]
    frozen: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.input,) if isinstance(self.input, str) else tuple(self.input)

    def encode(self, batch: Mapping[str, Any]) -> Tensor:
        missing = [f for f in self.fields if f not in batch]
        if missing:
            raise KeyError(
                f"the batch has no field(s) {missing} that a tower reads; batch fields are {sorted(map(str, batch))}"
            )
        if self.frozen:
            with torch.no_grad():
                return self.module(*(batch[f] for f in self.fields))
        return self.module(*(batch[f] for f in self.fields))


class TowerModule(Protocol):
    """What the runtime needs of the user's module (:class:`lightning_distmm.DistMMMixin` provides it)."""

    def tower_specs(self) -> dict[str, Tower]:
        """The module's towers by name (checked and cached)."""
        ...

    def interaction_loss(self, features: dict[str, Tensor]) -> Tensor:
        """The loss over the whole batch's features ``{tower: [B, ...]}``."""
        ...


class TowerRunner(Protocol):
    """What a strategy installs on a :class:`lightning_distmm.DistMMMixin` module to run its towers
    across ranks: the mixin calls these instead of running every tower itself."""

    def contrastive_loss(self, module: TowerModule, batch: Mapping[str, Any]) -> Tensor:
        """This rank's share of the step; returns the whole-batch loss (the same value on every rank)."""
        ...

    def global_batch_size(self, batch: Mapping[str, Any]) -> int:
        """Samples in the global batch this rank's share of ``batch`` belongs to."""
        ...

    def backward(self, run_backward: Callable[[], None]) -> None:
        """Around the autograd backward of the returned loss: hand the step's gradients back and sum them."""
        ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip every rank's gradients by the norm of the whole model's gradient; return that norm."""
        ...
