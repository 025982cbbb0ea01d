"""What stepping a param group one parameter at a time costs against torch's multi-tensor kernels.

    python benchmarks/optimizer_kernels.py            # CUDA when there is one, else the CPU
    python benchmarks/optimizer_kernels.py --rounds 20

A param group that mixes a sharded tower's DTensors with plain parameters steps with
``foreach=False`` (``lightning_distmm/parallel/optimizer_kernels.py``). This times AdamW and SGD
(momentum) over the parameters of a timm ViT-B/16 and a CLIP ViT-B/32 text tower (built from
configs, nothing downloaded), both kinds side by side in one run: the median step, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
from transformers import CLIPTextConfig, CLIPTextModel


def parameters(device: torch.device) -> list[torch.nn.Parameter]:
    vit = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)
    text = CLIPTextModel(CLIPTextConfig())
    params = [p for m in (vit, text) for p in m.parameters()]
    for p in params:
        p.data = p.data.to(device)
        p.grad = torch.randn_like(p) * 1e-3
    return params


def step_seconds(make, params: list[torch.nn.Parameter], rounds: int, device: torch.device) -> float:
    optimizer = make(params)
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
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = parameters(device)
    count = sum(p.numel() for p in params)
    print(f"{len(params)} parameter tensors, {count / 1e6:.0f}M values, on {device}")
    makers = {
        "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-4, foreach=fe),
        "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=fe),
    }
    print(f"{'optimizer':10} {'multi-tensor ms':>16} {'per-parameter ms':>17} {'ratio':>6}")
    for name, make in makers.items():
        fast = step_seconds(lambda ps: make(ps, True), params, args.rounds, device)
        slow = step_seconds(lambda ps: make(ps, False), params, args.rounds, device)
        print(f"{name:10} {fast * 1e3:16.2f} {slow * 1e3:17.2f} {slow / fast:6.2f}")


if __name__ == "__main__":
    main()
