"""The vocabulary fits the model (issue 26): every id a tokenizer produces (added tokens included)
has a row in the embedding and in the head, checked by the source stage before anything runs on
the weights; padding rows above the tokenizer's ids are accepted and stated on the card; added-token
ids with a gap are refused, not renumbered; a pinned tokenizer.json with other bytes is refused.

Each case runs the stage functions in-process (source: ``build_source``; vocab: the kind's
``bake_stage``; the card's ``vocab_fit``) on small synthetic checkpoints of every family."""

from __future__ import annotations

import copy
import json

import pytest

from recurrent_coreai import families, tokenizers
from recurrent_coreai.pipeline import config
from recurrent_coreai.stages.card import vocab_fit
from recurrent_coreai.stages.source import build_source
from recurrent_coreai.tokenizers import bpe, world
from recurrent_coreai.util.errors import PipelineError

LAYOUT = {"rwkv7": None, "rwkv6": "blinkdl", "mamba2": "hf"}  # None: the normal form; blinkdl: no config.json


def checkpoint(tmp_path, family_name: str, vocab: int, tokenizer_json: str | None = None, head_rows: int | None = None):
    """A checkpoint of ``family_name`` with ``vocab`` embedding rows (the head ``head_rows``, if given),
    in the family's layout of LAYOUT, in the family's tiny shape (``Family.tiny_shape``) otherwise; a
    Mamba-2 gets ``tokenizer_json`` (default: the synthetic 1024 ids)."""
    family = families.get(family_name)
    geom = family.geometry_from_shape({**family.tiny_shape, "vocab": vocab}, "test")
    dest = tmp_path / "ckpt"
    dest.mkdir()
    weights = family.write_layout(dict(family.synthetic_tensors(geom, 1)), dest, LAYOUT[family_name] or family.layouts[0],
                                  geom)
    if head_rows is not None:  # the file cut afterwards (write_layout checks the shapes)
        from safetensors.torch import load_file, save_file

        sd = load_file(weights)
        head = family.vocab_tensors[1]
        sd[head] = sd[head][:head_rows].clone()
        save_file(sd, weights)
    if family.tokenizer == "hf-bpe":
        (dest / bpe.TOKENIZER_FILE).write_text(tokenizer_json or bpe.synthetic_tokenizer_json(), encoding="utf-8")
    return dest if (dest / "config.json").is_file() else weights


def source(tmp_path, family_name: str, src, vocab_cfg: dict, pin: str | None = None):
    spec = {"kind": "path", "path": str(src), **({"tokenizer_sha256": pin} if pin else {})}
    out = tmp_path / "source"
    manifest = build_source("m", {"family": family_name, "source": spec, "license": "mit"}, vocab_cfg, out)
    return manifest, out


def refused(tmp_path, family_name: str, src, vocab_cfg: dict, pin: str | None = None) -> str:
    """The one line the source stage refuses with; nothing left behind."""
    with pytest.raises(PipelineError) as exc:
        source(tmp_path, family_name, src, vocab_cfg, pin)
    line = f"error: {exc.value}"
    assert "\n" not in line
    assert not (tmp_path / "source").exists() and not list(tmp_path.glob(".source.*"))
    return line


# --- the embedding smaller than the tokenizer ------------------------------------------------------
@pytest.mark.parametrize("family_name,rows,tensor,tokenizer,last", [
    ("rwkv7", 1000, "model.embeddings.weight", "the RWKV World vocabulary", 65529),
    ("rwkv6", 1000, "emb.weight", "the RWKV World vocabulary", 65529),  # a BlinkDL .pth: its own name
    ("mamba2", 960, "backbone.embeddings.weight", "its tokenizer.json", 1023),
    ("mamba2", 512, "backbone.embeddings.weight", "its tokenizer.json", 1023),
])
def test_an_embedding_smaller_than_the_tokenizer_is_one_line_at_the_source_stage(tmp_path, cfg, family_name, rows,
                                                                                  tensor, tokenizer, last):
    src = checkpoint(tmp_path, family_name, rows)
    line = refused(tmp_path, family_name, src, cfg["vocab"])
    assert line.startswith(f"error: {src}: {tensor} has {rows} rows, but {tokenizer} has token ids up to {last}: "
                           f"ids {rows}..{last} have no row -- fix: ")
    assert "every token id needs a row in the embedding and the head" in line


