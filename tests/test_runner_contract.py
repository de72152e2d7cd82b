"""The runner contract beside every published bundle (stages/runner_contract.py, the publish stage):
Apple's metadata.json in schema 0.2 with the field names and types apple/coreai-models writes and
reads, runner.json agreeing with export.json, the gate and the vocab stage, tokenizer/ holding the
vocab stage's files; ``generate --bundle`` runs a published folder from its contract alone (the same
text as ``--model/--recipe``), and a damaged contract is one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import test_publish as tp
from recurrent_coreai import families
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline.records import read_export, read_vocab
from recurrent_coreai.stages import cli
from recurrent_coreai.stages import runner_contract as rc
from recurrent_coreai.tools import generate as gen

RESULTS = None  # the tiny results tree (conftest)
MODEL, TARGET = "rwkv7-tiny", tp.TARGET  # the World tokenizer's contract
PROMPT = "Hello, who are you?"

# apple/coreai-models at 86b363d: python/src/coreai_models/export/bundle.py writes these keys (the
# types it writes), swift/Sources/CoreAIShared/Bundle/ModelBundle.swift and
# CoreAILanguageModels/Bundle/{LanguageBundle,LanguageConfig}.swift decode them (required: no ``?``).
NONE = type(None)
APPLE_TOP = {"metadata_version": str, "kind": str, "name": str, "assets": dict, "language": dict, "source": dict,
             "compression": (str, NONE), "compilation": dict}
APPLE_OPTIONAL_TOP = {"user_data": dict}  # ModelBundle.CommonFields.userData: [String: String]?
APPLE_LANGUAGE = {"tokenizer": str, "vocab_size": int, "max_context_length": (int, NONE), "embedded_tokenizer": bool,
                  "function_map": dict}
APPLE_OPTIONAL_LANGUAGE = {"states": dict, "vision": dict}  # LanguageConfig: [String: StateKind]?, VisionConfig?
APPLE_SOURCE = {"model_definition": str, "hf_model_id": (str, NONE)}
APPLE_COMPILATION = {"date": (str, NONE), "targets": list}
STATE_KINDS = {"kv_cache", "sliding_cache", "fixed"}  # StateHandlerFactory.swift StateKind


def apple_problems(meta: dict) -> list[str]:
    """What in ``meta`` is not a field of the name and type Apple's exporter writes and its Swift
    side reads (an empty list: none)."""
    problems = []

    def check(block: dict, required: dict, optional: dict, where: str) -> None:
        for key, typ in required.items():
            if key not in block:
                problems.append(f"{where}{key} missing")
            elif not isinstance(block[key], typ) or isinstance(block[key], bool) and typ is int:
                problems.append(f"{where}{key} is {type(block[key]).__name__}")
        for key in set(block) - set(required) - set(optional):
            problems.append(f"{where}{key} is not Apple's")
        for key, typ in optional.items():
            if key in block and not isinstance(block[key], typ):
                problems.append(f"{where}{key} is {type(block[key]).__name__}")

    check(meta, APPLE_TOP, APPLE_OPTIONAL_TOP, "")
    if problems:
        return problems
    check(meta["language"], APPLE_LANGUAGE, APPLE_OPTIONAL_LANGUAGE, "language.")
    check(meta["source"], APPLE_SOURCE, {}, "source.")
    check(meta["compilation"], APPLE_COMPILATION, {}, "compilation.")
    if meta["metadata_version"] != "0.2" or meta["kind"] != "llm":
        problems.append("not schema 0.2 kind llm")
    if not isinstance(meta["assets"].get("main"), str) or not all(isinstance(v, str) for v in meta["assets"].values()):
        problems.append("assets.main is not a string")
    fmap = meta["language"].get("function_map", {})
    if not all(isinstance(v, list) and v and all(isinstance(n, str) for n in v) for v in fmap.values()):
        problems.append("function_map values are not lists of names")
    if not set(meta["language"].get("states", {}).values()) <= STATE_KINDS:
        problems.append("language.states holds a kind Apple does not know")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.get("user_data", {}).items()):
        problems.append("user_data is not string to string")
    return problems


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """The publish stage (push off) on a copy of the built tree's rwkv7-tiny (tests/test_publish.py's helpers)."""
    tp.RESULTS = RESULTS
    tmp = tmp_path_factory.mktemp("contract")
    results = tp.copy_results(tmp / "results", model=MODEL)
    config = tp.write_config(tmp / "config.yaml", model=MODEL)
    out = tmp / "out" / "publish"
    rc_ = cli.publish(["--config-file", str(config), "--model", MODEL, *tp.publish_args(results, model=MODEL), "--out", str(out)])
    assert rc_ == 0
    return {"results": results, "out": out, "config": config}


def folders(out: Path) -> list[Path]:
    return [out / d / f"{MODEL}-{r}" for d in ("aimodel", TARGET) for r in tp.RECIPES]


def test_every_bundle_folder_carries_the_contract(staged):
    out, results = staged["out"], staged["results"]
    receipt = json.loads((out / "publish.json").read_text())
    vocab = read_vocab(results / MODEL / "vocab")
    for folder in folders(out):
        recipe = folder.name.removeprefix(f"{MODEL}-")
        rel = folder.relative_to(out).as_posix()
        for name in (rc.METADATA, rc.CONTRACT, *(f"{rc.TOKENIZER_DIR}/{n}" for n in vocab)):
            assert f"{rel}/{name}" in receipt["files"], (rel, name)  # recorded, attested (the receipt's files)
        for name, v in vocab.items():
            assert hashlib.sha256((folder / rc.TOKENIZER_DIR / name).read_bytes()).hexdigest() == v["sha256"]
        meta = json.loads((folder / rc.METADATA).read_text())
        contract = json.loads((folder / rc.CONTRACT).read_text())
        assert apple_problems(meta) == [], (rel, apple_problems(meta))
        assert (folder / meta["assets"]["main"]).exists() and meta["assets"]["main"] == contract["asset"]
        assert meta["name"] == f"{MODEL}-{recipe}"
        assert meta["language"]["max_context_length"] is None  # unbounded (docs/app.md: Apple's Swift wants an Int)
        assert meta["language"]["function_map"] == {"main": ["main"], "prefill": ["prefill"]}
        assert meta["language"]["states"] == {"recState": "fixed", "shiftState": "fixed"}
        assert meta["language"]["embedded_tokenizer"] is False  # World: no tokenizer.json for Apple's loader
        assert meta["user_data"]["runner_contract"] == rc.CONTRACT
        assert meta["compilation"]["targets"] == ([] if rel.startswith("aimodel/") else [TARGET])
        # runner.json agrees with the records it is derived from
        export = read_export(results / MODEL / "export" / recipe)
        gate = json.loads((results / MODEL / "gate" / f"{recipe}.json").read_text())
        assert contract["format"] == rc.FORMAT and contract["recipe"] == recipe and contract["model"] == MODEL
        assert contract["bundle_sha256"] == gate["bundle_sha256"]
        assert contract["states"] == [{**t, "initial": 0.0, "meaning": contract["states"][i]["meaning"]}
                                      for i, t in enumerate(export["functions"]["main"]["states"])]
        assert all(s["meaning"] for s in contract["states"])
        for name, f in export["functions"].items():
            mine = contract["functions"][name]
            assert (mine["role"], mine["tokens_per_call"]) == (f["role"], f["tokens_per_call"])
            assert (mine["inputs"], mine["outputs"], mine["states"]) == (f["inputs"], f["outputs"], f["states"])
        assert contract["prefill_chunk"] == export["prefill_chunk"] == 64
        tok = contract["tokenizer"]
        assert tok["kind"] == "world" and tok["file"] == "tokenizer/rwkv_vocab.tsv" and tok["hf_tokenizer"] is None
        assert (tok["start_ids"], tok["bos_id"], tok["eos_id"]) == ([0], 0, 0)
        assert tok["sha256"] == rc.tokenizer_digest(vocab)
        assert contract["chat"]["format"] == "User: {prompt}\n\nAssistant:" and contract["chat"]["stop"] == ["\n\nUser:"]


def test_the_apple_check_can_fail(staged):
    meta = json.loads((folders(staged["out"])[0] / rc.METADATA).read_text())
    broken = json.loads(json.dumps(meta))
    del broken["language"]["vocab_size"]
    broken["language"]["function_map"] = {"main": "main"}
    broken["language"]["states"] = {"recState": "recurrent"}
    broken["kind"] = "rnn"
    broken["extra"] = 1
    problems = apple_problems(broken)
    assert "language.vocab_size missing" not in problems  # the top level is checked first
    assert "extra is not Apple's" in problems
    del broken["extra"]
    problems = apple_problems(broken)
    assert {"language.vocab_size missing", "function_map values are not lists of names", "not schema 0.2 kind llm",
            "language.states holds a kind Apple does not know"} <= set(problems), problems
    broken = json.loads(json.dumps(meta))
    broken["language"]["vocab_size"] = "65536"
    assert apple_problems(broken) == ["language.vocab_size is str"]


def test_a_bpe_kind_embeds_its_tokenizer_json():
    """A Hugging Face tokenizer kind (mamba2-tiny: hf-bpe) names tokenizer/tokenizer.json, which
    Apple's LanguageBundle loads (embedded_tokenizer true); an hf:// source names its Hub id."""
    cfg = cfgmod.load(RESULTS.parent / "config.yaml")
    model = "mamba2-tiny"
    m = cfgmod.model(cfg, model)
    lay = RESULTS / model
    record = read_export(lay / "export" / m["recipes"][0])
    vocab = read_vocab(lay / "vocab")
    contract = rc.build(model, record, lay / "vocab", vocab, record["bundle"], families.tokenizer_of(m), m["family"])
    meta = rc.metadata(contract, {"uri": "hf://state-spaces/mamba2-130m"}, record["recipe_spec"], [])
    assert apple_problems(meta) == []
    assert contract["tokenizer"]["hf_tokenizer"] == "tokenizer/tokenizer.json" and "tokenizer.json" in vocab
    assert meta["language"]["embedded_tokenizer"] is True
    assert meta["language"]["tokenizer"] == meta["source"]["hf_model_id"] == "state-spaces/mamba2-130m"
    assert meta["language"]["states"] == {"convState": "fixed", "ssmState": "fixed"}
    assert contract["tokenizer"]["eos_id"] is not None


