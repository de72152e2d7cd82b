"""Publishing (recurrent_coreai.stages.publish and the ``publish`` CLI) on a copy of the tiny pipeline run.

The staging tree, its receipt, the refusal to publish a bundle without a passing gate, the push
decision, and a real push (in a subprocess, as the pipeline runs it) against the local Hub stand-in
of tests/hubserver.py. The real ``results/`` tree is never modified: large files are hard-linked
into the copy (nothing here writes to them), everything a test edits is a private copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from hubserver import HubServer, client_env, run_python
from recurrent_coreai.stages import card as c
from recurrent_coreai.stages import cli
from recurrent_coreai.pipeline import records
from recurrent_coreai.pipeline.paths import stage_args
from recurrent_coreai.stages import publish as p

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS: Path = REPO_ROOT / "results"  # set to the session-built tree by conftest.py, never results/
MODEL = "rwkv7-trained"  # rwkv7 with a byte vocabulary: 34 MB of outputs, rwkv7-tiny's 65536-id head 693 MB
RECIPES = ["fp32", "fp16", "int8keepproj"]
TARGET = "universal"
DEVICE_VOCAB = "bytes_vocab.tsv"  # MODEL's tokenizer kind's device table
HUB_REPO = f"tester/{MODEL}-coreai"
TOKEN = "hf_FAKE_publish_token_42"
EPOCH = "1767225600"
LINK_ABOVE = 256 * 1024  # bytes; smaller files are copied, so editing them never reaches results/
LOCAL = {"publish.json", "coreai-catalog.yaml"}  # written beside the staged tree, never uploaded



# --- helpers ---------------------------------------------------------------------------------------
def _place(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.stat().st_size > LINK_ABOVE:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


def copy_results(dst: Path, recipes=RECIPES, model: str = MODEL) -> Path:
    """A results root holding what publish (and card) read for ``recipes`` -- publish also checks
    the gate TSVs, the reference stream and the doctor results against their stages' records --
    including the snakemake timestamps the real outputs carry; returns the root."""
    src, out = RESULTS / model, dst / model
    parts = (["source", "vocab", "card", "reference"] + [f"export/{r}" for r in recipes]
             + [f"aot/{TARGET}/{r}" for r in recipes])
    for part in parts:
        for path in sorted((src / part).rglob("*")):
            if path.is_file():
                _place(path, out / path.relative_to(src))
    for r in recipes:
        for name in (f"{r}.json", f"{r}.tsv", f"{r}.doctor.json"):
            _place(src / "gate" / name, out / "gate" / name)
    _place(RESULTS / "toolchain.json", dst / "toolchain.json")
    assert list(out.rglob(".snakemake_timestamp")), "the copy should carry the pipeline's timestamp files"
    return dst


def publish_args(results: Path, recipes=RECIPES, model: str = MODEL) -> list[str]:
    """The publish rule's inputs for a results copy holding ``recipes``."""
    return stage_args("publish", results, model, recipes, [TARGET])


def write_config(path: Path, model: str = MODEL, **model_changes) -> Path:
    """The built tree's config (its gate settings are the ones its gates ran: publish recomputes each
    verdict with the config's, stages/derivation.py) with ``model_changes``."""
    cfg = yaml.safe_load((RESULTS.parent / "config.yaml").read_text())
    cfg["models"][model].update(model_changes)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return path


def render_card(results: Path, config: Path, recipes: list[str]) -> None:
    """The card as the card stage renders it for ``config`` (publish renders it again and compares)."""
    from recurrent_coreai.pipeline import config as cfgmod

    settings = cfgmod.settings(cfgmod.load(config), "card", model=MODEL)
    lay = results / MODEL
    text = c.card_text(MODEL, settings, lay / "source", lay / "vocab", results / "toolchain.json",
                       [lay / "export" / r for r in recipes], [lay / "gate" / f"{r}.json" for r in recipes], None, None)
    replace_file(lay / "card" / "README.md", text)


