"""The ``bytes`` tokenizer kind (256 ids, id = byte value, an optional configured end of text) and the
tokenizer kind chosen per model (``models.<m>.tokenizer``, default the family's; ``families.tokenizer_of``).

The kind on its own (round trip, the device files and their re-derivation, the chat prompt), the
config's checks (every family with a vocab of at least 256 rows accepts ``bytes``; fewer, an unknown
kind, ``tokenizer_eos`` without ``bytes``: one line each), a synthetic model of every family with
``tokenizer: bytes`` through the source, vocab and reference stages' ``main`` (a temporary config),
the fit check naming a checkpoint's own tensors (``emb.weight`` of a BlinkDL .pth), the stage keys
and code fingerprints that follow the kind, and generate's byte-safe stream over byte tokens."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from recurrent_coreai import families, tokenizers
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline import fingerprint
from recurrent_coreai.pipeline.records import read_manifest, read_stream, read_vocab
from recurrent_coreai.stages.card import vocab_fit
from recurrent_coreai.stages.source import build_source
from recurrent_coreai.tokenizers import round_trip
from recurrent_coreai.util.errors import PipelineError

kind = tokenizers.kind("bytes")


def one_line(exc_info) -> str:
    line = f"error: {exc_info.value}"
    assert "\n" not in line and " -- fix: " in line, line
    return line


# --- the kind ------------------------------------------------------------------------------------------
def test_the_kind_is_registered_with_the_whole_interface():
    assert tokenizers.KINDS["bytes"] == "bytes" and kind.__name__ == "recurrent_coreai.tokenizers.bytes"
    for name in ("bake_stage", "load", "source_files", "carry", "fits", "DESCRIPTION", "CHAT_DESCRIPTION", "EOS",
                 "MIN_VOCAB", "DEVICE_FILE"):
        assert hasattr(kind, name), name
    assert kind.MIN_VOCAB == kind.N_IDS == 256
    # every kind states the smallest synthetic vocab its ids fit in (the config check reads it)
    assert {k: tokenizers.kind(k).MIN_VOCAB for k in tokenizers.KINDS} == {
        "world": 65530, "hf-bpe": 257, "sp-bpe": 261, "bytes": 256}


@pytest.mark.parametrize("text", round_trip.TEXTS)
def test_the_shared_texts_round_trip_and_encode_to_their_bytes(text):
    tok = kind.BytesTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8") == tok.decode_bytes(ids)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_round_trip(data):
    tok = kind.BytesTokenizer(eos=0)
    assert tok.encode(data) == list(data)
    assert tok.decode_bytes(tok.encode(data)) == data


def test_ids_outside_a_byte_are_refused():
    tok = kind.BytesTokenizer()
    with pytest.raises(ValueError):
        tok.token_bytes(256)
    assert tok.n_ids == len(tok) == 256 and tok.eos is None


def test_the_chat_prompt_without_and_with_an_end_of_text_id():
    plain = kind.BytesTokenizer()
    assert plain.prompt("hi") == list(b"User: hi\n\nAssistant:")
    assert plain.prompt("hi", chat=False) == list(b"hi")
    assert "no end-of-text token" in plain.chat_description and plain.card_eos is None
    eos = kind.BytesTokenizer(eos=0)
    assert eos.prompt("hi") == [0] + list(b"User: hi\n\nAssistant:")
    assert eos.chat_description.startswith("token 0, then") and eos.card_eos == 0
    with pytest.raises(ValueError, match="byte 0x00, this model's end-of-text token"):
        eos.prompt("a\x00b")  # generate turns it into one line ("remove that character")


@pytest.mark.parametrize("bad", [256, -1, True, "0", 1.0])
def test_an_end_of_text_that_is_not_a_byte_is_one_line(bad):
    with pytest.raises(PipelineError) as exc:
        kind.check_eos(bad)
    assert "tokenizer_eos" in one_line(exc) and "is not a byte value" in str(exc.value)


# --- the vocab stage's files: written, re-derived, verified ----------------------------------------------
@pytest.mark.parametrize("eos", [None, 0, 10])
def test_bake_writes_the_derived_table_and_the_end_of_text(tmp_path, eos):
    out = tmp_path / "vocab"
    report = kind.bake_stage(tmp_path, out, {tokenizers.EOS_KEY: eos})
    assert sorted(p.name for p in out.iterdir()) == sorted(report["files"]) == ["bytes_tokenizer.json",
                                                                                  "bytes_vocab.tsv"]
    lines = (out / "bytes_vocab.tsv").read_text(encoding="ascii").splitlines()
    assert len(lines) == 256 == report["entries"]
    assert all(line == f"{i}\t{base64.b64encode(bytes([i])).decode()}" for i, line in enumerate(lines))
    assert json.loads((out / "bytes_tokenizer.json").read_text()) == {"eos": eos, "n_ids": 256}
    tok = kind.load(out)
    assert tok.eos == eos and tok.n_ids == 256
    # the same settings give the same bytes (the vocab stage is reproducible)
    again = kind.bake_stage(tmp_path, tmp_path / "again", {tokenizers.EOS_KEY: eos})
    assert again["files"] == report["files"]
    assert all((out / f).read_bytes() == (tmp_path / "again" / f).read_bytes() for f in report["files"])


def test_a_forged_table_with_two_ids_swapped_is_one_line(tmp_path):
    out = tmp_path / "vocab"
    kind.bake_stage(tmp_path, out, {})
    tsv = out / kind.DEVICE_FILE
    lines = tsv.read_text().splitlines()
    a, b = lines[65].split("\t")[1], lines[66].split("\t")[1]
    lines[65], lines[66] = f"65\t{b}", f"66\t{a}"  # ids still ascending: only the table says it is wrong
    tsv.write_text("\n".join(lines) + "\n")
    with pytest.raises(PipelineError) as exc:
        kind.load(out)
    assert one_line(exc).startswith(f"error: {tsv}: id 65 is b'B', the byte-level table has b'A' (id = byte value)")
    with pytest.raises(PipelineError, match="id 65 is b'B'"):
        kind.verify_table(tsv)


@pytest.mark.parametrize("damage, needle", [
    (lambda lines: lines.pop(), "has no id 255"),
    (lambda lines: lines.append(f"256\t{base64.b64encode(b'x').decode()}"), "has id 256, beyond"),
    (lambda lines: lines.__setitem__(0, "0\t"), "id 0 is b'', the byte-level table has b'\\x00'"),
])
def test_other_damage_to_the_table_is_one_line(tmp_path, damage, needle):
    out = tmp_path / "vocab"
    kind.bake_stage(tmp_path, out, {})
    tsv = out / kind.DEVICE_FILE
    lines = tsv.read_text().splitlines()
    damage(lines)
    tsv.write_text("\n".join(lines) + "\n")
    with pytest.raises(PipelineError) as exc:
        kind.load(out)
    assert needle in one_line(exc)


def test_a_damaged_end_of_text_file_is_one_line(tmp_path):
    out = tmp_path / "vocab"
    kind.bake_stage(tmp_path, out, {tokenizers.EOS_KEY: 0})
    (out / kind.CONFIG_FILE).write_text(json.dumps({"eos": 300, "n_ids": 256}))
    with pytest.raises(PipelineError) as exc:
        kind.load(out)
    assert "tokenizer_eos 300 is not a byte value" in one_line(exc)
    (out / kind.CONFIG_FILE).unlink()
    with pytest.raises(PipelineError) as exc:
        kind.load(out)
    assert f"{out / kind.CONFIG_FILE}: missing" in one_line(exc)


def test_a_tokenizer_pin_is_refused_for_the_bytes_kind(tmp_path):
    with pytest.raises(PipelineError) as exc:
        kind.fits(tmp_path, {tokenizers.PIN: "0" * 64}, {"emb.weight": 256}, "model.pth")
    assert "remove tokenizer_sha256" in one_line(exc)


# --- config ----------------------------------------------------------------------------------------------
def model_cfg(family: str, vocab: int, **extra) -> dict:
    fam = families.get(family)
    return {"enabled": True, "family": family, "dir": f"{family}-bytes", "license": "mit",
            "source": {"kind": "synthetic", "seed": 7, "shape": {**fam.tiny_shape, "vocab": vocab}},
            "recipes": ["fp32"], "targets": ["universal"], "publish": {"repo": None, "push": False}, **extra}


def with_models(cfg: dict, models: dict, tmp_path: Path) -> dict:
    out = {k: copy.deepcopy(v) for k, v in cfg.items() if k != cfgmod.ORIGIN_KEY}
    out.update(models=models, build=sorted(models), results=str(tmp_path / "results"))
    # a chat prompt of bytes is one token per byte: the four gate prompts need 179 steps
    out["gate"]["steps"] = 200
    return out


def test_the_schema_offers_every_kind():
    props = cfgmod.schema()["properties"]["models"]["additionalProperties"]["properties"]
    assert props["tokenizer"]["enum"] == list(tokenizers.KINDS)
    assert (props["tokenizer_eos"]["minimum"], props["tokenizer_eos"]["maximum"]) == (0, 255)


@pytest.mark.parametrize("family", families.NAMES)
def test_bytes_is_accepted_for_every_family_with_a_vocab_of_256_or_more(cfg, tmp_path, family):
    for vocab, eos in ((256, None), (256, 0), (320, 255)):
        extra = {"tokenizer": "bytes", **({"tokenizer_eos": eos} if eos is not None else {})}
        cfgmod.validate(with_models(cfg, {"m": model_cfg(family, vocab, **extra)}, tmp_path))
    assert families.tokenizer_of(model_cfg(family, 256, tokenizer="bytes")) == "bytes"
    assert families.tokenizer_of(model_cfg(family, 256)) == families.get(family).tokenizer


@pytest.mark.parametrize("family", families.NAMES)
def test_bytes_below_256_rows_is_one_line(cfg, tmp_path, family):
    with pytest.raises(PipelineError) as exc:
        cfgmod.validate(with_models(cfg, {"m": model_cfg(family, 255, tokenizer="bytes")}, tmp_path))
    assert one_line(exc) == ("error: config: models/m/source/shape/vocab 255 is smaller than the bytes tokenizer's "
                             "256 ids -- fix: use vocab >= 256, or set models/m/tokenizer to the kind the model was "
                             "trained with")


def test_an_unknown_kind_is_one_line(cfg, tmp_path):
    with pytest.raises(PipelineError) as exc:
        cfgmod.validate(with_models(cfg, {"m": model_cfg("rwkv7", 256, tokenizer="byte")}, tmp_path))
    line = one_line(exc)
    assert line.startswith("error: config: invalid value at models/m/tokenizer: 'byte' is not one of ")
    assert "world, hf-bpe, sp-bpe, bytes" in line


@pytest.mark.parametrize("family", families.NAMES)
def test_an_end_of_text_without_the_bytes_kind_is_one_line(cfg, tmp_path, family):
    with pytest.raises(PipelineError) as exc:
        cfgmod.validate(with_models(cfg, {"m": model_cfg(family, 65536, tokenizer_eos=0)}, tmp_path))
    own = families.get(family).tokenizer
    assert one_line(exc).startswith(f"error: config: models/m/tokenizer_eos is set, but the model's tokenizer is {own}")
    with pytest.raises(PipelineError) as exc:
        cfgmod.validate(with_models(cfg, {"m": model_cfg(family, 256, tokenizer="bytes", tokenizer_eos=256)},
                                    tmp_path))
    assert "invalid value at models/m/tokenizer_eos: 256 is greater than the maximum of 255" in one_line(exc)


def test_the_world_vocab_check_follows_the_chosen_kind(cfg, tmp_path):
    """World for a Mamba-2: its 65530 ids must fit; the family's own kind needs no such vocab."""
    cfgmod.validate(with_models(cfg, {"m": model_cfg("mamba2", 257)}, tmp_path))  # hf-bpe: 256 bytes + end of text
    with pytest.raises(PipelineError) as exc:
        cfgmod.validate(with_models(cfg, {"m": model_cfg("mamba2", 256, tokenizer="world")}, tmp_path))
    assert "vocab 256 is smaller than the world tokenizer's 65530 ids" in one_line(exc)