def run_cli(capfd, *args):
    code = gen.main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


def test_generate_runs_a_published_folder_from_its_contract(staged, capfd):
    folder = staged["out"] / TARGET / f"{MODEL}-fp32"
    code, by_folder, err = run_cli(capfd, "--bundle", str(folder), "--max-new-tokens", "12", PROMPT)
    assert code == 0, err
    code, by_model, err = run_cli(capfd, "--config-file", str(RESULTS.parent / "config.yaml"), "--model", MODEL,
                                  "--recipe", "fp32", "--max-new-tokens", "12", PROMPT)
    assert code == 0, err
    assert by_folder == by_model and by_folder.strip()
    # a state saved from the folder loads through --model/--recipe: the same bundle and tokenizer digests
    state = staged["out"].parent / "folder.state"
    code, _, err = run_cli(capfd, "--bundle", str(folder), "--max-new-tokens", "1", "--save-state", str(state), PROMPT)
    assert code == 0, err
    code, _, err = run_cli(capfd, "--config-file", str(RESULTS.parent / "config.yaml"), "--model", MODEL, "--recipe",
                           "fp32", "--max-new-tokens", "2", "--load-state", str(state), " Go on.")
    assert code == 0, err


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst, copy_function=shutil.copy2)
    return dst


def test_a_damaged_contract_is_one_line(staged, capfd, tmp_path):
    folder = staged["out"] / TARGET / f"{MODEL}-fp32"
    cases = []
    gone = _copy(folder, tmp_path / "gone")
    (gone / rc.CONTRACT).unlink()
    cases.append((gone, f"{gone / rc.CONTRACT}: missing: not a published bundle folder"))
    shape = _copy(folder, tmp_path / "shape")
    contract = json.loads((shape / rc.CONTRACT).read_text())
    for f in contract["functions"].values():
        f["states"][0]["shape"][2] += 1
    contract["states"][0]["shape"][2] += 1
    (shape / rc.CONTRACT).write_text(json.dumps(contract))
    cases.append((shape, "function 'main' has states"))  # the runtime's own descriptor disagrees
    vocab = _copy(folder, tmp_path / "vocab")
    with open(vocab / "tokenizer" / "rwkv_vocab.tsv", "ab") as fh:
        fh.write(b"65530\tQUJD\n")
    cases.append((vocab, "does not hold the tokenizer files runner.json names"))
    asset = _copy(folder, tmp_path / "aimodel")
    contract = json.loads((asset / rc.CONTRACT).read_text())
    contract["asset"] = "nothing.aimodelx"
    (asset / rc.CONTRACT).write_text(json.dumps(contract))
    cases.append((asset, "nothing.aimodelx: named by runner.json but missing"))
    for where, what in cases:
        code, out, err = run_cli(capfd, "--bundle", str(where), "--max-new-tokens", "2", PROMPT)
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert (code, out) == (1, ""), (where.name, err)
        assert len(lines) == 1 and what in lines[0] and " -- fix: " in lines[0], (where.name, err)


