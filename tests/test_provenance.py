"""Provenance statements and model-signing signatures for the published bundle folders.

Everything runs on copies of bundle folders from the session's ``tiny_results`` tree (never the
tree itself), with an EC key made here. Digests are recomputed with hashlib over os.walk, not
with the pipeline's own manifest code; versions come from importlib.metadata and the recipe
from config.yaml."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from recurrent_coreai.hub import provenance
from recurrent_coreai.hub import signing
from recurrent_coreai.util.errors import PipelineError

MODEL, RECIPE = "rwkv7-tiny", "int8keepproj"  # the smallest recipe of the tiny tree
BUNDLE = f"{MODEL}-{RECIPE}"
AIMODEL_REL, UNIVERSAL_REL = f"aimodel/{BUNDLE}", f"universal/{BUNDLE}"
CLI = Path(sys.executable).with_name("model_signing")


def _digests(folder: Path, skip=()) -> dict[str, str]:
    """sha256 of every file below ``folder`` by POSIX relative path (hashlib + os.walk)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if rel not in skip and name != ".snakemake_timestamp":
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _pem(key, password: bytes | None = None) -> bytes:
    crypt = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, crypt)


def _flip(path: Path, offset: int = 1000) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture(scope="module")
def inputs(tiny_results):
    """What publish holds for the recipe: export record, gate, source manifest, code digests."""
    base = tiny_results / MODEL
    return {"export_record": json.loads((base / "export" / RECIPE / "export.json").read_text()),
            "gate": json.loads((base / "gate" / f"{RECIPE}.json").read_text()),
            "source_manifest": json.loads((base / "source" / "manifest.json").read_text()),
            "code": {"export": "e" * 64, "aot": "a" * 64, "gate": "9" * 64, "stage_and_push": "5" * 64}}


@pytest.fixture
def hub(tiny_results, tmp_path) -> Path:
    """A copy of the recipe's two staged bundle folders (a private copy: tests change bytes)."""
    root = tmp_path / "hub"
    for rel in (AIMODEL_REL, UNIVERSAL_REL):
        shutil.copytree(tiny_results / MODEL / "publish" / rel, root / rel,
                        ignore=shutil.ignore_patterns("*.intoto.json", "*.sig"))
    return root


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("key") / "signing-key.pem"
    path.write_bytes(_pem(ec.generate_private_key(ec.SECP256R1())))
    return path


@pytest.fixture
def with_key(monkeypatch, key_file) -> Path:
    monkeypatch.setenv(signing.KEY_ENV, str(key_file))
    monkeypatch.delenv(signing.PASSWORD_ENV, raising=False)
    return key_file


def _attest(hub: Path, rel: str, inputs: dict) -> dict:
    return provenance.attest(hub, rel, targets=["universal"], **inputs)


def _statement(hub: Path, rel: str) -> dict:
    return json.loads((hub / rel / f"{BUNDLE}.intoto.json").read_text())


def _cli_verify(hub: Path, rel: str) -> subprocess.CompletedProcess:
    """The exact command the card and receipt give users, run in the Hub tree."""
    return subprocess.run(signing.verify_command(rel).replace("model_signing", str(CLI), 1).split(),
                          cwd=hub, capture_output=True, text=True, timeout=120)


