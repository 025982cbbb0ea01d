"""ZeRO-1 towers (``shard: optimizer``: the optimizer state sharded over a tower's replicas, weights
and gradients whole) train exactly like one process, alone and with tp, pp, cp, sp, microbatches,
accumulation and clipping; each replica holds the state of its 1/n of the tower only."""

import json

import lightning as L
import pytest
import torch
from distmm_testing import DeepCLIP, TinyCLIP, compare_with_reference

import lightning_distmm as ldm

UNEVEN = ldm.Plan(
    4,
    {
        "image": {"ranks": [0, 1, 2], "replica_batch": [4, 3, 2], "shard": "optimizer"},
        "text": {"ranks": [2, 3], "replica_batch": [5, 4], "shard": "optimizer"},
    },
    9,
)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_zero1_towers_with_uneven_replicas_match_single_process(optimizer, tmp_path):
    lr = 0.05 if optimizer == "sgd" else 0.01
    compare_with_reference(lambda: TinyCLIP(optimizer, lr=lr), UNEVEN, 4, 9, 3, tmp_path).assert_exact()


COMPOSED = {
    # tensor parallelism inside each replica: each tp rank steps its 1/dp of its tp shard
    "image-tp2xzero1-2+text-zero1": ldm.Plan(
        4,
        {
            "image": {"ranks": [0, 1, 2, 3], "tp": 2, "shard": "optimizer"},
            "text": {"ranks": [0, 2], "shard": "optimizer"},
        },
    ),
    "image-tp2-sp-xzero1-2": ldm.Plan(
        4, {"image": {"ranks": [0, 1, 2, 3], "tp": 2, "sp": True, "shard": "optimizer"}, "text": {"ranks": [0]}}
    ),
    # each pipeline stage's parameters over that stage's replicas
    "image-pp2xzero1-2": ldm.Plan(
        4, {"image": {"ranks": [0, 1, 2, 3], "pp": 2, "shard": "optimizer"}, "text": {"ranks": [0, 2]}}
    ),
    # the replicas and the cp ranks together share the state
    "image-cp2xzero1-2": ldm.Plan(
        4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "shard": "optimizer"}, "text": {"ranks": [0]}}
    ),
    "gpipe-mb3": ldm.Plan(
        3, {"image": {"ranks": [0, 1], "shard": "optimizer", "microbatch": 3}, "text": {"ranks": [2]}}
    ),
    "cached-mb2": ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "shard": "optimizer", "microbatch": 2, "schedule": "cached"},
            "text": {"ranks": [2], "microbatch": 2, "schedule": "cached"},
        },
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPOSED))
def test_zero1_composes(name, tmp_path):
    plan = COMPOSED[name]
    make = (
        (lambda: DeepCLIP("adamw", lr=0.01))
        if ("tp2" in name or "pp2" in name)
        else (lambda: TinyCLIP("adamw", lr=0.01))
    )
    compare_with_reference(make, plan, plan.world_size, 10, 3, tmp_path).assert_exact()


@pytest.mark.slow
def test_accumulation_and_clipping_with_zero1(tmp_path):
    """Lightning accumulates 2 batches (the reduce-scatter runs once, in the optimizer step's
    backward) and clips at a global norm of 0.05 (active), each rank's pieces counted once."""
    plan = ldm.Plan(
        3, {"image": {"ranks": [0, 1], "shard": "optimizer"}, "text": {"ranks": [1, 2], "shard": "optimizer"}}
    )
    result = compare_with_reference(
        lambda: TinyCLIP("adamw", lr=0.01),
        plan,
        3,
        8,
        3,
        tmp_path,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    )
    result.assert_exact()
    assert len(result.distributed_losses) == 6


class _StateSizes(L.Callback):
    """Each rank writes how many optimizer-state elements it holds and the size of the towers it holds."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        state = sum(v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        held = sum(p.numel() for p in pl_module.visual.parameters() if not p.is_meta)
        with open(f"{self.out}.{trainer.global_rank}", "w") as f:
            json.dump({"state": state, "image": held}, f)


@pytest.mark.slow
def test_each_replica_holds_the_state_of_its_share(tmp_path):
    """AdamW keeps two tensors per parameter: a ZeRO-1 image tower over 3 replicas holds 2/3 of its
    size in state per rank (up to the padding of its buckets), where shard: none holds twice its size."""
    from distmm_testing import loader, run_distmm

    sizes = {}
    for shard in ("optimizer", "none"):
        plan = ldm.Plan(4, {"image": {"ranks": [0, 1, 2], "shard": shard}, "text": {"ranks": [3]}})
        out = tmp_path / shard
        run_distmm(
            TinyCLIP("adamw", lr=0.01),
            plan,
            4,
            loader(9),
            1,
            str(tmp_path / "l.json"),
            callbacks=[_StateSizes(str(out))],
        )
        sizes[shard] = [json.loads((tmp_path / f"{shard}.{r}").read_text()) for r in range(3)]
    whole = sizes["none"][0]["image"]
    assert all(s["state"] == 2 * whole for s in sizes["none"])
    for s in sizes["optimizer"]:
        assert 2 * (whole // 3) - 8 <= s["state"] <= 2 * (whole // 3 + 8), (s, whole)
    assert sum(s["state"] for s in sizes["optimizer"]) == 2 * whole


@pytest.mark.slow
def test_a_non_elementwise_optimizer_is_refused(tmp_path):
    class LbfgsCLIP(TinyCLIP):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    from distmm_testing import loader, run_distmm

    plan = ldm.Plan(2, {"image": {"ranks": [0, 1], "shard": "optimizer"}, "text": {"ranks": [0, 1]}})
    with pytest.raises(Exception, match=r"shard: optimizer \(ZeRO-1\).*LBFGS"):
        run_distmm(LbfgsCLIP(), plan, 2, loader(4), 1, str(tmp_path / "l.json"))
