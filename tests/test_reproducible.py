"""Byte-reproducible bundles and lowerings (the package recurrent_coreai/coreai/reproducible/).

* every assumption the patches make about coreai's internals still holds (else: which one broke);
* a build of the default model in a fresh process gives the same files (export + lowering) as
  the `snakemake` copy's build (tests/conftest.py smk_repo): other working directories, other
  PYTHONHASHSEEDs, address randomisation on;
* the reproducible bundle runs exactly like an unpatched one, and each canonicalisation is
  checked against MLIR's own reader/printer on an unpatched bundle.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from recurrent_coreai.coreai import reproducible
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import tree_manifest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "rwkv7-tiny"
RECIPES = ("fp32", "int8keepproj")

# One clean build in a fresh interpreter, through the stage entry points (as scripts/*.py).
BUILD = """
import sys
from recurrent_coreai.stages import cli
config, source, out = sys.argv[1:4]
for recipe in sys.argv[4:]:
    base = ["--config-file", config, "--model", "{model}", "--recipe", recipe]
    assert cli.export([*base, "--source", source, "--out", f"{{out}}/export/{{recipe}}"]) == 0
    assert cli.aot([*base, "--target", "universal", "--export", f"{{out}}/export/{{recipe}}",
                    "--out", f"{{out}}/aot/universal/{{recipe}}"]) == 0
