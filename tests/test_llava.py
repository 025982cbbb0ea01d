"""transformers' ``LlavaForConditionalGeneration`` as two towers (``models/llava.py``), trained under
distmm and compared with the same model trained in one process through its own forward and loss."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from distmm_testing import read_losses, run_distmm, run_reference
from torch.utils.data import DataLoader, Dataset
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

import lightning_distmm as ldm
from lightning_distmm.models.llava import LlavaModule, llava_state_dict

IMAGE_TOKEN, VOCAB, SEQ, IMAGE_TOKENS = 39, 40, 12, 4


def tiny_llava(
    vocab: int = VOCAB, image_token: int = IMAGE_TOKEN, vision_layers: int = 2
) -> LlavaForConditionalGeneration:
    """A random LLaVA of a few ten thousand parameters: CLIP vision (2 layers, 8x8 images in 4
    patches) and Llama (2 layers)."""
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    )
    text = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        image_seq_length=IMAGE_TOKENS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config)


class Conversations(Dataset):
    """A prompt (``<image>`` expanded to the image's tokens in every other sample), a question and a
    padded answer; only the answer's tokens are targets."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(index)
        image = index % 2 == 0
        question = torch.randint(1, IMAGE_TOKEN, (2 + index % 3,), generator=g).tolist()
        answer = torch.randint(1, IMAGE_TOKEN, (1 + index % 4,), generator=g).tolist()
        prompt = [1] + ([IMAGE_TOKEN] * IMAGE_TOKENS if image else []) + question
        ids = (prompt + answer)[:SEQ]
        labels = [-100] * len(prompt) + answer
        pad = SEQ - len(ids)
        return {
            "pixel_values": torch.randn(3, 8, 8, generator=g),
            "n_images": int(image),
            "input_ids": torch.tensor(ids + [0] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
            "labels": torch.tensor(labels[:SEQ] + [-100] * pad),
        }


class OneProcess(L.LightningModule):
    """The reference: the transformers model's own forward and loss."""

    def __init__(self, model: LlavaForConditionalGeneration, optimizer: str, lr: float, freeze: str | None) -> None:
        super().__init__()
        self.model = model
        if freeze == "vision":
            model.model.vision_tower.requires_grad_(False)
        if freeze == "language":
            model.model.language_model.requires_grad_(False)
            model.lm_head.requires_grad_(False)
        self.optimizer_name, self.lr = optimizer, lr

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        present = batch["n_images"] > 0
        loss = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"][present] if bool(present.any()) else None,
            labels=batch["labels"],
        ).loss
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, eps=1e-6, weight_decay=0.0)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


def towers_logits(module: LlavaModule, batch: dict[str, Any]) -> torch.Tensor:
    """The two towers' logits on ``batch``, the language tower fed the vision tower's features."""
    features = module.vision(batch["pixel_values"], batch["n_images"])
    return module.language(batch["input_ids"], batch["attention_mask"], batch["labels"], batch["n_images"], features)


def data() -> DataLoader:
    return DataLoader(Conversations(), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(1))


def test_the_towers_compute_transformers_forward_and_loss():
    model = tiny_llava()
    module = LlavaModule(copy.deepcopy(model))
    batch = next(iter(data()))
    present = batch["n_images"] > 0
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        pixel_values=batch["pixel_values"][present],
        labels=batch["labels"],
    )
    logits = towers_logits(module, batch)
    assert torch.equal(logits, out.logits)
    total, count = module.token_loss(logits, batch)
    assert (total / count).item() == pytest.approx(out.loss.item(), rel=1e-6)
    exported = module.to_llava()
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("pp", [1, 2])
def test_the_language_stages_compute_its_forward(pp):
    module = LlavaModule(tiny_llava())
    batch = next(iter(data()))
    features = module.vision(batch["pixel_values"], batch["n_images"])
    fields = ("input_ids", "attention_mask", "labels", "n_images")
    whole = module.language(*(batch[f] for f in fields), features)
    rows = {**{f: batch[f] for f in fields}, "image_features": features}
    x = None
    for stage in module.language.pipeline_stages(pp):
        x = stage.run(x, rows)
    assert torch.equal(x, whole)


