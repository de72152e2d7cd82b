"""The parity gate: teacher-forced comparison of a Core AI bundle against the reference.

1. :func:`reference_stream` (once per model): for every prompt, token 0 then
   ``User: {prompt}\\n\\nAssistant:``, extended by the fp32 reference's greedy continuation up
   to the prompt's share of the step budget; the reference logits at every step are stored.
2. :func:`run_gate` (per recipe): the SAME fixed token stream is fed to the Core AI runtime;
   per step we compare the argmax and max|Δlogits|. A step where the reference's top-2 margin
   is below ``near_tie_epsilon`` is a near-tie: the engine may pick either of the two.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import stage, toolchain
from .coreai_runtime import DecodeSession
from .config import gate_settings
from .errors import PipelineError, main_guard
from .fsutil import atomic_path, dumps_json, sha256_file, tree_manifest
from .records import read_aot, read_export

TSV_COLUMNS = ("step", "prompt", "pos", "token", "ref_top1", "ref_top2", "engine_top1", "ref_margin",
               "near_tie", "agree", "max_abs_dlogits", "kl")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def compare(ref_logits: np.ndarray, eng_logits: np.ndarray, epsilon: float) -> dict:
    """Per-step comparison of two logit vectors (float64)."""
    top2 = np.argsort(ref_logits)[-2:][::-1]
    margin = float(ref_logits[top2[0]] - ref_logits[top2[1]])
    eng = int(np.argmax(eng_logits))
    lp, lq = _log_softmax(ref_logits), _log_softmax(eng_logits)
    return {"ref_top1": int(top2[0]), "ref_top2": int(top2[1]), "engine_top1": eng, "ref_margin": margin,
            "near_tie": margin < epsilon, "agree": eng == int(top2[0]),
            "max_abs_dlogits": float(np.abs(ref_logits - eng_logits).max()),
            "kl": float(np.sum(np.exp(lp) * (lp - lq)))}


def contract_problems(export_record: dict) -> list[str]:
    """Structural checks the numbers cannot see on this host (the Linux runtime executes
    several writes to one state correctly; the device GPU delegate keeps only one)."""
    problems = []
    writes = export_record.get("state_writes_per_step")
    if writes is None:
        problems.append("export.json does not record state writes per step")
    else:
        for name, n in sorted(writes.items()):
            if n != 1:
                problems.append(f"state {name} is written {n} times per step (must be exactly once, at the end)")
    return problems


def verdict(rows: list[dict], thresholds: dict) -> dict:
    counted = [r for r in rows if not r["near_tie"]]
    ties = [r for r in rows if r["near_tie"]]
    agree = sum(r["agree"] for r in counted)
    tie_ok = sum(r["engine_top1"] in (r["ref_top1"], r["ref_top2"]) for r in ties)
    agree_rate = agree / len(counted) if counted else 1.0
    max_abs = max(r["max_abs_dlogits"] for r in rows)
    reasons = []
    if agree_rate < thresholds["min_agree"]:
        reasons.append(f"top-1 agreement {agree}/{len(counted)} outside near-ties is below {thresholds['min_agree']}")
    if thresholds["min_agree"] >= 1.0 and tie_ok < len(ties):
        reasons.append(f"{len(ties) - tie_ok} near-tie step(s) picked neither of the reference's top 2")
    limit = thresholds.get("max_abs_dlogits")
    if limit is not None and max_abs > limit:
        reasons.append(f"max|dlogits| {max_abs:.3g} exceeds {limit:g}")
    return {
        "steps": len(rows), "agree": sum(r["agree"] for r in rows), "counted": len(counted),
        "agree_counted": agree, "agree_rate": agree_rate, "near_ties": len(ties),
        "near_ties_in_top2": tie_ok, "mismatches": len(counted) - agree,
        "max_abs_dlogits": max_abs, "mean_kl": float(np.mean([r["kl"] for r in rows])),
        "pass": not reasons, "reasons": reasons,
    }


def run_gate(aimodelx: Path, export_record: dict, stream: dict, settings: dict,
             session_factory=DecodeSession) -> tuple[dict, list[dict]]:
    states = {k: tuple(v) for k, v in export_record["states"].items()}
    state_dtype = np.float16 if export_record["state_dtype"] == "float16" else np.float32
    eps = settings["near_tie_epsilon"]
    rows: list[dict] = []
    with session_factory(aimodelx, states, state_dtype) as sess:
        prev_prompt = None
        for step, (tok, prompt, pos) in enumerate(zip(stream["tokens"], stream["prompt"], stream["pos"])):
            if prompt != prev_prompt:
                sess.reset()
                prev_prompt = prompt
            eng = sess.step(int(tok))
            row = {"step": step, "prompt": int(prompt), "pos": int(pos), "token": int(tok)}
            row.update(compare(stream["logits"][step].astype(np.float64), eng, eps))
            rows.append(row)
    result = verdict(rows, settings["thresholds"])
    contract = contract_problems(export_record)
    if contract:
        result["pass"] = False
        result["reasons"] = contract + result["reasons"]
    result.update({"state_writes_per_step": export_record.get("state_writes_per_step"), "near_tie_epsilon": eps,
                   "thresholds": settings["thresholds"], "prompts": settings["prompts"]})
    return result, rows


def bundle_digest(manifest: dict[str, dict]) -> str:
    """sha256 over a bundle's file manifest (a directory has no single file hash)."""
    import hashlib

    return hashlib.sha256(dumps_json(manifest).encode()).hexdigest()


