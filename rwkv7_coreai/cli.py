"""Entry points of the pipeline stages (``scripts/*.py`` call these; so do dvc.yaml's cmds).

Every stage takes ``--config-file`` and the names of what it builds; it reads its settings
from the validated config, writes its outputs atomically, logs details to ``--log`` and
reports a fixable problem as one line on stderr with exit 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from . import config as cfgmod
from .errors import PipelineError, main_guard
from .fsutil import dumps_json
from .paths import Layout, bundle_name

log = logging.getLogger("rwkv7_coreai")


def _parser(stage: str, *args: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"scripts/{stage}.py")
    p.add_argument("--config-file", default="config.yaml")
    p.add_argument("--log", help="append a detailed log here")
    for a in args:
        p.add_argument(f"--{a}", required=True)
    return p


def _setup(ns) -> dict:
    handlers = [logging.StreamHandler(sys.stdout)]
    if ns.log:
        Path(ns.log).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(ns.log, mode="w"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", handlers=handlers, force=True)
    return cfgmod.load(ns.config_file)


@main_guard
def source(argv=None) -> int:
    from .source import build_source

    ns = _parser("source", "model", "out").parse_args(argv)
    cfg = _setup(ns)
    manifest = build_source(ns.model, cfgmod.model(cfg, ns.model), cfg["vocab"], Path(ns.out))
    log.info("source %s: %s (%s layout) -> %s, %d files", ns.model, manifest["source"]["uri"], manifest["layout"],
             ns.out, len(manifest["files"]))


@main_guard
def vocab(argv=None) -> int:
    from . import vocab as v
    from .source import VOCAB_FILE
    from .fsutil import sha256_file

    ns = _parser("vocab", "model", "source", "out").parse_args(argv)
    cfg = _setup(ns)
    vc = cfg["vocab"]
    original = v.package_vocab(vc["package"], vc["version"], vc["file"], vc["sha256"])
    shipped = Path(ns.source) / VOCAB_FILE
    if shipped.is_file() and sha256_file(shipped) != vc["sha256"]:
        raise PipelineError(shipped, "the checkpoint's vocab differs from the pinned World vocab",
                            "this model does not use the RWKV World tokenizer; it is not supported")
    import pyrwkv_tokenizer

    report = v.bake(original, Path(ns.out), official=pyrwkv_tokenizer.RWKVTokenizer())
    log.info("vocab %s: %d entries baked to %s; corpus of %d checked (%d also against pyrwkv_tokenizer)",
             ns.model, report["entries"], ns.out, report["corpus"], report["checked_official"])


@main_guard
def reference(argv=None) -> int:
    import numpy as np

    from .fsutil import atomic_path
    from .gate import reference_stream
    from .vocab import read_tsv

    ns = _parser("reference", "model", "source", "vocab", "out").parse_args(argv)
    cfg = _setup(ns)
    t0 = time.perf_counter()
    stream = reference_stream(Path(ns.source), read_tsv(Path(ns.vocab)), cfg["gate"]["prompts"], cfg["gate"]["steps"])
    with atomic_path(ns.out) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **stream)
    top2 = np.sort(stream["logits"], axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    log.info("reference %s: %d steps in %.1f s; logit max %.2f; top-2 margin median %.3f, %d below %.2f",
             ns.model, len(stream["tokens"]), time.perf_counter() - t0, float(stream["logits"].max()),
             float(np.median(margins)), int((margins < cfg["gate"]["near_tie_epsilon"]).sum()),
             cfg["gate"]["near_tie_epsilon"])


@main_guard
def export(argv=None) -> int:
    import resource

    from .export import export_recipe

    ns = _parser("export", "model", "recipe", "source", "out").parse_args(argv)
    cfg = _setup(ns)
    m = cfgmod.model(cfg, ns.model)
    rec = export_recipe(Path(ns.source), ns.recipe, cfgmod.recipe(cfg, ns.recipe), bundle_name(m["dir"], ns.recipe),
                        Path(ns.out))
    log.info("export %s/%s: %s, %.1f MB in %.1f s, peak RSS %.0f MB; quantised %d linears, kept %d",
             ns.model, ns.recipe, rec["bundle"], rec["size_bytes"] / 1e6, rec["export_seconds"],
             resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(rec["quantized"]), len(rec["kept"]))
    for row in rec["kept"] + rec["quantized"]:
        log.info("  %-40s %-5s %s", row["layer"], row["action"], row["reason"])


@main_guard
def aot(argv=None) -> int:
    from .aot import build_target

    ns = _parser("aot", "model", "recipe", "target", "export", "out").parse_args(argv)
    cfg = _setup(ns)
    m = cfgmod.model(cfg, ns.model)
    t0 = time.perf_counter()
    build_target(Path(ns.export), bundle_name(m["dir"], ns.recipe), ns.target, cfgmod.target(cfg, ns.target), cfg["aot"], Path(ns.out))
    log.info("aot %s/%s/%s -> %s in %.1f s", ns.model, ns.target, ns.recipe, ns.out, time.perf_counter() - t0)


@main_guard
def gate(argv=None) -> int:
    from .gate import gate_bundle

    ns = _parser("gate", "model", "recipe", "export", "aot", "reference", "json", "tsv").parse_args(argv)
    cfg = _setup(ns)
    m = cfgmod.model(cfg, ns.model)
    res = gate_bundle(ns.model, ns.recipe, Path(ns.export), Path(ns.aot), Path(ns.reference),
                      cfgmod.gate_settings(cfg, ns.recipe), bundle_name(m["dir"], ns.recipe), Path(ns.json), Path(ns.tsv))
    log.info("gate %s/%s PASS: %d/%d top-1 outside %d near-ties, max|dlogits| %.3g, mean KL %.3g, %.1f s",
             ns.model, ns.recipe, res["agree_counted"], res["counted"], res["near_ties"], res["max_abs_dlogits"],
             res["mean_kl"], res["runtime_seconds"])


@main_guard
def card(argv=None) -> int:
    from . import card as c
    from .fsutil import write_text_atomic
    from .source import read_manifest
    from .vocab import read_tsv

    ns = _parser("card", "model", "results", "out").parse_args(argv)
    ns_existing = Path("cards") / f"{ns.model}.md"  # a maintainer-curated card, if any, is merged into
    cfg = _setup(ns)
    m, lay = cfgmod.model(cfg, ns.model), Layout(ns.results, ns.model)
    ctx = c.context(ns.model, m, cfg, read_manifest(lay.source),
                    {r: c.load_json(lay.export(r) / "export.json") for r in m["recipes"]},
                    {r: c.load_json(lay.gate_json(r)) for r in m["recipes"]}, lay.source,
                    c.load_json(lay.toolchain)["versions"], len(read_tsv(lay.vocab)), Path(ns.config_file))
    existing = ns_existing.read_text(encoding="utf-8") if ns_existing.is_file() else None
    write_text_atomic(ns.out, c.merge(existing, c.render(ctx)))
    log.info("card %s -> %s%s", ns.model, ns.out, f" (merged into {ns_existing})" if existing else "")


@main_guard
def publish(argv=None) -> int:
    from . import publish as p
    from .source import read_manifest

    import os

    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")  # read by huggingface_hub at import time
    ns = _parser("publish", "model", "results", "out").parse_args(argv)
    cfg = _setup(ns)
    m, lay = cfgmod.model(cfg, ns.model), Layout(ns.results, ns.model)
    manifest = read_manifest(lay.source)
    versions = c_load(lay.toolchain)["versions"]
    do_push, why = p.decide(m["publish"])
    message = (f"{m['dir']}: Core AI bundles ({', '.join(m['recipes'])}) from {manifest['source']['uri']}"
               f"@{manifest['source']['revision'] or 'local'}; coreai-core {versions['coreai-core']}, "
               f"coreai-torch {versions['coreai-torch']}, torch {versions['torch']}")
    meta = {"model": ns.model, "repo": m["publish"]["repo"], "source": manifest["source"],
            "toolchain": versions, "commit_message": message,
            "push": {"pushed": False, "reason": why}}
    receipt = p.stage(Path(ns.out), lay.card, lay.vocab, {r: lay.export(r) for r in m["recipes"]},
                      {(t, r): lay.aot(t, r) for t in m["targets"] for r in m["recipes"]},
                      {r: lay.gate_json(r) for r in m["recipes"]}, meta)
    if do_push:
        receipt = p.push(Path(ns.out), receipt, m["publish"]["repo"], message, p.token_from_env())
        pushed = receipt["push"]
        log.info("published %s to %s: commit %s (%d files committed, %d already identical)", ns.model,
                 pushed["repo"], pushed["commit"], len(pushed["committed"]), len(pushed["skipped"]))
    else:
        log.info("%s: %s; staged %d files in %s", ns.model, why, len(receipt["files"]), ns.out)


def c_load(path: Path) -> dict:
    from .card import load_json

    return load_json(path)


@main_guard
def toolchain(argv=None) -> int:
    from . import toolchain as tc
    from .fsutil import write_json_atomic

    ns = _parser("toolchain", "out").parse_args(argv)
    _setup(ns)
    write_json_atomic(ns.out, tc.record())
    log.info("toolchain: %s", json.dumps(tc.record(), sort_keys=True))


if __name__ == "__main__":  # pragma: no cover
    stage = sys.argv[1]
    sys.exit(globals()[stage](sys.argv[2:]))
