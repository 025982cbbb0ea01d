"""``Tower``: one encoder of a contrastive model and the batch field(s) it reads.

The unit every layer above the plan talks about: the user names towers in
:meth:`lightning_distmm.DistMMMixin.towers`, the runtime runs them, the planner prices them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
