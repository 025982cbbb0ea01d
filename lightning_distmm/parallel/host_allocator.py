"""The host allocator's policy for training on the CPU: keep the memory a step frees for the next.

glibc adapts its mmap and trim thresholds as a process runs and may hand the top of the heap back
to the kernel at the end of a step, which the next step then faults back in page by page. Fixing
both thresholds keeps that memory in the process, as jemalloc or tcmalloc would (PyTorch's
performance guide); docs/runtime.md has the measurement. Memory a rank releases for good (the
towers it does not run) is still handed back (:func:`lightning_distmm.parallel.prepare.return_freed_memory`).
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