def test_a_placeholder_count_that_misses_the_image_is_named():
    module = LlavaModule(tiny_llava())
    batch = next(iter(data()))
    n_images = batch["n_images"].clone()
    row = int((n_images == 0).nonzero()[0, 0])
    n_images[row] = 1  # says it has an image, but its text has no placeholders
    features = module.vision(batch["pixel_values"], n_images)
    with pytest.raises(ValueError, match=rf"row {row} has 0 <image> placeholder tokens \(id 39\) and 1 image"):
        module.language(batch["input_ids"], batch["attention_mask"], batch["labels"], n_images, features)


PLANS = {
    "vision-dp2+language": ldm.Plan(3, {"vision": {"ranks": [0, 1]}, "language": {"ranks": [2]}}),
    "colocated-dp2": "colocated",
    "vision+language-fsdp2": ldm.Plan(3, {"vision": {"ranks": [0]}, "language": {"ranks": [1, 2], "shard": "full"}}),
    "vision+language-tp2": ldm.Plan(3, {"vision": {"ranks": [0]}, "language": {"ranks": [1, 2], "tp": 2}}),
    "vision+language-pp2-mb2": ldm.Plan(
        3, {"vision": {"ranks": [0]}, "language": {"ranks": [1, 2], "pp": 2, "microbatch": 2}}
    ),
}


def _compare(
    plan: Any,
    devices: int,
    optimizer: str,
    freeze: str | None,
    tmp_path: Path,
    pack_tokens: int | None = None,
    vision_layers: int = 2,
) -> float:
    L.seed_everything(0)
    lr = 0.05 if optimizer == "sgd" else 0.01
    model = tiny_llava(vision_layers=vision_layers)
    reference = OneProcess(copy.deepcopy(model), optimizer, lr, freeze)
    module = LlavaModule(
        copy.deepcopy(model),
        freeze_vision=freeze == "vision",
        freeze_language=freeze == "language",
        optimizer=optimizer,
        lr=lr,
        eps=1e-6,
        pack_tokens=pack_tokens,
    )
    run_reference(reference, data(), 3, str(tmp_path / "ref.json"))
    run_distmm(module, plan, devices, data(), 3, str(tmp_path / "dist.json"))
    assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
    trained, initial = reference.model.state_dict(), model.state_dict()
    ours = llava_state_dict(module.state_dict())
    assert set(ours) == set(trained)
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-3
    return max((ours[k].float() - trained[k].float()).abs().max().item() for k in trained)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(PLANS))
def test_llava_trains_like_transformers_in_one_process(name, optimizer, tmp_path, capsys):
    plan = PLANS[name]
    devices = 2 if plan == "colocated" else plan.world_size
    diff = _compare(plan, devices, optimizer, None, tmp_path)
    with capsys.disabled():
        print(f"\nLLaVA {name} {optimizer}: max parameter diff {diff:.1e}")
    assert diff <= 1e-5


@pytest.mark.slow
def test_a_packed_language_tower_trains_like_transformers_padded(tmp_path):
    """The language model on 2 data-parallel ranks, each microbatch's rows packed into sequences of
    24 tokens (two or three samples each), against transformers' padded forward in one process."""
    plan = ldm.Plan(3, {"vision": {"ranks": [0]}, "language": {"ranks": [1, 2]}})
    assert _compare(plan, 3, "adamw", None, tmp_path, pack_tokens=24) <= 1e-5


def test_the_vision_towers_stages_compute_its_features():
    """Two stages of the vision tower (the layers up to the one LLaVA reads) give the features of its
    forward; a list of feature layers is refused with pp > 1."""
    module = LlavaModule(tiny_llava(vision_layers=3))
    batch = next(iter(data()))
    stages = module.vision.pipeline_stages(2)  # vision_feature_layer -2 of 3 layers: 2 run, one per stage
    out = stages[1].run(stages[0].run(None, batch), batch)
    expected = module.vision(batch["pixel_values"], batch["n_images"])
    assert (out - expected).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="cannot be cut into 3 pipeline stages"):
        module.vision.pipeline_stages(3)
    module.vision.layer = [-2, -1]
    with pytest.raises(ValueError, match="several layers"):
        module.vision.pipeline_stages(2)


