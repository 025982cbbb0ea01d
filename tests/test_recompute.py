"""Recomputation per block (``recompute: true`` every block, ``recompute: N`` the first N of each
stage): a recomputed block runs its forward again in the backward, the others do not; training is
exact against one process; a count the tower's stages cannot hold is refused naming the key."""

import lightning as L
import pytest
import torch
from distmm_testing import DeepCLIP, compare_with_reference

import lightning_distmm as ldm
from lightning_distmm.models.tiny import tiny_vit
from lightning_distmm.parallel.plan_checks import check_plan_runs
from lightning_distmm.parallel.recompute import recompute_blocks


def forwards_per_block(count: bool | int) -> list[int]:
    """How often each of a 3-block ViT's blocks started its MLP in one forward and backward (a pre-hook:
    torch stops a recomputation once the tensors the backward needs are back, before the MLP returns)."""
    torch.manual_seed(0)
    vit = tiny_vit(8, 4, width=16, depth=3, heads=2, embed=8)
    calls = [0, 0, 0]
    for i, block in enumerate(vit.blocks):
        block.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    if count is not False:
        recompute_blocks(vit, count)
    vit(torch.randn(2, 3, 8, 8)).sum().backward()
    return calls


def test_the_first_n_blocks_run_their_forward_again_in_the_backward():
    assert forwards_per_block(False) == [1, 1, 1]
    assert forwards_per_block(1) == [2, 1, 1]
    assert forwards_per_block(2) == [2, 2, 1]
    assert forwards_per_block(True) == [2, 2, 2]


def test_recomputed_blocks_give_the_same_gradients():
    grads = []
    for count in (False, 2):
        torch.manual_seed(0)
        vit = tiny_vit(8, 4, width=16, depth=3, heads=2, embed=8)
        if count:
            recompute_blocks(vit, count)
        vit(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        grads.append([p.grad.clone() for p in vit.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_count_the_stages_do_not_hold_is_refused():
    module = DeepCLIP()  # two blocks per tower
    with pytest.raises(ldm.PlanError, match="recompute: 2 recomputes the first 2 blocks") as raised:
        check_plan_runs(
            ldm.Plan(4, {"image": {"ranks": [0, 1], "pp": 2, "recompute": 2}, "text": {"ranks": [2, 3]}}),
            module.tower_specs(),
        )
    assert raised.value.key == "towers.image.recompute" and "use at most 1" in str(raised.value)


def test_recompute_counts_round_trip_and_bad_values_are_refused():
    plan = ldm.Plan(2, {"image": {"ranks": [0], "recompute": 1}, "text": {"ranks": [1], "recompute": True}})
    again = ldm.Plan.from_dict(plan.to_dict())
    assert again.towers["image"].recompute == 1 and again.towers["text"].recompute is True
    assert "gpipe+recompute(1)" in plan.table() and "gpipe+recompute " in plan.table() + " "
    for bad in (-1, "2", 1.5):
        with pytest.raises(ldm.PlanError, match="towers.image.recompute"):
            ldm.Plan.from_dict({"world_size": 1, "towers": {"image": {"ranks": [0], "recompute": bad}}})


PLANS = {
    # the first block of two recomputed on each replica; the text tower's every block
    "image-dp2-first1+text-all": ldm.Plan(
        3, {"image": {"ranks": [0, 1], "recompute": 1}, "text": {"ranks": [2], "recompute": True}}
    ),
    # each pipeline stage recomputes its block; the image stages sharded over their replicas
    "image-pp2xfull2-all": ldm.Plan(
        4,
        {"image": {"ranks": [0, 1, 2, 3], "pp": 2, "shard": "full", "recompute": True}, "text": {"ranks": [0, 2]}},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_recomputed_blocks_train_like_one_process(name, tmp_path):
    plan = PLANS[name]
    L.seed_everything(0)
    compare_with_reference(lambda: DeepCLIP("adamw", lr=0.01), plan, plan.world_size, 10, 3, tmp_path).assert_exact()
