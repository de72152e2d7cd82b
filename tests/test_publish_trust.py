"""Staging on a copy of the built tiny tree (issue 34, cases 2 and 6; docs/bad-inputs.md rows N6,
N11): a forged device vocabulary (two ids swapped, vocab.record.json sealed again) is not staged;
the staged tree shares no inode with the stage outputs, so an in-place edit of one after staging
leaves the staged bytes as checked; a failing gate run by hand leaves only ``.failed.*``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

import test_publish as tp
from recurrent_coreai.pipeline import records
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.stages import cli, gate
from tampering import swap_two_tokens
from test_publish import RECIPES, no_token  # noqa: F401

MODEL = "rwkv7-tiny"  # the World vocabulary's private-use tokens (its device table)
GATED = "rwkv7-trained"  # the failing gate's model: any vocabulary; a 256-id head runs its gate ~7x faster


def expected_tree(results):
    return tp.expected_tree(results, model=MODEL)


def publish_args(results):
    return tp.publish_args(results, model=MODEL)


def write_config(path, **changes):
    return tp.write_config(path, model=MODEL, **changes)

RESULTS: Path = Path(__file__).resolve().parents[1] / "results"  # set to the session-built tree by conftest.py


def copy_results(tmp_path: Path, model: str) -> Path:
    tp.RESULTS = RESULTS  # test_publish's helpers read its module's RESULTS
    return tp.copy_results(tmp_path / "results", model=model)


@pytest.fixture
def results_copy(tmp_path):
    return copy_results(tmp_path, MODEL)


def _private(path: Path) -> Path:
    """``path`` as its own inode (copy_results hard-links large files from the shared tree)."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return path


def _publish(results: Path, tmp_path: Path, capsys) -> tuple[int, str, Path]:
    config = write_config(tmp_path / "config.yaml")
    out = tmp_path / "out" / "publish"
    rc = cli.publish(["--config-file", str(config), "--model", MODEL, *publish_args(results), "--out", str(out)])
    return rc, capsys.readouterr().err, out


def test_a_forged_vocabulary_resealed_is_not_staged(results_copy, tmp_path, no_token, capsys):  # noqa: F811
    vocab = results_copy / MODEL / "vocab"
    table = _private(vocab / "rwkv_vocab.tsv")
    swap_two_tokens(table)
    records.write_vocab_record(vocab)  # sealed again: every seal check passes
    records.read_vocab(vocab)
    rc, err, out = _publish(results_copy, tmp_path, capsys)
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {table}: disagrees with {results_copy / MODEL / 'source'}: differs from the table "
                          "the world tokenizer kind bakes from the tokenizer file it was made from"), err
    assert not out.exists()


def test_the_staged_tree_shares_no_inode_with_the_stage_outputs(results_copy, tmp_path, no_token, capsys):  # noqa: F811
    rc, err, out = _publish(results_copy, tmp_path, capsys)
    assert rc == 0, err
    staged = {rel: src for rel, src in expected_tree(results_copy).items() if rel != "README.md" and src is not None}
    for rel, src in staged.items():
        assert (out / rel).stat().st_ino != src.stat().st_ino, rel
    receipt = json.loads((out / "publish.json").read_text())
    # an in-place edit of a stage output after staging: the staged file is still the checked bytes
    table = _private(results_copy / MODEL / "vocab" / "rwkv_vocab.tsv")
    with open(table, "r+b") as fh:
        fh.seek(10)
        fh.write(b"\x00")
    rel = f"universal/{MODEL}-fp32/rwkv_vocab.tsv"
    assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == receipt["files"][rel]["sha256"]
    assert records.read_receipt(out)  # every staged file against the receipt


def test_a_failing_gate_run_by_hand_leaves_only_the_failed_record(tmp_path, capsys):
    """The passing fp16.json/.tsv of an earlier run go when the gate, run again by hand with a
    stricter limit, fails: only fp16.failed.json/.tsv are left (docs/bad-inputs.md row 47)."""
    results_copy = copy_results(tmp_path, GATED)
    lay = Layout(results_copy, GATED)
    for name in ("fp16.json", "fp16.tsv"):
        assert (lay.gate_json("fp16").parent / name).is_file()
    raw = yaml.safe_load(tp.write_config(tmp_path / "config.yaml", model=GATED).read_text())
    raw["gate"]["thresholds"]["fp16"]["max_abs_dlogits"] = 1e-9
    conf = tmp_path / "strict.yaml"
    conf.write_text(yaml.safe_dump(raw, sort_keys=False))
    aot = results_copy / GATED / "aot" / "universal" / "fp16"
    rc = gate.main(["--config-file", str(conf), "--model", GATED, "--recipe", "fp16", "--export",
                    str(lay.export("fp16")), "--aot", str(aot), "--reference", str(lay.reference),
                    "--json", str(lay.gate_json("fp16")), "--tsv", str(lay.gate_tsv("fp16"))])
    err = capsys.readouterr().err
    assert rc == 1 and f"gate FAILED for {GATED}/fp16: max|dlogits|" in err, err
    assert not lay.gate_json("fp16").exists() and not lay.gate_tsv("fp16").exists()
    assert lay.gate_json("fp16").with_suffix(".failed.json").is_file()
    assert lay.gate_tsv("fp16").with_suffix(".failed.tsv").is_file()
