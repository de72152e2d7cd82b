"""``recurrent_coreai.hub.upload.upload_tree`` against a local stand-in of the Hub (tests/hubserver.py).

Each client session runs in a subprocess (huggingface_hub reads HF_ENDPOINT and HF_HUB_DISABLE_XET
at import time). The token is a recognisable fake; it must never come back out.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hubserver import HubServer, client_env, run_python

REPO = "org/rwkv7-coreai-test"
TOKEN = "hf_TESTTOKEN_do_not_print_123"
COMMIT = f"/api/models/{REPO}/commit/*"

UPLOAD = r'''
import json, sys
from pathlib import Path
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.hub.upload import upload_tree

args = json.loads(sys.argv[1])
try:
    result = upload_tree(args["repo"], Path(args["staging"]), message=args["message"], token=args["token"],
                         revision=args["revision"], create=args["create"], parent=args.get("parent"))
except PipelineError as exc:
    print(json.dumps({"error": str(exc), "where": exc.where, "what": exc.what, "fix": exc.fix,
                      "chained": repr(exc.__cause__) + repr(exc.__context__)}))
    sys.exit(1)
print(json.dumps({"result": result}))
'''


def _staging_files() -> dict[str, bytes]:
    rng = random.Random(7)
    return {
        "README.md": b"---\nlicense: apache-2.0\npipeline_tag: text-generation\n---\n\nRWKV-7 as a Core AI bundle.\n",
        "config.json": b'{"hidden_size": 64, "num_hidden_layers": 2}\n',
        "rwkv_vocab_v20230424.txt": b"1 'a' 1\n2 'b' 1\n3 '\\xe9' 1\n",
        "model.mlpackage/Manifest.json": b'{"fileFormatVersion": "1.0.0"}\n',
        # LFS by suffix
        "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin": bytes(rng.randrange(256) for _ in range(65536)),
        # LFS because the server sniffs binary content (no LFS suffix)
        "coreai/state.dat": b"\0\1\2\3" * 300,
    }


FILES = _staging_files()
LFS = {"model.mlpackage/Data/com.apple.CoreML/weights/weight.bin", "coreai/state.dat"}


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server
        assert server.errors == [], "the Hub stand-in itself failed"
        # the stand-in never keeps credentials; nor should anything it was sent end up in what it keeps
        assert TOKEN not in repr(server.log)


@pytest.fixture
def staging(tmp_path) -> Path:
    root = tmp_path / "staging"
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


class Upload:
    def __init__(self, proc):
        self.rc, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
        self.out = json.loads(last)
        self.result = self.out.get("result")
        self.error = self.out.get("error")

    def __repr__(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def upload(hub, tmp_path, staging, *, message="Publish RWKV-7 Core AI bundle", revision="main",
           create=True, repo=REPO, parent=None) -> Upload:
    args = {"repo": repo, "staging": str(staging), "message": message, "token": TOKEN,
            "revision": revision, "create": create, "parent": parent}
    run = Upload(run_python(UPLOAD, client_env(hub, tmp_path / "hf_home"), json.dumps(args)))
    assert TOKEN not in run.stdout and TOKEN not in run.stderr, run
    return run


def writes(hub) -> list[tuple[str, str]]:
    """Requests that change something on the Hub (preupload/LFS/commit), as (method, path)."""
    return [(e["method"], e["path"]) for e in hub.requests()
            if e["method"] in ("PUT", "POST") and "/paths-info/" not in e["path"]]


def test_first_upload_is_one_commit_with_every_file(hub, tmp_path, staging):
    run = upload(hub, tmp_path, staging)
    assert run.rc == 0, run
    history = hub.history(REPO)
    assert len(history) == 2  # the repo's initial commit (create_repo) + ours
    assert run.result == {"commit": history[0], "committed": sorted(FILES), "skipped": [], "repo": REPO,
                          "revision": "main"}
    commit = hub.commit(REPO, history[0])
    assert commit.message == "Publish RWKV-7 Core AI bundle"
    assert sorted(commit.operations) == sorted(f"add {p}" for p in FILES)
    assert {p: d for p, d in hub.files_at(REPO).items() if p != ".gitattributes"} == FILES
    assert {p for p in FILES if hub.blob(REPO, p).lfs} == LFS
    assert len(hub.requests("POST", "/api/repos/create")) == 1
    assert len(hub.requests("POST", COMMIT)) == 1
    assert len(hub.requests("PUT", "/_lfs/upload/*")) == len(LFS)
    # the token goes to the Hub API (never to the LFS storage href), and is sent, not logged
    assert all(e["auth"] for e in hub.requests() if not e["path"].startswith("/_lfs/upload/"))
    assert not any(e["auth"] for e in hub.requests("PUT", "/_lfs/upload/*"))


def test_reupload_of_the_same_tree_makes_no_commit(hub, tmp_path, staging):
    assert upload(hub, tmp_path, staging).rc == 0
    head = hub.head(REPO)
    hub.clear_log()
    run = upload(hub, tmp_path, staging)
    assert run.rc == 0, run
    assert run.result == {"commit": None, "committed": [], "skipped": sorted(FILES), "repo": REPO,
                          "revision": "main"}
    assert hub.head(REPO) == head
    # only the (idempotent) create and reads: no preupload, no LFS transfer, no commit
    assert writes(hub) == [("POST", "/api/repos/create")]


def test_into_an_existing_repo_with_create_false(hub, tmp_path, staging):
    initial = hub.add_repo(REPO, {"README.md": FILES["README.md"], "old.txt": "kept\n"})
    run = upload(hub, tmp_path, staging, create=False)
    assert run.rc == 0, run
    assert hub.requests("POST", "/api/repos/create") == []
    assert hub.history(REPO)[1] == initial
    assert run.result["skipped"] == ["README.md"]  # already identical on the Hub
    assert run.result["committed"] == sorted(set(FILES) - {"README.md"})
    assert hub.files_at(REPO)["old.txt"] == b"kept\n"  # remote files not in staging are left alone


@pytest.mark.parametrize("change", ["lfs-same-size", "regular", "new-file"])
def test_one_changed_file_is_one_commit_with_only_that_file(hub, tmp_path, staging, change):
    assert upload(hub, tmp_path, staging).rc == 0
    before = hub.head(REPO)
    if change == "lfs-same-size":  # same size, different bytes: caught by the sha256, not the size
        path = "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
        data = bytearray(FILES[path])
        data[1000] ^= 0xFF
        data = bytes(data)
    elif change == "regular":
        path, data = "config.json", b'{"hidden_size": 64, "num_hidden_layers": 3}\n'
    else:
        path, data = "coreai/notes.txt", b"a new file\n"
    (staging / path).parent.mkdir(parents=True, exist_ok=True)
    (staging / path).write_bytes(data)
    hub.clear_log()

    run = upload(hub, tmp_path, staging, message="Update one file")
    assert run.rc == 0, run
    history = hub.history(REPO)
    assert history[1] == before and len(history) == 3
    expected = set(FILES) | {path}
    assert run.result == {"commit": history[0], "committed": [path], "skipped": sorted(expected - {path}),
                          "repo": REPO, "revision": "main"}
    assert hub.commit(REPO, history[0]).operations == [f"add {path}"]
    assert hub.files_at(REPO)[path] == data
    assert len(hub.requests("POST", COMMIT)) == 1
    assert len(hub.requests("PUT", "/_lfs/upload/*")) == (1 if change == "lfs-same-size" else 0)


def test_commit_failure_raises_commits_nothing_and_a_retry_completes(hub, tmp_path, staging):
    hub.create_repo(REPO)
    initial = hub.head(REPO)
    hub.fail("POST", COMMIT, 500, times=1)
    run = upload(hub, tmp_path, staging)
    assert run.rc == 1, run
    assert run.result is None  # nothing reported as committed
    assert "Traceback" not in run.stderr
    assert run.error == (f"hf://{REPO}: Hub request failed (HTTP 500: injected 500); nothing was committed "
                         "-- fix: run the upload again (files already on the Hub are skipped, so a retry is safe)")
    assert run.out["chained"] == "NoneNone"  # no client exception rides along
    assert [e["status"] for e in hub.requests("POST", COMMIT)] == [500]  # the commit POST is not retried
    assert hub.history(REPO) == [initial]
    assert set(hub.files_at(REPO)) == {".gitattributes"}

    hub.clear_log()
    retry = upload(hub, tmp_path, staging)
    assert retry.rc == 0, retry
    assert retry.result["committed"] == sorted(FILES)
    assert hub.history(REPO)[1:] == [initial]
    assert hub.requests("PUT", "/_lfs/upload/*") == []  # the LFS objects were already stored


def test_missing_repo_without_create_and_missing_branch(hub, tmp_path, staging):
    run = upload(hub, tmp_path, staging, create=False, repo="org/absent")
    assert run.rc == 1, run
    assert run.error == ("hf://org/absent: repository not found, or the token cannot see it -- fix: check the "
                         "repo id and the token's permissions (create=True creates a missing repo)")
    hub.create_repo(REPO)
    run = upload(hub, tmp_path, staging, revision="release")
    assert run.rc == 1, run
    assert run.error == (f"hf://{REPO}: branch 'release' not found -- fix: create the branch on the Hub first, "
                         "or publish to main")
    assert writes(hub) == [("POST", "/api/repos/create")]
    assert hub.history(REPO) == [hub.head(REPO)]


def test_token_never_appears_in_output_errors_or_result(hub, tmp_path, staging):
    """Success, no-op, and a refusal whose server message echoes the credential back."""
    ok = upload(hub, tmp_path, staging)  # upload() itself asserts stdout/stderr are free of the token
    assert ok.rc == 0, ok
    (staging / "config.json").write_bytes(b"{}\n")
    hub.fail("POST", f"/api/models/{REPO}/preupload/*", 403, times=1,
             message=f"token {TOKEN} cannot write to {REPO} (Authorization: Bearer {TOKEN})")
    refused = upload(hub, tmp_path, staging)
    assert refused.rc == 1, refused
    assert refused.error == (f"hf://{REPO}: authentication failed (HTTP 403: token <token> cannot write to {REPO} "
                             "(Authorization: Bearer <token>)) -- fix: check that HF_TOKEN holds a valid token with "
                             "write access to the repo")
    assert "\n" not in refused.error
    again = upload(hub, tmp_path, staging)
    assert again.rc == 0 and again.result["committed"] == ["config.json"], again
    for run in (ok, refused, again):
        assert TOKEN not in run.stdout + run.stderr
        assert "TESTTOKEN" not in json.dumps(run.out)


def test_bad_arguments_are_refused_before_any_request(hub, tmp_path, staging):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = upload(hub, tmp_path, empty)
    assert run.rc == 1 and run.error.startswith(f"{empty}: staging directory is empty"), run
    run = upload(hub, tmp_path, tmp_path / "nope")
    assert run.rc == 1 and run.error.startswith(f"{tmp_path / 'nope'}: staging directory does not exist"), run
    run = upload(hub, tmp_path, staging, message="  ")
    assert run.rc == 1 and run.error.startswith(f"hf://{REPO}: empty commit message"), run
    assert hub.log == []


def test_a_branch_that_moved_since_the_given_parent_is_not_overwritten(hub, tmp_path, staging):
    """publish.push merges the card found at commit P and passes parent=P; if a maintainer
    commits after P, the upload must be refused rather than silently overwrite that commit."""
    assert upload(hub, tmp_path, staging).rc == 0
    based_on = hub.head(REPO)
    (staging / "config.json").write_bytes(b'{"hidden_size": 64, "num_hidden_layers": 4}\n')
    moved = upload(hub, tmp_path, staging, message="a maintainer's commit")  # the branch moves on
    assert moved.rc == 0 and hub.head(REPO) != based_on
    head_before = hub.head(REPO)
    (staging / "config.json").write_bytes(b'{"hidden_size": 64, "num_hidden_layers": 5}\n')
    run = upload(hub, tmp_path, staging, parent=based_on)
    assert run.rc == 1 and run.error.startswith(f"hf://{REPO}: ") and "\n" not in run.error, run
    assert hub.head(REPO) == head_before
