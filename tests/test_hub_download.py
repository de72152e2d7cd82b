"""``rwkv7_coreai.source.fetch_hf`` against a local stand-in of the Hub (tests/hubserver.py).

Every client session runs in a subprocess: huggingface_hub reads HF_ENDPOINT / HF_HOME /
HF_HUB_OFFLINE when it is imported. The subprocess calls fetch_hf through ``errors.main_guard``,
the CLI wrapper, so a PipelineError shows as one ``error: ...`` line on stderr and exit code 1.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from hubserver import HubServer, client_env, run_python

REPO = "org/tiny"
VOCAB = "rwkv_vocab_v20230424.txt"
FILES = {
    "config.json": b'{"architectures": ["RWKV7ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}\n',
    # any bytes do: fetch_hf does not load weights. Big enough to be cut in the middle, served as LFS.
    "model.safetensors": bytes(range(256)) * 160 + b"tail",
    VOCAB: "".join(f"{i} {chr(96 + i)!r} 1\n" for i in range(1, 27)).encode()
    + "27 '\u00e9t\u00e9' 4\n".encode(),
}

# fetch_hf through the CLI wrapper. rwkv7_coreai.source imports .checkpoint and .synthetic, which import
# torch (~3 s per process); fetch_hf/verify_snapshot use neither, so they are replaced by stubs that fail
# loudly if anything touches them.
CLIENT = r'''
import hashlib, json, sys, types
import rwkv7_coreai
for _name in ("checkpoint", "synthetic"):
    _stub = types.ModuleType("rwkv7_coreai." + _name)
    def _unavailable(attr, _name=_name):
        raise AttributeError(f"rwkv7_coreai.{_name} is stubbed out in test_hub_download (no torch): {attr}")
    _stub.__getattr__ = _unavailable
    sys.modules[_stub.__name__] = _stub
    setattr(rwkv7_coreai, _name, _stub)
from pathlib import Path
from rwkv7_coreai.errors import main_guard
from rwkv7_coreai.source import fetch_hf

@main_guard
def main():
    args = json.loads(sys.argv[1])
    snapshot = fetch_hf(args["repo"], args["revision"], args.get("allow_patterns"))
    files = {p.relative_to(snapshot).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(snapshot.rglob("*")) if p.is_file()}
    blobs = {p.relative_to(snapshot).as_posix(): Path(p.resolve()).name
             for p in sorted(snapshot.rglob("*")) if p.is_file()}
    print(json.dumps({"snapshot": str(snapshot), "files": files, "blobs": blobs}))

sys.exit(main())
'''


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server
        assert server.errors == [], "the Hub stand-in itself failed"


@pytest.fixture
def sha(hub) -> str:
    return hub.add_repo(REPO, FILES)


@pytest.fixture
def hf_home(tmp_path) -> Path:
    return tmp_path / "hf_home"


class Run:
    def __init__(self, proc):
        self.rc, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        self.result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
        self.errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]

    @property
    def files(self) -> dict[str, str]:
        """sha256 of every file of the returned snapshot."""
        return self.result["files"]

    def __repr__(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


def fetch(hub, hf_home, revision, allow_patterns=None, repo=REPO, **env) -> Run:
    args = json.dumps({"repo": repo, "revision": revision, "allow_patterns": allow_patterns})
    return Run(run_python(CLIENT, client_env(hub, hf_home, **env), args))


def digests(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def one_error(run: Run) -> str:
    """The single ``error:`` line of a failed run (and nothing like a traceback)."""
    assert run.rc == 1, run
    assert "Traceback" not in run.stderr, run
    assert len(run.errors) == 1, run
    return run.errors[0]


def gets(hub, path: str) -> list[dict]:
    return hub.requests("GET", f"/{REPO}/resolve/*/{path}")


# --- happy paths ---------------------------------------------------------------------------------
def test_first_download_fetches_every_file_and_verifies_it(hub, sha, hf_home):
    run = fetch(hub, hf_home, sha)
    assert run.rc == 0, run
    assert Path(run.result["snapshot"]).name == sha
    assert run.files == digests(FILES)
    # the cache is content-addressed the way verify_snapshot expects: sha256 for LFS, git sha1 otherwise
    assert run.result["blobs"]["model.safetensors"] == hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    assert run.result["blobs"]["config.json"] == hub.blob(REPO, "config.json").sha1
    # one tree listing, then HEAD + GET per file, nothing retried, no repo-info call (pinned sha)
    assert [e["status"] for e in hub.requests("GET", "/api/models/*/tree/*")] == [200]
    assert hub.requests(path_glob="/api/models/*/revision/*") == []
    for name in FILES:
        assert [e["status"] for e in hub.requests("HEAD", f"/{REPO}/resolve/{sha}/{name}")] == [200]
        assert [(e["status"], e["range"]) for e in gets(hub, name)] == [(200, None)]
    assert not any(e["auth"] for e in hub.log)  # no token configured, none sent


def test_allow_patterns_limit_the_download(hub, sha, hf_home):
    run = fetch(hub, hf_home, sha, allow_patterns=["*.json", "*.txt"])
    assert run.rc == 0, run
    assert run.files == digests({k: v for k, v in FILES.items() if k != "model.safetensors"})
    assert gets(hub, "model.safetensors") == []
    assert hub.requests("HEAD", "*/model.safetensors") == []


def test_allow_patterns_matching_nothing_is_an_error(hub, sha, hf_home):
    line = one_error(fetch(hub, hf_home, sha, allow_patterns=["*.gguf"]))
    assert line == (f"error: hf://{REPO}@{sha}: allow_patterns ['*.gguf'] matched no file "
                    "-- fix: fix allow_patterns in config.yaml")


def test_warm_cache_makes_zero_file_requests(hub, sha, hf_home):
    first = fetch(hub, hf_home, sha)
    assert first.rc == 0, first
    assert len(hub.file_requests()) == 2 * len(FILES)
    hub.clear_log()
    second = fetch(hub, hf_home, sha)
    assert second.rc == 0, second
    assert second.result["snapshot"] == first.result["snapshot"]
    assert second.files == digests(FILES)
    assert hub.file_requests() == []
    assert hub.log == []  # pinned sha + cached tree listing: not even an API call


def test_offline_with_a_filled_cache_works_without_any_request(hub, sha, hf_home):
    assert fetch(hub, hf_home, sha).rc == 0
    hub.clear_log()
    run = fetch(hub, hf_home, sha, HF_HUB_OFFLINE="1")
    assert run.rc == 0, run
    assert run.files == digests(FILES)
    assert hub.log == []


def test_offline_with_an_empty_cache_says_so(hub, sha, hf_home):
    line = one_error(fetch(hub, hf_home, sha, HF_HUB_OFFLINE="1"))
    assert hub.log == []
    assert line == (f"error: hf://{REPO}@{sha}: files not in the local cache and the Hub could not be reached "
                    "(or a file is missing) -- fix: run once with network access, or unset HF_HUB_OFFLINE")


# --- errors from the Hub -------------------------------------------------------------------------
def test_missing_repo_is_a_one_line_error(hub, sha, hf_home):
    line = one_error(fetch(hub, hf_home, sha, repo="org/missing"))
    assert line == (f"error: hf://org/missing@{sha}: repository not found (or private without a token) "
                    "-- fix: check source.repo in config.yaml, or set HF_TOKEN for a private repo")
    tree = hub.requests("GET", "/api/models/org/missing/tree/*")
    assert [e["status"] for e in tree] == [404]  # a 404 is not retried
    assert hub.file_requests() == []


def test_missing_revision_is_a_one_line_error(hub, sha, hf_home):
    unknown = "1234567890abcdef1234567890abcdef12345678"
    line = one_error(fetch(hub, hf_home, unknown))
    assert line == (f"error: hf://{REPO}@{unknown}: revision not found on the Hub "
                    "-- fix: check the commit hash in config.yaml")
    assert [e["status"] for e in hub.requests("GET", "/api/models/*/tree/*")] == [404]
    assert hub.file_requests() == []


def test_injected_revision_not_found_code_is_honoured(hub, sha, hf_home):
    """The error class follows X-Error-Code, not the status alone."""
    hub.fail("GET", f"/api/models/{REPO}/tree/*", 404, error_code="RevisionNotFound", times=1)
    line = one_error(fetch(hub, hf_home, sha))
    assert line.startswith(f"error: hf://{REPO}@{sha}: revision not found on the Hub -- fix:")


def test_server_errors_then_success(hub, sha, hf_home):
    hub.fail("GET", f"/api/models/{REPO}/tree/*", 503, times=1)  # retried after a 1 s backoff
    hub.fail("HEAD", f"/{REPO}/resolve/*/model.safetensors", 500, times=1)  # retried at once
    run = fetch(hub, hf_home, sha)
    assert run.rc == 0, run
    assert run.files == digests(FILES)
    assert [e["status"] for e in hub.requests("GET", "/api/models/*/tree/*")] == [503, 200]
    assert [e["status"] for e in hub.requests("HEAD", "*/model.safetensors")] == [500, 200]


def test_server_error_on_a_file_body_is_a_one_line_error(hub, sha, hf_home):
    hub.fail("GET", f"/{REPO}/resolve/*/model.safetensors", 500, times=5)  # GETs are not retried on 500
    line = one_error(fetch(hub, hf_home, sha))
    assert line.startswith(f"error: hf://{REPO}@{sha}: download failed (HfHubHTTPError: ")
    assert line.endswith("-- fix: retry; the cache keeps what was already downloaded")


# --- damaged transfers ---------------------------------------------------------------------------
def test_truncated_body_is_resumed_with_range_and_verified(hub, hf_home):
    # the client writes in 10 MiB chunks and resumes from what it wrote: cut a >10 MiB file past 10 MiB
    big = {"config.json": FILES["config.json"], "model.safetensors": bytes(range(256)) * 41000 + b"end"}
    sha = hub.add_repo("org/big", big)
    cut = 10 * 1024 * 1024 + 1000
    hub.truncate("org/big", "model.safetensors", at=cut)
    run = fetch(hub, hf_home, sha, repo="org/big")
    assert run.rc == 0, run
    assert run.files == digests(big)
    first, second = hub.requests("GET", "/org/big/resolve/*/model.safetensors")
    assert (first["status"], first["range"]) == (200, None)
    assert second["status"] == 206 and second["range"].startswith("bytes=") and second["range"].endswith("-")
    assert 0 < int(second["range"][6:-1]) <= cut  # resumed, not restarted


def test_connection_dropped_on_every_try_is_a_one_line_error(hub, sha, hf_home):
    hub.truncate(REPO, "model.safetensors", at=0, times=100)  # the client gives up after 5 resumes (~5 s)
    run = fetch(hub, hf_home, sha, allow_patterns=["model.safetensors"])
    line = one_error(run)
    assert line.startswith(f"error: hf://{REPO}@{sha}: ") and "RemoteProtocolError" in line


@pytest.mark.parametrize("name, kind", [("model.safetensors", "sha256"), ("config.json", "git sha1")])
def test_corrupted_body_of_the_right_size_is_rejected(hub, sha, hf_home, name, kind):
    hub.corrupt(REPO, name)
    run = fetch(hub, hf_home, sha)
    line = one_error(run)
    blob = hub.blob(REPO, name)
    served = bytes(b ^ 0x5A for b in FILES[name])
    got = hashlib.sha256(served).hexdigest() if kind == "sha256" else \
        hashlib.sha1(b"blob %d\0" % len(served) + served).hexdigest()
    assert got != blob.etag
    home = Path(os.path.realpath(hf_home))
    snapshot_file = home / "hub" / "models--org--tiny" / "snapshots" / sha / name
    cached_blob = home / "hub" / "models--org--tiny" / "blobs" / blob.etag
    assert line == (f"error: {snapshot_file}: content {kind} {got} does not match the Hub's {blob.etag} "
                    f"(corrupted or truncated download) -- fix: delete {os.path.realpath(cached_blob)} "
                    "from the Hugging Face cache and run again")
    # the client itself accepted it: same size, stored under the true hash
    assert cached_blob.read_bytes() == served
    # a warm cache with the bad blob is caught again, without asking the Hub
    hub.clear_log()
    assert one_error(fetch(hub, hf_home, sha)) == line
    assert hub.log == []
    # following the fix works
    cached_blob.unlink()
    hub.corrupted.clear()
    run = fetch(hub, hf_home, sha)
    assert run.rc == 0, run
    assert run.files == digests(FILES)


# --- refused before any request ------------------------------------------------------------------
REFUSE = r'''
import json, sys, types
import rwkv7_coreai
for _name in ("checkpoint", "synthetic"):
    _stub = types.ModuleType("rwkv7_coreai." + _name)
    sys.modules[_stub.__name__] = _stub
    setattr(rwkv7_coreai, _name, _stub)
from rwkv7_coreai.errors import PipelineError
from rwkv7_coreai.source import fetch_hf
out = []
for revision in json.loads(sys.argv[1]):
    try:
        fetch_hf("org/tiny", revision, None)
        out.append(None)
    except PipelineError as exc:
        out.append(str(exc))
print(json.dumps(out))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "huggingface_hub")))
'''


def test_unpinned_revisions_are_refused_before_any_request(hub, sha, hf_home):
    revisions = ["0" * 40, "main", sha[:12], sha.upper(), f" {sha}", "v1.0"]
    proc = run_python(REFUSE, client_env(hub, hf_home), json.dumps(revisions))
    assert proc.returncode == 0, proc.stderr
    messages_line, hub_modules_line = proc.stdout.strip().splitlines()[-2:]
    messages = json.loads(messages_line)
    assert messages[0] == (f"hf://{REPO}@{'0' * 40}: the revision is the unpinned placeholder -- fix: run "
                           "`python scripts/pin_revision.py MODEL` where the Hub is reachable and commit config.yaml")
    for revision, message in zip(revisions[1:], messages[1:]):
        assert message == (f"hf://{REPO}@{revision}: revision is not a full 40-hex commit hash "
                           "-- fix: pin the exact commit (python scripts/pin_revision.py MODEL)")
    assert hub.log == []
    assert json.loads(hub_modules_line) == []  # refused before huggingface_hub was even imported
    assert not hf_home.exists()
