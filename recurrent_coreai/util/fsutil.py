"""Atomic outputs and content hashes.

Every stage writes into a temporary sibling and renames it into place at the
end, so an interrupted or failing stage never leaves output that looks complete.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.progress import Progress

CHUNK = 1 << 20
# bookkeeping files that tools drop into directory outputs; never part of an artifact
IGNORED = frozenset({".snakemake_timestamp", ".gitignore"})


# (device, inode, size, mtime_ns, ctime_ns) -> sha256, inside remembered_digests() only
_REMEMBERED: dict[tuple, str] | None = None
RACY_NS = 1_000_000_000  # a file changed less than this before it is hashed is hashed every time


@contextlib.contextmanager
def remembered_digests() -> Iterator[None]:
    """Inside the block, :func:`sha256_file` hashes a file once and returns that digest again while
    the file's device, inode, size, mtime and ctime are unchanged: a process that checks the same
    outputs for several stages (the DVC record after a build: a gate JSON's bundle for the gate,
    card, report and publish stages) reads each once. Every write changes ctime, and no call can
    set it back (os.utime sets mtime only), so a file edited with its time kept is hashed again."""
    global _REMEMBERED, _MADE
    outer, outer_made = _REMEMBERED, _MADE
    _REMEMBERED = {} if outer is None else outer
    _MADE = {} if outer_made is None else outer_made
    try:
        yield
    finally:
        _REMEMBERED, _MADE = outer, outer_made


_MADE: dict[tuple, object] | None = None  # remembered(): key -> result, inside remembered_digests() only


def tree_states(paths) -> tuple:
    """``(name, file_state)`` of every file under each of ``paths`` (a file, a directory, or a
    missing path: state None), sorted: what tells those bytes unchanged without reading them."""
    out = []
    for path in map(Path, paths):
        if path.is_dir():
            out.extend((str(f), file_state(f.stat())) for f in sorted(path.rglob("*")) if f.is_file())
        else:
            out.append((str(path), file_state(path.stat()) if path.exists() else None))
    return tuple(out)


def remembered(key: tuple, paths, make):
    """``make()``, made once inside :func:`remembered_digests` for ``key`` while every file under
    ``paths`` is unchanged (:func:`tree_states`), and a copy of that result after (an exception is
    never remembered; nor is a result while one of those files changed within the last second, as
    in :func:`sha256_file`); outside the block, ``make()`` every time. For a check a process would
    repeat on the same inputs: the DVC record after a build bakes a model's vocab for its vocab
    stage and again for its publish stage."""
    if _MADE is None:
        return make()
    states = tree_states(paths)
    full = (key, states)
    if full in _MADE:
        return copy.deepcopy(_MADE[full])
    result = make()
    now = time.time_ns()
    if all(st is None or settled(st, now) for _, st in states):
        _MADE[full] = copy.deepcopy(result)
    return result


def file_state(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells a file's bytes unchanged without reading them: device, inode, size, mtime and
    ctime (every write changes ctime; os.utime cannot set it back). The key of this process's memos
    of a file's digest or parse."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def settled(state: tuple, now: int) -> bool:
    """A file last changed (``state``: :func:`file_state`) more than :data:`RACY_NS` before ``now``:
    git's "racily clean" rule -- on a file system with a coarse clock a second write in the same
    tick would keep its ctime, so anything younger is read again every time."""
    return state[4] < now - RACY_NS


def sha256_file(path: str | Path) -> str:
    if _REMEMBERED is None:
        return _sha256_file(path)
    st = os.stat(path)
    key = file_state(st)
    if key in _REMEMBERED:
        return _REMEMBERED[key]
    now = time.time_ns()
    digest = _sha256_file(path)
    if settled(key, now):  # a file changed within the last second is not remembered
        _REMEMBERED[key] = digest
    return digest


def _sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh, Progress(f"hashing {Path(path).name}", os.fstat(fh.fileno()).st_size, "B") as bar:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def git_blob_sha1(path: str | Path) -> str:
    """The git object id of a file (what the Hub lists as ``oid`` for non-LFS files)."""
    size = os.path.getsize(path)
    digest = hashlib.sha1(f"blob {size}\0".encode())
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree_files(root: str | Path) -> list[Path]:
    """Every regular file below ``root``, as sorted relative paths."""
    root = Path(root)
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name not in IGNORED)


def tree_manifest(root: str | Path) -> dict[str, dict]:
    """``{relpath: {sha256, size}}`` for every file below ``root``."""
    root = Path(root)
    return {
        rel.as_posix(): {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
        for rel in tree_files(root)
    }


def first_difference(got: dict[str, dict], expected: dict[str, dict]) -> str | None:
    """The first relative path (sorted) whose entry differs between two manifests, or None."""
    bad = sorted(rel for rel in set(got) | set(expected) if got.get(rel) != expected.get(rel))
    return bad[0] if bad else None


def dumps_json(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class DiskFullError(PipelineError):
    """A full disk met while writing ``where`` through :func:`atomic_path`; ``written`` bytes had been
    written to its temporary (now removed). An enclosing ``atomic_path`` reports it under its own name."""

    def __init__(self, where: Path, written: int):
        self.written = written
        free = shutil.disk_usage(where.parent).free
        super().__init__(where, f"no space left on device: {written / 1e6:.1f} MB written before the disk filled, "
                         f"{free / 1e6:.1f} MB free there", "free more than that much disk (or point results: at a "
                         "larger disk) and run again; nothing was written")


_TEMP_PART = re.compile(r"^\.(?P<name>.+)\.[^./]+\.tmp$")


def final_path(path: str | Path) -> Path:
    """The path a user knows for ``path``: inside an :func:`atomic_path` temporary
    (``dir/.<name>.<random>.tmp/<name>/...``) it is ``dir/<name>/...``."""
    parts = list(Path(path).parts)
    out = []
    for i, part in enumerate(parts):
        m = _TEMP_PART.match(part)
        if m and i + 1 < len(parts) and parts[i + 1] == m["name"]:
            continue
        out.append(part)
    return Path(*out) if out else Path(path)


def require_space(where: str | Path, need: int, what: str) -> None:
    """Refuse up front to write ``need`` bytes below ``where`` when the disk there holds less: some
    writers cannot report a full disk (LLVM's output stream exits the process, a write through a
    memory map is SIGBUS), so theirs is checked before they start."""
    where = Path(where)
    base = next((p for p in [where, *where.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(base).free
    if free < need:
        raise PipelineError(final_path(where), f"no space left on device: {what} needs about {need / 1e6:.1f} MB, "
                            f"{free / 1e6:.1f} MB free there", "free more than that much disk (or point results: "
                            "at a larger disk) and run again; nothing was written")


def why_missing(path: str | Path) -> str:
    """What is wrong with a path that cannot be opened: "is a symbolic link loop", "is a broken
    symbolic link (to …)", "is a directory, not a file", or "does not exist"."""
    path = Path(path)
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link loop (it resolves to itself)"
        if path.is_symlink():
            return f"is a broken symbolic link (to {os.readlink(path)})"
        return "does not exist"
    return "is a directory, not a file" if path.is_dir() else "exists"


