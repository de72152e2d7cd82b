"""The Hub fault matrix: the real huggingface_hub client — our ``fetch_hf`` and ``upload_tree``, each
in a fresh subprocess — against the local stand-in (tests/hubserver.py) with faults injected.

Every case runs with ``HF_TOKEN`` set to a fresh random sentinel that the client really sends (the
stand-in records that an Authorization header came), and every fault answered with an HTTP error
echoes that header back in its message, as a careless proxy might. ``no_leak`` — called by the
runners below, so by every case — asserts the sentinel is in no output stream and in no file name
or content under the test's temp dir (HF cache, stage output, logs, staging).

A failure must be ONE line ``error: <where>: <what> -- fix: <fix>`` and leave nothing at an output
path that looks complete: the snapshot holds only files whose content matches the Hub's (checked
here against the server's own bytes), and no partial file is kept.

The client's backoff is 1, 2, 4, 8, 8 s: faults fire once or twice; a dead endpoint is never used.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

import pytest
import yaml

from hubserver import HubServer, Run, assert_secret_absent, client_env, download, run_client

ROOT = Path(__file__).resolve().parents[1]
REPO = "org/tiny"
VOCAB = "rwkv_vocab_v20230424.txt"
FILES = {
    "config.json": b'{"architectures": ["RWKV7ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}\n',
    "model.safetensors": bytes(range(256)) * 160 + b"tail",  # served as LFS
    VOCAB: "".join(f"{i} {chr(96 + i)!r} 1\n" for i in range(1, 27)).encode(),
}
WEIGHTS = "model.safetensors"
BIG_REPO = "org/big"
MIB = 1024 * 1024
# > 10 MiB: huggingface_hub writes a body in 10 MiB chunks and can only resume from a chunk boundary
BIG = {"config.json": FILES["config.json"], WEIGHTS: bytes(range(256)) * (20 * MIB // 256) + b"end"}
UP_REPO = "org/rwkv7-coreai-faults"
COMMIT = f"/api/models/{UP_REPO}/commit/*"
RETRY = "retry: files that completed stay in the Hugging Face cache and are not fetched again"
READ_FIX = "check that HF_TOKEN holds a valid token with read access to the repo"
WRITE_FIX = "check that HF_TOKEN holds a valid token with write access to the repo"
ECHO = "(Authorization: Bearer <token>)"  # the echoed header, as it must come out: masked


@pytest.fixture
def token() -> str:
    return "hf_" + secrets.token_hex(17)  # the sentinel: random per test, the shape of a real token


@pytest.fixture
def sha(hub) -> str:
    return hub.add_repo(REPO, FILES)


def no_leak(run: Run, token: str, hub: HubServer, tmp_path: Path) -> Run:
    """The one leak check of every case (see the module docstring); also proves the sentinel was live."""
    assert_secret_absent(token, [run.stdout, run.stderr], tmp_path)
    if hub.log:
        assert any(e["auth"] for e in hub.log), "the client sent no token: the leak check would prove nothing"
    return run


def fetch(hub, tmp_path, token, revision, repo=REPO, **env) -> Run:
    run = download(hub, tmp_path / "hf_home", revision, repo=repo, token=token, **env)
    return no_leak(run, token, hub, tmp_path)


def digests(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def left_in_cache(tmp_path: Path, repo: str, files: dict[str, bytes]) -> dict:
    """What a run left in the HF cache: the snapshot's files (each must hold the Hub's exact bytes:
    nothing partial that looks complete) and any partial download."""
    root = tmp_path / "hf_home" / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = []
    for path in sorted((root / "snapshots").rglob("*")):
        if path.is_file():
            name = "/".join(path.relative_to(root / "snapshots").parts[1:])  # below snapshots/<commit>/
            assert path.read_bytes() == files[name], f"{name} in the snapshot is not the Hub's file"
            snapshot.append(name)
    partial = sorted(p.name for p in root.rglob("*.incomplete"))
    return {"snapshot": sorted(snapshot), "partial": partial}


def file_gets(hub, repo: str, name: str) -> list[tuple[int, str | None]]:
    return [(e["status"], e["range"]) for e in hub.requests("GET", f"/{repo}/resolve/*/{name}")]


# --- download: authentication ------------------------------------------------------------------
def test_download_401_on_the_tree_listing(hub, sha, tmp_path, token):
    hub.fail("GET", f"/api/models/{REPO}/tree/*", 401, message="Invalid credentials in Authorization header",
             echo_auth=True)
    line = fetch(hub, tmp_path, token, sha).one_error()
    assert line == (f"error: hf://{REPO}@{sha}: authentication failed (HTTP 401: Invalid credentials in "
                    f"Authorization header {ECHO}) -- fix: {READ_FIX}")
    assert hub.file_requests() == []
    assert left_in_cache(tmp_path, REPO, FILES) == {"snapshot": [], "partial": []}


def test_download_403_on_a_file_body(hub, sha, tmp_path, token):
    hub.fail("GET", f"/{REPO}/resolve/*/{WEIGHTS}", 403, echo_auth=True)  # the first line of the client's
    line = fetch(hub, tmp_path, token, sha).one_error()                  # exception carries the echo
    assert line == (f"error: hf://{REPO}@{sha}: authentication failed (HTTP 403: injected 403 {ECHO}) "
                    f"-- fix: {READ_FIX}")
    assert file_gets(hub, REPO, WEIGHTS) == [(403, None)]
    assert left_in_cache(tmp_path, REPO, FILES) == {"snapshot": ["config.json", VOCAB], "partial": []}


def source_stage(hub, tmp_path, token, sha) -> tuple[Run, Path, Path]:
    """The real source stage (scripts/source.py's entry point) on an ``hf`` source at the stand-in."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["results"] = str(tmp_path / "results")
    cfg["models"]["rwkv7-tiny"]["source"] = {"kind": "hf", "repo": REPO, "revision": sha}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "results" / "rwkv7-tiny" / "source"
    log = tmp_path / "results" / "logs" / "rwkv7-tiny" / "source.log"
    code = "import sys\nfrom recurrent_coreai.stages.cli import source\nsys.exit(source(sys.argv[1:]))\n"
    run = run_client(code, client_env(hub, tmp_path / "hf_home", token=token), "--config-file",
                     str(tmp_path / "config.yaml"), "--model", "rwkv7-tiny", "--out", str(out), "--log", str(log))
    return no_leak(run, token, hub, tmp_path), out, log


def test_download_403_on_a_file_through_the_source_stage(hub, sha, tmp_path, token):
    """huggingface_hub hides a refused HEAD behind "cannot find the requested files in the local
    cache"; the line must still say the token was refused. Run by the real stage: its output
    directory must not appear, and its log must not hold the token either."""
    hub.fail("HEAD", f"/{REPO}/resolve/*/{WEIGHTS}", 403, echo_auth=True)
    run, out, log = source_stage(hub, tmp_path, token, sha)
    line = run.one_error()
    assert line == (f"error: hf://{REPO}@{sha}: authentication failed (HTTP 403: injected 403 {ECHO}) "
                    f"-- fix: {READ_FIX}")
    assert file_gets(hub, REPO, WEIGHTS) == []
    # which of the other files huggingface_hub's parallel download finished before the 403 ended it is
    # timing (CI, 2026-12-02: the vocab not yet); what is there must be whole (left_in_cache), the weights never
    left = left_in_cache(tmp_path, REPO, FILES)
    assert set(left["snapshot"]) <= {"config.json", VOCAB} and left["partial"] == [], left
    assert not out.exists() and sorted(p.name for p in out.parent.iterdir()) == []  # no temp sibling either
    assert line in log.read_text()


# --- download: rate limit and server errors ------------------------------------------------------
def test_download_429_with_retry_after_then_success(hub, sha, tmp_path, token):
    hub.fail("GET", f"/{REPO}/resolve/*/{WEIGHTS}", 429, headers={"Retry-After": "1"})
    run = fetch(hub, tmp_path, token, sha)
    assert run.rc == 0, run
    assert run.files == digests(FILES)
    assert file_gets(hub, REPO, WEIGHTS) == [(429, None), (200, None)]
    limited, retried = hub.requests("GET", f"/{REPO}/resolve/*/{WEIGHTS}")
    waited = retried["t"] - limited["t"]
    assert 1.0 <= waited < 4.0  # huggingface_hub waits Retry-After + 1 s
    print(f"429 Retry-After 1: retried after {waited:.2f} s; whole download {run.seconds:.2f} s")


def test_download_5xx_on_the_listing_and_a_head_then_success(hub, sha, tmp_path, token):
    hub.fail("GET", f"/api/models/{REPO}/tree/*", 503)  # retried after a 1 s backoff
    hub.fail("HEAD", f"/{REPO}/resolve/*/{WEIGHTS}", 500)  # retried at once
    run = fetch(hub, tmp_path, token, sha)
    assert run.rc == 0, run
    assert run.files == digests(FILES)
    assert [e["status"] for e in hub.requests("GET", "/api/models/*/tree/*")] == [503, 200]
    assert [e["status"] for e in hub.requests("HEAD", f"*/{WEIGHTS}")] == [500, 200]


def test_download_500_on_a_file_body_then_a_rerun_fetches_only_that_file(hub, sha, tmp_path, token):
    hub.fail("GET", f"/{REPO}/resolve/*/{WEIGHTS}", 500, echo_auth=True)  # a file GET is not retried on 500
    line = fetch(hub, tmp_path, token, sha).one_error()
    assert line == f"error: hf://{REPO}@{sha}: download failed (HTTP 500: injected 500 {ECHO}) -- fix: {RETRY}"
    assert left_in_cache(tmp_path, REPO, FILES) == {"snapshot": ["config.json", VOCAB], "partial": []}
    hub.clear_log()
    rerun = fetch(hub, tmp_path, token, sha)
    assert rerun.rc == 0, rerun
    assert rerun.files == digests(FILES)
    assert {e["path"].rsplit("/", 1)[1] for e in hub.file_requests()} == {WEIGHTS}  # the rest came from the cache


# --- download: damaged connections ---------------------------------------------------------------
def test_download_connection_reset_mid_file(hub, tmp_path, token):
    """A TCP RST after 16 MiB: huggingface_hub 2.4.0 resumes a body only after a timeout or a clean
    close (next test), not after "connection reset" (httpx2.ReadError), and deletes its partial
    file. So: one line; nothing partial kept; the rerun fetches the file again and it verifies."""
    sha = hub.add_repo(BIG_REPO, BIG)
    hub.reset(BIG_REPO, WEIGHTS, at=16 * MIB)
    line = fetch(hub, tmp_path, token, sha, repo=BIG_REPO).one_error()
    assert line == (f"error: hf://{BIG_REPO}@{sha}: download failed (ReadError: [Errno 104] Connection reset by "
                    f"peer) -- fix: {RETRY}")
    assert left_in_cache(tmp_path, BIG_REPO, BIG) == {"snapshot": ["config.json"], "partial": []}
    hub.clear_log()
    rerun = fetch(hub, tmp_path, token, sha, repo=BIG_REPO)
    assert rerun.rc == 0, rerun
    assert rerun.files == digests(BIG)  # what fetch_hf returns passed our sha256 check
    assert file_gets(hub, BIG_REPO, WEIGHTS) == [(200, None)]  # from byte 0: no partial was kept
    assert file_gets(hub, BIG_REPO, "config.json") == []


def test_download_connection_closed_mid_file_is_resumed_with_range(hub, tmp_path, token):
    sha = hub.add_repo(BIG_REPO, BIG)
    cut = 10 * MIB + 1000
    hub.truncate(BIG_REPO, WEIGHTS, at=cut)
    run = fetch(hub, tmp_path, token, sha, repo=BIG_REPO)
    assert run.rc == 0, run
    assert run.files == digests(BIG)
    (s1, r1), (s2, r2) = file_gets(hub, BIG_REPO, WEIGHTS)
    assert (s1, r1) == (200, None)
    assert s2 == 206 and r2.startswith("bytes=") and r2.endswith("-")
    assert 0 < int(r2[6:-1]) <= cut  # resumed from the partial, not restarted


def test_download_read_timeout(hub, sha, tmp_path, token):
    """The server sends the headers, then nothing for longer than HF_HUB_DOWNLOAD_TIMEOUT (1 s):
    the client tries 6 times (~11 s, fixed by huggingface_hub), then one line. One stall only is
    survived within the run."""
    hub.stall(REPO, WEIGHTS, seconds=30, times=6)
    line = fetch(hub, tmp_path, token, sha, HF_HUB_DOWNLOAD_TIMEOUT="1").one_error()
    assert line == (f"error: hf://{REPO}@{sha}: no data from the Hub for 1 s (ReadTimeout, "
                    f"HF_HUB_DOWNLOAD_TIMEOUT=1) -- fix: {RETRY}; on a slow connection raise "
                    "HF_HUB_DOWNLOAD_TIMEOUT (now 1 s)")
    assert len(file_gets(hub, REPO, WEIGHTS)) == 6
    assert left_in_cache(tmp_path, REPO, FILES) == {"snapshot": ["config.json", VOCAB], "partial": []}
    hub.clear_log()
    hub.stall(REPO, WEIGHTS, seconds=30, times=1)
    rerun = fetch(hub, tmp_path, token, sha, HF_HUB_DOWNLOAD_TIMEOUT="1")
    assert rerun.rc == 0, rerun
    assert rerun.files == digests(FILES)
    assert file_gets(hub, REPO, WEIGHTS) == [(200, None), (200, None)]


# --- upload --------------------------------------------------------------------------------------
# upload_tree as publish.push calls it: the token from the environment, errors through main_guard
UPLOAD = r'''
import json, os, sys
from pathlib import Path
from recurrent_coreai.util.errors import main_guard
from recurrent_coreai.hub.upload import upload_tree

@main_guard
def main():
    repo, staging = sys.argv[1], Path(sys.argv[2])
    print(json.dumps(upload_tree(repo, staging, message="Publish", token=os.environ.get("HF_TOKEN"))))

sys.exit(main())
'''
STAGED = {"README.md": b"---\nlicense: apache-2.0\n---\n\nRWKV-7.\n", "config.json": b"{}\n",
          "model.aimodel/weights.bin": bytes(range(256)) * 64}


def publish(hub, tmp_path, token, **env) -> tuple[Run, dict[str, str]]:
    """upload_tree of a small staging tree; returns the run and the staging tree's digests after it."""
    staging = tmp_path / "staging"
    for name, data in STAGED.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    run = run_client(UPLOAD, client_env(hub, tmp_path / "hf_home", token=token, **env), UP_REPO, str(staging))
    after = {p.relative_to(staging).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in staging.rglob("*") if p.is_file()}
    assert after == digests(STAGED)  # the upload never touches its input
    return no_leak(run, token, hub, tmp_path), after


def test_upload_401_on_create(hub, tmp_path, token):
    hub.fail("POST", "/api/repos/create", 401, message="Invalid credentials in Authorization header", echo_auth=True)
    run, _ = publish(hub, tmp_path, token)
    assert run.one_error() == (f"error: hf://{UP_REPO}: authentication failed (HTTP 401: Invalid credentials in "
                               f"Authorization header {ECHO}) -- fix: {WRITE_FIX}")
    assert UP_REPO not in hub.repos


def test_upload_403_on_the_commit(hub, tmp_path, token):
    hub.create_repo(UP_REPO)
    before = hub.history(UP_REPO)
    hub.fail("POST", COMMIT, 403, echo_auth=True)
    run, _ = publish(hub, tmp_path, token)
    assert run.one_error() == (f"error: hf://{UP_REPO}: authentication failed (HTTP 403: injected 403 {ECHO}) "
                               f"-- fix: {WRITE_FIX}")
    assert hub.history(UP_REPO) == before  # nothing committed (the LFS object may already be stored)
    assert [e["status"] for e in hub.requests("POST", COMMIT)] == [403]


def test_upload_offline_says_unset_hf_hub_offline(hub, tmp_path, token):
    run, _ = publish(hub, tmp_path, token, HF_HUB_OFFLINE="1")
    line = run.one_error()
    assert line == (f"error: hf://{UP_REPO}: HF_HUB_OFFLINE is set, so the Hub is not contacted: uploading needs "
                    "the network -- fix: unset HF_HUB_OFFLINE to publish")
    assert "run the upload again" not in line  # a retry would fail the same way
    assert hub.log == []


def test_the_leak_check_finds_the_secret_in_output_file_names_and_contents(tmp_path, token):
    """no_leak's helper is not vacuous: each place it looks, it finds a planted (partial) secret."""
    with pytest.raises(AssertionError, match="output #1"):
        assert_secret_absent(token, ["", f"Bearer {token[:20]}"], tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "stage.log").write_bytes(b"\0binary\0" + token[-14:].encode())
    with pytest.raises(AssertionError, match="stage.log holds"):
        assert_secret_absent(token, [], tmp_path)
    (tmp_path / "logs" / "stage.log").unlink()
    (tmp_path / "cache" / token).mkdir(parents=True)
    with pytest.raises(AssertionError, match="a file name holds"):
        assert_secret_absent(token, [], tmp_path)
