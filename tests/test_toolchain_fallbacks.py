"""What the pipeline does where the installed Core AI toolchain is the previous real release (issue 38):
coreai-core 1.0.0b2 has no ``AIModelAsset._write_odix`` and no ``compile_to_binary``, and
coreai-torch 0.4.2 leaves a model's states as plain arguments of every function. Each is taken away
here, on the pins, by monkeypatching, and what the pipeline does instead is checked against what it
does on the pins, on rwkv7-trained fp16 (a trained model):

* the lowering without ``_write_odix`` and ``compile_to_binary`` (coreai/lowering.py: the passes
  1.0.0b2's own ``executable()`` runs) gives the same logits and states, bit for bit, as the
  aot stage's lowering of the same bundle; the contract says what degrades, and says the lowering
  fails when the fallback's bindings are gone too;
* a converter that skips coreai-core's pre-compilation rewrite (as 0.4.2 does) leaves the states
  as arguments; the export promotes them with ``AIProgram.optimize()`` (1.0.0b2's public API, given
  here as that same rewrite), records and says it once, and the bundle gives the same numbers as
  the pins' and is byte-reproducible; without ``optimize`` the export is refused in one line.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from recurrent_coreai.coreai import contract, lowering, runtime
from recurrent_coreai.families.rwkv7 import FAMILY as RWKV7
from recurrent_coreai.stages import export
from recurrent_coreai.util.errors import PipelineError

PROMPT, STEPS, CHUNK = list(range(1, 21)), (5, 9, 200), 16


def _numbers(aimodelx, record):
    """Logits after a prompt (a prefill chunk and a decode tail) and 3 decode steps, and the states."""
    with runtime.PromptSession(aimodelx, record) as s:
        logits = np.stack([s.feed(PROMPT), *(s.step(t) for t in STEPS)])
        return logits, s.state_arrays()


def _same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])


def _need(target: str) -> contract.Need:
    return next(n for n in contract.PUBLIC if n.target == target)


def _lowered(rec, out, name="x"):
    x = out / f"{name}.aimodelx"
    x.mkdir()
    runtime.lower_universal(out / rec["bundle"], x)
    return x


def _without_the_rewrite(monkeypatch, optimize: bool) -> None:
    """coreai-torch 0.4.3's to_coreai as 0.4.2's: no pre-compilation rewrite; with ``optimize``,
    AIProgram.optimize() as 1.0.0b2 has it (that rewrite, run on the program's module)."""
    import coreai.authoring.asset as asset
    import coreai.authoring.module as module

    rewrite = module.run_pre_compilation_rewrite
    monkeypatch.setattr(module, "run_pre_compilation_rewrite", lambda module: None)
    if optimize:
        monkeypatch.setattr(asset.AIProgram, "optimize", lambda self: rewrite(module=self._module._mlir_module),
                            raising=False)


MODEL = "rwkv7-trained"  # rwkv7 with a 256-id head: an export and a runtime call cost less than rwkv7-tiny's


@pytest.fixture(autouse=True)
def _no_decode_only_conversion(monkeypatch):
    """These bundles only feed the checks below: skip the second conversion behind size_bytes_decode_only."""
    monkeypatch.setattr(export, "DECODE_ONLY_MAX_PARAMS", 0)


@pytest.fixture(scope="module")
def source(cfg, tmp_path_factory):
    from recurrent_coreai.stages.source import build_source

    out = tmp_path_factory.mktemp("trained") / "source"
    build_source(MODEL, cfg["models"][MODEL], cfg["vocab"], out)
    return out


@pytest.fixture(scope="module")
def pinned(source, cfg, tmp_path_factory):
    """rwkv7-trained fp16 exported and lowered on the pins; its numbers."""
    out = tmp_path_factory.mktemp("pinned")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "DECODE_ONLY_MAX_PARAMS", 0)
        rec = export.export_recipe(RWKV7, source, "fp16", cfg["recipes"]["fp16"], "b", out, CHUNK)
    return out, rec, _numbers(_lowered(rec, out), rec)


