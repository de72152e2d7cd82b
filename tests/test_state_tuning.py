"""RWKV state-tuning files (``generate --state-tuning``, ``generate.tuned_state``,
``Family.tuned_states``): a BlinkDL-format file of per-layer ``blocks.<i>.att.time_state`` loaded
into the built fp32 bundle gives the official ``rwkv`` package's logits, run with the same file on
the same weights, over 64 tokens (RWKV-7 and RWKV-6 tiny models of the session's built tree). The
check can fail: the bundle from a zero state, or from the file read in the other orientation, is
far from the official logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recurrent_coreai import families
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.tools import generate as gen

RESULTS = None  # the tiny results tree (conftest)
WORKER = Path(__file__).with_name("state_tuning_official.py")
MODELS = {"rwkv7-tiny": "x070", "rwkv6-tiny": "x060"}
N_TOKENS = 64
TOL = 2e-4  # fp32 bundle vs the official fp32 RNN; measured 2026-12-06: 2.7e-5 (x070), 1.9e-5 (x060) of logits up to 47


def official(version: str, pth: Path, state: Path, tokens: list[int], tmp: Path) -> np.ndarray:
    (tmp / "tokens.json").write_text(json.dumps(tokens))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RWKV_")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, str(WORKER), version, str(pth), str(state), str(tmp / "tokens.json"),
                          str(tmp / "official.npz")], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"official rwkv worker failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return np.load(tmp / "official.npz")["logits"]


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request, tmp_path_factory):
    """(model, contract, state file, tokens, official logits) for one family."""
    from safetensors.torch import load_file

    model = request.param
    tmp = tmp_path_factory.mktemp(model)
    cfg = cfgmod.model(cfgmod.load(RESULTS.parent / "config.yaml"), model)
    fam = families.get(cfg["family"])
    src = RESULTS / model / "source"
    geom = fam.geometry_from_dict(json.loads((src / "manifest.json").read_text())["geometry"])
    pth = fam.write_layout(load_file(src / "model.safetensors"), tmp, "blinkdl")  # the official file layout
    gen_ = torch.Generator().manual_seed(36)
    tuned = {f"blocks.{i}.att.time_state": torch.randn(geom.heads, geom.head_dim, geom.head_dim, generator=gen_)
             for i in range(geom.layers)}
    state = tmp / "role.pth"
    torch.save(tuned, state)
    tokens = torch.randint(1, geom.vocab, (N_TOKENS,), generator=gen_).tolist()
    ref = official(MODELS[model], pth, state, tokens, tmp)
    _, contract, _ = gen.bundle_contract(RESULTS, model, "fp32", families.tokenizer_of(cfg), family=cfg["family"])
    return model, contract, state, tuned, tokens, ref


def bundle_logits(model: str, contract: dict, starts: list, tokens) -> list[np.ndarray]:
    """The bundle's logits over ``tokens`` from each initial state of ``starts`` (None: zeros), one session."""
    session, _ = gen.open_bundle(RESULTS, model, "fp32", use_prefill=False, family=contract["family"])
    out = []
    with session:
        for arrays in starts:
            session.reset()
            if arrays is not None:
                session.set_states(arrays)
            out.append(np.stack([session.step(t) for t in tokens]))
    return out


def test_a_state_tuning_file_gives_the_official_logits(case, tmp_path):
    """... and the check can fail: from a zero state, or from the file read transposed, the same
    bundle is far from the official logits."""
    model, contract, state, tuned, tokens, ref = case
    turned = tmp_path / "turned.pth"
    torch.save({k: v.transpose(1, 2).contiguous() for k, v in tuned.items()}, turned)
    got, cold, wrong = bundle_logits(model, contract, [gen.tuned_state(contract, state), None,
                                                       gen.tuned_state(contract, turned)], tokens)
    assert got.shape == ref.shape == (N_TOKENS, contract["vocab_size"])
    err = np.abs(got - ref).max()
    assert err < TOL, (model, err)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(cold - ref).max() > 50 * TOL, model  # the tuned state matters to these logits
    assert np.abs(wrong - ref).max() > 50 * TOL, model  # the orientation is the official one


def test_the_cli_takes_a_state_tuning_file(case, capfd):
    model, _, state, _, _, _ = case
    code = gen.main(["--config-file", str(RESULTS.parent / "config.yaml"), "--model", model, "--recipe", "fp32",
                     "--max-new-tokens", "4", "--state-tuning", str(state), "Hi"])
    out, err = capfd.readouterr()
    assert code == 0 and out.strip(), err


BAD = [  # (what the file holds, what the one line says)
    ("missing", "no such state-tuning file"),
    ("garbage", "cannot be read as a state-tuning file"),
    ("layer", "is not a state-tuning file of this 2-layer model (missing ['blocks.1.att.time_state']"),
    ("shape", "blocks.0.att.time_state has shape [2, 8, 8]"),
    ("nan", "blocks.0.att.time_state holds non-finite values"),
]


@pytest.mark.parametrize("kind,what", BAD, ids=[b[0] for b in BAD])
def test_a_bad_state_tuning_file_is_one_line(kind, what, tmp_path, capfd):
    """(On RWKV-7: base.rwkv_time_states, which reads the file, is both families'.)"""
    model = "rwkv7-tiny"
    geometry = json.loads((RESULTS / model / "source" / "manifest.json").read_text())["geometry"]
    heads = geometry["hidden"] // geometry["head_dim"]
    tuned = {f"blocks.{i}.att.time_state": torch.ones(heads, geometry["head_dim"], geometry["head_dim"])
             for i in range(geometry["layers"])}
    path = tmp_path / f"{kind}.pth"
    if kind == "garbage":
        path.write_bytes(b"not a pickle")
    elif kind == "layer":
        torch.save({"blocks.0.att.time_state": tuned["blocks.0.att.time_state"]}, path)
    elif kind == "shape":
        torch.save({k: torch.zeros(2, 8, 8) for k in tuned}, path)
    elif kind == "nan":
        torch.save({k: torch.full_like(v, float("nan")) for k, v in tuned.items()}, path)
    code = gen.main(["--config-file", str(RESULTS.parent / "config.yaml"), "--model", model, "--recipe", "fp32",
                     "--max-new-tokens", "2", "--state-tuning", str(path), "Hi"])
    out, err = capfd.readouterr()
    assert (code, out) == (1, "") and err.count("\n") == 1 and err.startswith(f"error: {path}: ") and what in err, err


def test_a_family_without_state_tuning_refuses_the_file(tmp_path, capfd):
    state = tmp_path / "role.pth"
    torch.save({"blocks.0.att.time_state": torch.zeros(2, 64, 64)}, state)
    code = gen.main(["--config-file", str(RESULTS.parent / "config.yaml"), "--model", "mamba2-tiny", "--recipe",
                     "fp32", "--state-tuning", str(state), "Hi"])
    out, err = capfd.readouterr()
    assert (code, out) == (1, "") and err.count("\n") == 1 and "which family mamba2 has none of" in err, err