def test_the_kind_reaches_exactly_the_stages_that_use_it(cfg, tmp_path):
    """A change of tokenizer reruns source, vocab, reference, card and publish (their settings hold it);
    tokenizer_eos only vocab, card and publish (the vocab output carries it on); no other stage."""
    c = with_models(cfg, {"m": model_cfg("rwkv7", 256, tokenizer="bytes", tokenizer_eos=0)}, tmp_path)
    names = {"model": "m", "recipe": "fp32", "target": "universal"}
    uses = {stage: set(cfgmod.settings(c, stage, **names).get("models", {}).get("m", {})) & {"tokenizer", "tokenizer_eos"}
            for stage in cfgmod.STAGE_KEYS}
    assert {s for s, keys in uses.items() if "tokenizer" in keys} == {
        "source", "vocab", "reference", "card", "stage_and_push"}
    assert {s for s, keys in uses.items() if "tokenizer_eos" in keys} == {"vocab", "card", "stage_and_push"}
    # the default models' settings are what they were: the keys are absent, so nothing reruns
    default = {"model": "rwkv7-tiny", "recipe": "fp32", "target": "universal"}
    assert "tokenizer" not in cfgmod.settings(cfg, "vocab", **default)["models"]["rwkv7-tiny"]


def test_the_code_fingerprint_follows_the_model_kind():
    bytes_py = "recurrent_coreai/tokenizers/bytes.py"
    for rule in fingerprint.TOKENIZER_RULES:
        assert bytes_py in fingerprint.code_files(rule, "mamba2", "bytes")
        assert bytes_py not in fingerprint.code_files(rule, "mamba2")
        assert "recurrent_coreai/tokenizers/bpe.py" not in fingerprint.code_files(rule, "mamba2", "bytes")
        assert fingerprint.digest(rule, "mamba2", "bytes") != fingerprint.digest(rule, "mamba2")
        assert fingerprint.digest(rule, "mamba2", "hf-bpe") == fingerprint.digest(rule, "mamba2")
    for rule in set(fingerprint.ENTRY) - fingerprint.TOKENIZER_RULES:  # export, doctor, gate ...: no tokenizer
        assert fingerprint.digest(rule, "mamba2", "bytes") == fingerprint.digest(rule, "mamba2")
    assert fingerprint.attested("gdn", "bytes")["vocab"] == fingerprint.digest("vocab", "gdn", "bytes")


