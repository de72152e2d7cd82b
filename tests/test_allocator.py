"""util/allocator.py: after keep_freed_memory(), a large freed block stays with the process for the
next call instead of going back to the system (what spares the runtime's page faults); before it,
glibc unmaps it. Each case in its own interpreter: the setting is for the life of a process."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

PROBE = """
import ctypes, sys
from recurrent_coreai.util.allocator import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
size = 64 << 20
p = libc.malloc(size)
ctypes.memset(p, 1, size)  # touch every page
before = resident()
libc.free(p)
print(applied, (before - resident()) >> 20)
"""


def _freed_mb(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    applied, freed = out.split()
    return applied, int(freed)


def test_a_large_freed_block_goes_back_to_the_system_by_default():
    assert _freed_mb("default")[1] >= 60


def test_after_keep_freed_memory_it_stays_for_the_next_call():
    applied, freed = _freed_mb("keep")
    assert applied == "True"
    assert freed <= 4
