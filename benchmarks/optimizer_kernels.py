"""What a param group mixing DTensor and plain parameters costs to step, by remedy.

    python benchmarks/optimizer_kernels.py            # CUDA when there is one, else the CPU
    python benchmarks/optimizer_kernels.py --rounds 20

The parameters of a timm ViT-B/16 and a CLIP ViT-B/32 text tower (built from configs, nothing
downloaded), in one param group, AdamW and SGD (momentum), side by side in one run, median step:

* ``multi-tensor``: every parameter plain, torch's multi-tensor kernels (the floor);
* ``per-parameter``: the same, ``foreach=False`` (what a mixed group of an optimizer this package
  does not know gets, ``lightning_distmm/parallel/optimizer_kernels.py``);
* ``split``: the ViT sharded with FSDP2 over a one-rank mesh (its parameters DTensors), the text
  tower plain, the group split by kind for the step (what torch's own optimizers get).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import timm
import torch
import torch.distributed as dist
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel

from lightning_distmm.parallel.optimizer_kernels import prepare_mixed_groups


def towers(device: torch.device, mesh: object | None = None) -> list[nn.Parameter]:
    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0).to(device)
    text = CLIPTextModel(CLIPTextConfig()).to(device)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(vit, mesh=mesh)
    params = [p for m in (vit, text) for p in m.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def step_seconds(optimizer: torch.optim.Optimizer, rounds: int, device: torch.device) -> float:
    times = []
    for i in range(rounds + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:  # the first steps create the state
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,))
    plain, mixed = towers(device), towers(device, mesh)
    print(f"{len(plain)} parameter tensors, {sum(p.numel() for p in plain) / 1e6:.0f}M values, on {device}")
    makers: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-4, foreach=fe),
        "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=fe),
    }
    print(
        f"{'optimizer':10} {'multi-tensor ms':>16} {'per-parameter ms':>17} {'split ms':>9}  per-param/multi  split/multi"
    )
    for name, make in makers.items():
        fast = step_seconds(make(plain, True), args.rounds, device)
        slow = step_seconds(make(plain, False), args.rounds, device)
        split_optimizer = make(mixed, True)
        assert [g.remedy for g in prepare_mixed_groups([split_optimizer])] == ["split"]
        split = step_seconds(split_optimizer, args.rounds, device)
        print(
            f"{name:10} {fast * 1e3:16.2f} {slow * 1e3:17.2f} {split * 1e3:9.2f}"
            f"  {slow / fast:15.2f}  {split / fast:11.2f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
