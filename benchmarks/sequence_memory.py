"""Activation memory per rank of a long-sequence ViT tower: cp 1 / 2 / 4, tp2 with and without sp.

Each configuration runs in fresh gloo processes on the CPU (spawned; as many as it has ranks). A
timm ViT with many patches (default 224 px at patch 8: 784 patches + the class token = 785
tokens) is prepared as the runtime prepares a tower of that plan: ``apply_cp`` over the ranks
(``cp``), ``apply_tp`` over a 1-D tp mesh (``tp2``), then ``apply_sp`` (``tp2+sp``). Every rank
runs the same forward on the same images with autograd on; a saved-tensor hook records every
tensor the forward keeps for backward (each storage once, the parameters excluded): the bytes
each rank holds for backward, the activation memory the plan changes. The table shows the largest
rank, its ratio to ``cp1`` (or ``tp2`` for ``tp2+sp``), and beside it the cost model's
prediction for the same tower (``planner.cost.memory.act_per_sample`` with the ``cp`` / ``sp``
arguments, fp32; attention probabilities counted when ``--probs`` says the CPU kernel keeps them,
which the script finds out by measuring). A backward checks that the prepared tower trains.

``--list tp2+sp`` (any config) also prints rank 0's saved tensors one by one: the module that
saved each, its shape and megabytes (how the sp scheme was checked: nothing of the whole sequence
at full width is kept inside a block).

Usage: ``python benchmarks/sequence_memory.py [--img 224] [--patch 8] [--width 64] [--depth 2]
[--heads 4] [--batch 2] [--list CONFIG]``.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from timm.models.vision_transformer import VisionTransformer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_distmm.parallel.families import apply_cp, apply_sp, apply_tp
from lightning_distmm.planner.cost.memory import act_per_sample
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.profiles.profile import tower_profile

#: name -> (ranks, cp, tp, sp)
CONFIGS = {
    "cp1": (1, 1, 1, False),
    "cp2": (2, 2, 1, False),
    "cp4": (4, 4, 1, False),
    "tp2": (2, 1, 2, False),
    "tp2+sp": (2, 1, 2, True),
}


def _tower(args: argparse.Namespace) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(
        img_size=args.img,
        patch_size=args.patch,
        embed_dim=args.width,
        depth=args.depth,
        num_heads=args.heads,
        num_classes=64,
        qkv_bias=False,
    )


def _saved_bytes(model: torch.nn.Module, images: torch.Tensor, listing: list | None = None) -> tuple[int, torch.Tensor]:
    """Bytes of the storages the forward saves for backward (parameters excluded), and the output;
    ``listing`` gets (module, shape, bytes) of each storage when given."""
    stack = ["(tower)"]
    if listing is not None:
        for name, sub in model.named_modules():
            sub.register_forward_pre_hook(lambda m, a, n=name: stack.append(n))
            sub.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1])
    params = set()
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        params.add(local.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.data_ptr() not in params and storage.device.type != "meta":
            if listing is not None and storage.data_ptr() not in seen:
                listing.append((stack[-1], tuple(t.shape), storage.nbytes()))
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(images)
    return sum(seen.values()), out


def _worker(rank: int, world: int, port: int, name: str, args: argparse.Namespace, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _, cp, tp, sp = CONFIGS[name]
    model = _tower(args)
    if tp > 1:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        apply_tp(model, mesh, sp=sp)
        if sp:
            apply_sp(model, mesh)
    if cp > 1:
        apply_cp(model, dist.group.WORLD, cp, rank)
    images = torch.randn(args.batch, 3, args.img, args.img, generator=torch.Generator().manual_seed(1))
    listing: list | None = [] if args.list == name and rank == 0 else None
    saved, out = _saved_bytes(model, images, listing)
    out.square().mean().backward()  # the prepared tower trains (every rank runs the same backward)
    results[(name, rank)] = saved
    if listing is not None:
        results[("list", name)] = listing
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probs_kept(args: argparse.Namespace) -> bool:
    """Whether the CPU attention keeps its probabilities for backward (one head's [S, S] per sample):
    the saved bytes of a one-block tower with and without attention scores tell."""
    s = (args.img // args.patch) ** 2 + 1
    q = torch.randn(args.batch, args.heads, s, args.width // args.heads, requires_grad=True)
    seen: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.numel()) or t, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    return max(seen) >= args.batch * args.heads * s * s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--list", choices=list(CONFIGS), help="print this config's saved tensors (rank 0)")
    args = ap.parse_args()
    manager = mp.Manager()
    results = manager.dict()
    for name, (ranks, *_) in CONFIGS.items():
        mp.spawn(_worker, args=(ranks, _free_port(), name, args, results), nprocs=ranks)
    probs = _probs_kept(args)
    opts = CostOptions(precision="fp32", flash_attention=not probs)
    cfg = {
        "arch": "vit",
        "img_size": args.img,
        "patch_size": args.patch,
        "width": args.width,
        "layers": args.depth,
        "heads": args.heads,
    }
    profile = tower_profile("image", cfg, 64)
    tokens = profile.seq
    print(
        f"ViT {args.img}px / patch {args.patch}: {tokens} tokens, width {args.width}, {args.depth} blocks,"
        f" {args.heads} heads, batch {args.batch}, fp32 (attention probabilities kept by the CPU kernel: {probs})"
    )
    head = f"{'config':<8} {'measured MB/rank':>17} {'ratio':>7} {'predicted MB':>13} {'ratio':>7}"
    print(head)
    measured, predicted = {}, {}
    for name, (ranks, cp, tp, sp) in CONFIGS.items():
        measured[name] = max(results[(name, r)] for r in range(ranks))
        predicted[name] = float(act_per_sample(profile, opts, tp, 1, 1.0, cp=cp, sp=sp)) * args.batch
        base = "tp2" if name == "tp2+sp" else "cp1"
        print(
            f"{name:<8} {measured[name] / 2**20:>17.2f} {measured[name] / measured[base]:>7.3f}"
            f" {predicted[name] / 2**20:>13.2f} {predicted[name] / predicted[base]:>7.3f}"
            + ("   (vs tp2)" if base == "tp2" else "")
        )
    if args.list:
        print(f"\n{args.list}, rank 0: saved tensors (module, shape of the saved view, MB of its storage)")
        for where, shape, nbytes in results[("list", args.list)]:
            print(f"  {where:<24} {str(shape):<22} {nbytes / 2**20:7.3f}")


if __name__ == "__main__":
    main()
