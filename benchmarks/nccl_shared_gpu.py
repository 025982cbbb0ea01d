"""Can several NCCL ranks share one GPU? Two processes on ``cuda:0``: an all-reduce, a send/recv
pair on a two-rank group, and the pipeline links' in-order opening.

    python benchmarks/nccl_shared_gpu.py          # needs a GPU; prints one line per step and a verdict

NCCL refuses a communicator whose ranks share a device in some versions ("Duplicate GPU
detected"); the first GPU run's multi-rank checks need to know which this machine's does.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, results: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    steps = []
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        x = torch.full((4,), float(rank + 1), device="cuda:0")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        steps.append(f"all_reduce {x[0].item():.0f} (want {world * (world + 1) // 2})")
        pair = dist.new_group([0, 1])
        from lightning_distmm.parallel.pipeline import connect_in_order

        connect_in_order({("act", 0, 1): pair, ("grad", 1, 0): pair}, torch.device("cuda:0"))
        steps.append("connect_in_order")
        y = torch.arange(3.0, device="cuda:0") * (rank + 1)
        if rank == 0:
            dist.send(y, 1, group=pair)
        else:
            dist.recv(y, 0, group=pair)
        torch.cuda.synchronize()
        steps.append(f"send/recv {y.tolist()}")
        dist.destroy_process_group()
        results.put((rank, "PASS", steps))  # type: ignore[attr-defined]
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        results.put((rank, "FAIL", steps + [f"{type(err).__name__}: {err}", traceback.format_exc()[-800:]]))  # type: ignore[attr-defined]


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = []
    for _ in procs:
        try:
            got.append(results.get(timeout=120))
        except Exception:  # noqa: BLE001 - a hang is the answer
            got.append((-1, "FAIL", ["no answer in 120 s (a hang?)"]))
            break
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    for rank, status, steps in sorted(got):
        print(f"rank {rank}: {status}: " + " | ".join(steps))
    ok = len(got) == 2 and all(s == "PASS" for _, s, _ in got)
    print(
        f"nccl_shared_gpu: two NCCL ranks on one GPU {'WORK' if ok else 'FAIL'} (torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
