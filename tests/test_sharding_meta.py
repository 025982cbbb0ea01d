"""Towers built on the meta device (``trainer.init_module(empty_init=True)``): each rank materialises
only what it holds, with the values an ordinary construction gives, and trains exactly like one process."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from distmm_testing import (
    DeepCLIP,
    LossRecorder,
    TinyCLIP,
    loader,
    max_param_diff,
    read_losses,
    run_reference,
    trainer_kwargs,
)
from test_sharding import QKVBiasCLIP
from torch.distributed.tensor import DTensor

import lightning_distmm as ldm
from lightning_distmm.parallel.deferred import deferred_init, materialize, tensor_refs


@pytest.mark.parametrize("make", [TinyCLIP, DeepCLIP, QKVBiasCLIP])
def test_deferred_construction_replays_the_seeded_init_exactly(make):
    """timm's ViT and transformers' CLIP text tower: meta while built, then every tensor bit for bit what
    an ordinary seeded construction gives; the generator ends where that construction leaves it."""
    torch.manual_seed(0)
    ordinary = make()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    with deferred_init():
        module = make()
    assert torch.equal(torch.get_rng_state(), after)  # later draws (a sampler's seed) match too
    refs = tensor_refs(module)
    assert refs and all(module.get_parameter(n).is_meta for n in refs if n in dict(module.named_parameters()))
    assert materialize(module, refs, torch.device("cpu")) == len(refs)
    assert torch.equal(torch.get_rng_state(), after)  # materialising draws from a forked generator
    for name, value in ordinary.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


def test_deferred_init_refuses_draws_it_cannot_replay():
    with pytest.raises(RuntimeError, match="draws random numbers into a tensor on cpu"):
        with deferred_init():
            torch.nn.Parameter(torch.randn(3, device="cpu"))


class Consolidated(L.Callback):
    """Rank 0 writes the whole trained model (assembled from every rank) and each rank the number of
    image-tower values it holds."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        from lightning_distmm.checkpoint import consolidated_state_dict

        state = consolidated_state_dict(trainer)
        if trainer.global_rank == 0:
            torch.save(state, Path(self.folder) / "weights.pt")
        image = [p for n, p in pl_module.named_parameters() if n.startswith("visual.") and not p.is_meta]
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in image)
        Path(self.folder, f"rank{dist.get_rank()}.json").write_text(json.dumps({"image": held}))


PLANS = {
    # image: 2 sharded pipeline stages per replica; text sharded over the last stages
    "image-pp2-sharded": (
        DeepCLIP,
        ldm.Plan(
            4,
            {
                "image": {"ranks": [0, 1, 2, 3], "pp": 2, "shard": "full", "microbatch": 2},
                "text": {"ranks": [1, 3], "shard": "full"},
            },
        ),
    ),
    # context parallelism: FSDP over the 2 replicas x 2 cp ranks, a quarter of the tower on each rank
    "image-dp2xcp2-sharded": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "shard": "full"}, "text": {"ranks": [0, 2]}}),
    ),
    # tensor parallelism inside each replica, FSDP across them (a qkv bias included)
    "image-tp2xfsdp2": (
        QKVBiasCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "tp": 2, "shard": "full"}, "text": {"ranks": [0, 2]}}),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_meta_built_towers_train_like_one_process(name, tmp_path):
    make, plan = PLANS[name]
    L.seed_everything(0)
    reference = make("sgd", lr=0.05)
    image = sum(p.numel() for p in reference.visual.parameters())
    run_reference(reference, loader(8), 3, str(tmp_path / "ref.json"))

    trainer = L.Trainer(
        devices=plan.world_size,
        max_steps=3,
        strategy=ldm.DistMMStrategy(plan=plan, start_method="fork"),
        callbacks=[LossRecorder(str(tmp_path / "dist.json")), Consolidated(str(tmp_path))],
        **trainer_kwargs(),
    )
    L.seed_everything(0)
    with trainer.init_module(empty_init=True):
        module = make("sgd", lr=0.05)
    assert all(p.is_meta for n, p in module.named_parameters() if n != "logit_scale")
    trainer.fit(module, loader(8))

    # the fork parent's module, built on meta, gets the trained weights (and its constructed buffers)
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    assert max_param_diff(reference, module) <= 1e-5
    trained = torch.load(tmp_path / "weights.pt")
    distributed = make("sgd", lr=0.05)
    distributed.load_state_dict(trained)
    assert max_param_diff(reference, distributed) <= 1e-5
    assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
    # each rank materialised only its shards of the image tower: about a quarter of it (2 x 2 ways)
    held = [json.loads((tmp_path / f"rank{r}.json").read_text())["image"] for r in range(plan.world_size)]
    assert max(held) < image * 0.4, (held, image)


def test_a_seed_set_inside_the_construction_is_replayed():
    def make():
        torch.manual_seed(3)  # as benchmarks and recipes often do inside their builders
        first = torch.nn.Linear(4, 4)
        torch.manual_seed(5)
        return torch.nn.Sequential(first, torch.nn.Linear(4, 2))

    torch.manual_seed(0)
    ordinary = make()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    with deferred_init():
        module = make()
    assert torch.equal(torch.get_rng_state(), after)
    materialize(module, tensor_refs(module), torch.device("cpu"))
    for name, value in ordinary.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name