# --- the head smaller ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family_name,rows,head_rows,head", [
    ("rwkv7", 65536, 1000, "lm_head.weight"),
    ("mamba2", 1024, 960, "lm_head.weight"),
])
def test_a_head_smaller_than_the_tokenizer_is_one_line(tmp_path, cfg, family_name, rows, head_rows, head):
    """The embedding fits, the head does not: the normal form refuses a head of other rows than the
    embedding (so the fit check never sees one), naming the tensor and both shapes."""
    src = checkpoint(tmp_path, family_name, rows, head_rows=head_rows)
    line = refused(tmp_path, family_name, src, cfg["vocab"])
    hidden = families.get(family_name).tiny_shape["hidden"]
    assert f"model.safetensors: tensor {head} has shape [{head_rows}, {hidden}], expected [{rows}, {hidden}] -- fix: " in line


# --- padding rows: accepted, and stated on the card --------------------------------------------------
def test_padding_rows_are_accepted_and_stated_mamba2(tmp_path, cfg):
    src = checkpoint(tmp_path, "mamba2", 1032)  # the 1024-id tokenizer, 8 rows of padding
    manifest, out = source(tmp_path, "mamba2", src, cfg["vocab"])
    family = families.get("mamba2")
    geom = family.geometry_from_dict(manifest["geometry"])
    assert family.vocab_rows(geom) == {"backbone.embeddings.weight": 1032, "lm_head.weight": 1032}
    kind = tokenizers.kind(family.tokenizer)
    kind.bake_stage(out, tmp_path / "vocab", cfg["vocab"])
    assert vocab_fit(family, geom, kind.load(tmp_path / "vocab").n_ids) == (
        "1032 rows, tokenizer 1024 ids: 8 padding rows never produced by the tokenizer")


@pytest.mark.parametrize("family_name", ["rwkv7", "rwkv6"])
def test_padding_rows_are_accepted_and_stated_world(tmp_path, cfg, family_name):
    src = checkpoint(tmp_path, family_name, 65536)  # World ids 0..65529: 6 rows of padding
    manifest, _ = source(tmp_path, family_name, src, cfg["vocab"])
    family = families.get(family_name)
    geom = family.geometry_from_dict(manifest["geometry"])
    tsv = tmp_path / world.DEVICE_FILE
    tsv.write_text(world.tsv_text(world.parse_world_vocab(world.pinned(cfg["vocab"]))), encoding="ascii")
    n_ids = world.load(tmp_path).n_ids  # from the baked device file, as the card reads it
    assert n_ids == 65530
    assert vocab_fit(family, geom, n_ids) == "65536 rows, tokenizer 65530 ids: 6 padding rows never produced by the tokenizer"


def test_exactly_as_many_rows_as_ids_states_no_padding():
    from recurrent_coreai.tokenizers import fit

    assert fit.describe(1024, 1024) == "1024 rows, tokenizer 1024 ids"
    assert fit.describe(1025, 1024) == "1025 rows, tokenizer 1024 ids: 1 padding row never produced by the tokenizer"


# --- added tokens: saved by the tokenizers library itself; beyond the vocab; with a gap -------------
def library_saved(tmp_path, added: list[str]) -> str:
    """The synthetic tokenizer with ``added`` special tokens, saved by the ``tokenizers`` library's
    own ``Tokenizer.save`` (ids 1024, 1025 ... as the library numbers them)."""
    from tokenizers import AddedToken, Tokenizer

    tk = Tokenizer.from_str(bpe.synthetic_tokenizer_json())
    tk.add_special_tokens([AddedToken(a, special=True) for a in added])
    path = tmp_path / "saved-by-tokenizers.json"
    tk.save(str(path))
    return path.read_text(encoding="utf-8")


FOUR = ["<|im_start|>", "<|im_end|>", "<|pad|>", "<|tool|>"]