def check_writable(path: str | Path) -> None:
    """``path`` (or its nearest existing parent) is a directory this process can write into: one line
    naming it otherwise (a read-only mount, a directory without write permission)."""
    path = Path(path)
    base = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    try:
        probe = Path(tempfile.mkdtemp(prefix=".write-probe.", dir=base))
        probe.rmdir()
    except OSError as exc:
        what = "is on a read-only file system" if exc.errno == errno.EROFS else f"is not writable ({exc.strerror})"
        raise PipelineError(base, what, "remount it read-write or point results: at a writable directory, "
                            "and run again") from None


def disk_full(exc: BaseException) -> bool:
    """An ENOSPC/EDQUOT, also when a writer (safetensors, coreai) reports it inside its own error."""
    if isinstance(exc, DiskFullError) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return True
    return any(os.strerror(code) in str(exc) for code in (errno.ENOSPC, errno.EDQUOT))


def remove_stale_temps(final: Path) -> list[Path]:
    """Temporaries of ``final`` left by a killed run (SIGKILL skips every cleanup)."""
    stale = sorted(final.parent.glob(f".{glob.escape(final.name)}.*.tmp"))
    for path in stale:
        _remove(path)
    return stale


# What atomic_path's temporary adds to an output's name: ".<name>.<8 random characters>.tmp"
# (tempfile.mkdtemp's names are 8 characters): a name may be this much below the file system's limit.
TEMP_NAME_EXTRA = len("." + "." + "x" * 8 + ".tmp")


@contextlib.contextmanager
def atomic_path(final: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it onto ``final`` on success.

    On an exception the temporary is removed and ``final`` is left untouched. Temporaries of
    the same output left by a killed run are removed first. ``final`` is replaced only by the
    same kind of thing (a directory by a directory, a file by a file), never through a link.
    """
    final = Path(final)
    if final.is_symlink() or (final.exists() and final.is_dir() != directory):
        kind = "a link" if final.is_symlink() else ("a directory" if final.is_dir() else "a file")
        raise PipelineError(final, f"is {kind} where this stage writes {'a directory' if directory else 'a file'}",
                            "move it away (nothing here replaces it) and run again")
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    target = tmp / final.name
    if directory:
        target.mkdir()
    try:
        yield target
        _remove(final)
        os.replace(target, final)
    except Exception as exc:  # noqa: BLE001 - writers (safetensors, coreai) wrap the OSError in their own types
        if not disk_full(exc):
            raise
        written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        # a nested atomic_path (a file written inside this directory) already removed its temporary
        written += exc.written if isinstance(exc, DiskFullError) else 0
        shutil.rmtree(tmp, ignore_errors=True)
        raise DiskFullError(final, written) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8", newline="\n")


def write_json_atomic(path: str | Path, value: object) -> None:
    write_text_atomic(path, dumps_json(value))
