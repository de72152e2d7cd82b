"""``status`` says when a gate's verdict is not the config's or not the last one (issue 34, case 6;
docs/bad-inputs.md row N11): a gate JSON recorded with other thresholds, near-tie epsilon or
prompts than the config in force gives is stale (``config: gate (...)``), not "pass, stale: no";
where a ``.failed.json`` is newer than the passing JSON beside it, the row is FAIL."""

from __future__ import annotations

import json
import os

import yaml

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline.paths import Layout

from test_status import table, tree  # noqa: F401  (the fixture: a hand-made tree of rwkv7-tiny's records)

MODEL = "rwkv7-tiny"


def _gate_settings(root, recipe: str) -> dict:
    cfg = cfgmod.load(root / "config.yaml")
    return cfgmod.gate_settings(cfgmod.settings(cfg, "gate", model=MODEL, recipe=recipe), recipe)


def _with_settings(root, recipe: str) -> None:
    """The fp32 gate JSON as the gate writes it: with the settings it ran (the config's)."""
    path = Layout(root / "results", MODEL).gate_json(recipe)
    record = json.loads(path.read_text())
    s = _gate_settings(root, recipe)
    record.update(thresholds=s["thresholds"], near_tie_epsilon=s["near_tie_epsilon"], prompts=s["prompts"])
    path.write_text(json.dumps(record))


def _edit_config(root, change) -> None:
    path = root / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    change(raw)
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))


def test_a_gate_recorded_with_the_configs_settings_is_not_stale(tree):  # noqa: F811
    _with_settings(tree, "fp32")
    assert table(tree)["fp32"]["stale"] == "no"


def test_a_gate_the_config_in_force_has_other_thresholds_for_is_stale(tree):  # noqa: F811
    _with_settings(tree, "fp32")
    _edit_config(tree, lambda raw: raw["gate"]["thresholds"]["fp32"].update(min_agree=0.5))
    row = table(tree)["fp32"]
    assert (row["gate"], row["stale"]) == ("pass", "config: gate (thresholds)"), row


def test_other_prompts_and_epsilon_are_named_too(tree):  # noqa: F811
    _with_settings(tree, "fp32")

    def change(raw):
        raw["gate"]["prompts"] = raw["gate"]["prompts"][:-1]
        raw["gate"]["near_tie_epsilon"] = raw["gate"]["near_tie_epsilon"] / 2
    _edit_config(tree, change)
    assert table(tree)["fp32"]["stale"] == "config: gate (near_tie_epsilon, prompts)"


def test_a_newer_failed_gate_beside_a_passing_one_is_the_verdict(tree):  # noqa: F811
    lay = Layout(tree / "results", MODEL)
    passing, failed = lay.gate_json("fp32"), lay.gate_json("fp32").with_suffix(".failed.json")
    failed.write_text(json.dumps({"recipe": "fp32", "pass": False, "agree_counted": 3, "counted": 40,
                                  "max_abs_dlogits": 9.0}))
    os.utime(passing, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    os.utime(failed, ns=(2_000_000_000_000_000_000, 2_000_000_000_000_000_000))
    assert (table(tree)["fp32"]["gate"], table(tree)["fp32"]["top-1"]) == ("FAIL", "3/40")
    os.utime(failed, ns=(500_000_000_000_000_000, 500_000_000_000_000_000))  # an older failure: the pass is the last
    assert (table(tree)["fp32"]["gate"], table(tree)["fp32"]["top-1"]) == ("pass", "40/40")