# --- every family, synthetic, tokenizer: bytes, through source -> vocab -> reference --------------------
@pytest.fixture(scope="module")
def bytes_models(cfg, tmp_path_factory):
    """A config whose models are each family's tiny shape with vocab 256 and ``tokenizer: bytes``
    (RWKV-6 written as a BlinkDL .pth; Mamba-2 with end of text 0), and the stages' outputs."""
    tmp = tmp_path_factory.mktemp("bytes")
    models = {}
    for family in families.NAMES:
        m = model_cfg(family, 256, tokenizer="bytes", **({"tokenizer_eos": 0} if family == "mamba2" else {}))
        if family == "rwkv6":
            m["source"]["layout"] = "blinkdl"
        models[f"{family}-bytes"] = m
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(with_models(cfg, models, tmp), sort_keys=True, allow_unicode=True))
    from recurrent_coreai.stages import reference, source, vocab

    outs = {}
    for name in models:
        base = tmp / "results" / name
        common = ["--config-file", str(path), "--model", name]
        assert source.main(common + ["--out", str(base / "source")]) == 0
        assert vocab.main(common + ["--source", str(base / "source"), "--out", str(base / "vocab")]) == 0
        assert reference.main(common + ["--source", str(base / "source"), "--vocab", str(base / "vocab"),
                                        "--out", str(base / "reference.npz")]) == 0
        outs[name] = base
    return cfgmod.load(path), outs


