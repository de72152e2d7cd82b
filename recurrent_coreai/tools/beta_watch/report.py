"""The report of a rebuild: ``reports/beta-<versions>.md`` (for people) and ``.json`` (for CI)."""

from __future__ import annotations

from pathlib import Path

from recurrent_coreai.tools.beta_watch.pins import Updates

REPORTS = "reports"


def versions_tag(updates: Updates) -> str:
    """``coreai-opt-0.4.1b1`` (joined with ``_``): names the report and the rebuild's log."""
    return "_".join(f"{p}-{new}" for p, (_, new) in sorted(updates.items()))


def fmt(value, spec: str = ".3g", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def digests(old: str | None, new: str | None, comparable: bool = True) -> str:
    """Old and new bundle digests; ``comparable`` is False when either bundle was built where the
    reproducible-build patches did not all apply: its digest says nothing about a change."""
    short = [f"`{d[:12]}`" if d else "–" for d in (old, new)]
    if not comparable:
        return " → ".join(short) + " (not comparable: not byte-reproducible)"
    return f"{short[1]} (unchanged)" if old and old == new else " → ".join(short)


def comparable(old: dict, new: dict) -> bool:
    """Whether two bundles' digests can be compared (both built byte-reproducibly)."""
    return old.get("byte_reproducible") is not False and new.get("byte_reproducible") is not False


def degraded_lines(report: dict) -> list[str]:
    """The toolchain contract's misses in the new venv and the bundles built not byte-reproducibly."""
    from recurrent_coreai.coreai.contract import miss_lines

    misses = (report.get("contract") or {}).get("new") or []
    rows = [(r, side) for r in report["recipes"] for side in ("old", "new") if r[side].get("byte_reproducible") is False]
    if not misses and not rows:
        return []
    out = ["", "## Toolchain contract", ""]
    out += [f"- {line}" for line in miss_lines(misses)] or ["The new versions hold the whole contract."]
    out += [f"- {r['model']}/{r['recipe']} ({side}): not byte-reproducible ({'; '.join(r[side]['toolchain_misses'])}); "
            "its digest is not comparable" for r, side in rows]
    return out


def render_markdown(report: dict) -> str:
    ups = ", ".join(f"{p} {u['old']} → {u['new']}" for p, u in report["updates"].items())
    lines = [f"# Core AI beta rebuild: {ups}", "",
             f"**{report['verdict']}** — limits: " + ", ".join(f"{k} {v:g}" for k, v in report["limits"].items()),
             "", f"Index: {report['index_url'] or 'pip default'}; rebuilt in {report['rebuild_seconds']:.0f} s "
             f"({len(report['jobs']['executed'])} jobs).", "",
             "| model | recipe | gate | top-1 agreed/counted | max abs Δlogits | mean KL | p99 KL | same top-1 | "
             "PPL ratio | text mean KL | text PPL ratio | text drift (horizon) | bundle MB | export s | "
             "export peak RSS MB | bundle sha256 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["recipes"]:
        o, n = row["old"], row["new"]

        def pair(key, spec=".3g"):
            return f"{fmt(o.get(key), spec)} → {fmt(n.get(key), spec)}"

        gate = f"{'PASS' if o['pass'] else 'FAIL'} → {'PASS' if n['pass'] else 'FAIL'}"
        agree = f"{o['agree_counted']}/{o['counted']} → {n['agree_counted']}/{n['counted']}"
        mb = f"{fmt(o['size_bytes'] and o['size_bytes'] / 1e6, '.1f')} → {fmt(n['size_bytes'] and n['size_bytes'] / 1e6, '.1f')}"
        lines.append(f"| {row['model']} | {row['recipe']} | {gate} | {agree} | {pair('max_abs_dlogits')} | "
                     f"{pair('mean_kl', '.2g')} | {pair('kld_p99', '.2g')} | {pair('same_top1', '.4f')} | "
                     f"{pair('ppl_ratio', '.5f')} | {pair('text_kld_mean', '.2g')} | {pair('text_ppl_ratio', '.5f')} | "
                     f"{pair('text_drift', '.2g')} ({fmt(n.get('text_horizon'), 'd')}) | {mb} | {pair('export_seconds', '.1f')} | "
                     f"{pair('export_peak_rss_mb', '.0f')} | {digests(o['bundle_sha256'], n['bundle_sha256'], comparable(o, n))} |")
    lines += degraded_lines(report)
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
