"""The model card: rendered from a Jinja2 template with numbers read from the stage outputs.

Sections between ``<!-- name begin -->`` and ``<!-- name end -->`` are managed: on
regeneration they are rewritten in place, while text outside them (a maintainer's edits in
the published card) is kept. The YAML front matter is managed too.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

import jinja2
import yaml

from recurrent_coreai import families, tokenizers
from recurrent_coreai.pipeline import stage
from recurrent_coreai.coreai import fold_words
from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, bundle_functions
from recurrent_coreai.tokenizers import fit
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.frontmatter import FRONT, front_matter
from recurrent_coreai.util.normal_form import WEIGHT_FILE
from recurrent_coreai.pipeline.records import (EXPORT, by_recipe, read_manifest, read_toolchain, read_vocab, seal_card,
                                              vocab_files)

BLOCK = re.compile(r"<!-- (?P<name>[\w-]+) begin -->\r?\n(?P<body>.*?)<!-- (?P=name) end -->", re.S)
TAGS = ("coreai", "no-kv-cache", "text-generation")  # beside the family's own tags
CURATED = "cards/{model}.md"  # a maintainer's card to merge into, relative to the repo root (rules/common.smk)
TARGET_SUFFIX = {"linux": (".aimodelx", "Linux lowering for the Core AI runtime")}


def blocks(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def merge(existing: str | None, fresh: str) -> str:
    """Rewrite the managed blocks and front matter of ``existing`` from ``fresh``; keep the rest.
    Blocks new in ``fresh`` are appended at the end."""
    if not existing:
        return fresh
    new_blocks = blocks(fresh)
    seen = set()

    def sub(m):
        seen.add(m["name"])
        body = new_blocks.get(m["name"], m["body"])
        return f"<!-- {m['name']} begin -->\n{body}<!-- {m['name']} end -->"

    out = BLOCK.sub(sub, existing)
    fm = FRONT.match(fresh)
    if fm:
        out = FRONT.sub(lambda _: fm.group(0), out, count=1) if FRONT.match(out) else fm.group(0) + out
    missing = [(name, body) for name, body in new_blocks.items() if name not in seen]
    if missing:
        tail = out[len(out.rstrip("\r\n")):] or "\n"   # keep the maintainer's own line ending
        out = out.rstrip("\r\n") + "".join(f"\n\n<!-- {n} begin -->\n{b}<!-- {n} end -->" for n, b in missing) + tail
    return out


def source_license(source_dir: Path, fallback: str | None) -> str:
    readme = source_dir / "README.md"
    meta = front_matter(readme) if readme.is_file() else {}
    if meta.get("license"):
        return str(meta["license"])
    if fallback:
        return fallback
    raise PipelineError(readme, "no license in the source card and none in config", "set models.<name>.license")


def build_date() -> str | None:
    """``$SOURCE_DATE_EPOCH`` as a date, or None: the card then states no date. A date from the
    clock, or from git's metadata (a clone's commit dates, which a copy, a shallow clone or a new
    commit of dvc.lock does not share), would make a rebuild's card differ from the first build's
    and the committed dvc.lock disagree with a fresh build (docs/dvc.md)."""
    import os
    from datetime import datetime, timezone

    if os.environ.get("SOURCE_DATE_EPOCH"):
        return datetime.fromtimestamp(int(os.environ["SOURCE_DATE_EPOCH"]), timezone.utc).strftime("%Y-%m-%d")
    return None


def group_layers(rows: list[dict]) -> str:
    """``<name>`` ×24 … : layer names with the block index folded, in first-seen order."""
    counts: dict[str, int] = {}
    for r in rows:
        leaf = re.sub(r"^model\.layers\.\d+\.", "", r["layer"])
        counts[leaf] = counts.get(leaf, 0) + 1
    return ", ".join(f"`{k}`" + (f" ×{n}" if n > 1 else "") for k, n in counts.items())


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def vocab_fit(family, geom, n_ids: int) -> str:
    """The card's vocabulary statement: the rows of the embedding and the head, the tokenizer's
    ids and the padding rows (the source stage refused fewer rows than ids)."""
    return fit.describe(min(family.vocab_rows(geom).values()), n_ids)  # the normal form: the same rows in each


def larger_than_fp16(name: str, model_recipes: list[str], recipes: dict, exports: dict[str, dict]) -> str | None:
    """Both sizes when recipe ``name`` quantises and its bundle is larger than the model's plain
    fp16 bundle (a float16 recipe of the model that quantises nothing; e.g. a tied head that a raw
    include quantises adds an int8 copy beside the fp16 table); else None (also without such a recipe)."""
    fp16 = next((exports[r]["size_bytes"] for r in model_recipes if r in exports
                 and not recipes[r].get("quantize") and recipes[r].get("dtype") == "float16"), None)
    size = exports[name]["size_bytes"]
    if not recipes[name].get("quantize") or fp16 is None or size <= fp16:
        return None
    return f"{size:,} bytes against {fp16:,}"


def context(model: str, cfg: dict, source_manifest: dict, exports: dict[str, dict], gates: dict[str, dict],
            source_dir: Path, toolchain: dict, vocab_dir: Path, date: str | None) -> dict:
    """Everything the template shows; ``cfg`` holds at least the card stage's settings."""
    mcfg = cfg["models"][model]
    missing = [r for r in mcfg["recipes"] if r not in exports or r not in gates]
    if missing:
        raise PipelineError(f"recipe {missing[0]}", "has no export record or gate result among the card's inputs",
                            "run the export and gate stages for every recipe of the model")
    g = source_manifest["geometry"]
    recipes = []
    for name in mcfg["recipes"]:
        exp, gate = exports[name], gates[name]
        q = cfg["recipes"][name].get("quantize")
        kept_reasons = sorted({r["reason"] for r in exp["kept"]})
        recipes.append({
            "name": name, "bundle": exp["bundle"].removesuffix(".aimodel"), "size": _size(exp["size_bytes"]),
            "weights": (f"int{q['bits']} + fp16" if q else {"float16": "fp16", "float32": "fp32"}[exp["state_dtype"]]),
            "gate": gate, "quantized": exp["quantized"], "kept": exp["kept"], "kept_reasons": "; ".join(kept_reasons),
            "quantized_groups": group_layers(exp["quantized"]), "kept_groups": group_layers(exp["kept"]),
            "bits": f"int{q['bits']}" if q else None, "block": q["block_size"] if q else None,
            "why": cfg["recipes"][name].get("why"),  # the recipe's measured reason (config), if it states one
            "larger_than_fp16": larger_than_fp16(name, mcfg["recipes"], cfg["recipes"], exports),
            # a toolchain the reproducible-build patches do not fit (export.json; docs/toolchain.md)
            "byte_reproducible": exp.get("byte_reproducible", True),
            "toolchain_misses": list({m["why"]: m for m in exp.get("toolchain_misses", []) if m["bytes"]}.values()),
            # what the export did instead, costing no bytes (e.g. states promoted: coreai/convert.py)
            "toolchain_notes": [m for m in exp.get("toolchain_misses", []) if not m["bytes"]],
        })
    targets = []
    for t in mcfg["targets"]:
        kind = cfg["targets"][t]["kind"]
        suffix, what = TARGET_SUFFIX.get(kind, (f".{t}.aimodelc", f"compiled for {t} by coreai-build"))
        targets.append({"name": t, "suffix": suffix, "what": what})
    base_model = source_manifest["source"]["uri"].removeprefix("hf://") if source_manifest["source"]["kind"] == "hf" else None
    family = families.get(mcfg["family"])
    tok = tokenizers.kind(families.tokenizer_of(mcfg))
    tags = [TAGS[0], *family.tags, *TAGS[1:]]
    front = {"license": source_license(source_dir, mcfg.get("license")), "library_name": "coreai",
             "pipeline_tag": "text-generation", "tags": tags}
    if base_model:
        front["base_model"] = base_model
    first = next(iter(exports.values()))
    functions = bundle_functions(first)
    for name, gate in gates.items():
        if "prefill" not in gate:
            raise PipelineError(f"recipe {name}", "its gate result has no prefill check (made before the prefill gate)",
                                "rerun the gate stage (snakemake --forcerun gate)")
    loaded = tok.load(vocab_dir)   # this model's settings (eos, chat) where the kind reads them, else its constants
    return {
        "front_matter": yaml.safe_dump(front, sort_keys=True, allow_unicode=True),
        "title": f"{mcfg['dir']} for Core AI", "description": mcfg.get("description", model), "model": model,
        "source": source_manifest["source"], "g": g, "states": first["states"], "recipes": recipes,
        "family": family, "architecture_rows": family.card_rows(family.geometry_from_dict(g)),
        "state_meanings": {s.name: s.meaning for s in family.state_specs(family.geometry_from_dict(g))},
        "tokenizer_description": tok.DESCRIPTION, "eos": getattr(loaded, "card_eos", tok.EOS),
        "chat_description": getattr(loaded, "chat_description", tok.CHAT_DESCRIPTION),
        "device_files": vocab_files(vocab_dir),
        "functions": [functions[DECODE], functions[PREFILL]], "decode": functions[DECODE],
        "prefill": functions[PREFILL], "prefill_gate": next(iter(gates.values()))["prefill"],
        "targets": targets, "gate_steps": max(g.get("reference_steps", g["steps"]) for g in gates.values()),
        "n_prompts": len(next(iter(gates.values()))["prompts"]),
        "vocab_fit": vocab_fit(family, family.geometry_from_dict(g), loaded.n_ids),
        "device_numbers": mcfg.get("device_numbers") or {},
        "weights_sha256": source_manifest["files"][WEIGHT_FILE]["sha256"], "normal_layout": family.layouts[0],
        "toolchain": toolchain, "build_date": date, "drift": largest_drift(gates),
    }


