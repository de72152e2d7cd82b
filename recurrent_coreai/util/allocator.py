"""The C allocator of a process that calls the Core AI runtime: freed memory kept for the next call.

The Linux runtime allocates every call's scratch afresh, among it an fp32 copy of each fp16 or int8
weight it reads (a 65536 x 128 head: 32 MB). glibc serves a request that large with its own ``mmap``
and unmaps it on ``free``: every call then faults the pages in again, and zeroes them. Measured on
rwkv7-tiny's gate shards (2026-12-06, AVX-512 host, ``bench/bench_allocator.py``): 7.7-8.0 s of
the fp16 and int8keepproj shards' 27 s were system time, page faults; the fp32 shard, which
converts nothing, had 0.7 s.

:func:`keep_freed_memory` tells glibc (``mallopt``) to take such blocks from its heap instead, and
to keep up to :data:`TRIM_THRESHOLD` bytes of freed heap rather than give them back: the next call
reuses the same pages. Same results (the gate JSONs are byte-identical); fp16 and int8 shards ~30%
faster, peak RSS ~100 MB higher. Called when a runtime session opens (coreai/runtime.py); a no-op
where the C library is not glibc (macOS) or once done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
# freed heap kept for reuse: above the largest scratch block of one call at the sizes the gate runs
# here (a 65536-id head in fp32: 32 MB at 128 wide, 512 MB at 2048 wide, the 1.5B)
TRIM_THRESHOLD = 1 << 30


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Large blocks from the heap, freed memory kept (glibc only); whether it was applied."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
