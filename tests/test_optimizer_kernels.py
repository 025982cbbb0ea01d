"""A param group that mixes a sharded tower's DTensors with plain parameters steps on every device.

torch picks its multi-tensor (``foreach``) kernels by default on CUDA only; here they are asked for
explicitly, which takes the path CUDA takes by default (one-rank gloo group, in this process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_distmm.parallel.optimizer_kernels import prepare_mixed_groups


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def towers(mesh=None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict({"image": nn.Linear(6, 4), "text": nn.Linear(5, 4)})
    model.scale = nn.Parameter(torch.tensor(2.0))
    if mesh is not None:
        fully_shard(model["image"], mesh=mesh)
    return model


def step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        out = model["image"](torch.randn(3, 6)).sum() + model["text"](torch.randn(3, 5)).pow(2).sum()
        (out * model.scale).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


OPTIMIZERS = {
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, **kw),
    "adamw-fused": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, **{"fused": True, **kw, "foreach": None}),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_mixed_group_steps_with_its_kernels_split_by_kind(one_rank, name):
    make = OPTIMIZERS[name]
    reference = towers()
    optimizer = make(reference.parameters(), foreach=False)
    step(reference, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))

    broken = towers(one_rank)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        step(broken, make(broken.parameters(), foreach=True))  # what a CUDA run met before

    mixed = towers(one_rank)
    optimizer = make(mixed.parameters(), foreach=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    (done,) = prepare_mixed_groups([optimizer])
    assert (done.optimizer, done.group, done.remedy) == (0, 0, "split")
    assert done.kinds == ("DTensor on mesh [0] (1,)", "plain tensors")
    assert "runs the multi-tensor kernels once per kind" in done.describe()
    groups = optimizer.param_groups
    step(mixed, optimizer, scheduler)
    assert optimizer.param_groups is groups and len(groups) == 1  # the user's group, back after each step
    assert groups[0]["lr"] == pytest.approx(0.01 * 0.5**3 if "adamw" in name else 0.1 * 0.5**3)
    for (key, want), got in zip(reference.named_parameters(), mixed.parameters(), strict=True):
        torch.testing.assert_close(full(got), want, msg=key)


def test_other_optimizers_step_one_parameter_at_a_time(one_rank):
    """An optimizer this package does not know may read the whole group: it is not split."""

    class MySGD(torch.optim.SGD):
        pass

    model = towers(one_rank)
    optimizer = MySGD(model.parameters(), lr=0.1, foreach=True)
    (done,) = prepare_mixed_groups([optimizer])
    assert (done.remedy, done.asked) == ("per-parameter", "foreach=True")
    assert "steps one parameter at a time; foreach=True overridden" in done.describe()
    assert optimizer.param_groups[0]["foreach"] is False
    step(model, optimizer)


def test_groups_of_one_kind_keep_their_kernels(one_rank):
    model = towers(one_rank)
    optimizer = torch.optim.SGD(
        [{"params": model["image"].parameters()}, {"params": [*model["text"].parameters(), model.scale]}],
        lr=0.1,
        foreach=True,
    )
    assert prepare_mixed_groups([optimizer]) == []
    assert [g["foreach"] for g in optimizer.param_groups] == [True, True]
    step(model, optimizer)  # the multi-tensor kernels take each group
