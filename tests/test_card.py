"""The model card (recurrent_coreai.stages.card and the ``card`` CLI) on a copy of the tiny pipeline run.

Every test works on a private copy of what the card stage reads from ``results/`` (source manifest
and README, export.json / gate JSON per recipe, vocab, toolchain.json) and of ``config.yaml``; the
real ``results/`` tree is never touched. Metrics are changed in the copy and the rendered card must
show exactly the changed values: nothing in the card is typed by hand.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.stages import card as c
from recurrent_coreai.stages import cli
from recurrent_coreai.pipeline import records
from recurrent_coreai.pipeline.paths import stage_args

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS: Path = REPO_ROOT / "results"  # set to the session-built tree by conftest.py, never results/
MODEL = "rwkv7-tiny"
RECIPES = ["fp32", "fp16", "int8keepproj"]
EPOCH = "1767225600"  # 2026-01-01T00:00:00Z
TAGS = {"coreai", "rwkv7", "rwkv", "linear-attention", "no-kv-cache"}
HEADER = ["recipe", "weights", "size on disk", "top-1 agreed / counted", "near-ties", "max abs Δlogits", "mean KL",
          "gate"]



# --- helpers -------------------------------------------------------------------------------------
def copy_card_inputs(dst: Path) -> Path:
    """Copy what the card stage reads (small files only) into ``dst``; returns the results root."""
    src = RESULTS / MODEL
    out = dst / MODEL
    for rel in ["source/manifest.json", "source/README.md",
                *(f"export/{r}/export.json" for r in RECIPES), *(f"gate/{r}.json" for r in RECIPES)]:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, out / rel)
    shutil.copytree(src / "vocab", out / "vocab")  # the vocab stage's output is a directory (rwkv_vocab.tsv inside)
    shutil.copyfile(RESULTS / "toolchain.json", dst / "toolchain.json")
    return dst


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_record(path: Path, data: dict) -> None:
    """A hand-made record, sealed by the stage that sealed the record it replaces (the integrity
    chain: the card refuses an unsealed or edited record, see test_an_edited_record_is_refused)."""
    stage = read_json(path)[records.SEAL]["stage"]
    records.write_sealed(path, data, stage)


def edit_json(path: Path, **changes) -> dict:
    data = read_json(path)
    data.update(changes)
    write_record(path, data)
    return data


def write_config(path: Path, **model_changes) -> Path:
    """A copy of config.yaml with ``models.rwkv7-tiny`` updated (None deletes a key)."""
    cfg = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())
    for key, value in model_changes.items():
        if value is None:
            cfg["models"][MODEL].pop(key, None)
        else:
            cfg["models"][MODEL][key] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return path


def front_matter(card: str) -> dict:
    m = re.match(r"\A---\n(.*?\n)---\n", card, re.S)
    assert m, f"no YAML front matter at the top of the card:\n{card[:300]}"
    meta = yaml.safe_load(m.group(1))
    assert isinstance(meta, dict)
    return meta


def block(card: str, name: str) -> str:
    found = c.blocks(card)
    assert name in found, f"managed block {name!r} missing; have {sorted(found)}"
    return found[name]


def table_row(card: str, recipe: str) -> dict[str, str]:
    """The recipes-table row of ``recipe`` as {column header: cell text}."""
    lines = block(card, "recipes").splitlines()
    header = next(line for line in lines if line.startswith("| recipe |"))
    assert [h.strip() for h in header.strip("|").split("|")] == HEADER
    rows = [line for line in lines if line.startswith(f"| `{recipe}` |")]
    assert len(rows) == 1, f"expected one row for {recipe}: {rows}"
    cells = [cell.strip() for cell in rows[0].strip().strip("|").split("|")]
    assert len(cells) == len(HEADER)
    return dict(zip(HEADER, cells))



@pytest.fixture
def work(tmp_path, monkeypatch):
    """A private results copy + config copy; the cwd is an empty tmp dir (no maintainer card unless a test
    adds cards/<model>.md) and the build date is pinned."""
    results = copy_card_inputs(tmp_path / "results")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    config = write_config(cwd / "config.yaml")
    return {"results": results, "cwd": cwd, "config": config, "tmp": tmp_path}


_RUNS = [0]


def render_card(work, config: Path | None = None, *, out: Path | None = None, capsys=None) -> str:
    """Run the card CLI on the copied results; returns the card text."""
    _RUNS[0] += 1
    out = out or work["tmp"] / "out" / f"card{_RUNS[0]}" / "README.md"
    rc = cli.card(["--config-file", str(config or work["config"]), "--model", MODEL,
                   *card_args(work, config), "--out", str(out)])
    if capsys is not None:
        captured = capsys.readouterr()
        assert rc == 0, captured.err
    assert rc == 0
    return records.read_card(out)  # sealed by the card stage (checked); the card without its seal line


def card_args(work, config: Path | None = None) -> list[str]:
    """The card rule's inputs for the copied results and the recipes of ``config``;
    cards/<model>.md when a test made one."""
    recipes = yaml.safe_load(Path(config or work["config"]).read_text())["models"][MODEL]["recipes"]
    curated = Path("cards") / f"{MODEL}.md"  # relative to the work cwd, as the rule declares it
    return stage_args("card", work["results"], MODEL, recipes) + (["--curated", str(curated)] if curated.is_file() else [])


def model_dir(work) -> Path:
    return work["results"] / MODEL


# --- numbers come from the metrics ---------------------------------------------------------------
def test_recipes_table_shows_exactly_the_measured_numbers(work, capsys):
    base = model_dir(work)
    edit_json(base / "gate" / "fp16.json", agree_counted=101, counted=113, near_ties=7,
              max_abs_dlogits=0.123456, mean_kl=0.000314159)
    edit_json(base / "export" / "fp16" / "export.json", size_bytes=12_345_678)
    edit_json(base / "gate" / "int8keepproj.json", agree_counted=99, counted=100, near_ties=11,
              max_abs_dlogits=2.5e-7, mean_kl=0.5, **{"pass": False})
    edit_json(base / "export" / "int8keepproj" / "export.json", size_bytes=1_234_567_890)

    card = render_card(work, capsys=capsys)

    assert table_row(card, "fp16") == {
        "recipe": "`fp16`", "weights": "fp16", "size on disk": "12.3 MB", "top-1 agreed / counted": "101 / 113",
        "near-ties": "7", "max abs Δlogits": "0.123", "mean KL": "0.00031", "gate": "pass"}
    assert table_row(card, "int8keepproj") == {
        "recipe": "`int8keepproj`", "weights": "int8 + fp16", "size on disk": "1.23 GB",
        "top-1 agreed / counted": "99 / 100", "near-ties": "11", "max abs Δlogits": "2.5e-07", "mean KL": "0.5",
        "gate": "FAIL"}
    # the untouched recipe still shows its own measured values, formatted the same way
    fp32_gate = read_json(base / "gate" / "fp32.json")
    fp32_export = read_json(base / "export" / "fp32" / "export.json")
    row = table_row(card, "fp32")
    assert row["top-1 agreed / counted"] == f"{fp32_gate['agree_counted']} / {fp32_gate['counted']}"
    assert row["near-ties"] == str(fp32_gate["near_ties"])
    assert row["max abs Δlogits"] == "%.3g" % fp32_gate["max_abs_dlogits"]
    assert row["size on disk"] == f"{fp32_export['size_bytes'] / 1e6:.1f} MB"
    # the intro of the block takes its step/prompt counts from the gate results, not the config
    assert f"({fp32_gate['steps']} steps over {len(fp32_gate['prompts'])} chat prompts)" in block(card, "recipes")


def test_table_has_one_row_per_configured_recipe_in_config_order(work, capsys):
    card = render_card(work, capsys=capsys)
    rows = [line.split("|")[1].strip() for line in block(card, "recipes").splitlines() if line.startswith("| `")]
    assert rows == [f"`{r}`" for r in RECIPES]
    # a config shipping fewer recipes gives fewer rows (and reads nothing of the others)
    shutil.rmtree(model_dir(work) / "export" / "fp32")
    (model_dir(work) / "gate" / "fp32.json").unlink()
    config = write_config(work["cwd"] / "two.yaml", recipes=["fp16", "int8keepproj"])
    card = render_card(work, config, capsys=capsys)
    rows = [line.split("|")[1].strip() for line in block(card, "recipes").splitlines() if line.startswith("| `")]
    assert rows == ["`fp16`", "`int8keepproj`"]
    assert "fp32" not in block(card, "layout")


def test_missing_metrics_is_a_one_line_error(work, capsys):
    (model_dir(work) / "gate" / "fp16.json").unlink()
    rc = cli.card(["--config-file", str(work["config"]), "--model", MODEL, *card_args(work),
                   "--out", str(work["tmp"] / "out" / "README.md")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert str(model_dir(work) / "gate" / "fp16.json") in err
    assert not (work["tmp"] / "out" / "README.md").exists()


def test_an_edited_record_is_refused(work, capsys):
    """A gate result changed without its stage's seal (edited by hand) is a one-line error naming it."""
    path = model_dir(work) / "gate" / "fp16.json"
    data = read_json(path)
    data["agree_counted"] -= 1
    path.write_text(json.dumps(data, indent=2))
    out = work["tmp"] / "out" / "README.md"
    rc = cli.card(["--config-file", str(work["config"]), "--model", MODEL, *card_args(work), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"error: {path}: differs from what the gate stage recorded") \
        and err.count("\n") == 1, err
    assert not out.exists()


def prefill_rows(card: str) -> dict[str, list[str]]:
    lines = block(card, "prefill").splitlines()
    header = lines.index("| recipe | prefill top-1 agreed / counted | max abs Δlogits | max abs Δstate | relative Δstate | gate |")
    rows = [line.strip().strip("|").split("|") for line in lines[header + 2:] if line.startswith("| `")]
    return {cells[0].strip().strip("`"): [c.strip() for c in cells[1:]] for cells in rows}


def test_prefill_gate_results_come_from_the_gate(work, capsys):
    path = model_dir(work) / "gate" / "fp16.json"
    gate = read_json(path)
    gate["prefill"].update(agree_counted=5, counted=6, max_abs_dlogits=0.4567, max_abs_dstate=0.0123,
                           max_rel_dstate=0.000987, tokens=77,
                           chunks=3, chunk=24, tail=5, **{"pass": False})
    write_record(path, gate)
    card = render_card(work, capsys=capsys)
    rows = prefill_rows(card)
    assert list(rows) == RECIPES
    assert rows["fp16"] == ["5 / 6", "0.457", "0.012", "0.00099", "FAIL"]
    fp32 = read_json(model_dir(work) / "gate" / "fp32.json")["prefill"]
    assert rows["fp32"] == [f"{fp32['agree_counted']} / {fp32['counted']}", "%.3g" % fp32["max_abs_dlogits"],
                            "%.2g" % fp32["max_abs_dstate"], "%.2g" % fp32["max_rel_dstate"], "pass"]
    intro = " ".join(block(card, "prefill").split())   # the intro names the stream of the first recipe's gate
    assert f"one continuous stream of {fp32['tokens']} tokens" in intro
    assert f"{fp32['chunks']} chunks of {fp32['chunk']} tokens through `prefill`, then {fp32['tail']} tokens" in intro


def test_usage_documents_the_functions_recorded_in_export_json(work, capsys):
    for r in RECIPES:  # the card reads the functions of the first recipe's export.json
        path = model_dir(work) / "export" / r / "export.json"
        record = read_json(path)
        record["functions"]["prefill"]["tokens_per_call"] = 48
        record["functions"]["prefill"]["inputs"][0]["shape"] = [1, 48]
        write_record(path, record)
    usage = block(render_card(work, capsys=capsys), "usage")
    fns = read_json(model_dir(work) / "export" / "fp32" / "export.json")["functions"]
    table = [line for line in usage.splitlines() if line.startswith("| `")]
    assert [line.split("|")[1].strip() for line in table] == ["`main`", "`prefill`"]
    assert "| `prefill` | prefill | `input_ids` [1, 48] int32, `position_ids` [1, 64] int32 |" in usage
    assert f"`logits` {fns['main']['outputs'][0]['shape']} | 1 |" in usage
    assert "T = 48 " in usage and 'model.load_function("prefill")' in usage
    assert "`prefill` takes exactly 48 tokens" in usage
    for state in fns["main"]["states"]:
        assert f"`{state['name']}` {state['shape']}" in usage


def test_a_gate_result_without_the_prefill_check_is_refused(work, capsys):
    path = model_dir(work) / "gate" / "int8keepproj.json"
    gate = read_json(path)
    del gate["prefill"]
    write_record(path, gate)
    out = work["tmp"] / "out" / "README.md"
    rc = cli.card(["--config-file", str(work["config"]), "--model", MODEL, *card_args(work), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and err == ("error: recipe int8keepproj: its gate result has no prefill check (made before the "
                               "prefill gate) -- fix: rerun the gate stage (snakemake --forcerun gate)\n")
    assert not out.exists()


def test_the_cards_app_code_prefills_then_decodes_like_the_reference(work, capsys):
    """The Python in the usage block, run as printed on the tiny fp32 bundle (lowered): a prompt of
    two chunks and a tail, then greedy decoding, gives the fp32 reference's greedy tokens."""
    import asyncio

    import numpy as np
    import torch

    from recurrent_coreai.checkpoints.reader import load_checkpoint
    from recurrent_coreai.families.rwkv7.reference import Reference

    usage = block(render_card(work, capsys=capsys), "usage")
    code = usage.split("```python\n", 1)[1].split("```", 1)[0]
    ns: dict = {}
    exec(compile(code, "<card usage>", "exec"), ns)
    record = read_json(RESULTS / MODEL / "export" / "fp32" / "export.json")
    T = record["functions"]["prefill"]["tokens_per_call"]
    assert ns["T"] == T
    g, weights = load_checkpoint(RESULTS / MODEL / "source")
    ids = [0] + torch.randint(1, g.vocab, (2 * T + 4,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = Reference(weights, g, torch.float32).greedy(ids, 6)
    lowered = next((RESULTS / MODEL / "aot" / "universal" / "fp32").glob("*.aimodelx"))

    async def run():
        return [t async for t in ns["generate"](str(lowered), ids, steps=6, dtype=np.float32)]

    got = asyncio.run(run())
    assert got == [t for t in expected if t != 0] and got  # greedy stops at token 0 (not yielded)


# --- front matter ----------------------------------------------------------------------------------
def test_front_matter_is_valid_yaml_with_the_hub_metadata(work, capsys):
    meta = front_matter(render_card(work, capsys=capsys))
    assert meta["license"] == "apache-2.0"
    assert meta["library_name"] == "coreai"
    assert meta["pipeline_tag"] == "text-generation"
    assert TAGS <= set(meta["tags"])
    assert len(meta["tags"]) == len(set(meta["tags"]))
    assert "base_model" not in meta  # synthetic source: there is no base model on the Hub


def test_license_is_inherited_from_the_source_card(work, capsys):
    readme = model_dir(work) / "source" / "README.md"
    text = readme.read_text()
    assert "license: apache-2.0" in text
    readme.write_text(text.replace("license: apache-2.0", "license: mit"))
    assert front_matter(render_card(work, capsys=capsys))["license"] == "mit"

    # no license in the source card: the config's models.<name>.license is the fallback
    readme.write_text("---\npipeline_tag: text-generation\n---\n\nNo license here.\n")
    config = write_config(work["cwd"] / "lic.yaml", license="bsd-3-clause")
    assert front_matter(render_card(work, config, capsys=capsys))["license"] == "bsd-3-clause"

    # neither: a one-line error naming the source card, no card written
    config = write_config(work["cwd"] / "nolic.yaml", license=None)
    out = work["tmp"] / "nolic" / "README.md"
    rc = cli.card(["--config-file", str(config), "--model", MODEL, *card_args(work, config),
                   "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert str(readme) in err
    assert not out.exists()


def test_base_model_is_named_for_a_hub_source(work, capsys):
    manifest_path = model_dir(work) / "source" / "manifest.json"
    manifest = read_json(manifest_path)
    manifest["source"] = {"kind": "hf", "uri": "hf://RWKV/RWKV7-Goose-World3-1.5B-HF", "revision": "a" * 40}
    write_record(manifest_path, manifest)
    card = render_card(work, capsys=capsys)
    meta = front_matter(card)
    assert meta["base_model"] == "RWKV/RWKV7-Goose-World3-1.5B-HF"
    assert meta["library_name"] == "coreai" and TAGS <= set(meta["tags"])
    assert f"at revision `{'a' * 40}`" in block(card, "provenance")


# --- quantisation ----------------------------------------------------------------------------------
def test_quantized_recipe_lists_the_layers_kept_in_fp16(work, capsys):
    export_path = model_dir(work) / "export" / "int8keepproj" / "export.json"
    record = read_json(export_path)
    record["kept"].append({"action": "fp16", "layer": "model.layers.1.attn.sensitive_proj",
                           "reason": "kept for the test", "shape": [128, 128]})
    write_record(export_path, record)

    quant = block(render_card(work, capsys=capsys), "quantization")
    lines = [line for line in quant.splitlines() if line.strip()]
    assert lines[0].startswith("**`int8keepproj`** quantises "), quant
    kept_line = next(line for line in lines if line.startswith("It leaves "))
    assert kept_line.startswith(f"It leaves {len(record['kept'])} linear layers in fp16 ")
    assert "kept for the test" in kept_line and "not matched by include" in kept_line
    assert "`attn.sensitive_proj`" in kept_line
    leaves = lambda rows: {re.sub(r"^model\.layers\.\d+\.", "", r["layer"]) for r in rows}  # noqa: E731
    for leaf in leaves(record["kept"]):
        assert f"`{leaf}`" in kept_line
    for leaf in leaves(record["quantized"]) - leaves(record["kept"]):
        assert f"`{leaf}`" not in kept_line
        assert f"`{leaf}`" in lines[0]
    assert f"quantises {len(record['quantized'])} linear layers to int8" in lines[0]
    # recipes that quantise nothing are not mentioned
    assert "`fp16`" not in quant and "`fp32`" not in quant


# --- managed blocks ----------------------------------------------------------------------------------
FRESH = ("---\nlicense: mit\nlibrary_name: coreai\n---\n\n# Title\n\n"
         "<!-- summary begin -->\nfresh summary\n<!-- summary end -->\n\n"
         "<!-- recipes begin -->\n| fresh | 1 |\n<!-- recipes end -->\n\n"
         "<!-- provenance begin -->\nfresh provenance\n<!-- provenance end -->\n")
EXISTING = ("---\nlicense: apache-2.0\nextra: maintainer\n---\n"
            "Maintainer intro, kept   exactly (two  spaces)\r\n\n"
            "<!-- summary begin -->\nold summary\nwith two lines\n<!-- summary end -->"
            "  between the blocks: maintainer text \u2014 \u00e9\u00e8\n\n\n"
            "<!-- recipes begin -->\n| old | 0 |\n<!-- recipes end -->\n"
            "<!-- custom begin -->\nmaintainer-only block\n<!-- custom end -->\n"
            "\nTrailing maintainer notes.\n\n")


def test_merge_rewrites_blocks_keeps_the_rest_byte_for_byte():
    merged = c.merge(EXISTING, FRESH + "")
    fresh_front = re.match(r"\A---\n.*?\n---\n", FRESH, re.S).group(0)
    expected_without_append = (
        fresh_front
        + "Maintainer intro, kept   exactly (two  spaces)\r\n\n"
        + "<!-- summary begin -->\nfresh summary\n<!-- summary end -->"
        + "  between the blocks: maintainer text \u2014 \u00e9\u00e8\n\n\n"
        + "<!-- recipes begin -->\n| fresh | 1 |\n<!-- recipes end -->\n"
        + "<!-- custom begin -->\nmaintainer-only block\n<!-- custom end -->\n"
        + "\nTrailing maintainer notes.")
    # provenance is new in fresh: appended at the end, after the maintainer's trailing text
    assert EXISTING.endswith("notes.\n\n")  # ... and the maintainer's own trailing newlines stay last
    assert merged == expected_without_append + "\n\n<!-- provenance begin -->\nfresh provenance\n<!-- provenance end -->\n\n"
    assert c.blocks(merged) == {**c.blocks(FRESH), "custom": "maintainer-only block\n"}
    assert front_matter(merged) == {"license": "mit", "library_name": "coreai"}


def test_merge_without_new_blocks_keeps_even_the_trailing_whitespace():
    fresh = FRESH.replace("<!-- provenance begin -->\nfresh provenance\n<!-- provenance end -->\n", "")
    merged = c.merge(EXISTING, fresh)
    assert merged == EXISTING.replace("---\nlicense: apache-2.0\nextra: maintainer\n---\n",
                                      "---\nlicense: mit\nlibrary_name: coreai\n---\n") \
                             .replace("old summary\nwith two lines\n", "fresh summary\n") \
                             .replace("| old | 0 |", "| fresh | 1 |")
    assert merged.endswith("\nTrailing maintainer notes.\n\n")


def test_merge_is_idempotent():
    once = c.merge(EXISTING, FRESH)
    assert c.merge(once, FRESH) == once
    assert c.merge(c.merge(once, FRESH), FRESH) == once
    other = FRESH.replace("fresh summary", "second summary")
    twice = c.merge(once, other)
    assert c.blocks(twice)["summary"] == "second summary\n"
    assert twice == once.replace("fresh summary", "second summary")


def test_merge_edge_cases():
    assert c.merge(None, FRESH) == FRESH
    assert c.merge("", FRESH) == FRESH
    assert c.merge(FRESH, FRESH) == FRESH
    # an existing card without front matter gets the fresh one in front, the rest kept
    bare = "Hand-written card.\n\n<!-- summary begin -->\nold\n<!-- summary end -->\n"
    merged = c.merge(bare, FRESH)
    assert merged.startswith("---\nlicense: mit\nlibrary_name: coreai\n---\nHand-written card.\n\n"
                             "<!-- summary begin -->\nfresh summary\n<!-- summary end -->\n")
    assert merged.count("<!-- summary begin -->") == 1


def test_merge_with_a_real_card_and_a_maintainer_card(work, capsys):
    fresh = render_card(work, capsys=capsys)
    names = list(c.blocks(fresh))
    assert names == ["summary", "architecture", "recipes", "prefill", "quality", "quantization", "usage", "layout",
                     "device-numbers", "provenance"]
    edited = fresh.replace("## Architecture\n", "## Architecture\n\nA maintainer's note on the architecture.\n")
    edited = edited.replace("<!-- recipes begin -->", "Before the recipes table.\n<!-- recipes begin -->")
    edited += "\n## Citation\n\nCite us, please.\n"
    edited = edited.replace(block(fresh, "summary"), "stale summary\n")
    merged = c.merge(edited, fresh)
    assert merged == edited.replace("stale summary\n", block(fresh, "summary"))
    assert c.merge(merged, fresh) == merged


# --- on-device numbers --------------------------------------------------------------------------------
def test_device_numbers_block_is_filled_from_config_and_rewritten_in_place(work, capsys):
    assert "device_numbers" not in yaml.safe_load(work["config"].read_text())["models"][MODEL]
    empty = block(render_card(work, capsys=capsys), "device-numbers")
    assert "No on-device measurement" in empty and "|" not in empty

    config = write_config(work["cwd"] / "dev1.yaml", device_numbers={"decode tok/s (iPhone 17 Pro)": 25})
    first = render_card(work, config, capsys=capsys)
    dev = block(first, "device-numbers")
    assert "| decode tok/s (iPhone 17 Pro) | 25 |" in dev.splitlines()
    assert "No on-device measurement" not in dev

    # a maintainer publishes that card with a paragraph right after the block; new numbers arrive
    paragraph = "\nMeasured by the maintainer with Xcode 27 beta 2, median of 5 runs.\n"
    cards = work["cwd"] / "cards"
    cards.mkdir()
    maintained = first.replace("<!-- device-numbers end -->\n", "<!-- device-numbers end -->\n" + paragraph)
    (cards / f"{MODEL}.md").write_text(maintained, encoding="utf-8")
    config = write_config(work["cwd"] / "dev2.yaml",
                          device_numbers={"decode tok/s (iPhone 17 Pro)": 31, "prefill tok/s (iPhone 17 Pro)": 140.5})
    second = render_card(work, config, capsys=capsys)
    dev = block(second, "device-numbers")
    assert "| decode tok/s (iPhone 17 Pro) | 31 |" in dev.splitlines()
    assert "| prefill tok/s (iPhone 17 Pro) | 140.5 |" in dev.splitlines()
    assert "| 25 |" not in second
    assert second.count("<!-- device-numbers begin -->") == 1
    assert "<!-- device-numbers end -->\n" + paragraph + "\n## Provenance" in second
    # in place: the block sits where it was, everything else is the maintained card
    assert second == maintained.replace(block(first, "device-numbers"), dev)
    assert (cards / f"{MODEL}.md").read_text(encoding="utf-8") == maintained  # the maintainer's file is input only


# --- build date ----------------------------------------------------------------------------------------
def test_build_date_is_reproducible(work, monkeypatch, capsys):
    one = render_card(work, capsys=capsys)
    two = render_card(work, capsys=capsys)
    assert one == two
    assert "- build date: 2026-01-01\n" in block(one, "provenance")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(int(EPOCH) + 86400 * 31))
    three = render_card(work, capsys=capsys)
    assert "- build date: 2026-02-01\n" in block(three, "provenance")
    assert three == one.replace("build date: 2026-01-01", "build date: 2026-02-01")
    assert c.build_date() == "2026-02-01"


def test_without_source_date_epoch_the_card_states_no_date(work, monkeypatch, capsys):
    """No clock and no git date: a copy, a shallow clone or a later commit would give another one
    (and the committed dvc.lock would then differ from a fresh build's)."""
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert c.build_date() is None
    card = render_card(work, capsys=capsys)
    assert "build date" not in card and card == render_card(work, capsys=capsys)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    dated = render_card(work, capsys=capsys)
    assert dated.replace("- build date: 2026-01-01\n", "") == card


def test_the_card_names_the_family_s_normal_layout(tiny_results):
    """The provenance line names the layout the weights were normalised to, per family."""
    from recurrent_coreai import families
    from recurrent_coreai.pipeline import config

    cfg = config.load(REPO_ROOT / "config.yaml")
    built = config.models_to_build(cfg)
    assert len(built) == len(families.available()) + 1  # one synthetic model per family and rwkv7-trained
    for model in built:
        card = (tiny_results / model / "card" / "README.md").read_text()
        assert f"normalised to the {families.get(cfg['models'][model]['family']).layouts[0]} layout" in card, model


# --- the CLI end to end --------------------------------------------------------------------------------
def test_card_cli_end_to_end(work, capsys):
    out = work["tmp"] / "out" / "README.md"
    log = work["tmp"] / "logs" / "card.log"
    rc = cli.card(["--config-file", str(work["config"]), "--model", MODEL, *card_args(work),
                   "--out", str(out), "--log", str(log)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.err == ""
    card = records.read_card(out)  # the card stage's seal checked; the card above it
    assert out.read_text(encoding="utf-8") == records.seal_card(card)  # the seal is the one last line
    assert list(out.parent.iterdir()) == [out]  # written atomically: no temporaries left beside it
    assert list(c.blocks(card)) == ["summary", "architecture", "recipes", "prefill", "quality", "quantization", "usage",
                                    "layout", "device-numbers", "provenance"]
    manifest = read_json(model_dir(work) / "source" / "manifest.json")
    toolchain = read_json(work["results"] / "toolchain.json")["versions"]
    prov = block(card, "provenance")
    assert f"- source: `{manifest['source']['uri']}`" in prov
    assert manifest["files"]["model.safetensors"]["sha256"] in prov
    for name, version in toolchain.items():
        assert f"{name} {version}" in prov
    g = manifest["geometry"]
    arch = block(card, "architecture")
    assert f"| layers | {g['layers']} |" in arch and f"| hidden size | {g['hidden']} |" in arch
    tsv = (model_dir(work) / "vocab" / "rwkv_vocab.tsv").read_text().splitlines()
    n_ids = max(int(line.split("\t")[0]) for line in tsv if line) + 1   # id 0 (end of text) is not in the file
    from recurrent_coreai.tokenizers import world  # the tokenizer kind describes itself, naming the device file

    assert "rwkv_vocab.tsv" in world.DESCRIPTION
    pad = g["vocab"] - n_ids  # the model's rows beyond the tokenizer's ids, stated
    assert n_ids == 65530 and pad > 0
    assert (f"| vocabulary | {g['vocab']} rows, tokenizer {n_ids} ids: {pad} padding rows never produced by the "
            f"tokenizer ({world.DESCRIPTION}) |") in arch
    layout = block(card, "layout")
    for r in RECIPES:
        bundle = f"{MODEL}-{r}"
        assert f"aimodel/{bundle}/{bundle}.aimodel/" in layout
        assert f"universal/{bundle}/{bundle}.aimodelx" in layout
        assert f"universal/{bundle}/rwkv_vocab.tsv" in layout
    assert "{{" not in card and "{%" not in card
    assert f"card {MODEL} -> {out}" in log.read_text()


def test_card_cli_merges_the_maintainer_card(work, capsys):
    cards = work["cwd"] / "cards"
    cards.mkdir()
    maintainer = ("---\nlicense: other\nlanguage: [en, ja]\n---\n"
                  "> Maintained by hand: text outside the markers is mine.\n\n"
                  "<!-- recipes begin -->\nSTALE TABLE 0 / 0\n<!-- recipes end -->\n\n"
                  "## Acknowledgements\n\nThanks to BlinkDL and the fla authors.\n")
    (cards / f"{MODEL}.md").write_text(maintainer, encoding="utf-8")
    fresh_out = work["tmp"] / "fresh" / "README.md"
    merged = render_card(work, capsys=capsys)
    (cards / f"{MODEL}.md").rename(cards / "parked.md")
    fresh = render_card(work, out=fresh_out, capsys=capsys)

    assert merged == c.merge(maintainer, fresh)
    assert merged.startswith(re.match(r"\A---\n.*?\n---\n", fresh, re.S).group(0)
                             + "> Maintained by hand: text outside the markers is mine.\n\n<!-- recipes begin -->\n")
    assert "STALE TABLE" not in merged
    assert block(merged, "recipes") == block(fresh, "recipes")
    assert "## Acknowledgements\n\nThanks to BlinkDL and the fla authors.\n" in merged
    assert front_matter(merged)["license"] == "apache-2.0"  # managed: from the source card, not the maintainer's
    assert "language" not in front_matter(merged)
    # every other block of the fresh card is appended after the maintainer's text, in order
    assert list(c.blocks(merged)) == ["recipes", "summary", "architecture", "prefill", "quality", "quantization", "usage",
                                      "layout", "device-numbers", "provenance"]
    assert all(block(merged, n) == b for n, b in c.blocks(fresh).items())
    assert (cards / "parked.md").read_text(encoding="utf-8") == maintainer


def test_crlf_card_blocks_are_rewritten_not_duplicated():
    fresh = "---\nlicense: mit\n---\n<!-- a begin -->\nnew\n<!-- a end -->\n"
    existing = "---\nlicense: x\n---\r\nintro\r\n<!-- a begin -->\r\nold\r\n<!-- a end -->\r\nnotes\r\n"
    merged = c.merge(existing, fresh)
    assert merged.count("<!-- a begin -->") == 1 and "new\n<!-- a end -->" in merged and "old" not in merged
    assert merged.endswith("notes\r\n")


# rwkv7-tiny's fp16 and int8keepproj gates: the 65536-row head's 1 x 1 convolution, folded (coreai/constant_fold.py)
HEAD_AS_MATMUL = ("its 2 fp16 1 x 1 convolutions by a large constant weight run as fp32 matmuls on that weight "
                  "widened and stored transposed, rounded once to fp16 (the runtime sums such a convolution in fp32)")


def test_pass_criteria_come_from_the_gate_results_and_a_models_own_thresholds_say_why(work, capsys):
    base = model_dir(work)
    why = "random weights put 3 reference margins inside int8's own error (README: int8keepproj at 1.5B)"
    edit_json(base / "gate" / "int8keepproj.json", near_tie_epsilon=0.1, thresholds_why=why,
              thresholds={"min_agree": 0.95, "min_counted": 0.75, "max_abs_dlogits": None,
                          "prefill_max_rel_dstate": 0.03})
    g = edit_json(base / "gate" / "fp32.json", thresholds={"min_agree": 1.0, "min_counted": 0.8, "max_abs_dlogits": 0.001,
                                                           "prefill_max_rel_dstate": 1e-05,
                                                           "prefill_max_abs_dstate": 0.0001}, counted=120, near_ties=7)
    counted = f"(counted 120 / {g['steps']}, prefill {g['prefill']['counted']} / {g['prefill']['steps']})"
    text = block(render_card(work, capsys=capsys), "recipes")
    lines = {line.split("`")[1]: line for line in text.splitlines() if line.startswith("- `")}
    assert lines["int8keepproj"].startswith("- `int8keepproj`: top-1 agreement outside near-ties ≥ 0.95 on at least "
                                            "0.75 of the steps (counted ")
    assert (", prefill max abs Δstate ≤ 0.03 of the state's own max abs value, near-tie epsilon 0.1; steps compared by "
            "1 gate shard (separate jobs); run on a lowering of the shipped bundle with its int8 dequantisation "
            f"evaluated once instead of on every call and {HEAD_AS_MATMUL}, bit-identical to the aot stage's lowering "
            "on 3 calls (logits and states). " in lines["int8keepproj"])  # the dequantised head, moved too
    assert "dequantisation" not in lines["fp32"]  # an unquantised bundle: no dequantisation to fold
    assert lines["int8keepproj"].endswith(f"**This model sets its own thresholds for `int8keepproj`**: {why}")
    assert lines["fp32"] == (f"- `fp32`: top-1 agreement outside near-ties ≥ 1.0 on at least 0.8 of the steps {counted}, "
                             "max abs Δlogits ≤ 0.001, prefill max abs Δstate ≤ 1e-05 of the state's own max abs value, "
                             "prefill max abs Δstate ≤ 0.0001, near-tie epsilon 0.1; steps compared by 1 gate shard "
                             "(separate jobs); run on a lowering of the shipped bundle with its 2 matmuls by a large "
                             "constant weight run on that weight stored transposed (the same products), bit-identical "
                             "to the aot stage's lowering on 3 calls (logits and states)")  # rwkv7-tiny's 65536-row head
    assert lines["fp16"].endswith(f"; run on a lowering of the shipped bundle with {HEAD_AS_MATMUL}, bit-identical to "
                                  "the aot stage's lowering on 3 calls (logits and states)")  # its conv2d head
    assert "own thresholds" not in lines["fp16"]
    shipped = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())["gate"]["thresholds"]["fp16"]
    rel = shipped["prefill_max_rel_dstate"]   # the card states the shipped relative state limit
    assert f", prefill max abs Δstate ≤ {rel} of the state's own max abs value, near-tie" in lines["fp16"]


def test_the_card_says_how_many_shards_compared_the_steps_and_how_they_started(work, capsys):
    """The gate JSON's ``shards`` (stages/gate.py gather): the count, and the shards that started
    mid-prompt from the state the bundle's own prefill and decode made."""
    edit_json(model_dir(work) / "gate" / "fp16.json", shards={"count": 6, "steps": [0, 16, 16, 32, 32, 31],
                                                              "mid_prompt_starts": 1})
    line = next(x for x in block(render_card(work, capsys=capsys), "recipes").splitlines() if x.startswith("- `fp16`"))
    assert ("; steps compared by 6 gate shards (separate jobs), 1 of them starting mid-prompt from the state the "
            "bundle's own prefill and decode made of the prompt's earlier tokens; run on a lowering" in line)


def test_thresholds_without_the_optional_max_abs_dlogits_render(work, capsys):
    """The schema makes max_abs_dlogits optional: a gate result without it is a card without that bound."""
    g = edit_json(model_dir(work) / "gate" / "fp16.json", thresholds={"min_agree": 1.0, "min_counted": 0.8,
                                                                      "prefill_max_rel_dstate": 0.01})
    text = block(render_card(work, capsys=capsys), "recipes")
    line = next(x for x in text.splitlines() if x.startswith("- `fp16`"))
    assert line == (f"- `fp16`: top-1 agreement outside near-ties ≥ 1.0 on at least 0.8 of the steps (counted "
                    f"{g['counted']} / {g['steps']}, prefill {g['prefill']['counted']} / {g['prefill']['steps']}), "
                    "prefill max abs Δstate ≤ 0.01 of the state's own max abs value, near-tie epsilon 0.1; steps "
                    f"compared by 1 gate shard (separate jobs); run on a lowering of the shipped bundle with "
                    f"{HEAD_AS_MATMUL}, bit-identical to the aot stage's lowering on 3 calls (logits and states)")


def test_a_recipe_gated_at_fewer_steps_says_so_with_the_models_reason(work, capsys):
    """models/<model>/gate/steps: the card's stream sentence keeps the reference's steps and the
    recipe's criteria line says how many of them it compared, and why."""
    base = model_dir(work)
    full = json.loads((base / "gate" / "fp16.json").read_text())["steps"]
    why = "measured: the runtime dequantises every int8 weight on every call (README: Scale)"
    edit_json(base / "gate" / "int8keepproj.json", steps=full - 9, reference_steps=full, steps_why=why)
    text = block(render_card(work, capsys=capsys), "recipes")
    assert f"({full} steps over " in text
    lines = {line.split("`")[1]: line for line in text.splitlines() if line.startswith("- `")}
    assert lines["int8keepproj"].endswith(f". **This model sets its own step count for `int8keepproj`** (compared at "
                                          f"{full - 9} of the {full} steps, each prompt's first share): {why}")
    assert "compared at" not in lines["fp16"] + lines["fp32"]
    # with its own thresholds too (one why in config.yaml for both): one statement, the reason once
    edit_json(base / "gate" / "int8keepproj.json", thresholds_why=why)
    text = block(render_card(work, capsys=capsys), "recipes")
    line = next(x for x in text.splitlines() if x.startswith("- `int8keepproj`"))
    assert line.endswith(f". **This model sets its own thresholds and step count for `int8keepproj`** (compared at "
                         f"{full - 9} of the {full} steps, each prompt's first share): {why}")
    assert line.count(why) == 1
