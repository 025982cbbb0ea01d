"""Every plan spec (none, ``"auto"``, ``"colocated"``) for a model whose language model consumes an
encoder's output, written as a user would: a conv patch encoder feeding a transformers Qwen2 LM
through ``inputs_embeds``, only the public API."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from distmm_testing import max_param_diff, read_losses, run_distmm, run_reference
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM

import lightning_distmm as ldm
from lightning_distmm.parallel.flops import tower_counts

SEQ, VOCAB, PATCHES, WIDTH = 6, 32, 4, 32


class Patches(nn.Module):
    """8x8 images -> 4 patch tokens of the LM's width."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, WIDTH, kernel_size=4, stride=4)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.conv(pixels).flatten(2).transpose(1, 2)  # [B, 4, WIDTH]


class Decoder(nn.Module):
    """The image tokens, then the caption, through a Qwen2 causal LM; logits of the caption."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        config = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        self.lm = Qwen2ForCausalLM(config)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_tokens: torch.Tensor
    ) -> torch.Tensor:
        text = self.lm.get_input_embeddings()(input_ids)
        embeds = torch.cat([image_tokens, text], dim=1)
        mask = torch.cat([torch.ones(image_tokens.shape[:2], dtype=attention_mask.dtype), attention_mask], dim=1)
        return self.lm(inputs_embeds=embeds, attention_mask=mask).logits[:, image_tokens.shape[1] :]


class Captioner(ldm.DistMMMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.vision = Patches()
        self.decoder = Decoder()

    def towers(self) -> dict[str, ldm.Tower]:
        return {
            "vision": ldm.Tower(self.vision, input="pixels"),
            "text": ldm.Tower(self.decoder, input=["input_ids", "attention_mask"], consumes={"vision": "image_tokens"}),
        }

    def token_loss(self, logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
        total = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return total, (labels != -100).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


class Captions(Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        length = 2 + index % (SEQ - 1)
        mask = (torch.arange(SEQ) < length).long()
        return {
            "pixels": torch.randn(3, 8, 8, generator=g),
            "input_ids": torch.randint(1, VOCAB, (SEQ,), generator=g) * mask,
            "attention_mask": mask,
        }


def test_the_consumer_is_counted_on_its_producers_output():
    model = Captioner()
    example = next(iter(DataLoader(Captions(), batch_size=1)))
    counts = tower_counts(model.towers(), example)
    params = sum(p.numel() for p in model.decoder.parameters())
    # counted by running it (its FLOPs grow with the image tokens it reads), not the 2 x parameters fallback
    assert counts["text"]["flops"] != 2.0 * params and counts["text"]["ops"] > 0
    assert counts["text"]["embed_dim"] == VOCAB


def test_a_consumer_that_cannot_take_what_it_consumes_is_named():
    class Wrong(Captioner):
        def towers(self) -> dict[str, ldm.Tower]:
            t = super().towers()
            t["text"] = ldm.Tower(self.decoder, input=["input_ids", "attention_mask"], consumes={"vision": "images"})
            return t

    example = next(iter(DataLoader(Captions(), batch_size=1)))
    with pytest.raises(
        TypeError, match=r"tower 'text' consumes \{'vision': 'images'\} but Decoder.forward.*images=<vision's output>"
    ):
        tower_counts(Wrong().towers(), example)


def _compare(spec: Any, devices: int, tmp_path: Path) -> float:
    L.seed_everything(0)
    reference = Captioner()
    module, initial = copy.deepcopy(reference), copy.deepcopy(reference)

    def data() -> DataLoader:
        return DataLoader(Captions(), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(2))

    run_reference(reference, data(), 3, str(tmp_path / "ref.json"))
    run_distmm(module, spec, devices, data(), 3, str(tmp_path / "dist.json"))
    assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
    assert max_param_diff(reference, initial) > 1e-3
    return max_param_diff(reference, module)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("spec", [None, "auto", "colocated"])
def test_every_plan_spec_trains_a_consuming_model_like_one_process(spec, devices, tmp_path, capsys):
    diff = _compare(spec, devices, tmp_path)
    with capsys.disabled():
        print(f"\nplan={spec!r} on {devices} ranks: max parameter diff {diff:.1e}")
    assert diff <= 1e-5


# "auto" measures the host: its core-sharing probe starts processes unless a quiet host cached it
# (on 2 ranks only: test_every_plan_spec_trains_a_consuming_model_like_one_process runs it on 3)
@pytest.mark.parametrize(
    "spec, world", [("default", 2), ("default", 3), pytest.param("auto", 2, marks=pytest.mark.slow)]
)
def test_the_choice_comes_from_the_encoder_to_llm_search(spec, world):
    """Rank 0's choice for a VLM: the VLM search's pick, in the model's tower
    names, with the line the log gets (the pick and its predicted ratio to FSDP and colocated)."""
    from contextlib import nullcontext

    from lightning_distmm.plan_choice import LiveJob, choose_on_rank0

    model = Captioner()
    job = LiveJob(
        towers=model.towers(),
        sync_groups=1,
        example=next(iter(DataLoader(Captions(), batch_size=1))),
        global_batch=6,
        world_size=world,
        per_node=world,
        device=torch.device("cpu"),
        precision="32-true",
        forward_context=nullcontext,
        random_state_kept=lambda device: nullcontext(),
    )
    chosen, line, error = choose_on_rank0(spec, job)
    assert error is None, error
    plan = ldm.Plan.from_dict(chosen)
    assert set(plan.towers) == {"vision", "text"} and plan.world_size == world
    assert line.startswith(f"distmm {spec} plan (VLM search): chose vision ")
    # the line compares the pick with the other kinds (FSDP over both, colocated, separate), never with
    # its own kind: an "auto" pick timed on a busy host may be the FSDP one
    assert line.count("x faster than ") >= 1 and ("than FSDP over both" in line or "than colocated" in line)
