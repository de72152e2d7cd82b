"""Old vs new: per gated recipe the gate verdict and numbers, bundle and export cost read from
both results trees, the regressions beyond ``beta_watch.limits``, and the verdict."""

from __future__ import annotations

import json
from pathlib import Path

from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import export_stats
from recurrent_coreai.tools.beta_watch.jobs import describe
from recurrent_coreai.tools.beta_watch.pins import Updates
from recurrent_coreai.tools.beta_watch.rebuild import Rebuild
from recurrent_coreai.tools.beta_watch.report import REPORTS, versions_tag, write_report

GATE_KEYS = ("pass", "agree_counted", "counted", "agree_rate", "near_ties", "max_abs_dlogits", "mean_kl",
             "kld_mean", "kld_p99", "same_top1", "ppl_ratio", "size_bytes", "bundle_sha256", "steps", "reasons")


# the held-out text stream's numbers (gate JSON ``text``): quality on real text and the largest
# relative state difference over its horizons (long-context drift)
TEXT_KEYS = ("text_kld_mean", "text_ppl_ratio", "text_drift", "text_horizon")


def text_numbers(verdict: dict) -> dict:
    """TEXT_KEYS of one gate verdict (None where it ran no text stream)."""
    text = verdict.get("text") or {}
    horizons = [h for h in text.get("horizons") or [] if h.get("max_rel_dstate") is not None]
    worst = max(horizons, key=lambda h: (h["max_rel_dstate"] != h["max_rel_dstate"], h["max_rel_dstate"]), default=None)
    return {"text_kld_mean": text.get("kld_mean"), "text_ppl_ratio": text.get("ppl_ratio"),
            "text_drift": worst["max_rel_dstate"] if worst else None,
            "text_horizon": max((h["horizon"] for h in text.get("horizons") or []), default=None)}


def numbers(results: Path, model: str, recipe: str) -> dict:
    """One recipe's gate verdict (passed or ``.failed.json``), bundle and export cost in a results tree."""
    lay = Layout(results, model)
    gate = lay.gate_json(recipe)
    if not gate.is_file() and gate.with_suffix(".failed.json").is_file():
        gate = gate.with_suffix(".failed.json")
    out = ({k: None for k in GATE_KEYS} | {k: None for k in TEXT_KEYS}
           | {"gate_file": None, "export_seconds": None, "export_peak_rss_mb": None})
    if gate.is_file():
        verdict = json.loads(gate.read_text())
        out.update({k: verdict.get(k) for k in GATE_KEYS}, **text_numbers(verdict), gate_file=str(gate.relative_to(results)))
    export_json = lay.export(recipe) / "export.json"
    out["byte_reproducible"], out["toolchain_misses"] = None, []
    if export_json.is_file():
        exp = json.loads(export_json.read_text())
        out["size_bytes"] = exp["size_bytes"] if out["size_bytes"] is None else out["size_bytes"]
        # a bundle built where the reproducible-build patches did not all apply (docs/toolchain.md)
        out["byte_reproducible"] = exp.get("byte_reproducible", True)
        out["toolchain_misses"] = list(dict.fromkeys(m["why"] for m in exp.get("toolchain_misses", []) if m["bytes"]))
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
    factor = limits.get("max_kld_factor")
    for key, what in (("kld_mean", "mean KL divergence"), ("text_kld_mean", "mean KL divergence on the held-out text")):
        if factor is not None and old.get(key) is not None and new.get(key) is not None:
            allowed = factor * max(old[key], limits.get("kld_floor", 0.0))
            if not new[key] <= allowed:
                found.append(f"{what} grew {old[key]:.3g} -> {new[key]:.3g} (limit x{factor:g} "
                             f"of max(old, {limits.get('kld_floor', 0.0):g}) = {allowed:.3g})")
    return found


def _toolchain(results: Path) -> dict:
    path = Layout(results, "").toolchain
    return json.loads(path.read_text())["versions"] if path.is_file() else {}


def assess(repo: Path, results: str, bw: dict, updates: Updates, run: Rebuild) -> dict:
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
        "contract": {"new": run.contract},  # the toolchain contract in the new venv, checked before the rebuild
        "snakemake_exit": run.exit, "rebuild_seconds": round(run.seconds, 1), "recipes": rows,
        "regressions": found, "verdict": "REGRESSION" if found else "no regression",
    }
    report["report"] = str(write_report(repo / REPORTS, report))
    return report
