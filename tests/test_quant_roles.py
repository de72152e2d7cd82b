"""Quantisation roles (coreai/quantize.resolve_roles + plan) and tied linears.

A head tied to the embedding (Mamba-2 ``tie_embeddings``: the family's ``tied_linears``) is one
table in an fp16 bundle: the converter stores equal weights once. A role (``lm_head``) therefore
keeps a tied head in fp16 -- an int8 copy would sit beside the fp16 table the lookup still reads --
and says why in the plan (export.json ``kept``) and on the card; a raw ``include`` pattern that
names it is honoured, and its row and the card say the table is then held twice. An untied head
is quantised by the role as before. The exports below measure the sizes at tiny scale."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from recurrent_coreai import families
from recurrent_coreai.coreai import quantize
from recurrent_coreai.pipeline import records
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.util.errors import PipelineError

MAMBA2 = families.get("mamba2")
# small enough to export in seconds, vocab-heavy so that the head is most of the bundle
SHAPE = {"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "vocab": 4096, "n_groups": 2}
V, C = SHAPE["vocab"], SHAPE["hidden"]
HEAD = "backbone.embeddings.weight"
KEEPSTATE = {"bits": 8, "block_size": 32, "axis": 1, "roles": ["mlp", "mixer_output", "lm_head"], "exclude": []}
TIED_REASON = f"tied to {HEAD}: one fp16 table serves both, and a role does not quantise a tied linear"


def geometry(tied: bool):
    return MAMBA2.geometry_from_shape({**SHAPE, "tie_embeddings": tied}, "test shape")


def plan(q: dict, tied: bool) -> dict[str, dict]:
    g = geometry(tied)
    resolved = quantize.resolve_roles(q, MAMBA2.roles, "r", MAMBA2.tied_linears(g))
    return {r["layer"]: r for r in quantize.plan(MAMBA2.decode_skeleton(g, torch.float16), resolved, "float16")}


# --- the plan ----------------------------------------------------------------------------------
def test_the_family_names_its_tied_head_only_when_tied():
    assert MAMBA2.tied_linears(geometry(True)) == {"lm_head": HEAD}
    assert MAMBA2.tied_linears(geometry(False)) == {}


def test_resolve_roles_without_ties_is_what_it_was():
    q = {**KEEPSTATE, "include": ["extra"]}
    assert quantize.resolve_roles(q, MAMBA2.roles, "r") == {**q, "include": [MAMBA2.roles[r] for r in q["roles"]] + ["extra"]}
    raw = {"bits": 8, "block_size": 32, "axis": 1, "include": ["lm_head"]}
    assert quantize.resolve_roles(raw, MAMBA2.roles, "r") is raw and quantize.resolve_roles(raw, MAMBA2.roles, "r", {}) is raw
    with pytest.raises(PipelineError, match="quantize.roles names 'attention', which this model's family does not define"):
        quantize.resolve_roles({**KEEPSTATE, "roles": ["attention"]}, MAMBA2.roles, "r", {"lm_head": HEAD})


def test_a_role_keeps_a_tied_head_and_quantises_an_untied_one():
    tied, untied = plan(KEEPSTATE, True), plan(KEEPSTATE, False)
    assert tied["lm_head"] == {"layer": "lm_head", "shape": [V, C], "tied_to": HEAD, "action": "fp16",
                               "reason": TIED_REASON}
    assert untied["lm_head"] == {"layer": "lm_head", "shape": [V, C], "action": "int8", "reason": "matched 'lm_head'"}
    for rows in (tied, untied):   # the rest of the recipe is unchanged by the tie
        assert all(rows[f"backbone.layers.{i}.mixer.out_proj"]["action"] == "int8" for i in range(SHAPE["layers"]))
        assert all(rows[f"backbone.layers.{i}.mixer.in_proj"]["reason"] == "not matched by include"
                   for i in range(SHAPE["layers"]))
    assert [n for n, r in tied.items() if "tied_to" in r] == ["lm_head"]


def test_a_raw_include_naming_the_tied_head_is_honoured_and_says_so():
    for q in ({**KEEPSTATE, "include": ["lm_head"]},                                 # a role and the raw pattern
              {"bits": 8, "block_size": 32, "axis": 1, "include": ["lm_head"]}):     # the raw pattern alone
        row = plan(q, True)["lm_head"]
        assert row["action"] == "int8" and row["tied_to"] == HEAD
        assert row["reason"] == (f"matched 'lm_head', although tied to {HEAD}: "
                                 "the bundle holds that table in fp16 and this int8 copy")
    assert plan({"bits": 8, "block_size": 32, "axis": 1, "include": [".*"]}, True)["lm_head"]["action"] == "int8"
    excluded = plan({**KEEPSTATE, "include": ["lm_head"], "exclude": ["lm_head"]}, True)["lm_head"]
    assert (excluded["action"], excluded["reason"]) == ("fp16", "excluded by 'lm_head'")


def test_a_recipe_left_with_only_a_tied_head_says_why_it_quantises_nothing():
    g = geometry(True)
    q = quantize.resolve_roles({**KEEPSTATE, "roles": ["lm_head"]}, MAMBA2.roles, "headonly", MAMBA2.tied_linears(g))
    rows = quantize.plan(MAMBA2.decode_skeleton(g, torch.float16), q, "float16")
    with pytest.raises(PipelineError, match=r"recipe headonly: .* matches no linear layer that can be quantised "
                                            r"\(.*; tied lm_head kept: a role does not quantise a tied linear\)"):
        quantize.chosen(rows, q, "headonly")


# --- exports at tiny scale: what the bundle holds -------------------------------------------------
@pytest.fixture(scope="module")
def exports(tmp_path_factory, cfg):
    """fp16 and int8keepstate of the tied and the untied geometry, and int8keepstate with a raw
    include of the tied head (the plan before tied heads were kept): name -> export.json."""
    pytest.importorskip("coreai_torch")
    from recurrent_coreai.stages import export
    from recurrent_coreai.stages.source import build_source

    root = tmp_path_factory.mktemp("tied")
    recipes = {"fp16": {"dtype": "float16"}, "int8keepstate": {"dtype": "float16", "quantize": KEEPSTATE},
               "int8keepstate+head": {"dtype": "float16", "quantize": {**KEEPSTATE, "include": ["lm_head"]}}}
    out = {}
    patch = pytest.MonkeyPatch()
    patch.setattr(export, "DECODE_ONLY_MAX_PARAMS", 0)   # no second, decode-only conversion: half the time
    for tied in (True, False):
        name = "tied" if tied else "untied"
        source = root / name / "source"
        build_source(name, {"family": "mamba2", "license": "apache-2.0", "source": {
            "kind": "synthetic", "seed": 7, "layout": "mamba-ssm", "shape": {**SHAPE, "tie_embeddings": tied}}},
            cfg["vocab"], source)
        for recipe, spec in recipes.items():
            if recipe.endswith("+head") and not tied:
                continue
            out[f"{name}/{recipe}"] = export.export_recipe(MAMBA2, source, recipe, spec, f"{name}-{recipe}",
                                                           root / name / "export" / recipe, chunk=16)
    patch.undo()
    return out


def test_an_fp16_bundle_stores_a_tied_table_once(exports):
    table = V * C * 2
    saved = exports["untied/fp16"]["size_bytes"] - exports["tied/fp16"]["size_bytes"]
    assert abs(saved - table) < 0.02 * table, (saved, table)


def test_keeping_the_tied_head_shrinks_int8keepstate_by_the_int8_copy(exports):
    keep, head = exports["tied/int8keepstate"], exports["tied/int8keepstate+head"]
    int8_head = V * C + V * C // 32 * 2                     # int8 weights + one fp16 scale per block of 32
    saved = head["size_bytes"] - keep["size_bytes"]
    assert abs(saved - int8_head) < 0.05 * int8_head, (saved, int8_head)
    assert keep["size_bytes"] < exports["tied/fp16"]["size_bytes"] < head["size_bytes"]   # now below fp16, before above
    kept = {r["layer"]: r for r in keep["kept"]}
    assert kept["lm_head"]["tied_to"] == HEAD and kept["lm_head"]["reason"] == TIED_REASON
    assert sorted(r["layer"] for r in keep["quantized"]) == [f"backbone.layers.{i}.mixer.out_proj"
                                                              for i in range(SHAPE["layers"])]
    assert all(f["quantized_weights"] == SHAPE["layers"] for f in keep["functions"].values())
    assert {r["layer"]: r["action"] for r in head["quantized"]}["lm_head"] == "int8"


def test_an_untied_head_is_still_quantised_by_its_role(exports):
    rec = exports["untied/int8keepstate"]
    head = next(r for r in rec["quantized"] if r["layer"] == "lm_head")
    assert head == {"layer": "lm_head", "shape": [V, C], "action": "int8", "reason": "matched 'lm_head'"}
    assert not any("tied_to" in r for r in rec["quantized"] + rec["kept"])
    assert rec["size_bytes"] < exports["untied/fp16"]["size_bytes"] - V * C * 0.9   # the head's int8 saving


# --- the built tree (tests/conftest.py tiny_results): export.json and the card --------------------
MODEL = "mamba2-tiny"


def test_the_built_mamba2_tiny_keeps_its_tied_head_and_the_card_says_why(tiny_results):
    lay = Layout(tiny_results, MODEL)
    rec = json.loads((lay.export("int8keepstate") / "export.json").read_text())
    kept = {r["layer"]: r for r in rec["kept"]}
    assert kept["lm_head"]["tied_to"] == HEAD and kept["lm_head"]["reason"] == TIED_REASON
    assert "lm_head" not in {r["layer"] for r in rec["quantized"]}
    fp16 = json.loads((lay.export("fp16") / "export.json").read_text())
    assert rec["size_bytes"] < fp16["size_bytes"]
    quant = [line for line in lay.card.read_text(encoding="utf-8").splitlines() if line.startswith("It leaves ")]
    assert len(quant) == 1 and TIED_REASON in quant[0] and "`lm_head`" in quant[0]
    assert "holds that table twice" not in lay.card.read_text(encoding="utf-8")


def test_the_card_shows_a_tied_head_a_raw_include_quantised(tiny_results, tmp_path, monkeypatch):
    """The card stage on a copy of mamba2-tiny's card inputs whose int8keepstate record quantised
    the tied head (as a raw include would): one line says the table is held twice."""
    from recurrent_coreai.pipeline.paths import stage_args
    from recurrent_coreai.stages import cli

    import yaml

    src, dst = tiny_results / MODEL, tmp_path / "results" / MODEL
    cfg = yaml.safe_load((tiny_results.parent / "config.yaml").read_text())   # the build's config (conftest)
    recipes = cfg["models"][MODEL]["recipes"]
    for rel in ["source/manifest.json", "source/README.md", *(f"export/{r}/export.json" for r in recipes),
                *(f"gate/{r}.json" for r in recipes)]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dst / rel)
    shutil.copytree(src / "vocab", dst / "vocab")
    shutil.copyfile(tiny_results / "toolchain.json", tmp_path / "results" / "toolchain.json")
    path = dst / "export" / "int8keepstate" / "export.json"
    rec = json.loads(path.read_text())
    head = next(r for r in rec["kept"] if r["layer"] == "lm_head")
    rec["kept"].remove(head)
    rec["quantized"].append({**head, "action": "int8", "reason": f"matched 'lm_head', although tied to {HEAD}: "
                                                                 "the bundle holds that table in fp16 and this int8 copy"})
    records.write_sealed(path, {k: v for k, v in rec.items() if k != records.SEAL}, "export")
    cfg["results"] = str(tmp_path / "results")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    out = tmp_path / "card" / "README.md"
    assert cli.card(["--config-file", str(config), "--model", MODEL,
                     *stage_args("card", tmp_path / "results", MODEL, recipes), "--out", str(out)]) == 0
    card = records.read_card(out)
    lines = [line for line in card.splitlines() if "holds that table twice" in line]
    assert lines == [f"`lm_head` is tied to `{HEAD}`, yet a raw include pattern quantises it: "
                     "the bundle holds that table twice (fp16 and int8)."]
    after = card.splitlines()[card.splitlines().index(lines[0]) + 1]
    assert after.startswith("Why this choice: "), after          # the line sits between the two, nothing lost
    assert not re.search(r"\n\n\n", card.split("<!-- quantization begin -->")[1].split("<!-- quantization end -->")[0])


@pytest.mark.parametrize("tied", [True, False])
def test_int8keepproj_on_mamba2_quantises_only_the_tied_head_and_is_refused(cfg, tied):
    """int8keepproj names RWKV's ffn.key/value (Mamba-2 has none) and lm_head: on a tied Mamba-2
    only the head's int8 copy would be added beside the fp16 table (the bundle grows, nothing of
    the model is quantised): refused before any weight is read; untied, the head is the model's own."""
    g = geometry(tied)
    q = quantize.resolve_roles(cfg["recipes"]["int8keepproj"]["quantize"], MAMBA2.roles, "int8keepproj",
                               MAMBA2.tied_linears(g))
    rows = quantize.plan(MAMBA2.decode_skeleton(g, torch.float16), q, "float16")
    if not tied:
        assert quantize.chosen(rows, q, "int8keepproj") == ["lm_head"]
        return
    with pytest.raises(PipelineError) as exc:
        quantize.chosen(rows, q, "int8keepproj")
    line = f"error: {exc.value}"
    assert line == ("error: recipe int8keepproj: quantises only lm_head (tied to backbone.embeddings.weight): the bundle "
                    "would keep that table in fp16 and add an int8 copy (larger than fp16) and quantise none of this "
                    "model's own linears (include ['.*\\\\.ffn\\\\.(key|value)$', 'lm_head'] matches no other) -- fix: "
                    "drop int8keepproj from this model's recipes, or name linears it has in "
                    "recipes/int8keepproj/quantize (roles or include)"), line
    # with one untied linear of its own beside the head the recipe is accepted (the card states the size)
    more = {**q, "include": q["include"] + [MAMBA2.roles["mixer_output"]]}
    rows = quantize.plan(MAMBA2.decode_skeleton(g, torch.float16), more, "float16")
    assert "lm_head" in quantize.chosen(rows, more, "int8keepproj")


