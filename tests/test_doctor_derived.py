"""Doctor results re-derived at staging (issue 34, case 5; docs/bad-inputs.md row N19): publish (and
scripts/dvc_record.py) checks each ``<recipe>.doctor.json`` against what it derives from --
it linted this recipe's bundle, the source and the family's graph sources, and its judgement for
the recipe and its counts are what coreai doctor's findings and export.json give. A doctor JSON
copied from another recipe, or edited and sealed again, is one line."""

from __future__ import annotations

import json
import shutil

import pytest

from recurrent_coreai import families
from recurrent_coreai.pipeline import records
from recurrent_coreai.stages import derivation, doctor
from recurrent_coreai.util.errors import PipelineError

from test_doctor_per_recipe import ROOT, state_spaces_exports  # noqa: F401  (the fixture: a padded Mamba-2's exports)

MAMBA2 = families.get("mamba2")


@pytest.fixture(scope="module")
def doctored(state_spaces_exports):  # noqa: F811
    root = state_spaces_exports
    sources = [ROOT / s for s in MAMBA2.doctor_sources()]
    for recipe in ("fp16", "head"):
        out = root / f"{recipe}.doctor.json"
        if not out.exists():
            assert doctor.doctor_bundle(sources, root / "source", root / "export" / recipe, out)["exit_status"] < 2
    return root


def test_a_doctor_json_as_written_passes(doctored):
    for recipe in ("fp16", "head"):
        rec = derivation.check_doctor(doctored / f"{recipe}.doctor.json", "mamba2", doctored / "source",
                                      doctored / "export" / recipe)
        assert rec["exit_status"] < doctor.FAIL_STATUS


def test_a_doctor_json_of_another_recipe_is_refused(doctored, tmp_path):
    copied = tmp_path / "fp16.doctor.json"
    shutil.copyfile(doctored / "head.doctor.json", copied)
    with pytest.raises(PipelineError) as exc:
        derivation.check_doctor(copied, "mamba2", doctored / "source", doctored / "export" / "fp16")
    assert str(exc.value).startswith(f"{copied}: disagrees with {doctored / 'export' / 'fp16' / 'export.json'}: it "
                                     "linted [") and "padded-fp16.aimodel" in str(exc.value)


@pytest.mark.parametrize("edit, what", [
    (lambda r: r.update(defects=r["defects"] + 1), "defects is"),
    (lambda r: r["reports"][-2]["findings"][0].pop("not_applicable"), "reports is"),
])
def test_a_doctor_json_edited_and_resealed_is_refused(doctored, tmp_path, edit, what):
    record = json.loads((doctored / "fp16.doctor.json").read_text())
    record.pop(records.SEAL)
    edit(record)
    forged = tmp_path / "fp16.doctor.json"
    forged.write_text(records.sealed_text(record, "doctor"))
    with pytest.raises(PipelineError) as exc:
        derivation.check_doctor(forged, "mamba2", doctored / "source", doctored / "export" / "fp16")
    assert str(exc.value).startswith(f"{forged}: disagrees with {forged}: {what}"), str(exc.value)
    assert str(exc.value).endswith("-- fix: rerun it: snakemake --cores 1 publish --forcerun doctor")
