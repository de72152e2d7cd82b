"""``python -m recurrent_coreai status``: one row per model and recipe -- built, gated, published,
stale -- read from the records in ``results/``, from ``dvc.yaml`` (which stages) and from
``dvc.lock`` (what they ran) only: no rebuild, no Snakemake, no DVC, no torch.

* built: the recipe's ``export.json`` exists (its bundle size).
* gate: the gate JSON's verdict, top-1 agreement outside near-ties and max|dlogits|
  (``FAIL`` from ``<recipe>.failed.json`` when the last gate failed: where both are there, the
  newer one is the last verdict).
* published: the commit of ``publish.json`` (``push.commit``), ``staged`` when the receipt
  exists without a push, ``no`` otherwise.
* stale: what changed since the build. ``config: gate (<keys>)``: the gate JSON records other gate
  settings (thresholds, near-tie epsilon, prompts) than the config in force gives its model and
  recipe, so its verdict is not this config's (publish would refuse it); ``toolchain``: an
  installed version differs from ``results/toolchain.json``; ``code: <rule>``: the code a stage
  the row depends on ran has changed since ``dvc.lock`` recorded it: the stage's code set file
  (``results/code/<group>.md5``, pipeline/code_groups.py: the files of fingerprint.code_files,
  which Snakemake's ``params: code`` hashes) has another md5 now or is gone, or a file it lists
  has another md5 than it lists. A stage that starts importing another module must change one of
  its listed files to do so, so the listed md5s cover the file set too (re-deriving
  fingerprint.code_files would parse every module, ~1.5 s). A dvc.lock of before the code sets,
  whose stages list their code files themselves, is read the same way.

The stages a row depends on come from the committed ``dvc.yaml`` -- the project's one job
listing (pipeline/dag.py generates it from Snakemake's DAG) -- read as a graph of deps and outs
(:func:`row_stages`): every stage on a path from the row's export to the model's published
bundle (export, aot on every target, gate, doctor, card, stage_and_push), and every stage the
row's own ones (all of those but the ones shared with the model's other recipes: card,
stage_and_push) depend on, transitively (toolchain, source, vocab, reference, and whatever
stage the DAG puts before them). Not the report page: the published bundle does not depend on
it. The rerun hint of a record names the stage dvc.yaml says writes it. A built row that
dvc.yaml has no stages for reads ``unknown: not in dvc.yaml``, with one line naming dvc.yaml
and the fix (regenerate it) when config.yaml builds that model.

A record it cannot read -- a gate JSON, ``export.json``, ``publish.json`` or ``toolchain.json``
that is truncated, binary, not a JSON object or missing a key; a ``dvc.lock`` or ``dvc.yaml``
that is not the YAML DVC writes (or no ``dvc.yaml``) -- is never shown as "not built": its cell
reads ``corrupt`` (the stale column ``unknown: dvc.lock corrupt``, ``unknown: dvc.yaml corrupt``,
``unknown: no dvc.yaml``). A gate JSON that is gone while ``publish.json`` records the recipe
as gated is not "not gated" either: its cell reads ``missing``, its line goes to stderr. Status prints the whole table first, then ONE line per corrupt
record on stderr (``error: <file>: <what> -- fix: <the stage to rerun>``) and exits 1: one run
shows every broken record and every healthy row, instead of one per rerun.

``status | head -3``: once the reader has closed the pipe, the rest of the table is dropped
quietly and the exit is 0 (1 if there were corrupt records: those lines go to stderr).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import sys
from dataclasses import dataclass, field
from pathlib import Path

from recurrent_coreai.tools.one_line_parser import OneLineParser
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline import code_groups, dag, records
from recurrent_coreai.coreai import toolchain
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.pipeline.fingerprint import ROOT
from recurrent_coreai.pipeline.paths import Layout

PROG = "python -m recurrent_coreai status"
CODE_DIRS = ("recurrent_coreai/", "scripts/")
COLUMNS = ("model", "recipe", "built", "gate", "top-1", "max|dlogits|", "published", "stale")
CORRUPT = "corrupt"
MISSING = "missing"  # a record a later one says was written (the receipt's gated recipe)
NUMBER = (int, float)
# the keys status reads from each record, and their JSON types
GATE_KEYS = {"pass": bool, "agree_counted": int, "counted": int, "max_abs_dlogits": NUMBER}
EXPORT_KEYS = {"size_bytes": int}
RECEIPT_KEYS = {"gates": dict}
TOOLCHAIN_KEYS = {"versions": dict}
LOCK_FIX = "restore it (git checkout -- dvc.lock); the next snakemake run records its stages into it again"
LISTING = "dvc.yaml"
REGENERATE = "regenerate it from the Snakefile and config.yaml: python scripts/gen_dvc.py"


@dataclass
class Rerun:
    """The stage that writes a record: its DVC name (None when dvc.yaml names none) and the
    output ``snakemake --force`` rebuilds."""
    stage: str | None
    output: Path

    def fix(self) -> str:
        if self.stage is None:
            return f"rerun the stage that writes it: snakemake --cores 1 --force {self.output}"
        return f"rerun its stage {self.stage}: snakemake --cores 1 --force {self.output}"


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def read_record(path: Path, keys: dict, rerun: Rerun) -> dict | None:
    """A JSON record with ``keys`` of the given types; None when there is none; a PipelineError
    naming the file and the stage to rerun when it is not such a record."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise PipelineError(path, f"is not a JSON record (binary, {len(data)} bytes)", rerun.fix()) from None
    except json.JSONDecodeError as exc:
        what = "is empty" if not data.strip() else f"is not valid JSON (truncated? {exc.msg}: byte {exc.pos} of {len(data)})"
        raise PipelineError(path, what, rerun.fix()) from None
    if not isinstance(record, dict):
        raise PipelineError(path, f"is {_kind(record)}, not a JSON object", rerun.fix())
    if isinstance(record.get(records.SEAL), dict):  # the integrity chain: the bytes its stage wrote
        problem = records.seal_problem(data, record)
        if problem is not None:
            stage = record[records.SEAL].get("stage", "its")
            raise PipelineError(path, f"differs from what the {stage} stage recorded{problem}", rerun.fix())
    for key, kind in keys.items():
        if key not in record:
            raise PipelineError(path, f"has no {key!r}", rerun.fix())
        if not isinstance(record[key], kind) or (kind is not bool and isinstance(record[key], bool)):
            raise PipelineError(path, f"{key!r} is {_kind(record[key])} ({json.dumps(record[key])[:40]})",
                                rerun.fix())
    return record


