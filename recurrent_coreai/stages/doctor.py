"""The peer lint: ``coreai doctor`` (coreai-cli, a community static lint of known Core AI traps)
over the export graph's source, the checkpoint and one recipe's bundle.

``scripts/doctor.py --model M --recipe R --sources F.py... --checkpoint DIR --export DIR --out J``
writes every report (coreai-cli's own JSON per target) into ``results/<m>/gate/<r>.doctor.json``.
A defect that coreai doctor rates fatal or silent (its exit status 2) fails the stage with exit 2
and one line naming the finding; runaway/perf findings (its exit status 1) are kept in the JSON
and logged as warnings. On failure the declared output is not written.

Findings are judged per recipe where coreai doctor cannot know the recipe: a block-divisibility
finding (:data:`BLOCK_RULE`, e.g. ``vocab_size=50288`` not divisible by 32: Mamba-2's padded
vocabulary) is a defect only for a recipe whose quantisation plan (export.json ``quantized``)
quantises a tensor whose width along the axis its blocks run (the recipe's ``quantize.axis``: 1,
a linear's input width; each output row is quantised on its own, so the number of rows -- a
vocabulary of 1000 -- needs no block) is not a multiple of the recipe's block. For any other
recipe (fp16, which quantises nothing; a head of 1000 x 128 in blocks of 32 along its 128 inputs)
the finding stays in the JSON with ``"applies": false`` and the reason in ``"not_applicable"``,
and does not count towards the exit status.

The toolchain contract (recurrent_coreai/coreai/contract.py: what the pipeline needs of
coreai-core/-torch/-opt) is checked against the installed packages, statically (their files read,
nothing imported: importing coreai-opt alone costs seconds per job): each miss is one warning line
saying what degrades, and the JSON gets ``toolchain_contract`` (only when something is missing).
A miss does not fail the stage: the export and the gate say what it cost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from recurrent_coreai.coreai import contract
from recurrent_coreai.pipeline import stage
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.fsutil import write_text_atomic
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import read_export, read_manifest, sealed_text

PROFILE = "iphone"  # the device class the shipped bundles target (gates coreai doctor's device rules)
FAIL_STATUS = 2  # coreai doctor: 2 = fatal/silent defect, 1 = runaway/perf, 0 = none
FIX_TOOL = "pip install -r requirements.txt (coreai-cli is pinned there)"
SEVERITY_STATUS = {"fatal": 2, "silent": 2, "runaway": 1, "perf": 1}  # coreai doctor's exit status per severity
BLOCK_RULE = "QUANT-BLOCK-DIVISIBILITY"  # its evidence: "not divisible by block size B: name=value, ..."


def doctor_json(lay: Layout, recipe: str) -> Path:
    """``results/<m>/gate/<recipe>.doctor.json``: beside the recipe's gate result."""
    return lay.doctor_json(recipe)


def tool_version() -> str:
    try:
        return f"coreai-cli {version('coreai-cli')}"
    except PackageNotFoundError:
        raise PipelineError("coreai-cli", "is not installed", FIX_TOOL) from None


