"""The collectives the side-by-side plans run, timed on the emulated two-node cluster itself.

``benchmarks/side_by_side_emulated.py`` prices each plan's collectives from loopback gloo measured
on an idle host and the link's tbf rate. This script times those collectives where the plans run
them: two network namespaces of 2 CPU ranks each (``placement_emulated``'s cluster, one ``torchrun``
per namespace, each namespace's ranks pinned to its half of the cores), at the sizes the plans use:

* ``world all-reduce``: the DDP plan's gradient sums over the 4 ranks (gloo's ring crosses the link);
* ``pairs across``: the Megatron-style plan's data-parallel sums, two 2-rank groups ({0,2}, {1,3})
  crossing the link at once, each with half the gradients (the tensor-parallel shards);
* ``pairs in node``: its tensor-parallel all-reduces, two 2-rank groups ({0,1}, {2,3}) each inside a
  namespace, both ranks of a pair on the same core, at one block's activation size;
* ``world all-gather`` / ``world reduce-scatter``: FSDP's per-unit collectives over the 4 ranks.

Each is timed alone (the median call) and between compute slices (a matmul loop that keeps the
node's cores busy, as a training step does): the added seconds per call, beyond the compute-only
loop, are what a collective costs a plan on this host. Printed with the cost model's price of the
same call (``planner.cost.comm``) on the same emulated cluster spec.

Needs root, ``ip netns`` and ``tc`` (as placement_emulated). About a minute per link rate.

    python benchmarks/collectives_emulated.py [--rate-mbit 263,2990] [--calls 12] [--slice-ms 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import placement_emulated as pe  # noqa: E402

FLOAT = 4  # bytes per fp32 element


def cases(model: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    """The plans' collectives on the side-by-side model at global ``batch``: name, group kind, op, bytes."""
    from lightning_distmm.models.clip import CLIPModel

    towers = CLIPModel(model, pe.OPTIM).towers()
    grads = {n: sum(p.numel() for p in t.module.parameters()) * FLOAT for n, t in towers.items()}
    img, txt = model["towers"]["image"], model["towers"]["text"]
    img_tokens = (img["img_size"] // img["patch_size"]) ** 2 + 1
    rows = batch // 2  # a tp2 x dp2 replica's rows
    act = {
        "image": rows * img_tokens * img["width"] * FLOAT,
        "text": rows * txt["context_length"] * txt["width"] * FLOAT,
    }
    block = {n: 12 * t["width"] ** 2 * FLOAT for n, t in model["towers"].items()}  # one block's weights
    out = []
    for n in towers:
        out += [
            {"name": f"ddp sum {n}", "group": "world", "op": "all_reduce", "bytes": grads[n]},
            {"name": f"megatron dp sum {n}", "group": "pairs_across", "op": "all_reduce", "bytes": grads[n] / 2},
            {"name": f"megatron tp {n}", "group": "pairs_in_node", "op": "all_reduce", "bytes": act[n]},
            {"name": f"fsdp gather {n} block", "group": "world", "op": "all_gather", "bytes": block[n]},
            {"name": f"fsdp reduce-scatter {n} block", "group": "world", "op": "reduce_scatter", "bytes": block[n]},
        ]
    return out


def worker(args: argparse.Namespace) -> None:
    """A rank under torchrun: every case timed alone and between compute slices."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {
        "world": None,
        "pairs_in_node": [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2],
        "pairs_across": [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2],
    }
    a = torch.randn(256, 256)

    def compute(ms: float) -> None:
        end = time.thread_time() + ms * 1e-3  # CPU time of this thread: a slice of work, not of waiting
        while time.thread_time() < end:
            a @ a

    def call(case: dict[str, Any]) -> None:
        g = groups[case["group"]]
        size = dist.get_world_size(g)
        n = max(int(case["bytes"] // FLOAT) // size * size, size)
        if case["op"] == "all_reduce":
            dist.all_reduce(torch.ones(n), group=g)
        elif case["op"] == "all_gather":
            dist.all_gather_into_tensor(torch.empty(n), torch.ones(n // size), group=g)
        else:
            dist.reduce_scatter_tensor(torch.empty(n // size), torch.ones(n), group=g)

    def loop(case: dict[str, Any] | None, slice_ms: float) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            if slice_ms:
                compute(slice_ms)
            if case is not None:
                call(case)
        dist.barrier()
        return (time.perf_counter() - t0) / args.calls

    results = []
    loop(None, args.slice_ms)  # warm-up
    for case in json.loads(Path(args.cases).read_text()):
        call(case)  # the group's first call connects it
        alone = loop(case, 0.0)
        base = loop(None, args.slice_ms)
        busy = loop(case, args.slice_ms)
        base2 = loop(None, args.slice_ms)
        results.append({**case, "alone_s": alone, "added_s": busy - (base + base2) / 2, "slice_wall_s": base})
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def launch(emu: pe.Emulation, args: argparse.Namespace, tmp: Path, run: int, cores: list[set[int]]) -> list[dict]:
    out = tmp / f"collectives{run}.json"
    procs = []
    for node in range(pe.NODES):
        worker = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--cases", args.cases_path]
        worker += ["--calls", str(args.calls), "--slice-ms", str(args.slice_ms)]
        cmd, env = pe.node_launch(emu, node, pe.PORT + 50 + run, f"{emu.ns[0]}-c{run}", worker, cores)
        affinity = cores[node]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                cwd=pe.ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda a=affinity: os.sched_setaffinity(0, a),  # noqa: PLW1509
            )
        )
    try:
        logs = [p.communicate(timeout=args.run_timeout)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            pe._stop(p)
    if any(p.returncode for p in procs) or not out.exists():
        raise RuntimeError("collective probe failed:\n" + "\n".join(log[-2000:] for log in logs))
    return json.loads(out.read_text())


def priced(case: dict[str, Any], cluster: Any) -> float:
    """The cost model's seconds for one call of ``case`` on the emulated ``cluster``."""
    from lightning_distmm.planner.cost.comm import allgather_time, allreduce_time, reduce_scatter_time, ring_bytes

    b = case["bytes"]
    if case["group"] == "pairs_in_node":
        return float(allreduce_time(cluster, b, 2, 1))
    if case["group"] == "pairs_across":  # both pairs cross the same NICs at once
        return float(allreduce_time(cluster, b, 2, 2, 1, 2 * ring_bytes(b, 2)))
    if case["op"] == "all_reduce":
        return float(allreduce_time(cluster, b, 4, 2))
    return float((reduce_scatter_time if case["op"] == "reduce_scatter" else allgather_time)(cluster, b, 4, 2))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", default="263,2990", help="link rates, comma-separated")
    parser.add_argument("--burst-kib", type=float, default=None, help="tbf's bucket (default: placement_emulated's)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--slice-ms", type=float, default=8.0, help="CPU ms of compute before each call")
    parser.add_argument("--run-timeout", type=float, default=300.0)
    parser.add_argument("--results", default=str(pe.ROOT / "benchmarks" / "results" / "collectives_emulated.txt"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    import side_by_side_emulated as sbs

    from lightning_distmm.planner import measure_local_cpu

    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    why = pe.preflight()
    if why:
        sys.exit(f"collectives_emulated: {why}")
    cores = pe.node_cores(True)
    host = measure_local_cpu(devices=pe.DEVICES_PER_NODE, measure_concurrency=False)
    lines = [
        f"# Collectives on the emulated cluster ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        f"model {sbs.MODEL['name']}, global batch {args.batch}; {args.calls} calls per case; compute slices of"
        f" {args.slice_ms:g} CPU ms; loopback gloo measured idle: {host.intra.bandwidth / 1e6:.0f} MB/s,"
        f" {host.intra.latency * 1e6:.0f} us",
        "",
        "| link Mbit/s | collective | group | KB | alone ms | between compute ms | priced ms |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="collectives_") as tmp:
        path = Path(tmp) / "cases.json"
        path.write_text(json.dumps(cases(sbs.MODEL, args.batch)))
        args.cases_path = str(path)
        for run, rate in enumerate(float(r) for r in args.rate_mbit.split(",")):
            link = pe.LinkSettings(rate, burst_kib=args.burst_kib)
            cluster = pe.emulated_cluster(host, link)
            with pe.Emulation(link) as emu:
                got = launch(emu, args, Path(tmp), run, cores)
            for c in got:
                row = (
                    f"| {rate:g} | {c['name']} | {c['group']} | {c['bytes'] / 1e3:.0f} | {c['alone_s'] * 1e3:.2f} |"
                    f" {c['added_s'] * 1e3:.2f} | {priced(c, cluster) * 1e3:.2f} |"
                )
                lines.append(row)
                print(row, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.results).write_text(text)


if __name__ == "__main__":
    main()
