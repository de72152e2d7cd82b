"""The records stages leave beside their outputs, read back by the stages after them.

* ``manifest.json`` in ``results/<m>/source/``: the source URI, revision, layout, geometry, files.
* ``export.json`` in ``results/<m>/export/<recipe>/``: recipe, bundle, states, quantisation plan, files.
* ``aot.json`` in ``results/<m>/aot/<target>/<recipe>/``: the digests of the bundle it was built
  from (``from``) and of every file it wrote (``files``, relative to that directory).
* the gate JSON: the verdict, and ``tested_files`` (what the gate ran).

The integrity chain: every stage output carries the sha256 of every byte its stage wrote, and
every consumer checks the bytes it reads against it before using them (:func:`verify_output`).

* A JSON record is SEALED: its ``"record"`` field holds the writing stage and the sha256 of the
  record's canonical text without that field, and the file must be exactly that canonical text
  (:func:`sealed_text`, :func:`check_seal`). So ``manifest.json``, ``export.json``, ``aot.json``,
  ``vocab.record.json``, ``publish.json``, the gate JSON, the doctor JSON and ``toolchain.json``
  vouch for themselves; the directory records list every other file of their directory
  (``files``; ``export.json`` the bundle's, under ``<bundle>/``).
* The gate JSON records the sha256 of the gate TSV it wrote beside it (``tsv``).
* The reference ``stream.npz`` holds ``record_sha256``: the sha256 over its arrays
  (:func:`stream_digest`).
* The card and the build report end in one seal line: an HTML comment with the sha256 of the text
  above it (:func:`seal_lines`; :func:`seal_card`/:func:`read_card`, :func:`seal_report`/:func:`read_report`).

A seal is a digest anyone can recompute, not a signature: it says a record is what its stage
wrote unless someone edited it and sealed it again. So publish and DVC's recording also check each
derived record against what it is derived from (stages/derivation.py; docs/provenance.md says what
that still leaves open).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import IGNORED, dumps_json, first_difference, tree_manifest

MANIFEST = "manifest.json"
EXPORT = "export.json"
AOT = "aot.json"
VOCAB_RECORD = "vocab.record.json"  # in the vocab stage's directory; never a tokenizer file
RECEIPT = "publish.json"
CATALOG_ENTRIES = "coreai-catalog.yaml"  # written into the publish directory after a push (hub/catalog.py)
SEAL = "record"  # the field of a sealed JSON record
STREAM_SEAL = "record_sha256"  # the array of the reference stream.npz holding its digest
# the array of stream.npz holding each prompt's token count, written only where some prompt needed
# more than its equal share of gate.steps (config.prompt_budgets); the gate shares fewer steps by it
PROMPT_TOKENS = "prompt_tokens"
SEAL_LINE = "<!-- recurrent-coreai {stage} sha256 {sha} -->\n"  # the last line of a sealed text output


def seal_line_pattern(stage: str) -> re.Pattern:
    """The seal line (:data:`SEAL_LINE`) of ``stage``'s text output, matched at the very end."""
    return re.compile(rf"<!-- recurrent-coreai {stage} sha256 (?P<sha>[0-9a-f]{{64}}) -->\n\Z")


CARD_SEAL = seal_line_pattern("card")
REPORT_SEAL = seal_line_pattern("report")


# --- the integrity chain -------------------------------------------------------------------------
def rerun_fix(rule: str) -> str:
    return f"rerun it: snakemake --cores 1 publish --forcerun {rule}"


def changed(path: str | Path, stage: str, rule: str | None = None, detail: str = "") -> PipelineError:
    """``<path>: differs from what the <stage> stage recorded -- fix: rerun it: ...``"""
    return PipelineError(path, f"differs from what the {stage} stage recorded{detail}", rerun_fix(rule or stage))


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _mac(key: bytes, text: str, stage: str) -> str:
    """HMAC-SHA256 of a record's canonical body and its stage under the records' key."""
    import hmac

    return hmac.new(key, f"{stage}\0{text}".encode(), hashlib.sha256).hexdigest()


def sealed_text(record: dict, stage: str) -> str:
    """The canonical text of ``record`` with its seal: what a stage writes as its JSON record. With
    a key in RECURRENT_COREAI_RECORD_KEY (util/env.py) the seal also holds an HMAC of it: a
    record edited and sealed again by someone without the key is refused (docs/provenance.md)."""
    from recurrent_coreai.util.env import record_key

    body = {k: v for k, v in record.items() if k != SEAL}
    text = dumps_json(body)
    seal = {"stage": stage, "sha256": _digest(text)}
    key = record_key()
    if key:
        seal["hmac"] = _mac(key, text, stage)
    return dumps_json({**body, SEAL: seal})


