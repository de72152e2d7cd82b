"""pipeline/code_groups.py: dvc.yaml's `code` stage and the code set file each stage depends on
instead of its code files (a dvc.lock 3x smaller, which DVC rewrites after every stage)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import code_groups, dag, fingerprint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stages():
    return yaml.load((ROOT / "dvc.yaml").read_text(), Loader=yaml.CSafeLoader)["stages"]


def _groups(stages) -> list[str]:
    return [Path(o).name.removesuffix(code_groups.SUFFIX) for o in stages[code_groups.STAGE]["outs"]]


def test_each_stage_depends_on_exactly_its_code_sets_file(stages, cfg):
    """A stage's code set is what fingerprint.code_files gives its rule, family and tokenizer kind
    (what Snakemake's params: code hashes), and the stage lists no code file itself."""
    for name, st in stages.items():
        if name == code_groups.STAGE:
            continue
        deps = st["deps"]
        groups = [d for d in deps if d.startswith("results/code/")]
        assert len(groups) == 1, (name, groups)
        rule, wildcards = dag.stage_rule(name), name.split("-")[1:]
        if rule != "doctor":  # doctor lints the family's graph sources: inputs of its job, not its code
            assert not [d for d in deps if d.startswith(("recurrent_coreai/", "scripts/"))], name
        model = next((m for m in cfg["models"] if name.startswith(f"{rule}-{m}")), None)
        family = cfg["models"][model]["family"] if model else None
        from recurrent_coreai import families

        tokenizer = families.tokenizer_of(cfg["models"][model]) if model else None
        assert wildcards is not None
        assert code_groups.files(Path(groups[0]).name.removesuffix(code_groups.SUFFIX)) == \
            fingerprint.code_files(rule, family, tokenizer), name


def test_the_code_stage_depends_on_every_code_file_and_its_own(stages):
    code = stages[code_groups.STAGE]
    every = {f for g in _groups(stages) for f in code_groups.files(g)}
    assert sorted(code["deps"]) == sorted(every | set(code_groups.own_files()))
    assert {"scripts/code_groups.py", "recurrent_coreai/pipeline/code_groups.py",
            "recurrent_coreai/pipeline/fingerprint.py"} <= set(code["deps"])
    assert code["cmd"] == f"python scripts/code_groups.py --config-file config.yaml --out results/code " \
                          f"{' '.join(_groups(stages))}"
    assert code["params"] == [{"config.yaml": ["results"]}]  # DVC reads config.yaml before it runs this stage


def test_group_names_round_trip_and_bad_ones_are_refused():
    assert code_groups.group("aot", "rwkv7", "world") == "aot"  # no family code, no tokenizer
    assert code_groups.group("export", "mamba2") == "export.mamba2"
    assert code_groups.group("source", "mamba2") == "source.mamba2.hf-bpe"  # the family's kind by default
    assert code_groups.group("source", "mamba2", "bytes") == "source.mamba2.bytes"
    assert code_groups.parse("source.mamba2.hf-bpe") == ("source", "mamba2", "hf-bpe")
    assert code_groups.parse("toolchain") == ("toolchain", None, None)
    for bad in ("", "a..b", "a.b.c.d"):
        with pytest.raises(ValueError):
            code_groups.parse(bad)


def test_a_group_file_is_md5sum_output_and_reads_back(tmp_path):
    text = code_groups.text("export.rwkv7")
    listed = code_groups.recorded_md5s(text)
    assert list(listed) == fingerprint.code_files("export", "rwkv7")
    assert all(hashlib.md5((ROOT / rel).read_bytes()).hexdigest() == md5 for rel, md5 in listed.items())
    if shutil.which("md5sum"):
        (tmp_path / "g.md5").write_text(text)
        assert subprocess.run(["md5sum", "--quiet", "-c", str(tmp_path / "g.md5")], cwd=ROOT).returncode == 0
    with pytest.raises(ValueError):
        code_groups.recorded_md5s("not an md5 line\n")


def test_write_writes_all_when_one_differs_and_nothing_when_none_does(tmp_path):
    names = ["toolchain", "export.rwkv7"]
    out = tmp_path / "code"
    assert code_groups.write(out, names) is True
    assert sorted(p.name for p in out.iterdir()) == ["export.rwkv7.md5", "toolchain.md5"]
    assert code_groups.stale(out, names) == []
    times = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert code_groups.write(out, names) is False
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == times
    (out / "toolchain.md5").write_text("0" * 32 + "  scripts/toolchain.py\n")  # edited
    (out / "extra.md5").write_text("")
    assert code_groups.stale(out, names) == ["toolchain"]
    assert code_groups.write(out, names) is True
    assert sorted(p.name for p in out.iterdir()) == ["export.rwkv7.md5", "toolchain.md5"]  # the stray one removed
    assert code_groups.stale(out, names) == []


def test_an_edit_changes_exactly_the_group_files_of_the_stages_that_run_it(tmp_path, stages):
    """A copy of the code: editing the RWKV-7 family's reference changes the code sets of the stages
    running RWKV-7 family code (stage_and_push attests them all) and no other code set."""
    root = tmp_path / "repo"
    for sub in ("recurrent_coreai", "scripts"):
        shutil.copytree(ROOT / sub, root / sub, ignore=shutil.ignore_patterns("__pycache__"))
    names = _groups(stages)
    before = {n: code_groups.text(n, root) for n in names}
    with open(root / "recurrent_coreai/families/rwkv7/reference.py", "a") as fh:
        fh.write("\n# edited\n")
    changed = sorted(n for n in names if code_groups.text(n, root) != before[n])
    assert changed == sorted(n for n in names if n.split(".")[1:2] == ["rwkv7"]
                             and n.split(".")[0] in fingerprint.FAMILY_RULES), changed
    assert changed and all(n.split(".")[0] not in ("aot", "gate", "gate_shard", "toolchain") for n in changed)


def test_the_derivation_check_refuses_a_stale_group_file(tmp_path, stages, monkeypatch):
    from recurrent_coreai.stages import derivation
    from recurrent_coreai.util.errors import PipelineError

    monkeypatch.chdir(tmp_path)
    st = {**stages[code_groups.STAGE]}
    code_groups.write(tmp_path / "results/code", _groups(stages))
    derivation.check_stage(st)
    (tmp_path / "results/code/aot.md5").write_text("0" * 32 + "  scripts/aot.py\n")
    with pytest.raises(PipelineError, match=r"results/code/aot\.md5: is not the md5 list .* fix: write it again: "
                                            r"dvc repro code"):
        derivation.check_stage(st)