""".format(model=MODEL)


@pytest.mark.parametrize("text,check", [(a.text, a.check) for a in reproducible.ASSUMPTIONS],
                         ids=[a.text for a in reproducible.ASSUMPTIONS])
def test_coreai_still_does_what_the_patches_rely_on(text, check):
    try:
        ok = check()
    except Exception as exc:  # noqa: BLE001 - a vanished attribute is exactly what we report
        ok, text = False, f"{text} ({type(exc).__name__}: {exc})"
    assert ok, f"coreai changed, reproducible bundles are no longer guaranteed: NOT TRUE ANY MORE: {text}"


def test_a_changed_coreai_is_reported(monkeypatch):
    """The checks can fail, and swap() on a patch point that vanished is one line (the scopes skip
    such a patch instead: tests/test_reproducible_degrade.py)."""
    import coreai.authoring.asset as asset
    import coreai.authoring.metal as metal

    def _write_odix(self, output_directory):  # a coreai that lowers some other way
        return output_directory

    monkeypatch.setattr(asset.AIModelAsset, "_write_odix", _write_odix)
    failing = [a.text for a in reproducible.ASSUMPTIONS if not a.check()]
    assert failing == [a.text for a in reproducible.ASSUMPTIONS if "_write_odix" in a.text]
    monkeypatch.delattr(metal, "choice")
    gone = r"coreai-core .*: reproducible build: coreai\.authoring\.metal\.choice no longer exists"
    with pytest.raises(PipelineError, match=gone):
        with reproducible.swap("coreai.authoring.metal", "choice", lambda original: original):
            pass
    gone = r"coreai\.authoring\.gone\.choice no longer exists \(no module coreai\.authoring\.gone\)"
    with pytest.raises(PipelineError, match=gone):  # looked up first: not a ModuleNotFoundError
        with reproducible.swap("coreai.authoring.gone", "choice", lambda original: original):
            pass


def test_scopes_restore_what_they_patch():
    import coreai.authoring.asset as asset
    import coreai.authoring.graph_builder as gb
    import secrets

    before = (gb.choice, asset._serialize_module_to_bytecode, asset.serialize_module_to_odix)
    with reproducible.export_scope("a"):
        names = [gb._randomize_fn_name("f") for _ in range(3)]
        assert gb.choice is not secrets.choice
    with reproducible.export_scope("a"):
        assert [gb._randomize_fn_name("f") for _ in range(3)] == names
    with reproducible.export_scope("b"):
        assert [gb._randomize_fn_name("f") for _ in range(3)] != names
    with reproducible.lowering_scope():
        assert asset.serialize_module_to_odix is not before[2]
    assert (gb.choice, asset._serialize_module_to_bytecode, asset.serialize_module_to_odix) == before


@pytest.mark.parametrize("first,expected", [("recurrent_coreai", "True"), ("coreai.runtime", "False")])
def test_swift_runtime_hashes_deterministically_when_recurrent_coreai_comes_first(first, expected):
    """metadata.json's key order: importing the package (as every stage does first) turns on
    deterministic hashing in the Swift runtime; loaded before it, the runtime is seeded randomly."""
    env = {k: v for k, v in os.environ.items() if k != reproducible.SWIFT_HASHING_ENV}
    code = (f"import {first}, coreai.runtime; from recurrent_coreai.coreai import reproducible; "
            "print(reproducible.swift_hashing_deterministic())")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == expected


def _unpatched_build(source: Path, family: str, recipes: dict, top: Path) -> None:
    """Export and lower with every patch switched off (as before the reproducible package existed)."""
    from recurrent_coreai import families
    from recurrent_coreai.coreai.runtime import lower_universal
    from recurrent_coreai.stages.export import export_recipe

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reproducible, "export_scope", lambda seed: contextlib.nullcontext())
        mp.setattr(reproducible, "lowering_scope", contextlib.nullcontext)
        for recipe in RECIPES:
            bundle = f"{MODEL}-{recipe}"
            export_recipe(families.get(family), source, recipe, recipes[recipe], bundle, top / "export" / recipe)
            lowered = top / "aot" / "universal" / recipe / f"{bundle}.aimodelx"
            lowered.mkdir(parents=True)
            lower_universal(top / "export" / recipe / f"{bundle}.aimodel", lowered)


@pytest.fixture(scope="module")
def builds(tiny_source, cfg, tmp_path_factory) -> dict[str, Path]:
    """The default model's fp32 and int8keepproj, exported and lowered: by the stage entry points
    in a fresh process (its own working directory and PYTHONHASHSEED), and at the same time in
    this process with the patches off."""
    top = tmp_path_factory.mktemp("build-seed4242")
    (top / "cwd").mkdir()
    env = {**os.environ, "PYTHONHASHSEED": "4242", "PYTHONPATH": str(ROOT)}
    env.pop(reproducible.SWIFT_HASHING_ENV, None)  # the package must set it itself
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILD, str(ROOT / "config.yaml"), str(tiny_source), str(top / "out"), *RECIPES],
        cwd=top / "cwd", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    unpatched = tmp_path_factory.mktemp("unpatched")
    try:
        _unpatched_build(tiny_source, cfg["models"][MODEL]["family"], cfg["recipes"], unpatched)
    finally:
        log = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, log[-3000:]
    assert "metadata.json key order will vary" not in log
    return {"fresh": top / "out", "unpatched": unpatched}


@pytest.fixture(scope="module")
def fresh(builds) -> Path:
    return builds["fresh"]


@pytest.fixture(scope="module")
def unpatched(builds) -> Path:
    return builds["unpatched"]


def test_two_clean_builds_are_byte_identical(fresh, smk_repo, tiny_source):
    """The fresh-process build against the `snakemake --cores 1 publish` copy's (another
    directory, PYTHONHASHSEED 11, digests recorded right after its build): every export and
    lowering file of these recipes is the same."""
    repo, smk = smk_repo
    a = tree_manifest(fresh)
    prefix = f"results/{MODEL}/"
    other = {rel.removeprefix(prefix): digest for rel, digest in smk["outputs"].items()
             if _recipe_of(rel.removeprefix(prefix)) in RECIPES}
    for recipe in RECIPES:
        assert f"export/{recipe}/rwkv7-tiny-{recipe}.aimodel/main.mlirb" in a
        assert f"aot/universal/{recipe}/rwkv7-tiny-{recipe}.aimodelx/main-universal.odix" in a
    assert sorted(a) == sorted(other)
    differing = [rel for rel in a if a[rel]["sha256"] != other[rel]]
    assert not differing, f"files differ between two clean builds: {differing}"
    records = [rel for rel in a if Path(rel).name in ("export.json", "aot.json")]
    assert len(records) == 2 * len(RECIPES)
    for rel in records:  # ours: no absolute paths, no timings (they would differ between machines)
        text = (fresh / rel).read_text()
        for path in (fresh, repo, tiny_source, ROOT):
            assert str(path) not in text, f"{rel} holds the absolute path {path}"
        keys = re.findall(r'"([^"]+)"\s*:', text)
        timed = [k for k in keys if re.search(r"(^|_)(seconds|time|timestamp|date|duration)($|_)", k, re.I)]
        assert not timed, f"{rel} holds timings: {timed}"


def _recipe_of(rel: str) -> str | None:
    """The recipe of a file below export/<recipe>/ or aot/universal/<recipe>/, else None."""
    parts = rel.split("/")
    if parts[0] == "export" and len(parts) > 2:
        return parts[1]
    if parts[:2] == ["aot", "universal"] and len(parts) > 3:
        return parts[2]
    return None


def _bundle(root: Path, recipe: str) -> Path:
    return root / "export" / recipe / f"{MODEL}-{recipe}.aimodel"


@pytest.mark.parametrize("recipe", RECIPES)
def test_reproducible_bundle_runs_bit_identically_to_an_unpatched_one(recipe, fresh, unpatched):
    from recurrent_coreai.coreai.runtime import DecodeSession

    ours = _bundle(fresh, recipe)
    theirs = _bundle(unpatched, recipe)
    names = _resource_names(ours / "main.mlirb")
    assert names == {f"resource_{i}" for i in range(len(names))}  # canonical: the patches acted
    assert not any(re.fullmatch(r"resource_\d{1,3}", n) for n in _resource_names(theirs / "main.mlirb"))
    record = json.loads((ours.parent / "export.json").read_text())
    shapes = {k: tuple(v) for k, v in record["states"].items()}
    dtype = np.dtype({"float32": np.float32, "float16": np.float16}[record["state_dtype"]])
    lowered = [fresh / "aot" / "universal" / recipe / f"{MODEL}-{recipe}.aimodelx",
               unpatched / "aot" / "universal" / recipe / f"{MODEL}-{recipe}.aimodelx"]
    with DecodeSession(lowered[0], shapes, dtype) as a, DecodeSession(lowered[1], shapes, dtype) as b:
        for token in (0, 11, 4000, 65000):
            la, lb = a.step(token), b.step(token)
            assert np.isfinite(la).all() and la.std() > 0
            np.testing.assert_array_equal(la, lb)
        for name, state in a.state_arrays().items():
            np.testing.assert_array_equal(state, b.state_arrays()[name])


def _asm(module) -> str:
    return module.operation.get_asm(large_elements_limit=8, large_resource_limit=8)


def _load(mlirb: Path):
    """The module as MLIR's own bytecode reader sees it."""
    from coreai.authoring.asset import load_module_from_bytecode
    from coreai.authoring.context import Context

    return load_module_from_bytecode(context=Context()._mlir_context, path=mlirb)