def test_statement_describes_the_bundle_folder(hub, inputs, cfg, tiny_results):
    _attest(hub, AIMODEL_REL, inputs)
    stmt = _statement(hub, AIMODEL_REL)
    assert stmt["_type"] == "https://in-toto.io/Statement/v1"
    assert stmt["predicateType"] == "https://slsa.dev/provenance/v1"
    # one subject per file of the folder (the statement itself excluded), with its sha256
    expected = _digests(hub / AIMODEL_REL, skip={f"{BUNDLE}.intoto.json"})
    assert {s["name"]: s["digest"]["sha256"] for s in stmt["subject"]} == expected
    assert len(stmt["subject"]) == len(expected) and {"export.json", "gate.json"} <= set(expected)
    assert any(name.startswith(f"{BUNDLE}.aimodel/") for name in expected)

    build = stmt["predicate"]["buildDefinition"]
    assert build["buildType"] == provenance.BUILD_TYPE
    params = build["externalParameters"]
    assert params["model"] == MODEL and params["bundle"] == AIMODEL_REL and params["targets"] == ["universal"]
    assert params["recipe"] == {"name": RECIPE, "definition": cfg["recipes"][RECIPE]}  # the full recipe

    deps = {d["name"]: d for d in build["resolvedDependencies"]}
    source_dir = tiny_results / MODEL / "source"
    source_files = _digests(source_dir, skip={"manifest.json"})
    assert {n.removeprefix("source/"): d["digest"]["sha256"] for n, d in deps.items()
            if n.startswith("source/") and not n.startswith("source/upstream/")} == source_files
    manifest = json.loads((source_dir / "manifest.json").read_text())["source"]
    assert deps["source"]["uri"] == manifest["uri"]
    assert deps["source"]["annotations"]["revision"] == manifest["revision"]
    # the code by content (the publish stage's digest covers every stage's), never a git commit
    assert deps["rwkv7-coreai"]["digest"] == {"sha256": inputs["code"]["stage_and_push"]}
    assert deps["rwkv7-coreai"]["annotations"]["code"] == inputs["code"]

    tools = build["internalParameters"]["toolchain"]
    for pkg in ("torch", "coreai-core", "coreai-torch", "coreai-opt"):
        assert tools[pkg] == importlib.metadata.version(pkg)
    assert tools["python"] == platform.python_version()
    assert tools["os"]["system"] == platform.system() and tools["os"]["machine"] == platform.machine()
    if platform.system() != "Darwin":
        assert tools["os"]["macos_build"] == tools["os"]["coreai_build"] == "absent"

    gate = json.loads((hub / AIMODEL_REL / "gate.json").read_text())
    summary = stmt["predicate"]["runDetails"]["byproducts"][0]["annotations"]
    for k in ("pass", "steps", "agree_counted", "counted", "max_abs_dlogits", "mean_kl"):
        assert summary[k] == gate[k], k
    assert summary["pass"] is True
    assert summary["subjects_tested"] == sorted(n for n in expected if n.startswith(f"{BUNDLE}.aimodel/"))


def test_device_folder_names_the_gated_bundle_it_was_built_from(hub, inputs):
    _attest(hub, UNIVERSAL_REL, inputs)
    stmt = _statement(hub, UNIVERSAL_REL)
    assert {s["name"] for s in stmt["subject"]} == set(_digests(hub / UNIVERSAL_REL, skip={f"{BUNDLE}.intoto.json"}))
    deps = {d["name"]: d["digest"]["sha256"] for d in stmt["predicate"]["buildDefinition"]["resolvedDependencies"]
            if d["name"].startswith("aimodel/")}
    aimodel = _digests(hub / AIMODEL_REL / f"{BUNDLE}.aimodel")
    assert deps == {f"{AIMODEL_REL}/{BUNDLE}.aimodel/{rel}": sha for rel, sha in aimodel.items()}
    tested = stmt["predicate"]["runDetails"]["byproducts"][0]["annotations"]["subjects_tested"]
    assert tested and all(name.startswith(f"{BUNDLE}.aimodelx/") for name in tested)  # the lowering the gate ran


def test_statement_is_byte_reproducible_and_host_free(hub, inputs, tmp_path):
    import socket

    _attest(hub, AIMODEL_REL, inputs)
    first = (hub / AIMODEL_REL / f"{BUNDLE}.intoto.json").read_bytes()
    other = tmp_path / "elsewhere" / "deeper"
    shutil.copytree(hub, other)
    _attest(other, AIMODEL_REL, inputs)  # same inputs, another absolute path
    _attest(hub, AIMODEL_REL, inputs)  # and again in place (the old statement is not a subject)
    assert (other / AIMODEL_REL / f"{BUNDLE}.intoto.json").read_bytes() == first
    assert (hub / AIMODEL_REL / f"{BUNDLE}.intoto.json").read_bytes() == first
    text = first.decode()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    leaves = []

    def walk(v):
        if isinstance(v, dict):
            leaves.extend(v)
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            leaves.append(v)

    walk(json.loads(text))
    assert str(tmp_path) not in text and not any(s.startswith("/") for s in leaves)
    host = socket.gethostname()
    assert host not in leaves and (len(host) < 4 or all(host not in s for s in leaves))


