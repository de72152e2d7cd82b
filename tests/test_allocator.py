"""util/allocator.py: after keep_freed_memory(), a call that allocates, fills and frees a large
block (what the runtime does with its fp32 copy of a weight, every call) faults its pages in once,
not on every call. Before it, and with either of its two settings alone, every call faults all
16384 pages of a 64 MB block again (measured: 16385, 16352 with M_MMAP_MAX alone, 16385 with
M_TRIM_THRESHOLD alone). Each case in its own interpreter: the setting is for the life of a process."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

PROBE = """
import ctypes, resource, sys
from recurrent_coreai.util import allocator
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
mode = sys.argv[1]
if mode == "keep":
    print(allocator.keep_freed_memory())
elif mode != "default":  # one of the two settings alone
    print(bool(libc.mallopt(getattr(allocator, mode), {"M_MMAP_MAX": 0}.get(mode, allocator.TRIM_THRESHOLD))))
else:
    print(None)
size = 64 << 20
def call():  # a runtime call's scratch: allocated, written, freed
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    call()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


def _faults_per_call(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    applied, faults = out.split()
    return applied, int(faults)


def test_by_default_every_call_faults_its_scratch_in_again():
    assert _faults_per_call("default")[1] >= 16000


@pytest.mark.parametrize("setting", ["M_MMAP_MAX", "M_TRIM_THRESHOLD"])
def test_either_setting_alone_is_not_enough(setting):
    applied, faults = _faults_per_call(setting)
    assert applied == "True" and faults >= 16000


def test_after_keep_freed_memory_the_scratch_is_reused():
    applied, faults = _faults_per_call("keep")
    assert applied == "True"
    assert faults <= 64  # 16384 pages of 64 MB: none faulted in again