def _resource_names(mlirb: Path) -> set[str]:
    return set(re.findall(r"dense_resource<(resource_\d+)>", _asm(_load(mlirb))))


@pytest.mark.parametrize("recipe", RECIPES)
def test_resource_renaming_is_a_pure_renaming(recipe, unpatched, tmp_path):
    """MLIR's own reader on the canonicalised file: the same IR up to a one-to-one renaming of
    the resource keys, and not one byte before the string section touched."""
    original = _bundle(unpatched, recipe) / "main.mlirb"
    canonical = tmp_path / "main.mlirb"
    shutil.copyfile(original, canonical)
    assert reproducible.canonicalize_resource_names(canonical) > 0
    copy = tmp_path / "again.mlirb"
    shutil.copyfile(canonical, copy)
    assert reproducible.canonicalize_resource_names(copy) == 0 and copy.read_bytes() == canonical.read_bytes()

    with open(original, "rb") as fh:
        head = next(s for s in reproducible.sections(fh) if s["id"] == reproducible.SECTION_STRING)["header"]
    with open(original, "rb") as f1, open(canonical, "rb") as f2:
        assert f1.read(head) == f2.read(head)

    texts = [_asm(_load(p)) for p in (original, canonical)]
    names = [re.findall(r"dense_resource<(resource_\d+)>", t) for t in texts]
    assert len(names[0]) == len(names[1]) > 0
    pairs = set(zip(*names))
    assert len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs})  # one-to-one
    assert {b for _, b in pairs} == {f"resource_{i}" for i in range(len(pairs))}
    strip = [re.sub(r"resource_\d+", "resource_N", t) for t in texts]
    assert strip[0] == strip[1]