def run_doctor(target: Path, block_size: int | None = None) -> tuple[int, dict]:
    """``coreai doctor TARGET --json``: (its exit status, its JSON report). Paths in the report
    are given as ``target`` was (coreai doctor resolves them), so the JSON does not depend on
    where the tree lives. ``block_size``: the recipe's quantisation block (coreai doctor's
    default, 32, without one)."""
    cmd = [sys.executable, "-m", "coreai_cli", "doctor", str(target), "--json", "--profile", PROFILE,
           *(["--block-size", str(block_size)] if block_size else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        lines = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()
        raise PipelineError(target, f"coreai doctor gave no report ({lines[-1][:300]})",
                            f"check the path; run `coreai doctor {target}` to see why") from None
    absolute = str(Path(target).resolve())
    report["target"] = str(target)
    for f in report["findings"]:
        f["where"] = f["where"].replace(absolute, str(target))
    return proc.returncode, report


def not_applicable(finding: dict, export_record: dict | None) -> str | None:
    """Why a finding does not apply to the recipe of ``export_record``, or None when it does.
    Only a block-divisibility finding is judged: it applies when the recipe's plan quantises a
    tensor with a dimension that is not a multiple of the recipe's block (whatever coreai doctor
    names: it reads config.json, which may give the unpadded vocabulary, 50280 for a table of
    50288 rows), and not otherwise."""
    if finding["id"] != BLOCK_RULE or export_record is None:
        return None
    named = finding["evidence"].partition(":")[2].strip() or finding["evidence"]
    recipe, quantized = export_record["recipe"], export_record.get("quantized", [])
    if not quantized:
        return f"recipe {recipe} quantises no tensor, so no block size applies to {named}"
    q = (export_record.get("recipe_spec") or {}).get("quantize") or {}
    block, axis = q.get("block_size"), q.get("axis", 1)
    if not block or any(row["shape"][axis] % block for row in quantized):
        return None
    shapes = ", ".join(sorted({"x".join(map(str, r["shape"])) for r in quantized}))
    return (f"recipe {recipe} quantises {len(quantized)} linear{'s' * (len(quantized) > 1)} in blocks of {block} along "
            f"axis {axis}, where each is a multiple of the block ({shapes}); the other axis needs none: {named} "
            "does not apply")


def judge(report: dict, export_record: dict | None) -> int:
    """Mark the findings that do not apply to the recipe (``applies``, ``not_applicable``);
    the report's exit status counting only those that do (coreai doctor's is ``doctor_exit_status``)."""
    status = 0
    for f in report["findings"]:
        why = not_applicable(f, export_record)
        if why is not None:
            f.update(applies=False, not_applicable=why)
        else:
            status = max(status, SEVERITY_STATUS.get(f["severity"], 0))
    if any(f.get("applies") is False for f in report["findings"]):
        report["doctor_exit_status"] = report["exit_status"]
        report["exit_status"] = status
    return report["exit_status"]


def lint(sources: list[Path], checkpoint: Path | None, bundle: Path | None, export_record: dict | None = None) -> dict:
    """Every target's report and the worst exit status (findings that do not apply to the
    recipe of ``export_record`` not counted: :func:`judge`)."""
    targets = [*sources, *([checkpoint] if checkpoint else []), *([bundle] if bundle else [])]
    q = (export_record or {}).get("recipe_spec", {}).get("quantize") or {}
    reports = []
    for target in targets:
        status, report = run_doctor(Path(target), q.get("block_size"))
        report["exit_status"] = status
        reports.append(report)
    return summary(reports, export_record)


def summary(reports: list[dict], export_record: dict | None) -> dict:
    """The doctor's result from coreai doctor's reports (each with its own ``exit_status``):
    each judged for the recipe (:func:`judge`), the worst exit status and the counts."""
    worst = max([judge(report, export_record) for report in reports], default=0)
    findings = [f for r in reports for f in r["findings"] if f.get("applies", True)]
    return {"tool": tool_version(), "profile": PROFILE, "exit_status": worst, "findings": len(findings),
            "defects": sum(f["severity"] in ("fatal", "silent", "runaway", "perf") for f in findings),
            **({"not_applicable": sum(len(r["findings"]) for r in reports) - len(findings)}
               if len(findings) < sum(len(r["findings"]) for r in reports) else {}),
            "reports": reports}


def as_reported(report: dict) -> dict:
    """A recorded report as coreai doctor gave it, before :func:`judge` marked it for the recipe."""
    raw = {k: v for k, v in report.items() if k != "doctor_exit_status"}
    raw["exit_status"] = report.get("doctor_exit_status", report["exit_status"])
    raw["findings"] = [{k: v for k, v in f.items() if k not in ("applies", "not_applicable")}
                       for f in report["findings"]]
    return raw


def first_defect(result: dict) -> tuple[str, dict]:
    """(target, finding) of the first fatal/silent finding."""
    for report in result["reports"]:
        for f in report["findings"]:
            if f["severity"] in ("fatal", "silent") and f.get("applies", True):
                return report["target"], f
    raise ValueError("no fatal or silent finding")


def doctor_bundle(sources: list[Path], checkpoint: Path | None, export_dir: Path | None, out: Path) -> dict:
    record = read_export(export_dir) if export_dir else None
    bundle = export_dir / record["bundle"] if export_dir else None
    if checkpoint is not None and (Path(checkpoint) / "manifest.json").exists():
        read_manifest(Path(checkpoint))  # the source stage's bytes, as it recorded them
    result = lint(sources, checkpoint, bundle, record)
    misses = contract.check(live=False)
    for line in contract.miss_lines(misses):
        stage.log.warning("%s", line)
    if misses:
        result["toolchain_contract"] = misses
    for report in result["reports"]:
        for f in report["findings"]:
            if f.get("applies", True):
                stage.log.warning("coreai doctor %s: %s (%s) at %s: %s -- fix: %s", report["kind"], f["id"],
                                  f["severity"], f["where"], f["evidence"], f["fix"])
            else:
                stage.log.info("coreai doctor %s: %s (%s) at %s: %s -- not applicable: %s", report["kind"], f["id"],
                               f["severity"], f["where"], f["evidence"], f["not_applicable"])
    if result["exit_status"] < FAIL_STATUS:
        write_text_atomic(out, sealed_text(result, "doctor"))  # sealed: see pipeline/records.py
    return result


def error_line(result: dict) -> str:
    """The one line for the first fatal/silent finding (the rest are in the log and the JSON)."""
    _, f = first_defect(result)
    more = result["defects"] - 1
    line = (f"error: {f['where']}: coreai doctor {f['id']} ({f['severity']}): {f['title']}: {f['evidence']}"
            + (f" (+{more} more defect{'s' if more > 1 else ''} in the log)" if more > 0 else "")
            + f" -- fix: {f['fix']}")
    return " ".join(line.split())


@main_guard
def main(argv=None) -> int:
    """``scripts/doctor.py``: exit 0 (no findings, or only runaway/perf ones: kept in the JSON and
    logged), 2 (a fatal/silent defect: one line on stderr, no output written), 1 (anything else
    that went wrong, e.g. coreai-cli missing: one line)."""
    p = stage.parser("doctor", "model", "recipe", "out", lists=("sources",))
    p.add_argument("--checkpoint", type=Path, help="the normalised checkpoint directory (results/<m>/source)")
    p.add_argument("--export", type=Path, help="the recipe's export directory (its .aimodel is linted)")
    ns = p.parse_args(argv)
    stage.setup("doctor", ns)
    result = doctor_bundle(ns.sources, ns.checkpoint, ns.export, Path(ns.out))
    if result["exit_status"] >= FAIL_STATUS:
        print(error_line(result), file=sys.stderr)
        return FAIL_STATUS
    stage.log.info("doctor %s/%s: %s, %d targets, %d findings (%d defects) -> %s", ns.model, ns.recipe,
                   result["tool"], len(result["reports"]), result["findings"], result["defects"], ns.out)
    return 0
