"""Every plan trains exactly like one process on the same global batches."""

import copy

import lightning as L
import pytest

import lightning_distmm as ldm
from distmm_testing import TinyCLIP, loader, max_param_diff, read_losses, run_distmm, run_reference

PLANS = {
    "colocated-2": (2, 8, ldm.Plan(2, {"image": {"ranks": [0, 1]}, "text": {"ranks": [0, 1]}})),
    "image2-text1": (3, 8, ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})),
    "b10-image3-uneven-text1": (
        4, 10, ldm.Plan(4, {"image": {"ranks": [0, 1, 2], "replica_batch": [4, 3, 3]}, "text": {"ranks": [3]}}, 10),
    ),
    "b9-image2-text2": (4, 9, ldm.Plan(4, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2, 3]}})),
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(PLANS))
def test_matches_single_process(name, optimizer, tmp_path):
    world, batch, plan = PLANS[name]
    L.seed_everything(0)
    reference = TinyCLIP(optimizer, lr=0.05 if optimizer == "sgd" else 0.01)
    module = copy.deepcopy(reference)
    initial = copy.deepcopy(reference)
    run_reference(reference, loader(batch), 3, str(tmp_path / "ref.json"))
    run_distmm(module, plan, world, loader(batch), 3, str(tmp_path / "dist.json"))
    assert max_param_diff(reference, module) <= 1e-5
    ref_losses, dist_losses = read_losses(tmp_path / "ref.json"), read_losses(tmp_path / "dist.json")
    assert len(ref_losses) == len(dist_losses) == 3
    for a, b in zip(ref_losses, dist_losses):
        assert abs(a - b) <= 1e-5
    # the weights really moved: equality is not the trivial one
    assert max_param_diff(reference, initial) > 1e-3
