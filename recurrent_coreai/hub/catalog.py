"""After a push: the entries that would add the model to the ``coreai-catalog`` package's catalog.

:func:`write_entries` reads the publish directory — the receipt ``publish.json`` (the commit,
every published file with sha256 and size), the staged card's front matter (license, base
model) and each bundle's ``export.json`` (functions, inputs, the two states) — and writes
``coreai-catalog.yaml`` beside the receipt: one ``artifacts.yaml`` entry (the Hugging Face repo
pinned to the upload's commit, its files) and one ``catalog.yaml`` model entry
(``architecture: recurrent``, an ``io_contract``, ``provenance.converted_by``). Nothing is guessed:
a facet the build does not know (e.g. device support without a device target) is ``unknown``.
When the repo is already in the installed catalog, the entries keep that id and the file says
it updates it. Validate with ``coreai_catalog.contribute.validate_entry`` (see tests/test_catalog.py).
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from recurrent_coreai.pipeline.config import DEVICE_ARCHITECTURES
from recurrent_coreai.coreai.entrypoints import bundle_functions
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.frontmatter import front_matter
from recurrent_coreai.util.fsutil import write_text_atomic
from recurrent_coreai import DISTRIBUTION, families, tokenizers
from recurrent_coreai.pipeline.records import EXPORT, load_json

ENTRIES = "coreai-catalog.yaml"
HUB = "https://huggingface.co"
DTYPE = {"float32": "fp32", "float16": "fp16"}
LICENSES_OK_COMMERCIALLY = {"apache-2.0", "mit", "bsd-3-clause", "bsd-2-clause"}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}GB" if n >= 1e9 else f"{n / 1e6:.1f}MB"


@functools.lru_cache(maxsize=1)
def _installed() -> tuple[dict, tuple[dict, ...]]:
    """The installed catalog's id universe and its artifacts (read once: ~3 s of YAML)."""
    from coreai_catalog.contribute import find_root, ids_context, read_yaml

    root = find_root()
    return ids_context(root), tuple(read_yaml(root / "artifacts.yaml").get("artifacts", []) or [])


def existing_artifact_id(owner: str, repo: str) -> str | None:
    """The id of an artifact already hosted at ``owner/repo`` in the installed catalog, if any."""
    for art in _installed()[1]:
        hf = art.get("huggingface") or {}
        if (hf.get("owner"), hf.get("repo")) == (owner, repo):
            return art["id"]
    return None


def _exports(out: Path, receipt: dict) -> dict[str, dict]:
    """Each published bundle's export.json (staged as ``aimodel/<bundle>/export.json``), by recipe."""
    records = [load_json(out / rel) for rel in sorted(receipt["files"])
               if rel.startswith("aimodel/") and rel.endswith("/" + EXPORT)]
    return {r["recipe"]: r for r in records}


def _parameters(family, geometry: dict) -> str:
    n = family.parameter_count(family.geometry_from_dict(geometry))
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _precision(exports: dict[str, dict]) -> tuple[str, str]:
    """(precision, quantization) over the published recipes."""
    prec, quant = [], []
    for name, rec in exports.items():
        q = rec["recipe_spec"].get("quantize")
        prec.append(f"{name}: {DTYPE.get(rec['state_dtype'], rec['state_dtype'])}"
                    + (f" + int{q['bits']}" if q else ""))
        if q:
            quant.append(f"{name}: int{q['bits']} weight-only, per-block-{q['block_size']}, "
                         f"{len(rec['quantized'])} linear layers")
    return "; ".join(prec), "; ".join(quant) or "none"


def _devices(targets: set[str]) -> dict:
    ios = bool(targets & set(DEVICE_ARCHITECTURES["iOS"]))
    mac = bool(targets & set(DEVICE_ARCHITECTURES["macOS"]))
    return {"iphone": True if ios else "unknown", "ipad": "unknown", "mac": True if mac else "unknown",
            "mac_only": False if ios else "unknown"}


