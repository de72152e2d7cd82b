"""beta-watch as a hostile user drives it: a wrong index (HTTP 404, an empty project page, a page
without the pinned version, a missing file:// directory, a plain-http host pip ignores, a refused
connection), a requirements.txt without the pin, and wrong types on the command line and in
config.yaml ``beta_watch:``. Each is ONE line on stderr (``error: <where>: <what> -- fix: <fix>``),
a nonzero exit and no report -- never "nothing newer than the pins".

The indexes are PEP 503 simple pages written here and served from a temp dir on 127.0.0.1 (or
read through file://); their links point at files that do not exist: listing a version is all
``pip index versions`` reads."""

from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.tools import beta_watch

ROOT = Path(__file__).resolve().parents[1]
PINS = {"coreai-core": "1.0.0b3", "coreai-torch": "0.4.3", "coreai-opt": "0.4.0"}  # requirements.txt


def page(root: Path, project: str, versions: list[str]) -> None:
    """A PEP 503 project page listing one sdist per version."""
    stem = project.replace("-", "_")
    links = "".join(f'<a href="{stem}-{v}.tar.gz">{stem}-{v}.tar.gz</a><br>\n' for v in versions)
    (root / project).mkdir(parents=True, exist_ok=True)
    (root / project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(directory: Path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def site(tmp_path):
    """<site>/simple: every watched project at its pin (coreai-opt also 0.3.0)."""
    root = tmp_path / "site"
    for project, pin in PINS.items():
        page(root / "simple", project, [pin] + (["0.3.0"] if project == "coreai-opt" else []))
    with serve(root) as url:
        yield root, url


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with the shipped config.yaml and requirements.txt, as the cwd."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("config.yaml", "requirements.txt"):
        shutil.copy(ROOT / name, root / name)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    monkeypatch.chdir(root)
    return root


def beta(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    capsys.readouterr()
    rc = beta_watch.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def one_line(rc: int, err: list[str], start: str, *parts: str) -> str:
    assert rc != 0 and len(err) == 1, (rc, err)
    line = err[0]
    assert line.startswith(start), line
    assert " -- fix: " in line and all(p in line for p in parts), line
    assert "internal error" not in line and "nothing newer" not in line, line
    return line


def test_a_good_index_over_http_and_file_is_nothing_newer(site, repo, capsys):
    root, url = site
    for index in (f"{url}/simple", (root / "simple").as_uri()):
        rc, out, err = beta(capsys, "--index-url", index)
        assert (rc, err) == (0, []) and out == [f"beta-watch: nothing newer than the pins on {index}"], (out, err)


def test_an_index_that_answers_404_is_an_error_naming_the_index_and_the_pin(site, repo, capsys):
    _, url = site
    index = f"{url}/nonexistent/simple"
    rc, out, err = beta(capsys, "--index-url", index)
    line = one_line(rc, err, f"error: index {index}: coreai-core==1.0.0b3 (pinned in requirements.txt) is not "
                    "listed there", f"{index}/coreai-core/", "404", "--index-url")
    assert out == [] and not (repo / "reports").exists()
    print(line)


def test_an_empty_project_page_is_an_error(site, repo, capsys):
    root, url = site
    page(root / "simple", "coreai-torch", [])
    rc, _, err = beta(capsys, "--index-url", f"{url}/simple")
    print(one_line(rc, err, f"error: index {url}/simple: coreai-torch==0.4.3 (pinned in requirements.txt) is not "
                   "listed there", "lists no versions"))


def test_a_page_without_the_pinned_version_is_an_error_even_with_newer_ones(site, repo, capsys):
    root, url = site
    page(root / "simple", "coreai-core", ["1.0.0b2", "1.0.0b4"])  # b4 is newer: still the wrong index
    rc, out, err = beta(capsys, "--index-url", f"{url}/simple")
    print(one_line(rc, err, f"error: index {url}/simple: coreai-core==1.0.0b3 (pinned in requirements.txt) is not "
                   "listed there", "1.0.0b2, 1.0.0b4"))
    assert out == []


def test_a_missing_file_index_directory_is_an_error(tmp_path, repo, capsys):
    index = (tmp_path / "nonexistent").as_uri()
    rc, _, err = beta(capsys, "--index-url", index)
    print(one_line(rc, err, f"error: index {index}: coreai-core==1.0.0b3 (pinned in requirements.txt) is not listed "
                   "there", "neither a file nor a directory"))


def test_a_refused_connection_is_an_error(repo, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    index = f"http://127.0.0.1:{port}/simple"
    rc, _, err = beta(capsys, "--index-url", index)
    print(one_line(rc, err, f"error: index {index}: ", "could not be reached", "Connection refused"))


def test_a_plain_http_index_pip_ignores_is_an_error(repo, capsys):
    index = "http://index.invalid/simple"  # pip skips insecure hosts without asking them: no network
    rc, _, err = beta(capsys, "--index-url", index)
    print(one_line(rc, err, f"error: index {index}: ", "not a trusted or secure host", "https://"))


def test_the_command_line_says_it_in_one_line(site, repo):
    """The real command, as the daily job runs it: one stderr line, exit 1, nothing on stdout."""
    _, url = site
    index = f"{url}/nonexistent/simple"
    proc = subprocess.run([sys.executable, "-m", "recurrent_coreai", "beta-watch", "--index-url", index],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"error: index {index}: "), proc.stderr


# --- requirements.txt ---------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, start, parts", [
    (lambda t: t.replace("coreai-opt==0.4.0\n", ""), "error: {req}: ", ("no exact pin", "coreai-opt")),
    (lambda t: t.replace("coreai-opt==0.4.0", "coreai-opt>=0.4"), "error: {req}: ", ("no exact pin", "coreai-opt")),
    (lambda t: t.replace("coreai-opt==0.4.0", "coreai-opt==0.4.*"), "error: {req}:", ("coreai-opt==0.4.*",)),
    (lambda t: t + "coreai-core==1.0.0b2\n", "error: {req}:", ("coreai-core", "1.0.0b2", "1.0.0b3")),
    (lambda t: t.replace("coreai-opt==0.4.0", "coreai-opt==0.4.0 ;;"), "error: {req}:", ("cannot parse",)),
    (None, "error: {req}: ", ("not found",)),
    (b"\xff\xfe\x00coreai\x80", "error: {req}: ", ("UTF-8",)),
], ids=["pin-missing", "not-exact", "wildcard", "pinned-twice", "unparsable", "file-missing", "binary"])
def test_requirements_without_a_usable_pin(site, repo, capsys, edit, start, parts):
    _, url = site
    req = repo / "requirements.txt"
    if edit is None:
        req.unlink()
    elif isinstance(edit, bytes):
        req.write_bytes(edit)
    else:
        req.write_text(edit(req.read_text()))
    rc, _, err = beta(capsys, "--index-url", f"{url}/simple")
    print(one_line(rc, err, start.format(req=req), *parts))


# --- the command line -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, start, parts", [
    (["--limits", "max_dlogits=3"], "error: --limits: ", ("max_dlogits=3",)),
    (["--limits", "max_agree_drop"], "error: --limits: ", ("KEY=VALUE",)),
    (["--limits", "max_agree_drop=abc"], "error: --limits: ", ("not a number",)),
    (["--limits", "max_agree_drop=nan"], "error: --limits: ", ("max_agree_drop",)),
    (["--limits", "max_agree_drop=-0.1"], "error: --limits: ", ("max_agree_drop", "0..1")),
    (["--limits", "max_dlogits_factor=0.5"], "error: --limits: ", ("max_dlogits_factor", "at least 1")),
    (["--limits", "dlogits_floor=inf"], "error: --limits: ", ("dlogits_floor",)),
    (["--limits"], "error: python -m recurrent_coreai beta-watch: ", ("--limits", "--help")),
    (["--no-such-flag"], "error: python -m recurrent_coreai beta-watch: ", ("--no-such-flag",)),
    (["--index-url"], "error: python -m recurrent_coreai beta-watch: ", ("--index-url",)),
    (["--index-url", "pypi.org/simple"], "error: --index-url: ", ("pypi.org/simple", "https://")),
    (["--index-url", ""], "error: --index-url: ", ("empty",)),
    (["--worktree", "somewhere"], "error: --worktree: ", ("--apply",)),
    (["--apply", "--worktree", "."], "error: .: ", ("already exists",)),
    (["--config-file", "nope.yaml"], "error: ", ("nope.yaml: config file not found",)),
])
def test_bad_arguments(site, repo, capsys, argv, start, parts):
    rc, out, err = beta(capsys, *argv)
    print(one_line(rc, err, start, *parts))
    assert out == []