def largest_drift(gates: dict[str, dict]) -> dict | None:
    """The largest relative state difference over every recipe's text-stream horizons (where
    they hold one), with its recipe, state, horizon and the recipe's limit (None: not gated)."""
    found = [(h["max_rel_dstate"], name, h) for name, g in gates.items() for h in (g.get("text") or {}).get("horizons", [])
             if h.get("max_rel_dstate") is not None]
    if not found:
        return None
    value, name, h = max(found, key=lambda f: (f[0] != f[0], f[0]))  # NaN first
    return {"value": value, "recipe": name, "state": h["state"], "horizon": h["horizon"],
            "limit": gates[name].get("thresholds", {}).get("text_max_rel_dstate")}


@functools.lru_cache(maxsize=1)
def template() -> jinja2.Template:
    """The card's template, compiled once per process (~0.2 s a compile: the DVC record renders
    every card twice)."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             loader=jinja2.FunctionLoader(
                                 lambda name: resources.files(__package__).joinpath("templates", name).read_text()))
    env.globals["fold_words"] = fold_words.describe  # what the gate's fold did, as the report says it
    return env.get_template("model_card.md.j2")


def render(ctx: dict) -> str:
    return template().render(**ctx)


@main_guard
def main(argv=None) -> int:
    """The card stage: ``scripts/card.py --model M --source … --exports … --gates … [--curated F] --out F``."""
    from recurrent_coreai.util.fsutil import write_text_atomic

    ns = stage.parser("card", "model", "source", "vocab", "toolchain", "out", lists=("exports", "gates"),
                      optional_lists=("curated",)).parse_args(argv)
    s, cfg = stage.setup("card", ns)
    curated = ns.curated[0] if ns.curated else None
    text = card_text(ns.model, s, Path(ns.source), Path(ns.vocab), Path(ns.toolchain), ns.exports, ns.gates, curated,
                     build_date())
    write_text_atomic(ns.out, text)  # sealed: its last line, its digest
    stage.log.info("card %s -> %s%s", ns.model, ns.out, f" (merged into {curated})" if curated else "")


def curated_card(model: str) -> Path | None:
    """The maintainer's card of ``model`` (:data:`CURATED`) when there is one."""
    path = Path(CURATED.format(model=model))
    return path if path.is_file() else None


def card_text(model: str, settings: dict, source: Path, vocab: Path, toolchain: Path, exports: list[Path],
              gates: list[Path], curated: Path | None, date: str | None) -> str:
    """The card, sealed, from its inputs (each checked against its stage's record first): what the
    card stage writes, and what stages/derivation.py renders again to check a card."""
    # every input checked against the record of the stage that wrote it (pipeline/records.py)
    read_vocab(vocab)
    # the manifest as the source stage sealed it (the card reads its digests, not the weights)
    ctx = context(model, settings, read_manifest(source, files=False), by_recipe(exports, EXPORT, files=False),
                  by_recipe(gates), source, read_toolchain(toolchain)["versions"], vocab, date)
    existing = Path(curated).read_text(encoding="utf-8") if curated else None
    return seal_card(merge(existing, render(ctx)))
