"""Per-rank memory of a ~50M-parameter tower on 4 CPU ranks: ``shard: none`` against ``shard: full``.

Each configuration runs in fresh processes (4 gloo ranks, spawned) so that peak RSS is its own.
A timm ViT tower (~50M parameters) trains a few AdamW steps, as the runtime runs it:

* ``none``: every rank holds the whole tower; gradients are summed over the ranks
  (:func:`lightning_distmm.parallel.exchange.allreduce_sum`, the runtime's sums);
* ``full``: :func:`lightning_distmm.parallel.fsdp.apply_fsdp` over a 1-D mesh of the 4 ranks (what
  the runtime applies to a tower with ``shard: full``).

Measured on every rank after the last step, from the tensors the rank holds (a DTensor counts its
local shard): bytes of parameters, of gradients and of optimizer state; and the process's peak
RSS. Prints a table per configuration (the largest rank), the full/none ratios and the step-time
ratio. Usage: ``python benchmarks/sharding_memory.py [--steps 3] [--depth 16] [--width 512]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from timm.models.vision_transformer import VisionTransformer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

WORLD = 4


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _tower(depth: int, width: int) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(
        img_size=32, patch_size=8, embed_dim=width, depth=depth, num_heads=8, num_classes=512, qkv_bias=False
    )


def _worker(rank: int, shard: str, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from lightning_distmm.parallel.exchange import allreduce_sum
    from lightning_distmm.parallel.fsdp import apply_fsdp

    model = _tower(args.depth, args.width)
    n_params = sum(p.numel() for p in model.parameters())
    if shard == "full":
        apply_fsdp(model, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, 3, 32, 32, generator=g)
        start = time.perf_counter()
        model(x).square().mean().backward()
        if shard == "none":
            allreduce_sum([p.grad for p in model.parameters()])
        optimizer.step()
        times.append(time.perf_counter() - start)
        if _ < args.steps - 1:
            optimizer.zero_grad(set_to_none=True)
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    from lightning_distmm.parallel.prepare import return_freed_memory

    return_freed_memory()  # malloc_trim: what the rank holds now, not what glibc kept
    with open("/proc/self/statm") as f:
        rss_now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    row = {
        "rss_now": rss_now,
        "params": _bytes(params),
        "grads": _bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": _bytes(state),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times[1:] or times),
        "n_params": n_params,
    }
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(repr(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(shard: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.txt")
        mp.start_processes(_worker, args=(shard, args, _free_port(), out), nprocs=WORLD, start_method="spawn")
        return eval(Path(out).read_text())  # noqa: S307 - our own repr of plain dicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    results = {shard: measure(shard, args) for shard in ("none", "full")}
    mib = 2**20
    print(
        f"tower: timm ViT depth {args.depth} width {args.width}, {results['none'][0]['n_params'] / 1e6:.1f}M"
        f" parameters, {WORLD} CPU ranks (gloo), AdamW, batch {args.batch} per rank"
    )
    print(
        f"{'shard':<6} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'sum MiB':>9} {'peak RSS MiB':>13}"
        f" {'RSS after MiB':>14} {'step s':>8}"
    )
    worst = {}
    for shard, rows in results.items():
        top = max(rows, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        total = top["params"] + top["grads"] + top["optimizer"]
        rss = max(r["rss"] for r in rows)
        rss_now = max(r["rss_now"] for r in rows)
        step = max(r["step_s"] for r in rows)
        worst[shard] = (total, rss, step, rss_now)
        print(
            f"{shard:<6} {top['params'] / mib:>11.1f} {top['grads'] / mib:>10.1f} {top['optimizer'] / mib:>10.1f}"
            f" {total / mib:>9.1f} {rss / mib:>13.1f} {rss_now / mib:>14.1f} {step:>8.3f}"
        )
    ratio = worst["full"][0] / worst["none"][0]
    print(
        f"full / none: tensors {ratio:.3f} (1/{1 / ratio:.2f}), peak RSS {worst['full'][1] / worst['none'][1]:.3f},"
        f" RSS after the steps {worst['full'][3] / worst['none'][3]:.3f}, step time {worst['full'][2] / worst['none'][2]:.2f}x"
    )
    print(
        "peak RSS includes building the whole tower on every rank before it is sharded (the runtime is handed"
        " the user's materialized module); RSS after the steps is what the rank holds once sharded"
    )


if __name__ == "__main__":
    main()
