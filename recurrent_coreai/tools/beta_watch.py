"""``python -m recurrent_coreai beta-watch``: rebuild on a new Core AI beta and compare.

1. Ask the package index (pip's own client: ``pip index versions --pre``) for versions of the
   watched packages (coreai-core, coreai-torch, coreai-opt) newer than their pins in
   requirements.txt, pre-releases included, and list what would rebuild: the toolchain stage and
   every job after it, as ``snakemake -n --forcerun toolchain publish`` plans it.
2. ``--apply``: in a throwaway ``git worktree`` of HEAD, bump the pins in requirements.txt and
   envs/*.yaml together, prepare a venv that holds ONLY the new wheels (installed ``--no-deps``)
   and sees everything else -- torch included -- through a ``.pth`` into the current venv, copy
   the current results in, run ``snakemake --cores 1 --keep-going publish`` there, check that
   exactly the planned jobs ran, and write ``reports/beta-<versions>.md`` + ``.json``: per model
   and recipe the gate numbers old vs new, bundle size, export time and peak RSS, bundle digest.
   A regression beyond ``beta_watch.limits`` (any gate failure, an agreement drop, max|dlogits|
   growing by more than a factor) is one error line and exit 1. Nothing is ever published from
   the worktree: the run gets no Hub token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import export_stats

REQUIREMENTS = "requirements.txt"
ENVS_GLOB = "envs/*.yaml"
REPORTS = "reports"
TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN")
# config.yaml `beta_watch:` (the lead's schema validates it); these are the values without one.
DEFAULTS = {
    "packages": ["coreai-core", "coreai-torch", "coreai-opt"],
    "index_url": None,  # None: pip's configured index (PyPI unless pip.conf says otherwise)
    "limits": {
        "max_agree_drop": 0.0,  # top-1 agreement outside near-ties may drop by at most this fraction
        "max_dlogits_factor": 2.0,  # new max|dlogits| <= factor x max(old, dlogits_floor)
        "dlogits_floor": 1.0e-4,  # below this an fp32 bundle's max|dlogits| is rounding noise
    },
}


# --- settings and pins -------------------------------------------------------------------------
def settings(cfg: dict, overrides: list[str] = ()) -> dict:
    """``beta_watch:`` from the config over DEFAULTS, then ``--limits KEY=VALUE`` overrides."""
    own = cfg.get("beta_watch") or {}
    out = {**DEFAULTS, **{k: v for k, v in own.items() if k != "limits"}}
    out["limits"] = {**DEFAULTS["limits"], **(own.get("limits") or {})}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS["limits"]:
            raise PipelineError("--limits", f"{item!r} is not KEY=VALUE with KEY one of {sorted(DEFAULTS['limits'])}",
                                "write e.g. --limits max_dlogits_factor=1.5")
        try:
            out["limits"][key] = float(value)
        except ValueError:
            raise PipelineError("--limits", f"{key}={value!r} is not a number", "give a number") from None
    return out


def read_pins(requirements: Path, packages: list[str]) -> dict[str, Version]:
    """``name==version`` pins of ``packages`` in a requirements file."""
    pins = {}
    for n, line in enumerate(requirements.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text or text.startswith("-"):
            continue
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise PipelineError(f"{requirements}:{n}", f"cannot parse {text!r} ({exc})", "fix the line") from None
        spec = list(req.specifier)
        if len(spec) == 1 and spec[0].operator == "==":
            pins[canonicalize_name(req.name)] = Version(spec[0].version)
    missing = [p for p in packages if canonicalize_name(p) not in pins]
    if missing:
        raise PipelineError(requirements, f"no exact pin (name==version) for {', '.join(missing)}",
                            "pin every watched package exactly; beta-watch compares against the pins")
    return {p: pins[canonicalize_name(p)] for p in packages}


# --- the package index, through pip -------------------------------------------------------------
def pip_index_args(index_url: str | None) -> list[str]:
    """An explicit index is the ONLY source (``--isolated`` drops pip's env/user extra indexes)."""
    return ["--isolated", "--index-url", index_url] if index_url else []


def index_versions(package: str, index_url: str | None) -> list[Version]:
    """Every version of ``package`` the index offers, pre-releases included; [] when the index does
    not have the project. An index that cannot be reached is an error, not "nothing new"."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package, "--pre", "-vv",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "30", *pip_index_args(index_url)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    where = index_url or "pip's configured index"
    unreachable = [line for line in out.splitlines() if line.startswith("Could not fetch URL")
                   and re.search(r"connection error|SSLError|ProxyError|timed out", line)]
    if unreachable:
        raise PipelineError(where, f"the package index could not be reached ({unreachable[0][:200]})",
                            "check --index-url / beta_watch.index_url and the network, then run again")
    listed = re.search(r"^Available versions: (.*)$", out, re.M)
    if proc.returncode == 0 and listed:
        try:
            return sorted(Version(v.strip()) for v in listed.group(1).split(","))
        except InvalidVersion as exc:
            raise PipelineError(where, f"unexpected version list for {package}: {exc}", "report this") from None
    if "No matching distribution found" in out:
        return []
    last = (out.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    raise PipelineError(where, f"pip index versions {package} failed: {last[:200]}",
                        "run the same pip command by hand to see why")


def find_updates(pins: dict[str, Version], index_url: str | None) -> dict[str, tuple[Version, Version]]:
    """{package: (pinned, newest newer version)} for the packages the index has something newer of."""
    updates = {}
    for package, pinned in pins.items():
        newer = [v for v in index_versions(package, index_url) if v > pinned]
        if newer:
            updates[package] = (pinned, max(newer))
    return updates


def versions_tag(updates: dict[str, tuple[Version, Version]]) -> str:
    return "_".join(f"{p}-{new}" for p, (_, new) in sorted(updates.items()))


# --- pins in requirements.txt and envs/*.yaml ----------------------------------------------------
def bump_pins(tree: Path, updates: dict[str, tuple[Version, Version]]) -> list[Path]:
    """Rewrite ``name==old`` to ``name==new`` in requirements.txt and every envs/*.yaml, line by
    line (comments and layout kept). Every file must hold every pin: they move together."""
    files = [tree / REQUIREMENTS, *sorted(tree.glob(ENVS_GLOB))]
    for path in files:
        lines = path.read_text().splitlines(keepends=True)
        for package, (old, new) in updates.items():
            pat = re.compile(rf"^(\s*(?:-\s+)?){re.escape(package)}=={re.escape(str(old))}(?=\s|$|#)", re.I)
            hits = [i for i, line in enumerate(lines) if pat.match(line)]
            if len(hits) != 1:
                raise PipelineError(path, f"{'no' if not hits else len(hits)} line(s) pin {package}=={old}",
                                    f"pin {package}=={old} once in requirements.txt and every envs/*.yaml "
                                    "(tests/test_envs.py keeps them equal)")
            lines[hits[0]] = pat.sub(lambda m: f"{m.group(1)}{package}=={new}", lines[hits[0]])
        path.write_text("".join(lines))
    return files


# --- Snakemake job lists -------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Job:
    """One Snakemake job: its rule and wildcards (in Snakemake's order)."""

    rule: str
    wildcards: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict:
        return {"rule": self.rule, "wildcards": dict(self.wildcards)}

    @classmethod
    def from_json(cls, data: dict) -> Job:
        return cls(data["rule"], tuple(data["wildcards"].items()))

    def get(self, key: str) -> str | None:
        return dict(self.wildcards).get(key)

    def __str__(self) -> str:
        return self.rule + (f"[{', '.join(f'{k}={v}' for k, v in self.wildcards)}]" if self.wildcards else "")


def parse_jobs(text: str) -> tuple[dict[int, Job], set[int]]:
    """Snakemake's log -> ({jobid: job} of every job it announced, {jobids it finished})."""
    announced, head, fields = {}, None, {}

    def close():
        if head is not None and "jobid" in fields:
            wc = tuple(tuple(kv.split("=", 1)) for kv in fields.get("wildcards", "").split(", ") if "=" in kv)
            announced[int(fields["jobid"])] = Job(head, wc)

    for line in text.splitlines():
        m = re.match(r"^(?:local)?rule (\S+):$", line)
        if m or not line.startswith(" "):
            close()
            head, fields = (m.group(1) if m else None), {}
        elif head is not None and ":" in line:
            key, _, value = line.strip().partition(":")
            fields[key] = value.strip()
    close()
    finished = {int(n) for n in re.findall(r"^Finished jobid: (\d+)", text, re.M)}
    return announced, finished


def snakemake(tree: Path, args: list[str], env: dict, python: str = sys.executable,
              log: Path | None = None) -> tuple[int, str]:
    """Run Snakemake in ``tree``: (exit status, its output). With ``log`` the output streams there."""
    cmd = [python, "-m", "snakemake", "--cores", "1", *args]
    if log is None:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        return proc.returncode, proc.stdout + proc.stderr
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write(f"$ cd {tree} && {' '.join(cmd[1:])}\n")
        fh.flush()
        rc = subprocess.run(cmd, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    return rc, log.read_text(errors="replace")


def plan(tree: Path, env: dict, *extra: str, python: str = sys.executable) -> list[Job]:
    """The jobs ``snakemake -n publish`` would run in ``tree`` (``extra``: e.g. --forcerun toolchain),
    in the order Snakemake lists them."""
    rc, out = snakemake(tree, ["-n", "--nolock", *extra, "publish"], env, python)
    if rc:
        last = out.strip().splitlines()[-1:] or [f"exit {rc}"]
        raise PipelineError(tree / "Snakefile", f"snakemake -n failed: {last[0][:300]}", "fix the pipeline first")
    return list(parse_jobs(out)[0].values())


def describe(jobs: list[Job]) -> list[str]:
    """Jobs grouped per model, in the order Snakemake listed them (a DAG order): ``toolchain``,
    ``rwkv7-tiny: export fp16, fp32; aot universal/fp16; card``, ``publish``."""
    groups: dict[str, dict[str, list[str]]] = {}
    for job in jobs:
        model = job.get("model")
        rest = "/".join(v for k, v in job.wildcards if k != "model")
        groups.setdefault(model or job.rule, {}).setdefault(job.rule, []).append(rest)
    return [key if key in rules and len(rules) == 1 and rules[key] == [""] else
            f"{key}: " + "; ".join(f"{r} {', '.join(sorted(v))}".strip() for r, v in rules.items())
            for key, rules in groups.items()]


# --- the throwaway tree and environment ----------------------------------------------------------
def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if proc.returncode:
        raise PipelineError(repo, f"git {' '.join(args[:2])} failed: {proc.stderr.strip()[:300]}",
                            "run beta-watch from the root of a git clone of rwkv7-coreai")
    return proc.stdout


def check_clean(repo: Path) -> None:
    """The rebuild runs on HEAD: uncommitted edits of tracked files (dvc.lock aside: a baseline run
    records into it, and it is copied over) would silently be left out."""
    dirty = [line[3:] for line in git(repo, "status", "--porcelain", "--untracked-files=no").splitlines()
             if line[3:] != "dvc.lock"]
    if dirty:
        raise PipelineError(repo, f"uncommitted changes to tracked files ({', '.join(dirty[:4])}"
                            f"{' …' if len(dirty) > 4 else ''}); the rebuild runs on HEAD without them",
                            "commit (or stash) them and build the baseline again, then rerun beta-watch")


@contextlib.contextmanager
def worktree(repo: Path, dest: Path, keep: bool = False):
    git(repo, "worktree", "add", "--detach", str(dest), "HEAD")
    try:
        yield dest
    finally:
        if not keep:
            subprocess.run(["git", "worktree", "remove", "--force", str(dest)], cwd=repo, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True)


def seed(repo: Path, tree: Path, results: str) -> None:
    """The baseline the rebuild starts from: results (file times kept, so only what the new
    toolchain invalidates reruns), Snakemake's provenance records, dvc.lock, and DVC's cache."""
    shutil.copytree(repo / results, tree / results, symlinks=True)
    if (repo / ".snakemake" / "metadata").is_dir():
        shutil.copytree(repo / ".snakemake" / "metadata", tree / ".snakemake" / "metadata")
    if (repo / "dvc.lock").is_file():
        shutil.copy2(repo / "dvc.lock", tree / "dvc.lock")
    if (repo / ".dvc").is_dir():  # one cache for both trees (DVC's own setting, local to the worktree)
        cache = subprocess.run([sys.executable, "-m", "dvc", "cache", "dir"], cwd=repo, capture_output=True, text=True)
        path = cache.stdout.strip() if cache.returncode == 0 and cache.stdout.strip() else str(repo / ".dvc" / "cache")
        subprocess.run([sys.executable, "-m", "dvc", "cache", "dir", "--local", path], cwd=tree, capture_output=True)


VERIFY = """
import importlib, importlib.metadata as md, json, sys
from packaging.requirements import Requirement

def unmet(dist):
    for req in map(Requirement, dist.requires or []):
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            yield f"{req} (have {have or 'none'})"

out = {}
for name in sys.argv[1:]:
    dist = md.distribution(name)
    tops = sorted({f.parts[0] for f in dist.files or [] if f.suffix == ".py" and len(f.parts) > 1
                   and not f.parts[0].endswith((".dist-info", ".data")) and f.parts[0] != ".."})
    out[name] = {"version": md.version(name), "dist": str(dist.locate_file("")), "unmet": list(unmet(dist)),
                 "modules": {t: importlib.import_module(t).__file__ for t in tops}}
print(json.dumps(out))
"""


def prepare_env(venv: Path, tree: Path, updates: dict[str, tuple[Version, Version]], index_url: str | None) -> dict:
    """A venv with only the new wheels in it; the tree's code and the current venv (torch and
    everything else) come in through a .pth. Returns the environment to run Snakemake with."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    base = sysconfig.get_path("purelib")  # the current venv's site-packages
    # path lines first (the tree's recurrent_coreai before the editable install's), then the current
    # venv with its own .pth files processed (addsitedir), after the new wheels.
    (site / "zz_beta_watch_base.pth").write_text(f"{tree}\nimport site; site.addsitedir({base!r})\n")
    wanted = [f"{p}=={new}" for p, (_, new) in sorted(updates.items())]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:", "--pre",
                           "--disable-pip-version-check", "--no-warn-script-location", "--target", str(site),
                           *pip_index_args(index_url), *wanted], capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
        full = "No space left on device" in last[0]
        raise PipelineError(site if full else index_url or "pip's configured index",
                            f"cannot install {' '.join(wanted)}: {last[0][:300]}",
                            "free disk space there and run again" if full
                            else "check that the index serves wheels for this platform")
    env = {k: v for k, v in os.environ.items() if k not in TOKEN_VARS}  # never publish from the worktree
    env.update(VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(venv / "bin"), str(Path(sys.executable).parent),
                                                            env.get("PATH", "")]), DVC_NO_ANALYTICS="1")
    verify_env(python, env, site, updates)
    return env


def verify_env(python: Path, env: dict, site: Path, updates: dict[str, tuple[Version, Version]]) -> None:
    """In the new venv, metadata and imports of every bumped package resolve to the new wheels,
    their requirements hold, and torch is still the current venv's (not reinstalled)."""
    names = [*sorted(updates), "torch"]
    proc = subprocess.run([python, "-c", VERIFY, *names], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise PipelineError(python, f"the new packages do not import: {proc.stderr.strip().splitlines()[-1][:300]}",
                            "the beta may need newer dependencies than the current venv has")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for package, (_, new) in updates.items():
        info, problems = got[package], []
        if Version(info["version"]) != new:
            problems.append(f"importlib.metadata says {info['version']}")
        problems += [f"{mod} imports from {path}" for mod, path in info["modules"].items()
                     if not str(path).startswith(str(site))]
        problems += [f"requires {r}" for r in info["unmet"]]
        if problems:
            raise PipelineError(python, f"{package} {new} is not what the new environment runs: "
                                + "; ".join(problems[:3]), "bump the packages it requires together "
                                "(they must all be on the index) or rebuild .venv")
    if str(got["torch"]["dist"]).startswith(str(site)):
        raise PipelineError(python, "torch was installed into the beta venv", "install the new wheels with --no-deps")


# --- numbers --------------------------------------------------------------------------------------
GATE_KEYS = ("pass", "agree_counted", "counted", "agree_rate", "near_ties", "max_abs_dlogits", "mean_kl",
             "size_bytes", "bundle_sha256", "steps", "reasons")


def numbers(results: Path, model: str, recipe: str) -> dict:
    """One recipe's gate verdict (passed or ``.failed.json``), bundle and export cost in a results tree."""
    lay = Layout(results, model)
    gate = lay.gate_json(recipe)
    if not gate.is_file() and gate.with_suffix(".failed.json").is_file():
        gate = gate.with_suffix(".failed.json")
    out = {k: None for k in GATE_KEYS} | {"gate_file": None, "export_seconds": None, "export_peak_rss_mb": None}
    if gate.is_file():
        out.update({k: json.loads(gate.read_text()).get(k) for k in GATE_KEYS}, gate_file=str(gate.relative_to(results)))
    export_json = lay.export(recipe) / "export.json"
    if out["size_bytes"] is None and export_json.is_file():
        out["size_bytes"] = json.loads(export_json.read_text())["size_bytes"]
    stats = export_stats(lay.log(f"export-{recipe}"), model, recipe)
    if stats:
        out["export_seconds"], out["export_peak_rss_mb"] = stats["seconds"], stats["rss_mb"]
    return out


def regressions(old: dict, new: dict, limits: dict) -> list[str]:
    """Why ``new`` is worse than ``old`` beyond the limits (empty: no regression)."""
    if new["pass"] is not True:
        why = "; ".join(new["reasons"] or []) or "no gate verdict (the rebuild did not reach the gate)"
        return [f"gate failed: {why}"]
    found = []
    if old["agree_rate"] is not None and new["agree_rate"] < old["agree_rate"] - limits["max_agree_drop"]:
        found.append(f"top-1 agreement dropped {old['agree_counted']}/{old['counted']} -> "
                     f"{new['agree_counted']}/{new['counted']} (limit: a drop of {limits['max_agree_drop']:g})")
    if old["max_abs_dlogits"] is not None:
        allowed = limits["max_dlogits_factor"] * max(old["max_abs_dlogits"], limits["dlogits_floor"])
        if new["max_abs_dlogits"] > allowed:
            found.append(f"max|dlogits| grew {old['max_abs_dlogits']:.3g} -> {new['max_abs_dlogits']:.3g} "
                         f"(x{new['max_abs_dlogits'] / max(old['max_abs_dlogits'], 1e-30):.1f}; limit "
                         f"x{limits['max_dlogits_factor']:g} of max(old, {limits['dlogits_floor']:g}) = {allowed:.3g})")
    return found


# --- the report -----------------------------------------------------------------------------------
def _fmt(value, spec: str = ".3g", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def digests(old: str | None, new: str | None) -> str:
    short = [f"`{d[:12]}`" if d else "–" for d in (old, new)]
    return f"{short[1]} (unchanged)" if old and old == new else " → ".join(short)


def render_markdown(report: dict) -> str:
    ups = ", ".join(f"{p} {u['old']} → {u['new']}" for p, u in report["updates"].items())
    lines = [f"# Core AI beta rebuild: {ups}", "",
             f"**{report['verdict']}** — limits: " + ", ".join(f"{k} {v:g}" for k, v in report["limits"].items()),
             "", f"Index: {report['index_url'] or 'pip default'}; rebuilt in {report['rebuild_seconds']:.0f} s "
             f"({len(report['jobs']['executed'])} jobs).", "",
             "| model | recipe | gate | top-1 agreed/counted | max abs Δlogits | mean KL | bundle MB | export s | "
             "export peak RSS MB | bundle sha256 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["recipes"]:
        o, n = row["old"], row["new"]

        def pair(key, spec=".3g"):
            return f"{_fmt(o[key], spec)} → {_fmt(n[key], spec)}"

        gate = f"{'PASS' if o['pass'] else 'FAIL'} → {'PASS' if n['pass'] else 'FAIL'}"
        agree = f"{o['agree_counted']}/{o['counted']} → {n['agree_counted']}/{n['counted']}"
        mb = f"{_fmt(o['size_bytes'] and o['size_bytes'] / 1e6, '.1f')} → {_fmt(n['size_bytes'] and n['size_bytes'] / 1e6, '.1f')}"
        lines.append(f"| {row['model']} | {row['recipe']} | {gate} | {agree} | {pair('max_abs_dlogits')} | "
                     f"{pair('mean_kl', '.2g')} | {mb} | {pair('export_seconds', '.1f')} | "
                     f"{pair('export_peak_rss_mb', '.0f')} | {digests(o['bundle_sha256'], n['bundle_sha256'])} |")
    lines += ["", "## Regressions", ""]
    lines += [f"- {r}" for r in report["regressions"]] or ["None beyond the limits."]
    lines += ["", "## Jobs", "", "Planned (`snakemake -n --forcerun toolchain publish` on the baseline) and run "
              "in the worktree:", ""] + [f"- {line}" for line in report["jobs"]["summary"]]
    if report["jobs"]["failed"]:
        lines += ["", "Failed: " + ", ".join(report["jobs"]["failed"])]
    lines += ["", "## Toolchain", "", "| package | old | new |", "|---|---|---|"]
    old_tc, new_tc = report["toolchain"]["old"], report["toolchain"]["new"]
    lines += [f"| {k} | {old_tc.get(k, '–')} | {new_tc.get(k, '–')} |" for k in sorted(set(old_tc) | set(new_tc))]
    return "\n".join(lines) + "\n"


def write_report(reports: Path, report: dict) -> Path:
    from recurrent_coreai.util.fsutil import write_json_atomic, write_text_atomic

    base = reports / f"beta-{report['tag']}"
    write_json_atomic(f"{base}.json", report)
    write_text_atomic(f"{base}.md", render_markdown(report))
    return Path(f"{base}.md")


def _toolchain(results: Path) -> dict:
    path = Layout(results, "").toolchain
    return json.loads(path.read_text())["versions"] if path.is_file() else {}


# --- the two modes ----------------------------------------------------------------------------------
def show_plan(repo: Path, updates: dict, index_url: str | None) -> list[Job]:
    where = index_url or "pip's configured index"
    if not updates:
        print(f"beta-watch: nothing newer than the pins on {where}")
        return []
    print(f"beta-watch: newer than the pins on {where}:")
    for package, (old, new) in sorted(updates.items()):
        print(f"  {package} {old} -> {new}{' (pre-release)' if new.is_prerelease else ''}")
    jobs = plan(repo, dict(os.environ), "--forcerun", "toolchain")
    print(f"would rebuild ({len(jobs)} jobs, from snakemake -n --forcerun toolchain publish):")
    for line in describe(jobs):
        print(f"  {line}")
    return jobs


@dataclass
class Rebuild:
    """What a rebuild in the worktree did."""
    tree: Path
    planned: list[Job]
    executed: list[Job]
    failed: list[Job]
    exit: int
    seconds: float


def rebuild(repo: Path, tree: Path, venv: Path, results: str, bw: dict, updates: dict, expected: list[Job],
            log: Path) -> Rebuild:
    """Seed the worktree, bump the pins, prepare the venv, run Snakemake; check the job list."""
    seed(repo, tree, results)
    bump_pins(tree, updates)
    env = prepare_env(venv, tree, updates, bw["index_url"])
    python = str(venv / "bin" / "python")
    planned = plan(tree, env, python=python)
    if sorted(planned) != sorted(expected):
        differ = sorted(set(planned) ^ set(expected))
        raise PipelineError(tree, f"the bumped tree plans {len(planned)} jobs, a toolchain change {len(expected)} "
                            f"(differ: {', '.join(map(str, differ[:4]))})", "check that results/ was built from "
                            "HEAD (rebuild the baseline) and that only the pins differ")
    print(f"beta-watch: rebuilding {len(planned)} jobs in {tree} (log: {log})", flush=True)
    t0 = time.perf_counter()
    rc, out = snakemake(tree, ["--keep-going", "publish"], env, python, log=log)
    seconds = time.perf_counter() - t0
    announced, finished = parse_jobs(out)
    executed = [job for i, job in announced.items() if i in finished]  # in the order they started
    failed = [job for i, job in announced.items() if i not in finished]
    if rc == 0 and sorted(executed) != sorted(planned):
        differ = sorted(set(executed) ^ set(planned))
        raise PipelineError(log, f"the rebuild ran other jobs than planned ({', '.join(map(str, differ[:4]))})",
                            "inspect the snakemake log")
    return Rebuild(tree, planned, executed, failed, rc, seconds)


def assess(repo: Path, results: str, bw: dict, updates: dict, run: Rebuild) -> dict:
    """Old vs new numbers of every gated recipe, the verdict, and the report files."""
    rows = []
    for model, recipe in sorted({(j.get("model"), j.get("recipe")) for j in run.planned if j.rule == "gate"}):
        old, new = numbers(repo / results, model, recipe), numbers(run.tree / results, model, recipe)
        rows.append({"model": model, "recipe": recipe, "old": old, "new": new,
                     "regressions": regressions(old, new, bw["limits"])})
    found = [f"{r['model']}/{r['recipe']}: {why}" for r in rows for why in r["regressions"]]
    if run.exit and not found:
        found.append(f"the rebuild failed (snakemake exit {run.exit}) at {', '.join(map(str, run.failed)) or 'start'}")
    report = {
        "tag": versions_tag(updates), "index_url": bw["index_url"], "limits": bw["limits"],
        "updates": {p: {"old": str(o), "new": str(n)} for p, (o, n) in sorted(updates.items())},
        "toolchain": {"old": _toolchain(repo / results), "new": _toolchain(run.tree / results)},
        "jobs": {"planned": [j.to_json() for j in run.planned], "executed": [j.to_json() for j in run.executed],
                 "failed": [str(j) for j in run.failed], "summary": describe(run.executed)},
        "snakemake_exit": run.exit, "rebuild_seconds": round(run.seconds, 1), "recipes": rows,
        "regressions": found, "verdict": "REGRESSION" if found else "no regression",
    }
    report["report"] = str(write_report(repo / REPORTS, report))
    return report


def apply(repo: Path, cfg: dict, bw: dict, updates: dict, expected: list[Job], keep: Path | None) -> dict:
    """Rebuild with the new versions in a throwaway worktree (kept at ``keep``) and assess it."""
    results = cfg["results"]
    check_clean(repo)
    baseline = plan(repo, dict(os.environ))
    if baseline:
        raise PipelineError(repo / results, f"the baseline is not up to date (snakemake -n plans {len(baseline)} "
                            f"job(s): {', '.join(map(str, baseline[:3]))}{' …' if len(baseline) > 3 else ''})",
                            "run snakemake --cores 1 publish first: the old toolchain's numbers are the baseline")
    log = repo / REPORTS / f"beta-{versions_tag(updates)}.snakemake.log"
    with tempfile.TemporaryDirectory(prefix="beta-watch-") as tmp:
        with worktree(repo, keep or Path(tmp) / "tree", keep=keep is not None) as tree:
            run = rebuild(repo, tree, Path(tmp) / "venv", results, bw, updates, expected, log)
            return assess(repo, results, bw, updates, run)


@main_guard
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recurrent_coreai beta-watch", description="Find coreai-* versions newer "
                                 "than the pins; --apply rebuilds in a throwaway git worktree and compares.")
    ap.add_argument("--index-url", help="PEP 503/691 simple index to ask (default: beta_watch.index_url, else pip's)")
    ap.add_argument("--apply", action="store_true", help="rebuild in a throwaway worktree and compare")
    ap.add_argument("--limits", nargs="+", default=[], metavar="KEY=VALUE",
                    help=f"override beta_watch.limits ({', '.join(DEFAULTS['limits'])})")
    ap.add_argument("--worktree", type=Path, help="with --apply: build in this new directory and keep it")
    ap.add_argument("--config-file", default=cfgmod.DEFAULT_FILE)
    ns = ap.parse_args(argv)
    repo = Path(git(Path.cwd(), "rev-parse", "--show-toplevel").strip())
    cfg = cfgmod.load(repo / ns.config_file)
    bw = settings(cfg, ns.limits)
    bw["index_url"] = ns.index_url or bw["index_url"]
    if ns.worktree and ns.worktree.exists():
        raise PipelineError(ns.worktree, "already exists", "name a new directory for --worktree")
    updates = find_updates(read_pins(repo / REQUIREMENTS, bw["packages"]), bw["index_url"])
    expected = show_plan(repo, updates, bw["index_url"])
    if not updates or not ns.apply:
        return 0
    report = apply(repo, cfg, bw, updates, expected, ns.worktree and ns.worktree.resolve())
    for row in report["recipes"]:
        o, n = row["old"], row["new"]
        print(f"  {row['model']}/{row['recipe']}: gate {'PASS' if n['pass'] else 'FAIL'}, top-1 "
              f"{n['agree_counted']}/{n['counted']} (was {o['agree_counted']}/{o['counted']}), max|dlogits| "
              f"{_fmt(n['max_abs_dlogits'])} (was {_fmt(o['max_abs_dlogits'])})")
    print(f"beta-watch: {report['verdict']}; report {report['report']} (+ .json)")
    if report["regressions"]:
        raise PipelineError(report["report"], f"{report['verdict']} with {', '.join(report['updates'])}: "
                            + "; ".join(report["regressions"][:3]),
                            "do not adopt these versions; see the report (limits: beta_watch.limits in config.yaml)")
    return 0
