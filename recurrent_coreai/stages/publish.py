"""Publishing: stage the exact Hub tree, write a receipt, and upload it in one commit.

Staging ``results/<model>/publish/``::

    README.md
    aimodel/<bundle>/<bundle>.aimodel/...          per shipped recipe (+ export.json, gate.json)
    <target>/<bundle>/<bundle>.<target>.aimodelc   per AOT target (universal: <bundle>.aimodelx)
    <target>/<bundle>/<tokenizer files>              the vocab stage's output (the tokenizer kind's files)
    <folder>/metadata.json, <folder>/runner.json   in every bundle folder (aimodel/<bundle>, <target>/<bundle>):
    <folder>/tokenizer/<tokenizer files>           the runner contract (stages/runner_contract.py): Apple's
                                                   metadata.json (schema 0.2), what a no-KV runner needs, and
                                                   the vocab stage's files (device TSV, HF tokenizer.json)
    publish.json                                   receipt: files, gate verdicts, what was committed
                                                   (stays local: it records the commit id)

The upload happens only when the model names a repo, ``publish.push`` is on and a token is
in the environment (``HF_TOKEN``); otherwise the output says plainly that it only staged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable

from recurrent_coreai import families, tokenizers
from recurrent_coreai.hub import catalog
from recurrent_coreai.pipeline import stage
from recurrent_coreai.stages import derivation, runner_contract
from recurrent_coreai.util import env
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.fsutil import IGNORED, atomic_path, dumps_json, first_difference, sha256_file, tree_manifest
from recurrent_coreai.pipeline.paths import published_folders
from recurrent_coreai.pipeline.records import (AOT, RECEIPT, read_aot, read_card, read_doctor, read_export, read_gate,
                                              read_manifest, read_stream, read_toolchain, read_vocab, sealed_text,
                                              unseal_card)


def _link_tree(src: Path, dst: Path) -> None:
    """Copy a file or directory tree (:func:`_link_file`: never a hard link)."""
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=_link_file, ignore=shutil.ignore_patterns(*IGNORED))
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        _link_file(src, dst)


def _link_file(src, dst) -> None:
    """A copy of ``src`` -- a reflink where the file system makes them (its own inode, the blocks
    shared until either is written), else the bytes -- never a hard link: a staged file sharing
    its inode with a stage output changed with any in-place edit of that output, after staging
    had checked it, and nothing noticed (Snakemake's timestamps are the output directories')."""
    import fcntl

    try:
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            fcntl.ioctl(fout.fileno(), 0x40049409, fin.fileno())  # FICLONE (linux/fs.h)
    except OSError:  # no reflinks here (ext4, tmpfs, another device): the bytes
        shutil.copyfile(src, dst)
    shutil.copystat(src, dst)


def check_gates(gates: list[Path], tsvs: bool = False) -> dict[str, dict]:
    """The passing gate result of every recipe, keyed by recipe; anything else refuses. Each is
    checked against the gate stage's record (``tsvs``: and the TSV it wrote beside it)."""
    results = {}
    for path in gates:
        if not Path(path).is_file():
            raise PipelineError(path, "no readable gate result",
                                "run the gate; a bundle without a passing gate is never published")
        data = read_gate(Path(path), tsv=tsvs)
        recipe = data.get("recipe", Path(path).stem)
        if data.get("pass") is not True:
            raise PipelineError(path, f"recipe {recipe} did not pass its gate", "fix the export; failing bundles are not published")
        if "tested_files" not in data:
            raise PipelineError(path, f"recipe {recipe}: the gate result records no tested files",
                                "rerun the gate with this version (snakemake --forcerun gate)")
        results[recipe] = data
    return results


VERDICT_KEYS = ("pass", "steps", "agree_counted", "counted", "near_ties", "max_abs_dlogits", "mean_kl", "bundle_sha256")


def _verify(staged: dict[str, dict], prefix: str, expected: dict[str, dict], origin: Path, what: str, fix: str) -> None:
    """The staged files below ``prefix`` must be exactly ``expected`` (same names, sha256, sizes);
    a difference is reported at the file it was staged from (``origin``)."""
    got = {rel[len(prefix):]: v for rel, v in staged.items() if rel.startswith(prefix)}
    bad = first_difference(got, expected)
    if bad:
        state = "is missing" if bad not in got else ("is not among" if bad not in expected else "differs from")
        raise PipelineError(origin / bad, f"{state} {what}", fix)


