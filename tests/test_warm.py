"""The run's warm process (pipeline/warm.py): a stage run there writes the bytes, exit status and
lines its own process does; a job that cannot use it (busy, switched off, refused, killed) runs or
ends as it would without it. The stage scripts run as Snakemake runs them: subprocesses in the repo."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recurrent_coreai.pipeline import fingerprint, warm

ROOT = Path(__file__).resolve().parents[1]
MODEL = "mamba2-tiny"  # the fastest default model to export


def _stage(script: str, *args: str, socket: str | None = None, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in (warm.SOCKET_ENV, warm.SWITCH_ENV)}
    full.update(env, OMP_NUM_THREADS="1")
    if socket:
        full[warm.SOCKET_ENV] = socket
    return subprocess.run([sys.executable, f"scripts/{script}.py", "--config-file", "config.yaml", *args], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=600)


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _log_lines(socket: str) -> list[str]:
    return (Path(socket).parent / warm.LOG).read_text().splitlines()


@pytest.fixture
def run(monkeypatch):
    """A run's socket (owner: this test process), closed afterwards: what the Snakefile's hooks do."""
    monkeypatch.delenv(warm.SWITCH_ENV, raising=False)
    socket = warm.open_run(os.getpid())
    yield socket
    warm.close_run()
    shutil.rmtree(Path(socket).parent, ignore_errors=True)


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict[str, Path]:
    """The source and the fp32 export of MODEL, each in its own process (no warm process)."""
    d = tmp_path_factory.mktemp("local")
    assert _stage("source", "--model", MODEL, "--out", str(d / "source")).returncode == 0
    r = _stage("export", "--model", MODEL, "--recipe", "fp32", "--source", str(d / "source"), "--out", str(d / "export"))
    assert r.returncode == 0, r.stderr
    return {"source": d / "source", "export": d / "export"}


def test_a_stage_in_the_warm_process_writes_the_bytes_of_its_own_process(run, local, tmp_path):
    src = _stage("source", "--model", MODEL, "--out", str(tmp_path / "source"), "--log", str(tmp_path / "source.log"),
                 socket=run)
    assert src.returncode == 0, src.stderr
    exports = []
    for i in range(2):  # the second export in a process that has run one already
        exports.append(tmp_path / f"export{i}")
        r = _stage("export", "--model", MODEL, "--recipe", "fp32", "--source", str(tmp_path / "source"),
                   "--out", str(exports[-1]), "--log", str(tmp_path / f"export{i}.log"), socket=run)
        assert r.returncode == 0, r.stderr
    assert [line.split(" in ")[0] for line in _log_lines(run)] == ["ran source exit 0", "ran export exit 0",
                                                                   "ran export exit 0"]
    assert _tree(tmp_path / "source") == _tree(local["source"])
    for out in exports:
        assert _tree(out) == _tree(local["export"]), out
    # the job's own stdout and --log have the stage's lines (its descriptors were the warm process's)
    assert f"export {MODEL}/fp32: {MODEL}-fp32.aimodel" in r.stdout
    assert f"export {MODEL}/fp32: {MODEL}-fp32.aimodel" in (tmp_path / "export1.log").read_text()
    said = warm.close_run()
    assert said == "warm process: ran 3 job(s) (export 2, source 1)"


def test_bad_input_is_the_same_line_and_exit_in_the_warm_process(run, tmp_path):
    args = ("--model", "no-such-model", "--out", str(tmp_path / "x"))
    own, served = _stage("source", *args), _stage("source", *args, socket=run)
    assert (served.returncode, served.stderr) == (own.returncode, own.stderr)
    assert own.returncode == 1 and own.stderr.startswith("error: ") and len(own.stderr.splitlines()) == 1
    assert [line.split(" in ")[0] for line in _log_lines(run)] == ["ran source exit 1"]
    assert not (tmp_path / "x").exists()


def test_a_busy_warm_process_leaves_the_job_to_its_own_process(run, local, tmp_path):
    assert _stage("source", "--model", MODEL, "--out", str(tmp_path / "a"), socket=run).returncode == 0
    with open(Path(run).parent / "busy.lock", "w") as busy:
        fcntl.flock(busy, fcntl.LOCK_EX)  # another job is being served (snakemake --cores 2)
        r = _stage("source", "--model", MODEL, "--out", str(tmp_path / "b"), socket=run)
    assert r.returncode == 0, r.stderr
    assert len(_log_lines(run)) == 1  # the first job only
    assert _tree(tmp_path / "b") == _tree(local["source"])


def test_a_killed_job_ends_the_warm_process_before_its_output_appears(run, local, tmp_path):
    assert _stage("source", "--model", MODEL, "--out", str(tmp_path / "s"), socket=run).returncode == 0
    pid = int((Path(run).parent / "pid").read_text())
    env = {k: v for k, v in os.environ.items() if k != warm.SWITCH_ENV}
    env.update({warm.SOCKET_ENV: run, "OMP_NUM_THREADS": "1"})
    job = subprocess.Popen([sys.executable, "scripts/export.py", "--config-file", "config.yaml", "--model", MODEL,
                            "--recipe", "fp32", "--source", str(local["source"]), "--out", str(tmp_path / "e")],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)  # the export is running in the warm process (started and warm: the source job above)
    assert job.poll() is None
    job.send_signal(signal.SIGKILL)  # what Snakemake does to a job it gives up (Ctrl-C, --keep-going off)
    job.wait()
    deadline = time.monotonic() + 10
    while warm._alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not warm._alive(pid), "the warm process went on with a job nobody waits for"
    time.sleep(1)
    assert not (tmp_path / "e").exists()
    # the next job starts another warm process
    r = _stage("source", "--model", MODEL, "--out", str(tmp_path / "t"), socket=run)
    assert r.returncode == 0, r.stderr
    assert int((Path(run).parent / "pid").read_text()) != pid
    assert _log_lines(run)[-1].startswith("ran source exit 0")


def test_the_warm_process_ends_with_the_snakemake_process_that_opened_the_run(monkeypatch, tmp_path):
    monkeypatch.delenv(warm.SWITCH_ENV, raising=False)
    owner = subprocess.Popen(["sleep", "10"])  # outlives the first job even on a slow host
    socket = warm.open_run(owner.pid)
    try:
        assert _stage("source", "--model", MODEL, "--out", str(tmp_path / "s"), socket=socket).returncode == 0
        pid = int((Path(socket).parent / "pid").read_text())
        assert warm._alive(pid)
        owner.wait()
        deadline = time.monotonic() + 3 * warm.POLL_S + 5
        while warm._alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not warm._alive(pid)
    finally:
        warm.close_run()


def test_a_warm_process_left_with_more_memory_than_it_may_keep_ends_after_the_job(run, tmp_path):
    run_dir = Path(run).parent
    server = subprocess.Popen([sys.executable, "-m", warm.__name__, "--socket", run, "--retain-mb", "1"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=open(run_dir / warm.LOG, "ab"), start_new_session=True)
    (run_dir / "pid").write_text(str(server.pid))  # as the first job would have started it
    assert _stage("source", "--model", MODEL, "--out", str(tmp_path / "s"), socket=run).returncode == 0
    assert server.wait(timeout=10) == 0
    assert _log_lines(run)[-1].startswith("ran source exit 0")


def test_a_warm_process_that_cannot_start_leaves_every_job_to_its_own_process(run, local, tmp_path):
    Path(run).mkdir()  # the socket's path is taken: the warm process cannot listen there
    for name in ("a", "b"):
        r = _stage("source", "--model", MODEL, "--out", str(tmp_path / name), socket=run)
        assert r.returncode == 0, r.stderr
        assert _tree(tmp_path / name) == _tree(local["source"])
        if name == "a":
            pid = (Path(run).parent / "pid").read_text()
    assert (Path(run).parent / "pid").read_text() == pid  # the second job did not try again
    said = warm.close_run()
    assert said.startswith(f"warm process: could not start (pid {pid} did not listen); every job ran in its own "
                           "process\n"), said
    assert "Address already in use" in said


def test_switched_off_every_stage_runs_in_its_own_process(monkeypatch, run, tmp_path):
    r = _stage("source", "--model", MODEL, "--out", str(tmp_path / "s"), socket=run, **{warm.SWITCH_ENV: "0"})
    assert r.returncode == 0, r.stderr
    assert not (Path(run).parent / "pid").exists()  # no warm process was started
    monkeypatch.setenv(warm.SWITCH_ENV, "0")
    monkeypatch.delenv(warm.SOCKET_ENV)
    assert warm.open_run(os.getpid()) is None and warm.SOCKET_ENV not in os.environ


def test_the_warm_process_refuses_a_job_after_a_code_change_or_elsewhere():
    server = warm.Server.__new__(warm.Server)  # its checks only: no imports, no socket
    module = ROOT / "recurrent_coreai" / "stages" / "source.py"
    st = module.stat()
    server.cwd, server.code = str(ROOT), {str(module): (st.st_mtime_ns, st.st_size)}
    job = {"module": "recurrent_coreai.stages.source", "cwd": str(ROOT), "package": str(warm.PACKAGE)}
    assert server.refused(job) is None
    server.code[str(module)] = (st.st_mtime_ns - 1, st.st_size)  # edited since the warm process loaded it
    assert server.refused(job) == f"code changed since it started: {module}"
    server.code[str(module)] = (st.st_mtime_ns, st.st_size)
    assert "another working directory" in server.refused({**job, "cwd": "/elsewhere"})
    assert "not served" in server.refused({**job, "module": "recurrent_coreai.stages.publish"})
    assert "another copy of the package" in server.refused({**job, "package": "/elsewhere/recurrent_coreai"})


def test_the_served_stages_code_sets_hold_the_warm_process_and_the_others_do_not():
    for rule, (_, module) in fingerprint.ENTRY.items():
        served = f"recurrent_coreai.{module}" in warm.SERVED
        attests = rule == "stage_and_push"  # the code of every rule it attests (fingerprint.ATTESTED)
        assert ("recurrent_coreai/pipeline/warm.py" in fingerprint.code_files(rule)) == (served or attests), rule
        script = (ROOT / "scripts" / f"{fingerprint.ENTRY[rule][0]}.py").read_text()
        assert ("run_stage(" in script) == served, rule
    assert {m.rsplit(".", 1)[-1] for m in warm.SERVED} == {"source", "reference", "export", "aot", "doctor",
                                                            "gate_shard", "gate"}
