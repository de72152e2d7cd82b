"""Publishing a staged directory to a Hugging Face Hub model repo, as one commit.

Environment: callers must set ``HF_HUB_DISABLE_XET=1`` (before ``huggingface_hub`` is imported,
i.e. in the process environment) so that LFS files go through the plain git-LFS protocol; this
module sets nothing global. ``HF_ENDPOINT`` selects the Hub as usual.
"""

from __future__ import annotations

from pathlib import Path

from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import git_blob_sha1, sha256_file, tree_files
from recurrent_coreai.hub.errors import common_failure, first_line, http_detail, http_status, hub_error, scrub

PATHS_INFO_BATCH = 100  # paths per get_paths_info request


def upload_tree(repo_id: str, staging: Path, *, message: str, token: str, revision: str = "main",
                create: bool = True, parent: str | None = None, expected: dict[str, str] | None = None) -> dict:
    """Make branch ``revision`` of model repo ``repo_id`` hold every file below ``staging``.

    Each local file is compared with the remote one at the branch head (size, and the sha256 for
    LFS files or the git blob sha1 for regular ones); the files that differ or are missing go into
    ONE ``create_commit`` whose parent is that head (if the branch moves meanwhile the Hub refuses
    the commit and nothing is written). Files that already match are skipped; when nothing
    differs no commit is made. Remote files absent from ``staging`` are left alone.

    ``parent``: the commit the caller based ``staging`` on (e.g. the head whose README it merged);
    the commit is made on top of it, so a branch that moved since is refused instead of overwritten.
    ``expected``: {path: sha256} the stages recorded for the staged files (publish.json): every
    local file must be one of them with that digest, checked before anything reaches the network.
    ``create``: create the repo first (``exist_ok``). Requires ``HF_HUB_DISABLE_XET=1`` in the
    environment (see the module docstring). Every failure is a one-line ``PipelineError`` at
    ``hf://{repo_id}``; the token never appears in messages, exceptions or the return value.

    Returns ``{"commit": oid | None, "committed": [paths], "skipped": [paths], "repo": repo_id,
    "revision": revision}`` (paths are POSIX, relative to ``staging``, sorted).
    """
    where = f"hf://{repo_id}"
    staging = Path(staging)
    if not token or not isinstance(token, str):
        raise hub_error(where, "no Hub token given", "set HF_TOKEN to a token with write access to the repo", token)
    if not message or not message.strip():
        raise hub_error(where, "empty commit message", "pass a commit message", token)
    if not staging.is_dir():
        raise hub_error(staging, "staging directory does not exist", "run the stage that fills it first", token)
    local = {rel.as_posix(): staging / rel for rel in tree_files(staging)}
    if not local:
        raise hub_error(staging, "staging directory is empty: nothing to publish", "run the stage that fills it first",
                        token)
    if expected is not None:
        for rel, path in sorted(local.items()):
            if rel not in expected or sha256_file(path) != expected[rel]:
                what = "is no file the publish stage recorded" if rel not in expected else \
                    "differs from what the publish stage recorded"
                raise PipelineError(path, f"{what}; nothing was uploaded",
                                    "stage again: snakemake --cores 1 publish --forcerun stage_and_push")
        missing = sorted(set(expected) - set(local))
        if missing:
            raise PipelineError(staging / missing[0], "is recorded by the publish stage but missing; nothing was "
                                "uploaded", "stage again: snakemake --cores 1 publish --forcerun stage_and_push")

    failure: tuple[str, str] | None = None
    result: dict | None = None
    try:
        result = _publish(repo_id, local, message=message, token=token, revision=revision, create=create,
                          parent=parent)
    except PipelineError as exc:
        failure = (exc.what, exc.fix)
    except Exception as exc:  # noqa: BLE001 - every client/network failure becomes one line
        failure = describe_failure(exc, revision)
    # raised outside the except block: no chained exception (whose text could carry anything) survives
    if failure is not None:
        raise hub_error(where, failure[0], failure[1], token)
    return {key: scrub(value, token) for key, value in result.items()}


def _publish(repo_id: str, local: dict[str, Path], *, message: str, token: str, revision: str,
             create: bool, parent: str | None = None) -> dict:
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(token=token)
    if create:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
    head = parent or api.repo_info(repo_id, repo_type="model", revision=revision).sha
    if not head:
        raise PipelineError(f"hf://{repo_id}", f"the Hub reported no commit for {revision!r}",
                            "check the revision (a branch name)")

    paths = sorted(local)
    remote: dict[str, RepoFile] = {}
    for i in range(0, len(paths), PATHS_INFO_BATCH):
        for entry in api.get_paths_info(repo_id, paths[i:i + PATHS_INFO_BATCH], revision=head, repo_type="model"):
            if isinstance(entry, RepoFile):
                remote[entry.path] = entry

    changed = [p for p in paths if not _same(local[p], remote.get(p))]
    skipped = sorted(set(paths) - set(changed))
    out = {"commit": None, "committed": [], "skipped": skipped, "repo": repo_id, "revision": revision}
    if not changed:
        return out

    operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(local[p])) for p in changed]
    info = api.create_commit(repo_id, operations, commit_message=message, revision=revision,
                             parent_commit=head, repo_type="model")
    if not info.oid or info.oid == head:
        # the client found every file unchanged after all (it skips no-op additions): no commit made
        return {**out, "skipped": paths}
    return {**out, "commit": info.oid, "committed": changed}


def _same(path: Path, entry) -> bool:
    """Whether local ``path`` has the content of remote tree entry ``entry`` (None = absent)."""
    if entry is None:
        return False
    size = path.stat().st_size
    if entry.lfs is not None:
        return entry.lfs.size == size and entry.lfs.sha256 == sha256_file(path)
    return entry.size == size and entry.blob_id == git_blob_sha1(path)


def describe_failure(exc: BaseException, revision: str) -> tuple[str, str]:
    """(what, fix) for an exception huggingface_hub or the network raised while reading or writing
    branch ``revision`` of a repo (pass it to :func:`~recurrent_coreai.hub.errors.hub_error`)."""
    from huggingface_hub import errors as hf_errors

    retry = "run the upload again (files already on the Hub are skipped, so a retry is safe)"
    detail = f"{type(exc).__name__}: {first_line(exc)}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and not isinstance(exc, hf_errors.HfHubHTTPError):
        detail += f" <- {type(cause).__name__}: {first_line(cause)}"
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return f"branch {revision!r} not found", "create the branch on the Hub first, or publish to main"
    if isinstance(exc, hf_errors.RepositoryNotFoundError):  # includes GatedRepoError
        return ("repository not found, or the token cannot see it",
                "check the repo id and the token's permissions (create=True creates a missing repo)")
    common = common_failure(exc, "write")  # the token refused; HF_HUB_OFFLINE (a retry would fail the same way)
    if common is not None:
        return common
    if isinstance(exc, hf_errors.HfHubHTTPError):
        if http_status(exc) == 412:
            return f"the branch moved while uploading ({http_detail(exc)}); nothing was committed", retry
        return f"Hub request failed ({http_detail(exc)}); nothing was committed", retry
    try:
        import httpx2

        transport = (httpx2.TransportError,)
    except ImportError:  # pragma: no cover - huggingface_hub 2.4.0 depends on httpx2
        transport = ()
    if transport and isinstance(exc, transport):
        return f"cannot reach the Hub ({detail})", "check the network and HF_ENDPOINT, then " + retry
    return f"upload failed ({detail})", retry

