"""One-line, actionable errors and the CLI wrapper that prints them."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable


class PipelineError(Exception):
    """An error the user can fix: says where, what is wrong and how to fix it."""

    def __init__(self, where: str | Path, what: str, fix: str):
        self.where, self.what, self.fix = str(where), what, fix
        super().__init__(f"{self.where}: {what} -- fix: {fix}")


def main_guard(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Run an entry point; a PipelineError becomes one line on stderr and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            rc = fn(*args, **kwargs)
        except PipelineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return int(rc or 0)

    return wrapper