@pytest.mark.parametrize("recipe", RECIPES)
def test_register_reset_canonicalisation_only_permutes_resets(recipe, unpatched, tmp_path):
    """Printed by MLIR before and after: identical except the trailing resets of each region,
    which hold the same registers (as a multiset), now in definition order."""
    from coreai.authoring.asset import compile_to_binary

    module = _load(_bundle(unpatched, recipe) / "main.mlirb")
    compile_to_binary(module=module, output_directory=tmp_path, enable_debug_info=False)
    before = _asm(module).splitlines()
    assert reproducible.canonicalize_register_resets(module) > 100
    after = _asm(module).splitlines()
    reset = re.compile(r"^\s*odix\.load_imm %(\d+) \{imm = 0 : i64\}$")
    assert len(before) == len(after)
    changed = [i for i, (x, y) in enumerate(zip(before, after)) if x != y]
    assert changed and all(reset.match(before[i]) and reset.match(after[i]) for i in changed)
    runs, run = [], []
    for i, line in enumerate(after):  # maximal runs of resets: compare each as a multiset
        if reset.match(line):
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    for run in runs:
        regs = [int(reset.match(after[i]).group(1)) for i in run]
        assert Counter(regs) == Counter(int(reset.match(before[i]).group(1)) for i in run)
        if set(run) & set(changed):
            assert regs == sorted(regs)


def test_function_table_order_is_a_pure_permutation(fresh, tmp_path):
    """The .odix of a two-function bundle (main + prefill) lists its functions in either order.
    Put in the other order, the file still loads and both functions compute bit-identically;
    put back, it is byte for byte the canonical file again (name order, what the stage writes)."""
    from recurrent_coreai.coreai.runtime import PromptSession

    recipe = "fp32"
    built = fresh / "aot" / "universal" / recipe / f"{MODEL}-{recipe}.aimodelx"
    record = json.loads((fresh / "export" / recipe / "export.json").read_text())
    names = sorted(record["functions"])
    assert names == ["main", "prefill"]
    flipped = tmp_path / built.name
    shutil.copytree(built, flipped)
    odix = flipped / "main-universal.odix"
    assert not reproducible.canonicalize_function_table(odix, names)  # the stage wrote name order
    assert reproducible.canonicalize_function_table(odix, names[::-1])
    assert odix.read_bytes() != (built / odix.name).read_bytes()
    outputs = []
    for lowered in (built, flipped):
        with PromptSession(lowered, record) as session:
            logits = session.feed(list(range(3, 3 + session.chunk + 2)))
            outputs.append((logits, session.state_arrays()))
    np.testing.assert_array_equal(outputs[0][0], outputs[1][0])
    for name, state in outputs[0][1].items():
        np.testing.assert_array_equal(state, outputs[1][1][name])
    assert reproducible.canonicalize_function_table(odix, names)
    assert odix.read_bytes() == (built / odix.name).read_bytes()


def test_function_table_canonicalisation_refuses_an_unknown_layout(tmp_path):
    odix = tmp_path / "main-universal.odix"
    odix.write_bytes(b"odix" + bytes(12) + (64).to_bytes(4, "little") + bytes(44) + bytes(64))
    with pytest.raises(PipelineError, match="0 function tables named 'main'"):
        reproducible.canonicalize_function_table(odix, ["main", "prefill"])
    assert not reproducible.canonicalize_function_table(odix, ["main"])  # one function: nothing to order
