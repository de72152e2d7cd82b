"""Bad inputs that only a multi-family pipeline meets, each one line naming the file (tensor) and the
fix, nothing left behind: a checkpoint of one family given as another; a Mamba-2 config whose
in_proj width disagrees with d_state/n_groups/headdim; a .bin holding arbitrary pickled objects;
a tokenizer.json that does not round-trip."""

from __future__ import annotations

import json
import os

import pytest
import torch

from recurrent_coreai import families
from recurrent_coreai.stages.source import build_source
from recurrent_coreai.util.errors import PipelineError


def write_tiny(family, layout: str, weights, dest, geom):
    """``family.write_layout`` of its tiny model; a layout only other geometries can be written in
    (one outside ``synthetic_layouts`` that write_layout refuses, e.g. Gated DeltaNet's fla-tied for
    an untied shape) is skipped, saying why: the family's own tests cover it."""
    try:
        return family.write_layout(weights, dest, layout, geom)
    except ValueError as exc:
        if layout in family.synthetic_layouts:
            raise
        pytest.skip(f"{family.name} writes its {layout} layout only from another geometry than its tiny_shape ({exc})")


def checkpoint(family_name: str, layout: str, dest):
    family = families.get(family_name)
    geom = family.geometry_from_shape(family.tiny_shape, "test")
    dest.mkdir(parents=True, exist_ok=True)
    write_tiny(family, layout, dict(family.synthetic_tensors(geom, 1)), dest, geom)
    return dest


def build(tmp_path, family: str, src) -> PipelineError:
    out = tmp_path / "out"
    with pytest.raises(PipelineError) as exc:
        build_source("m", {"family": family, "source": {"kind": "path", "path": str(src)}, "license": "mit"},
                     {"package": "pyrwkv-tokenizer", "version": "0.9.1", "file": "rwkv_vocab_v20230424.txt",
                      "sha256": "e6dee3d4e31b4d5c40ac99508ac6c701ceef4bed681bf2167ce9a908552bca89"}, out)
    assert "\n" not in str(exc.value)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    return exc.value


def mismatches() -> list[tuple[str, str, str]]:
    """(actual family, its layout, the family config.yaml names): every layout of every registered
    family (its tiny model written in it: :func:`write_tiny`), given as each other family."""
    return [(actual, layout, given) for actual in families.available() for layout in families.get(actual).layouts
            for given in families.available() if given != actual]


@pytest.mark.parametrize("actual,layout,given", mismatches())
def test_a_checkpoint_of_another_family_names_the_family_it_looks_like(tmp_path, actual, layout, given):
    src = checkpoint(actual, layout, tmp_path / "ckpt")
    weights = [p for p in src.iterdir() if p.suffix in (".safetensors", ".pth", ".bin")]
    err = build(tmp_path, given, weights[0] if not (src / "config.json").exists() else src)
    assert f"({actual}, {layout} layout)" in err.what and f"set family: {actual}" in err.fix


def test_a_mamba2_config_whose_in_proj_disagrees_names_both_numbers(tmp_path):
    src = checkpoint("mamba2", "hf", tmp_path / "ckpt")
    cfg = json.loads((src / "config.json").read_text())
    cfg["state_size"] = 32  # in_proj was made for d_state 16
    (src / "config.json").write_text(json.dumps(cfg))
    err = build(tmp_path, "mamba2", src)
    assert "in_proj" in err.what and "d_state 32" in err.what


class Payload:
    def __reduce__(self):
        return os.system, ("echo pwned > /tmp/recurrent-coreai-pwned",)


def test_a_bin_holding_arbitrary_objects_is_refused_and_never_runs(tmp_path):
    src = checkpoint("mamba2", "mamba-ssm", tmp_path / "ckpt")
    bin_file = next(src.glob("*.bin"))
    sd = torch.load(bin_file, weights_only=True)
    sd["backbone.norm_f.weight"] = Payload()
    torch.save(sd, bin_file)  # pickles Payload through its __reduce__: a call of os.system on load
    if os.path.exists("/tmp/recurrent-coreai-pwned"):
        os.remove("/tmp/recurrent-coreai-pwned")
    err = build(tmp_path, "mamba2", src)
    assert "the pickle refers to posix.system" in err.what and "weights_only" in err.what
    assert not os.path.exists("/tmp/recurrent-coreai-pwned")


def test_a_tokenizer_json_that_does_not_round_trip_is_refused(tmp_path):
    src = checkpoint("mamba2", "hf", tmp_path / "ckpt")
    from recurrent_coreai.tokenizers import bpe

    tj = json.loads(bpe.synthetic_tokenizer_json(512))
    tj["decoder"] = None  # no byte-level decoder: decode(encode(text)) is not the text's bytes
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    (src / "tokenizer.json").write_text(json.dumps(tj))
    err = build(tmp_path, "mamba2", src)
    assert "tokenizer.json" in err.where
