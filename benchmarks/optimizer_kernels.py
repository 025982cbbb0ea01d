"""What a param group mixing DTensor and plain parameters costs to step, by remedy.

    python benchmarks/optimizer_kernels.py            # CUDA when there is one, else the CPU
    python benchmarks/optimizer_kernels.py --rounds 20

The parameters of a timm ViT-B/16 and a CLIP ViT-B/32 text tower (built from configs, nothing
downloaded), in one param group, AdamW and SGD (momentum), side by side in one run, median step:

* ``plain``: every parameter plain, torch's multi-tensor kernels (the floor);
* ``all DTensor``: both towers sharded with FSDP2 over a one-rank mesh, multi-tensor kernels (what a
  model sharded whole, torchtitan's way, pays for DTensor's dispatch);
* then the ViT sharded, the text tower plain, in one group (DistMM's mix):
  ``mixed, per-parameter`` with ``foreach=False`` (what an optimizer this package does not know
  gets, ``lightning_distmm/parallel/optimizer_kernels.py``) and ``mixed, split`` with the group
  split by kind for the step (what torch's own optimizers get).
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


def towers(device: torch.device, mesh: object | None = None, shard_text: bool = False) -> list[nn.Parameter]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0).to(device)
    text = CLIPTextModel(CLIPTextConfig()).to(device)
    if mesh is not None:
        fully_shard(vit, mesh=mesh)
    if shard_text:
        fully_shard(text, mesh=mesh)
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
    plain, sharded, mixed = towers(device), towers(device, mesh, shard_text=True), towers(device, mesh)
    print(f"{len(plain)} parameter tensors, {sum(p.numel() for p in plain) / 1e6:.0f}M values, on {device}")
    makers: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-4, foreach=fe),
        "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=fe),
    }
    columns = ["plain", "all DTensor", "mixed, per-parameter", "mixed, split"]
    print("median step ms (x plain)")
    print(f"{'optimizer':10}" + "".join(f"{c:>24}" for c in columns))
    for name, make in makers.items():
        per_parameter, split = make(mixed, False), make(mixed, True)
        assert [g.remedy for g in prepare_mixed_groups([split])] == ["split"]
        optimizers = [make(plain, True), make(sharded, True), per_parameter, split]
        seconds = [step_seconds(o, args.rounds, device) for o in optimizers]
        cells = [f"{s * 1e3:.2f} ({s / seconds[0]:.2f}x)" for s in seconds]
        print(f"{name:10}" + "".join(f"{c:>24}" for c in cells))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
