"""Fetching a pinned snapshot from the Hugging Face Hub (the ``hf`` source kind), verified.

``fetch_hf`` calls huggingface_hub's ``snapshot_download`` (which reuses the HF cache, retries
the tree listing and the per-file HEAD on 429/5xx, and resumes a body cut short within the same
run) and then checks every file against its content address, which huggingface_hub does not.
Every failure is one ``PipelineError`` line at ``hf://repo@revision``; the token is never in it.
A file that failed to download is not left in the snapshot: huggingface_hub writes into a
process-unique ``*.incomplete`` file that it deletes on failure (so a rerun fetches that file
again from its start, and only the files that are missing).
"""

from __future__ import annotations

import os
from pathlib import Path

from recurrent_coreai.pipeline.config import HEX40, PLACEHOLDER_REVISION
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import git_blob_sha1, sha256_file
from recurrent_coreai.hub.errors import client_token, common_failure, first_line, http_detail, http_status, hub_error, root_cause

# HTTP statuses that a retry gets again (401/403 are authentication: hub.errors.common_failure)
PERSISTENT = frozenset({400, 404, 410})
RETRY = "retry: files that completed stay in the Hugging Face cache and are not fetched again"


def verify_snapshot(snapshot: Path) -> None:
    """Check every file of a huggingface_hub snapshot against the content address it is stored
    under (blob name = sha256 for LFS files, git sha1 otherwise). huggingface_hub does not."""
    for path in sorted(snapshot.rglob("*")):
        if not path.is_file():
            continue
        blob = Path(os.path.realpath(path)).name
        if len(blob) == 64:
            got, kind = sha256_file(path), "sha256"
        elif len(blob) == 40:
            got, kind = git_blob_sha1(path), "git sha1"
        else:
            continue  # not in the content-addressed cache layout (nothing to check against)
        if got != blob:
            raise PipelineError(path, f"content {kind} {got} does not match the Hub's {blob} (corrupted or truncated download)",
                                f"delete {os.path.realpath(path)} from the Hugging Face cache and run again")


def fetch_hf(repo: str, revision: str, allow_patterns: list[str] | None) -> Path:
    """Download (or reuse from the cache) a pinned snapshot; returns the snapshot directory."""
    where = f"hf://{repo}@{revision}"
    if revision == PLACEHOLDER_REVISION:
        raise PipelineError(where, "the revision is the unpinned placeholder",
                            "run `python scripts/pin_revision.py MODEL` where the Hub is reachable and commit config.yaml")
    if not HEX40.match(revision):
        raise PipelineError(where, "revision is not a full 40-hex commit hash",
                            "pin the exact commit (python scripts/pin_revision.py MODEL)")
    import httpx2  # huggingface_hub 2.4's transport; its network errors are not OSErrors
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import snapshot_download

    failure: tuple[str, str] | None = None
    try:
        snapshot = Path(snapshot_download(repo_id=repo, revision=revision, allow_patterns=allow_patterns))
    except (hf_errors.HfHubHTTPError, OSError, httpx2.TransportError) as exc:
        failure = describe_download_failure(exc)
    # raised outside the except block: no chained client exception (whose text could carry anything) survives
    if failure is not None:
        raise hub_error(where, *failure, client_token())
    if not snapshot.is_dir() or not any(snapshot.iterdir()):
        raise PipelineError(where, f"allow_patterns {allow_patterns} matched no file", "fix allow_patterns in config.yaml")
    verify_snapshot(snapshot)
    return snapshot


def describe_download_failure(exc: BaseException) -> tuple[str, str]:
    """(what, fix) for an exception of ``snapshot_download``."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub import errors as hf_errors

    cause = root_cause(exc)
    if isinstance(cause, hf_errors.RevisionNotFoundError):
        return "revision not found on the Hub", "check the commit hash in config.yaml"
    if isinstance(cause, hf_errors.RepositoryNotFoundError):  # includes GatedRepoError
        return ("repository not found (or private without a token)",
                "check source.repo in config.yaml, or set HF_TOKEN for a private repo")
    common = common_failure(cause, "read")
    if common is not None:
        return common
    if isinstance(cause, hf_errors.RemoteEntryNotFoundError):
        return f"a file is missing on the Hub ({first_line(cause)})", "check allow_patterns"
    if isinstance(cause, hf_errors.LocalEntryNotFoundError):  # nothing more specific behind it
        return ("files not in the local cache and the Hub could not be reached (or a file is missing)",
                "check the network and HF_ENDPOINT, then run again")
    if isinstance(cause, httpx2.TimeoutException):
        # a file body's (GET) timeout reaches us bare; a metadata request's (HEAD) comes wrapped
        var, seconds = (("HF_HUB_ETAG_TIMEOUT", constants.HF_HUB_ETAG_TIMEOUT) if cause is not exc
                        else ("HF_HUB_DOWNLOAD_TIMEOUT", constants.HF_HUB_DOWNLOAD_TIMEOUT))
        return (f"no data from the Hub for {seconds} s ({type(cause).__name__}, {var}={seconds})",
                f"{RETRY}; on a slow connection raise {var} (now {seconds} s)")
    status = http_status(cause)
    if status in PERSISTENT:  # the same request fails the same way again: retrying is no fix
        return (f"download failed ({http_detail(cause)}): the Hub has no such file at this revision",
                "check source.repo, source.revision and allow_patterns in config.yaml (a retry gets the same answer)")
    if status is not None:
        return f"download failed ({http_detail(cause)})", RETRY
    return f"download failed ({type(cause).__name__}: {first_line(cause)})", RETRY
