"""The runner contract: what an app needs to drive a published bundle, beside the bundle, as data.

Every published bundle folder (``aimodel/<bundle>/``, ``<target>/<bundle>/``) holds:

* ``metadata.json`` -- Apple's bundle metadata, schema ``0.2``, as apple/coreai-models' exporter
  writes it (``python/src/coreai_models/export/bundle.py``) and its Swift side reads it
  (``ModelBundle``, ``LanguageBundle``, ``LanguageConfig``): ``metadata_version``, ``kind: llm``,
  ``name``, ``assets.main`` (the bundle file in this folder), ``language`` (``tokenizer``,
  ``vocab_size``, ``max_context_length``, ``embedded_tokenizer``, ``function_map``, and the optional
  ``states``: every state ``fixed``), ``source``, ``compression``, ``compilation``; ``user_data``
  (string to string) names the contract file. Our values: ``max_context_length: null`` (a no-KV
  model has no context limit; Apple's Swift ``LanguageConfig`` decodes this key as a required
  ``Int`` and refuses null: docs/app.md), ``function_map`` ``{"main": ["main"], "prefill":
  ["prefill"]}``, ``compilation.date: null`` (the published tree is reproducible: no clock).
* ``runner.json`` -- what a no-KV runner needs and Apple's schema has no field for (format
  ``recurrent-coreai-runner/1``): every state's name, shape, dtype and initial value; the
  inputs, outputs and tokens per call of ``main`` and ``prefill``; the prefill chunk; the
  tokenizer kind, its files, its digest, the start (BOS) ids and the end-of-text (EOS) id; the chat
  format and its stop strings; the bundle's digest (what a state file must name).
* ``tokenizer/`` -- the vocab stage's files: the device TSV (id TAB base64 bytes) and, where the
  kind has one, the Hugging Face ``tokenizer.json`` (the folder Apple's ``LanguageBundle`` reads).

``generate`` drives every bundle from this contract (:func:`session_record`, :func:`identity`,
``tools/generate.py``), built from the stage records for ``--model``/``--recipe`` or read from a
published folder with ``--bundle``: the contract is tested by our own runner.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

from recurrent_coreai import families, tokenizers
from recurrent_coreai.coreai import state_file
from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, bundle_functions
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import dumps_json

FORMAT = "recurrent-coreai-runner/1"
CONTRACT, METADATA, TOKENIZER_DIR = "runner.json", "metadata.json", "tokenizer"
METADATA_VERSION = "0.2"
MAX_CONTEXT_LENGTH = None  # unbounded: the states are fixed-size (Apple's Swift reads an Int here: docs/app.md)
CHAT_STOP = ("\n\nUser:",)  # the chat format's next turn: the model would go on playing the user
HF_TOKENIZER = "tokenizer.json"
FIX = "stage it again: snakemake --cores 1 publish --forcerun stage_and_push"


def bundle_digest(export_record: Mapping) -> str:
    """The gate's ``bundle_sha256``: sha256 over the ``.aimodel``'s file manifest (export.json ``files``)."""
    return hashlib.sha256(dumps_json(export_record["files"]).encode()).hexdigest()


def tokenizer_digest(vocab_files: Mapping[str, Mapping]) -> str:
    """sha256 over the vocab stage's file manifest (its record's ``files``: name -> sha256, size)."""
    return hashlib.sha256(dumps_json(dict(vocab_files)).encode()).hexdigest()


def _tensors(items) -> list[dict]:
    return [{"name": t["name"], "shape": list(t["shape"]), "dtype": t["dtype"]} for t in items]


def build(model: str, export_record: Mapping, vocab_dir: Path, vocab_files: Mapping[str, Mapping], asset: str,
          kind: str, family: str | None = None, tokenizer=None) -> dict:
    """The contract of the bundle ``export_record`` describes, published as ``asset`` beside the
    vocab stage's files ``vocab_files`` (``read_vocab``) from ``vocab_dir``, read by tokenizer
    kind ``kind`` (``families.tokenizer_of``; ``tokenizer``: that kind's tokenizer over
    ``vocab_dir`` when the caller has loaded it). ``family`` gives each state its meaning."""
    module = tokenizers.kind(kind)
    tok = tokenizer if tokenizer is not None else module.load(Path(vocab_dir))
    start = list(tok.prompt("", chat=False))  # what every prompt starts with (encode("") is empty)
    meanings = {}
    if family:
        fam = families.get(family)
        meanings = {s.name: s.meaning for s in fam.state_specs(fam.geometry_from_dict(export_record["geometry"]))}
    functions = bundle_functions(dict(export_record))
    decode = functions[DECODE]
    files = sorted(vocab_files)
    return {
        "format": FORMAT,
        "model": model,
        "family": family,
        "recipe": export_record["recipe"],
        "bundle": export_record["bundle"].removesuffix(".aimodel"),
        "asset": asset,
        "bundle_sha256": bundle_digest(export_record),
        "geometry": dict(export_record["geometry"]),
        "roles": {role: f["name"] for role, f in sorted(functions.items())},
        "functions": {f["name"]: {"role": role, "tokens_per_call": int(f["tokens_per_call"]),
                                  "inputs": _tensors(f["inputs"]), "outputs": _tensors(f["outputs"]),
                                  "states": _tensors(f["states"])}
                      for role, f in sorted(functions.items())},
        "inputs_note": "input_ids: the token ids of the call; position_ids: accepted and ignored (zeros will do)",
        "prefill_chunk": int(functions[PREFILL]["tokens_per_call"]) if PREFILL in functions else None,
        "states": [{**t, "initial": 0.0, "meaning": meanings.get(t["name"], "")} for t in _tensors(decode["states"])],
        "vocab_size": int(decode["outputs"][0]["shape"][-1]),
        "tokenizer": {
            "kind": kind,
            "description": module.DESCRIPTION,
            "file": f"{TOKENIZER_DIR}/{module.DEVICE_FILE}",
            "files": [f"{TOKENIZER_DIR}/{name}" for name in files],
            "hf_tokenizer": f"{TOKENIZER_DIR}/{HF_TOKENIZER}" if HF_TOKENIZER in files else None,
            "sha256": tokenizer_digest(vocab_files),
            "start_ids": start,
            "bos_id": start[0] if start else None,
            "eos_id": tok.eos,
        },
        "chat": {"format": module.CHAT, "description": getattr(tok, "chat_description", module.CHAT_DESCRIPTION),
                 "stop": list(CHAT_STOP)},
        "state_file": {"format": state_file.FORMAT},
    }


def metadata(contract: Mapping, source: Mapping, recipe_spec: Mapping, targets: list[str]) -> dict:
    """Apple's ``metadata.json`` (schema 0.2) for the bundle of ``contract``; ``source`` is the
    source manifest's ``source`` (an ``hf://`` uri names the Hub model), ``recipe_spec`` the
    recipe (a ``quantize`` block: compression names the recipe), ``targets`` the compile targets
    of this folder's asset (none for the ``.aimodel``)."""
    uri = source.get("uri") or ""
    hf_id = uri[len("hf://"):] if uri.startswith("hf://") else None
    tok = contract["tokenizer"]
    return {
        "metadata_version": METADATA_VERSION,
        "kind": "llm",
        "name": contract["bundle"],
        "assets": {"main": contract["asset"]},
        "language": {
            "tokenizer": hf_id or contract["model"],
            "vocab_size": contract["vocab_size"],
            "max_context_length": MAX_CONTEXT_LENGTH,
            "embedded_tokenizer": tok["hf_tokenizer"] is not None,
            "function_map": {role if role != DECODE else "main": [name] for role, name in contract["roles"].items()},
            "states": {s["name"]: "fixed" for s in contract["states"]},
        },
        "source": {"model_definition": "torch", "hf_model_id": hf_id},
        "compression": contract["recipe"] if recipe_spec.get("quantize") else None,
        "compilation": {"date": None, "targets": list(targets)},
        "user_data": {"runner_contract": CONTRACT, "model": contract["model"], "recipe": contract["recipe"],
                      "tokenizer_kind": tok["kind"]},
    }