@pytest.mark.parametrize("family", families.NAMES)
def test_a_byte_level_model_of_every_family_goes_through_source_vocab_and_reference(bytes_models, family):
    cfg, outs = bytes_models
    name = f"{family}-bytes"
    base = outs[name]
    # no tokenizer files in the source (the table is fixed), none carried
    assert not [p for p in (base / "source").iterdir() if "vocab" in p.name or p.name.startswith("tokenizer")]
    assert sorted(read_vocab(base / "vocab")) == ["bytes_tokenizer.json", "bytes_vocab.tsv"]
    tok = kind.load(base / "vocab")
    assert tok.eos == (0 if family == "mamba2" else None)
    stream = read_stream(base / "reference.npz")
    first = tok.prompt(cfg["gate"]["prompts"][0])
    assert list(stream["tokens"][:len(first)]) == first  # the byte-level chat prompt, as the kind writes it
    assert int(stream["tokens"].max()) < 256 and stream["logits"].shape[1] == 256
    fam = families.get(family)
    geom = fam.geometry_from_dict(read_manifest(base / "source")["geometry"])
    assert vocab_fit(fam, geom, tok.n_ids) == "256 rows, tokenizer 256 ids"


def test_padding_rows_of_a_byte_level_model_are_stated(tmp_path):
    fam = families.get("rwkv7")
    geom = fam.geometry_from_shape({**fam.tiny_shape, "vocab": 264}, "test")
    assert vocab_fit(fam, geom, kind.N_IDS) == "264 rows, tokenizer 256 ids: 8 padding rows never produced by the tokenizer"


