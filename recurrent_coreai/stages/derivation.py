"""Derived records checked against what they are derived from: recompute, compare.

A seal (pipeline/records.py) says only that a record is the canonical text with its digest: an edit
followed by a recomputed seal passes it. So, before anything is staged (stages/publish.py) and
before DVC records a stage (scripts/dvc_record.py), every derived record is made again from its
inputs and compared with what is on disk:

* a gate JSON: its verdict recomputed (:func:`stages.gate.verdict`) from the per-step TSV it
  carries the digest of, with the settings in force (config: thresholds, near-tie epsilon, prompts,
  steps); its prefill verdict from its own prefill rows; the bundle it names against the bundle's
  ``export.json``; its reference digest against the reference stream;
* ``export.json``: its ``files`` and ``size_bytes`` against the bundle's bytes;
* an AOT output's ``aot.json``: what it was built from against ``export.json``;
* the card: rendered again from the records it is made of (:func:`stages.card.card_text`);
* the build report: rendered again likewise (:func:`stages.report.report_text`);
* the vocab stage's output (``vocab.record.json``, the device table of every tokenizer kind and
  the files beside it): baked again by the model's tokenizer kind from the source's tokenizer file (World:
  the pinned vocabulary) with the settings in force, and compared byte for byte
  (:func:`check_vocab`): a table with two ids swapped and its record sealed again is refused.

The seals stay the first check (they are cheap and name the stage to rerun); a record that is
sealed but disagrees with what it derives from is ONE line naming both files
(:func:`disagrees`). What this cannot catch -- a TSV and its summary forged together, or a bundle
and its ``export.json`` -- is in docs/provenance.md.
"""

from __future__ import annotations

import copy
import csv
import functools
import io
import json
import math
import os
import re
import shlex
import tempfile
from pathlib import Path

from recurrent_coreai import families, tokenizers
from recurrent_coreai.pipeline import code_groups
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline.records import (AOT, EXPORT, SEAL, check_seal, read_aot, read_card, read_export,
                                              read_gate, read_gate_tsv, read_report, read_vocab, rerun_fix,
                                              unseal_card)
from recurrent_coreai.stages import card, gate, report
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import file_state, first_difference, remembered, sha256_file, tree_manifest

TSV_INTS = ("step", "prompt", "pos", "token", "ref_top1", "ref_top2", "engine_top1")
TSV_BOOLS = ("near_tie", "agree")
TSV_REL = 1e-5  # the TSV prints 6 significant digits: a mean of printed values is within 5e-7 of the true one
SETTINGS = ("thresholds", "near_tie_epsilon", "prompts", "thresholds_why", "steps_why")
DATE = "\0build-date\0"  # rendered in place of the card's build date, which is not derived (SOURCE_DATE_EPOCH)


def disagrees(record: str | Path, source: str | Path, what: str, rule: str) -> PipelineError:
    """``<record>: disagrees with <source>: <what> -- fix: rerun it: ... --forcerun <rule>``"""
    return PipelineError(record, f"disagrees with {source}: {what}", rerun_fix(rule))


# --- the gate --------------------------------------------------------------------------------------
def tsv_rows(path: Path, text: str) -> list[dict]:
    """The gate TSV's rows as :func:`stages.gate.decode_rows` made them (printed precision); the
    text must be exactly what :func:`stages.gate.tsv_text` writes for them."""
    try:
        rows = [{k: (int(v) if k in TSV_INTS else bool(int(v)) if k in TSV_BOOLS else float(v)) for k, v in r.items()}
                for r in csv.DictReader(io.StringIO(text, newline=""), delimiter="\t")]
        canonical = gate.tsv_text(rows) == text and bool(rows)
    except (ValueError, TypeError, KeyError):
        canonical = False
    if not canonical:
        raise PipelineError(path, "is not a gate TSV as the gate writes it", rerun_fix("gate"))
    return rows


def _same(recorded, derived) -> bool:
    if isinstance(derived, float) and isinstance(recorded, (int, float)) and not isinstance(recorded, bool):
        return math.isclose(recorded, derived, rel_tol=TSV_REL, abs_tol=1e-12)
    return type(recorded) is type(derived) and recorded == derived


def _compare(record: Path, source: Path, recorded: dict, derived: dict, rule: str, prefix: str = "") -> None:
    for key, value in derived.items():
        if key not in recorded or not _same(recorded[key], value):
            got = recorded.get(key, "nothing")
            raise disagrees(record, source, f"{prefix}{key} is {got!r}, what it derives from gives {value!r}", rule)


