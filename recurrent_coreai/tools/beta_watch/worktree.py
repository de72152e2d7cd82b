"""git: the rebuild runs on a clean HEAD, in a throwaway worktree seeded with the baseline."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

from recurrent_coreai.util.errors import PipelineError


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if proc.returncode:
        raise PipelineError(repo, f"git {' '.join(args[:2])} failed: {proc.stderr.strip()[:300]}",
                            "run beta-watch from the root of a git clone of rwkv7-coreai")
    return proc.stdout


def check_clean(repo: Path) -> None:
    """The rebuild runs on HEAD: uncommitted edits of tracked files (dvc.lock aside: a baseline run
    records into it, and it is copied over) would silently be left out."""
    dirty = [line[3:] for line in git(repo, "status", "--porcelain", "--untracked-files=no").splitlines()
             if line[3:] != "dvc.lock"]
    if dirty:
        raise PipelineError(repo, f"uncommitted changes to tracked files ({', '.join(dirty[:4])}"
                            f"{' …' if len(dirty) > 4 else ''}); the rebuild runs on HEAD without them",
                            "commit (or stash) them and build the baseline again, then rerun beta-watch")


@contextlib.contextmanager
def worktree(repo: Path, dest: Path, keep: bool = False):
    git(repo, "worktree", "add", "--detach", str(dest), "HEAD")
    try:
        yield dest
    finally:
        if not keep:
            subprocess.run(["git", "worktree", "remove", "--force", str(dest)], cwd=repo, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True)


def keep_file_times(repo: Path, tree: Path) -> None:
    """The worktree's tracked files get the checkout's file times: a tracked file that is a rule's
    input (a trained fixture's checkpoint, the gate's held-out text) is otherwise newer than the
    baseline's outputs, and Snakemake would rerun its stage for a toolchain change. The content is
    HEAD's in both (check_clean)."""
    import os

    for rel in filter(None, git(repo, "ls-files", "-z").split("\0")):
        src, dst = repo / rel, tree / rel
        if src.is_file() and not src.is_symlink() and dst.is_file() and not dst.is_symlink():
            st = src.stat()
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def seed(repo: Path, tree: Path, results: str) -> None:
    """The baseline the rebuild starts from: results (file times kept, so only what the new
    toolchain invalidates reruns), the tracked files' times (:func:`keep_file_times`), Snakemake's
    provenance records, dvc.lock, and DVC's cache."""
    keep_file_times(repo, tree)
    shutil.copytree(repo / results, tree / results, symlinks=True)
    if (repo / ".snakemake" / "metadata").is_dir():
        shutil.copytree(repo / ".snakemake" / "metadata", tree / ".snakemake" / "metadata")
    if (repo / "dvc.lock").is_file():
        shutil.copy2(repo / "dvc.lock", tree / "dvc.lock")
    if (repo / ".dvc").is_dir():  # one cache for both trees (DVC's own setting, local to the worktree)
        cache = subprocess.run([sys.executable, "-m", "dvc", "cache", "dir"], cwd=repo, capture_output=True, text=True)
        path = cache.stdout.strip() if cache.returncode == 0 and cache.stdout.strip() else str(repo / ".dvc" / "cache")
        subprocess.run([sys.executable, "-m", "dvc", "cache", "dir", "--local", path], cwd=tree, capture_output=True)
