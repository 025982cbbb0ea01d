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

from lightning_distmm.parallel.optimizer_kernels import step_mixed_groups_per_parameter


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def towers() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"image": nn.Linear(6, 4), "text": nn.Linear(5, 4)})


def step(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        out = model["image"](torch.randn(3, 6)).sum() + model["text"](torch.randn(3, 5)).pow(2).sum()
        out.backward()
        optimizer.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps, foreach: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=foreach),
        lambda ps, foreach: torch.optim.AdamW(ps, lr=0.01, foreach=foreach),
    ],
    ids=["sgd", "adamw"],
)
def test_a_sharded_and_a_plain_tower_in_one_group_step_as_unsharded(one_rank, make):
    reference = towers()
    step(reference, make(reference.parameters(), False))

    broken = towers()
    fully_shard(broken["image"], mesh=one_rank)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        step(broken, make(broken.parameters(), True))  # what a CUDA run met before

    mixed = towers()
    fully_shard(mixed["image"], mesh=one_rank)

    optimizer = make(mixed.parameters(), True)
    (switched,) = step_mixed_groups_per_parameter([optimizer])
    assert (switched.optimizer, switched.group, switched.asked) == (0, 0, "foreach=True")
    assert switched.kinds == ("DTensor on mesh [0] (1,)", "plain tensors")
    assert "steps one parameter at a time; foreach=True overridden" in switched.describe()
    assert optimizer.param_groups[0]["foreach"] is False
    step(mixed, optimizer)
    for (name, want), got in zip(reference.named_parameters(), mixed.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor() if hasattr(got, "full_tensor") else got, want, msg=name)


def test_groups_of_one_kind_keep_their_kernels(one_rank):
    model = towers()
    fully_shard(model["image"], mesh=one_rank)
    optimizer = torch.optim.SGD(
        [{"params": model["image"].parameters()}, {"params": model["text"].parameters()}], lr=0.1, foreach=True
    )
    assert step_mixed_groups_per_parameter([optimizer]) == []
    assert [g["foreach"] for g in optimizer.param_groups] == [True, True]
    step(model, optimizer)  # the multi-tensor kernels take each group