def check_gate(json_path: Path, settings: dict, export_dir: Path | None = None, reference: Path | None = None) -> dict:
    """A gate JSON (sealed) against its TSV (by digest) and what it derives from: the verdict from
    the TSV's rows and ``settings`` (config.gate_settings: what is in force), the prefill verdict
    from its prefill rows, the bundle against ``export_dir``'s export.json, the reference digest.
    Returns the gate record."""
    json_path = Path(json_path)
    record = read_gate(json_path)
    tsv = json_path.with_name((record.get("tsv") or {}).get("name", json_path.with_suffix(".tsv").name))
    rows = tsv_rows(tsv, read_gate_tsv(tsv, record))
    for key in SETTINGS:
        if record.get(key) != settings.get(key):
            raise disagrees(json_path, "the config in force", f"{key} is {record.get(key)!r}, the config says "
                            f"{settings.get(key)!r}", "gate")
    counts = record.get("prompt_tokens") or [0] * len(settings["prompts"])
    steps = cfgmod.gate_step_count(counts, settings["steps"])
    if len(rows) != steps or record.get("steps_raised") != (steps > settings["steps"]):
        raise disagrees(json_path, tsv, f"{len(rows)} step(s) (steps_raised {record.get('steps_raised')!r}), the "
                        f"config's gate/steps {settings['steps']} for its prompts' tokens gives {steps}", "gate")
    eps = record.get("near_tie_epsilon_used")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps <= settings["near_tie_epsilon"]:
        raise disagrees(json_path, "the config in force", f"near_tie_epsilon_used is {eps!r}, not a number in "
                        f"[0, {settings['near_tie_epsilon']}]", "gate")
    bad_tie = next((r for r in rows if r["near_tie"] and r["ref_margin"] > eps * (1 + TSV_REL)), None)
    if bad_tie is not None:
        raise disagrees(json_path, tsv, f"step {bad_tie['step']} is a near-tie at margin {bad_tie['ref_margin']:g}, "
                        f"above near_tie_epsilon_used {eps:g}", "gate")
    for r in rows:
        if r["agree"] != (r["engine_top1"] == r["ref_top1"]):
            raise disagrees(json_path, tsv, f"step {r['step']}: agree is {int(r['agree'])} for engine top-1 "
                            f"{r['engine_top1']} and reference top-1 {r['ref_top1']}", "gate")
    prefill = record.get("prefill") or {}
    prefill_rows = prefill.get("rows") or []
    text = record.get("text") or {}
    if bool(text) != bool(settings.get("text")):
        raise disagrees(json_path, "the config in force", f"holds {'a' if text else 'no'} text stream, the config "
                        f"sets {'a' if settings.get('text') else 'no'} gate/text", "gate")
    text_rows = text.get("rows") or []
    decode = gate.verdict(rows, settings["thresholds"], counted_over=rows + prefill_rows + text_rows)
    _compare(json_path, tsv, record, {k: v for k, v in decode.items() if k not in ("pass", "reasons")}, "gate")
    if prefill:
        pre = gate.verdict(prefill_rows, settings["thresholds"], counted_over=[])
        _compare(json_path, json_path, prefill, {k: v for k, v in pre.items() if k != "reasons"}, "gate", "prefill ")
    if text:
        states = {h.get("horizon"): h.get("states") for h in text.get("horizons") or []}
        derived = gate.text_verdict(text_rows, states, list(settings["text"]["horizons"]), text.get("chunk"),
                                    settings["thresholds"])
        _compare(json_path, json_path, text, {k: v for k, v in derived.items() if k != "reasons"}, "gate", "text ")
    problems = (decode["reasons"] + ([] if prefill.get("pass", False) else ["prefill"])
                + ([] if not text or text.get("pass", False) else ["text"]))
    tested = (record.get("tested_files") or {}).get("aimodel") or {}
    if export_dir is not None:
        export = check_export(export_dir)
        problems += gate.contract_problems(export)
        if record.get("bundle") != export["bundle"] or tested != export["files"]:
            bad = first_difference(tested, export["files"]) or "its name"
            raise disagrees(json_path, Path(export_dir) / EXPORT, f"the bundle it tested is not this one "
                            f"({record.get('bundle')}: {bad})", "gate")
    if record.get("bundle_sha256") != gate.bundle_digest(tested):
        raise disagrees(json_path, json_path, "bundle_sha256 is not the digest of its tested_files", "gate")
    if record.get("pass") != (not problems) or (record.get("pass") and record.get("reasons")):
        raise disagrees(json_path, tsv, f"pass is {record.get('pass')!r}, the rows give "
                        f"{not problems!r} ({'; '.join(problems) or 'no reason to fail'})", "gate")
    if reference is not None and record.get("reference_sha256") != sha256_file(reference):
        raise disagrees(json_path, reference, "it was not gated against this reference stream", "gate")
    return record