def test_the_card_states_a_quantised_bundle_larger_than_fp16_with_both_sizes(exports):
    """int8keepstate with a raw include of the tied head (accepted: it quantises out_proj too) is
    larger than fp16 at this scale: the card's quantization block says so with both sizes; the
    plain int8keepstate (smaller) and a model without an fp16 recipe say nothing."""
    import jinja2

    from recurrent_coreai.stages import card

    recipes = {"fp16": {"dtype": "float16"}, "int8keepstate": {"dtype": "float16", "quantize": KEEPSTATE},
               "int8keepstate+head": {"dtype": "float16", "quantize": {**KEEPSTATE, "include": ["lm_head"]}}}
    ex = {r: exports[f"tied/{r}"] for r in recipes}
    big, fp16 = ex["int8keepstate+head"]["size_bytes"], ex["fp16"]["size_bytes"]
    assert big > fp16
    said = card.larger_than_fp16("int8keepstate+head", list(recipes), recipes, ex)
    assert said == f"{big:,} bytes against {fp16:,}"
    assert card.larger_than_fp16("int8keepstate", list(recipes), recipes, ex) is None
    assert card.larger_than_fp16("fp16", list(recipes), recipes, ex) is None
    assert card.larger_than_fp16("int8keepstate+head", ["int8keepstate+head"], recipes, ex) is None
    # the template's quantization block, rendered alone
    text = (card.resources.files(card.__package__) / "templates" / "model_card.md.j2").read_text()
    source = re.search(r"<!-- quantization begin -->\n(.*?)<!-- quantization end -->", text, re.S)[1]
    row = {"name": "r", "quantized": [{"layer": "x"}], "bits": "int8", "block": 32, "quantized_groups": "`x`",
           "kept": [], "kept_reasons": "", "kept_groups": "", "why": None}
    template = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True).from_string(source)
    plain = template.render(recipes=[{**row, "larger_than_fp16": None}])
    larger = template.render(recipes=[{**row, "larger_than_fp16": said}])
    line = f"**Its bundle is larger than this model's fp16 bundle** ({said}).\n"
    assert "larger" not in plain and line in larger
    assert larger.replace(line, "") == plain, larger   # one line more, the rest unchanged
