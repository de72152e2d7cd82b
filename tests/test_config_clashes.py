"""Config-time refusals of what used to fail late or not at all: two models that push to one Hub
repo (the second push replaces the first's README.md), and a ``dir`` too long for the names the
pipeline makes from it (it failed only at export, with a wrong fix)."""

from __future__ import annotations

import copy
import errno
from pathlib import Path

import pytest
import yaml

from recurrent_coreai.pipeline import config
from recurrent_coreai.pipeline.paths import BUNDLE_SUFFIXES, NAME_MAX, bundle_name, device_suffix
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import TEMP_NAME_EXTRA

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def raw() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def refused(cfg: dict) -> str:
    with pytest.raises(PipelineError) as exc:
        config.validate(copy.deepcopy(cfg), "config.yaml")
    line = f"error: {exc.value}"
    assert "\n" not in line and line.count(" -- fix: ") == 1
    return line


def pushing(cfg: dict, model: str, repo: str, push: bool = True) -> dict:
    cfg["models"][model]["publish"] = {"repo": repo, "push": push}
    return cfg


# --- one Hub repo, two models ------------------------------------------------------------------
def test_the_shipped_config_shares_a_dir_but_no_pushed_repo(raw):
    dirs = [m["dir"] for m in raw["models"].values()]
    assert len(dirs) > len(set(dirs))   # rwkv7-1.5b-shape mirrors rwkv7-goose-1.5b's layout, unpushed
    config.validate(copy.deepcopy(raw), "config.yaml")


def test_two_models_pushing_to_one_repo_are_refused(raw):
    repo = raw["models"]["rwkv7-goose-1.5b"]["publish"]["repo"]
    line = refused(pushing(raw, "rwkv7-tiny", repo))
    assert line == (f"error: config.yaml: models/rwkv7-tiny and models/rwkv7-goose-1.5b both push to {repo}: the "
                    "second push would replace the first's README.md -- fix: give models/rwkv7-goose-1.5b/publish/repo "
                    "a repo of its own, or set its push: false")


def test_the_same_dir_in_one_repo_says_so_and_case_does_not_hide_it(raw):
    repo = raw["models"]["rwkv7-goose-1.5b"]["publish"]["repo"]
    line = refused(pushing(raw, "rwkv7-1.5b-shape", repo.upper()))   # dir rwkv7_goose_1_5b as well
    assert line.startswith(f"error: config.yaml: models/rwkv7-goose-1.5b and models/rwkv7-1.5b-shape both push to "
                           f"{repo.upper()} and the same dir: the second push would replace the first's README.md "
                           "and bundles -- fix: ")


def test_a_second_model_that_does_not_push_may_name_the_repo(raw):
    repo = raw["models"]["rwkv7-goose-1.5b"]["publish"]["repo"]
    config.validate(pushing(raw, "rwkv7-tiny", repo, push=False), "config.yaml")
    config.validate(pushing(raw, "rwkv7-tiny", repo + "-tiny"), "config.yaml")


# --- the length of dir ---------------------------------------------------------------------------
def longest_name(model: dict, cfg: dict) -> str:
    """The longest name the pipeline makes from the model's dir, its temporary included."""
    suffixes = list(BUNDLE_SUFFIXES) + [device_suffix(t) for t in model["targets"]
                                        if cfg["targets"][t]["kind"] == "device"]
    bundle = max((bundle_name(model, r) for r in model["recipes"]), key=len)
    return "." + bundle + max(suffixes, key=len) + ".abcdefgh.tmp"


def test_a_300_character_dir_is_refused_with_the_real_limit(raw):
    raw["models"]["rwkv7-tiny"]["dir"] = "d" * 300
    line = refused(raw)
    # recipes fp32, fp16, int8keepproj (no shipped one): '-int8keepproj'; target universal: '.intoto.json'
    assert line == ("error: config.yaml: models/rwkv7-tiny/dir is 300 bytes: with what the pipeline appends to it "
                    "('-int8keepproj' (recipe), '.intoto.json' and 14 for a temporary's '.<name>.XXXXXXXX.tmp') a name "
                    "would be 339 bytes, over the 255 one path component may hold -- fix: shorten "
                    "models/rwkv7-tiny/dir to at most 216 bytes")


@pytest.mark.parametrize("model", ["rwkv7-tiny", "rwkv7-goose-1.5b"])   # recipes only / a shipped one and h18p
def test_the_limit_is_the_longest_name_that_can_be_made(raw, model, tmp_path):
    """At the limit the longest name is exactly NAME_MAX bytes and can be created here; one byte
    more is refused by the config (and by the file system)."""
    spec = raw["models"][model]
    for size in range(190, 260):
        spec["dir"] = "d" * size
        try:
            config.validate(copy.deepcopy(raw), "config.yaml")
        except PipelineError as exc:
            assert f"shorten models/{model}/dir to at most {size - 1} bytes" in exc.fix
            break
    else:
        pytest.fail("no dir length refused")
    spec["dir"] = "d" * (size - 1)
    name = longest_name(spec, raw)
    assert len(name.encode()) == NAME_MAX and len("." + ".abcdefgh.tmp") == TEMP_NAME_EXTRA
    (tmp_path / name).mkdir()
    with pytest.raises(OSError) as exc:
        (tmp_path / (name + "x")).mkdir()
    assert exc.value.errno == errno.ENAMETOOLONG


def test_the_suffixes_are_those_the_stages_use():
    """paths.BUNDLE_SUFFIXES covers the hub's signature and statement names."""
    from recurrent_coreai.hub import provenance, signing

    assert signing.signature_name("a/b") == "b" + signing.SUFFIX and signing.SUFFIX in BUNDLE_SUFFIXES
    assert provenance.statement_name("a/b") == "b" + provenance.SUFFIX and provenance.SUFFIX in BUNDLE_SUFFIXES
