"""One rank of a two-process gloo job that ends while its last collectives complete.

``python exit_settle.py RANK PORT SETTLE``: both ranks start five asynchronous all-gathers and drop
every reference to them; rank 0 then waits for its own and stays alive, so rank 1's complete on
gloo's worker threads while rank 1's interpreter ends. Those workers free the gathered tensors,
whose Python objects the works kept alive: with ``SETTLE`` 0 that usually happens during
finalisation and rank 1 aborts (SIGABRT, ``terminate called without an active exception``); with
``SETTLE`` 1 ``settle_collectives_at_exit`` (what the strategy registers on every rank) lets the
workers finish first and rank 1 exits with 0.
"""

import importlib.util
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# loaded from its file: the package's import of Lightning would add seconds per run
_spec = importlib.util.spec_from_file_location(
    "exit_settle", Path(__file__).resolve().parents[2] / "lightning_distmm" / "parallel" / "exit_settle.py"
)
exit_settle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exit_settle)

rank, port, settle = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if settle:
    exit_settle.settle_collectives_at_exit()
works = []
for _ in range(5):
    gathered = [torch.empty(1000) for _ in range(2)]
    works.append(dist.all_gather(gathered, torch.ones(1000), async_op=True))
if rank == 0:
    for work in works:
        work.wait()
    time.sleep(2.0)  # the peer of rank 1's collectives stays up while rank 1 ends
del works, gathered
