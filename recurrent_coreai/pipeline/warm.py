"""One warm process per Snakemake run: the jobs of the stages that import torch or the converter
run there, one after another, instead of each in a new interpreter (as Gradle's daemon or Bazel's
server do for builds).

Why: an export job spent ~4 s of its ~9 s on what every new process pays -- importing torch and
the converter, ``torch.export``'s lazy imports, its first-call set-up -- and the default DAG runs
18 of them, beside 18 aot, 18 doctor, 18 gate shard, 18 gate, 6 source and 6 reference jobs
(docs/measurements/2026-12-07-warm-process.md). In a process that has run stages before, a stage
writes the same bytes (checked for every default bundle, ``main.mlirb`` and ``.odix``, and by
tests/test_warm.py for whole output directories) in the time of its work alone.

How, for a job of a :data:`SERVED` stage (``scripts/<stage>.py`` calls :func:`run_stage`):

* The Snakefile's ``onstart`` names a socket for the run (:func:`open_run`: ``SOCKET_ENV`` in the
  jobs' environment) for local execution in Snakemake's own environment only (no ``--sdm
  conda``/apptainer), unless ``RECURRENT_COREAI_WARM=0``. ``dvc repro``, a stage run by hand and a
  cluster job never have it: they run in their own process, as before.
* The first such job starts the warm process (:func:`main`, with the interpreter and the copy of
  the package the job runs) and waits for it to listen, which it does once it has imported the
  served stages. A job hands it its arguments, working directory, environment
  (``OMP_NUM_THREADS`` sets torch's threads) and its stdout and stderr (the descriptors
  themselves), and exits with the stage's exit status. One job at a time: a job that finds it
  busy (``--cores 2`` and up) runs in its own process.
* A job that dies (Snakemake kills it, Ctrl-C) takes its work with it: the warm process exits at
  once, before the stage can finish an output, and the next job starts another. A job whose warm
  process dies under it runs again in its own process (a warning line says so). The warm process
  refuses a job when a package module it loaded has changed on disk since (that job runs in its
  own process), ends after a job that leaves it above :data:`RETAIN_MB` resident, and ends when
  the Snakemake process that opened the run is gone, or when :func:`close_run` stops it
  (``onsuccess``/``onerror``, which print what it ran).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import importlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

SOCKET_ENV = "RECURRENT_COREAI_WARM_SOCKET"  # set by the Snakefile's onstart for the run's jobs
SWITCH_ENV = "RECURRENT_COREAI_WARM"  # "0": every stage in its own process
# the stages whose jobs it runs: the ones that import torch, the converter or the runtime (not the
# publish stage: it alone reads the Hub token)
SERVED = tuple(f"recurrent_coreai.stages.{s}" for s in ("source", "reference", "export", "aot", "doctor", "gate_shard",
                                                           "gate"))
RETAIN_MB = 1536  # a warm process whose RSS stays above this after a job ends after it
PACKAGE = Path(__file__).resolve().parents[1]
LOG = "warm.log"  # in the run's directory: one line per job (SERVED_LINE or DECLINED_LINE)
SERVED_LINE, DECLINED_LINE = "ran ", "declined "
READY = "ready"  # in the run's directory: the pid of the warm process once it listens
FAILED = "failed"  # in the run's directory: the warm process could not start; no job tries again
START_WAIT_S = 120  # the longest a first job waits for the warm process to listen
WATCHER_JOIN_S = 30  # how long the job may take to close its end after reading its status
POLL_S = 2.0  # how often the idle warm process checks that its Snakemake process still runs


# --- the Snakefile's side -------------------------------------------------------------------------
def open_run(owner_pid: int) -> str | None:
    """A socket path for this run's jobs (in a new private directory), put in ``SOCKET_ENV``; None
    where the switch is off. Nothing starts here: the first served job starts the warm process."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None
    run_dir = Path(tempfile.mkdtemp(prefix="rcw-"))  # short: a socket path has ~100 bytes at most
    (run_dir / "owner").write_text(str(owner_pid))
    os.environ[SOCKET_ENV] = str(run_dir / "socket")
    return os.environ[SOCKET_ENV]


