"""Sharded data parallelism for a tower, applied from outside (torchtitan's ``apply_fsdp`` style).

A tower whose plan says ``shard: full`` (or ``hybrid``) is wrapped with torch's FSDP2
(:func:`torch.distributed.fsdp.fully_shard`) over the tower's own data-parallel mesh: one
``fully_shard`` per transformer block (each block's parameters are all-gathered just before it
runs and freed after, its gradients reduce-scattered as soon as its backward ends), then one on
the tower root for what is left (embeddings, norms, head). The tower keeps its plain module
structure and parameter names; its parameters become ``DTensor`` shards (``Shard(0)`` over the
mesh), which DCP checkpoints read and write like any other DTensor.

What distmm changes of FSDP's defaults:

* **Sums, not means.** FSDP's reduce-scatter divides by the data-parallel size. Each rank's loss
  is its rows' share of the whole-batch mean, so the whole-batch gradient is the *sum* over the
  tower's replicas (whatever their batch sizes): every FSDP module gets
  ``set_gradient_divide_factor(1.0)``, with ``set_force_sum_reduction_for_comms(True)`` so that the
  collective is a plain ``ReduceOp.SUM`` (the default would ask for NCCL's ``PREMUL_SUM``, which gloo
  does not have; a plain sum is also what NCCL runs zero-copy).
* **Mixed precision.** Under ``bf16-mixed`` the tower computes in bf16 with gradients reduced in
  fp32 (:func:`mixed_precision_policy`); the sharded parameters, their gradients and the
  optimizer state stay fp32.
* **Tensor parallelism.** A tower already sharded over its ``tp`` mesh dimension (DTensors from
  :mod:`.tensor_parallel`) is sharded again over ``dp``: FSDP2 composes the two into a 2-D
  ``(dp, tp)`` layout from the meshes' common root.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from lightning_distmm.parallel.tensor_parallel import is_strided


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The tower's repeated blocks, each its own FSDP unit: a timm ViT's ``blocks``, a transformers
    text encoder's ``encoder.layers``, an open_clip transformer's ``resblocks`` (empty: the root only)."""
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return list(blocks)
    for suffix in ("encoder.layers", "resblocks", "layers"):
        for name, sub in module.named_modules():
            if (name == suffix or name.endswith("." + suffix)) and isinstance(sub, (nn.ModuleList, nn.Sequential)):
                return list(sub)
    return []


def mixed_precision_policy(precision: str | None) -> MixedPrecisionPolicy | None:
    """FSDP's policy for a Lightning precision string: bf16 (or fp16) compute with fp32 gradient
    reduction under ``*-mixed``; None (the parameters' own dtype) otherwise."""
    dtypes = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    if precision not in dtypes:
        return None
    return MixedPrecisionPolicy(param_dtype=dtypes[precision], reduce_dtype=torch.float32)


def apply_fsdp(module: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard ``module`` over ``mesh`` (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP), block by block
    and then the root, with gradients summed over the mesh (in place; returns ``module``).

    Idempotent over the same mesh: a second ``Trainer`` call in the same process (fit, then
    validate) finds the tower already sharded.
    """
    if isinstance(module, FSDPModule):
        if getattr(module, "_distmm_fsdp_mesh", None) != mesh:
            raise ValueError("this tower is already sharded over another data-parallel mesh")
        return module
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "shard_placement_fn": partial(_placement, dp=mesh.size()),
    }
    units: list[FSDPModule] = []
    for block in transformer_blocks(module):
        if any(p.is_meta for p in block.parameters()):
            raise ValueError(f"{type(block).__name__}: a tower sharded with FSDP must hold all its blocks")
        units.append(fully_shard(block, **kwargs))
    root = fully_shard(module, **kwargs)
    units.append(root)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # sums over the replicas: each rank's loss is its share
        unit.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM, no PREMUL_SUM (NCCL-only; gloo refuses)
    module._distmm_fsdp_mesh = mesh  # type: ignore[assignment]
    return module


def check_fsdp(module: nn.Module, tp: int, tower: str) -> None:
    """Raise if ``module`` cannot be sharded with FSDP on top of ``tp``-way tensor parallelism; needs
    only the module's structure (meta is fine), so every rank checks every tower and fails together.

    A fused qkv's bias is a 1-D head-aligned strided TP shard that FSDP can only shard again on dim 0;
    torch 2.14 trains that layout correctly but assembles it in the wrong row order (``full_tensor``,
    DCP), so checkpoints would be wrong: refused."""
    if tp == 1:
        return
    for i, block in enumerate(getattr(module, "blocks", None) or []):
        qkv = getattr(getattr(block, "attn", None), "qkv", None)
        if getattr(qkv, "bias", None) is not None:
            raise ValueError(
                f"tower {tower!r}: blocks.{i}.attn.qkv has a bias; sharding it with FSDP on top of tp={tp} is not"
                " supported (its nested strided layout is not assembled correctly by torch's DTensor); use shard:"
                " none with tp, or tp: 1 with shard"
            )


def _placement(param: nn.Parameter, dp: int) -> Shard | None:
    """FSDP's dimension for ``param``: dim 0 (None) except for a fused qkv's head-aligned strided TP
    shard (:func:`~.tensor_parallel.strided_shard`), which FSDP shards on dim 1 when that divides.
    Nested on dim 0, the two strided layouts train correctly but ``full_tensor()`` and DCP put the
    rows back in the wrong order (checked: row blocks of a tp2 x fsdp2 qkv came back permuted)."""
    if is_strided(param) and param.dim() >= 2 and param.shape[1] % dp == 0:
        return Shard(1)
    return None


def fsdp_modules(module: nn.Module) -> Iterable[FSDPModule]:
    return (m for m in module.modules() if isinstance(m, FSDPModule))


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """FSDP's ``no_sync``: with ``sync`` off a backward keeps the unsharded gradients on the rank
    (accumulating) and reduce-scatters nothing; the next backward with ``sync`` on reduces the total."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync, recurse=True)


def is_fsdp(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


__all__ = [
    "apply_fsdp",
    "check_fsdp",
    "fsdp_modules",
    "is_fsdp",
    "mixed_precision_policy",
    "set_gradient_sync",
    "transformer_blocks",
]
