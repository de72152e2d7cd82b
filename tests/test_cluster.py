"""Cluster execution: per-job resources from the model's size (recurrent_coreai/pipeline/resources.py), and
the default DAG through profiles/slurm on a real single-node SLURM (Debian's slurm-wlm 22.05
with slurmdbd, started by tests/cluster/start.sh), every job checked in `sacct`."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml

from recurrent_coreai import families
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline import resources, shards
from recurrent_coreai.pipeline.records import MANIFEST, load_json
from recurrent_coreai.families.rwkv7.geometry import Geometry
from repo_copies import SHORT_GATE

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "tests" / "cluster"
# the zoo's geometries (config.yaml: RWKV-7 World 0.1B, 0.4B, 1.5B, 2.9B)
ZOO = {"0.1B": Geometry(12, 768, 64, 3072, 65536, 64, 64, 32, 128), "0.4B": Geometry(24, 1024, 64, 4096, 65536, 64, 64, 32, 160),
       "1.5B": Geometry(24, 2048, 64, 8192, 65536, 96, 96, 64, 256), "2.9B": Geometry(32, 2560, 64, 10240, 65536, 96, 96, 64, 320)}
RWKV7 = families.get("rwkv7")
PARAMS = {name: RWKV7.parameter_count(g) for name, g in ZOO.items()}
MEASURED_1_5B_EXPORT_PEAK_MB = 3_800  # peak RSS of the 1.5B-shaped fp16 export (bench/bench_scale.py; 3.06 GB bundle)
LOCAL_RULES = {"source", "stage_and_push", "publish"}  # network / HF_TOKEN, and the aggregate target
GATE_STEPS = SHORT_GATE["steps"]  # the SLURM run's own copy (tiny_results has config.yaml's gate)


# --- resources.py --------------------------------------------------------------------------------
def test_parameter_count_is_what_the_checkpoint_stores(tiny_source):
    """4 bytes per parameter: the synthetic checkpoint's fp32 safetensors file, less its header."""
    n = resources.parameters_recorded("rwkv7", tiny_source)
    stored = (tiny_source / "model.safetensors").stat().st_size
    header = 8 + int.from_bytes((tiny_source / "model.safetensors").read_bytes()[:8], "little")
    assert n * 4 == stored - header


def test_the_zoo_sizes_match_their_published_sizes():
    """fp32 bytes of the 1.5B = the 6.1 GB source; parameter counts = the fla-hub names (191M, 1.5B, 2.9B)."""
    counts = PARAMS
    assert counts["1.5B"] * 4 / 1e9 == pytest.approx(6.1, abs=0.05)
    assert round(counts["0.1B"] / 1e6) == 191 and round(counts["2.9B"] / 1e9, 1) == 2.9


def test_export_memory_covers_the_measured_peak_without_waste():
    mem = resources.estimate("export", PARAMS["1.5B"], "float16")["mem_mb"]
    assert MEASURED_1_5B_EXPORT_PEAK_MB < mem < 1.5 * MEASURED_1_5B_EXPORT_PEAK_MB


def test_requests_grow_with_the_model_and_with_retries():
    for rule in resources.SIZED:
        asks = [resources.estimate(rule, n, "float16", steps=127) for n in PARAMS.values()]
        assert all(a["mem_mb"] < b["mem_mb"] and a["runtime"] <= b["runtime"] for a, b in zip(asks, asks[1:])), rule
    assert [resources.cpus_for(n) for n in PARAMS.values()] == [1, 1, 4, 8]
    first, retry = (resources.estimate("export", PARAMS["1.5B"], attempt=a)["mem_mb"] for a in (1, 2))
    assert retry >= 1.5 * first - 100
    assert resources.estimate("card")["mem_mb"] == resources.FLAT["card"][0]
    with pytest.raises(ValueError, match="no size for rule 'lint'"):
        resources.estimate("lint")  # a new rule gets a size before it gets a `resources:` line


