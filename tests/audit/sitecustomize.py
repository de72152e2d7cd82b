"""Test-only: the files a pipeline stage process opens, for tests/test_declared_inputs.py.

tests/repo_copies.py puts this directory on PYTHONPATH (after the copy itself) for one build
and sets RWKV7_TEST_OPENED_DIR. Python imports ``sitecustomize`` at start-up, so in every stage
process -- ``python scripts/<stage>.py ...``, as the rule's shell command runs it -- an audit
hook collects each ``open`` event's path (absolute, against the job's working directory) and at
exit writes ``{"argv", "cwd", "opened"}`` to ``$RWKV7_TEST_OPENED_DIR/<pid>-<ns>.json``. Every
other process (snakemake, dvc, ...) is left alone. Without the variable this does nothing.
"""

import os
import sys


def _install(out_dir: str) -> None:
    import atexit
    import json
    import time

    opened: set[str] = set()
    cwd = os.getcwd()

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            try:
                opened.add(os.path.abspath(os.fsdecode(args[0])))
            except Exception:  # noqa: BLE001 - never make the stage's own open() fail
                pass

    def write():
        record = {"argv": list(sys.argv), "cwd": cwd, "opened": sorted(opened)}
        path = os.path.join(out_dir, f"{os.getpid()}-{time.time_ns()}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)  # a reader never sees half a record

    sys.addaudithook(hook)
    atexit.register(write)


def _is_stage(argv: list[str]) -> bool:
    script = argv[0] if argv else ""
    return script.endswith(".py") and os.path.basename(os.path.dirname(os.path.abspath(script))) == "scripts"


if os.environ.get("RWKV7_TEST_OPENED_DIR") and _is_stage(getattr(sys, "argv", [])):
    _install(os.environ["RWKV7_TEST_OPENED_DIR"])