def replace_file(path: Path, text: str) -> None:
    """Write a new file in place of ``path`` (as the pipeline's stages do: never in place, since the
    staging tree hard-links its inputs)."""
    path.unlink(missing_ok=True)
    path.write_text(text)


def replace_gate(path: Path, gate: dict) -> None:
    """A hand-made gate result in place of ``path``, sealed as the gate stage seals its JSON (so
    publish judges its verdict, not its seal)."""
    replace_file(path, records.sealed_text(gate, "gate"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def staged_bytes(rel: str, src: Path) -> bytes:
    """What publish stages at ``rel`` from ``src``: its bytes; the card checked and without its seal line."""
    return records.read_card(src).encode() if rel == "README.md" else src.read_bytes()


def all_files(root: Path) -> set[str]:
    return {q.relative_to(root).as_posix() for q in root.rglob("*") if q.is_file()}


def expected_tree(results: Path, recipes=RECIPES, model: str = MODEL) -> dict[str, Path]:
    """Staged path -> the results file it must be a copy of (README.md: the rendered card, which is
    staged without its seal line: see staged_bytes)."""
    lay = results / model
    tree = {"README.md": lay / "card" / "README.md"}
    for r in recipes:
        bundle = f"{model}-{r}"
        export = lay / "export" / r
        for f in (export / f"{bundle}.aimodel").rglob("*"):
            if f.is_file():
                tree[f"aimodel/{bundle}/{bundle}.aimodel/{f.relative_to(export / f'{bundle}.aimodel').as_posix()}"] = f
        tree[f"aimodel/{bundle}/export.json"] = export / "export.json"
        tree[f"aimodel/{bundle}/gate.json"] = lay / "gate" / f"{r}.json"
        aot = lay / "aot" / TARGET / r
        for f in (aot / f"{bundle}.aimodelx").rglob("*"):
            if f.is_file():
                tree[f"{TARGET}/{bundle}/{bundle}.aimodelx/{f.relative_to(aot / f'{bundle}.aimodelx').as_posix()}"] = f
        for name in records.vocab_files(lay / "vocab"):
            tree[f"{TARGET}/{bundle}/{name}"] = lay / "vocab" / name
            for folder in (f"aimodel/{bundle}", f"{TARGET}/{bundle}"):  # the runner contract (tests/test_runner_contract.py)
                tree[f"{folder}/tokenizer/{name}"] = lay / "vocab" / name
        for folder in (f"aimodel/{bundle}", f"{TARGET}/{bundle}"):
            tree[f"{folder}/metadata.json"] = tree[f"{folder}/runner.json"] = None  # written by publish
    return tree



@pytest.fixture
def no_token(monkeypatch):
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def staged(tmp_path, no_token, capsys):
    """cli.publish (push off, the default config) on a results copy."""
    results = copy_results(tmp_path / "results")
    config = write_config(tmp_path / "config.yaml")
    out = tmp_path / "out" / "publish"
    rc = cli.publish(["--config-file", str(config), "--model", MODEL, *publish_args(results), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return {"results": results, "out": out, "config": config, "stdout": captured.out, "stderr": captured.err}


# --- the staging tree and its receipt ----------------------------------------------------------------
def statements(recipes=RECIPES) -> set[str]:
    """The provenance statement publish writes into every bundle folder (no key: no signatures)."""
    return {f"{d}/{MODEL}-{r}/{MODEL}-{r}.intoto.json" for d in ("aimodel", TARGET) for r in recipes}


def test_staging_tree_layout(staged):
    out, results = staged["out"], staged["results"]
    expected = expected_tree(results)
    assert all_files(out) == set(expected) | statements() | {"publish.json"}
    for rel, src in expected.items():
        if src is not None:
            assert (out / rel).read_bytes() == staged_bytes(rel, src), rel
    assert (out / "README.md").read_text() == records.unseal_card(expected["README.md"].read_text())
    assert records.CARD_SEAL.search(expected["README.md"].read_text())  # (the card stage's output is sealed)
    for r in RECIPES:
        bundle = f"{MODEL}-{r}"
        assert (out / "aimodel" / bundle / f"{bundle}.aimodel").is_dir()
        assert (out / TARGET / bundle / f"{bundle}.aimodelx").is_dir()
        assert list((out / "aimodel" / bundle / f"{bundle}.aimodel").iterdir())
        assert list((out / TARGET / bundle / f"{bundle}.aimodelx").iterdir())
    # the README is the rendered card; the card's layout block describes exactly this tree
    layout = c.blocks((out / "README.md").read_text())["layout"]
    for r in RECIPES:
        bundle = f"{MODEL}-{r}"
        assert f"aimodel/{bundle}/{bundle}.aimodel/" in layout and f"{TARGET}/{bundle}/{DEVICE_VOCAB}" in layout
    # nothing but the staging tree beside it (atomic rename, temporaries removed)
    assert [q.name for q in out.parent.iterdir()] == ["publish"]


def test_receipt_lists_every_staged_file_with_hashes_and_gates(staged):
    out, results = staged["out"], staged["results"]
    receipt = json.loads((out / "publish.json").read_text())
    assert set(receipt["files"]) == all_files(out) - {"publish.json"}
    for rel, entry in receipt["files"].items():
        assert entry == {"sha256": sha256(out / rel), "size": (out / rel).stat().st_size}, rel
    assert set(receipt["gates"]) == set(RECIPES)
    for r in RECIPES:
        gate = json.loads((results / MODEL / "gate" / f"{r}.json").read_text())
        assert receipt["gates"][r]["pass"] is True
        for key in ("steps", "agree_counted", "counted", "near_ties", "max_abs_dlogits", "mean_kl", "bundle_sha256"):
            assert receipt["gates"][r][key] == gate[key], (r, key)
    assert receipt["push"]["pushed"] is False
    assert receipt["push"]["reason"].startswith("staging only"), receipt["push"]
    assert "no publish.repo" in receipt["push"]["reason"]
    assert receipt["push"]["would_commit"] == sorted(receipt["files"])
    assert receipt["model"] == MODEL and receipt["repo"] is None
    # the family (the catalog reads it) and the vocab stage's files, each staged beside every compiled bundle
    assert receipt["family"] == "rwkv7"
    vocab_files = sorted(q.name for q in (results / MODEL / "vocab").iterdir()  # less Snakemake's directory marker
                         if q.is_file() and q.name not in (".snakemake_timestamp", records.VOCAB_RECORD))
    assert receipt["tokenizer_files"] == vocab_files == records.vocab_files(results / MODEL / "vocab")
    assert DEVICE_VOCAB in vocab_files
    assert not [rel for rel in receipt["files"] if rel.endswith(records.VOCAB_RECORD)]  # the record is not staged
    for r in RECIPES:
        for name in vocab_files:
            assert f"{TARGET}/{MODEL}-{r}/{name}" in receipt["files"], (r, name)
    manifest = json.loads((results / MODEL / "source" / "manifest.json").read_text())
    assert receipt["source"] == manifest["source"]
    assert receipt["toolchain"] == json.loads((results / "toolchain.json").read_text())["versions"]
    assert all(r in receipt["commit_message"] for r in RECIPES)
    assert "staging only" in staged["stdout"] and staged["stderr"] == ""


def test_no_snakemake_timestamps_are_staged(staged):
    out = staged["out"]
    assert not [q for q in out.rglob("*") if q.name == ".snakemake_timestamp"]
    assert ".snakemake_timestamp" not in (out / "publish.json").read_text()
    # (while the inputs did carry them)
    assert list((staged["results"] / MODEL).rglob(".snakemake_timestamp"))


def test_restaging_replaces_the_tree(staged, capsys):
    """A second run (e.g. after a gate rerun) replaces the staging tree wholesale, with no leftovers."""
    out = staged["out"]
    (out / "stray.txt").write_text("left over from an older layout\n")
    rc = cli.publish(["--config-file", str(staged["config"]), "--model", MODEL, *publish_args(staged["results"]),
                      "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert not (out / "stray.txt").exists()
    assert all_files(out) == set(expected_tree(staged["results"])) | statements() | {"publish.json"}


# --- refusal -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("problem", ["fails", "missing", "unreadable"])
def test_a_recipe_without_a_passing_gate_is_refused(tmp_path, no_token, capsys, problem):
    results = copy_results(tmp_path / "results")
    config = write_config(tmp_path / "config.yaml")
    gate = results / MODEL / "gate" / "fp16.json"
    if problem == "fails":
        data = json.loads(gate.read_text())
        data.update({"pass": False, "agree_counted": 120, "reasons": ["top-1 agreement 120/127 < 1.0"]})
        replace_gate(gate, data)
    elif problem == "missing":
        gate.unlink()
    else:
        replace_file(gate, '{"pass": tru')
    out = tmp_path / "out" / "publish"
    rc = cli.publish(["--config-file", str(config), "--model", MODEL, *publish_args(results), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert str(gate) in err and "fp16" in err
    if problem == "fails":  # refused for its verdict (a sealed gate result), not for its record
        assert "did not pass its gate" in err, err
    assert "Traceback" not in err
    assert not out.exists()
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_the_staged_folders_are_the_configured_names(staged, tmp_path, capsys):
    """Publish stages exactly paths.published_folders; bundles built under other names (here:
    the config now ships int8keepproj under the bare dir name) are refused in one line."""
    from recurrent_coreai.pipeline.paths import published_folders

    cfg = yaml.safe_load(staged["config"].read_text())["models"][MODEL]
    out = staged["out"]
    assert sorted(f"{d.parent.name}/{d.name}" for d in out.glob("*/*") if d.is_dir()) == \
        published_folders(cfg, cfg["targets"])
    renamed = write_config(tmp_path / "renamed.yaml", shipped="int8keepproj")
    rc = cli.publish(["--config-file", str(renamed), "--model", MODEL, *publish_args(staged["results"]),
                      "--out", str(tmp_path / "again")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "but the config names" in err and f"'aimodel/{MODEL}'" in err, err
    assert "snakemake --forcerun export" in err and not (tmp_path / "again").exists()


def test_refusal_leaves_an_earlier_staging_tree_untouched(staged, capsys):
    out = staged["out"]
    before = {rel: sha256(out / rel) for rel in all_files(out)}
    gate = staged["results"] / MODEL / "gate" / "int8keepproj.json"
    data = json.loads(gate.read_text())
    data["pass"] = False
    replace_gate(gate, data)
    rc = cli.publish(["--config-file", str(staged["config"]), "--model", MODEL, *publish_args(staged["results"]),
                      "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and str(gate) in err and err.count("\n") == 1, err
    assert {rel: sha256(out / rel) for rel in all_files(out)} == before
    assert [q.name for q in out.parent.iterdir()] == ["publish"]


def test_check_gates_reports_each_recipe(tmp_path):
    good = json.loads((RESULTS / MODEL / "gate" / "fp32.json").read_text())
    records.write_sealed(tmp_path / "a.json", good, "gate")
    verdicts = p.check_gates([tmp_path / "a.json"])
    assert verdicts["fp32"]["pass"] is True and verdicts["fp32"]["counted"] == good["counted"]
    records.write_sealed(tmp_path / "b.json", {**good, "recipe": "fp16", "pass": "true"}, "gate")  # only a JSON true passes
    with pytest.raises(p.PipelineError) as exc:
        p.check_gates([tmp_path / "a.json", tmp_path / "b.json"])
    assert exc.value.where == str(tmp_path / "b.json") and "fp16" in exc.value.what


# --- the push decision -----------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, token, pushed, says", [
    ({"repo": None, "push": False}, None, False, "no publish.repo"),
    ({"repo": None, "push": True}, TOKEN, False, "no publish.repo"),
    ({"repo": HUB_REPO, "push": False}, TOKEN, False, "publish.push is off"),
    ({"repo": HUB_REPO, "push": True}, None, False, "no HF_TOKEN"),
    ({"repo": HUB_REPO, "push": True}, TOKEN, True, f"publishing to {HUB_REPO}"),
])
def test_decide(monkeypatch, no_token, cfg, token, pushed, says):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    do_push, why = p.decide(cfg)
    assert do_push is pushed
    assert says in why
    assert why.startswith("staging only") != pushed
    if cfg["repo"] and not pushed:
        assert cfg["repo"] in why  # says where it would have published
    assert TOKEN not in why


def test_decide_accepts_the_legacy_token_variable(monkeypatch, no_token):
    assert p.decide({"repo": HUB_REPO, "push": True})[0] is False
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", TOKEN)
    assert p.decide({"repo": HUB_REPO, "push": True}) == (True, f"publishing to {HUB_REPO}")
    monkeypatch.setenv("HF_TOKEN", "")
    assert p.decide({"repo": HUB_REPO, "push": True})[0] is True


# --- a real push against the local Hub stand-in ---------------------------------------------------------
PUBLISH = "import sys\nfrom recurrent_coreai.stages.cli import publish\nsys.exit(publish(sys.argv[1:]))\n"
CARD = "import sys\nfrom recurrent_coreai.stages.cli import card\nsys.exit(card(sys.argv[1:]))\n"
MAINTAINER_NOTE = "\n> Maintainer's note: fp16 is the bundle to start with on iPhone.\n"


def _run(code: str, env: dict, argv: list[str], cwd: Path) -> dict:
    proc = run_python(code, env, *argv, timeout=120, cwd=cwd)
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.fixture(scope="module")
def pushes(tmp_path_factory):
    """Three publishes of MODEL to the stand-in (push on, fake token), as the pipeline runs them:
    1. first publish; 2. the same again; 3. after a maintainer edits the remote card and the card is
    regenerated with new device numbers. Returns what each run printed, logged and recorded."""
    tmp = tmp_path_factory.mktemp("push")
    results = copy_results(tmp / "results")
    config = write_config(tmp / "config.yaml", publish={"repo": HUB_REPO, "push": True})
    out = results / MODEL / "publish"
    logs = tmp / "logs"
    runs = []
    with HubServer() as hub:
        env = client_env(hub, tmp / "hf_home", HF_TOKEN=TOKEN, SOURCE_DATE_EPOCH=EPOCH)
        argv = ["--config-file", str(config), "--model", MODEL, *publish_args(results), "--out", str(out)]

        def publish(i: int) -> dict:
            log = logs / f"publish{i}.log"
            run = _run(PUBLISH, env, [*argv, "--log", str(log)], tmp)
            run.update(log=log.read_text() if log.is_file() else "",
                       receipt_text=(out / "publish.json").read_text() if (out / "publish.json").is_file() else "",
                       history=hub.history(HUB_REPO) if HUB_REPO in hub.repos else [],
                       staged={rel: (out / rel).read_bytes() for rel in ["README.md"]},
                       files=all_files(out) if out.is_dir() else set())
            run["receipt"] = json.loads(run["receipt_text"]) if run["receipt_text"] else {}
            run["remote"] = hub.files_at(HUB_REPO) if HUB_REPO in hub.repos else {}
            runs.append(run)
            return run

        first = publish(1)
        second = publish(2)
        # a maintainer edits the published card on the Hub: a note outside the managed blocks, and
        # (wrongly) a line inside the recipes block, which the next publish overwrites
        card = hub.files_at(HUB_REPO)["README.md"].decode()
        edited = card.replace("## Bundles and their parity gate\n",
                              "## Bundles and their parity gate\n" + MAINTAINER_NOTE)
        edited = edited.replace("<!-- recipes end -->", "hand-typed 999 / 999\n<!-- recipes end -->")
        edited += "\n## Citation\n\nPlease cite RWKV-7.\n"
        maintainer_commit = hub.commit_files(HUB_REPO, {"README.md": edited}, message="maintainer edit")
        # new device numbers arrive: the card stage regenerates the card, then publish runs again
        config2 = write_config(tmp / "config.yaml", publish={"repo": HUB_REPO, "push": True},
                               device_numbers={"decode tok/s (iPhone 17 Pro)": 25})
        card_run = _run(CARD, env, ["--config-file", str(config2), "--model", MODEL,
                                    *stage_args("card", results, MODEL, RECIPES),
                                    "--out", str(results / MODEL / "card" / "README.md"),
                                    "--log", str(logs / "card.log")], tmp)
        assert card_run["rc"] == 0, card_run
        third = publish(3)
        state = {"runs": runs, "first": first, "second": second, "third": third, "edited": edited,
                 "maintainer_commit": maintainer_commit, "results": results, "out": out,
                 "server_errors": list(hub.errors), "server_log": repr(hub.log),
                 "commits": {oid: hub.commit(HUB_REPO, oid) for oid in hub.history(HUB_REPO)},
                 "hub_requests": list(hub.requests())}
    return state


def _ok(run):
    assert run["rc"] == 0, f"rc={run['rc']}\n--- stdout\n{run['stdout'][-3000:]}\n--- stderr\n{run['stderr'][-3000:]}"


def test_first_publish_is_one_commit_with_every_staged_file(pushes):
    first = pushes["first"]
    _ok(first)
    assert pushes["server_errors"] == []
    history = first["history"]
    assert len(history) == 2  # the repo's initial commit (create_repo) + exactly one of ours
    commit = pushes["commits"][history[0]]
    staged = first["files"] - LOCAL
    assert sorted(commit.operations) == sorted(f"add {rel}" for rel in staged)
    assert set(first["remote"]) == staged | {".gitattributes"}
    assert first["remote"]["README.md"] == first["staged"]["README.md"]  # nothing remote to merge into
    out_files = expected_tree(pushes["results"])
    for rel in staged - {"README.md"}:  # byte-identical with what was built
        assert hashlib.sha256(first["remote"][rel]).hexdigest() == first["receipt"]["files"][rel]["sha256"], rel
    assert set(first["receipt"]["files"]) == set(out_files) | statements()
    push = first["receipt"]["push"]
    assert push["pushed"] is True
    assert push["commit"] == history[0]
    assert push["repo"] == HUB_REPO and push["revision"] == "main"
    assert push["committed"] == sorted(staged) and push["skipped"] == []
    assert commit.message.startswith(first["receipt"]["commit_message"])
    assert f"commit {history[0]}" in first["stdout"]


def test_publish_json_stays_local(pushes):
    for run in pushes["runs"]:
        assert not LOCAL & set(run["remote"])
    assert (pushes["out"] / "publish.json").is_file()
    # coreai-catalog entries only after a push that made a commit (the second publish commits nothing)
    assert "coreai-catalog.yaml" in pushes["first"]["files"] and "coreai-catalog.yaml" not in pushes["second"]["files"]


def test_publishing_again_makes_no_commit(pushes):
    first, second = pushes["first"], pushes["second"]
    _ok(second)
    assert second["history"] == first["history"]
    push = second["receipt"]["push"]
    assert push["pushed"] is True and push["commit"] is None
    assert push["committed"] == [] and push["skipped"] == sorted(first["files"] - LOCAL)
    assert second["remote"] == first["remote"]


def test_maintainer_edit_survives_while_managed_blocks_are_rewritten(pushes):
    third = pushes["third"]
    _ok(third)
    history = third["history"]
    assert history[1] == pushes["maintainer_commit"]  # one new commit on top of the maintainer's
    assert len(history) == len(pushes["second"]["history"]) + 2
    push = third["receipt"]["push"]
    assert push["commit"] == history[0]
    assert push["committed"] == ["README.md"]  # the bundles did not change
    remote = third["remote"]["README.md"].decode()
    staged = third["staged"]["README.md"].decode()
    # the maintainer's text outside the blocks is kept, where it was
    assert "## Bundles and their parity gate\n" + MAINTAINER_NOTE in remote
    assert remote.endswith("\n## Citation\n\nPlease cite RWKV-7.\n")
    # every managed block is the freshly generated one (the hand-typed line inside a block is gone)
    assert "hand-typed 999 / 999" not in remote
    assert c.blocks(remote) == c.blocks(staged)
    assert "| decode tok/s (iPhone 17 Pro) | 25 |" in c.blocks(remote)["device-numbers"]
    assert remote == c.merge(pushes["edited"], staged)
    # the receipt describes the staged card (what the pipeline built), the Hub holds the merge
    assert third["receipt"]["files"]["README.md"]["sha256"] == hashlib.sha256(staged.encode()).hexdigest()


def test_the_token_never_comes_back_out(pushes):
    for run in pushes["runs"]:
        for where in ("stdout", "stderr", "log", "receipt_text"):
            assert TOKEN not in run[where], where
        assert run["log"], "the --log file should have been written"
    assert TOKEN not in pushes["server_log"]
    # it was sent to the Hub API (the stand-in records only that an Authorization header was present)
    assert any(e["auth"] for e in pushes["hub_requests"] if e["path"].endswith("/commit/main"))


def test_an_unreadable_remote_card_is_a_one_line_error_and_nothing_is_pushed(tmp_path):
    results = copy_results(tmp_path / "results", recipes=["int8keepproj"])
    config = write_config(tmp_path / "config.yaml", recipes=["int8keepproj"],
                          publish={"repo": HUB_REPO, "push": True})
    render_card(results, config, ["int8keepproj"])  # the card rule reruns for the new recipes
    with HubServer() as hub:
        head = hub.add_repo(HUB_REPO, {"README.md": "maintainer card\n"})
        hub.fail("GET", "*/resolve/*", 500, times=50)
        run = _run(PUBLISH, client_env(hub, tmp_path / "hf_home", HF_TOKEN=TOKEN),
                   ["--config-file", str(config), "--model", MODEL, *publish_args(results, ["int8keepproj"]),
                    "--out", str(tmp_path / "publish")], tmp_path)
        assert hub.head(HUB_REPO) == head  # never overwrite a card it could not read
    assert TOKEN not in run["stdout"] + run["stderr"]
    assert run["rc"] == 1
    assert run["stderr"].startswith("error: ") and run["stderr"].count("\n") == 1, run["stderr"]
    assert f"hf://{HUB_REPO}" in run["stderr"]


# --- provenance and signatures through the publish stage ---------------------------------------------
def test_publish_attests_and_signs_every_bundle_folder_and_a_changed_byte_fails(tmp_path, no_token, capsys,
                                                                                 monkeypatch):
    import subprocess
    import sys

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from recurrent_coreai.hub import signing

    key = tmp_path / "keys" / "signing.pem"
    key.parent.mkdir()
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    monkeypatch.setenv("RECURRENT_COREAI_SIGNING_KEY", str(key))
    results = copy_results(tmp_path / "results")
    out = tmp_path / "out" / "publish"
    rc = cli.publish(["--config-file", str(write_config(tmp_path / "config.yaml")), "--model", MODEL,
                      *publish_args(results), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    receipt = json.loads((out / "publish.json").read_text())
    folders = {f"aimodel/{MODEL}-{r}" for r in RECIPES} | {f"{TARGET}/{MODEL}-{r}" for r in RECIPES}
    assert set(receipt["provenance"]) == folders and receipt["signing"]["signed"] is True
    assert receipt["signing"]["key_sha256"] == sha256(out / "signing-key.pub")
    for rel in folders:
        statement = json.loads((out / receipt["provenance"][rel]["statement"]).read_text())
        assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    assert str(key) not in captured.out + captured.err and key.read_text() not in (out / "publish.json").read_text()
    bundle = f"aimodel/{MODEL}-fp16"
    cmd = [str(Path(sys.executable).with_name("model_signing")), "verify", "key", str(out / bundle), "--signature",
           str(out / bundle / f"{MODEL}-fp16.sig"), "--public_key", str(out / "signing-key.pub")]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    mlirb = out / bundle / f"{MODEL}-fp16.aimodel" / "main.mlirb"
    replace_file(mlirb, "changed after signing")  # a new file: the hard-linked results copy stays intact
    assert subprocess.run(cmd, capture_output=True, text=True).returncode != 0
    with pytest.raises(p.PipelineError, match="main.mlirb"):
        signing.verify_before_upload(out, receipt["signing"])