def test_the_reference_job_counts_its_text_stream_by_its_form():
    """A model at or above reference.chunked.from_params runs the text stream chunked: the plan's
    calls (28 prefill + 256 main at the defaults) plus the check's 128 steps, not 2048 steps."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    text = cfgmod.text_settings(cfg["gate"], cfg["prefill"]["chunk"])
    small, big = cfg["reference"]["chunked"]["from_params"] - 1, cfg["reference"]["chunked"]["from_params"]
    assert resources.reference_text_steps(cfg, text, small) == resources.reference_text_steps(cfg, text, None) == 2048
    chunked = resources.reference_text_steps(cfg, text, big)
    assert chunked == pytest.approx(28 * shards.prefill_call_cost(64) + 256 + 128)
    steps = {n: resources.job_needs("reference", cfg, {"model": "rwkv7-1.5b-shape"}, n)["runtime"] for n in (small, big)}
    assert steps[big] < steps[small]
    no_chunked = {k: v for k, v in cfg.items() if k != "reference"}
    assert resources.reference_text_steps(no_chunked, text, big) == 2048


def test_a_job_without_its_record_yet_is_to_be_determined(tmp_path, tiny_source):
    """Snakemake shows <TBD> for a resource whose function raises FileNotFoundError for an input."""
    missing = tmp_path / "results/m/source"
    with pytest.raises(FileNotFoundError) as exc:
        resources.parameters_recorded("rwkv7", missing)
    assert exc.value.filename == str(missing)
    geom = RWKV7.geometry_from_dict(load_json(tiny_source / MANIFEST)["geometry"])
    export = tmp_path / "export"
    export.mkdir()
    (export / "export.json").write_text(json.dumps({"geometry": geom.as_dict()}))
    assert RWKV7.geometry_from_dict(load_json(export / "export.json")["geometry"]) == geom
    assert resources.parameters_recorded("rwkv7", export) == resources.parameters_recorded("rwkv7", tiny_source) \
        == RWKV7.parameter_count(geom)


def dry_run_jobs(text: str) -> list[dict]:
    """(rule, local?, wildcards, resources, log) of every job block a Snakemake (dry) run printed."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \S+:\n)", text):
        head = re.match(r"(local)?rule (\S+):\n", block)
        if not head:
            continue
        fields = dict(re.findall(r"^\s+(wildcards|resources|log): (.*)$", block, re.M))
        parse = lambda s: dict(kv.split("=", 1) for kv in s.split(", ")) if s else {}  # noqa: E731
        jobs.append({"rule": head.group(2), "local": bool(head.group(1)), "wildcards": parse(fields.get("wildcards")),
                     "resources": parse(fields.get("resources")), "log": fields.get("log")})
    return jobs


def expected(repo_results: Path, cfg: dict, job: dict) -> dict:
    """What resources.py asks for this job, from the records of the built tree."""
    w, rule = job["wildcards"], job["rule"]
    record = {"reference": "source", "export": "source", "aot": "export", "gate_shard": "export"}.get(rule)
    n = None
    if record:
        base = repo_results / w["model"]
        n = resources.parameters_recorded(cfg["models"][w["model"]]["family"],
                                          base / "source" if record == "source" else base / "export" / w["recipe"])
    threads = resources.shard_threads(cfg)(w) if rule == "gate_shard" else 1
    return resources.job_needs(rule, cfg, w, n, threads=threads)


