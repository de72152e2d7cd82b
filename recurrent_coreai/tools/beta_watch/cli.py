"""The command: arguments, the dry listing (what is newer, what would rebuild) and ``--apply``."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from recurrent_coreai.tools.one_line_parser import OneLineParser
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.tools.beta_watch.assess import assess
from recurrent_coreai.tools.beta_watch.index import find_updates
from recurrent_coreai.tools.beta_watch.jobs import Job, describe
from recurrent_coreai.tools.beta_watch.pins import REQUIREMENTS, Updates, read_pins
from recurrent_coreai.tools.beta_watch.plan import plan
from recurrent_coreai.tools.beta_watch.rebuild import rebuild
from recurrent_coreai.tools.beta_watch.report import REPORTS, fmt, versions_tag
from recurrent_coreai.tools.beta_watch.settings import DEFAULTS, check_index_url, settings
from recurrent_coreai.tools.beta_watch.worktree import check_clean, git, worktree
from recurrent_coreai.util.errors import PipelineError, main_guard

PROG = "python -m recurrent_coreai beta-watch"


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description="Find coreai-* versions newer than the pins; --apply rebuilds in a "
                 "throwaway git worktree and compares.")
    ap.add_argument("--index-url", help="PEP 503/691 simple index to ask (default: beta_watch.index_url, else pip's)")
    ap.add_argument("--apply", action="store_true", help="rebuild in a throwaway worktree and compare")
    ap.add_argument("--limits", nargs="+", default=[], metavar="KEY=VALUE",
                    help=f"override beta_watch.limits ({', '.join(DEFAULTS['limits'])})")
    ap.add_argument("--worktree", type=Path, help="with --apply: build in this new directory and keep it")
    ap.add_argument("--config-file", default=cfgmod.DEFAULT_FILE)
    return ap


def show_plan(repo: Path, updates: Updates, index_url: str | None) -> list[Job]:
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


def unbuilt(repo: Path, results: str, baseline: list[Job]) -> str | None:
    """The one warning line when the baseline is not built (``baseline``: what ``snakemake -n
    publish`` plans on it), else None: the listing above then includes what the baseline lacks."""
    if not baseline:
        return None
    named = ", ".join(map(str, baseline[:3])) + (" …" if len(baseline) > 3 else "")
    return (f"warning: {repo / results}: the baseline is not built (snakemake -n publish plans {len(baseline)} "
            f"job(s): {named}); the jobs above include them, and --apply refuses until `snakemake --cores 1 "
            "publish` has built it")


def apply(repo: Path, cfg: dict, bw: dict, updates: Updates, expected: list[Job], keep: Path | None,
          baseline: list[Job]) -> dict:
    """Rebuild with the new versions in a throwaway worktree (kept at ``keep``) and assess it
    (``baseline``: the jobs ``snakemake -n publish`` plans on the checkout: none, or a refusal)."""
    results = cfg["results"]
    check_clean(repo)
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
    ns = parser().parse_args(argv)
    if ns.index_url is not None:
        check_index_url(ns.index_url)
    if ns.worktree and not ns.apply:
        raise PipelineError("--worktree", "only means something with --apply (where to build and keep the tree)",
                            "add --apply, or leave --worktree out")
    if ns.worktree and ns.worktree.exists():
        raise PipelineError(ns.worktree, "already exists", "name a new directory for --worktree")
    repo = Path(git(Path.cwd(), "rev-parse", "--show-toplevel").strip())
    cfg = cfgmod.load(repo / ns.config_file)
    bw = settings(cfg, ns.limits)
    bw["index_url"] = ns.index_url or bw["index_url"]
    updates = find_updates(read_pins(repo / REQUIREMENTS, bw["packages"]), bw["index_url"])
    expected = show_plan(repo, updates, bw["index_url"])
    if not updates:
        return 0
    baseline = plan(repo, dict(os.environ))
    warning = unbuilt(repo, cfg["results"], baseline)
    if warning and not ns.apply:
        print(warning, file=sys.stderr)
    if not ns.apply:
        return 0
    report = apply(repo, cfg, bw, updates, expected, ns.worktree and ns.worktree.resolve(), baseline)
    for row in report["recipes"]:
        o, n = row["old"], row["new"]
        print(f"  {row['model']}/{row['recipe']}: gate {'PASS' if n['pass'] else 'FAIL'}, top-1 "
              f"{n['agree_counted']}/{n['counted']} (was {o['agree_counted']}/{o['counted']}), max|dlogits| "
              f"{fmt(n['max_abs_dlogits'])} (was {fmt(o['max_abs_dlogits'])})")
    print(f"beta-watch: {report['verdict']}; report {report['report']} (+ .json)")
    if report["regressions"]:
        raise PipelineError(report["report"], f"{report['verdict']} with {', '.join(report['updates'])}: "
                            + "; ".join(report["regressions"][:3]),
                            "do not adopt these versions; see the report (limits: beta_watch.limits in config.yaml)")
    return 0
