"""Bad inputs and faults at the stage level: each is ONE line on stderr (and in the job's log),
exit 1, nothing at the output path, and a token in the environment appears in no output stream
and no file. The matrix in the README is backed by these tests, tests/test_bad_checkpoints.py
(checkpoints), tests/test_hub_faults.py (the Hub) and tests/test_config.py (config)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.stages import cli

ROOT = Path(__file__).resolve().parents[1]
MODEL = "rwkv7-tiny"
TOKEN = f"hf_{secrets.token_hex(12)}"


@pytest.fixture(autouse=True)
def token_everywhere(monkeypatch, tmp_path, capsys):
    """A token in the environment during every case; afterwards it must be in no stream, no file."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    yield
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), f"the token leaked into {path}"
    sys.stdout.write(captured.out)
    sys.stderr.write(captured.err)


def config_file(tmp_path: Path, **changes) -> Path:
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["results"] = str(tmp_path / "results")
    for key, value in changes.items():
        cfg[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return path


def one_line(capsys, rc) -> str:
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " -- fix: " in lines[0], err
    return lines[0]


def test_unknown_model_on_the_command_line(tmp_path, capsys):
    conf = config_file(tmp_path)
    line = one_line(capsys, cli.source(["--config-file", str(conf), "--model", "nope", "--out", str(tmp_path / "o")]))
    names = sorted(yaml.safe_load(conf.read_text())["models"])   # every model the file names, sorted
    assert len(names) >= 10 and "rwkv7-tiny" in names
    assert line == f"error: {conf}: unknown model 'nope' -- fix: use one of {names}"
    assert not (tmp_path / "o").exists()


def test_invalid_yaml_in_the_config_file(tmp_path, capsys):
    conf = tmp_path / "config.yaml"
    conf.write_text("results: results\ngate:\n  steps: [127\n")
    line = one_line(capsys, cli.toolchain(["--config-file", str(conf), "--out", str(tmp_path / "t.json")]))
    assert line.startswith(f"error: {conf}: invalid YAML at line 4") and "fix the YAML syntax there" in line


def test_results_pointing_at_a_file(tmp_path, capsys):
    conf = config_file(tmp_path)
    (tmp_path / "results").write_text("a file")
    line = one_line(capsys, cli.toolchain(["--config-file", str(conf), "--out", str(tmp_path / "t.json")]))
    assert f"results: {tmp_path / 'results'} is a file, not a directory" in line


def test_a_file_where_a_directory_output_goes_is_not_replaced(tmp_path, capsys):
    conf = config_file(tmp_path)
    out = tmp_path / "results" / MODEL / "source"
    out.parent.mkdir(parents=True)
    out.write_text("someone's notes")
    line = one_line(capsys, cli.source(["--config-file", str(conf), "--model", MODEL, "--out", str(out)]))
    assert line.startswith(f"error: {out}: is a file where this stage writes a directory")
    assert out.read_text() == "someone's notes"


def test_disk_full_names_the_output_and_the_space(tmp_path, capsys):
    small = tmp_path / "small"
    small.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)], capture_output=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mount.stderr.decode().strip()}")
    try:
        conf = config_file(tmp_path)
        out, log = small / MODEL / "source", tmp_path / "logs" / "source.log"
        line = one_line(capsys, cli.source(["--config-file", str(conf), "--model", MODEL, "--out", str(out),
                                            "--log", str(log)]))
        assert line.startswith(f"error: {out}: no space left on device: ") and "MB written before the disk filled" in line
        assert not out.exists() and list(out.parent.iterdir()) == [], "no partial output, no temporaries"
        assert line in log.read_text()
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_an_internal_error_is_one_line_and_the_traceback_goes_to_the_log(tmp_path, capsys, monkeypatch):
    from recurrent_coreai.stages import toolchain  # the stage module holds main and calls record by this name

    def boom():
        raise RuntimeError("unexpected state\nsecond line")

    monkeypatch.setattr(toolchain, "record", boom)
    log = tmp_path / "toolchain.log"
    line = one_line(capsys, cli.toolchain(["--config-file", str(config_file(tmp_path)), "--out",
                                           str(tmp_path / "t.json"), "--log", str(log)]))
    assert line == ("error: recurrent_coreai.stages.toolchain: internal error (RuntimeError: unexpected state) -- fix: this is a "
                    f"bug: please report it with the traceback in {log}")
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and line in text


def test_temporaries_of_a_killed_stage_are_removed_by_the_next_run(tmp_path, tiny_source, capsys):
    """SIGKILL skips every cleanup: the next run of the same stage removes what it left."""
    conf = config_file(tmp_path)
    out = tmp_path / "results" / MODEL / "export" / "fp32"
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "export.py"), "--config-file", str(conf),
                             "--model", MODEL, "--recipe", "fp32", "--source", str(tiny_source), "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(out.parent.glob(".fp32.*.tmp/fp32/*.aimodel")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stale = list(out.parent.glob(".fp32.*.tmp"))
    assert stale and not out.exists(), "the kill should leave a temporary and no output"
    rc = cli.export(["--config-file", str(conf), "--model", MODEL, "--recipe", "fp32", "--source", str(tiny_source),
                     "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == ["fp32"]


def _copy_tree_without_git(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


def test_a_source_tree_without_git_builds_without_dvc_and_says_so(tmp_path):
    """A release tarball: no git, so no DVC record — one line, and the run still succeeds."""
    tree = _copy_tree_without_git(tmp_path / "tarball")
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}", DVC_NO_ANALYTICS="1",
               GIT_CEILING_DIRECTORIES=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "results/toolchain.json"], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tree / "results" / "toolchain.json").is_file()
    assert ("DVC: not recorded: this tree is not a git repository (DVC needs one); the outputs were built without DVC"
            in proc.stderr)
    assert TOKEN not in proc.stdout + proc.stderr