def folder_texts(contract: Mapping, meta: Mapping) -> dict[str, str]:
    """The two files of a bundle folder, as their bytes will be (canonical JSON)."""
    return {METADATA: dumps_json(meta), CONTRACT: dumps_json(contract)}


def read(folder: str | Path) -> dict:
    """A published folder's ``runner.json``, checked: its format, the asset and tokenizer files it
    names are there, its functions have the roles a runner needs."""
    folder = Path(folder)
    path = folder / CONTRACT
    if not path.is_file():
        raise PipelineError(path, "missing: not a published bundle folder (aimodel/<bundle>/ or <target>/<bundle>/)",
                            "give the folder of a published bundle (results/<m>/publish/universal/<bundle>)")
    try:
        contract = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PipelineError(path, f"is not JSON ({exc})", FIX) from None
    if not isinstance(contract, dict) or contract.get("format") != FORMAT:
        raise PipelineError(path, f"is not a runner contract of format {FORMAT!r}", FIX)
    try:
        roles = contract["roles"]
        functions = {role: contract["functions"][name] for role, name in roles.items()}
        tok = contract["tokenizer"]
        names = [contract["asset"], tok["file"]]
        states = [(s["name"], s["shape"], s["dtype"]) for s in contract["states"]]
    except (KeyError, TypeError) as exc:
        raise PipelineError(path, f"lacks {exc}", FIX) from None
    if DECODE not in functions:
        raise PipelineError(path, "names no decode function (roles.decode)", FIX)
    if [(t["name"], t["shape"], t["dtype"]) for t in functions[DECODE]["states"]] != states:
        raise PipelineError(path, "lists other states than its decode function's", FIX)
    for name in names:
        if not (folder / name).exists():
            raise PipelineError(folder / name, f"named by {CONTRACT} but missing", FIX)
    return contract


def session_record(contract: Mapping) -> dict:
    """The contract's functions as export.json records them (what the runtime sessions read:
    coreai/runtime.py ``PromptSession``, ``state_spec``)."""
    return {"bundle": contract["asset"],
            "functions": {name: {**f} for name, f in contract["functions"].items()}}


def identity(contract: Mapping) -> state_file.Identity:
    """What a state file of this bundle names (coreai/state_file.py)."""
    return state_file.Identity(contract["model"], contract["recipe"], contract["bundle_sha256"],
                               contract["tokenizer"]["sha256"])