def md5_of(path: Path) -> str | None:
    try:
        return hashlib.md5(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def read_lock(path: Path) -> dict[str, dict[str, str]] | None:
    """``{stage: {code file: md5}}`` from dvc.lock (only the code deps), or None without a lock."""
    try:
        lock = dag.load_yaml_file(path, LOCK_FIX) or {}
    except FileNotFoundError:
        return None
    if not isinstance(lock, dict):
        raise PipelineError(path, f"is not a DVC lock file (its top level is {_kind(lock)}, not a mapping)", LOCK_FIX)
    stages = lock.get("stages", {})
    if not isinstance(stages, dict):
        raise PipelineError(path, f"is not a DVC lock file (its stages are {_kind(stages)}, not a mapping)", LOCK_FIX)
    out = {}
    for name, st in stages.items():
        deps = st.get("deps", []) if isinstance(st, dict) else None
        if not isinstance(deps, list) or not all(isinstance(d, dict) and isinstance(d.get("path"), str) for d in deps):
            raise PipelineError(path, f"stage {name!r} is not as DVC writes it (deps without a path)", LOCK_FIX)
        out[name] = {d["path"]: d.get("md5") for d in deps if d["path"].startswith(CODE_DIRS) or is_group_file(d["path"])}
    return out


def is_group_file(rel: str) -> bool:
    """A code set's file (pipeline/code_groups.py: ``<results>/code/<group>.md5``), a stage's dep for its code."""
    p = posixpath.split(rel)
    return p[1].endswith(code_groups.SUFFIX) and posixpath.basename(p[0]) == code_groups.FOLDER


def toolchain_changes(built: dict | None) -> list[str]:
    """``pkg old->new`` for every version that differs from the built tree's toolchain.json."""
    if built is None:
        return []
    now = toolchain.versions()
    versions = built["versions"]
    return [f"{k} {versions.get(k)}->{now.get(k)}" for k in sorted(set(versions) | set(now))
            if versions.get(k) != now.get(k)]


class CodeCheck:
    """Which recorded stages ran code that has changed since (each file hashed once)."""

    def __init__(self, lock: dict[str, dict[str, str]], root: Path):
        self.lock, self.root, self._md5 = lock, root, {}

    def md5(self, rel: str) -> str | None:
        if rel not in self._md5:
            self._md5[rel] = md5_of(self.root / rel)
        return self._md5[rel]

    def changed(self, stage: str) -> bool | None:
        """True if a code file of the stage changed, None if dvc.lock does not record the stage. A
        stage records its code set's file (pipeline/code_groups.py): written again since (another
        md5, or gone), its code changed; else each file it lists is compared with its md5 there."""
        recorded = self.lock.get(stage)
        if recorded is None:
            return None
        return any(self.md5(rel) != md5 or (is_group_file(rel) and self.group_changed(rel)) for rel, md5 in recorded.items())

    def group_changed(self, rel: str) -> bool:
        try:
            listed = code_groups.recorded_md5s((self.root / rel).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return True
        return any(self.md5(code) != md5 for code, md5 in listed.items())


def row_stages(graph: dag.StageGraph, export: str, gate: str, publish: str,
               _through: dict[str, set[str]] | None = None) -> set[str] | None:
    """The dvc.yaml stages a row's freshness depends on, from the graph alone; ``export``,
    ``gate`` and ``publish`` are the row's export, its gate JSON and the model's published
    bundle, as dvc.yaml writes paths. None when dvc.yaml has no stage writing one of them.

    ``through``: every stage on a path from the row's export to the published bundle (export,
    aot on each target, gate, doctor, card, stage_and_push). The row's own stages are those not
    also on such a path from another export beside it (the model's other recipes), plus the
    stage writing its gate JSON; the row is ``through`` and everything the own stages depend
    on, transitively. (The shared card and stage_and_push count, but not what they read of the
    other recipes.) ``_through`` caches ``through`` per export stage across a model's rows."""
    found = [graph.writer(path) for path in (export, gate, publish)]
    if None in found:
        return None
    (export_stage, export_out), (gate_stage, _), (publish_stage, _) = found
    cache = {} if _through is None else _through

    def through(stage: str) -> set[str]:
        if stage not in cache:
            cache[stage] = graph.between({stage}, {publish_stage})
        return cache[stage]

    beside = {stage for out, stage in graph.writers_under(posixpath.dirname(export_out)).items()
              if stage != export_stage and not out.startswith(export_out + "/")}
    shared = set().union(*(through(stage) for stage in beside))
    mine = through(export_stage)
    return mine | graph.upstream((mine - shared) | {gate_stage})


class Listing:
    """dvc.yaml's stages, found by the paths of a results tree under ``root`` (None, with why,
    when dvc.yaml is missing or corrupt)."""

    def __init__(self, root: Path):
        self.root, self.graph, self.why = root, None, None
        self._through: dict[str, set[str]] = {}

    def load(self) -> None:
        path = self.root / LISTING
        try:
            self.graph = dag.read_listing(path)
        except PipelineError:
            self.why = f"{LISTING} corrupt" if path.exists() else f"no {LISTING}"
            raise

    def rel(self, path: Path) -> str | None:
        """``path`` as dvc.yaml writes it (relative to the root, '/'); None outside the root."""
        rel = Path(os.path.relpath(path, self.root)).as_posix()
        return None if rel == ".." or rel.startswith("../") else rel

    def rerun(self, record: Path, output: Path) -> Rerun:
        """The stage dvc.yaml says writes ``record`` and its out; else ``output``, unnamed."""
        rel = self.rel(record) if self.graph is not None else None
        found = self.graph.writer(rel) if rel is not None else None
        return Rerun(found[0], self.root / found[1]) if found else Rerun(None, output)

    @staticmethod
    def anchors(lay: Layout, recipe: str) -> tuple[Path, Path, Path]:
        """What :func:`row_stages` finds a row by: its export, its gate JSON, the published bundle."""
        return lay.export(recipe), lay.gate_json(recipe), lay.publish

    def row(self, lay: Layout, recipe: str) -> set[str] | str:
        """The stage names of a row, or why they are unknown."""
        if self.graph is None:
            return self.why
        paths = [self.rel(p) for p in self.anchors(lay, recipe)]
        if None in paths:
            return f"results outside --root, not in {LISTING}"
        stages = row_stages(self.graph, *paths, _through=self._through)
        return f"not in {LISTING}" if stages is None else stages

    def unlisted_problem(self, results: Path, lay: Layout, name: str, recipes: list[str]) -> PipelineError:
        """The one line for built recipes of a model the config builds that dvc.yaml has no stages for."""
        which = f"{name}'s recipe{'s' * (len(recipes) > 1)} {', '.join(recipes)}"
        paths = [self.rel(p) for p in self.anchors(lay, recipes[0])]
        if None in paths:
            return PipelineError(results, f"is outside {self.root}, so {LISTING} there does not list the stages of "
                                 f"{which}", "give the repository root the tree was built in (--root)")
        unwritten = next(p for p in paths if self.graph.writer(p) is None)
        return PipelineError(self.root / LISTING, f"has no stages for {which} (no stage writes {unwritten}), "
                             "which the config builds", REGENERATE)


def _stale(stages: set[str] | str, tool: list[str], code: CodeCheck | str | None) -> str:
    reasons = [f"toolchain ({', '.join(tool)})"] if tool else []
    if isinstance(stages, str):
        reasons.append(f"unknown: {stages}")
    elif code is None or isinstance(code, str):
        reasons.append(f"unknown: {code or 'no dvc.lock'}")
    else:
        # not the `code` stage itself: it lists every stage's code; each stage's own code set file says what it ran
        checks = {stage: code.changed(stage) for stage in stages if stage != code_groups.STAGE}
        changed = sorted({dag.stage_rule(stage) for stage, c in checks.items() if c})
        unrecorded = sorted({dag.stage_rule(stage) for stage, c in checks.items() if c is None})
        reasons += [f"code: {', '.join(changed)}"] if changed else []
        reasons += [f"not in dvc.lock: {', '.join(unrecorded)}"] if unrecorded else []
    return "; ".join(reasons) or "no"


GATE_SETTINGS = ("thresholds", "near_tie_epsilon", "prompts")  # what a gate JSON records of the settings it ran


def gate_config_changes(cfg: dict, model: str, recipe: str, gate: dict) -> list[str]:
    """The gate settings ``gate`` (a gate JSON) records that the config in force gives otherwise for
    its model and recipe (``thresholds``, ``near_tie_epsilon``, ``prompts``; a key the record does
    not hold is not compared)."""
    try:
        now = cfgmod.gate_settings(cfgmod.settings(cfg, "gate", model=model, recipe=recipe), recipe)
    except (KeyError, PipelineError):  # a recipe the config has no thresholds for: nothing to compare
        return []
    return [key for key in GATE_SETTINGS if key in gate and gate[key] != now.get(key)]


def last_gate(json_path: Path) -> Path:
    """The gate record that holds the last verdict: ``<recipe>.failed.json`` where it is newer than
    ``<recipe>.json`` (or alone), else ``<recipe>.json``."""
    failed = json_path.with_suffix(".failed.json")
    try:
        newer = failed.stat().st_mtime_ns >= json_path.stat().st_mtime_ns
    except FileNotFoundError:
        newer = not json_path.exists()
    return failed if newer and failed.exists() else json_path


def _published(receipt: dict | None, recipe: str) -> str:
    if not receipt or recipe not in receipt["gates"]:
        return "no"
    push = receipt.get("push")
    push = push if isinstance(push, dict) else {}
    return push["commit"] if push.get("pushed") and push.get("commit") else "staged"


@dataclass
class Survey:
    """The table, and a PipelineError per record that could not be read."""
    rows: list[dict[str, str]] = field(default_factory=list)
    problems: list[PipelineError] = field(default_factory=list)

    def read(self, path: Path, keys: dict, rerun: Rerun) -> dict | str | None:
        """The record, None without one, or CORRUPT (and the error noted)."""
        try:
            return read_record(path, keys, rerun)
        except PipelineError as exc:
            self.problems.append(exc)
            return CORRUPT


def survey(cfg: dict, root: Path = ROOT) -> Survey:
    """The status of every model to build (and every model with something in results/)."""
    out = Survey()
    results = root / cfg["results"]
    listing = Listing(root)
    try:
        listing.load()
    except PipelineError as exc:
        out.problems.append(exc)
    try:
        lock = read_lock(root / "dvc.lock")
        code = CodeCheck(lock, root) if lock is not None else None
    except PipelineError as exc:
        out.problems.append(exc)
        code = "dvc.lock corrupt"
    lay0 = Layout(results, "")
    built_tc = out.read(lay0.toolchain, TOOLCHAIN_KEYS, listing.rerun(lay0.toolchain, lay0.toolchain))
    tool = ["toolchain.json corrupt"] if built_tc == CORRUPT else toolchain_changes(built_tc)
    to_build = set(cfgmod.models_to_build(cfg))
    names = sorted(to_build | {m for m in cfg["models"] if (results / m).is_dir()})
    for name in names:
        model, lay = cfg["models"][name], Layout(results, name)
        receipt = out.read(lay.publish / "publish.json", RECEIPT_KEYS,
                           listing.rerun(lay.publish / "publish.json", lay.publish))
        unlisted = []  # built recipes that dvc.yaml has no stages for
        for recipe in model["recipes"]:
            export = out.read(lay.export(recipe) / "export.json", EXPORT_KEYS,
                              listing.rerun(lay.export(recipe) / "export.json", lay.export(recipe)))
            gate_rerun = listing.rerun(lay.gate_json(recipe), lay.gate_json(recipe))
            gate = out.read(last_gate(lay.gate_json(recipe)), GATE_KEYS, gate_rerun)
            if gate is None and isinstance(receipt, dict) and recipe in receipt["gates"]:
                # the publish receipt says this recipe was gated: its gate record is missing, not "not gated"
                out.problems.append(PipelineError(lay.gate_json(recipe), f"is missing, but {lay.publish / 'publish.json'} "
                                                  f"records recipe {recipe} as gated", gate_rerun.fix()))
                gate = MISSING
            stale = "-"
            if export is not None:  # built (or its record corrupt): what changed since
                stages = listing.row(lay, recipe)
                unlisted += [recipe] if isinstance(stages, str) and listing.graph is not None else []
                stale = _stale(stages, tool, code)
                changed = gate_config_changes(cfg, name, recipe, gate) if isinstance(gate, dict) else []
                if changed:
                    stale = "; ".join([f"config: gate ({', '.join(changed)})"] + ([] if stale == "no" else [stale]))
            row = {"model": name, "recipe": recipe, "built": "no", "gate": "-", "top-1": "-", "max|dlogits|": "-",
                   "published": CORRUPT if receipt == CORRUPT else _published(receipt, recipe), "stale": stale}
            if export == CORRUPT:
                row["built"] = CORRUPT
            elif export is not None:
                row["built"] = f"yes ({export['size_bytes'] / 1e6:.1f} MB)"
            if gate in (CORRUPT, MISSING):
                row["gate"] = gate
            elif gate is not None:
                row["gate"] = "pass" if gate["pass"] else "FAIL"
                row["top-1"] = f"{gate['agree_counted']}/{gate['counted']}"
                row["max|dlogits|"] = f"{gate['max_abs_dlogits']:.3g}"
            out.rows.append(row)
        # an error only for a model this config builds (regenerating dvc.yaml lists it); another
        # config's model left in results/ just says so in its rows
        if unlisted and name in to_build:
            out.problems.append(listing.unlisted_problem(results, lay, name, unlisted))
    return out


def render(table: list[dict[str, str]]) -> str:
    widths = {c: max([len(c)] + [len(r[c]) for r in table]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in COLUMNS).rstrip() for r in table]
    return "\n".join(lines)


def _print_table(text: str) -> None:
    """The table on stdout; a reader that stops early (``| head``) ends it quietly."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # what is left in the buffer must not be flushed again at exit (that would print
        # "Exception ignored ... BrokenPipeError"): stdout goes to /dev/null from here on
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


@main_guard
def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", default=cfgmod.DEFAULT_FILE, help="the config the tree was built with")
    ap.add_argument("--root", type=Path, default=Path("."),
                    help="repository root holding dvc.yaml, dvc.lock, the code and results/ (default: .)")
    ns = ap.parse_args(argv)
    if not ns.root.is_dir():
        raise PipelineError(ns.root, "--root is not a directory", "give the repository root (default: .)")
    cfg = cfgmod.load_for_tool(ns.config_file)  # a --configfile fragment: merged over config.yaml
    found = survey(cfg, ns.root)
    _print_table(render(found.rows))
    for exc in found.problems[:-1]:  # the last one goes through main_guard, like any error
        print(f"error: {exc}", file=sys.stderr)
    if found.problems:
        raise found.problems[-1]
    return 0
