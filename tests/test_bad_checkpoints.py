"""Corrupt checkpoints and bad source inputs fail in the SOURCE stage with one PipelineError line
(where = the file, what = what is wrong naming the tensor/key/line, fix = what to do), and the
stage leaves nothing on disk.

Each case builds a small damaged checkpoint in a temp dir from the synthetic state dict and runs
it through ``source.build_source`` (kind ``path``): the error's where/what/fix, and through the
CLI's ``main_guard``: exactly that one line on stderr, exit 1. Good inputs next to each bad one (a
proper sharded checkpoint, a CRLF copy of the World vocab, a license that needs YAML quoting)
must still build, checked against independent readers (safetensors, card.py, the pinned file).
"""

from __future__ import annotations

import json
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from recurrent_coreai import families
from recurrent_coreai.families.rwkv7 import blinkdl
from recurrent_coreai.stages import card
from recurrent_coreai.checkpoints import reader as checkpoint
from recurrent_coreai.tokenizers import world as vocab
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.families.rwkv7.geometry import Geometry
from recurrent_coreai.stages.source import build_source
from recurrent_coreai.tokenizers.world import VOCAB_FILE
from recurrent_coreai.families.rwkv7.synthetic import pack_mixers, synthetic_state_dict

# vocab: the RWKV World size (ids 0..65529, real checkpoints have 65536 rows): the source stage refuses
# an embedding or head with fewer rows than the tokenizer has ids (tokenizers/fit.py); hidden 64 keeps
# each of the two [65536, 64] tensors at 16 MB
G = Geometry(layers=2, hidden=64, head_dim=32, ffn=128, vocab=65536, decay_lora=8, a_lora=8, v_lora=8, gate_lora=8)
INDEX = "model.safetensors.index.json"  # the Hugging Face sharded layout
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def sd():
    return synthetic_state_dict(G, 7)


@pytest.fixture(scope="module")
def pinned(cfg) -> Path:
    v = cfg["vocab"]
    return vocab.package_vocab(v["package"], v["version"], v["file"], v["sha256"])


# --- writing (damaged) checkpoints ------------------------------------------------------------
def fla_dir(root: Path, tensors: dict, config: object = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(G.to_hf_config() if config is None else config))
    return root


