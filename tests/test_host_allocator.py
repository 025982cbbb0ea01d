"""The CPU host-allocator policy: the memory a step frees stays in the process for the next step."""

import json
import subprocess
import sys

import pytest

# One process (it imports the package, so lightning, as a training rank does: how glibc's heap is
# laid out decides whether its freed top can be trimmed; a torch-only process kept a small block
# above the tensors and never trimmed): 4 rounds under glibc's default policy, then the policy
# applied and 4 rounds more. No block of a round is mmapped, so the default rounds leave glibc's
# thresholds as they were.
CODE = """
import json, torch
from lightning_distmm.parallel.host_allocator import keep_freed_host_memory
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
def rounds():
    per_round = []
    for _ in range(4):
        before = faults()
        held = [torch.ones(25_000) for _ in range(400)]  # 40 MB in 100 kB blocks: all from the heap
        del held  # the top of the heap is free again
        per_round.append(faults() - before)
    return per_round
default = rounds()
applied = keep_freed_host_memory()
print(json.dumps([applied, default, rounds()]))
"""


def _rounds() -> tuple[bool, list[int], list[int]]:
    """Whether the policy applied, and the page faults of each round before and after it."""
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    applied, default, kept = json.loads(out.stdout.strip().splitlines()[-1])
    return applied, default, kept


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc/self/stat")
def test_freed_memory_serves_the_next_round_instead_of_faulting_in_again():
    """glibc returns the freed top of the heap to the kernel (past a 128 kB trim threshold), so every
    round faults its 40 MB in again; with the thresholds fixed the later rounds reuse it."""
    applied, default, kept = _rounds()
    assert applied is True
    assert min(default[1:]) > 5000, default  # ~9,300 pages every round
    assert max(kept[1:]) < 500, kept  # the first round's pages, reused
