"""The software-side assumptions every cost function shares (precision, sharding, kernels, overlap, margins)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_distmm.core.plan_schema import SHARDS as RUNTIME_SHARDS

SHARDS = ("none", "optimizer", "zero2", "full", "hybrid")
"""How a tower's data-parallel replicas hold their training state, as the cost model prices it:
``none`` (every replica holds all of it, gradients all-reduced: DDP), ``optimizer`` (ZeRO-1 /
Megatron's distributed optimizer: master weights and Adam moments split over the replicas,
gradients reduce-scattered, weights all-gathered after the step), ``zero2`` (ZeRO-2 / FSDP2 with
``reshard_after_forward=False``, FSDP1's ``SHARD_GRAD_OP``: gradients and optimizer state split,
each layer's weights all-gathered once in the forward and kept through the backward, its gradients
reduce-scattered), ``full`` (ZeRO-3 / FSDP2: weights, gradients and optimizer state split, each
layer's weights all-gathered before its forward and its backward, its gradients reduce-scattered),
``hybrid`` (HSDP, what the runtime runs for ``shard: hybrid``: ZeRO-3 over the tower's replicas
inside one node, replicated across nodes; each layer's gradient shard is all-reduced across the
nodes after its reduce-scatter)."""

LAYER_SHARDS = ("zero2", "full", "hybrid")
"""Shardings whose collectives run layer by layer inside the forward and backward (FSDP)."""

PLANNABLE_SHARDS = tuple(s for s in RUNTIME_SHARDS if s in SHARDS)
"""What the planner may write into a plan: ways the runtime runs (``core.plan_schema.SHARDS``) and
the cost model prices (all of them)."""


@dataclass(frozen=True)
class PrecisionPolicy:
    """Bytes per parameter and per activation element under one precision policy.

    ``compute``: activations, tensor-parallel and pipeline messages; ``weights``: the copy of the
    weights the kernels read (and FSDP gathers); ``grads``: the gradient buffer, also the dtype the
    data-parallel reduction runs in; ``optimizer``: master weights and Adam's two moments.
    """

    name: str
    compute: int
    weights: int
    grads: int
    optimizer: int

    @property
    def trainable(self) -> int:
        """Static bytes per trainable parameter, unsharded."""
        return self.weights + self.grads + self.optimizer


PRECISIONS = {
    # fp32 weights (the master copy), fp32 gradients, Adam's m and v: 4 + 4 + 8 = 16 B/param
    # (ZeRO, Rajbhandari et al. SC'20, section 3.1, with K = 8 without the extra master copy)
    "fp32": PrecisionPolicy("fp32", compute=4, weights=4, grads=4, optimizer=8),
    # bf16 compute weights, fp32 gradients (accumulated and reduced in fp32), fp32 master weights and
    # Adam moments: 2 + 4 + 12 = 18 B/param, Megatron-LM's "bf16 param, fp32 grads" row of its
    # distributed optimizer documentation (docs/source/api-guide/dist_optimizer.md: 18 bytes per
    # parameter without the distributed optimizer, 6 + 12/d with it)
    "bf16-mixed": PrecisionPolicy("bf16-mixed", compute=2, weights=2, grads=4, optimizer=12),
}
PRECISION_ALIASES = {
    "32": "fp32",
    "32-true": "fp32",
    "fp32": "fp32",
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "bf16-mixed",
}
"""Lightning's precision names map to the policy with the same bytes (fp16 mixed precision holds
what bf16 mixed does)."""


def shard_group(shard: str, dp: Any, tp: int, pp: int, devices_per_node: int) -> Any:
    """Over how many replicas a tower's training state is split: all ``dp`` of them, or under
    ``hybrid`` the replicas of one node (the tower packed from a node start: ``devices_per_node //
    (tp * pp)`` of them, at least 1), as the runtime's HSDP mesh does. Numbers or numpy arrays."""
    import numpy as np

    if shard != "hybrid":
        return dp
    per_node = max(devices_per_node // (tp * pp), 1)
    return np.minimum(dp, per_node) if np.ndim(dp) else min(int(dp), per_node)


def precision_policy(name: str) -> PrecisionPolicy:
    """The :class:`PrecisionPolicy` of a precision name (``fp32``, ``bf16-mixed``, Lightning's aliases)."""
    key = PRECISION_ALIASES.get(str(name))
    if key is None:
        raise ValueError(f"precision={name!r}: choose one of {', '.join(PRECISION_ALIASES)}")
    return PRECISIONS[key]


@dataclass
class CostOptions:
    """Software-side assumptions of the cost model (not hardware constants).

    ``precision``: the :class:`PrecisionPolicy` by name (``bf16-mixed``: bf16 compute, fp32 master
    weights, fp32 gradient reduction, fp32 Adam moments, 18 B per trainable parameter; ``fp32``:
    16 B). It applies to every plan alike, DistMM's and the baselines'. A frozen tower keeps only
    its weights. How much of the static bytes a device holds depends on the tower's ``shard``
    (:data:`SHARDS`, :func:`lightning_distmm.planner.cost.memory.static_per_param`).
    ``flash_attention``: attention probabilities are not stored (FlashAttention / SDPA kernels).
    ``overlap_grad_sync``: gradient all-reduce overlaps the backward, as DDP's buckets do
    (``bucket_bytes`` = DDP's default 25 MB); the last bucket is always exposed.
    ``memory_margin``: fraction of device memory a plan may fill (allocator fragmentation, CUDA
    context, workspace).
    ``step_overhead``: seconds per step the training framework spends outside what is priced here
    (the Lightning loop and hooks, logging, the runtime's bookkeeping and its small collectives);
    0 unless measured (docs/planner.md section 12: 5-7 ms for 2 CPU ranks on a 2-core host).
    ``autocast``: mixed precision is PyTorch autocast (Lightning's ``bf16-mixed``, NeMo without
    ``megatron_amp_O2``): the weights stay fp32 and are cast to the compute dtype once per forward,
    LayerNorm runs in fp32 (autocast's "ops that autocast to float32" list), so the residual stream
    (fp32 position embedding + bf16 branch outputs promote to fp32) and the norms move 4-byte
    elements, and each norm's output is cast to the compute dtype before its GEMM
    (:attr:`residual_bytes`, :attr:`weight_cast_bytes`). ``False``: everything in the compute dtype
    (Megatron's O2 with ``fp32_residual_connection: False``).
    ``sequence_parallel``: under tensor parallelism the norms, residual adds and their kept
    activations are split over the tp ranks along the sequence (Megatron-LM's
    ``--sequence-parallel``, Korthikanti et al. 2022): replicated elementwise work and activations
    are divided by tp; each all-reduce becomes a reduce-scatter and an all-gather of the same bytes.
    Priced for the Megatron baselines; the runtime has no sequence parallelism.
    ``separate_bias``: every bias is added by its own kernel, as Megatron's (and NeMo 1.x's)
    ``linear_with_grad_accumulation_and_async_allreduce`` does (``output = matmul(...)``, then
    ``output + bias``; with ``bias_activation_fusion: False`` also the MLP's first bias); the
    row-parallel biases are fused into bias-dropout-add; each bias gradient is
    ``grad_output.sum(0)``, one read of the output gradient. ``False``: biases ride in the GEMM's
    epilogue (``torch.nn.Linear`` through cuBLASLt), the runtime's case.
    ``torch_softmax_towers``: towers whose unfused attention softmax runs as fp32 PyTorch ops rather
    than a fused kernel (NeMo 1.x's ViT: no attention mask, which apex's fused softmax requires;
    :data:`lightning_distmm.planner.cost.compute.TORCH_SOFTMAX_BYTES`). Only with
    ``flash_attention: False``.
    """

    precision: str = "bf16-mixed"
    flash_attention: bool = True
    overlap_grad_sync: bool = True
    bucket_bytes: float = 25e6
    memory_margin: float = 0.9
    feature_bytes: int = 4
    step_overhead: float = 0.0
    autocast: bool = True
    sequence_parallel: bool = False
    separate_bias: bool = False
    torch_softmax_towers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        precision_policy(self.precision)  # an unknown name fails here, with the choices
        self.torch_softmax_towers = tuple(self.torch_softmax_towers)  # a YAML list reads back as a tuple

    @property
    def policy(self) -> PrecisionPolicy:
        return precision_policy(self.precision)

    @property
    def bytes_el(self) -> int:
        """Bytes of an activation element (and of tensor-parallel and pipeline messages)."""
        return self.policy.compute

    @property
    def residual_bytes(self) -> int:
        """Bytes of a residual-stream / LayerNorm element: fp32 under autocast, else the compute dtype."""
        return 4 if self.autocast else self.bytes_el

    @property
    def cast_bytes(self) -> int:
        """Bytes one cast of a residual-stream element to the compute dtype moves (read + write); 0
        when the two dtypes are the same."""
        return self.residual_bytes + self.bytes_el if self.residual_bytes != self.bytes_el else 0

    @property
    def weight_cast_bytes(self) -> int:
        """HBM bytes per parameter autocast moves per forward: reading the fp32 weight and writing
        its compute-dtype copy (``torch.autocast`` caches the copy for the backward); 0 in fp32."""
        return 4 + self.bytes_el if self.autocast and self.bytes_el != 4 else 0

    @property
    def static_bytes_trainable(self) -> float:
        return float(self.policy.trainable)

    @property
    def static_bytes_frozen(self) -> float:
        return float(self.policy.weights)

    @property
    def grad_bytes(self) -> float:
        """Bytes per parameter of the data-parallel gradient reduction (the gradient dtype)."""
        return float(self.policy.grads)

    @property
    def optimizer_traffic(self) -> float:
        """HBM bytes one Adam step reads and writes per parameter (weights, grads, master, moments)."""
        return 2.0 * self.static_bytes_trainable

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> CostOptions:
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


__all__ = [
    "CostOptions",
    "PrecisionPolicy",
    "PRECISIONS",
    "SHARDS",
    "LAYER_SHARDS",
    "PLANNABLE_SHARDS",
    "shard_group",
    "precision_policy",
]