_SEAL_MEMO: dict[tuple[bytes, bytes | None], str | None] = {}  # (sha256 of the bytes, key) -> seal_problem
_SEAL_MEMO_MAX = 4096


def seal_problem(data: bytes, record: object) -> str | None:
    """Why ``data`` (parsed: ``record``, i.e. ``json.loads(data)``) is not a record its stage
    sealed, or None when it is (with the records' key set: sealed under that key). The answer is a
    function of the bytes and the key alone, so it is remembered per process: a recording checks
    the same gate record once per stage that reads it, and re-encoding a large record (json's
    indented encoder is pure Python) was most of a check."""
    from recurrent_coreai.util.env import record_key

    memo = (hashlib.sha256(data).digest(), record_key())
    if memo not in _SEAL_MEMO:
        if len(_SEAL_MEMO) >= _SEAL_MEMO_MAX:
            _SEAL_MEMO.clear()
        _SEAL_MEMO[memo] = _seal_problem(data, record, memo[1])
    return _SEAL_MEMO[memo]


def _seal_problem(data: bytes, record: object, key: bytes | None) -> str | None:
    import hmac

    from recurrent_coreai.util.env import RECORD_KEY_VAR

    if not isinstance(record, dict) or not isinstance(record.get(SEAL), dict):
        return ": it carries no digest from its stage (written before the integrity chain, or edited)"
    body = {k: v for k, v in record.items() if k != SEAL}
    text = dumps_json(body)
    if record[SEAL].get("sha256") != _digest(text):
        return ""
    if data != dumps_json(record).encode():
        return " (its bytes were rewritten)"
    if key and not hmac.compare_digest(str(record[SEAL].get("hmac", "")),
                                       _mac(key, text, str(record[SEAL].get("stage", "")))):
        return (f": its MAC is not one made with {RECORD_KEY_VAR} (sealed without that key, with another one, "
                "or forged)")
    return None


def check_seal(path: str | Path, stage: str, rule: str | None = None, data: bytes | None = None) -> dict:
    """A sealed JSON record, read and checked; one line naming the file and the stage otherwise."""
    path = Path(path)
    fix = rerun_fix(rule or stage)
    try:
        data = path.read_bytes() if data is None else data
    except FileNotFoundError:
        raise PipelineError(path, f"missing (the {stage} stage writes it)", fix) from None
    except IsADirectoryError:
        raise PipelineError(path, f"is a directory where the {stage} stage writes a file", fix) from None
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise changed(path, stage, rule, " (it is no longer valid JSON)") from None
    problem = seal_problem(data, record)
    if problem is not None:
        raise changed(path, stage, rule, problem)
    return record


def write_sealed(path: str | Path, record: dict, stage: str) -> None:
    """Write ``record`` sealed (``path`` is inside a stage's temporary output, or use atomic_path)."""
    Path(path).write_text(sealed_text(record, stage), encoding="utf-8", newline="\n")


def verify_files(root: Path, expected: dict[str, dict], stage: str, rule: str | None = None,
                 skip: tuple[str, ...] = ()) -> None:
    """Every file below ``root`` (but ``skip`` and bookkeeping) is exactly ``expected``, the
    ``files`` of the record ``root/skip[0]`` (named in the error beside the file: either one
    may be what changed)."""
    on_disk = {rel: v for rel, v in tree_manifest(root).items() if rel not in skip}
    bad = first_difference(on_disk, expected)
    if bad:
        detail = (" (it is missing)" if bad not in on_disk else
                  " (the stage wrote no such file)" if bad not in expected else "")
        where = f" in {Path(root) / skip[0]}" if skip else ""
        raise changed(Path(root) / bad, stage, rule, where + detail)