def test_the_aimodel_folder_is_refused_on_this_host(staged, capfd):
    folder = staged["out"] / "aimodel" / f"{MODEL}-fp32"
    code, out, err = run_cli(capfd, "--bundle", str(folder), PROMPT)
    assert (code, out) == (1, "") and "is not a universal lowering (.aimodelx)" in err and err.count("\n") == 1


OTHER_KINDS = ("mamba2-tiny", "gdn-tiny", "rwkv6-tiny")  # hf-bpe, sp-bpe or bytes, world: what the build has


@pytest.mark.parametrize("model", OTHER_KINDS)
def test_a_folder_of_every_family_runs_from_its_contract(model, tmp_path, capfd):
    """A universal bundle folder laid out as publish lays it out (runner_contract's own functions,
    tokenizer/ from the vocab stage) for the other families and tokenizer kinds: --bundle reads
    the tokenizer kind, its files and the functions from runner.json alone, and gives the text
    --model/--recipe gives."""
    import os

    cfg = cfgmod.load(RESULTS.parent / "config.yaml")
    if model not in cfgmod.models_to_build(cfg):
        pytest.skip(f"{model} is not in this build")
    m = cfgmod.model(cfg, model)
    recipe, lay = m["recipes"][0], RESULTS / model
    record = read_export(lay / "export" / recipe)
    aot = lay / "aot" / TARGET / recipe
    product = json.loads((aot / "aot.json").read_text())["product"]
    folder = tmp_path / f"{model}-{recipe}"
    shutil.copytree(aot / product, folder / product, copy_function=os.link)
    vocab = read_vocab(lay / "vocab")
    for name in vocab:
        (folder / rc.TOKENIZER_DIR).mkdir(exist_ok=True)
        shutil.copyfile(lay / "vocab" / name, folder / rc.TOKENIZER_DIR / name)
    contract = rc.build(model, record, lay / "vocab", vocab, product, families.tokenizer_of(m), m["family"])
    manifest = json.loads((lay / "source" / "manifest.json").read_text())
    for name, text in rc.folder_texts(contract, rc.metadata(contract, manifest["source"], record["recipe_spec"],
                                                            [TARGET])).items():
        (folder / name).write_text(text)
    args = ["--max-new-tokens", "10", "--no-chat", "The quick brown fox"]
    code, by_folder, err = run_cli(capfd, "--bundle", str(folder), *args)
    assert code == 0, err
    code, by_model, err = run_cli(capfd, "--config-file", str(RESULTS.parent / "config.yaml"), "--model", model,
                                  "--recipe", recipe, *args)
    assert code == 0, err
    assert by_folder == by_model and by_folder.strip(), (by_folder, by_model)
    assert contract["tokenizer"]["kind"] == families.tokenizer_of(m)