def _stage_exports(tmp: Path, exports: list[Path], results: dict[str, dict], gate_file: dict[str, Path]):
    """Stage ``aimodel/<bundle>/`` per recipe; returns ({recipe: export record}, checks)."""
    records, checks = {}, []
    for export_dir in exports:
        record = read_export(export_dir)
        recipe, aimodel = record["recipe"], record["bundle"]
        if recipe not in results:
            raise PipelineError(export_dir, f"recipe {recipe} has no gate result among the inputs", "run its gate")
        records[recipe] = record
        folder = tmp / "aimodel" / bundle_of(record)
        _link_tree(export_dir / aimodel, folder / aimodel)
        _link_tree(export_dir / "export.json", folder / "export.json")
        _link_tree(gate_file[recipe], folder / "gate.json")
        checks.append((f"aimodel/{bundle_of(record)}/{aimodel}/", results[recipe]["tested_files"]["aimodel"],
                       export_dir / aimodel, f"the bundle the {recipe} gate tested",
                       "the bundle changed after its gate: rebuild it (snakemake --forcerun export)"))
    return records, checks


def _stage_aots(tmp: Path, aots: list[Path], vocab: Path, results: dict[str, dict], records: dict[str, dict],
                contracts: Callable[[str, str, str, list[str]], dict[str, dict]]):
    """Stage ``<target>/<bundle>/`` per AOT output, with its runner contract (``contracts(folder,
    recipe, asset, targets)`` stages it and returns its files); returns ({folder: recipe}, checks)."""
    folders, checks = {}, []
    tokenizer_files = read_vocab(vocab)  # every file of the vocab stage's output (checked): what an app needs
    for aot_dir in aots:
        rec = read_aot(aot_dir)  # checks the files against aot.json
        recipe, target = rec["recipe"], rec["target"]
        gated = results.get(recipe)
        if recipe not in records or gated is None:
            raise PipelineError(aot_dir, f"AOT output of recipe {recipe}, which is not published here", "check the inputs")
        if rec["from"] != gated["tested_files"]["aimodel"]:
            raise PipelineError(aot_dir, f"was built from other bytes than the bundle the {recipe} gate tested",
                                "rerun the aot stage: snakemake --forcerun aot")
        if rec["product"] == gated["lowered"] and rec["files"] != gated["tested_files"]["lowered"]:
            raise PipelineError(aot_dir, f"is not the lowering the {recipe} gate ran",
                                "rerun the gate: snakemake --forcerun gate")
        rel = f"{target}/{bundle_of(records[recipe])}"
        for product in sorted(p for p in aot_dir.iterdir() if p.name not in IGNORED and p.name != AOT):
            _link_tree(product, tmp / rel / product.name)
        for name in tokenizer_files:
            _link_tree(vocab / name, tmp / rel / name)
        folders[rel] = recipe
        contract_files = contracts(rel, recipe, rec["product"], [target])
        checks.append((f"{rel}/", {**rec["files"], **tokenizer_files, **contract_files}, aot_dir,
                       f"the {target} build of the gated bundle",
                       "the AOT output changed after it was built: snakemake --forcerun aot"))
    return folders, checks


