"""Entry points of the pipeline stages (``scripts/*.py`` call these; so do dvc.yaml's cmds).

Every stage takes ``--config-file`` (config.yaml, or the effective config the Snakefile wrote)
and the paths its rule declares; it reads only its own settings (``config.settings``: the
keys listed in ``config.STAGE_KEYS``), writes its outputs atomically, logs details to
``--log`` and reports any problem as one line on stderr (and in the log) with exit 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from pathlib import Path

from . import config as cfgmod
from .errors import main_guard
from .paths import bundle_name

log = logging.getLogger("rwkv7_coreai")
WILDCARDS = ("model", "recipe", "target")


def _parser(stage: str, *args: str, lists: tuple[str, ...] = (), optional_lists: tuple[str, ...] = ()):
    p = argparse.ArgumentParser(prog=f"scripts/{stage}.py")
    p.add_argument("--config-file", default=cfgmod.DEFAULT_FILE)
    p.add_argument("--log", help="write a detailed log here")
    for a in args:
        p.add_argument(f"--{a}", required=True)
    for a in lists:
        p.add_argument(f"--{a}", nargs="+", required=True, type=Path)
    for a in optional_lists:
        p.add_argument(f"--{a}", nargs="*", default=[], type=Path)
    return p


def _setup(stage: str, ns: argparse.Namespace) -> tuple[dict, dict]:
    """Logging to stdout and ``--log``; returns (this stage's settings, the whole config)."""
    handlers = [logging.StreamHandler(sys.stdout)]
    if ns.log:
        Path(ns.log).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(ns.log, mode="w"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", handlers=handlers, force=True)
    cfg = cfgmod.load(ns.config_file)
    names = {k: getattr(ns, k, None) for k in WILDCARDS}
    return cfgmod.settings(cfg, stage, **names), cfg


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@main_guard
def source(argv=None) -> int:
    from .source import build_source

    ns = _parser("source", "model", "out").parse_args(argv)
    s, _ = _setup("source", ns)
    manifest = build_source(ns.model, s["models"][ns.model], s["vocab"], Path(ns.out))
    log.info("source %s: %s (%s layout) -> %s, %d files", ns.model, manifest["source"]["uri"], manifest["layout"],
             ns.out, len(manifest["files"]))


@main_guard
def vocab(argv=None) -> int:
    from . import vocab as world
    from .source import VOCAB_FILE

    ns = _parser("vocab", "model", "source", "out").parse_args(argv)
    s, _ = _setup("vocab", ns)
    vc = s["vocab"]
    original = world.package_vocab(vc["package"], vc["version"], vc["file"], vc["sha256"])
    shipped = Path(ns.source) / VOCAB_FILE
    if shipped.is_file():
        world.check_checkpoint_vocab(shipped, original)
    import pyrwkv_tokenizer

    report = world.bake(original, Path(ns.out), official=pyrwkv_tokenizer.RWKVTokenizer())
    log.info("vocab %s: %d entries baked to %s; corpus of %d checked (%d also against pyrwkv_tokenizer)",
             ns.model, report["entries"], ns.out, report["corpus"], report["checked_official"])


@main_guard
def reference(argv=None) -> int:
    import numpy as np

    from .fsutil import atomic_path
    from .gate import reference_stream
    from .vocab import read_tsv

    ns = _parser("reference", "model", "source", "vocab", "out").parse_args(argv)
    s, cfg = _setup("reference", ns)
    t0 = time.perf_counter()
    stream = reference_stream(Path(ns.source), read_tsv(Path(ns.vocab)), s["gate"]["prompts"], s["gate"]["steps"],
                              cfgmod.origin(cfg))
    with atomic_path(ns.out) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **stream)
    top2 = np.sort(stream["logits"], axis=1)[:, -2:]
    log.info("reference %s: %d steps in %.1f s; logit max %.2f; top-2 margin median %.3f, min %.3f", ns.model,
             len(stream["tokens"]), time.perf_counter() - t0, float(stream["logits"].max()),
             float(np.median(top2[:, 1] - top2[:, 0])), float((top2[:, 1] - top2[:, 0]).min()))


@main_guard
def export(argv=None) -> int:
    from .export import export_recipe

    ns = _parser("export", "model", "recipe", "source", "out").parse_args(argv)
    s, _ = _setup("export", ns)
    t0 = time.perf_counter()
    rec = export_recipe(Path(ns.source), ns.recipe, s["recipes"][ns.recipe],
                        bundle_name(s["models"][ns.model]["dir"], ns.recipe), Path(ns.out))
    log.info("export %s/%s: %s, %.1f MB in %.1f s, peak RSS %.0f MB; quantised %d linears, kept %d",
             ns.model, ns.recipe, rec["bundle"], rec["size_bytes"] / 1e6, time.perf_counter() - t0, _rss_mb(),
             len(rec["quantized"]), len(rec["kept"]))
    for row in rec["kept"] + rec["quantized"]:
        log.info("  %-40s %-5s %s", row["layer"], row["action"], row["reason"])


@main_guard
def aot(argv=None) -> int:
    from .aot import build_target

    ns = _parser("aot", "model", "recipe", "target", "export", "out").parse_args(argv)
    s, _ = _setup("aot", ns)
    t0 = time.perf_counter()
    build_target(Path(ns.export), bundle_name(s["models"][ns.model]["dir"], ns.recipe), ns.recipe, ns.target,
                 s["targets"][ns.target], s["aot"], Path(ns.out))
    log.info("aot %s/%s/%s -> %s in %.1f s, peak RSS %.0f MB", ns.model, ns.target, ns.recipe, ns.out,
             time.perf_counter() - t0, _rss_mb())


@main_guard
def gate(argv=None) -> int:
    from .gate import gate_bundle

    ns = _parser("gate", "model", "recipe", "export", "aot", "reference", "json", "tsv").parse_args(argv)
    s, _ = _setup("gate", ns)
    t0 = time.perf_counter()
    res = gate_bundle(ns.model, ns.recipe, Path(ns.export), Path(ns.aot), Path(ns.reference),
                      cfgmod.gate_settings(s, ns.recipe), Path(ns.json), Path(ns.tsv))
    seconds = time.perf_counter() - t0
    log.info("gate %s/%s PASS: %d/%d top-1 outside %d near-ties, max|dlogits| %.3g, mean KL %.3g; "
             "%.1f s (%.3f s/step), peak RSS %.0f MB", ns.model, ns.recipe, res["agree_counted"], res["counted"],
             res["near_ties"], res["max_abs_dlogits"], res["mean_kl"], seconds, seconds / res["steps"], _rss_mb())


@main_guard
def card(argv=None) -> int:
    from . import card as model_card
    from .fsutil import write_text_atomic
    from .source import read_manifest
    from .vocab import read_tsv

    ns = _parser("card", "model", "source", "vocab", "toolchain", "out", lists=("exports", "gates"),
                 optional_lists=("curated",)).parse_args(argv)
    s, cfg = _setup("card", ns)
    exports = model_card.by_recipe(ns.exports, "export.json")
    gates = model_card.by_recipe(ns.gates)
    ctx = model_card.context(ns.model, s, read_manifest(Path(ns.source)), exports, gates, Path(ns.source),
                             model_card.load_json(Path(ns.toolchain))["versions"], len(read_tsv(Path(ns.vocab))),
                             model_card.build_date(cfgmod.origin(cfg)))
    existing = ns.curated[0].read_text(encoding="utf-8") if ns.curated else None
    write_text_atomic(ns.out, model_card.merge(existing, model_card.render(ctx)))
    log.info("card %s -> %s%s", ns.model, ns.out, f" (merged into {ns.curated[0]})" if existing else "")


@main_guard
def publish(argv=None) -> int:
    import os

    from . import publish as hub_publish
    from .card import load_json
    from .source import read_manifest

    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")  # read by huggingface_hub at import time
    ns = _parser("publish", "model", "source", "card", "vocab", "toolchain", "out",
                 lists=("exports", "gates", "aots")).parse_args(argv)
    s, _ = _setup("stage_and_push", ns)
    m = s["models"][ns.model]
    manifest = read_manifest(Path(ns.source))
    versions = load_json(Path(ns.toolchain))["versions"]
    do_push, why = hub_publish.decide(m["publish"])
    message = (f"{m['dir']}: Core AI bundles ({', '.join(m['recipes'])}) from {manifest['source']['uri']}"
               f"@{manifest['source']['revision'] or 'local'}; coreai-core {versions['coreai-core']}, "
               f"coreai-torch {versions['coreai-torch']}, torch {versions['torch']}")
    meta = {"model": ns.model, "repo": m["publish"]["repo"], "source": manifest["source"],
            "toolchain": versions, "commit_message": message, "push": {"pushed": False, "reason": why}}
    receipt = hub_publish.stage(Path(ns.out), Path(ns.card), Path(ns.vocab), ns.exports, ns.aots, ns.gates, meta)
    if do_push:
        receipt = hub_publish.push(Path(ns.out), receipt, m["publish"]["repo"], message, hub_publish.token_from_env())
        pushed = receipt["push"]
        log.info("published %s to %s: commit %s (%d files committed, %d already identical)", ns.model,
                 pushed["repo"], pushed["commit"], len(pushed["committed"]), len(pushed["skipped"]))
    else:
        log.info("%s: %s; staged %d files in %s", ns.model, why, len(receipt["files"]), ns.out)


@main_guard
def toolchain(argv=None) -> int:
    from . import toolchain as tc
    from .fsutil import write_json_atomic

    ns = _parser("toolchain", "out").parse_args(argv)
    _setup("toolchain", ns)
    record = tc.record()
    write_json_atomic(ns.out, record)
    log.info("toolchain: %s", json.dumps(record, sort_keys=True))


if __name__ == "__main__":  # pragma: no cover
    stage = sys.argv[1]
    sys.exit(globals()[stage](sys.argv[2:]))