def test_a_library_saved_tokenizer_with_four_added_tokens_beyond_the_vocab(tmp_path, cfg):
    text = library_saved(tmp_path, FOUR)
    assert [a["id"] for a in json.loads(text)["added_tokens"]] == [0, 1024, 1025, 1026, 1027]
    # a model with a row for each of the 1028 ids (and 4 rows of padding): accepted, stated
    (tmp_path / "fits").mkdir()
    src = checkpoint(tmp_path / "fits", "mamba2", 1032, tokenizer_json=text)
    manifest, out = source(tmp_path / "fits", "mamba2", src, cfg["vocab"])
    family = families.get("mamba2")
    bpe.bake_stage(out, tmp_path / "fits" / "vocab", {})
    tok = bpe.load(tmp_path / "fits" / "vocab")
    assert tok.n_ids == 1028 and tok.tok.token_to_id("<|tool|>") == 1027 and tok.token_bytes(1027) == b""
    assert vocab_fit(family, family.geometry_from_dict(manifest["geometry"]), tok.n_ids) == (
        "1032 rows, tokenizer 1028 ids: 4 padding rows never produced by the tokenizer")
    # a model of the base vocabulary's 1024 rows: the four added ids have no row
    (tmp_path / "short").mkdir()
    src = checkpoint(tmp_path / "short", "mamba2", 1024, tokenizer_json=text)
    line = refused(tmp_path / "short", "mamba2", src, cfg["vocab"])
    assert line.startswith(f"error: {src}: backbone.embeddings.weight has 1024 rows, but its tokenizer.json has "
                           "token ids up to 1027: ids 1024..1027 have no row -- fix: ")


def test_an_added_token_id_with_a_gap_is_refused_not_renumbered(tmp_path, cfg):
    spec = json.loads(library_saved(tmp_path, FOUR[:1]))
    spec["added_tokens"][-1]["id"] = 5000  # the library would load it as 1024
    src = checkpoint(tmp_path, "mamba2", 8192, tokenizer_json=json.dumps(spec, ensure_ascii=False))
    line = refused(tmp_path, "mamba2", src, cfg["vocab"])
    assert line.startswith(f"error: {src / 'tokenizer.json'}: added token '<|im_start|>' has id 5000, which leaves a "
                           "gap after the ids before it (or repeats one): the tokenizers library would renumber it "
                           "to 1024 -- fix: ")


# --- a pinned tokenizer.json ------------------------------------------------------------------------
def swapped_two_ids(text: str) -> str:
    spec = json.loads(text)
    vocab = spec["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return json.dumps(spec, ensure_ascii=False, sort_keys=True, indent=1) + "\n"


def test_a_pinned_tokenizer_with_two_ids_swapped_is_refused(tmp_path, cfg):
    good = bpe.synthetic_tokenizer_json()
    pin = bpe.sha256_bytes(good.encode("utf-8"))
    bad = swapped_two_ids(good)
    got = bpe.sha256_bytes(bad.encode("utf-8"))
    (tmp_path / "unpinned").mkdir()  # unpinned, the swap goes unnoticed: it round-trips
    source(tmp_path / "unpinned", "mamba2", checkpoint(tmp_path / "unpinned", "mamba2", 1024, bad), cfg["vocab"])
    src = checkpoint(tmp_path, "mamba2", 1024, tokenizer_json=bad)
    line = refused(tmp_path, "mamba2", src, cfg["vocab"], pin=pin)
    assert line.startswith(f"error: {src / 'tokenizer.json'}: sha256 is {got}, expected {pin} -- fix: ")
    (tmp_path / "good").mkdir()  # the pinned bytes pass
    source(tmp_path / "good", "mamba2", checkpoint(tmp_path / "good", "mamba2", 1024, good), cfg["vocab"], pin=pin)


def test_the_config_schema_takes_a_tokenizer_pin():
    raw = config.read_yaml(config.DEFAULT_FILE)
    raw["models"]["mamba2-tiny"]["source"] = {"kind": "path", "path": "ckpt", "tokenizer_sha256": "a" * 64}
    config.validate(copy.deepcopy(raw), "config.yaml")
    raw["models"]["mamba2-tiny"]["source"]["tokenizer_sha256"] = "nope"
    with pytest.raises(PipelineError, match="tokenizer_sha256"):
        config.validate(raw, "config.yaml")


def test_a_tokenizer_pin_on_a_world_model_is_refused(tmp_path, cfg):
    src = checkpoint(tmp_path, "rwkv6", 65536)
    line = refused(tmp_path, "rwkv6", src, cfg["vocab"], pin="a" * 64)
    assert line.startswith("error: config.yaml: source.tokenizer_sha256 pins a tokenizer file, but this model uses "
                           "the RWKV World vocabulary, pinned by vocab.sha256 -- fix: ")