# --- export and AOT ----------------------------------------------------------------------------------
def check_export(export_dir: Path) -> dict:
    """``export.json`` (sealed; every file of the directory as it records them) against the
    bundle's bytes: ``files`` and ``size_bytes``."""
    export_dir = Path(export_dir)
    record = read_export(export_dir)
    files = tree_manifest(export_dir / record["bundle"])
    bad = first_difference(files, record["files"])
    if bad:
        raise disagrees(export_dir / EXPORT, export_dir / record["bundle"] / bad, "other bytes", "export")
    size = sum(f["size"] for f in files.values())
    if record["size_bytes"] != size:
        raise disagrees(export_dir / EXPORT, export_dir / record["bundle"], f"size_bytes is {record['size_bytes']}, "
                        f"the bundle's files hold {size} bytes", "export")
    return record


def check_aot(aot_dir: Path, export_dir: Path) -> dict:
    """``aot.json`` (sealed, with its files) against the export it was built from."""
    record = read_aot(Path(aot_dir))
    export = read_export(Path(export_dir), files=False)
    if record["from"] != export["files"]:
        raise disagrees(Path(aot_dir) / AOT, Path(export_dir) / EXPORT, "it was built from other bytes "
                        f"({first_difference(record['from'], export['files'])})", "aot")
    return record


# --- the card and the report -----------------------------------------------------------------------
def check_card(path: Path, model: str, settings: dict, source: Path, vocab: Path, toolchain: Path,
               exports: list[Path], gates: list[Path], curated: Path | None) -> None:
    """The card (sealed) is the card rendered again from its inputs, byte for byte (its build date,
    from SOURCE_DATE_EPOCH when it was built, is taken as it is: any date or none)."""
    read_card(path)
    text = Path(path).read_text(encoding="utf-8")
    fresh = card.card_text(model, settings, Path(source), Path(vocab), Path(toolchain), exports, gates, curated, DATE)
    plain = card.card_text(model, settings, Path(source), Path(vocab), Path(toolchain), exports, gates, curated, None)
    body = re.escape(unseal_card(fresh)).replace(re.escape(DATE), r"\d{4}-\d{2}-\d{2}")
    if text != plain and not re.fullmatch(body, unseal_card(text)):
        raise disagrees(path, first_line_difference(text, plain, gates), "it is not the card they render", "card")


def first_line_difference(text: str, fresh: str, inputs: list[Path]) -> str:
    """The inputs, and the first line where ``text`` and ``fresh`` differ (for the error)."""
    a, b = text.splitlines(), fresh.splitlines()
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    where = ", ".join(map(str, inputs)) if len(inputs) <= 2 else f"{inputs[0]} and the other inputs"
    return f"{where} (line {n + 1})"


def check_report(path: Path, model: str, inputs: dict) -> None:
    """The build report (sealed) is the page rendered again from its inputs, byte for byte."""
    read_report(path)
    fresh, _ = report.report_text(model, inputs)
    if Path(path).read_text(encoding="utf-8") != fresh:
        gates = [Path(p) for p in inputs["gates"]] + [Path(inputs["card"])]
        raise disagrees(path, first_line_difference(Path(path).read_text(encoding="utf-8"), fresh, gates),
                        "it is not the page they render", "report")


# --- the vocab stage's tables ----------------------------------------------------------------------
def check_vocab(vocab_dir: Path, model: str, settings: dict, source: Path) -> dict:
    """The vocab stage's output (its record checked first: :func:`records.read_vocab`) is what the
    model's tokenizer kind bakes from ``source`` (its tokenizer file; World: the pinned vocabulary
    of ``settings["vocab"]``) with the settings in force (``settings``: a stage's, holding
    ``models.<model>`` and ``vocab``), file for file and byte for byte. Returns the vocab record's files."""
    recorded = read_vocab(vocab_dir)
    spec = settings["models"][model]
    kind = families.tokenizer_of(spec)
    bake = {**settings["vocab"], tokenizers.EOS_KEY: spec.get(tokenizers.EOS_KEY)}

    def baked() -> dict:
        with tempfile.TemporaryDirectory(prefix=".vocab-derived.") as tmp:
            fresh_dir = Path(tmp) / "vocab"
            tokenizers.kind(kind).bake_stage(Path(source), fresh_dir, bake)
            return tree_manifest(fresh_dir)
    # baked once per process for the vocab and the publish stage of a model (fsutil.remembered)
    fresh = remembered(("vocab", kind, json.dumps(bake, sort_keys=True, default=str)), [source], baked)
    bad = first_difference(recorded, fresh)
    if bad:
        what = ("is not among the files" if bad not in fresh else "is missing from the files" if bad not in recorded
                else "differs from the table")
        raise disagrees(Path(vocab_dir) / bad, source, f"{what} the {kind} tokenizer kind bakes from the tokenizer "
                        "file it was made from (a table edited and its vocab.record.json sealed again?)", "vocab")
    return recorded