def _contract_stager(tmp: Path, vocab: Path, records: dict[str, dict], meta: dict, source_manifest: dict):
    """``stage(folder, recipe, asset, targets)``: writes the runner contract into ``tmp/folder``
    (metadata.json, runner.json; tokenizer/ linked from the vocab stage's output) and returns what
    those files must be ({name: {sha256, size}}, names relative to the folder)."""
    vocab_files = read_vocab(vocab)
    kind = families.tokenizer_of(meta)
    tokenizer = tokenizers.kind(kind).load(vocab)  # once for every folder

    def stage(folder: str, recipe: str, asset: str, targets: list[str]) -> dict[str, dict]:
        record = records[recipe]
        contract = runner_contract.build(meta["model"], record, vocab, vocab_files, asset, kind, meta["family"], tokenizer)
        texts = runner_contract.folder_texts(contract, runner_contract.metadata(
            contract, source_manifest["source"], record.get("recipe_spec", {}), targets))
        expected = {}
        for name, text in texts.items():
            (tmp / folder / name).write_text(text, encoding="utf-8", newline="\n")
            expected[name] = _sha(text)
        for name, v in vocab_files.items():
            _link_tree(vocab / name, tmp / folder / runner_contract.TOKENIZER_DIR / name)
            expected[f"{runner_contract.TOKENIZER_DIR}/{name}"] = v
        return expected

    return stage


def bundle_of(export_record: dict) -> str:
    return export_record["bundle"].removesuffix(".aimodel")


def _sha(text: str) -> dict:
    data = text.encode()
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _recorded(records: dict[str, dict], results: dict[str, dict], card_text: str, checks: list) -> dict[str, dict]:
    """What every staged file must be, from the records of the stages that wrote it (each record
    checked when read): the bundle and AOT files, the tokenizer files, ``export.json`` and
    ``gate.json`` (a sealed record's bytes are its canonical text) and the card."""
    expected = {"README.md": _sha(card_text)}
    for prefix, files, *_ in checks:
        expected |= {f"{prefix}{rel}": v for rel, v in files.items()}
    for recipe, rec in records.items():
        folder = f"aimodel/{bundle_of(rec)}"
        expected[f"{folder}/export.json"] = _sha(dumps_json(rec))  # a checked record is its canonical text
        expected[f"{folder}/gate.json"] = _sha(dumps_json(results[recipe]))
    return expected


def stage_tree(out: Path, card: Path, vocab: Path, exports: list[Path], aots: list[Path], gates: list[Path],
               meta: dict, source_manifest: dict, folders_expected: list[str], tsvs: bool = False,
               check: Callable[[], None] | None = None) -> dict:
    """Build the staging tree atomically; returns the receipt (without push results).

    Every staged bundle file must be a byte the gate tested (or, for a device target, built from
    exactly the tested bundle): a bundle changed after its gate is refused, never shipped. ``check``
    (main: stages/derivation.py) refuses a derived record that disagrees with what it is derived
    from. Only then does each bundle folder get its provenance statement and, with a key, its
    signature."""
    from recurrent_coreai.hub import provenance
    from recurrent_coreai.hub import signing
    from recurrent_coreai.pipeline import fingerprint

    results = check_gates(gates, tsvs)
    # the card stage's bytes, as it recorded them; staged (and published) without its seal line
    card_text = read_card(card)
    with atomic_path(out, directory=True) as tmp:
        (tmp / "README.md").write_text(card_text, encoding="utf-8", newline="\n")
        records, checks = _stage_exports(tmp, exports, results, dict(zip(results, gates)))
        contracts = _contract_stager(tmp, vocab, records, meta, source_manifest)
        folders, aot_checks = _stage_aots(tmp, aots, vocab, results, records, contracts)
        contract_files = {f"aimodel/{bundle_of(rec)}/{name}": v for r, rec in sorted(records.items())
                          for name, v in contracts(f"aimodel/{bundle_of(rec)}", r, rec["bundle"], []).items()}
        folders |= {f"aimodel/{bundle_of(rec)}": r for r, rec in records.items()}
        if sorted(folders) != folders_expected:
            raise PipelineError(out, f"would stage the bundle folders {sorted(folders)}, but the config names "
                                f"{folders_expected} (dir, shipped, recipes, targets)",
                                "rebuild the bundles under the configured names: snakemake --forcerun export")
        if check is not None:
            check()
        staged = tree_manifest(tmp)
        for bundle_check in checks + aot_checks:
            _verify(staged, *bundle_check)
        # every staged file, the bundles' and the records', is the bytes its stage recorded
        recorded = _recorded(records, results, card_text, checks + aot_checks) | contract_files
        bad = first_difference(staged, recorded)
        if bad:
            raise PipelineError(out / bad, "changed while it was staged (it differs from what its stage recorded)",
                                "stage again: snakemake --cores 1 publish --forcerun stage_and_push")
        targets = sorted({rel.split("/")[0] for rel in folders} - {"aimodel"})
        code = fingerprint.attested(meta["family"], families.tokenizer_of(meta))
        attested = {rel: provenance.attest(tmp, rel, export_record=records[r], gate=results[r],
                                           source_manifest=source_manifest, code=code,
                                           targets=targets if rel.startswith("aimodel/") else [rel.split("/")[0]],
                                           verified={k[len(rel) + 1:]: v["sha256"] for k, v in recorded.items()
                                                     if k.startswith(f"{rel}/")})
                    for rel, r in sorted(folders.items())}
        signed = signing.sign_staged(tmp, sorted(folders))
        files = tree_manifest(tmp)
        receipt = {**meta, "gates": {r: {k: g[k] for k in VERDICT_KEYS} for r, g in results.items()},
                   "provenance": attested, "signing": signed, "files": files}
        if not meta["push"]["pushed"]:  # without a push there is no remote to compare against
            receipt["push"] = {**meta["push"], "would_commit": sorted(files)}
        (tmp / RECEIPT).write_text(sealed_text(receipt, "publish"))  # sealed: pipeline/records.py
    return receipt


