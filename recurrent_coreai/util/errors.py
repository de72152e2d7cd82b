"""One-line, actionable errors and the wrappers that print them.

Whatever goes wrong in a stage, the user sees ONE line on stderr —
``error: <where>: <what> -- fix: <fix>`` — the same line lands in the job's log, and the exit
status is nonzero. Only an unexpected exception (a bug) also leaves its traceback, in the log.
"""

from __future__ import annotations

import errno
import functools
import logging
import shutil
import sys
import traceback
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


class PipelineError(Exception):
    """An error the user can fix: says where, what is wrong and how to fix it."""

    def __init__(self, where: str | Path, what: str, fix: str):
        self.where, self.what, self.fix = str(where), what, fix
        super().__init__(f"{self.where}: {what} -- fix: {fix}")

    def __reduce__(self):  # pickled whole: a gate worker process raises it to the stage
        return PipelineError, (self.where, self.what, self.fix)


def _free(path: str | Path) -> str:
    for p in [Path(path), *Path(path).parents]:
        try:
            return f"{shutil.disk_usage(p).free / 1e6:.0f} MB free there"
        except OSError:
            continue
    return "free space unknown"


def as_pipeline_error(exc: BaseException) -> PipelineError | None:
    """The one-line form of an environmental failure (disk full, permissions), else None.
    (Outputs written through fsutil.atomic_path report a full disk with what they had written.)"""
    if isinstance(exc, PipelineError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = exc.filename or "a temporary file"
        return PipelineError(where, f"no space left on device ({_free(where)})",
                             "free disk space (or point TMPDIR / results: at a larger disk) and run again")
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return PipelineError(exc.filename or "the output directory", "is on a read-only file system",
                             "remount it read-write or point results: at a writable directory, and run again")
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError)) and exc.filename:
        return PipelineError(exc.filename, f"{exc.strerror.lower()}", "check the path and its permissions")
    return None


def _file_handlers() -> list[logging.FileHandler]:
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def _to_logs(text: str) -> None:
    for h in _file_handlers():
        h.stream.write(text.rstrip("\n") + "\n")
        h.flush()


def main_guard(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Run an entry point: any failure becomes one line on stderr (and in the log), exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            rc = fn(*args, **kwargs)
        except KeyboardInterrupt:
            line = "error: interrupted -- fix: run it again (its output was not written)"
            _to_logs(line)  # the job's log says why it ended, as for any other error
            print(line, file=sys.stderr)
            return 130
        except Exception as exc:  # noqa: BLE001 - the point: never a traceback on the terminal
            err = as_pipeline_error(exc)
            if err is None:
                logs = [h.baseFilename for h in _file_handlers()]
                _to_logs(traceback.format_exc())
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                err = PipelineError(fn.__module__, f"internal error ({type(exc).__name__}: {first})",
                                    "this is a bug: please report it with " + (f"the traceback in {logs[0]}" if logs
                                                                                else "the command line"))
            line = f"error: {err}"
            _to_logs(line)
            print(line, file=sys.stderr)
            return 1
        return int(rc or 0)

    return wrapper


def exit_on_error(fn: Callable[[], T]) -> T:
    """For the Snakefile: a PipelineError is one line on stderr and exit 1 (no Snakemake traceback)."""
    try:
        return fn()
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
