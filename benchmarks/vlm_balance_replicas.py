"""The straggler at many encoder replicas, with real kernels: each replica's encoder work timed on
one core, one replica after another, for each step's rows split by count and by cost.

``vlm_balance.py`` trains on real ranks, but this machine holds two, and the largest of two loads is
near their mean: the straggler the planner prices at 1.3-1.75x for InternVL-like data at 16-64
replicas cannot appear there. This script measures that regime's compute without pretending to run
it: for each step it draws a global batch of ``dp x rows`` samples (the images per sample of the
planner's workloads), assigns the rows to ``dp`` encoder replicas twice, by count (the plan's even
split in sample order) and by cost (the runtime's own ``balance_rows`` on ``n_images``, what
``DistMMStrategy(balance="cost")`` computes every step), and times each replica's forward and
backward of the demo VLM's vision tower (a timm ViT that runs only the images a row carries; 64 px
images in 8 px patches by default, so that an image's work outweighs a call's fixed cost as a
real tile's does: about 8 ms per call and 12 ms per image here) on its rows, one thread, the two splits alternating replica by replica. Reported per split, medians over
steps:

* ``busy slowest / mean``: the replicas' measured busy times, largest over mean (what balancing
  removes), beside the planner's price of it (``planner.vlm.profile.straggler``, its even-split and
  balanced models);
* ``encoder phase``: the slowest replica's time, which a parallel step waits for, and the ratio of
  the two splits.

What it is not: a parallel step. No communication, no language model, no contention between ranks:
a step of a VLM plan whose encoder is its bottleneck gains at most this ratio, and less as
the LLM's share grows.

    python benchmarks/vlm_balance_replicas.py --dp 8,16 --rows 1,2,4 --steps 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vlm_balance import PATCH, WIDTH, WORKLOADS  # noqa: E402

import lightning_distmm as ldm  # noqa: E402
from lightning_distmm.core.assignment import RowAssignment, balance_rows  # noqa: E402
from lightning_distmm.models.vlm import VisionProjector, tiny_vit  # noqa: E402
from lightning_distmm.planner.vlm.profile import VLMWorkload, straggler  # noqa: E402


def replica_rows(assignment: RowAssignment, dp: int) -> list[tuple[int, ...]]:
    """The sample rows of each encoder replica (one sync group)."""
    off = assignment.offsets("image", 0)
    return [assignment.rows(off[i], off[i + 1]) for i in range(dp)]


def time_replica(vision: torch.nn.Module, pixels: torch.Tensor, counts: torch.Tensor, repeats: int) -> float:
    """Seconds of one forward + backward of ``vision`` on these rows (the least of ``repeats``)."""
    best = float("inf")
    for _ in range(repeats):
        vision.zero_grad(set_to_none=True)
        start = time.perf_counter()
        vision(pixels, counts).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(WORKLOADS), default="internvl")
    parser.add_argument("--dp", default="8,16", help="encoder replicas")
    parser.add_argument("--rows", default="1,2,4", help="rows per encoder replica")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="timings per replica, the least kept")
    parser.add_argument("--vit-depth", type=int, default=8)
    parser.add_argument("--img", type=int, default=64, help="image side in pixels (8 px patches)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = WORKLOADS[args.workload]
    max_images = max(images)
    torch.manual_seed(0)
    img = args.img
    vit = tiny_vit(img_size=img, patch_size=PATCH, width=WIDTH, depth=args.vit_depth, heads=4)
    vision = VisionProjector(vit, WIDTH, 32)
    workload = VLMWorkload("llava15_7b", images=images)
    pixels_of = torch.randn(max(max_images, 1), 3, img, img)
    rng = random.Random(0)
    # warm the allocator and the kernels on every image count a replica can hold
    for k in range(1, max_images + 1):
        time_replica(vision, pixels_of[:k][None].expand(1, -1, -1, -1, -1).contiguous(), torch.tensor([k]), 2)
    print(
        f"{args.workload}-like images per sample {images}; encoder: the demo VLM's ViT (depth {args.vit_depth},"
        f" width {WIDTH}, {img} px in {PATCH} px patches), forward + backward per replica on one thread;"
        f" medians over {args.steps} steps"
    )
    print(
        "| dp | rows / replica | split | busy slowest / mean | planner's price | encoder phase ms |"
        " by count / by cost |"
    )
    print("|---|---|---|---|---|---|---|")
    for dp in (int(d) for d in args.dp.split(",")):
        plan = ldm.Plan(dp, {"image": {"ranks": list(range(dp))}, "llm": {"ranks": list(range(dp))}})
        for rows in (int(r) for r in args.rows.split(",")):
            n = dp * rows
            stats: dict[str, dict[str, list[float]]] = {m: {"ratio": [], "phase": []} for m in ("rows", "cost")}
            for _ in range(args.steps):
                counts = rng.choices(list(images), list(images.values()), k=n)
                splits = {
                    "rows": replica_rows(RowAssignment.even(plan, n), dp),
                    "cost": replica_rows(balance_rows(plan, n, {"image": [float(c) for c in counts]}), dp),
                }
                busy: dict[str, list[float]] = {"rows": [], "cost": []}
                for replica in range(dp):
                    for mode in ("rows", "cost") if replica % 2 == 0 else ("cost", "rows"):
                        mine = splits[mode][replica]
                        k = torch.tensor([counts[r] for r in mine])
                        pixels = pixels_of[None].expand(len(mine), -1, -1, -1, -1).clone()
                        for i, c in enumerate(k.tolist()):
                            pixels[i, c:] = 0
                        busy[mode].append(time_replica(vision, pixels, k, args.repeats))
                for mode, times in busy.items():
                    stats[mode]["ratio"].append(max(times) / (sum(times) / len(times)))
                    stats[mode]["phase"].append(max(times))
            phase = {m: statistics.median(s["phase"]) for m, s in stats.items()}
            for mode, label in (("rows", "by count"), ("cost", "by cost")):
                price = straggler(workload, rows, dp, balanced=mode == "cost")
                ratio = f"{phase['rows'] / phase['cost']:.2f}x" if mode == "cost" else ""
                print(
                    f"| {dp} | {rows} | {label} | {statistics.median(stats[mode]['ratio']):.2f} | {price:.2f} |"
                    f" {phase[mode] * 1e3:.1f} | {ratio} |"
                )


if __name__ == "__main__":
    main()