def sharded_dir(root: Path, shards: dict[str, dict], index: dict | None) -> Path:
    """Shards written as given; ``index`` is the weight_map (None: no index file)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / name))
    if index is not None:
        (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (root / "config.json").write_text(json.dumps(G.to_hf_config()))
    return root


def split_in_two(sd: dict) -> tuple[dict, dict, dict]:
    names = list(sd)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    index = {n: SHARDS[0] for n in first} | {n: SHARDS[1] for n in second}
    return {n: sd[n] for n in first}, {n: sd[n] for n in second}, index


def nonfinite(t: torch.Tensor, nans: int, infs: int) -> torch.Tensor:
    t = t.clone()
    flat = t.view(-1)
    flat[:nans] = float("nan")
    flat[flat.numel() - infs:] = float("inf")
    return t


def config_with(**changes) -> dict:
    return {**G.to_hf_config(), **changes}


def corrupt_vocab(pinned: Path, lineno: int, new_line: bytes) -> bytes:
    lines = pinned.read_bytes().split(b"\n")
    lines[lineno - 1] = new_line
    return b"\n".join(lines)


def with_vocab(root: Path, sd: dict, data: bytes) -> Path:
    fla_dir(root, sd)
    (root / VOCAB_FILE).write_bytes(data)
    return root


def with_readme(root: Path, sd: dict, text: str) -> Path:
    fla_dir(root, sd)
    (root / "README.md").write_text(text)
    return root


def pth(root: Path, obj) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    torch.save(obj, root / "model.pth")
    return root / "model.pth"


def flip_in_member(path: Path, holds: bytes | None = None, suffix: str | None = None) -> str:
    """Flip one byte in the middle of the zip member of a torch.save file that holds exactly
    ``holds`` (found by its content, read with zipfile) or whose name ends with ``suffix``;
    returns the member's name. Only the member's data changes: its recorded CRC-32 does not."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist()
                    if (z.read(i) == holds if holds is not None else i.filename.endswith(suffix)))
    data = bytearray(path.read_bytes())
    n, m = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])  # local header
    data[info.header_offset + 30 + n + m + info.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return info.filename


def pth_flipped(root: Path, sd: dict, name: str | None) -> Path:
    """The BlinkDL .pth (torch.save) with a byte flipped in tensor ``name``'s storage (None: in the pickle)."""
    tensors = blinkdl.from_hf(sd)
    path = pth(root, tensors)
    flip_in_member(path, tensors[name].numpy().tobytes() if name else None, None if name else "/data.pkl")
    return path


def bin_dir_flipped(root: Path, sd: dict, name: str) -> Path:
    """A transformers-4 style directory (pytorch_model.bin by torch.save + config.json), one byte flipped."""
    root.mkdir(parents=True, exist_ok=True)
    torch.save(sd, root / "pytorch_model.bin")
    (root / "config.json").write_text(json.dumps(G.to_hf_config()))
    flip_in_member(root / "pytorch_model.bin", sd[name].numpy().tobytes())
    return root


def quantized(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates creating quantized tensors; files of them exist
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(t, 0.01, 0, torch.qint8)


def cut_short(path: Path) -> Path:
    """The zip's last 100 bytes (its central directory's end record) gone: an interrupted download."""
    path.write_bytes(path.read_bytes()[:-100])
    return path


def text_file(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "notes.txt").write_text("hello\n")
    return root / "notes.txt"


def index_not_json(root: Path, sd: dict) -> Path:
    a, b, _ = split_in_two(sd)
    sharded_dir(root, {SHARDS[0]: a, SHARDS[1]: b}, None)
    (root / INDEX).write_text('{"weight_map": {oops')
    return root


def stale_third_shard(root: Path, sd: dict) -> Path:
    a, b, index = split_in_two(sd)
    sharded_dir(root, {SHARDS[0]: a, SHARDS[1]: b}, index)
    save_file({"lm_head.weight": torch.zeros(G.vocab, G.hidden)}, str(root / "model-00003-of-00003.safetensors"))
    return root


def index_misplaces(root: Path, sd: dict) -> Path:
    a, b, index = split_in_two(sd)
    index["lm_head.weight"] = SHARDS[0]            # it is stored in the second shard
    return sharded_dir(root, {SHARDS[0]: a, SHARDS[1]: b}, index)


def index_lists_absent(root: Path, sd: dict) -> Path:
    a, b, index = split_in_two(sd)
    index["model.layers.0.attn.x_q"] = SHARDS[1]   # in no shard at all
    return sharded_dir(root, {SHARDS[0]: a, SHARDS[1]: b}, index)


def index_missing_shard(root: Path, sd: dict) -> Path:
    a, _, index = split_in_two(sd)
    return sharded_dir(root, {SHARDS[0]: a}, index)


def duplicate_across_shards(root: Path, sd: dict) -> Path:
    a, b, _ = split_in_two(sd)
    b["model.layers.0.attn.k_k"] = torch.zeros(G.hidden)   # a second, different copy
    return sharded_dir(root, {SHARDS[0]: a, SHARDS[1]: b}, None)


def packed_and_split(root: Path, sd: dict) -> Path:
    tensors = pack_mixers(sd)
    tensors["model.layers.1.attn.x_r"] = sd["model.layers.1.attn.x_r"] + 1
    return fla_dir(root, tensors)


def fla_with(name: str, make) -> Callable:
    """Builder: the good fla checkpoint with tensor ``name`` replaced by ``make(original)``."""
    return lambda root, sd, pinned: fla_dir(root, {**sd, name: make(sd[name])})


def packed_with(name: str, make) -> Callable:
    return lambda root, sd, pinned: fla_dir(root, {**pack_mixers(sd), name: make(pack_mixers(sd)[name])})


def pth_with(name: str, make) -> Callable:
    return lambda root, sd, pinned: pth(root, {**blinkdl.from_hf(sd), name: make(blinkdl.from_hf(sd)[name])})


# case id -> (builder(root, sd, pinned) -> source path, substrings of the message, file named as `where`)
CASES = {
    "int32-tensor": (fla_with("model.layers.1.attn.k_k", lambda t: t.int()),
                     ["tensor model.layers.1.attn.k_k has dtype int32", "float32, float16 or bfloat16"],
                     "model.safetensors"),
    "float64-tensor": (fla_with("lm_head.weight", lambda t: t.double()),
                       ["tensor lm_head.weight has dtype float64"], "model.safetensors"),
    "int8-tensor-pth": (pth_with("blocks.0.att.r_k", lambda t: t.to(torch.int8)),
                        ["tensor blocks.0.att.r_k has dtype int8"], "model.pth"),
    "nan-inf": (fla_with("lm_head.weight", lambda t: nonfinite(t, 3, 2)),
                ["tensor lm_head.weight has 3 NaN and 2 infinite values (of 4194304)"], "model.safetensors"),
    "inf-bf16": (fla_with("model.layers.0.ffn.key.weight", lambda t: nonfinite(t, 0, 1).bfloat16()),
                 ["tensor model.layers.0.ffn.key.weight has 0 NaN and 1 infinite values"], "model.safetensors"),
    "nan-in-packed-mixers": (packed_with("model.layers.0.attn.x_x", lambda t: nonfinite(t, 1, 0)),
                             ["tensor model.layers.0.attn.x_x has 1 NaN"], "model.safetensors"),
    "packed-and-split-mixers": (lambda r, sd, p: packed_and_split(r, sd),
                                ["model.layers.1.attn.x_x (packed mixers) and model.layers.1.attn.x_r (split) are "
                                 "both present"], "model.safetensors"),
    "tensor-in-two-shards": (lambda r, sd, p: duplicate_across_shards(r, sd),
                             [f"tensor model.layers.0.attn.k_k is in both {SHARDS[0]} and {SHARDS[1]}"], "src"),
    "index-names-missing-shard": (lambda r, sd, p: index_missing_shard(r, sd),
                                  [f"names shard {SHARDS[1]}, which is missing"], INDEX),
    "index-maps-to-wrong-shard": (lambda r, sd, p: index_misplaces(r, sd),
                                  [f"holds tensor lm_head.weight, which {INDEX} maps to {SHARDS[0]}"], SHARDS[1]),
    "index-lists-absent-tensor": (lambda r, sd, p: index_lists_absent(r, sd),
                                  [f"maps tensor model.layers.0.attn.x_q to {SHARDS[1]}, which does not hold it"],
                                  INDEX),
    "shard-not-in-index": (lambda r, sd, p: stale_third_shard(r, sd),
                           ["does not name model-00003-of-00003.safetensors"], INDEX),
    "index-not-json": (lambda r, sd, p: index_not_json(r, sd), ["invalid JSON"], INDEX),
    "config-head-dim-0": (lambda r, sd, p: fla_dir(r, sd, config_with(head_dim=0)),
                          ["head_dim must be a positive integer, got 0"], "config.json"),
    "config-head-dim-abc": (lambda r, sd, p: fla_dir(r, sd, config_with(head_dim="abc")),
                            ['head_dim must be a positive integer, got "abc"'], "config.json"),
    "config-hidden-2.5": (lambda r, sd, p: fla_dir(r, sd, config_with(hidden_size=2.5)),
                          ["hidden_size must be a positive integer, got 2.5"], "config.json"),
    "config-layers-null": (lambda r, sd, p: fla_dir(r, sd, config_with(num_hidden_layers=None)),
                           ["num_hidden_layers must be a positive integer, got null"], "config.json"),
    "config-ratio-abc": (lambda r, sd, p: fla_dir(r, sd, config_with(intermediate_size=None, hidden_ratio="abc")),
                         ['hidden_ratio must be a positive number, got "abc"'], "config.json"),
    "config-is-a-list": (lambda r, sd, p: fla_dir(r, sd, [G.to_hf_config()]),
                         ["is a JSON array, not an object"], "config.json"),
    "pth-flipped-byte-in-a-tensor": (lambda r, sd, p: pth_flipped(r, sd, "blocks.1.att.r_k"),
                                     ["zip member model/data/", "(the bytes of tensor blocks.1.att.r_k) fails its "
                                      "CRC-32 check: the file is corrupted"], "model.pth"),
    "pth-flipped-byte-in-the-pickle": (lambda r, sd, p: pth_flipped(r, sd, None),
                                       ["zip member model/data.pkl (the pickle of tensor names and shapes) fails its "
                                        "CRC-32 check"], "model.pth"),
    "bin-flipped-byte": (lambda r, sd, p: bin_dir_flipped(r, sd, "lm_head.weight"),
                         ["zip member pytorch_model/data/", "(the bytes of tensor lm_head.weight) fails its CRC-32"],
                         "pytorch_model.bin"),
    "pth-zip-cut-short": (lambda r, sd, p: cut_short(pth(r, blinkdl.from_hf(sd))),
                          ["cannot read its zip container (BadZipFile"], "model.pth"),
    "pth-sparse-tensor": (pth_with("blocks.0.att.r_k", lambda t: t.to_sparse()),
                          ["tensor blocks.0.att.r_k is stored in the sparse_coo layout (sparse), not as a dense "
                           "array"], "model.pth"),
    "pth-sparse-csr-tensor": (pth_with("head.weight", lambda t: t.to_sparse_csr()),
                              ["tensor head.weight is stored in the sparse_csr layout (sparse)"], "model.pth"),
    "pth-meta-tensor": (pth_with("head.weight", lambda t: torch.empty_like(t, device="meta")),
                        ["tensor head.weight is a meta tensor: shape [65536, 64] but no data"], "model.pth"),
    "pth-quantized-tensor": (pth_with("blocks.1.ffn.key.weight", quantized),
                             ["tensor blocks.1.ffn.key.weight is quantized (qint8, per_tensor_affine); weights must "
                              "be float32, float16 or bfloat16"], "model.pth"),
    "pth-holds-a-list": (lambda r, sd, p: pth(r, [1, 2]), ["holds a list, not a state dict of tensors"], "model.pth"),
    "pth-holds-non-tensor": (lambda r, sd, p: pth(r, {"emb.weight": 3}), ["entry 'emb.weight' is not a tensor (int)"],
                             "model.pth"),
    "txt-as-source": (lambda r, sd, p: text_file(r),
                      ["is not a weights file (suffix '.txt')", "*.safetensors, *.pth"], "notes.txt"),
    "readme-bad-yaml": (lambda r, sd, p: with_readme(r, sd, "---\nlicense: mit\ntags: [rwkv, x: y\n---\n\nHi\n"),
                        ["YAML front matter is invalid at line 3", "'tags: [rwkv, x: y'"], "README.md"),
    "readme-front-matter-list": (lambda r, sd, p: with_readme(r, sd, "---\n- mit\n---\n"),
                                 ["YAML front matter is a list, not a mapping"], "README.md"),
    "vocab-malformed-literal": (lambda r, sd, p: with_vocab(r, sd, corrupt_vocab(p, 300, b"300 b'\\x2 1")),
                                ["token 300: b'\\x2 is not a Python str/bytes literal"], f"{VOCAB_FILE}:300"),
    "vocab-int-literal": (lambda r, sd, p: with_vocab(r, sd, corrupt_vocab(p, 5, b"5 3 3")),
                          ["token 5: 3 is not a str/bytes literal (int)"], f"{VOCAB_FILE}:5"),
    "vocab-wrong-length": (lambda r, sd, p: with_vocab(r, sd, corrupt_vocab(p, 261, b"261 '\\n\\n' 3")),
                           ["token 261: '\\n\\n' is 2 bytes, the line says '3'"], f"{VOCAB_FILE}:261"),
    "vocab-not-utf8": (lambda r, sd, p: with_vocab(r, sd, corrupt_vocab(p, 1000, b"1000 '\xff' 1")),
                       ["is not UTF-8 (byte 6 of the line is 0xff)"], f"{VOCAB_FILE}:1000"),
    "vocab-other-tokenizer": (lambda r, sd, p: with_vocab(r, sd, corrupt_vocab(p, 300, b"300 'zz' 2")),
                              ["token 300 is b'zz', World has", "not the World vocab"], f"{VOCAB_FILE}:300"),
}


def run_source(src: Path, out: Path, vocab_cfg: dict):
    return build_source("bad", {"family": "rwkv7", "source": {"kind": "path", "path": str(src)}, "license": "mit"}, vocab_cfg, out)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_source_is_one_pipeline_error(case, sd, pinned, cfg, tmp_path, capsys):
    build, needles, where = CASES[case]
    src = build(tmp_path / "src", sd, pinned)
    out = tmp_path / "results" / "source"
    with pytest.raises(PipelineError) as exc:
        run_source(src, out, cfg["vocab"])
    err = exc.value
    for needle in needles:
        assert needle in err.what, f"{needle!r} not in {err.what!r}"
    assert err.where == str(tmp_path / "src") if where == "src" else err.where.endswith("/" + where), err.where
    assert err.fix
    # the stage writes into a temp sibling: a failure leaves nothing in results/
    assert list((tmp_path / "results").iterdir()) == []
    # what the CLI prints (main_guard around the stage): exit 1, one line, no traceback
    rc = main_guard(lambda: run_source(src, out, cfg["vocab"]))()
    printed = capsys.readouterr().err
    assert rc == 1 and printed == f"error: {err}\n" and printed.count("\n") == 1 and " -- fix: " in printed, printed


# --- the good inputs beside the bad ones ---------------------------------------------------------
def test_sharded_checkpoint_with_index(sd, cfg, tmp_path):
    """HF sharded layout: read through the index, written as ONE model.safetensors equal to the
    single-file normal form; upstream lists exactly the files read, not unrelated ones."""
    a, b, index = split_in_two(sd)
    src = sharded_dir(tmp_path / "src", {SHARDS[0]: a, SHARDS[1]: b}, index)
    (src / "training_log.txt").write_text("not part of the checkpoint\n")
    (src / "README.md").write_text("---\nlicense: mit\n---\n")
    out = tmp_path / "out"
    manifest = run_source(src, out, cfg["vocab"])
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    checkpoint.save_normalized(sd, tmp_path / "normal.safetensors")
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "normal.safetensors").read_bytes()
    with safe_open(out / "model.safetensors", "pt") as fh:
        assert set(fh.keys()) == set(sd) and all(torch.equal(fh.get_tensor(k), sd[k]) for k in sd)
    assert sorted(manifest["upstream"]) == sorted([*SHARDS, INDEX, "config.json", "README.md"])
    assert manifest["upstream"][SHARDS[1]]["size"] == (src / SHARDS[1]).stat().st_size


def test_crlf_copy_of_the_world_vocab_is_accepted(sd, pinned, cfg, tmp_path):
    """Same tokens, other line ends: accepted, and the source carries the pinned bytes."""
    src = with_vocab(tmp_path / "src", sd, pinned.read_bytes().replace(b"\n", b"\r\n"))
    run_source(src, tmp_path / "out", cfg["vocab"])
    assert (tmp_path / "out" / VOCAB_FILE).read_bytes() == pinned.read_bytes()


def test_vocab_line_errors_name_the_line(pinned, tmp_path):
    """parse_world_vocab itself (used by the vocab stage's bake): a repeated id and a float literal."""
    bad = tmp_path / "v.txt"
    bad.write_bytes(corrupt_vocab(pinned, 12, b"11 '\\x0b' 1"))
    with pytest.raises(PipelineError, match=r"v\.txt:12: token id 11 repeats line 11"):
        vocab.parse_world_vocab(bad)
    bad.write_bytes(corrupt_vocab(pinned, 40, b"40 2.5 1"))
    with pytest.raises(PipelineError, match=r"v\.txt:40: token 40: 2\.5 is not a str/bytes literal \(float\)"):
        vocab.parse_world_vocab(bad)


@pytest.mark.parametrize("license_", ["a: b", "yes"])
def test_synthetic_card_front_matter_is_valid_yaml(cfg, license_, tmp_path):
    """The synthetic source writes its README front matter with a YAML writer: card.py reads back
    exactly the configured license (an unquoted 'a: b' used to be invalid YAML, 'yes' a boolean)."""
    model = json.loads(json.dumps(cfg["models"]["rwkv7-tiny"]))
    model["license"] = license_
    # smaller, but the configured World-sized vocab stays: the source stage refuses fewer rows than ids
    model["source"]["shape"] = {**model["source"]["shape"], "layers": 1, "hidden": 64}
    assert model["source"]["shape"]["vocab"] >= 65530
    out = tmp_path / "src"
    build_source("rwkv7-tiny", model, cfg["vocab"], out)
    assert card.source_license(out, None) == license_


# --- torch.save containers: CRC-32 of every zip member; what is read as it is --------------------
def test_a_flipped_byte_names_its_zip_member_and_tensor(sd, cfg, tmp_path):
    """The member found by its content (zipfile, not the reader) is the one the line names, with
    its tensor; torch.load(mmap=True) alone returns the damaged values without a word."""
    tensors = blinkdl.from_hf(sd)
    path = pth(tmp_path / "src", tensors)
    member = flip_in_member(path, tensors["blocks.0.att.key.weight"].numpy().tobytes())
    assert member.startswith("model/data/")
    damaged = torch.load(path, mmap=True, weights_only=True)["blocks.0.att.key.weight"]
    assert not torch.equal(damaged, tensors["blocks.0.att.key.weight"])  # accepted by torch, not by us
    with pytest.raises(PipelineError) as exc:
        run_source(path, tmp_path / "out", cfg["vocab"])
    assert exc.value.what == (f"zip member {member} (the bytes of tensor blocks.0.att.key.weight) fails its CRC-32 "
                              "check: the file is corrupted")
    assert exc.value.where == str(path)


def test_a_storage_shared_by_two_names_names_both(tmp_path):
    """A tied pair (one storage, two names: torch.save stores it once) is named whole."""
    emb = torch.randn(8, 4)
    path = tmp_path / "tied.pth"
    torch.save({"emb.weight": emb, "other": torch.randn(3), "head.weight": emb}, path)
    flip_in_member(path, emb.numpy().tobytes())
    with pytest.raises(PipelineError, match=r"tied\.pth: zip member tied/data/\d+ \(the bytes of tensor emb\.weight, "
                       r"head\.weight\) fails its CRC-32 check"):
        checkpoint.load_pickle(path)


def offset_view(t: torch.Tensor) -> torch.Tensor:
    """The same values, stored at an offset inside a larger storage."""
    return torch.cat([torch.zeros(5, dtype=t.dtype), t.flatten(), torch.ones(3, dtype=t.dtype)])[5:5 + t.numel()].view(
        t.shape)


VIEWS = {
    "legacy-format": lambda t: t,               # saved with _use_new_zipfile_serialization=False
    "transposed": lambda t: t.t().contiguous().t() if t.dim() == 2 else t,
    "offset-in-storage": offset_view,
    "expanded": lambda t: t.flatten()[:1].expand(t.numel()).view(t.shape) if t.dim() == 1 else t,
}


@pytest.mark.parametrize("how", list(VIEWS))
def test_pickles_torch_writes_are_read_as_the_values_they_hold(how, sd, tmp_path):
    """A legacy (non-zip) torch.save has no CRC to check and is read as it is; dense tensors stored
    non-contiguously (transposed, at an offset, expanded with stride 0) are read as the values they
    show: the normal form equals that of the same values saved contiguously, byte for byte."""
    tensors = {k: VIEWS[how](v) for k, v in blinkdl.from_hf(sd).items()}
    if how != "legacy-format":
        assert any(not t.is_contiguous() or t.storage_offset() for t in tensors.values())
    want = {k: v.contiguous().clone() for k, v in tensors.items()}
    rwkv7 = families.get("rwkv7")
    checkpoint.write_normalized(pth(tmp_path / "plain", want), tmp_path / "want.safetensors", rwkv7)
    path = tmp_path / "src" / "model.pth"
    path.parent.mkdir()
    torch.save(tensors, path, _use_new_zipfile_serialization=how != "legacy-format")
    assert zipfile.is_zipfile(path) == (how != "legacy-format")
    checkpoint.write_normalized(path, tmp_path / "got.safetensors", rwkv7)
    assert (tmp_path / "got.safetensors").read_bytes() == (tmp_path / "want.safetensors").read_bytes()
    with safe_open(tmp_path / "got.safetensors", "pt") as fh:  # and those are the values saved
        assert all(torch.equal(fh.get_tensor(k), v) for k, v in sd.items())
