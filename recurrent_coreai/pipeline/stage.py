"""What every stage entry point shares: its argument parser, logging to stdout and ``--log``,
and the settings it may read (only the keys of ``config.STAGE_KEYS[stage]``).

Each stage's entry point is ``main`` in its own module (``source.main``, ``export.main``, …;
``scripts/<stage>.py`` calls it), so the code a stage runs — and so its code fingerprint
(``fingerprint.py``) — is that module and what it imports, nothing of the other stages.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
from pathlib import Path

from recurrent_coreai.pipeline import config as cfgmod

WILDCARDS = ("model", "recipe", "target")


def parser(script: str, *args: str, lists: tuple[str, ...] = (), optional_lists: tuple[str, ...] = ()):
    """``--config-file``, ``--log``, the required ``--<arg>`` and the path lists (``--exports a b``)."""
    p = argparse.ArgumentParser(prog=f"scripts/{script}.py")
    p.add_argument("--config-file", default=cfgmod.DEFAULT_FILE)
    p.add_argument("--log", help="write a detailed log here")
    for a in args:
        p.add_argument(f"--{a}", required=True)
    for a in lists:
        p.add_argument(f"--{a}", nargs="+", required=True, type=Path)
    for a in optional_lists:
        p.add_argument(f"--{a}", nargs="*", default=[], type=Path)
    return p


def setup(stage: str, ns: argparse.Namespace) -> tuple[dict, dict]:
    """Logging to stdout and ``--log``; returns (this stage's settings, the whole config)."""
    handlers = [logging.StreamHandler(sys.stdout)]
    if ns.log:
        Path(ns.log).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(ns.log, mode="w"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", handlers=handlers, force=True)
    cfg = cfgmod.load(ns.config_file)
    names = {k: getattr(ns, k, None) for k in WILDCARDS}
    return cfgmod.settings(cfg, stage, **names), cfg


def rss_mb() -> float:
    """Peak resident memory of this process so far, MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


log = logging.getLogger("recurrent_coreai")
