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
  ``(dp, tp)`` layout from the meshes' common root (a fused qkv's weight and bias included).
* **Pipeline stages.** A rank of a pipelined tower holds one stage (the other stages' tensors are
  on the meta device), and the stage does not run through the tower's ``forward``. So the stage
  becomes a module of its own (:class:`StageModule`, whose forward is the stage's ``run``): each of
  the stage's blocks gets its own ``fully_shard``, then the stage module for what is left of the
  stage (embeddings on the first, norm and head on the last), with the other stages' tensors
  ignored. The mesh is the stage's data-parallel group (the same stage of every replica).
* **Gradient sync per backward.** Whether a backward reduce-scatters is set right before it, by
  the step engine (:func:`set_gradient_reduction`): a tower's microbatches reduce once per step, in the
  last backward, and not at all while Lightning accumulates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from lightning_distmm.parallel.pipeline import Stage, owned_names
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


class StageModule(nn.Module):
    """A pipeline stage of a tower as one module, so that FSDP's hooks run around it.

    ``forward(x, rows)`` is the stage's ``run``. The tower is a submodule (its parameters keep their
    names and places: FSDP swaps them in place), but only the stage's own tensors are sharded; the
    other stages' (on the meta device) are ignored."""

    def __init__(self, tower: nn.Module, run: Callable[[Tensor | None, Mapping[str, Any]], Tensor]) -> None:
        super().__init__()
        self.tower = tower
        self._run = run

    def forward(self, x: Tensor | None, rows: Mapping[str, Any]) -> Tensor:
        return self._run(x, rows)


def apply_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    stage: Stage | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``module`` over ``mesh`` (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP), block by block
    and then the root, with gradients summed over the mesh (in place). ``reshard_after_forward=False``
    (a plan's ``shard: zero2``): each block's weights, gathered in its forward, stay whole until its
    backward, which then gathers nothing (ZeRO-2's traffic, one block's whole weights more memory).

    Returns the FSDP root: ``module`` itself, or with ``stage`` (a pipeline stage of ``module``,
    :class:`~lightning_distmm.parallel.pipeline.Stage`) the :class:`StageModule` to call instead of
    the stage's ``run``: the stage's blocks each, then the stage module over the stage's other
    tensors (the other stages' meta tensors ignored).

    Idempotent over the same mesh: a second ``Trainer`` call in the same process (fit, then
    validate) finds the tower (or its stage) already sharded. Its units are resharded then: a
    forward without a backward (an evaluation) leaves the root unit's *unsharded* parameters
    registered on the module (FSDP does not reshard the root after its forward, expecting the
    backward), and the parameter table and the optimizer built next must hold the sharded ones
    (otherwise a ``fit`` after ``validate`` in the same processes leaves the root's parameters out
    of the table, and they never learn).
    """
    done = fsdp_root(module)
    if done is not None:
        if getattr(module, "_distmm_fsdp_mesh", None) != mesh:
            raise ValueError("this tower is already sharded over another data-parallel mesh")
        for unit in fsdp_modules(module):
            unit.reshard()  # not recursive: every unit registers its sharded parameters again
        return done
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "shard_placement_fn": partial(_placement, dp=mesh.size()),
        "reshard_after_forward": reshard_after_forward,
    }
    if stage is None:
        blocks, root, ignored = transformer_blocks(module), module, set()
    else:
        owned = {id(m) for m in stage.modules}
        blocks = [b for b in transformer_blocks(module) if id(b) in owned]
        root = StageModule(module, stage.run)
        mine = owned_names(module, stage)
        ignored = {p for n, p in module.named_parameters() if n not in mine}  # the other stages' parameters
    units: list[FSDPModule] = []
    for block in blocks:
        units.append(fully_shard(block, **kwargs))
    units.append(fully_shard(root, ignored_params=ignored or None, **kwargs))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # sums over the replicas: each rank's loss is its share
        unit.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM, no PREMUL_SUM (NCCL-only; gloo refuses)
    module._distmm_fsdp_mesh = mesh  # type: ignore[assignment]
    if root is not module:
        module.__dict__["_distmm_fsdp_root"] = root  # a plain attribute: not a submodule (no cycle)
    return root


def fsdp_root(module: nn.Module) -> nn.Module | None:
    """The FSDP root of a sharded tower: the tower itself, or the :class:`StageModule` of this rank's
    pipeline stage (None: not sharded)."""
    if isinstance(module, FSDPModule):
        return module
    return getattr(module, "_distmm_fsdp_root", None)


def _placement(param: nn.Parameter, dp: int) -> Shard | None:
    """FSDP's dimension for ``param``: dim 0 (None) except for a fused qkv's head-aligned strided TP
    shard (:func:`~.tensor_parallel.strided_shard`), which FSDP shards on dim 1 when that divides.
    Nested on dim 0, the two strided layouts train correctly but ``full_tensor()`` and DCP put the
    rows back in the wrong order (checked: row blocks of a tp2 x fsdp2 qkv came back permuted)."""
    if is_strided(param) and param.dim() >= 2 and param.shape[1] % dp == 0:
        return Shard(1)
    return None


def fsdp_modules(module: nn.Module) -> Iterable[FSDPModule]:
    """Every FSDP unit of a sharded tower (its blocks and its root or stage module)."""
    root = fsdp_root(module)
    return (m for m in (root.modules() if root is not None else ()) if isinstance(m, FSDPModule))


def set_gradient_reduction(module: nn.Module, reduce: bool) -> None:
    """FSDP's ``no_sync`` for the next backward through a sharded tower (or its stage): with ``reduce``
    off the backward keeps the unsharded gradients on the rank (accumulating inside FSDP) and
    reduce-scatters nothing; the next backward with ``reduce`` on reduces the total once."""
    root = fsdp_root(module)
    if isinstance(root, FSDPModule):
        root.set_requires_gradient_sync(reduce, recurse=True)


__all__ = [
    "StageModule",
    "apply_fsdp",
    "fsdp_modules",
    "fsdp_root",
    "mixed_precision_policy",
    "set_gradient_reduction",
    "transformer_blocks",
]