def token_from_env() -> str | None:
    return env.hub_token()


def remote_head(repo: str, token: str) -> str | None:
    """The commit ``main`` points at now, or None if the repo does not exist yet."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    from recurrent_coreai.hub.errors import hub_error
    from recurrent_coreai.hub.upload import describe_failure

    failure = None
    try:
        return HfApi(token=token).repo_info(repo, repo_type="model", revision="main").sha
    except (hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError):
        return None
    except Exception as exc:  # noqa: BLE001
        failure = describe_failure(exc, "main")
    raise hub_error(f"hf://{repo}", f"cannot read the repo's head: {failure[0]}", failure[1], token)


def remote_card(repo: str, token: str, revision: str | None = None) -> str | None:
    """The README.md published at ``revision`` (a maintainer may have edited it), or None."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub import errors as hf_errors

    from recurrent_coreai.hub.errors import hub_error
    from recurrent_coreai.hub.upload import describe_failure

    failure = None
    try:
        return Path(hf_hub_download(repo, "README.md", token=token, revision=revision)).read_text(encoding="utf-8")
    except (hf_errors.RemoteEntryNotFoundError, hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError):
        return None  # nothing published yet
    except Exception as exc:  # noqa: BLE001 - never overwrite maintainer edits blindly
        failure = describe_failure(exc, "main")
    raise hub_error(f"hf://{repo}", f"cannot read the published README.md to merge into: {failure[0]}",
                    failure[1], token)


def push(out: Path, receipt: dict, repo: str, message: str, token: str) -> dict:
    """Upload the staging tree (the receipt stays local: it records the commit) in ONE commit.
    The published card's maintainer edits are kept: only its managed blocks are rewritten."""
    import tempfile

    from recurrent_coreai.hub import signing
    from recurrent_coreai.stages.card import merge
    from recurrent_coreai.hub.upload import upload_tree

    with tempfile.TemporaryDirectory(prefix=".upload.", dir=out.parent) as tmp:
        view = Path(tmp)
        for rel in receipt["files"]:
            if rel != "README.md":
                _link_tree(out / rel, view / rel)
        card = (out / "README.md").read_text(encoding="utf-8")  # staged without the card stage's seal
        head = remote_head(repo, token)  # merge into the card at this commit, and commit on top of it
        existing = remote_card(repo, token, head) if head else None
        (view / "README.md").write_text(merge(unseal_card(existing) if existing else None, card), encoding="utf-8")
        staged = {rel: v for rel, v in tree_manifest(view).items() if rel != "README.md"}
        bad = first_difference(staged, {rel: v for rel, v in receipt["files"].items() if rel != "README.md"})
        if bad:  # the staged bundle must still be the gated bytes at the moment of upload
            raise PipelineError(out / bad, "changed after it was staged and checked against its gate",
                                "stage again (snakemake --forcerun stage_and_push); nothing was uploaded")
        signing.verify_before_upload(view, receipt.get("signing", {}))
        expected = {rel: v["sha256"] for rel, v in receipt["files"].items() if rel != "README.md"}
        expected["README.md"] = sha256_file(view / "README.md")  # the card merged just now, from the checked one
        result = upload_tree(repo, view, message=message, token=token, parent=head, expected=expected)
    receipt = {**receipt, "push": {"pushed": True, **result}}
    with atomic_path(out / RECEIPT) as tmp_receipt:
        tmp_receipt.write_text(sealed_text(receipt, "publish"))
    return receipt


