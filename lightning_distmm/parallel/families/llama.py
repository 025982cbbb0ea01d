"""What makes a transformers Llama / Qwen2-style causal LM parallel: Megatron's tensor-parallel
split of its decoder layers (``...layers`` of modules with ``self_attn.q_proj`` and ``mlp.gate_proj``).
The attention reshapes by ``head_dim`` (``-1`` heads), so local heads need no attribute change."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_distmm.parallel.families.registry import Family, Held, holds_all, register
from lightning_distmm.parallel.tensor_parallel import _check_heads


def _llama_layers(module: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of a transformers Llama / Qwen2-style causal LM (``...layers`` of modules with
    ``self_attn.q_proj`` and ``mlp.gate_proj``), or None."""
    for name, m in module.named_modules():
        if name.endswith("layers") and isinstance(m, nn.ModuleList) and len(m) > 0:
            first = m[0]
            if hasattr(first, "self_attn") and hasattr(first.self_attn, "q_proj") and hasattr(first, "mlp"):
                if hasattr(first.mlp, "gate_proj"):
                    return m
    return None


def apply_tp_llama(model: nn.Module, mesh: DeviceMesh, held: Held = holds_all) -> nn.Module:
    """Shard the decoder layers of a Llama / Qwen2-style causal LM (Megatron's split: q/k/v and the gated
    MLP's gate/up column-wise, o and down row-wise); embeddings, norms and the LM head stay replicated.
    The attention reshapes by ``head_dim`` (``-1`` heads), so local heads need no attribute change;
    query and key/value heads must both divide by tp."""
    layers = _llama_layers(model)
    assert layers is not None
    check_tp_llama(model, mesh.size())
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in layers:
        if held(layer):
            parallelize_module(layer, mesh, plan)
    return model


def check_tp_llama(module: nn.Module, tp: int) -> None:
    """Refuse a ``tp`` that does not divide the query heads and the key/value heads (the config of
    ``module`` or of its first submodule with one; no ``num_key_value_heads``: one per query head)."""
    config = next(m.config for m in module.modules() if hasattr(m, "config"))
    _check_heads(config.num_attention_heads, tp, "self_attn (query heads)")
    _check_heads(
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads, tp, "self_attn (key/value heads)"
    )


LLAMA = register(
    Family(
        name="llama",
        what="Llama / Qwen2-style causal LMs",
        matches=lambda module: _llama_layers(module) is not None,
        check_tp=check_tp_llama,
        apply_tp=lambda module, mesh, held, sp: apply_tp_llama(module, mesh, held),
    )
)

__all__ = ["LLAMA", "apply_tp_llama"]