def stream_digest(arrays: dict) -> str:
    """sha256 over a reference stream's arrays (name, dtype, shape, bytes; sorted by name)."""
    import numpy as np

    h = hashlib.sha256()
    for name in sorted(k for k in arrays if k != STREAM_SEAL):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def read_stream(path: str | Path, required: bool = True) -> dict:
    """The reference stage's ``stream.npz`` (its arrays), checked against the digest it holds
    (``required=False``: a stream made by hand, without one, is taken as it is)."""
    import zipfile

    import numpy as np

    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise PipelineError(path, "missing (the reference stage writes it)", rerun_fix("reference")) from None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
        raise changed(path, "reference", detail=f" (unreadable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    seal = arrays.pop(STREAM_SEAL, None)
    if seal is None:
        if not required:
            return arrays
        raise changed(path, "reference", detail=": it carries no digest from its stage")
    if str(seal) != stream_digest(arrays):
        raise changed(path, "reference")
    return arrays


def seal_lines(text: str, stage: str) -> str:
    """``text`` with ``stage``'s seal: a last line holding the sha256 of everything above it."""
    return text + SEAL_LINE.format(stage=stage, sha=_digest(text))


def read_sealed_lines(path: str | Path, stage: str) -> str:
    """A text output sealed by :func:`seal_lines` (without its seal line), checked; one line naming
    the file and the stage to rerun otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PipelineError(path, f"missing (the {stage} stage writes it)", rerun_fix(stage)) from None
    except IsADirectoryError:
        raise PipelineError(path, f"is a directory where the {stage} stage writes a file", rerun_fix(stage)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise changed(path, stage, detail=" (it is no longer UTF-8 text)") from None
    m = seal_line_pattern(stage).search(text)
    if m is None:
        raise changed(path, stage, detail=": it carries no digest from its stage")
    if _digest(text[:m.start()]) != m["sha"]:
        raise changed(path, stage)
    return text[:m.start()]


def seal_card(text: str) -> str:
    """The card's text with its seal: a last line holding the sha256 of everything above it."""
    return seal_lines(text, "card")


def unseal_card(text: str) -> str:
    """The card's text without its seal (what is merged into a published card)."""
    m = CARD_SEAL.search(text)
    return text[:m.start()] if m else text


def read_card(path: str | Path) -> str:
    """The card stage's README.md (without its seal), checked."""
    return read_sealed_lines(path, "card")


def seal_report(html: str) -> str:
    """The build report's HTML with its seal (``<!-- recurrent-coreai report sha256 <hex> -->``)."""
    return seal_lines(html, "report")


def read_report(path: str | Path) -> str:
    """The report stage's ``index.html`` (without its seal), checked."""
    return read_sealed_lines(path, "report")


def read_gate(path: str | Path, tsv: bool = False) -> dict:
    """A gate JSON (passing or ``.failed.json``), checked; with ``tsv``, also the TSV beside it."""
    path = Path(path)
    record = check_seal(path, "gate")
    if tsv:
        read_gate_tsv(path.with_name((record.get("tsv") or {}).get("name", path.with_suffix(".tsv").name)), record)
    return record


def read_gate_tsv(path: str | Path, gate: dict) -> str:
    """The text of the gate TSV at ``path``, checked against the digest its gate JSON recorded
    (``gate``: that JSON, as :func:`read_gate` returns it)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise changed(path, "gate", detail=" (it is missing)") from None
    if (gate.get("tsv") or {}).get("sha256") != _digest(data):
        raise changed(path, "gate")
    return data.decode("utf-8")


def read_toolchain(path: str | Path) -> dict:
    return check_seal(path, "toolchain")


def read_doctor(path: str | Path) -> dict:
    return check_seal(path, "doctor")


def write_vocab_record(vocab_dir: Path) -> dict:
    """Seal the vocab stage's output: ``vocab.record.json`` listing every other file of it."""
    from recurrent_coreai.util.fsutil import write_text_atomic

    files = {rel: v for rel, v in tree_manifest(vocab_dir).items() if rel != VOCAB_RECORD}
    record = {"files": files}
    write_text_atomic(Path(vocab_dir) / VOCAB_RECORD, sealed_text(record, "vocab"))
    return record


def read_vocab(vocab_dir: str | Path) -> dict[str, dict]:
    """The vocab stage's files (``{name: {sha256, size}}``, its record excluded), checked."""
    vocab_dir = Path(vocab_dir)
    record = check_seal(vocab_dir / VOCAB_RECORD, "vocab")
    verify_files(vocab_dir, record["files"], "vocab", skip=(VOCAB_RECORD,))
    return record["files"]


def vocab_files(vocab_dir: str | Path) -> list[str]:
    """The tokenizer files of the vocab stage's output (its record is not one)."""
    return sorted(p.name for p in Path(vocab_dir).iterdir()
                  if p.is_file() and p.name not in IGNORED and p.name != VOCAB_RECORD)


def read_receipt(publish_dir: str | Path, extra: tuple[str, ...] = ()) -> dict:
    """``publish.json``, checked, and every staged file against it (``extra``: files written after it)."""
    publish_dir = Path(publish_dir)
    record = check_seal(publish_dir / RECEIPT, "publish", "stage_and_push")
    verify_files(publish_dir, record["files"], "publish", "stage_and_push", skip=(RECEIPT, CATALOG_ENTRIES, *extra))
    return record


def load_json(path: Path, fix: str = "rerun the stage that writes it") -> dict:
    """A JSON file; a sealed record is checked against its seal (one line naming its stage)."""
    path = Path(path)
    try:
        data = path.read_bytes()
        record = json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise PipelineError(path, "missing", fix) from None
    except UnicodeDecodeError:
        raise PipelineError(path, "is not JSON text (binary?)", fix) from None
    except json.JSONDecodeError as exc:
        raise PipelineError(path, f"invalid JSON ({exc.msg} at line {exc.lineno})", fix) from None
    if isinstance(record, dict) and isinstance(record.get(SEAL), dict):
        stage = str(record[SEAL].get("stage", "its"))
        problem = seal_problem(data, record)
        if problem is not None:
            raise changed(path, stage, "stage_and_push" if stage == "publish" else stage, problem)
    return record


def read_export(export_dir: Path, files: bool = True) -> dict:
    """``export.json``, checked, and (``files``) every file of the export directory against it."""
    export_dir = Path(export_dir)
    record = check_seal(export_dir / EXPORT, "export")
    if files:
        verify_files(export_dir, {f"{record['bundle']}/{rel}": v for rel, v in record["files"].items()},
                     "export", skip=(EXPORT,))
    return record


def read_aot(aot_dir: Path) -> dict:
    """``aot.json``, checked, and the files beside it against it."""
    record = check_seal(Path(aot_dir) / AOT, "aot")
    verify_files(Path(aot_dir), record["files"], "aot", skip=(AOT,))
    return record


def by_recipe(paths: list[Path], name: str | None = None, files: bool = True) -> dict[str, dict]:
    """Records (``export.json`` in each dir, or gate JSON files) keyed by the recipe they name,
    each checked against its stage's record (``files``: and the export directory's files)."""
    if name == EXPORT:
        records = [read_export(Path(p), files) for p in paths]
    elif name is None:
        records = [read_gate(Path(p)) for p in paths]
    else:
        records = [load_json(Path(p) / name) for p in paths]
    return {r["recipe"]: r for r in records}


def read_manifest(source_dir: Path, files: bool = True) -> dict:
    """``manifest.json``, checked, and (``files``) every file of the source directory against it."""
    source_dir = Path(source_dir)
    if not (source_dir / MANIFEST).exists() and not source_dir.exists():
        raise PipelineError(source_dir / MANIFEST, "missing", "run the source stage first")
    record = check_seal(source_dir / MANIFEST, "source")
    if files:
        verify_files(source_dir, record["files"], "source", skip=(MANIFEST,))
    return record


# --- any stage output, by what it is ---------------------------------------------------------
def verify_output(path: str | Path) -> str:
    """Check one stage output (a DVC ``out``) against its stage's record; returns the kind checked,
    or ``"unrecorded"`` for an output no stage seals (raises a PipelineError when it differs)."""
    path = Path(path)
    if path.is_dir():
        for name, reader in ((MANIFEST, read_manifest), (EXPORT, read_export), (AOT, read_aot),
                             (VOCAB_RECORD, read_vocab), (RECEIPT, read_receipt)):
            if (path / name).is_file():
                reader(path)
                return name
        raise PipelineError(path, "holds no record from the stage that writes it", "rerun that stage")
    if path.suffix == ".npz":
        read_stream(path)
        return "stream"
    if path.suffix == ".tsv":
        read_gate(path.with_suffix(".json") if path.with_suffix(".json").exists()
                  else path.with_suffix(".failed.json"), tsv=True)
        return "tsv"
    if path.name == "README.md":
        read_card(path)
        return "card"
    if path.suffix == ".html":
        read_report(path)
        return "report"
    if path.suffix == ".json" and path.name.startswith("shard-") and path.parent.parent.name == "gate":
        check_seal(path, "gate_shard")  # results/<m>/gate/<recipe>/shard-<k>.json (paths.Layout.gate_shard)
        return "gate_shard"
    if path.suffix == ".json":
        load_json(path)
        try:
            data = path.read_bytes()
            sealed = seal_problem(data, json.loads(data)) is None
        except (OSError, ValueError):
            sealed = False
        if not sealed:
            raise changed(path, "its", detail=": it carries no digest from its stage")
        return "json"
    return "unrecorded"


# The export stage's summary line in its job log (``export <model>/<recipe>: <bundle>, <size> MB
# (...) in <s> s, peak RSS <mb> MB; ...``): the one record of its cost. Not in export.json, which
# holds no timings so that rebuilds are byte-identical.
EXPORT_LINE = re.compile(r"export (?P<model>[^/\s]+)/(?P<recipe>\S+): \S+, [\d.]+ MB[^;\n]* in (?P<seconds>[\d.]+) s, "
                         r"peak RSS (?P<rss_mb>[\d.]+) MB")


def export_stats(log: Path, model: str, recipe: str) -> dict | None:
    """Export time and peak RSS from the export job's log (its last summary line); None when the
    log is missing (logs are not tracked by DVC: after a ``dvc pull`` there are none) or has no
    such line."""
    try:
        text = Path(log).read_text(errors="replace")
    except FileNotFoundError:
        return None
    hits = [m for m in EXPORT_LINE.finditer(text) if m["model"] == model and m["recipe"] == recipe]
    if not hits:
        return None
    return {"seconds": float(hits[-1]["seconds"]), "rss_mb": float(hits[-1]["rss_mb"])}