# --- the doctor's results --------------------------------------------------------------------------
def check_doctor(path: Path, family: str, source: Path, export_dir: Path) -> dict:
    """A doctor JSON (sealed) against what it derives from: it linted exactly the family's graph
    sources, the source directory and this export's bundle; each report's judgement for the
    recipe (``applies``, ``not_applicable``, its exit status: stages.doctor.judge) and the counts
    and worst exit status are made again from coreai doctor's findings and the export's
    ``export.json``; the result passes (below coreai doctor's fail status). coreai doctor's own
    findings are taken as recorded (as the gate's TSV rows are: docs/provenance.md)."""
    import copy

    from recurrent_coreai.pipeline.records import read_doctor
    from recurrent_coreai.stages import doctor

    path = Path(path)
    recorded = read_doctor(path)
    export = read_export(Path(export_dir), files=False)
    # what it linted, by name (the paths are as the doctor job was given them, relative or not)
    targets = [*(Path(p).name for p in families.get(family).doctor_sources()), Path(source).name, export["bundle"]]
    reports = recorded.get("reports") or []
    linted = [Path(str(r.get("target"))).name for r in reports]
    if linted != targets:
        raise disagrees(path, Path(export_dir) / EXPORT, f"it linted {linted}, not {targets}", "doctor")
    fresh = doctor.summary([doctor.as_reported(copy.deepcopy(r)) for r in reports], export)
    plain = {k: v for k, v in recorded.items() if k not in (SEAL, "toolchain_contract", "tool")}
    _compare(path, path, plain, {k: v for k, v in fresh.items() if k != "tool"}, "doctor")
    if fresh["exit_status"] >= doctor.FAIL_STATUS:
        raise disagrees(path, path, f"its findings fail recipe {export['recipe']} (exit status {fresh['exit_status']})",
                        "doctor")
    return recorded


# --- the code each stage ran ------------------------------------------------------------------------
def check_code_groups(out_dir: Path, names: list[str]) -> None:
    """The ``code`` stage's group files are the md5s of the code in the checkout (pipeline/code_groups.py)."""
    bad = code_groups.stale(out_dir, names)
    if bad:
        raise PipelineError(Path(out_dir) / f"{bad[0]}{code_groups.SUFFIX}", "is not the md5 list of its code set's "
                            "files now (the code changed while it was recorded, or the file was edited)",
                            f"write it again: dvc repro {code_groups.STAGE}")


# --- what publish reads, what DVC records ----------------------------------------------------------
def check_publish_inputs(model: str, settings: dict, source: Path, card_path: Path, vocab: Path, toolchain: Path,
                         exports: list[Path], gates: list[Path], aots: list[Path], reference: Path | None,
                         doctors: list[Path] = ()) -> None:
    """Every derived record the publish stage stages or reads, against what it derives from
    (``settings``: the stage_and_push settings, which hold the card's and the gate's; ``doctors``:
    each recipe's ``<recipe>.doctor.json``)."""
    by_recipe = {read_export(Path(p), files=False)["recipe"]: Path(p) for p in exports}
    for path in doctors:
        recipe = Path(path).name.removesuffix(".doctor.json")
        if recipe in by_recipe:
            check_doctor(Path(path), settings["models"][model]["family"], source, by_recipe[recipe])
    for path in gates:
        recipe = read_gate(Path(path))["recipe"]
        check_gate(Path(path), cfgmod.gate_settings(settings, recipe), by_recipe.get(recipe), reference)
    for path in aots:
        recipe = check_seal(Path(path) / AOT, "aot")["recipe"]
        if recipe in by_recipe:
            check_aot(Path(path), by_recipe[recipe])
    check_vocab(vocab, model, settings, source)
    check_card(card_path, model, settings, source, vocab, toolchain, exports, gates, card.curated_card(model))


