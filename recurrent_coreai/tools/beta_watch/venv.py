"""The beta venv: ONLY the new wheels (installed ``--no-deps``), the worktree's code and the
current venv (torch and everything else) through a ``.pth``; verified before it is used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.version import Version

from recurrent_coreai.tools.beta_watch.index import pip_index_args
from recurrent_coreai.tools.beta_watch.pins import Updates
from recurrent_coreai.util import env as env_vars
from recurrent_coreai.util.errors import PipelineError


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


def prepare_env(venv: Path, tree: Path, updates: Updates, index_url: str | None) -> dict:
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
    env = {k: v for k, v in os.environ.items() if k not in env_vars.SECRET_VARS}  # never publish from the worktree
    env.update(VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(venv / "bin"), str(Path(sys.executable).parent),
                                                            env.get("PATH", "")]), DVC_NO_ANALYTICS="1")
    verify_env(python, env, site, updates)
    return env


def verify_env(python: Path, env: dict, site: Path, updates: Updates) -> None:
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

