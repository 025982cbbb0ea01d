"""The software-side assumptions every cost function shares (precision, kernels, overlap, margins)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class CostOptions:
    """Software-side assumptions of the cost model (not hardware constants).

    ``precision``: ``bf16-mixed`` (2-byte activations/weights/grads, fp32 master weights and Adam
    moments: 16 bytes of static memory per trainable parameter, as in ZeRO, Rajbhandari et al. 2020)
    or ``32`` (4 + 4 + 8 = 16 bytes as well). A frozen tower keeps only its weights.
    ``flash_attention``: attention probabilities are not stored (FlashAttention / SDPA kernels).
    ``overlap_grad_sync``: gradient all-reduce overlaps the backward, as DDP's buckets do
    (``bucket_bytes`` = DDP's default 25 MB); the last bucket is always exposed.
    ``memory_margin``: fraction of device memory a plan may fill (allocator fragmentation, CUDA
    context, workspace).
    ``step_overhead``: seconds per step the training framework spends outside what is priced here
    (the Lightning loop and hooks, logging, the runtime's bookkeeping and its small collectives);
    0 unless measured (docs/planner.md section 12: 5-7 ms for 2 CPU ranks on the development VM).
    """

    precision: str = "bf16-mixed"
    flash_attention: bool = True
    overlap_grad_sync: bool = True
    bucket_bytes: float = 25e6
    memory_margin: float = 0.9
    feature_bytes: int = 4
    step_overhead: float = 0.0

    @property
    def bytes_el(self) -> int:
        return 2 if str(self.precision).startswith(("bf16", "16")) else 4

    @property
    def static_bytes_trainable(self) -> float:
        return 16.0

    @property
    def static_bytes_frozen(self) -> float:
        return float(self.bytes_el)

    @property
    def optimizer_traffic(self) -> float:
        """HBM bytes one Adam step reads and writes per parameter (weights, grads, master, moments)."""
        return 2.0 * self.static_bytes_trainable

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> CostOptions:
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


__all__ = ["CostOptions"]
