"""``python -m recurrent_coreai <command> [args]``: the project's tools beside the pipeline stages.

A command is a module with ``main(argv) -> int``; add one by adding a line to COMMANDS (it is
imported only when run, so the dispatcher stays fast).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {  # name: (module, one-line description)
    "status": ("recurrent_coreai.tools.status", "one row per model and recipe: built, gated, published, stale"),
    "beta-watch": ("recurrent_coreai.tools.beta_watch.cli", "find newer coreai-* versions; --apply rebuilds and compares"),
    "generate": ("recurrent_coreai.tools.generate", "generate text with a built bundle in the Core AI runtime (--help)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: python -m recurrent_coreai <command> [args]\n\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 1
    if argv[0] not in COMMANDS:
        print(f"error: python -m recurrent_coreai: unknown command {argv[0]!r} -- fix: use one of "
              f"{', '.join(COMMANDS)} (python -m recurrent_coreai --help)", file=sys.stderr)
        return 1
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
