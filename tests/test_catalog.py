"""coreai-catalog entries after a real push of a built model (rwkv7-trained: 34 MB to push, rwkv7-tiny's
65536-id head 693 MB) to the local Hub stand-in
(tests/hubserver.py): pinned to the upload's commit, every file with the sha256 and size the Hub
holds, a recurrent model with the bundle's functions and two states, and valid for the
coreai-catalog package's own validator (offline)."""

from __future__ import annotations

import datetime as dt
import hashlib
import math

import pytest
import yaml
from safetensors import safe_open

from hubserver import HubServer, client_env, run_python
from recurrent_coreai import families
from recurrent_coreai.hub import catalog
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.pipeline.paths import stage_args

RESULTS = None  # the tiny results tree (conftest)
M = "rwkv7-trained"
HUB_REPO = "tester/RWKV7-Trained-CoreAI"
TOKEN = "hf_FAKE_catalog_token_7"
PUBLISH = "import sys\nfrom recurrent_coreai.stages.cli import publish\nsys.exit(publish(sys.argv[1:]))\n"
TODAY = dt.date(2026, 11, 30)


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """One publish with push on, as the pipeline runs it; the Hub's files and head afterwards."""
    tmp = tmp_path_factory.mktemp("catalog")
    cfg = yaml.safe_load((RESULTS.parent / "config.yaml").read_text())
    cfg["models"][M]["publish"] = {"repo": HUB_REPO, "push": True}
    conf = tmp / "config.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    m = cfg["models"][M]
    out = tmp / "publish"
    with HubServer() as hub:
        env = client_env(hub, tmp / "hf_home", HF_TOKEN=TOKEN)
        proc = run_python(PUBLISH, env, "--config-file", str(conf), "--model", M,
                          *stage_args("publish", RESULTS, M, m["recipes"], m["targets"]), "--out", str(out),
                          timeout=180, cwd=tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {"out": out, "head": hub.head(HUB_REPO), "remote": hub.files_at(HUB_REPO)}


def test_entries_pin_the_upload_and_validate_offline(pushed):
    from coreai_catalog.contribute import format_error, ids_context, validate_entry

    path = catalog.write_entries(pushed["out"], TODAY)
    assert path == pushed["out"] / "coreai-catalog.yaml"
    written = yaml.safe_load(path.read_text())
    assert path.read_text().startswith("# coreai-catalog entries (add, valid for coreai-catalog 2.3.0): ")
    (art,), (model,) = written["artifacts"], written["models"]
    # the package's validator, offline, as for one contribution adding both entries
    context = ids_context()
    errors = validate_entry("artifact", art, context=context)
    context["artifact_ids"] = context["artifact_ids"] | {art["id"]}
    errors += validate_entry("model", model, context=context)
    assert errors == [], "\n".join(map(format_error, errors))
    assert catalog.validate(catalog.entries(pushed["out"], TODAY)) == []

    hf = art["huggingface"]
    assert (hf["owner"], hf["repo"], hf["url"]) == ("tester", "RWKV7-Trained-CoreAI", f"https://huggingface.co/{HUB_REPO}")
    assert hf["revision"] == pushed["head"]  # the commit the upload made
    remote = pushed["remote"]
    assert {f["path"] for f in hf["files"]} == set(remote) - {".gitattributes", "README.md"}
    for f in hf["files"]:  # what the Hub serves at that commit, byte for byte
        assert f["sha256"] == hashlib.sha256(remote[f["path"]]).hexdigest() and f["size_bytes"] == len(remote[f["path"]])
    assert art["provenance"]["converted_by"] == {"tool": "recurrent-coreai", "version": "0.1.0"}

    assert model["id"] == art["id"] == model["artifact_ref"] == "rwkv7-trained-coreai"
    assert model["architecture"] == "recurrent" and model["last_verified"] == "2026-11-30"
    assert model["source_path"] == f"https://huggingface.co/{HUB_REPO}/tree/{pushed['head']}"
    io = model["io_contract"]
    export = yaml.safe_load((RESULTS / M / "export" / "fp32" / "export.json").read_text())
    states = {i["name"]: i["tensor"]["shape"] for i in io["inputs"] if i["modality"] == "state"}
    assert states == export["states"] == {"recState": [2, 1, 4, 32, 32], "shiftState": [2, 1, 2, 128]}
    tensors = {i["name"]: i["tensor"]["shape"] for i in io["inputs"] if i["modality"] != "state"}
    assert tensors == {f"{fn}.{t['name']}": t["shape"] for fn, f in export["functions"].items() for t in f["inputs"]}
    assert tensors["main.input_ids"] == [1, 1] and tensors["prefill.input_ids"] == [1, export["prefill_chunk"]]
    assert [o["name"] for o in io["outputs"]] == ["main.logits", "prefill.logits"] and io["session"]["stateful"] is True
    assert io["files"]["tokenizer_ref"].endswith("/bytes_tokenizer.json") and io["files"]["tokenizer_ref"] in remote
    assert model["device_support"]["iphone"] == "unknown"  # only the universal (Linux) target was built
    params = float(model["size"]["parameters"].removesuffix("M")) * 1e6
    with safe_open(RESULTS / M / "source" / "model.safetensors", "np") as source:  # the source's own count
        counted = sum(math.prod(source.get_slice(name).get_shape()) for name in source.keys())
    assert params == pytest.approx(counted, abs=0.05e6)  # the entry gives 0.1M steps
    assert model["license"]["name"] == "apache-2.0" == yaml.safe_load(remote["README.md"].split(b"---")[1])["license"]


def test_the_validator_would_catch_a_broken_entry(pushed):
    found = catalog.entries(pushed["out"], TODAY)
    found["model"]["architecture"] = "rnn"
    found["model"]["sources"] = ["nowhere"]
    del found["artifact"]["huggingface"]["files"][0]["sha256"]
    errors = catalog.validate(found)
    assert len(errors) == 3, errors
    assert any(":: architecture: 'rnn' is not one of" in e for e in errors)
    assert any(":: sources: points to missing source 'nowhere'" in e for e in errors)
    # an id the catalog already has is refused for an addition (this repo is not in it: an update keeps the id)
    found = catalog.entries(pushed["out"], TODAY)
    found["artifact"]["id"] = found["model"]["id"] = found["model"]["artifact_ref"] = "rwkv7-goose-1-5b"
    assert any("already exists" in e for e in catalog.validate(found))


def test_an_export_without_functions_gives_no_entry():
    record = yaml.safe_load((RESULTS / M / "export" / "fp16" / "export.json").read_text())
    del record["functions"]
    with pytest.raises(PipelineError, match="records no functions"):
        catalog.io_contract(families.get("rwkv7"), {"fp16": record}, None)


def test_no_entry_without_a_commit(tmp_path):
    (tmp_path / "publish.json").write_text('{"push": {"pushed": false, "reason": "staging only"}, "files": {}}')
    assert catalog.write_entries(tmp_path) is None and not (tmp_path / "coreai-catalog.yaml").exists()
    (tmp_path / "publish.json").write_text('{"push": {"pushed": true, "commit": null}, "files": {}}')
    assert catalog.write_entries(tmp_path) is None


def test_a_repo_the_catalog_lists_keeps_its_id():
    """The shipped 1.5B publishes to the repo the catalog already lists: its entries update that one."""
    assert catalog.existing_artifact_id("mlboydaisuke", "RWKV7-Goose-1.5B-CoreAI") == "rwkv7-goose-1-5b"
    assert catalog.existing_artifact_id("tester", "RWKV7-Tiny-CoreAI") is None
