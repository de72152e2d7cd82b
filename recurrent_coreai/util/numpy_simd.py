"""numpy's SIMD kernels, capped so that the gate's numbers are the same on every x86-64 host.

numpy picks a kernel per ufunc and CPU when it loads: on an AVX-512 host ``exp`` and ``log`` (the
gate's softmax and KL) run its ``X86_V4`` kernels, on an AVX2 host its ``X86_V3`` ones, and the two
differ in their last bits. So the gate's records -- and the card, report and publish tree after them
-- differed between the two kinds of host, and ``make publish`` left ``dvc.lock`` modified on the
kind it was not recorded on (measured 2026-12-03: a gate shard on an AVX-512 host with the kernels
capped at ``X86_V3`` gave the AVX2 host's bytes; nothing else in the gate depends on the CPU kind).

numpy reads ``NPY_DISABLE_CPU_FEATURES`` once, when it loads: importing this module (and
``recurrent_coreai``, which imports it first) puts the cap there unless the environment names its
own list. :func:`gate_kernels` reads what the loaded numpy picked (``numpy.lib.introspect``).
On a host without ``X86_V3`` (AVX2 and FMA: before 2013-2015) numpy runs its baseline kernels and
the gate's numbers differ from the record: :func:`warn_unless_recorded_kernels` says so.
"""

from __future__ import annotations

import logging
import os

NUMPY_SIMD_ENV = "NPY_DISABLE_CPU_FEATURES"
RECORDED_TARGET = "X86_V3"  # the kernels dvc.lock's gate records were computed with
# numpy 2.4's x86 dispatch targets above RECORDED_TARGET (numpy.show_runtime(): 'found'/'not_found');
# naming one the CPU lacks is allowed and silent
ABOVE_RECORDED = "X86_V4 AVX512_ICL AVX512_SPR"
GATE_UFUNCS = ("exp", "log")  # the gate's transcendental ufuncs (softmax, KL), in float32 and float64

os.environ.setdefault(NUMPY_SIMD_ENV, ABOVE_RECORDED)  # effective only if numpy is not loaded yet

log = logging.getLogger(__name__)


def gate_kernels() -> dict[str, str]:
    """The dispatch target the loaded numpy runs for each gate ufunc and float type, e.g.
    ``{"exp ff": "X86_V3", ...}`` (``baseline(X86_V2)`` where no dispatched kernel applies)."""
    from numpy.lib.introspect import opt_func_info

    info = opt_func_info(func_name="^(" + "|".join(GATE_UFUNCS) + ")$", signature="^(float32|float64)$")
    return {f"{func} {sig}": target["current"] for func, sigs in info.items() for sig, target in sigs.items()}


def off_record() -> dict[str, str]:
    """The gate ufuncs whose kernel is not the recorded one (empty where the record holds)."""
    return {name: target for name, target in gate_kernels().items() if target != RECORDED_TARGET}


def warn_unless_recorded_kernels() -> None:
    """Log one warning when numpy runs other kernels than dvc.lock's gate records were made with."""
    other = off_record()
    if other:
        log.warning("the gate's numbers will differ in their last bits from dvc.lock's: numpy runs %s, the record "
                    "%s (fix: import recurrent_coreai before numpy, and leave %s to it -- it is %r; on a host "
                    "without %s, re-record dvc.lock)", ", ".join(f"{k}: {v}" for k, v in sorted(other.items())),
                    RECORDED_TARGET, NUMPY_SIMD_ENV, os.environ.get(NUMPY_SIMD_ENV), RECORDED_TARGET)