def close_run() -> str | None:
    """Stop this run's warm process (if one started) and remove its directory; one line on what
    it ran (None: no warm process this run)."""
    path = os.environ.pop(SOCKET_ENV, None)
    if not path:
        return None
    run_dir = Path(path).parent
    pid = _pid(run_dir / "pid")
    if pid is not None and _ours(pid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    try:
        lines = (run_dir / LOG).read_text().splitlines()
    except OSError:
        lines = []
    failed = (run_dir / FAILED).read_text() if (run_dir / FAILED).exists() else ""
    shutil.rmtree(run_dir, ignore_errors=True)
    if pid is None:
        return None
    if failed:  # its log goes with the directory: its last lines, where the run's output is read
        return (f"warm process: could not start ({failed}); every job ran in its own process"
                + "".join(f"\n  {line}" for line in lines[-3:]))
    served = collections.Counter(line.split()[1] for line in lines if line.startswith(SERVED_LINE))
    declined = sum(line.startswith(DECLINED_LINE) for line in lines)
    return (f"warm process: ran {sum(served.values())} job(s) ({', '.join(f'{k} {n}' for k, n in sorted(served.items()))})"
            + (f"; {declined} declined (run in their own process)" if declined else ""))


# --- a job's side ---------------------------------------------------------------------------------
def run_stage(module: str, argv: list[str]) -> int:
    """``module``'s ``main(argv)``: in the run's warm process where there is one to use, else here."""
    path = os.environ.get(SOCKET_ENV)
    if path and module in SERVED and os.environ.get(SWITCH_ENV, "1") != "0":
        rc = _served(Path(path), module, argv)
        if rc is not None:
            return rc
    return importlib.import_module(module).main(argv)


def _started(path: Path) -> bool:
    """The warm process listens at ``path`` (started here if no live one has the run)."""
    run_dir = path.parent
    if not (run_dir / "owner").is_file() or (run_dir / FAILED).exists():
        return False
    with open(run_dir / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pid = _pid(run_dir / "pid")
        if pid is None or not _alive(pid):
            for stale in (path, run_dir / READY):  # a dead one's (killed with a job)
                with contextlib.suppress(OSError):
                    stale.unlink()
            # the package this job imported, first on the path (``-m`` would put the working
            # directory's first, another copy where the job imports an installed one)
            code = f"import sys; sys.path.insert(0, {str(PACKAGE.parent)!r}); from {__name__} import main; sys.exit(main())"
            with open(run_dir / LOG, "ab") as log:
                proc = subprocess.Popen([sys.executable, "-c", code, "--socket", str(path)],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
            (run_dir / "pid").write_text(str(proc.pid))
            pid = proc.pid
    deadline = time.monotonic() + START_WAIT_S
    while _pid(run_dir / READY) != pid:
        if not _alive(pid) or time.monotonic() > deadline:
            # it could not start (an import failed: its log says why): the run's jobs go on without
            # it, each in its own process, rather than each trying again
            (run_dir / FAILED).write_text(f"pid {pid} did not listen")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
            return False
        time.sleep(0.05)
    return True


def _served(path: Path, module: str, argv: list[str]) -> int | None:
    """The exit status from the warm process; None: run it here (none, busy, refused, or it died)."""
    try:
        busy = open(path.parent / "busy.lock", "w")
    except OSError:
        return None
    with busy:
        try:
            fcntl.flock(busy, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # serving another job (snakemake --cores 2 and up)
        if not _started(path):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        socket.send_fds(sock, [b"j"], [sys.stdout.fileno(), sys.stderr.fileno()])
        conn = Connection(sock.detach())
        conn.send({"module": module, "argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ),
                   "package": str(PACKAGE)})
        try:
            reply = conn.recv()
            if "declined" in reply:
                return None
            return int(conn.recv()["rc"])
        except (EOFError, OSError):
            print(f"warning: the run's warm process ended during {module.rsplit('.', 1)[-1]}; "
                  "running it in its own process", file=sys.stderr)
            return None
        finally:
            conn.close()


# --- the warm process -----------------------------------------------------------------------------
def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _ours(pid: int) -> bool:
    """``pid`` is still a warm process (not a number the system has given to another since)."""
    try:
        return __name__.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc (macOS): the pid is all there is
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """``pid`` runs. A warm process this process started and that has ended is reaped here: unreaped,
    it would still answer ``os.kill(pid, 0)``."""
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _loaded_code() -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every loaded module file of the package."""
    files = {}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve().is_relative_to(PACKAGE):
            with contextlib.suppress(OSError):
                st = os.stat(f)
                files[f] = (st.st_mtime_ns, st.st_size)
    return files


class Server:
    """The warm process: imports the served stages, then runs one job at a time."""

    def __init__(self, path: Path, retain_mb: float = RETAIN_MB):
        self.path, self.retain_mb = path, retain_mb
        self.owner = _pid(path.parent / "owner")
        for module in SERVED:
            importlib.import_module(module)
        # the helper process multiprocessing keeps for the gate's spawned workers: started now, it
        # holds this process's stdout and stderr; started during a job, it would hold the job's to
        # the end of the run (and whoever reads them would wait that long for their end)
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        self.cwd = os.getcwd()
        self.env = dict(os.environ)
        torch = sys.modules.get("torch")
        self.threads = torch.get_num_threads() if torch else None  # what a new process would use
        self.code = _loaded_code()

    def refused(self, job: dict) -> str | None:
        if job["module"] not in SERVED:
            return f"{job['module']} is not served here"
        if job["cwd"] != self.cwd:
            return f"another working directory ({job['cwd']})"
        if job.get("package") != str(PACKAGE):
            return f"another copy of the package ({job.get('package')})"
        changed = [f for f, st in self.code.items() if _stat(f) != st]
        return f"code changed since it started: {changed[0]}" if changed else None

    def serve(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(4)
        listener.settimeout(POLL_S)
        ready = self.path.parent / f".{READY}.{os.getpid()}"
        ready.write_text(str(os.getpid()))
        ready.rename(self.path.parent / READY)  # what a waiting job reads: this process listens
        while self.owner is None or _alive(self.owner):
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            self.one_job(sock)
        listener.close()

    def one_job(self, sock: socket.socket) -> None:
        _, fds, _, _ = socket.recv_fds(sock, 1, 2)
        conn = Connection(sock.detach())
        try:
            job = conn.recv()
            reason = self.refused(job) if len(fds) == 2 else "no stdout/stderr received"
            if reason:
                print(f"{DECLINED_LINE}{job.get('module', '?').rsplit('.', 1)[-1]}: {reason}", file=sys.stderr, flush=True)
                conn.send({"declined": reason})
                return
            conn.send({"accepted": os.getpid()})
            t0 = time.perf_counter()
            done = threading.Event()
            watcher = threading.Thread(target=_exit_with_the_job, args=(conn, done), daemon=True)
            watcher.start()
            rc = self.run(job, fds)
            done.set()
            print(f"{SERVED_LINE}{job['module'].rsplit('.', 1)[-1]} exit {rc} in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
            conn.send({"rc": rc})
            # the job closes its end on reading the status: the watcher leaves its recv() before this
            # descriptor is closed (and its number given to the next job's connection)
            watcher.join(WATCHER_JOIN_S)
            if watcher.is_alive() or _rss_mb() > self.retain_mb:  # the next job starts a new one
                os._exit(0)
        except (EOFError, OSError):
            return
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    def run(self, job: dict, fds: list[int]) -> int:
        """The job's ``main`` with its stdout/stderr, directory and environment; its exit status."""
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.environ.clear()
        os.environ.update(job["env"])
        self.set_threads(job["env"])
        _reset_peak_rss()
        try:
            rc = importlib.import_module(job["module"]).main(job["argv"])
            return int(rc or 0)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                return int(exc.code or 0)
            print(exc.code, file=sys.stderr)
            return 1
        except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
            traceback.print_exc()
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for h in logging.getLogger().handlers[:]:  # the stage's log file and stdout handlers
                logging.getLogger().removeHandler(h)
                h.close()
            os.environ.clear()
            os.environ.update(self.env)
            os.chdir(self.cwd)
            for fd, saved_fd in zip((1, 2), saved):
                os.dup2(saved_fd, fd)
                os.close(saved_fd)

    def set_threads(self, env: dict) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and self.threads is not None:
            want = env.get("OMP_NUM_THREADS", "")
            torch.set_num_threads(int(want) if want.isdigit() and int(want) > 0 else self.threads)


def _stat(f: str) -> tuple[int, int] | None:
    try:
        st = os.stat(f)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _exit_with_the_job(conn: Connection, done: threading.Event) -> None:
    """The job's process sends nothing more: its end (killed, Ctrl-C) ends this process at once,
    so that no output of a job Snakemake gave up appears afterwards."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    if not done.is_set():
        os._exit(1)


def _rss_mb() -> float:
    """The current resident set, MB (Linux; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _reset_peak_rss() -> None:
    """Linux: the peak RSS a stage logs (``ru_maxrss``) starts again from the current RSS."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recurrent_coreai.pipeline.warm")
    ap.add_argument("--socket", required=True, type=Path)
    ap.add_argument("--retain-mb", type=float, default=RETAIN_MB, help="end after a job that leaves more resident")
    ns = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        Server(ns.socket, ns.retain_mb).serve()
    finally:
        with contextlib.suppress(OSError):
            ns.socket.unlink()
    os._exit(0)  # no interpreter shutdown under the runtime's threads (coreai/runtime.py's exit race)


if __name__ == "__main__":
    sys.exit(main())
