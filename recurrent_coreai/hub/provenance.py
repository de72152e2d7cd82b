"""SLSA provenance for every published bundle: an in-toto Statement v1 per bundle folder.

A published bundle folder is one directory of the Hub tree — ``aimodel/<bundle>/`` (the
``<bundle>.aimodel`` apps load, ``export.json``, ``gate.json``) or ``<target>/<bundle>/`` (the
lowered or compiled product and the tokenizer files). Its statement is written INTO that folder,
as ``<bundle>.intoto.json`` beside the ``.aimodel`` (never inside it: apps load the ``.aimodel``
as it is), so whoever downloads the folder gets its provenance, and the folder's signature
(``<bundle>.sig``, see signing.py) covers the statement too.

The statement says, for every file of the folder (its subjects, by relative path and sha256):
which model, recipe (its full definition) and targets it was built for; what it was built from
(the source URI, revision and the sha256 of every source file, the pipeline's version and the
code digest of each stage that built it, and for a device product the gated ``.aimodel`` it was
compiled from); with
which toolchain on which OS; and the gate's verdict. It holds no timestamp, host name or
absolute path: identical inputs give byte-identical statements (sorted keys, fixed format).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import dumps_json, sha256_file, tree_files

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
# Names this pipeline's build process (what the parameters below mean); replace by the
# repository's public URL once it has one.
BUILD_TYPE = "urn:rwkv7-coreai:buildtype:coreai-bundle:v1"
BUILDER_ID = "urn:rwkv7-coreai:builder:self-hosted"
SUFFIX = ".intoto.json"
ABSENT = "absent"
TOOLCHAIN_KEYS = ("python", "torch", "coreai-core", "coreai-torch", "coreai-opt")
GATE_SUMMARY = ("pass", "steps", "agree_counted", "counted", "near_ties", "max_abs_dlogits", "mean_kl",
                "bundle_sha256")
GATE_SETTINGS = ("prompts", "near_tie_epsilon", "thresholds", "thresholds_why", "reference_steps", "steps_why")
SHA1 = re.compile(r"[0-9a-f]{40}")


def statement_name(bundle_dir: str | Path) -> str:
    return f"{Path(bundle_dir).name}{SUFFIX}"


def provenance_files(bundle_dir: str | Path) -> tuple[str, str]:
    """The two files this module and signing.py add to a bundle folder (never subjects)."""
    from recurrent_coreai.hub.signing import signature_name

    return statement_name(bundle_dir), signature_name(bundle_dir)


def subjects(bundle_dir: str | Path, verified: dict[str, str] | None = None) -> list[dict]:
    """Every file of the folder but its statement and signature, by relative path, sorted. With
    ``verified`` ({relative path: sha256} from the records of the stages that wrote the files),
    every subject must be one of those files with that digest: only verified digests are attested."""
    bundle_dir = Path(bundle_dir)
    skip = set(provenance_files(bundle_dir))
    subs = [{"name": rel.as_posix(), "digest": {"sha256": sha256_file(bundle_dir / rel)}}
            for rel in tree_files(bundle_dir) if rel.as_posix() not in skip]
    if verified is not None:
        for s in subs:
            if verified.get(s["name"]) != s["digest"]["sha256"]:
                what = ("is no file any stage recorded" if s["name"] not in verified
                        else "differs from what its stage recorded")
                raise PipelineError(bundle_dir / s["name"], f"{what}: it is not attested",
                                    "stage again: snakemake --cores 1 publish --forcerun stage_and_push")
        missing = sorted(set(verified) - {s["name"] for s in subs})
        if missing:
            raise PipelineError(bundle_dir / missing[0], "is recorded but was not staged: it is not attested",
                                "stage again: snakemake --cores 1 publish --forcerun stage_and_push")
    return subs


def _run(cmd: list[str]) -> str:
    """First line of a tool's output, or ``absent`` when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return ABSENT
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ABSENT
    lines = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else ABSENT


def platform_record() -> dict:
    """The OS this runs on; the macOS release, build and ``xcrun coreai-build --version`` only on
    macOS, where the device compiler shapes the bundle. Elsewhere the kernel release is left out:
    it shapes no byte (the universal lowering is coreai-core's own code) and differs from host to
    host, so two hosts building the same bytes would publish different statements (and dvc.lock)."""
    system = platform.system()
    on_mac = system == "Darwin"
    return {
        "system": system,
        "release": platform.release() if on_mac else ABSENT,
        "machine": platform.machine(),
        "macos_version": (platform.mac_ver()[0] or ABSENT) if on_mac else ABSENT,
        "macos_build": _run(["sw_vers", "-buildVersion"]) if on_mac else ABSENT,
        "coreai_build": _run(["xcrun", "coreai-build", "--version"]) if on_mac else ABSENT,
    }


def pipeline_record(code: dict[str, str] | None = None) -> dict:
    """What built a bundle: this package's version and ``code``, the digest of each stage's code
    ({rule: digest}: pipeline/fingerprint.py's ``attested``). Content, not a git commit: the same
    code gives the same statement in any clone, copy or commit (committing ``dvc.lock`` after a
    build changes no statement), and a verifier recomputes each digest from a checkout with
    ``python -m recurrent_coreai.pipeline.fingerprint RULE --family F`` (and ``--tokenizer K`` for a
    model that names its own tokenizer kind)."""
    import recurrent_coreai

    return {"version": recurrent_coreai.__version__, "code": dict(sorted((code or {}).items())) or ABSENT}


