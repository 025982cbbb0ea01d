"""The host allocator's policy for training on the CPU: keep the memory a step frees for the next.

glibc's ``malloc`` adapts two thresholds as a process runs: blocks above the mmap threshold get
their own mapping, and free memory at the top of the heap beyond the trim threshold goes back to
the kernel. A training step allocates and frees the same tens of megabytes of activations every
step; when the order of its frees leaves the top of the heap free at the end of a step, glibc
returns it, and the next step takes every page of it back through a page fault. That is what a
distmm rank did on the CPU (``benchmarks/step_time.py``'s model: 14,600 minor faults per step on
rank 0 against DDP's 660, and the step correspondingly slower), where DDP's frees happened to
leave the top in use. Fixing both thresholds (which also stops glibc from adapting them) keeps
that memory in the process, as PyTorch's performance guide gets by switching to jemalloc or
tcmalloc: 275 faults per step. Memory a rank releases for good (the towers it does not run) is
still handed back explicitly (:func:`lightning_distmm.parallel.prepare.return_freed_memory`).
"""

from __future__ import annotations

import ctypes

#: blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit hosts)
MMAP_THRESHOLD = 32 * 2**20
#: free memory at the top of the heap is kept up to this size
TRIM_THRESHOLD = 2**30

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_host_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