def test_without_write_odix_and_compile_to_binary_the_lowering_runs_the_passes_and_the_numbers_hold(
        pinned, monkeypatch, tmp_path, caplog):
    import coreai.authoring.asset as asset

    out, rec, want = pinned
    monkeypatch.delattr(asset.AIModelAsset, "_write_odix")
    monkeypatch.delattr(asset, "compile_to_binary")
    module = lowering.load_program(out / rec["bundle"])
    assert lowering.compile_module(module, tmp_path) == lowering.FALLBACK
    with caplog.at_level(logging.WARNING):
        x = _lowered(rec, out, "fallback")
    assert sorted(f.name for f in x.iterdir()) == ["main-universal.dbginfo", lowering.ODIX]
    assert _same(_numbers(x, rec), want)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("toolchain:")]
    assert len(warned) == 1 and "no attribute coreai.authoring.asset.AIModelAsset._write_odix" in warned[0]
    misses = {m["target"]: m["degrades"] for m in contract.check(live=True) if m["kind"] == "public"}
    assert misses == {t: _need(t).instead for t in ("coreai.authoring.asset:AIModelAsset._write_odix",
                                                     "coreai.authoring.asset:compile_to_binary")}
    assert "define-graph-output-intents + core-to-odix" in misses["coreai.authoring.asset:compile_to_binary"]


def test_without_the_fallbacks_bindings_too_the_contract_says_the_lowering_fails(monkeypatch):
    import importlib

    import coreai.authoring.asset as asset

    monkeypatch.delattr(asset, "compile_to_binary")
    monkeypatch.delattr(importlib.import_module(lowering.NATIVE), "apply_passes")
    misses = {m["target"]: m["degrades"] for m in contract.check(live=True)}
    assert list(misses) == ["coreai.authoring.asset:compile_to_binary"]
    assert misses["coreai.authoring.asset:compile_to_binary"] == _need("coreai.authoring.asset:compile_to_binary").degrades
    assert misses["coreai.authoring.asset:compile_to_binary"].startswith(contract.LOWERING_FAILS)


def test_states_left_as_arguments_are_promoted_recorded_and_give_the_same_numbers(
        pinned, source, cfg, monkeypatch, tmp_path, caplog):
    _, _, want = pinned
    _without_the_rewrite(monkeypatch, optimize=True)
    recs = []
    with caplog.at_level(logging.WARNING):
        for run in ("a", "b"):
            recs.append(export.export_recipe(RWKV7, source, "fp16", cfg["recipes"]["fp16"], "b",
                                             tmp_path / run, CHUNK))
    rec = recs[0]
    assert {n: [t["name"] for t in f["states"]] for n, f in rec["functions"].items()} == \
        {"main": ["recState", "shiftState"], "prefill": ["recState", "shiftState"]}
    assert rec["byte_reproducible"] is True  # promoting costs no reproducibility: the second export below
    [m] = rec["toolchain_misses"]
    assert m["target"] == "coreai_torch:TorchConverter.to_coreai" and "AIProgram.optimize()" in m["degrades"]
    assert m["why"] == "left the states recState, shiftState as plain arguments and results " \
                       "(MutableBuffers.buffer_mutation)"
    warned = [r.getMessage() for r in caplog.records if "MutableBuffers" in r.getMessage()]
    assert len(warned) == 1, "said once per run"
    assert recs[0]["files"] == recs[1]["files"], "two promoted exports: the same bytes"
    monkeypatch.undo()  # the pins' lowering and runtime
    assert _same(_numbers(_lowered(rec, tmp_path / "a"), rec), want)


def test_states_left_as_arguments_without_optimize_are_refused_in_one_line(source, cfg, monkeypatch, tmp_path):
    _without_the_rewrite(monkeypatch, optimize=False)
    with pytest.raises(PipelineError, match=r"made function '(main|prefill)' hold states \[\], not \['recState', "
                       r"'shiftState'\] \(recState, shiftState became plain inputs and outputs\)"):
        export.export_recipe(RWKV7, source, "fp16", {"dtype": "float16"}, "b", tmp_path / "x", CHUNK)
    assert not (tmp_path / "x").exists(), "nothing written"
