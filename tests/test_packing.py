"""Sequence packing for a language tower (``models/packing.py``): the packed forward equals the padded
one at every token the rows hold, gradients included, and bad budgets are named."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from test_llava import data, tiny_llava, towers_logits

from lightning_distmm.models.llava import LlavaModule
from lightning_distmm.models.packing import pack, plan_packing, unpack


def test_samples_go_whole_in_row_order():
    assert plan_packing([3, 4, 2, 5, 1], 7) == [[0, 1], [2, 3], [4]]
    assert plan_packing([7, 7], 7) == [[0], [1]]
    with pytest.raises(ValueError, match="row 1 of the microbatch has 9 tokens, more than the packing budget of 8"):
        plan_packing([2, 9], 8)
    with pytest.raises(ValueError, match="packing budget 0"):
        plan_packing([1], 0)


def test_pack_then_unpack_gives_back_the_kept_tokens():
    x = torch.randn(3, 5, 2)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]])  # masked slots inside a row too
    packed, positions, where = pack(x, keep, 8)
    assert packed.shape == (2, 6, 2) and where.tokens == 11
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]  # a sequence's tail continues
    back = unpack(packed, where)
    torch.testing.assert_close(back, x * keep[..., None])


def assert_same_computation(padded, packed, batch, logits_of) -> None:
    """The two modules' logits at every real token, their loss and every parameter's gradient agree."""
    outs = []
    for module in (padded, packed):
        logits = logits_of(module)
        total, count = module.token_loss(logits, batch)
        (total / count).backward()
        outs.append((logits, total / count))
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(outs[1][0][real], outs[0][0][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-6, rtol=1e-6)
    for (name, a), b in zip(padded.named_parameters(), packed.parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("budget", [12, 30])
def test_a_packed_llava_language_tower_computes_the_padded_one(budget):
    """The same weights, padded rows against rows packed into sequences of ``budget`` tokens: the
    logits at every real token, the loss, and every parameter's gradient."""
    padded = LlavaModule(tiny_llava())
    packed = copy.deepcopy(padded)
    packed.language.pack_tokens = budget
    batch = next(iter(data()))
    assert_same_computation(padded, packed, batch, lambda module: towers_logits(module, batch))


def test_a_packed_demo_vlm_language_model_computes_the_masked_one():
    """The demo VLM's LM (absent image slots and padding masked) against the same LM computing only the
    present tokens, packed: logits at every text token that has a mask, loss and gradients."""
    from vlm_testing import VLMData, vlm_loader

    from lightning_distmm.models.vlm import VLM

    torch.manual_seed(0)
    masked = VLM()
    packed = copy.deepcopy(masked)
    packed.language.pack_tokens = 40
    batch = next(iter(vlm_loader(6, data=VLMData)))

    def logits_of(module):
        embeds = module.vision(batch["pixel_values"], batch["n_images"])
        fields = [batch[k] for k in ("input_ids", "attention_mask", "labels", "n_images")]
        return module.language(*fields, embeds)

    assert_same_computation(masked, packed, batch, logits_of)


def test_a_sample_over_the_budget_is_named_before_any_row_trains():
    """The batch-level check (before the batch moves): the sample, its token count and the budget,
    in one process where no loader says the dataset index."""
    from vlm_testing import vlm_loader

    from lightning_distmm.models.vlm import VLM

    model = VLM(pack_tokens=8)
    batch = next(iter(vlm_loader(6)))
    lengths = batch["attention_mask"].sum(1) + batch["n_images"] * model.language.tokens_per_image
    first = int((lengths > 8).nonzero()[0, 0])
    with pytest.raises(ValueError, match=rf"the sample at row {first} of the batch has {int(lengths[first])} tokens"):
        model.on_before_batch_transfer(batch, 0)
    with pytest.raises(ValueError, match="pack_tokens=0"):
        VLM(pack_tokens=0).on_before_batch_transfer(batch, 0)


@pytest.mark.slow
def test_under_distmm_the_message_names_the_dataset_sample(tmp_path):
    """Shuffled rows, the LLM on its own rank: the rank that loads the text stops before the first
    step naming the sample by its dataset index and its row of the global batch."""
    import lightning as L
    from distmm_testing import trainer_kwargs
    from torch.utils.data import DataLoader
    from vlm_testing import VLMData

    import lightning_distmm as ldm
    from lightning_distmm.models.vlm import VLM

    data = VLMData(24)
    tokens = VLM().language.tokens_per_image
    lengths = [int(data.load(i, data.fields)["attention_mask"].sum()) + tokens * data.images(i) for i in range(24)]
    budget = sorted(lengths)[len(lengths) // 4]  # three samples in four are longer
    loader = DataLoader(data, batch_size=6, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(3))
    plan = ldm.Plan(2, {"image": {"ranks": [1]}, "llm": {"ranks": [0]}})
    trainer = L.Trainer(
        devices=2, max_steps=1, strategy=ldm.DistMMStrategy(plan, start_method="fork"), **trainer_kwargs()
    )
    with pytest.raises(Exception) as raised:
        trainer.fit(VLM(pack_tokens=budget), loader)
    found = re.search(r"sample (\d+) of the dataset \(row (\d+) of the batch\) has (\d+) tokens", str(raised.value))
    assert found, str(raised.value)[-1500:]
    index, row, n = (int(g) for g in found.groups())
    assert n == lengths[index] > budget  # the named sample is the one that is too long
    assert index != row  # shuffled: the dataset index, not the row, names it
    assert f"more than the packing budget pack_tokens={budget}" in str(raised.value)
