"""Per-rank memory of a ~50M-parameter tower on 4 CPU ranks: ``shard: none`` against ``shard: optimizer``
(ZeRO-1) and ``shard: full`` (ZeRO-3).

Each configuration runs in fresh processes (4 gloo ranks, spawned) so that peak RSS is its own.
A timm ViT tower (~50M parameters) trains a few AdamW steps, as the runtime runs it:

* ``none``: every rank builds and holds the whole tower; gradients are summed over the ranks
  (:func:`lightning_distmm.parallel.exchange.allreduce_sum`, the runtime's sums);
* ``optimizer``: every rank builds and holds the whole tower; at the end of the backward the
  gradients are reduce-scattered over the ranks into each rank's quarter, AdamW steps that quarter
  (its state allocated for it alone) and the updated quarters are all-gathered into every rank's
  weights (:class:`lightning_distmm.parallel.optimizer_shards.OptimizerShards` through the same
  optimizer hooks the strategy installs). The whole gradients are freed after the reduce-scatter,
  so the ``grads`` column (held after the step) is 0 there; the step peak includes them. Its
  ``optim`` column counts the AdamW state of the quarter and the quarter's copy of the weights that
  AdamW steps (Megatron's sharded main weights);
* ``full``: every rank builds the whole tower, then
  :func:`lightning_distmm.parallel.fsdp.apply_fsdp` shards it over a 1-D mesh of the 4 ranks (what
  the runtime applies to a tower with ``shard: full``);
* ``full+meta``: the tower is built on the meta device
  (:func:`lightning_distmm.parallel.deferred.deferred_init`, what ``trainer.init_module(empty_init=True)``
  does under distmm), sharded there, and each rank materialises only its shards, with the values
  of the seeded construction (checked against ``none``'s weights, bit for bit).

Measured on every rank: bytes of the tensors it holds after the last step (a DTensor counts its
local shard: parameters, gradients, optimizer state); the process's RSS once its imports and
process group are up (the floor every configuration shares), its peak while building and
sharding the tower, its peak over the steps, and its RSS once the steps are done. Prints a table per configuration (the largest rank), the
ratios against ``none`` and the step-time ratio. By default glibc's mmap threshold is fixed at
1 MiB in every rank, so that the peak RSS measures what was live rather than what glibc's heap
kept of freed buffers (``--malloc glibc`` measures with its adaptive default). Usage:
``python benchmarks/sharding_memory.py [--steps 3] [--depth 16] [--width 512] [--malloc fixed|glibc]``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
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


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """The process's peak RSS since the last :func:`_reset_peak` (Linux's VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    """Start a new peak-RSS window (``echo 5 > /proc/self/clear_refs``, Linux 4.0+); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(rank: int, shard: str, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.malloc == "fixed":
        # M_MMAP_THRESHOLD fixed at 1 MiB (as MALLOC_MMAP_THRESHOLD_=1048576 would): tensors of 1 MiB and
        # more get their own mappings, returned to the OS when freed. glibc's default raises the threshold
        # after each large free, so the transient buffers of later steps (FSDP's all-gathers and
        # reduce-scatters, activations) stay in its heap and the peak RSS counts memory nothing holds
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from lightning_distmm.parallel.deferred import deferred_init, materialize, tensor_refs
    from lightning_distmm.parallel.exchange import allreduce_sum
    from lightning_distmm.parallel.fsdp import apply_fsdp
    from lightning_distmm.parallel.optimizer_kernels import prepare_mixed_groups
    from lightning_distmm.parallel.optimizer_shards import OptimizerShards
    from lightning_distmm.parallel.prepare import return_freed_memory

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    return_freed_memory()
    rss_floor = _rss()
    windows = _reset_peak()
    if shard == "full+meta":
        with deferred_init():
            model = _tower(args.depth, args.width)
        refs = tensor_refs(model)
        apply_fsdp(model, mesh)
        materialize(model, refs, torch.device("cpu"))
    else:
        model = _tower(args.depth, args.width)
        if shard == "full":
            apply_fsdp(model, mesh)
    build_peak = _peak()
    n_params = sum(p.numel() for p in model.parameters())
    # the weights as built, for the check that every configuration starts from the same ones
    first = {k: _digest(v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    return_freed_memory()
    rss_built = _rss()
    windows = _reset_peak() and windows
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shards = None
    if shard == "optimizer":
        shards = OptimizerShards({"tower": (list(model.parameters()), None)}, 25 * 2**20)
        prepare_mixed_groups([optimizer], shards)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, 3, 32, 32, generator=g)
        start = time.perf_counter()
        model(x).square().mean().backward()
        if shard == "none":
            allreduce_sum([p.grad for p in model.parameters()])
        if shards is not None:
            shards.towers["tower"].reduce_scatter()
        optimizer.step()
        times.append(time.perf_counter() - start)
        if _ < args.steps - 1:
            optimizer.zero_grad(set_to_none=True)
    step_peak = _peak()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if shards is not None:  # the pieces the optimizer steps (Megatron's sharded main weights) are its state too
        state += [piece.main for piece in shards.towers["tower"].pieces.values()]
    return_freed_memory()  # malloc_trim: what the rank holds now, not what glibc kept
    row = {
        "rss_floor": rss_floor,
        "rss_built": rss_built,
        "rss_now": _rss(),
        "build_peak": build_peak,
        "step_peak": step_peak,
        "windows": windows,
        "first": first,
        "params": _bytes(params),
        "grads": _bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": _bytes(state),
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


CONFIGS = ("none", "optimizer", "full", "full+meta")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--malloc",
        choices=["fixed", "glibc"],
        default="fixed",
        help="fixed: glibc's mmap threshold at 1 MiB (freed tensors leave the RSS); glibc: its adaptive default",
    )
    args = parser.parse_args()
    results = {shard: measure(shard, args) for shard in CONFIGS}
    mib = 2**20
    print(
        f"tower: timm ViT depth {args.depth} width {args.width}, {results['none'][0]['n_params'] / 1e6:.1f}M"
        f" parameters, {WORLD} CPU ranks (gloo), AdamW, batch {args.batch} per rank, malloc {args.malloc}"
    )
    windows = all(r["windows"] for rows in results.values() for r in rows)
    print(
        "MiB per rank (the largest rank of each); RSS above the floor every configuration shares (imports,"
        f" process group: {max(r['rss_floor'] for r in results['none']) / mib:.0f} MiB): peak while building"
        " (and sharding) the tower, peak over the steps, and once the steps are done"
        + ("" if windows else " (peaks not reset between phases here: each includes the earlier ones)")
    )
    print(
        f"{'shard':<10} {'params':>7} {'grads':>7} {'optim':>7} {'tensors':>8} {'build peak':>11} {'step peak':>10}"
        f" {'RSS after':>10} {'step s':>7}"
    )
    worst = {}
    for shard, rows in results.items():
        top = max(rows, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        total = top["params"] + top["grads"] + top["optimizer"]
        build = max(r["build_peak"] - r["rss_floor"] for r in rows)
        peak = max(r["step_peak"] - r["rss_floor"] for r in rows)
        after = max(r["rss_now"] - r["rss_floor"] for r in rows)
        step = max(r["step_s"] for r in rows)
        worst[shard] = {"tensors": total, "build": build, "peak": peak, "after": after, "step": step}
        print(
            f"{shard:<10} {top['params'] / mib:>7.1f} {top['grads'] / mib:>7.1f} {top['optimizer'] / mib:>7.1f}"
            f" {total / mib:>8.1f} {build / mib:>11.1f} {peak / mib:>10.1f} {after / mib:>10.1f} {step:>7.3f}"
        )
    none = worst["none"]
    for shard in CONFIGS[1:]:
        w = worst[shard]
        ratio = w["tensors"] / none["tensors"]
        print(
            f"{shard} / none: tensors {ratio:.3f} (1/{1 / ratio:.2f}), build peak {w['build'] / none['build']:.3f},"
            f" step peak {w['peak'] / none['peak']:.3f}, RSS after the steps {w['after'] / none['after']:.3f},"
            f" step time {w['step'] / none['step']:.2f}x"
        )
    same = all(rows[0]["first"] == results["none"][0]["first"] for rows in results.values())
    print(f"every configuration starts from the seeded construction's weights (sha256 of each tensor): {same}")
    print(
        "full builds the whole tower on every rank before sharding it (its build peak is none's);"
        " full+meta holds one tensor of the tower whole at a time"
    )


if __name__ == "__main__":
    main()
