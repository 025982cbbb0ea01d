"""A tower's training step eager against compiled (``compile: true``: each block through torch.compile,
inductor), side by side in one run on this machine's CPU or GPU.

    python benchmarks/compile_step.py                      # the main job's towers and a ViT-B/16
    python benchmarks/compile_step.py --rounds 20 --only vit_b16

For each tower two copies from the same weights: one eager, one with its blocks compiled by the
runtime's own :func:`lightning_distmm.parallel.compile.compile_tower`. A step is the tower's forward
on one replica batch, a loss on its features (their squared mean: the tower's share of a loss),
the backward and an AdamW step. Printed per tower:

* the compile time: the compiled copy's first step minus the eager median (torch compiles the
  forward and backward graphs then), and the first step at a second batch size (the batch
  dimension is marked dynamic, so that step should cost a step, not a compile);
* the median step of each, measured in alternating rounds, and their ratio;
* the difference to eager: the features of the first step, its gradients (largest difference over
  largest value) and every weight after all steps (compiled kernels sum in another order: this is
  the float reordering, not an error; AdamW's normalised update turns it into up to a few times the
  learning rate on weights whose gradient is near zero).

The compile time is a first run's: inductor's on-disk cache starts empty (``--warm-cache`` keeps the
usual one, what a second run of the same job sees).

Towers: ``clip_tiny`` image and text (the main job's, ``python recipes/train.py``: each tower its
own rank, so each sees the global batch of 64) and a timm ViT-B/16 (86M parameters) at 4 images of
224 pixels, a small per-GPU batch.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import timm
import torch
from torch import Tensor, nn

from lightning_distmm.models.clip import CLIPModel
from lightning_distmm.parallel.compile import compile_tower


@dataclass
class Case:
    name: str
    module: nn.Module
    batch: Callable[[int], Mapping[str, Any]]
    encode: Callable[[nn.Module, Mapping[str, Any]], Tensor]
    rows: int


def cases(device: torch.device) -> list[Case]:
    torch.manual_seed(0)
    clip = CLIPModel()
    g = torch.Generator().manual_seed(1)

    def images(size: int) -> Callable[[int], Mapping[str, Any]]:
        return lambda n: {"image": torch.randn(n, 3, size, size, generator=g).to(device)}

    def tokens(n: int) -> Mapping[str, Any]:
        ids = torch.randint(0, 64, (n, 16), generator=g)
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}

    towers = clip.towers()
    vit = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)
    return [
        Case("clip_tiny image", towers["image"].module, images(32), lambda m, b: m(b["image"]), 64),
        Case(
            "clip_tiny text",
            towers["text"].module,
            tokens,
            lambda m, b: m(b["input_ids"], b["attention_mask"]),
            64,
        ),
        Case("ViT-B/16", vit, images(224), lambda m, b: m(b["image"]), 4),
    ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step(
    case: Case, module: nn.Module, opt: torch.optim.Optimizer, batch: Mapping[str, Any], device: torch.device
) -> tuple[float, Tensor, list[Tensor]]:
    """One training step; its time, the features and the gradients it stepped with."""
    sync(device)
    start = time.perf_counter()
    features = case.encode(module, batch)
    features.float().square().mean().backward()
    grads = [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start, features.detach(), grads


def run(case: Case, rounds: int, device: torch.device) -> dict[str, Any]:
    eager = case.module.to(device).train()
    compiled = copy.deepcopy(eager)
    regions = compile_tower(case.name, compiled)
    opts = {
        "eager": torch.optim.AdamW(eager.parameters(), lr=1e-4),
        "compiled": torch.optim.AdamW(compiled.parameters(), lr=1e-4),
    }
    modules = {"eager": eager, "compiled": compiled}
    first_batch = case.batch(case.rows)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    t_eager, f_eager, g_eager = step(case, eager, opts["eager"], first_batch, device)
    t_first, f_compiled, g_compiled = step(case, compiled, opts["compiled"], first_batch, device)
    feature_diff = (f_eager.float() - f_compiled.float()).abs().max().item()
    # the gradients' largest difference against their largest value (relative: sums reordered)
    grad_diff = max((a - b).abs().max().item() for a, b in zip(g_eager, g_compiled)) / max(
        a.abs().max().item() for a in g_eager
    )
    times["eager"].append(t_eager)
    for _ in range(rounds):
        batch = case.batch(case.rows)
        for name in ("eager", "compiled") if _ % 2 == 0 else ("compiled", "eager"):
            times[name].append(step(case, modules[name], opts[name], batch, device)[0])
    other = case.batch(case.rows - 1)  # a second batch size: the dynamic batch dimension, no new compile
    t_other = step(case, compiled, opts["compiled"], other, device)[0]
    step(case, eager, opts["eager"], other, device)
    weight_diff = max(
        (a.float() - b.float()).abs().max().item() for a, b in zip(eager.parameters(), compiled.parameters())
    )
    eager_median, compiled_median = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {
        "eager": eager_median,
        "compiled": compiled_median,
        "compile": t_first - eager_median,
        "other_batch": t_other,
        "feature_diff": feature_diff,
        "grad_diff": grad_diff,
        "weight_diff": weight_diff,
        "params": sum(p.numel() for p in eager.parameters()) / 1e6,
        "failure": regions.failure,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds of one eager and one compiled step")
    ap.add_argument("--only", choices=["clip_tiny", "vit_b16"], default=None)
    ap.add_argument(
        "--warm-cache",
        action="store_true",
        help="use inductor's usual on-disk cache (default: a fresh one, so the compile time is a first run's)",
    )
    args = ap.parse_args()
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_step_")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"torch {torch.__version__}, {device.type}"
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else f", {torch.get_num_threads()} threads")
        + f", {args.rounds} rounds, AdamW, fp32"
    )
    header = (
        f"{'tower':<16} {'M params':>8} {'rows':>4} {'eager ms':>9} {'compiled ms':>11} {'speedup':>7}"
        f" {'compile s':>9} {'new batch ms':>12} {'features diff':>13} {'grads rel diff':>14} {'weights diff':>12}"
    )
    print(header)
    for case in cases(device):
        if args.only == "clip_tiny" and not case.name.startswith("clip_tiny"):
            continue
        if args.only == "vit_b16" and case.name != "ViT-B/16":
            continue
        r = run(case, args.rounds, device)
        print(
            f"{case.name:<16} {r['params']:>8.2f} {case.rows:>4} {r['eager'] * 1e3:>9.1f} {r['compiled'] * 1e3:>11.1f}"
            f" {r['eager'] / r['compiled']:>6.2f}x {r['compile']:>9.1f} {r['other_batch'] * 1e3:>12.1f}"
            f" {r['feature_diff']:>13.1e} {r['grad_diff']:>14.1e} {r['weight_diff']:>12.1e}"
            + (f"  (ran eagerly: {r['failure']})" if r["failure"] else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
