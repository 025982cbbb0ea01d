"""Model families (``parallel/families``): each tower is matched to the family that knows how to
split it, an unknown tower is refused naming the families there are, and a family added through
the registry (BERT-style text encoders) trains under tensor parallelism exactly like one process."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from distmm_testing import EMBED, SEQ, VOCAB, Comparison, TinyCLIP, loader, read_losses, run_distmm, run_reference
from torch import nn
from transformers import BertConfig, BertModel

import lightning_distmm as ldm
from lightning_distmm.models.tiny import tiny_vit
from lightning_distmm.parallel.families import FAMILIES, check_sp, check_tp, family_of
from lightning_distmm.parallel.families.bert import LAYER_PLAN


class BertText(nn.Module):
    """A LiT-style text tower: a transformers ``BertModel`` (2 layers, width 16, 2 heads), its first
    token projected to the embedding; the key bias frozen (its true gradient is zero: see the README)."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.proj = nn.Linear(16, EMBED)
        for layer in self.bert.encoder.layer:
            layer.attention.self.key.bias.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.proj(hidden[:, 0])


class BertCLIP(TinyCLIP):
    def __init__(self, optimizer: str = "sgd", lr: float = 0.1) -> None:
        super().__init__(optimizer, lr)
        self.text = BertText()


def test_each_tower_finds_its_family_and_an_unknown_one_is_named():
    assert [f.name for f in FAMILIES][:4] == ["vit", "clip_text", "llama", "bert"]
    assert family_of(tiny_vit(8, 4, width=16, depth=1, heads=2, embed=EMBED), "apply_tp", "").name == "vit"
    assert family_of(BertText(), "apply_tp", "").name == "bert"
    with pytest.raises(ValueError, match=r"tower 'x', tp=2: no tensor-parallel plan for a Linear tower: supported are"):
        check_tp(nn.Linear(2, 2), 2, "x")
    with pytest.raises(ValueError, match=r"encoder.layer.0.attention.self: 2 attention heads do not divide by tp=4"):
        check_tp(BertText(), 4, "x")
    with pytest.raises(ValueError, match="tower 'x', tp=2, sp: true: no sequence-parallel plan for a BertText"):
        check_sp(BertText(), "x", 2)


class _ShardRecorder(L.Callback):
    """Each rank writes its local shapes of the text tower's split linears (are they really split?)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layer = pl_module.text.bert.encoder.layer[0]  # type: ignore[union-attr]
        if not hasattr(layer.attention.self.query.weight, "to_local"):
            return  # the image's rank: the text tower is not here
        shapes = {name: list(layer.get_submodule(name).weight.to_local().shape) for name in LAYER_PLAN}
        (self.folder / f"shapes{trainer.global_rank}.json").write_text(json.dumps(shapes))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_bert_text_tower_trains_under_tp2_like_one_process(optimizer, tmp_path):
    """Image on rank 2, the BERT text tower tp2 on ranks 0 and 1, 3 steps: weights and losses equal
    one process within 1e-5, and each tp rank held half of every split linear."""
    plan = ldm.Plan(3, {"image": {"ranks": [2]}, "text": {"ranks": [0, 1], "tp": 2}})
    lr = 0.05 if optimizer == "sgd" else 0.01
    L.seed_everything(0)
    reference = BertCLIP(optimizer, lr)
    module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
    run_reference(reference, loader(8), 3, str(tmp_path / "ref.json"))
    run_distmm(module, plan, 3, loader(8), 3, str(tmp_path / "dist.json"), callbacks=[_ShardRecorder(tmp_path)])
    losses = [read_losses(tmp_path / f) for f in ("ref.json", "dist.json")]
    Comparison(reference, module, initial, *losses).assert_exact()
    for rank in (0, 1):
        shapes = json.loads((tmp_path / f"shapes{rank}.json").read_text())
        assert shapes["attention.self.query"] == [8, 16] and shapes["attention.output.dense"] == [16, 8]
        assert shapes["intermediate.dense"] == [16, 16] and shapes["output.dense"] == [16, 16]
