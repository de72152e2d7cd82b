"""``python -m recurrent_coreai status``: one row per model and recipe -- built, gated, published,
stale -- read from the records in ``results/`` and from ``dvc.lock`` only: no rebuild, no
Snakemake, no torch.

* built: the recipe's ``export.json`` exists (its bundle size).
* gate: the gate JSON's verdict, top-1 agreement outside near-ties and max|dlogits|
  (``FAIL`` from ``<recipe>.failed.json`` when the last gate failed).
* published: the commit of ``publish.json`` (``push.commit``), ``staged`` when the receipt
  exists without a push, ``no`` otherwise.
* stale: what changed since the build. ``toolchain``: an installed version differs from
  ``results/toolchain.json``; ``code: <rule>``: a code file that ``dvc.lock`` records for a
  stage the row depends on (the files of fingerprint.code_files, which Snakemake's ``params:
  code`` hashes) has another md5 now, or is gone. A stage that starts importing another module
  must change one of its recorded files to do so, so the recorded md5s cover the file set too
  (re-deriving fingerprint.code_files would parse every module, ~1.5 s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import yaml

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.coreai import toolchain
from recurrent_coreai.pipeline.dag import stage_name
from recurrent_coreai.util.errors import main_guard
from recurrent_coreai.pipeline.fingerprint import ROOT
from recurrent_coreai.pipeline.paths import Layout

CODE_DIRS = ("recurrent_coreai/", "scripts/")
MODEL_STAGES = ("source", "vocab", "reference", "card", "stage_and_push")
COLUMNS = ("model", "recipe", "built", "gate", "top-1", "max|dlogits|", "published", "stale")


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def md5_of(path: Path) -> str | None:
    try:
        return hashlib.md5(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def read_lock(path: Path) -> dict[str, dict[str, str]] | None:
    """``{stage: {code file: md5}}`` from dvc.lock (only the code deps), or None without a lock."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    stages = (yaml.load(text, Loader=loader) or {}).get("stages", {})
    return {name: {d["path"]: d.get("md5") for d in st.get("deps", []) if d["path"].startswith(CODE_DIRS)}
            for name, st in stages.items()}


def toolchain_changes(results: Path) -> list[str]:
    """``pkg old->new`` for every version that differs from the built tree's toolchain.json."""
    built = (_json(results / "toolchain.json") or {}).get("versions")
    if built is None:
        return []
    now = toolchain.versions()
    return [f"{k} {built.get(k)}->{now.get(k)}" for k in sorted(set(built) | set(now)) if built.get(k) != now.get(k)]


class CodeCheck:
    """Which recorded stages ran code that has changed since (each file hashed once)."""

    def __init__(self, lock: dict[str, dict[str, str]], root: Path):
        self.lock, self.root, self._md5 = lock, root, {}

    def md5(self, rel: str) -> str | None:
        if rel not in self._md5:
            self._md5[rel] = md5_of(self.root / rel)
        return self._md5[rel]

    def changed(self, stage: str) -> bool | None:
        """True if a code file of the stage changed, None if dvc.lock does not record the stage."""
        recorded = self.lock.get(stage)
        if recorded is None:
            return None
        return any(self.md5(rel) != md5 for rel, md5 in recorded.items())


def _stages_of(model: dict, name: str, recipe: str) -> list[tuple[str, str]]:
    """(rule, dvc stage) pairs whose outputs a recipe's published bundle depends on."""
    targets = sorted({"universal", *model["targets"]})
    pairs = [("toolchain", "toolchain")]
    pairs += [(rule, stage_name({"rule": rule, "wildcards": {"model": name}})) for rule in MODEL_STAGES]
    pairs.append(("export", stage_name({"rule": "export", "wildcards": {"model": name, "recipe": recipe}})))
    pairs += [("aot", stage_name({"rule": "aot", "wildcards": {"model": name, "target": t, "recipe": recipe}}))
              for t in targets]
    pairs += [(rule, stage_name({"rule": rule, "wildcards": {"model": name, "recipe": recipe}}))
              for rule in ("gate", "doctor")]  # publish waits for both
    return pairs


def _stale(pairs, tool: list[str], code: CodeCheck | None, built: bool) -> str:
    if not built:
        return "-"
    reasons = [f"toolchain ({', '.join(tool)})"] if tool else []
    if code is None:
        reasons.append("unknown: no dvc.lock")
    else:
        checks = {rule: code.changed(stage) for rule, stage in pairs}
        changed = sorted({rule for rule, c in checks.items() if c})
        unrecorded = sorted({rule for rule, c in checks.items() if c is None})
        reasons += [f"code: {', '.join(changed)}"] if changed else []
        reasons += [f"not in dvc.lock: {', '.join(unrecorded)}"] if unrecorded else []
    return "; ".join(reasons) or "no"


def _published(receipt: dict | None, recipe: str) -> str:
    if not receipt or recipe not in receipt.get("gates", {}):
        return "no"
    push = receipt.get("push", {})
    return push["commit"] if push.get("pushed") and push.get("commit") else "staged"


def rows(cfg: dict, root: Path = ROOT) -> list[dict[str, str]]:
    """The status of every model to build (and every model with something in results/)."""
    results = root / cfg["results"]
    lock = read_lock(root / "dvc.lock")
    code = CodeCheck(lock, root) if lock is not None else None
    tool = toolchain_changes(results)
    names = sorted(set(cfgmod.models_to_build(cfg)) | {m for m in cfg["models"] if (results / m).is_dir()})
    out = []
    for name in names:
        model, lay = cfg["models"][name], Layout(results, name)
        receipt = _json(lay.publish / "publish.json")
        for recipe in model["recipes"]:
            export = _json(lay.export(recipe) / "export.json")
            gate = _json(lay.gate_json(recipe)) or _json(lay.gate_json(recipe).with_suffix(".failed.json"))
            row = {"model": name, "recipe": recipe, "built": "no", "gate": "-", "top-1": "-", "max|dlogits|": "-",
                   "published": _published(receipt, recipe),
                   "stale": _stale(_stages_of(model, name, recipe), tool, code, export is not None)}
            if export is not None:
                row["built"] = f"yes ({export['size_bytes'] / 1e6:.1f} MB)"
            if gate is not None:
                row["gate"] = "pass" if gate.get("pass") else "FAIL"
                row["top-1"] = f"{gate['agree_counted']}/{gate['counted']}"
                row["max|dlogits|"] = f"{gate['max_abs_dlogits']:.3g}"
            out.append(row)
    return out


def render(table: list[dict[str, str]]) -> str:
    widths = {c: max([len(c)] + [len(r[c]) for r in table]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in COLUMNS).rstrip() for r in table]
    return "\n".join(lines)


@main_guard
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recurrent_coreai status", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", default=cfgmod.DEFAULT_FILE, help="the config the tree was built with")
    ap.add_argument("--root", type=Path, default=Path("."),
                    help="repository root holding dvc.lock, the code and results/ (default: .)")
    ns = ap.parse_args(argv)
    cfg = cfgmod.load(ns.config_file)
    print(render(rows(cfg, ns.root)))
    return 0
