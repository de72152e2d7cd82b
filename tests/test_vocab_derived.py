"""The vocab stage's tables re-derived before staging and recording (issue 34, case 2;
docs/bad-inputs.md row N6): for every tokenizer kind, a device table with two ids swapped and its
``vocab.record.json`` sealed again -- sealed, so the seal check passes -- is refused in one line
naming the table, by publish's checks (derivation.check_publish_inputs -> check_vocab) and by what
scripts/dvc_record.py checks of a vocab stage (derivation.check_stage); the tables as baked pass."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from recurrent_coreai import tokenizers
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline.records import write_vocab_record
from recurrent_coreai.stages import derivation
from recurrent_coreai.util.errors import PipelineError

from tampering import rewrite

ROOT = Path(__file__).resolve().parents[1]
# kind -> (the family a model of it is, its device table)
KINDS = {"world": ("rwkv7", "rwkv_vocab.tsv"), "hf-bpe": ("mamba2", "bpe_vocab.tsv"),
         "sp-bpe": ("gdn", "spbpe_vocab.tsv"), "bytes": ("rwkv7", "bytes_vocab.tsv")}


def swap_two_tokens(path: Path, a: int = 100, b: int = 101) -> None:
    """Ids ``a`` and ``b`` of a device table swap their bytes (an app would decode wrongly); a new
    inode, the file's times kept (tampering.rewrite). tampering.swap_two_tokens swaps ids 300 and
    301, past the byte-level table's 256."""
    lines = path.read_bytes().split(b"\n")
    ia, ib = lines[a].index(b"\t"), lines[b].index(b"\t")
    assert lines[a][ia:] != lines[b][ib:]
    lines[a], lines[b] = lines[a][:ia] + lines[b][ib:], lines[b][:ib] + lines[a][ia:]
    rewrite(path, b"\n".join(lines))


def _settings(cfg: dict, kind: str, eos: int | None = None) -> dict:
    model = {"family": KINDS[kind][0], "tokenizer": kind, **({"tokenizer_eos": eos} if eos is not None else {})}
    return {"models": {"m": model}, "vocab": copy.deepcopy(cfg["vocab"])}


def _baked(cfg: dict, tmp_path: Path, kind: str, eos: int | None = None) -> tuple[Path, Path, dict]:
    """(source, vocab, settings): a synthetic source's tokenizer files and the vocab stage's output."""
    mod = tokenizers.kind(kind)
    source, vocab = tmp_path / "source", tmp_path / "vocab"
    source.mkdir()
    settings = _settings(cfg, kind, eos)
    mod.source_files(source, {**settings["vocab"], "vocab_size": 1024})
    mod.bake_stage(source, vocab, {**settings["vocab"], tokenizers.EOS_KEY: eos})
    write_vocab_record(vocab)
    return source, vocab, settings


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_table_with_two_ids_swapped_and_resealed_is_refused(cfg, tmp_path, kind):
    source, vocab, settings = _baked(cfg, tmp_path, kind)
    assert derivation.check_vocab(vocab, "m", settings, source)  # as baked: passes
    table = vocab / KINDS[kind][1]
    swap_two_tokens(table)
    write_vocab_record(vocab)  # sealed again: the seal check alone passes it
    with pytest.raises(PipelineError) as exc:
        derivation.check_vocab(vocab, "m", settings, source)
    line = str(exc.value)
    assert line == (f"{table}: disagrees with {source}: differs from the table the {kind} tokenizer kind bakes from "
                    "the tokenizer file it was made from (a table edited and its vocab.record.json sealed again?) -- "
                    "fix: rerun it: snakemake --cores 1 publish --forcerun vocab"), line


@pytest.mark.parametrize("kind", ["hf-bpe", "sp-bpe"])
def test_a_tokenizer_json_edited_beside_its_table_is_refused(cfg, tmp_path, kind):
    """The staged tokenizer.json is the source's, byte for byte: one whose bytes differ (here one
    token's spelling, the table left alone) and sealed again is not what the source bakes to."""
    source, vocab, settings = _baked(cfg, tmp_path, kind)
    path = vocab / "tokenizer.json"
    rewrite(path, path.read_bytes().replace(b'"ab"', b'"ba"', 1) if b'"ab"' in path.read_bytes()
            else path.read_bytes() + b"\n")
    write_vocab_record(vocab)
    with pytest.raises(PipelineError, match=f"{path}: disagrees with {source}: differs from the table"):
        derivation.check_vocab(vocab, "m", settings, source)


def test_the_bytes_kinds_end_of_text_is_derived_from_the_config_in_force(cfg, tmp_path):
    """A bytes_tokenizer.json made for end of text 0, checked with the config's 10: refused."""
    source, vocab, settings = _baked(cfg, tmp_path, "bytes", eos=0)
    derivation.check_vocab(vocab, "m", settings, source)
    with pytest.raises(PipelineError, match="bytes_tokenizer.json: disagrees with .*differs from the table the bytes"):
        derivation.check_vocab(vocab, "m", _settings(cfg, "bytes", eos=10), source)


def test_a_file_added_to_the_vocab_output_and_sealed_is_refused(cfg, tmp_path):
    source, vocab, settings = _baked(cfg, tmp_path, "sp-bpe")
    (vocab / "extra.tsv").write_text("0\tAA==\n")
    write_vocab_record(vocab)
    with pytest.raises(PipelineError, match=r"extra.tsv: disagrees with .*: is not among the files the sp-bpe"):
        derivation.check_vocab(vocab, "m", settings, source)


def test_dvc_record_checks_a_vocab_stage_against_its_source(cfg, tmp_path):
    """What scripts/dvc_record.py checks of a vocab stage it would record: its command's --source
    and --out, with the config its --config-file names (gdn-tiny: sp-bpe)."""
    raw = cfgmod.read_yaml(ROOT / "config.yaml")
    source, vocab, _ = _baked(cfg, tmp_path, "sp-bpe")
    conf = tmp_path / "config.yaml"
    conf.write_text((ROOT / "config.yaml").read_text())
    assert raw["models"]["gdn-tiny"]["family"] == "gdn"
    stage = {"cmd": f"python scripts/vocab.py --config-file {conf} --model gdn-tiny --source {source} --out {vocab}"}
    derivation.check_stage(stage)
    swap_two_tokens(vocab / "spbpe_vocab.tsv")
    write_vocab_record(vocab)
    with pytest.raises(PipelineError, match="spbpe_vocab.tsv: disagrees with"):
        derivation.check_stage(stage)


def test_a_file_of_the_table_removed_and_resealed_is_named_missing(cfg, tmp_path):
    source, vocab, settings = _baked(cfg, tmp_path, "sp-bpe")
    (vocab / "tokenizer.json").unlink()
    write_vocab_record(vocab)
    with pytest.raises(PipelineError, match=r"tokenizer.json: disagrees with .*: is missing from the files the sp-bpe"):
        derivation.check_vocab(vocab, "m", settings, source)


def test_a_stage_command_is_read_as_dvc_yaml_writes_it():
    """derivation.cmd_args: the script's stage name and its options (dashes as underscores), the
    words before the script and a positional word before the first option left out."""
    assert derivation.cmd_args("python scripts/vocab.py --config-file c.yaml --model m --source a b") == (
        "vocab", {"config_file": ["c.yaml"], "model": ["m"], "source": ["a", "b"]})
    assert derivation.cmd_args("env X=1 python scripts/gate.py pos --json-out j") == ("gate", {"json_out": ["j"]})
    assert derivation.cmd_args("python tools/other.py --model m") == ("", {})
    assert derivation.cmd_args("bash run.sh") == ("", {})