def test_the_rules_ask_for_what_resources_py_computes(tiny_results, tmp_path):
    """A dry run over a built tree: every job's mem_mb/runtime/cpus_per_task is resources.py's."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    repo = tmp_path / "repo"
    for rel in files:
        if (ROOT / rel).is_file() and not rel.startswith("tests/"):
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, repo / rel)
    cfg = yaml.safe_load((repo / "config.yaml").read_text())
    cfg["results"] = str(tiny_results)  # built with this config.yaml's gate
    (repo / "config.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(repo))
    proc = subprocess.run("snakemake -n --forceall --cores 1 publish", cwd=repo, env=env, shell=True,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [j for j in dry_run_jobs(proc.stdout + proc.stderr) if j["rule"] not in LOCAL_RULES]
    assert {"toolchain", "vocab", "reference", "export", "aot", "gate_shard", "gate", "card"} <= {j["rule"] for j in jobs}
    for job in jobs:
        asked = {k: int(job["resources"][k]) for k in resources.NAMES}
        assert asked == expected(tiny_results, cfg, job), job


# --- a real SLURM --------------------------------------------------------------------------------
def _sacct(run_id: str, since: datetime) -> list[dict]:
    """The jobs named ``run_id`` (the plugin's job name) in ``since`` .. now. The window is explicit:
    without -S, sacct starts it at 00:00 of the current day, so for a run that crossed midnight it
    silently left out every job that had ended before (exit 0, fewer rows; seen with faketime on
    SLURM 22.05). The run ID is a fresh UUID, so the name alone picks this run's jobs."""
    out = subprocess.run(["sacct", "-X", "-P", "-n", "--name", run_id, "-S", f"{since:%Y-%m-%dT%H:%M:%S}", "-E", "now",
                          "-o", "JobID,State,ExitCode,ReqMem,Timelimit,ReqCPUS,Elapsed,Comment%300"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    keys = ("id", "state", "exit", "mem", "limit", "cpus", "elapsed", "comment")
    return [dict(zip(keys, line.split("|", len(keys) - 1))) for line in out.splitlines() if line]


def _minutes(limit: str) -> int:
    days, _, hms = limit.rpartition("-")
    h, m, s = map(int, hms.split(":"))
    return int(days or 0) * 1440 + h * 60 + m + math.ceil(s / 60)


FAKE_SACCT = """
import sys
from datetime import datetime
NOW = datetime(2026, 12, 2, 0, 5)  # a run that started at 23:55 and crossed midnight
JOBS = [("1", "rule_toolchain", datetime(2026, 12, 1, 23, 58)),
        ("2", "rule_card_wildcards_m", datetime(2026, 12, 2, 0, 2))]
args = sys.argv[1:]
name = args[args.index("--name") + 1]
# SLURM's default window: from 00:00 of the current day (22.05, when neither -s nor -j is given)
since = datetime.fromisoformat(args[args.index("-S") + 1]) if "-S" in args else NOW.replace(hour=0, minute=0)
for job_id, comment, end in JOBS:
    if name == "run" and end >= since:
        print(f"{job_id}|COMPLETED|0:0|500M|00:05:00|1|00:00:17|{comment}")
"""


def test_the_sacct_query_keeps_the_jobs_of_a_run_that_crossed_midnight(tmp_path, monkeypatch):
    """A fake sacct with SLURM's default window (00:00 of the current day): the test's query names
    its own window, so a job that ended before midnight is still counted."""
    (tmp_path / "sacct").write_text(f"#!{sys.executable}\n{FAKE_SACCT}")
    (tmp_path / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    default = subprocess.run(["sacct", "-X", "-P", "-n", "--name", "run"], capture_output=True, text=True, check=True)
    assert len(default.stdout.splitlines()) == 1  # the fake drops what a real sacct drops
    rows = _sacct("run", datetime(2026, 12, 1, 23, 50))
    assert [(r["id"], r["state"], r["comment"]) for r in rows] == \
        [("1", "COMPLETED", "rule_toolchain"), ("2", "COMPLETED", "rule_card_wildcards_m")]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(["timeout", "-k", "5", "120", "bash", str(CLUSTER / "start.sh"), str(state)],
                           capture_output=True, text=True)
    try:
        assert start.returncode == 0, f"tests/cluster/start.sh failed:\n{start.stdout}\n{start.stderr}"
        print(start.stdout.strip())
        yield state
    finally:
        subprocess.run(["timeout", "-k", "5", "120", "bash", str(CLUSTER / "stop.sh"), str(state)])


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RECURRENT_COREAI_TEST_CLUSTER") != "1",
                    reason="starts a SLURM here and runs the DAG on it: `make test-cluster` runs it "
                           "(RECURRENT_COREAI_TEST_CLUSTER=1), `make test` does not, SLURM installed or not")
@pytest.mark.skipif(shutil.which("slurmctld") is None,
                    reason="slurmctld not installed: `make test-cluster` installs SLURM (Debian slurm-wlm, slurmdbd, "
                           "munge, mariadb-server) and runs this test")
@pytest.mark.skipif(os.geteuid() != 0, reason="starting slurmd/slurmctld here needs root")
def test_the_default_dag_runs_as_slurm_jobs_and_every_job_completes(slurm, tmp_path_factory):
    from repo_copies import fresh_copy, run

    # with the short gate; the default model's DAG only (tests/conftest.py smk_repo builds all three families)
    repo = fresh_copy(tmp_path_factory.mktemp("cluster"), edit=lambda cfg: cfg.update(build=["rwkv7-tiny"]))
    cfg = yaml.safe_load((repo / "config.yaml").read_text())

    since = datetime.now().replace(microsecond=0) - timedelta(minutes=5)  # sacct's window opens before the run
    start = time.monotonic()
    proc = run("timeout -k 10 1500 snakemake --profile profiles/slurm --slurm-init-seconds-before-status-checks 2 "
               "publish", repo, timeout=1600)
    wall = time.monotonic() - start
    log = proc.stdout + proc.stderr
    run_id = re.search(r"SLURM run ID: (\S+)", log).group(1)
    # every job of the DAG (a dry run prints them all, with their resources); the run printed its local ones
    dry = run("snakemake -n --forceall --profile profiles/slurm publish", repo)
    every = dry_run_jobs(dry.stdout + dry.stderr)
    local = {(j["rule"], tuple(j["wildcards"].items())) for j in dry_run_jobs(log) if j["local"]}
    assert {rule for rule, _ in local} == LOCAL_RULES, "localrules"
    remote = {f"rule_{j['rule']}" + (f"_wildcards_{'_'.join(j['wildcards'].values())}" if j["wildcards"] else ""): j
              for j in every if (j["rule"], tuple(j["wildcards"].items())) not in local}
    assert len(local) + len(remote) == len(every) and not LOCAL_RULES & {j["rule"] for j in remote.values()}

    rows = _sacct(run_id, since)
    print(f"\n{len(rows)} SLURM jobs, wall {wall:.0f} s (snakemake --profile profiles/slurm publish):")
    for r in rows:
        print(f"  {r['id']:>4} {r['state']:<10} {r['elapsed']} mem {r['mem']:>6} limit {r['limit']} cpus {r['cpus']}"
              f"  {r['comment']}")
    got = sorted(r["comment"] for r in rows)
    assert got == sorted(remote), ("one SLURM job per non-local job of the DAG: not in sacct "
                                   f"{sorted(set(remote) - set(got))}, not in the DAG {sorted(set(got) - set(remote))}, "
                                   f"more than once {sorted({c for c in got if got.count(c) > 1})}")
    assert {(r["state"], r["exit"]) for r in rows} == {("COMPLETED", "0:0")}

    results = repo / "results"
    for r in rows:  # sbatch got what resources.py computes from the job's records (and the dry run shows)
        job, want = remote[r["comment"]], expected(results, cfg, remote[r["comment"]])
        assert (int(r["mem"].rstrip("M")), _minutes(r["limit"]), int(r["cpus"])) == \
            (want["mem_mb"], want["runtime"], want["cpus_per_task"]), r
        assert {k: int(job["resources"][k]) for k in resources.NAMES} == want, job
    # what each stage measured itself (ru_maxrss, in its log) stayed under what its job asked for;
    # a job's log is the one the dry run names for it (gate_shard logs as gate-<recipe>-shard-<k>)
    asked = {Path(job["log"]).stem: int(r["mem"].rstrip("M"))
             for r in rows for job in [remote[r["comment"]]] if job["log"]}
    peaks = {}
    for logfile in (results / "logs/rwkv7-tiny").glob("*.log"):
        m = re.search(r"peak RSS (\d+) MB", logfile.read_text())
        if m:
            peaks[logfile.stem] = int(m.group(1))
    recipes = cfg["models"]["rwkv7-tiny"]["recipes"]
    shard_logs = {Path(j["log"]).stem for j in remote.values() if j["rule"] == "gate_shard"}
    stage_logs = {f"{stage}-{r}" for stage in ("export", "aot-universal", "gate") for r in recipes}
    assert shard_logs and stage_logs | shard_logs <= set(peaks), sorted(peaks)
    assert set(peaks) <= set(asked), f"a log with a peak RSS but no SLURM job of the run: {peaks}, {asked}"
    assert all(peaks[name] < asked[name] for name in peaks), (peaks, asked)

    for recipe in recipes:
        gate = json.loads((results / f"rwkv7-tiny/gate/{recipe}.json").read_text())
        assert gate["pass"] is True and gate["steps"] == GATE_STEPS
    assert (results / "rwkv7-tiny/publish/publish.json").is_file()
    assert "Nothing to be done" in run("snakemake -n --cores 1 publish", repo).stdout
    built = [name for name in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
             if name == "toolchain" or "-rwkv7-tiny" in name]  # dvc.yaml lists every enabled model's stages
    assert "Data and pipelines are up to date" in run(f"dvc status {' '.join(built)}", repo).stdout
