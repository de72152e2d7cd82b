"""Faults at the stage level (issue 19, item 7): a full disk during the export and the AOT stages
(whose writers cannot report one: LLVM's output stream exits the process, the lowering writes
through a memory map and dies of SIGBUS), results on a read-only mount, and an interrupt. Each is
ONE line on stderr (and in the job's log), a nonzero exit, and nothing at the output path: no
output, no temporary."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.stages import cli
from recurrent_coreai.util import fsutil
from recurrent_coreai.util.errors import PipelineError, as_pipeline_error, main_guard

ROOT = Path(__file__).resolve().parents[1]
MODEL = "rwkv7-tiny"


def config_file(tmp_path: Path, results: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["results"] = str(results)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return path


def one_line(capsys, rc, code: int = 1) -> str:
    err = capsys.readouterr().err
    assert rc == code, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " -- fix: " in lines[0], err
    return lines[0]


@pytest.fixture
def mount(tmp_path):
    """mount(dir, *options): a tmpfs or a bind mount there, unmounted afterwards (root only)."""
    mounted: list[Path] = []

    def do(where: Path, *args: str) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", *args, str(where)], capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount here (needs root): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield do
    for where in reversed(mounted):
        subprocess.run(["umount", str(where)], check=True)


def tmpfs(mount, where: Path, size: str) -> Path:
    return mount(where, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


def read_only(mount, where: Path) -> Path:
    """``where`` as a read-only view of itself (a bind mount remounted ro: root's mode bits do not count)."""
    mount(where, "--bind", str(where))
    proc = subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return where


def nothing_left(directory: Path) -> None:
    left = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    assert left == [], f"left behind in {directory}: {left}"


# --- a full disk -------------------------------------------------------------------------------
def test_export_on_a_full_disk_is_one_line_before_the_converter_writes(tmp_path, tiny_source, capsys, mount):
    """18 MB of room for a 35 MB fp16 bundle: refused before LLVM's stream would exit the process
    (it left an 18 MB temporary and an empty log)."""
    small = tmpfs(mount, tmp_path / "small", "18m")
    conf = config_file(tmp_path, small)
    out, log = small / MODEL / "export" / "fp16", tmp_path / "logs" / "export-fp16.log"
    rc = cli.export(["--config-file", str(conf), "--model", MODEL, "--recipe", "fp16", "--source", str(tiny_source),
                     "--out", str(out), "--log", str(log)])
    line = one_line(capsys, rc)
    assert line.startswith(f"error: {out}: no space left on device: the bundle {MODEL}-fp16.aimodel needs about "), line
    assert "MB free there" in line and "nothing was written" in line
    nothing_left(out.parent)
    assert line in log.read_text()


def test_aot_on_a_full_disk_is_one_line_not_sigbus(tmp_path, tiny_source, capsys, mount):
    """The export on a roomy disk, the lowering onto a 12 MB one: one line, no temporary."""
    conf = config_file(tmp_path, tmp_path / "results")
    export = tmp_path / "results" / MODEL / "export" / "fp16"
    assert cli.export(["--config-file", str(conf), "--model", MODEL, "--recipe", "fp16", "--source",
                       str(tiny_source), "--out", str(export)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    small = tmpfs(mount, tmp_path / "small", "12m")
    out, log = small / "aot" / "universal" / "fp16", tmp_path / "logs" / "aot.log"
    rc = cli.aot(["--config-file", str(conf), "--model", MODEL, "--recipe", "fp16", "--target", "universal",
                  "--export", str(export), "--out", str(out), "--log", str(log)])
    line = one_line(capsys, rc)
    assert line.startswith(f"error: {out}/{MODEL}-fp16.aimodelx: no space left on device: the lowering of "
                           f"{MODEL}-fp16.aimodel needs about "), line
    nothing_left(out.parent)
    assert line in log.read_text()


def test_require_space_names_the_final_path_not_the_temporary(tmp_path):
    final = tmp_path / "export" / "fp16"
    with pytest.raises(PipelineError) as err:
        with fsutil.atomic_path(final, directory=True) as tmp:
            fsutil.require_space(tmp / "m.aimodel", 1 << 62, "the bundle m.aimodel")
    assert err.value.where == str(final / "m.aimodel") and "needs about" in err.value.what
    nothing_left(final.parent)


# --- a read-only results directory --------------------------------------------------------------
@pytest.mark.parametrize("stage", ["source", "export"])
def test_a_read_only_results_directory_is_one_line(tmp_path, tiny_source, capsys, mount, stage):
    results = read_only(mount, tmp_path / "results")
    conf = config_file(tmp_path, results)
    if stage == "source":
        out = results / MODEL / "source"
        rc = cli.source(["--config-file", str(conf), "--model", MODEL, "--out", str(out)])
    else:
        out = results / MODEL / "export" / "fp32"
        rc = cli.export(["--config-file", str(conf), "--model", MODEL, "--recipe", "fp32", "--source",
                         str(tiny_source), "--out", str(out)])
    line = one_line(capsys, rc)
    assert "is on a read-only file system -- fix: remount it read-write or point results: at a writable" in line, line
    assert f"error: {results}" in line
    nothing_left(results)


def test_a_read_only_log_directory_is_one_line(tmp_path, capsys, mount):
    logs = read_only(mount, tmp_path / "logs")
    conf = config_file(tmp_path, tmp_path / "results")
    rc = cli.toolchain(["--config-file", str(conf), "--out", str(tmp_path / "t.json"), "--log", str(logs / "t.log")])
    line = one_line(capsys, rc)
    assert line.startswith(f"error: {logs / 't.log'}: is on a read-only file system"), line
    assert not (tmp_path / "t.json").exists()


def test_check_writable_says_read_only(tmp_path, mount):
    where = read_only(mount, tmp_path / "results")
    with pytest.raises(PipelineError, match="is on a read-only file system"):
        fsutil.check_writable(where / "m" / "export")
    fsutil.check_writable(tmp_path / "elsewhere" / "deep")  # a writable parent is enough


def test_erofs_from_any_writer_is_one_line():
    err = as_pipeline_error(OSError(errno.EROFS, "Read-only file system", "/r/x"))
    assert str(err) == ("/r/x: is on a read-only file system -- fix: remount it read-write or point results: at a "
                        "writable directory, and run again")


# --- an interrupt ---------------------------------------------------------------------------------
def test_an_interrupt_is_one_line_in_the_log_too(tmp_path, capsys):
    import logging

    log = tmp_path / "stage.log"

    @main_guard
    def stage():
        logging.basicConfig(level=logging.INFO, handlers=[logging.FileHandler(log, mode="w")], force=True)
        raise KeyboardInterrupt

    line = one_line(capsys, stage(), code=130)
    assert line == "error: interrupted -- fix: run it again (its output was not written)"
    assert log.read_text().splitlines()[-1] == line