# --- the fit check names the checkpoint's own tensors ------------------------------------------------------
@pytest.mark.parametrize("family, layout, tensor", [
    ("rwkv7", "blinkdl", "emb.weight"),
    ("rwkv7", "fla-split", "model.embeddings.weight"),
    ("rwkv6", "blinkdl", "emb.weight"),
    ("rwkv6", "hf", "rwkv.embeddings.weight"),
    ("mamba2", "mamba-ssm", "backbone.embedding.weight"),
    ("mamba2", "hf", "backbone.embeddings.weight"),
    ("gdn", "fla", "model.embeddings.weight"),
])
def test_the_fit_error_names_the_files_own_tensor(cfg, tmp_path, family, layout, tensor):
    fam = families.get(family)
    geom = fam.geometry_from_shape({**fam.tiny_shape, "vocab": 200}, "test")
    dest = tmp_path / "ckpt"
    dest.mkdir()
    weights = fam.write_layout(dict(fam.synthetic_tensors(geom, 1)), dest, layout, geom)
    src = dest if (dest / "config.json").is_file() else weights
    spec = {"family": family, "tokenizer": "bytes", "license": "mit", "source": {"kind": "path", "path": str(src)}}
    with pytest.raises(PipelineError) as exc:
        build_source("m", spec, cfg["vocab"], tmp_path / "source")
    assert one_line(exc).startswith(
        f"error: {src}: {tensor} has 200 rows, but the byte-level tokenizer (models.<m>.tokenizer: bytes) has token "
        "ids up to 255: ids 200..255 have no row -- fix: ")
    assert not (tmp_path / "source").exists()


def test_a_byte_level_checkpoint_is_accepted_where_the_world_vocab_refuses_it(cfg, tmp_path):
    """The case of the report: a BlinkDL .pth whose emb.weight has 256 rows, refused as World (naming
    emb.weight), accepted with tokenizer: bytes."""
    fam = families.get("rwkv6")
    geom = fam.geometry_from_shape({**fam.tiny_shape, "vocab": 256}, "test")
    dest = tmp_path / "ckpt"
    dest.mkdir()
    pth = fam.write_layout(dict(fam.synthetic_tensors(geom, 1)), dest, "blinkdl", geom)
    spec = {"family": "rwkv6", "license": "mit", "source": {"kind": "path", "path": str(pth)}}
    with pytest.raises(PipelineError) as exc:
        build_source("m", spec, cfg["vocab"], tmp_path / "world")
    assert one_line(exc).startswith(f"error: {pth}: emb.weight has 256 rows, but the RWKV World vocabulary has token "
                                    "ids up to 65529")
    manifest = build_source("m", {**spec, "tokenizer": "bytes"}, cfg["vocab"], tmp_path / "bytes")
    assert manifest["layout"] == "blinkdl" and manifest["geometry"]["vocab"] == 256


