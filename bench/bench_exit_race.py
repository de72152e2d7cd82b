"""How often a process interrupted while the runtime loads a bundle aborts at exit (SIGABRT, 134)
instead of exiting 130, under CPU load -- with the exit wait of coreai/runtime.py
(``RuntimeLoop.quiesce``, registered with atexit) and, with ``--without-quiesce``, without it.

    python bench/bench_exit_race.py --aimodelx results/rwkv7-tiny/aot/universal/fp32/rwkv7-tiny-fp32.aimodelx \
        [--runs 700] [--hogs 3] [--without-quiesce] [--json out.json]

Each run is tests/test_faults_runtime.py's LOAD_INTERRUPTED (imported from there): SIGINT right after the
runtime's load began, then the usual exit through main_guard. ``--hogs`` busy Python loops run
beside it the whole time (the race needs a runtime thread kept off the CPU for a moment, as on a
loaded CI machine). Prints (and writes) the count of each exit status.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "tests"))
from test_faults_runtime import LOAD_INTERRUPTED  # noqa: E402 - the test's child, the one copy of it

# --without-quiesce: the exit wait (registered when the runtime module is imported) taken back first
WITHOUT = """
import atexit
import recurrent_coreai  # noqa: F401
from recurrent_coreai.coreai import runtime
atexit.unregister(runtime._quiesce_at_exit)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aimodelx", type=Path, required=True, help="a lowered bundle (any)")
    ap.add_argument("--runs", type=int, default=700)
    ap.add_argument("--hogs", type=int, default=3, help="busy loops beside the runs")
    ap.add_argument("--without-quiesce", action="store_true", help="take the exit wait back (the code before it)")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    if not ns.aimodelx.is_dir():
        sys.exit(f"error: {ns.aimodelx}: no such lowered bundle -- fix: build one (snakemake --cores 1 publish)")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(ns.hogs)]
    counts: collections.Counter = collections.Counter()
    t0 = time.monotonic()
    try:
        for _ in range(ns.runs):
            child = (WITHOUT if ns.without_quiesce else "") + LOAD_INTERRUPTED
            proc = subprocess.run([sys.executable, "-c", child, str(ns.aimodelx)], cwd=ROOT, capture_output=True,
                                  timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                                  env={**os.environ, "RECURRENT_COREAI_PROGRESS": "0"})
            counts[proc.returncode] += 1
    finally:
        for h in hogs:
            h.kill()
    result = {"runs": ns.runs, "hogs": ns.hogs, "quiesce": not ns.without_quiesce,
              "exit_status": {str(k): v for k, v in sorted(counts.items())}, "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(result))
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