def test_sources_are_named_without_local_paths(inputs, hub, tmp_path):
    src = inputs["source_manifest"]
    local = {**src, "source": {"kind": "path", "uri": f"file://{tmp_path}/my-checkpoint", "revision": None},
             "upstream": {"model.pth": {"sha256": "ab" * 32, "size": 1}}}
    rev = "0123456789abcdef0123456789abcdef01234567"
    hf = {**src, "source": {"kind": "hf", "uri": "hf://RWKV/Some-Model", "revision": rev},
          "upstream": {"model.safetensors": {"sha256": "cd" * 32, "size": 1}}}
    common = dict(bundle_rel=AIMODEL_REL, export_record=inputs["export_record"], gate=inputs["gate"],
                  targets=["universal"],
                  platform_info=provenance.platform_record(), pipeline=provenance.pipeline_record())
    deps = {d["name"]: d for d in provenance.statement(hub / AIMODEL_REL, source_manifest=local, **common)
            ["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert str(tmp_path) not in json.dumps(deps)
    assert deps["source"]["annotations"] == {"kind": "path", "name": "my-checkpoint", "revision": None}
    assert "uri" not in deps["source"] and deps["source/upstream/model.pth"]["digest"] == {"sha256": "ab" * 32}
    deps = {d["name"]: d for d in provenance.statement(hub / AIMODEL_REL, source_manifest=hf, **common)
            ["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["source"]["uri"] == f"hf://RWKV/Some-Model@{rev}" and deps["source"]["digest"] == {"gitCommit": rev}
    assert deps["source/upstream/model.safetensors"]["uri"] == f"hf://RWKV/Some-Model@{rev}/model.safetensors"


def test_platform_record_on_macos(monkeypatch, tmp_path):
    """On macOS the build of the OS and coreai-build's version are recorded (fake tools here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, out in (("sw_vers", "27A5123x"), ("xcrun", "coreai-build version 27.0 (2701.1)")):
        (bin_dir / name).write_text(f"#!/bin/sh\necho '{out}'\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "mac_ver", lambda: ("27.0", ("", "", ""), "arm64"))
    rec = provenance.platform_record()
    assert rec["macos_version"] == "27.0" and rec["macos_build"] == "27A5123x"
    assert rec["coreai_build"] == "coreai-build version 27.0 (2701.1)"
    (bin_dir / "xcrun").write_text("#!/bin/sh\nexit 1\n")
    assert provenance.platform_record()["coreai_build"] == "absent"


def test_the_published_tree_attests_the_code_of_every_stage_by_content(tiny_results):
    """Each statement of the built tree names the code that built it: one digest per stage, the
    digests fingerprint.py computes from this checkout's files (what a verifier recomputes with
    ``python -m recurrent_coreai.pipeline.fingerprint``), and the publish stage's covering them all."""
    from recurrent_coreai.pipeline import fingerprint

    stmt = json.loads((tiny_results / MODEL / "publish" / AIMODEL_REL / f"{BUNDLE}.intoto.json").read_text())
    dep = {d["name"]: d for d in stmt["predicate"]["buildDefinition"]["resolvedDependencies"]}["rwkv7-coreai"]
    code = dep["annotations"]["code"]
    assert set(code) == {*fingerprint.ATTESTED, "stage_and_push"}
    assert code == fingerprint.attested("rwkv7")
    assert dep["digest"] == {"sha256": code["stage_and_push"]}
    covered = set(fingerprint.code_files("stage_and_push", "rwkv7"))
    assert all(set(fingerprint.code_files(rule, "rwkv7")) <= covered for rule in fingerprint.ATTESTED)
    cli = subprocess.run([sys.executable, "-m", "recurrent_coreai.pipeline.fingerprint", "export", "--family",
                          "rwkv7"], capture_output=True, text=True, check=True)
    assert cli.stdout.split() == [code["export"]]


def _attested_in(tree: Path) -> dict:
    """fingerprint.attested of two families, computed by the package copy in ``tree``."""
    code = ("import json; from recurrent_coreai.pipeline import fingerprint as f; "
            "print(json.dumps({x: f.attested(x) for x in ('rwkv7', 'mamba2')}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_code_digests_follow_content_not_the_checkout(tmp_path):
    """The same files give the same digests wherever they are, in git or not (so a commit of
    dvc.lock changes no statement); a changed line of one family's code changes that family's
    digests of exactly the stages running family code, and no other family's."""
    from recurrent_coreai.pipeline import fingerprint

    root, tree = fingerprint.ROOT, tmp_path / "copy"
    shutil.copytree(root, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "results", ".snakemake", ".dvc", "__pycache__", "tests", "docs", "bench"))
    before = _attested_in(tree)
    assert before == {f: fingerprint.attested(f) for f in ("rwkv7", "mamba2")}
    ref = tree / fingerprint.NAME / "families" / "rwkv7" / "reference.py"
    ref.write_text(ref.read_text() + "\n# changed\n")
    after = _attested_in(tree)
    assert after["mamba2"] == before["mamba2"]
    changed = {rule for rule in before["rwkv7"] if after["rwkv7"][rule] != before["rwkv7"][rule]}
    assert changed == fingerprint.FAMILY_RULES, changed  # every stage running RWKV-7's code, publish too
    assert provenance.pipeline_record(after["rwkv7"])["code"] == dict(sorted(after["rwkv7"].items()))


def test_sign_then_verify_with_api_and_cli_and_one_flipped_byte_is_rejected(hub, inputs, with_key, capfd):
    for rel in (AIMODEL_REL, UNIVERSAL_REL):
        _attest(hub, rel, inputs)
    record = signing.sign_staged(hub, [AIMODEL_REL, UNIVERSAL_REL])
    assert record["signed"] is True
    assert record["key_sha256"] == hashlib.sha256((hub / "signing-key.pub").read_bytes()).hexdigest()
    sig = json.loads((hub / AIMODEL_REL / f"{BUNDLE}.sig").read_text())
    assert sig["verificationMaterial"]["publicKey"]["hint"] == record["key_sha256"]  # the key id users compare
    signed = json.loads(base64.b64decode(sig["dsseEnvelope"]["payload"]))["predicate"]["resources"]
    assert {r["name"]: r["digest"] for r in signed} == _digests(hub / AIMODEL_REL, skip={f"{BUNDLE}.sig"})

    signing.verify_before_upload(hub, record)
    proc = _cli_verify(hub, AIMODEL_REL)
    assert proc.returncode == 0 and "Verification succeeded" in proc.stdout, proc.stderr

    mlirb = hub / AIMODEL_REL / f"{BUNDLE}.aimodel" / "main.mlirb"
    _flip(mlirb)
    with pytest.raises(PipelineError) as err:
        signing.verify_before_upload(hub, record)
    assert err.value.where == str(mlirb) and "differs from the signed bundle" in err.value.what
    proc = _cli_verify(hub, AIMODEL_REL)
    assert proc.returncode == 1 and "Verification failed" in proc.stderr and "main.mlirb" in proc.stderr
    _flip(mlirb)  # the same byte back: both accept again, so the byte was the reason
    signing.verify_before_upload(hub, record)

    statement = hub / UNIVERSAL_REL / f"{BUNDLE}.intoto.json"  # the signature covers the provenance too
    statement.write_text(statement.read_text().replace('"pass": true', '"pass": false'))
    with pytest.raises(PipelineError, match="intoto.json: differs from the signed bundle"):
        signing.verify_before_upload(hub, record)
    assert _cli_verify(hub, UNIVERSAL_REL).returncode == 1


def test_added_file_wrong_key_and_foreign_signature_are_rejected(hub, with_key, tmp_path):
    record = signing.sign_staged(hub, [AIMODEL_REL, UNIVERSAL_REL])
    pub, aim_sig = hub / "signing-key.pub", hub / AIMODEL_REL / f"{BUNDLE}.sig"
    stranger = tmp_path / "stranger.pub"
    stranger.write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(PipelineError, match="was not made by the key stranger.pub"):
        signing.verify(hub / AIMODEL_REL, stranger, aim_sig)
    with pytest.raises(PipelineError, match="is not a PEM elliptic-curve public key"):
        signing.verify(hub / AIMODEL_REL, with_key, aim_sig)  # the private key given by mistake
    with pytest.raises(PipelineError, match="it signs another bundle"):
        signing.verify(hub / UNIVERSAL_REL, pub, aim_sig)
    (hub / AIMODEL_REL / "extra.txt").write_text("not signed")
    with pytest.raises(PipelineError, match="extra.txt: was not signed"):
        signing.verify(hub / AIMODEL_REL, pub, aim_sig)
    (hub / AIMODEL_REL / "extra.txt").unlink()
    (hub / AIMODEL_REL / "gate.json").unlink()
    with pytest.raises(PipelineError, match="gate.json: is missing"):
        signing.verify(hub / AIMODEL_REL, pub, aim_sig)
    pub.write_bytes(stranger.read_bytes())  # a swapped public key in the staged tree stops the upload
    with pytest.raises(PipelineError, match="is not the public key the bundles were signed with"):
        signing.verify_before_upload(hub, record)


def test_the_key_appears_in_no_file_and_no_output(hub, inputs, with_key, capfd, caplog):
    private = with_key.read_bytes()
    scalar = serialization.load_pem_private_key(private, None).private_numbers().private_value.to_bytes(32, "big")
    _attest(hub, AIMODEL_REL, inputs)
    record = signing.sign_staged(hub, [AIMODEL_REL])
    needles = [private, str(with_key).encode(), scalar, scalar.hex().encode(), base64.b64encode(scalar),
               private.split(b"\n")[1]]  # a line of the PEM body
    written = [p for p in hub.rglob("*") if p.is_file()]
    assert any(p.suffix == ".sig" for p in written)
    out, err = capfd.readouterr()
    for blob in [p.read_bytes() for p in written] + [json.dumps(record).encode(), out.encode(), err.encode(),
                                                     caplog.text.encode()]:
        for needle in needles:
            assert needle not in blob


def test_without_a_key_signing_is_skipped_with_the_reason(hub, monkeypatch):
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    record = signing.sign_staged(hub, [AIMODEL_REL])
    assert record == {"signed": False, "reason": f"signing skipped: no {signing.KEY_ENV} in the environment "
                                                 "(bundles are published unsigned)"}
    assert not list(hub.rglob("*.sig")) and not (hub / "signing-key.pub").exists()
    signing.verify_before_upload(hub, record)  # nothing to check


@pytest.mark.parametrize("case", ["missing", "rsa", "encrypted-no-password", "wrong-password", "not-pem"])
def test_bad_keys_are_one_line_without_the_path(hub, monkeypatch, tmp_path, case):
    path = tmp_path / "secret-location" / "key.pem"
    path.parent.mkdir()
    key = ec.generate_private_key(ec.SECP256R1())
    if case == "rsa":
        path.write_bytes(_pem(rsa.generate_private_key(public_exponent=65537, key_size=2048)))
    elif case in ("encrypted-no-password", "wrong-password"):
        path.write_bytes(_pem(key, b"right horse battery"))
        if case == "wrong-password":
            monkeypatch.setenv(signing.PASSWORD_ENV, "wrong")
    elif case == "not-pem":
        path.write_text("not a key\n")
    monkeypatch.setenv(signing.KEY_ENV, str(path))
    if case != "wrong-password":
        monkeypatch.delenv(signing.PASSWORD_ENV, raising=False)
    with pytest.raises(PipelineError) as err:
        signing.sign_staged(hub, [AIMODEL_REL])
    assert "secret-location" not in str(err.value) and err.value.fix
    assert not list(hub.rglob("*.sig"))
    expected = {"missing": "does not name a readable file", "rsa": "is not an elliptic-curve key",
                "encrypted-no-password": "is encrypted and no password was given",
                "wrong-password": "cannot be loaded", "not-pem": "cannot be loaded"}[case]
    assert expected in err.value.what


def test_an_encrypted_key_signs_with_its_password(hub, monkeypatch, tmp_path):
    path = tmp_path / "enc.pem"
    path.write_bytes(_pem(ec.generate_private_key(ec.SECP384R1()), b"right horse battery"))
    monkeypatch.setenv(signing.KEY_ENV, str(path))
    monkeypatch.setenv(signing.PASSWORD_ENV, "right horse battery")
    record = signing.sign_staged(hub, [UNIVERSAL_REL])
    signing.verify_before_upload(hub, record)
    assert "right horse battery" not in json.dumps(record)
