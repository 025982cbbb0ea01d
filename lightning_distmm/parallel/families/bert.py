"""What makes a transformers BERT-style encoder parallel (``BertModel``, ``RobertaModel`` and their
kin: ``encoder.layer`` of layers with ``attention.self.query/key/value``, ``attention.output.dense``,
``intermediate.dense`` and ``output.dense``), LiT's and many retrieval models' text towers.

**Tensor parallelism** (Megatron's split): query, key, value and the intermediate dense
column-wise, the attention's and the layer's output dense row-wise, so each rank computes its own
heads and its share of the MLP; the embeddings, every LayerNorm and the pooler stay replicated.
The attention reshapes by ``attention_head_size`` (``-1`` heads), so local heads need no
attribute change. Sequence and context parallelism and a pipeline cut are not built for this
family (``sp``, ``cp`` and ``pp`` above 1 are refused naming it).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_distmm.parallel.families.registry import Family, Held, register
from lightning_distmm.parallel.tensor_parallel import _check_heads

#: the linears of one layer and how each is split
LAYER_PLAN = {
    "attention.self.query": "column",
    "attention.self.key": "column",
    "attention.self.value": "column",
    "attention.output.dense": "row",
    "intermediate.dense": "column",
    "output.dense": "row",
}


def _layers(module: nn.Module) -> nn.ModuleList | None:
    """The encoder layers of a BERT-style model inside ``module``, or None."""
    for name, m in module.named_modules():
        if (name == "encoder.layer" or name.endswith(".encoder.layer")) and isinstance(m, nn.ModuleList) and len(m):
            first = m[0]
            if all(_has(first, path) for path in LAYER_PLAN):
                return m
    return None


def _has(module: nn.Module, path: str) -> bool:
    try:
        return isinstance(module.get_submodule(path), nn.Linear)
    except AttributeError:
        return False


def check_tp_bert(module: nn.Module, tp: int) -> None:
    layers = _layers(module)
    assert layers is not None
    for i, layer in enumerate(layers):
        heads = layer.attention.self.num_attention_heads
        _check_heads(heads, tp, f"encoder.layer.{i}.attention.self")


def apply_tp_bert(module: nn.Module, mesh: DeviceMesh, held: Held, sp: bool) -> None:
    """Shard the held encoder layers over the tp ``mesh`` in place (``sp`` is refused before this)."""
    layers = _layers(module)
    assert layers is not None
    check_tp_bert(module, mesh.size())
    styles = {name: ColwiseParallel() if how == "column" else RowwiseParallel() for name, how in LAYER_PLAN.items()}
    for layer in layers:
        if held(layer):
            parallelize_module(layer, mesh, styles)


BERT = register(
    Family(
        name="bert",
        what="transformers BERT-style encoders (modules with 'encoder.layer')",
        matches=lambda module: _layers(module) is not None,
        check_tp=check_tp_bert,
        apply_tp=apply_tp_bert,
    )
)

__all__ = ["BERT", "LAYER_PLAN", "apply_tp_bert"]