def io_contract(family, exports: dict[str, dict], tokenizer_ref: str | None, tokenizer: str | None = None) -> dict:
    """The functions (export.json ``functions``: name, role, inputs and outputs with shapes) and
    the states they share (their meanings from the model's ``family``); every recipe has the same
    interface, only the dtype follows it."""
    first = next(iter(exports.values()))
    functions = {f["name"]: f for f in bundle_functions(first).values()}  # refuses an export.json without them
    dtypes = sorted({DTYPE.get(r["state_dtype"], r["state_dtype"]) for r in exports.values()})
    modality = {"input_ids": "tokens", "position_ids": "positions (accepted, unused)"}
    inputs = [{"name": f"{fn}.{t['name']}", "modality": modality.get(t["name"], "tensor"),
               "tensor": {"shape": t["shape"], "dtype": t["dtype"]}}
              for fn, f in functions.items() for t in f["inputs"]]
    once = [fn for fn, f in functions.items() if set(f["state_writes"].values()) == {1}]
    layouts = {s.name: s.meaning for s in family.state_specs(family.geometry_from_dict(first["geometry"]))}
    tok = tokenizers.kind(tokenizer or family.tokenizer)  # the model's kind (families.tokenizer_of)
    inputs += [{"name": name, "modality": "state",
                "tensor": {"shape": list(shape), "dtype": " or ".join(dtypes) + " (the recipe's)",
                           "layout": f"{layouts.get(name, name)}; zero at the start, read and written once per "
                                     f"call by {', '.join(once)}"}}
               for name, shape in first["states"].items()]
    calls = ", ".join(f"{fn} ({f['role']}, {f['tokens_per_call']} token{'s' * (f['tokens_per_call'] > 1)}/call)"
                      for fn, f in functions.items())
    contract = {
        "entrypoint": {"framework": "Core AI runtime", "type": "AIModel",
                       "init_pattern": f"AIModel.load(bundle), load_function(name) for {calls}; a prompt's full chunks "
                                       "through prefill, the rest token by token through the decode function, on the "
                                       "same two states (they mutate in place)"},
        "inputs": inputs,
        "outputs": [{"name": f"{fn}.{t['name']}", "decoding": {"detokenization": f"{tok.DESCRIPTION}; "
                                                                f"{tok.CHAT_DESCRIPTION}"}}
                    for fn, f in functions.items() for t in f["outputs"]],
        "session": {"stateful": True, "streaming": True},
    }
    if tokenizer_ref:
        contract["files"] = {"tokenizer_ref": tokenizer_ref}
    return contract


def entries(out: Path, today: dt.date | None = None) -> dict | None:
    """The artifact and model entries for the push recorded in ``out/publish.json``; None when
    nothing was pushed or the push made no commit (the Hub already held these bytes)."""
    receipt = load_json(out / "publish.json", "run the publish stage first")
    push = receipt.get("push", {})
    if not (push.get("pushed") and push.get("commit")):
        return None
    repo, commit = push["repo"], push["commit"]
    owner, name = repo.split("/", 1)
    exports = _exports(out, receipt)
    if not exports:
        raise PipelineError(out, "the receipt lists no aimodel/<bundle>/export.json", "publish again (snakemake "
                            "--forcerun stage_and_push)")
    card = front_matter(out / "README.md")
    files = {rel: v for rel, v in sorted(receipt["files"].items()) if rel != "README.md"}  # the Hub holds a merged card
    targets = {rel.split("/", 1)[0] for rel in files} - {"aimodel"}
    family = families.get(receipt["family"])
    device = set(receipt.get("tokenizer_files", []))
    # the device table beside a compiled bundle, as before the runner contract's tokenizer/ copies (issue 36)
    vocab = next((rel for rel in files if rel.rsplit("/", 1)[-1] in device and "/tokenizer/" not in rel), None)
    existing = existing_artifact_id(owner, name)
    entry_id = existing or slug(name)
    try:
        tool_version = version(DISTRIBUTION)
    except PackageNotFoundError:
        tool_version = "unknown"
    toolchain = receipt.get("toolchain", {})
    license_name = str(card.get("license", "unknown"))
    precision, quantization = _precision(exports)
    first = next(iter(exports.values()))
    url = f"{HUB}/{repo}"
    artifact = {
        "id": entry_id, "group": "external",
        "huggingface": {"owner": owner, "repo": name, "url": url, "revision": commit,
                        "files": [{"path": rel, "sha256": v["sha256"], "size_bytes": v["size"]} for rel, v in files.items()]},
        "officiality": {"apple_export_recipe": False, "apple_hosted_artifact": False, "community_packaged": True},
        "provenance": {"converted_by": {"tool": DISTRIBUTION, "version": tool_version},
                       "recipe_source": "independent",
                       "format_version": f"coreai-core {toolchain.get('coreai-core', 'unknown')}"},
        "bundle_kind": "llm", "precision": precision,
    }
    model = {
        "id": entry_id, "name": f"{receipt['model']} (Core AI, {', '.join(exports)})", "family": family.catalog_family,
        "source_group": "external", "source_path": f"{url}/tree/{commit}", "artifact_ref": entry_id,
        "capabilities": ["chat", "text-generation"], "modalities": {"input": ["text"], "output": ["text"]},
        "artifact": {"format": "aimodel", "availability": "available"},
        "size": {"parameters": _parameters(family, first["geometry"]), "precision": precision, "quantization": quantization,
                 "artifact_size": _human(sum(v["size"] for v in files.values()))},
        "runtime": {"runtime_name": "apple-core-ai", "runner": "unknown", "stock_runtime": False,
                    "custom_kernel": False, "patch_required": False, "tokenizer_required": True,
                    "processor_required": False, "aot_required": False},
        "device_support": _devices(targets),
        "license": {"name": license_name,
                    "commercial_use": "likely" if license_name.lower() in LICENSES_OK_COMMERCIALLY else "check_license"},
        "status": "needs_review", "maturity": "experimental", "confidence": "needs_review",
        "sources": ["rwkv-upstream"], "last_verified": (today or dt.date.today()).isoformat(),
        "architecture": "recurrent", "streaming": True, "bundle_kind": "llm",
        "io_contract": io_contract(family, exports, vocab, families.tokenizer_of(receipt)),
        "notes": (f"{family.display_name} built by {DISTRIBUTION} {tool_version}: every bundle passed a teacher-forced parity "
                  f"gate against an fp32 PyTorch reference ({'; '.join(_gate_line(r, g) for r, g in receipt['gates'].items())}). "
                  f"Recurrent: {len(first['states'])} fixed-size states, no KV cache."),
    }
    if card.get("base_model"):
        model["upstream_repo"] = str(card["base_model"])
    return {"action": "update" if existing else "add", "artifact": artifact, "model": model}