def decide(publish_cfg: dict) -> tuple[bool, str]:
    if not publish_cfg.get("repo"):
        return False, "staging only: no publish.repo configured for this model"
    if not publish_cfg.get("push"):
        return False, f"staging only: publish.push is off (would publish to {publish_cfg['repo']})"
    if not token_from_env():
        return False, f"staging only: no HF_TOKEN in the environment (would publish to {publish_cfg['repo']})"
    return True, f"publishing to {publish_cfg['repo']}"


@main_guard
def main(argv=None) -> int:
    """The publish stage (rule ``stage_and_push``): stage the Hub tree, check it, push when enabled."""
    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")  # read by huggingface_hub at import time
    ns = stage.parser("publish", "model", "source", "card", "vocab", "toolchain", "out",
                      lists=("exports", "gates", "aots"), optional_lists=("tsvs", "reference", "doctors")).parse_args(argv)
    s, _ = stage.setup("stage_and_push", ns)
    m = s["models"][ns.model]
    # every input checked against the record of the stage that wrote it (pipeline/records.py); the
    # gate TSVs, the reference and the doctor results when the rule passes them
    manifest = read_manifest(Path(ns.source))
    versions = read_toolchain(Path(ns.toolchain))["versions"]
    for path in ns.reference:
        read_stream(path)
    for path in ns.doctors:
        read_doctor(path)
    do_push, why = decide(m["publish"])
    message = (f"{m['dir']}: Core AI bundles ({', '.join(m['recipes'])}) from {manifest['source']['uri']}"
               f"@{manifest['source']['revision'] or 'local'}; coreai-core {versions['coreai-core']}, "
               f"coreai-torch {versions['coreai-torch']}, torch {versions['torch']}")
    meta = {"model": ns.model, "family": m["family"], "repo": m["publish"]["repo"], "source": manifest["source"],
            # the model's own tokenizer kind, where it names one (the catalog reads it: families.tokenizer_of)
            **({"tokenizer": m["tokenizer"]} if m.get("tokenizer") else {}),
            "tokenizer_files": sorted(read_vocab(Path(ns.vocab))),
            "toolchain": versions, "commit_message": message, "push": {"pushed": False, "reason": why}}
    # every derived record it stages, against what it is derived from (a record edited and sealed
    # again is sealed, but not what its inputs give): one line naming both files, nothing staged
    def derived() -> None:
        derivation.check_publish_inputs(ns.model, s, Path(ns.source), Path(ns.card), Path(ns.vocab),
                                        Path(ns.toolchain), ns.exports, ns.gates, ns.aots,
                                        ns.reference[0] if ns.reference else None, ns.doctors)

    receipt = stage_tree(Path(ns.out), Path(ns.card), Path(ns.vocab), ns.exports, ns.aots, ns.gates, meta, manifest,
                         published_folders(m, m["targets"]), tsvs=bool(ns.tsvs), check=derived)
    stage.log.info("%s: %s", ns.model, receipt["signing"]["reason"])
    if do_push:
        receipt = push(Path(ns.out), receipt, m["publish"]["repo"], message, token_from_env())
        pushed = receipt["push"]
        stage.log.info("published %s to %s: commit %s (%d files committed, %d already identical)", ns.model,
                       pushed["repo"], pushed["commit"], len(pushed["committed"]), len(pushed["skipped"]))
        catalog.write_entries(Path(ns.out))  # coreai-catalog entries beside the receipt (only after a commit)
    else:
        stage.log.info("%s: %s; staged %d files in %s", ns.model, why, len(receipt["files"]), ns.out)