def test_packed_pipeline_stages_hand_on_packed_sequences_and_match_the_padded_forward():
    """Stage 0 packs its rows (what it sends is the packed sequences, not the padded rows); stage 1
    finds the same packing from the mask and unpacks; the result is the padded forward's."""
    module = LlavaModule(tiny_llava(), pack_tokens=24)
    batch = next(iter(data()))
    features = module.vision(batch["pixel_values"], batch["n_images"])
    rows = {**batch, "image_features": features}
    stages = module.language.pipeline_stages(2)
    sent = stages[0].run(None, rows)
    tokens = int(batch["attention_mask"].sum())
    assert sent.shape[1] <= 24 and sent.shape[0] * sent.shape[1] < batch["input_ids"].numel()
    assert sent.shape[0] * 24 >= tokens
    out = stages[1].run(sent, rows)
    module.language.pack_tokens = None
    padded = towers_logits(module, batch)
    kept = batch["attention_mask"].bool()
    assert (out[kept] - padded[kept]).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_a_pipelined_vision_tower_trains_like_transformers(tmp_path):
    """The vision tower in 2 stages (one encoder layer each; the third, whose output LLaVA does not
    read, held unrun by the last) in 2 microbatches, the language model on a rank of its own."""
    plan = ldm.Plan(3, {"vision": {"ranks": [0, 1], "pp": 2, "microbatch": 4}, "language": {"ranks": [2]}})
    assert _compare(plan, 3, "adamw", None, tmp_path, vision_layers=3) <= 1e-5


@pytest.mark.slow
def test_a_packed_pipelined_language_tower_trains_like_transformers_padded(tmp_path):
    """The language model in 2 pipeline stages and 2 microbatches, each stage finding the packing
    from the rows' mask: the first packs, every stage runs the packed sequences, the last unpacks."""
    plan = ldm.Plan(3, {"vision": {"ranks": [0]}, "language": {"ranks": [1, 2], "pp": 2, "microbatch": 4}})
    assert _compare(plan, 3, "adamw", None, tmp_path, pack_tokens=24) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("freeze", ["vision", "language"])
def test_llava_stages_with_a_frozen_part_train_like_one_process(freeze, tmp_path):
    """LLaVA's stage 1 (the language model frozen: the projector learns through it) and its
    fine-tuning with the vision encoder frozen."""
    diff = _compare(PLANS["vision-dp2+language"], 3, "adamw", freeze, tmp_path)
    assert diff <= 1e-5


@pytest.mark.slow
def test_init_from_a_folder_train_export_and_reload_with_transformers_alone(tmp_path):
    """A LLaVA saved in a local folder, trained 3 steps under distmm, saved back: transformers
    loads the folder and computes the trained module's logits."""
    tiny_llava().save_pretrained(tmp_path / "start")
    module = LlavaModule.from_pretrained(str(tmp_path / "start"), optimizer="adamw", lr=0.01)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    run_distmm(module, PLANS["vision-dp2+language"], 3, data(), 3, str(tmp_path / "dist.json"))
    assert max((module.state_dict()[k] - v).abs().max().item() for k, v in before.items()) > 1e-3
    module.save_pretrained(str(tmp_path / "trained"))
    reloaded = LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "trained"), local_files_only=True)
    batch = next(iter(data()))
    present = batch["n_images"] > 0
    with torch.no_grad():
        theirs = reloaded(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"][present],
        ).logits
        ours = towers_logits(module, batch)
    assert (theirs - ours).abs().max().item() <= 1e-5


def test_a_vision_tower_unpickled_where_its_class_was_never_built_still_records_hidden_states():
    """A rank started with ``spawn`` unpickles the towers without building them: transformers' registry
    of which classes record ``hidden_states`` (filled in ``PreTrainedModel.__init__``) has no entry
    there, and the CLIP vision tower returned ``hidden_states=None`` (found by recipes/llava_shapes.py)."""
    import pickle

    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    module = LlavaModule(tiny_llava())
    blob = pickle.dumps(module)
    key = str(type(module.vision.vision_tower))
    saved = {k: v for k, v in dict(_CAN_RECORD_REGISTRY).items() if "CLIPVision" in k}
    try:
        for k in saved:
            del _CAN_RECORD_REGISTRY[k]  # as in a fresh process
        assert key not in _CAN_RECORD_REGISTRY
        restored = pickle.loads(blob)
        batch = next(iter(data()))
        assert restored.vision(batch["pixel_values"], batch["n_images"]).shape[1] == IMAGE_TOKENS
    finally:
        _CAN_RECORD_REGISTRY.update(saved)