# --- generate: a character split over byte tokens streams whole -------------------------------------------
class Scripted:
    """A stand-in for the runtime session that 'predicts' a fixed token sequence (one-hot logits)."""

    function = "main"

    def __init__(self, script):
        self.script, self.i = list(script), 0

    def _next(self):
        logits = np.zeros(256)
        logits[self.script[min(self.i, len(self.script) - 1)]] = 1.0
        self.i += 1
        return logits

    def feed(self, tokens):
        return self._next()

    def step(self, token):
        return self._next()


def test_generate_streams_multi_byte_characters_whole():
    from recurrent_coreai.tools import generate as gen
    from recurrent_coreai.tools.sampling import Sampler, Sampling

    tok = kind.BytesTokenizer()
    script = list("é日🐦!".encode())  # 2 + 3 + 4 + 1 bytes, one token each
    pieces: list[str] = []
    res = gen.generate(Scripted(script), tok, tok.prompt("hi"), Sampler(Sampling()), len(script),
                       on_text=pieces.append)
    assert pieces == ["é", "日", "🐦", "!"] and res.text == "é日🐦!"
    assert res.stop_reason == "length" and res.tokens == script  # no end of text: it stops by length
    # with an end-of-text id configured, that id ends the text
    eos = kind.BytesTokenizer(eos=0)
    res = gen.generate(Scripted(list("ok".encode()) + [0]), eos, eos.prompt("hi"), Sampler(Sampling()), 50)
    assert res.text == "ok" and res.stop_reason == "eos"
    # bytes that never complete a character become U+FFFD at the end, not lost
    res = gen.generate(Scripted([ord("a"), 0xF0, 0x9F]), tok, [1], Sampler(Sampling()), 3)
    assert res.text == "a\ufffd" and res.stop_reason == "length"


# --- the catalog and the publish receipt: the model's kind, not the family's -------------------------------
def test_the_catalog_states_the_kind_the_receipt_records():
    """The publish receipt records the model's own ``tokenizer`` (where it names one); the catalog's
    io_contract takes the kind from it through families.tokenizer_of."""
    from recurrent_coreai.hub import catalog

    fam = families.get("rwkv7")
    geom = fam.geometry_from_shape({**fam.tiny_shape, "vocab": 256}, "test")
    states = {s.name: list(s.shape) for s in fam.state_specs(geom)}
    record = {"bundle": "b.aimodel", "geometry": geom.as_dict(), "states": states, "state_dtype": "float32",
              "functions": {"main": {"role": "decode", "tokens_per_call": 1, "state_writes": {n: 1 for n in states},
                                     "inputs": [{"name": "input_ids", "shape": [1, 1], "dtype": "int32"}],
                                     "outputs": [{"name": "logits", "shape": [1, 1, 256], "dtype": "float32"}]}}}
    receipt = {"family": "rwkv7", "tokenizer": "bytes"}
    contract = catalog.io_contract(fam, {"fp32": record}, "aimodel/b/bytes_vocab.tsv", families.tokenizer_of(receipt))
    detok = contract["outputs"][0]["decoding"]["detokenization"]
    assert detok.startswith(kind.DESCRIPTION) and "bytes_vocab.tsv" in detok
    default = catalog.io_contract(fam, {"fp32": record}, None, families.tokenizer_of({"family": "rwkv7"}))
    assert default["outputs"][0]["decoding"]["detokenization"].startswith(tokenizers.kind("world").DESCRIPTION)
    assert default == catalog.io_contract(fam, {"fp32": record}, None)  # the family's, as before
