"""How often a process interrupted while the runtime loads a bundle aborts at exit (SIGABRT, 134)
instead of exiting 130, under CPU load -- with the exit wait of coreai/runtime.py
(``RuntimeLoop.quiesce``, registered with atexit) and, with ``--without-quiesce``, without it.

    python bench/bench_exit_race.py --aimodelx results/rwkv7-tiny/aot/universal/fp32/rwkv7-tiny-fp32.aimodelx \
        [--runs 700] [--hogs 3] [--without-quiesce] [--json out.json]

Each run is the child of tests/test_faults_runtime.py's LOAD_INTERRUPTED: SIGINT right after the
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

CHILD = """
import asyncio, atexit, os, signal, sys
from pathlib import Path
import recurrent_coreai  # noqa: F401
import coreai.runtime as rt
from recurrent_coreai.coreai import runtime
from recurrent_coreai.coreai.runtime import DecodeSession
from recurrent_coreai.util.errors import main_guard
real = rt.AIModel.load
async def load(path):
    task = asyncio.ensure_future(real(path))
    await asyncio.sleep(0)  # the runtime's thread is loading now
    os.kill(os.getpid(), signal.SIGINT)
    return await task
rt.AIModel.load = load
if sys.argv[2] == "without":
    runtime.RuntimeLoop()  # registers the exit wait; then take it back
    atexit.unregister(runtime._quiesce_at_exit)
main = main_guard(lambda: DecodeSession(Path(sys.argv[1]), {"s": (1,)}, "float32") and 0)
sys.exit(main())
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
            proc = subprocess.run([sys.executable, "-c", CHILD, str(ns.aimodelx),
                                   "without" if ns.without_quiesce else "with"], cwd=ROOT, capture_output=True,
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