def _source_dependencies(manifest: dict) -> list[dict]:
    """The source snapshot as fetched (upstream files, by URI where one exists) and the normalised
    files the export read. A local ``path`` source is named by its base name, never its path."""
    src = manifest["source"]
    kind, revision = src["kind"], src.get("revision")
    if kind == "path":
        uri, annotations = None, {"kind": kind, "name": PurePosixPath(src["uri"]).name}
    else:
        uri, annotations = src["uri"], {"kind": kind}
    snapshot = {"name": "source", "annotations": {**annotations, "revision": revision}}
    if uri:
        snapshot["uri"] = f"{uri}@{revision}" if revision else uri
    if revision and SHA1.fullmatch(revision):
        snapshot["digest"] = {"gitCommit": revision}
    deps = [snapshot]
    for rel, entry in sorted(manifest.get("upstream", {}).items()):
        dep = {"name": f"source/upstream/{rel}", "digest": {"sha256": entry["sha256"]}}
        if kind == "hf" and revision:
            dep["uri"] = f"{uri}@{revision}/{rel}"  # the bytes huggingface_hub serves at that commit
        deps.append(dep)
    deps += [{"name": f"source/{rel}", "digest": {"sha256": entry["sha256"]}}
             for rel, entry in sorted(manifest["files"].items())]
    return deps


def statement(bundle_dir: str | Path, *, bundle_rel: str, export_record: dict, gate: dict, source_manifest: dict,
              targets: list[str], platform_info: dict, pipeline: dict, verified: dict[str, str] | None = None) -> dict:
    """The in-toto Statement (SLSA provenance v1) of one published bundle folder.

    ``bundle_rel``: the folder's path in the Hub tree (``aimodel/<bundle>``, ``<target>/<bundle>``);
    ``export_record``: the recipe's ``export.json`` (its ``toolchain`` is what built the bundle);
    ``gate``: its passing gate JSON; ``targets``: what this folder is for; ``pipeline``:
    :func:`pipeline_record`."""
    subs = subjects(bundle_dir, verified)
    aimodel = export_record["bundle"]
    tested = gate["tested_files"]
    gated = {f"{aimodel}/{rel}": v["sha256"] for rel, v in tested["aimodel"].items()}
    gated |= {rel: v["sha256"] for rel, v in tested.get("lowered", {}).items()}
    code = pipeline["code"]
    # the publish stage's digest covers the code of every stage that built the bundle
    digest = {"digest": {"sha256": code["stage_and_push"]}} if code != ABSENT and "stage_and_push" in code else {}
    deps = [{"name": "rwkv7-coreai", "annotations": {"version": pipeline["version"], "code": code}, **digest},
            *_source_dependencies(source_manifest)]
    if not any(s["name"].startswith(f"{aimodel}/") for s in subs):  # a product built from the gated bundle
        deps += [{"name": f"aimodel/{aimodel.removesuffix('.aimodel')}/{name}", "digest": {"sha256": sha}}
                 for name, sha in sorted(gated.items()) if name.startswith(f"{aimodel}/")]
    versions = export_record["toolchain"]
    tested_here = sorted(s["name"] for s in subs if gated.get(s["name"]) == s["digest"]["sha256"])
    return {
        "_type": STATEMENT_TYPE,
        "subject": subs,
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "model": gate["model"],
                    "bundle": bundle_rel,
                    "recipe": {"name": export_record["recipe"], "definition": export_record["recipe_spec"]},
                    "targets": sorted(targets),
                    "gate": {k: gate[k] for k in GATE_SETTINGS if k in gate},
                },
                "internalParameters": {
                    "toolchain": {**{k: versions.get(k, ABSENT) for k in TOOLCHAIN_KEYS}, "os": platform_info},
                },
                "resolvedDependencies": deps,
            },
            "runDetails": {
                "builder": {"id": BUILDER_ID, "version": {"rwkv7-coreai": pipeline["version"]}},
                "byproducts": [{
                    "name": "gate",
                    "annotations": {
                        **{k: gate[k] for k in GATE_SUMMARY},
                        # the subjects whose exact bytes the gate ran (a device product: none)
                        "subjects_tested": tested_here,
                    },
                }],
            },
        },
    }


def attest(staging_root: str | Path, bundle_rel: str, *, export_record: dict, gate: dict, source_manifest: dict,
           targets: list[str], code: dict[str, str] | None = None, verified: dict[str, str] | None = None) -> dict:
    """Write ``<bundle>.intoto.json`` into ``staging_root/bundle_rel`` (for this OS and checkout);
    ``code``: {rule: code digest} of the stages that built it (pipeline/fingerprint.py's ``attested``);
    ``verified``: {path in the folder: sha256} the stages recorded (see :func:`subjects`).
    Returns ``{"statement": relpath in the tree, "sha256": its digest}``."""
    bundle_dir = Path(staging_root) / bundle_rel
    pipeline = pipeline_record(code)
    stmt = statement(bundle_dir, bundle_rel=bundle_rel, export_record=export_record, gate=gate,
                     source_manifest=source_manifest, targets=targets, platform_info=platform_record(),
                     pipeline=pipeline, verified=verified)
    path = bundle_dir / statement_name(bundle_dir)
    path.write_text(dumps_json(stmt), encoding="utf-8", newline="\n")
    return {"statement": f"{bundle_rel}/{path.name}", "sha256": sha256_file(path)}