def _gate_line(recipe: str, gate: dict) -> str:
    return f"{recipe} {gate['agree_counted']}/{gate['counted']} top-1, max|dlogits| {gate['max_abs_dlogits']:.3g}"


def validate(found: dict) -> list[str]:
    """coreai-catalog's own validation of both entries (schema, cross-references, and for an
    addition duplicate ids), as one contribution: the model entry may refer to the new artifact.
    One line per error; empty when valid."""
    from coreai_catalog.contribute import format_error, validate_entry

    new = found["action"] == "add"
    context = dict(_installed()[0])
    errors = validate_entry("artifact", found["artifact"], context=context, check_duplicate_id=new)
    context["artifact_ids"] = context["artifact_ids"] | {found["artifact"]["id"]}
    errors += validate_entry("model", found["model"], context=context, check_duplicate_id=new)
    return [format_error(e) for e in errors]


def write_entries(out: Path, today: dt.date | None = None) -> Path | None:
    """``out/coreai-catalog.yaml`` after a push that made a commit (see :func:`entries`), checked with
    coreai-catalog's validator; None (and a log line saying why) otherwise. Called after the upload
    succeeded, so it never fails the stage: a problem is a warning in the log."""
    from recurrent_coreai.pipeline import stage

    try:
        found = entries(out, today)
        if found is None:
            stage.log.info("coreai-catalog: no entry: the push made no commit")
            return None
        errors = validate(found)
    except (PipelineError, ImportError) as exc:
        stage.log.warning("coreai-catalog: no entry written: %s", exc)
        return None
    checked = f"coreai-catalog {version('coreai-catalog')}"
    verdict = f"valid for {checked}" if not errors else f"{len(errors)} {checked} validation error(s), listed below"
    header = (f"# coreai-catalog entries ({found['action']}, {verdict}): append `artifacts` to artifacts.yaml and\n"
              f"# `models` to catalog.yaml of the coreai-catalog repository. Written by recurrent-coreai after the push.\n"
              + "".join(f"# error: {e}\n" for e in errors))
    body = yaml.safe_dump({"artifacts": [found["artifact"]], "models": [found["model"]]}, sort_keys=False,
                          allow_unicode=True, width=100)
    path = out / ENTRIES
    write_text_atomic(path, header + body)
    for e in errors:
        stage.log.warning("coreai-catalog: %s", e)
    stage.log.info("coreai-catalog: %s entries for %s@%s (%s) -> %s", found["action"], found["artifact"]["huggingface"]
                   ["repo"], found["artifact"]["huggingface"]["revision"], verdict, path)
    return path