# --- config.yaml beta_watch: ------------------------------------------------------------------------------
@pytest.mark.parametrize("section, parts", [
    (["coreai-core"], ("beta_watch", "object")),
    ({"packages": "coreai-core"}, ("beta_watch/packages", "array")),
    ({"packages": []}, ("beta_watch/packages",)),
    ({"packages": ["coreai-nothing"]}, ("coreai-nothing", "requirements.txt")),
    ({"index_url": 5}, ("beta_watch/index_url",)),
    ({"index_url": "pypi.org/simple"}, ("beta_watch/index_url",)),
    ({"limits": {"max_agree_drop": "none"}}, ("beta_watch/limits/max_agree_drop",)),
    ({"limits": {"max_dlogits_factor": 0.5}}, ("beta_watch/limits/max_dlogits_factor",)),
    ({"limits": {"max_dlogit_factor": 2}}, ("beta_watch/limits", "max_dlogit_factor")),
    ({"limits": [1, 2]}, ("beta_watch/limits",)),
    ({"index": "https://pypi.org/simple"}, ("beta_watch", "index")),
], ids=["a-list", "packages-a-string", "packages-empty", "package-unpinned", "url-a-number", "url-no-scheme",
        "limit-a-string", "limit-too-small", "limit-misspelt", "limits-a-list", "unknown-key"])
def test_bad_config_section(site, repo, capsys, section, parts):
    _, url = site
    cfg = yaml.safe_load((repo / "config.yaml").read_text())
    cfg["beta_watch"] = section
    (repo / "config.yaml").write_text(yaml.safe_dump(cfg))
    rc, out, err = beta(capsys, "--index-url", f"{url}/simple")
    print(one_line(rc, err, "error: ", *parts))
    assert out == []
