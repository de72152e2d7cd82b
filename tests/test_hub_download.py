"""``recurrent_coreai.hub.download.fetch_hf`` against a local stand-in of the Hub (tests/hubserver.py).

Every client session runs in a subprocess: huggingface_hub reads HF_ENDPOINT / HF_HOME /
HF_HUB_OFFLINE when it is imported. The subprocess calls fetch_hf through ``errors.main_guard``,
the CLI wrapper, so a PipelineError shows as one ``error: ...`` line on stderr and exit code 1.
Faults of the Hub or the network (auth, 429, 5xx, resets, timeouts) are in test_hub_faults.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from hubserver import Run, client_env, download, run_python

REPO = "org/tiny"
VOCAB = "rwkv_vocab_v20230424.txt"
FILES = {
    "config.json": b'{"architectures": ["RWKV7ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}\n',
    # any bytes do: fetch_hf does not load weights. Big enough to be cut in the middle, served as LFS.
    "model.safetensors": bytes(range(256)) * 160 + b"tail",
    VOCAB: "".join(f"{i} {chr(96 + i)!r} 1\n" for i in range(1, 27)).encode()
    + "27 '\u00e9t\u00e9' 4\n".encode(),
}


@pytest.fixture
def sha(hub) -> str:
    return hub.add_repo(REPO, FILES)


@pytest.fixture
def hf_home(tmp_path) -> Path:
    return tmp_path / "hf_home"


def fetch(hub, hf_home, revision, allow_patterns=None, repo=REPO, **env) -> Run:
    return download(hub, hf_home, revision, repo=repo, allow_patterns=allow_patterns, **env)


def digests(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


one_error = Run.one_error


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
    assert line == (f"error: hf://{REPO}@{sha}: HF_HUB_OFFLINE is set, so the Hub is not contacted, and the "
                    "snapshot is not (completely) in the Hugging Face cache -- fix: unset HF_HUB_OFFLINE (or fill "
                    "the cache once with network access)")


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


# --- damaged transfers ---------------------------------------------------------------------------
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
import json, sys
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.hub.download import fetch_hf
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