def check_gates(cfg: dict, model: str, gates: list[Path], exports: list[Path]) -> None:
    """Each gate JSON of ``model`` against its TSV, the config's settings for its recipe and its
    recipe's export among ``exports`` (what a card or a report is rendered from: a card re-rendered
    from an edited gate JSON agrees with it, so the gate itself is checked too)."""
    by_recipe = {read_export(Path(p), files=False)["recipe"]: Path(p) for p in exports}
    for path in gates:
        recipe = read_gate(Path(path))["recipe"]
        s = cfgmod.settings(cfg, "gate", model=model, recipe=recipe)
        check_gate(Path(path), cfgmod.gate_settings(s, recipe), by_recipe.get(recipe))


def cmd_args(cmd: str) -> tuple[str, dict[str, list[str]]]:
    """A stage's command line (dvc.yaml ``cmd``): (the script's stage name, ``{option: values}``)."""
    words = shlex.split(cmd)
    script = next((Path(w).stem for w in words if w.startswith("scripts/") and w.endswith(".py")), "")
    args: dict[str, list[str]] = {}
    key = None
    for w in words[words.index(f"scripts/{script}.py") + 1:] if script else []:
        if w.startswith("--"):
            key = w[2:].replace("-", "_")
            args[key] = []
        elif key:
            args[key].append(w)
    return script, args


def config_in_force(path: str | Path) -> dict:
    """config.load of ``path``, parsed and validated once per process while the file is unchanged
    (the DVC record checks ~100 stages against one config); a copy, so no caller changes another's."""
    return copy.deepcopy(_loaded(str(path), file_state(os.stat(path))))


@functools.lru_cache(maxsize=4)
def _loaded(path: str, state: tuple) -> dict:
    return cfgmod.load(path)


def check_stage(stage: dict) -> None:
    """What scripts/dvc_record.py checks of a stage it would record (after the seals of its outs):
    each derived record among its outs against the inputs its command names."""
    script, a = cmd_args(stage.get("cmd", ""))
    one = {k: v[0] for k, v in a.items() if v}
    if script == "code_groups":
        check_code_groups(Path(one["out"]), [Path(o).name.removesuffix(code_groups.SUFFIX) for o in stage.get("outs", [])])
    elif script == "export":
        check_export(Path(one["out"]))
    elif script == "aot":
        check_aot(Path(one["out"]), Path(one["export"]))
    elif script == "doctor":
        cfg = config_in_force(one.get("config_file", cfgmod.DEFAULT_FILE))
        check_doctor(Path(one["out"]), cfgmod.model(cfg, one["model"])["family"], one["checkpoint"], Path(one["export"]))
    elif script == "vocab":
        cfg = config_in_force(one.get("config_file", cfgmod.DEFAULT_FILE))
        check_vocab(Path(one["out"]), one["model"], cfgmod.settings(cfg, "vocab", model=one["model"]), Path(one["source"]))
    elif script in ("gate", "card", "report", "publish"):
        cfg = config_in_force(one.get("config_file", cfgmod.DEFAULT_FILE))
        if script == "gate":
            s = cfgmod.settings(cfg, "gate", model=one["model"], recipe=one["recipe"])
            check_gate(Path(one["json"]), cfgmod.gate_settings(s, one["recipe"]), Path(one["export"]),
                       Path(one["reference"]))
        if script in ("card", "report"):  # what they render: each gate checked against its TSV first
            check_gates(cfg, one["model"], list(map(Path, a["gates"])), list(map(Path, a["exports"])))
        if script == "card":
            check_card(Path(one["out"]), one["model"], cfgmod.settings(cfg, "card", model=one["model"]),
                       Path(one["source"]), Path(one["vocab"]), Path(one["toolchain"]), list(map(Path, a["exports"])),
                       list(map(Path, a["gates"])), Path(one["curated"]) if one.get("curated") else None)
        elif script == "report":
            check_report(Path(one["out"]), one["model"], {k: a[k] for k in ("gates", "tsvs", "exports", "doctors")}
                         | {"card": one["card"]})
        elif script == "publish":
            check_publish_inputs(one["model"], cfgmod.settings(cfg, "stage_and_push", model=one["model"]),
                                 Path(one["source"]), Path(one["card"]), Path(one["vocab"]), Path(one["toolchain"]),
                                 list(map(Path, a["exports"])), list(map(Path, a["gates"])),
                                 list(map(Path, a.get("aots", []))), Path(one["reference"]) if one.get("reference") else None,
                                 list(map(Path, a.get("doctors", []))))