def tsv_text(rows: list[dict]) -> str:
    def fmt(v):
        return f"{v:.6g}" if isinstance(v, float) else str(int(v) if isinstance(v, (bool, np.bool_)) else v)

    return "\t".join(TSV_COLUMNS) + "\n" + "".join("\t".join(fmt(r[c]) for c in TSV_COLUMNS) + "\n" for r in rows)


def write_report(result: dict, rows: list[dict], json_path: Path, tsv_path: Path) -> None:
    with atomic_path(tsv_path) as tmp:
        tmp.write_text(tsv_text(rows))
    with atomic_path(json_path) as tmp:
        tmp.write_text(dumps_json(result))


def gate_bundle(model: str, recipe: str, export_dir: Path, aot_dir: Path, stream_path: Path, settings: dict,
                json_path: Path, tsv_path: Path) -> dict:
    """Gate one recipe's bundle. The result records the sha256 of every file it tested (the
    ``.aimodel`` and the lowering it ran): publish ships those bytes and no others."""
    record = read_export(export_dir)
    lowering = read_aot(aot_dir)  # checks the lowered files against aot.json
    aimodel = export_dir / record["bundle"]
    tested = tree_manifest(aimodel)
    if lowering["from"] != tested:
        raise PipelineError(aot_dir, f"was lowered from other bytes than {aimodel}",
                            "rerun the aot stage for the universal target (snakemake --forcerun aot)")
    aimodelx = aot_dir / lowering["product"]
    with np.load(stream_path) as npz:
        stream = {k: npz[k] for k in npz.files}
    result, rows = run_gate(aimodelx, record, stream, settings)
    result.update({"model": model, "recipe": recipe, "bundle": record["bundle"], "bundle_sha256": bundle_digest(tested),
                   "lowered": aimodelx.name, "tested_files": {"aimodel": tested, "lowered": lowering["files"]},
                   "reference_sha256": sha256_file(stream_path),
                   "toolchain": toolchain.versions(), "size_bytes": record["size_bytes"]})
    if not result["pass"]:
        failed = json_path.with_suffix(".failed.json")
        write_report(result, rows, failed, tsv_path.with_suffix(".failed.tsv"))
        raise PipelineError(json_path, f"gate FAILED for {model}/{recipe}: {'; '.join(result['reasons'])}",
                            f"inspect {failed}; the bundle is not published")
    for stale in (json_path.with_suffix(".failed.json"), tsv_path.with_suffix(".failed.tsv")):
        stale.unlink(missing_ok=True)
    write_report(result, rows, json_path, tsv_path)
    return result


@main_guard
def main(argv=None) -> int:
    """The gate stage: ``scripts/gate.py --model M --recipe R --export DIR --aot DIR --reference NPZ
    --json J --tsv T``; exit 1 (and no declared output) when the bundle fails."""
    import time

    ns = stage.parser("gate", "model", "recipe", "export", "aot", "reference", "json", "tsv").parse_args(argv)
    s, _ = stage.setup("gate", ns)
    t0 = time.perf_counter()
    res = gate_bundle(ns.model, ns.recipe, Path(ns.export), Path(ns.aot), Path(ns.reference),
                      gate_settings(s, ns.recipe), Path(ns.json), Path(ns.tsv))
    seconds = time.perf_counter() - t0
    stage.log.info("gate %s/%s PASS: %d/%d top-1 outside %d near-ties, max|dlogits| %.3g, mean KL %.3g; "
                   "%.1f s (%.3f s/step), peak RSS %.0f MB", ns.model, ns.recipe, res["agree_counted"], res["counted"],
                   res["near_ties"], res["max_abs_dlogits"], res["mean_kl"], seconds, seconds / res["steps"],
                   stage.rss_mb())
