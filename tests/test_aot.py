"""Device AOT: the xcrun command line (checked with a fake xcrun), and clear failures."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from recurrent_coreai.stages import aot
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.pipeline.records import read_aot

AOT_CFG = {"min_deployment_version": "27.0", "preferred_compute": "gpu"}
FAKE = """#!/usr/bin/env python3
import json, os, sys
from pathlib import Path
Path(os.environ["FAKE_XCRUN_LOG"]).write_text(json.dumps(sys.argv[1:]))
args = sys.argv[1:]
out, arch = Path(args[args.index("--output") + 1]), args[args.index("--architecture") + 1]
if os.environ.get("FAKE_XCRUN_FAIL"):
    print("error: unsupported deployment target", file=sys.stderr); sys.exit(3)
if not os.environ.get("FAKE_XCRUN_NO_OUTPUT"):
    (out / (Path(args[2]).stem + "." + arch + ".aimodelc")).mkdir()
"""


@pytest.fixture()
def export_dir(tmp_path):
    d = tmp_path / "export"
    (d / "m-fp16.aimodel").mkdir(parents=True)
    (d / "m-fp16.aimodel" / "main.mlirb").write_bytes(b"ir")
    return d


@pytest.fixture()
def fake_xcrun(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "xcrun"
    exe.write_text(FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(tmp_path / "argv.json"))
    return tmp_path / "argv.json"


def test_device_command_line(export_dir, fake_xcrun, tmp_path):
    out = tmp_path / "aot" / "h18p" / "fp16"
    aot.build_target(export_dir, "m-fp16", "fp16", "h18p", {"kind": "device", "platform": "iOS"}, AOT_CFG, out)
    argv = json.loads(fake_xcrun.read_text())
    assert argv[:3] == ["coreai-build", "compile", str(export_dir / "m-fp16.aimodel")]
    opts = dict(zip(argv[3::2], argv[4::2]))
    assert opts["--platform"] == "iOS" and opts["--architecture"] == "h18p"
    assert opts["--preferred-compute"] == "gpu" and opts["--min-deployment-version"] == "27.0"
    assert (out / "m-fp16.h18p.aimodelc").is_dir()
    record = read_aot(out)  # what it was compiled from, and what it holds
    assert record["from"] == {"main.mlirb": {"sha256": hashlib.sha256(b"ir").hexdigest(), "size": 2}}
    assert record["target"] == "h18p" and record["recipe"] == "fp16" and record["product"] == "m-fp16.h18p.aimodelc"


def test_no_xcrun_is_one_clear_line(export_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "aot"
    with pytest.raises(PipelineError) as exc:
        aot.build_target(export_dir, "m-fp16", "fp16", "h18p", {"kind": "device", "platform": "iOS"}, AOT_CFG, out)
    assert "xcrun not found: device compilation needs macOS with Xcode 27" in str(exc.value)
    assert not out.exists()


@pytest.mark.parametrize("env, needle", [("FAKE_XCRUN_FAIL", "coreai-build failed with exit 3: error: unsupported"),
                                         ("FAKE_XCRUN_NO_OUTPUT", "exited 0 but wrote no compiled model")])
def test_compiler_failures_are_reported(export_dir, fake_xcrun, tmp_path, monkeypatch, env, needle):
    monkeypatch.setenv(env, "1")
    out = tmp_path / "aot"
    with pytest.raises(PipelineError, match=needle):
        aot.build_target(export_dir, "m-fp16", "fp16", "h18p", {"kind": "device", "platform": "iOS"}, AOT_CFG, out)
    assert not out.exists()


def test_unknown_architecture_is_refused_before_running_xcrun(export_dir, fake_xcrun, tmp_path):
    with pytest.raises(PipelineError, match="target h99z: is not a known iOS architecture"):
        aot.compile_device(export_dir / "m-fp16.aimodel", "h99z", "iOS", AOT_CFG, tmp_path)
    assert not fake_xcrun.exists()


def test_missing_export_is_reported(tmp_path):
    with pytest.raises(PipelineError, match="export bundle is missing"):
        aot.build_target(tmp_path, "m-fp16", "fp16", "universal", {"kind": "linux"}, AOT_CFG, tmp_path / "o")


# --- both functions: the compiler takes the whole bundle ---------------------------------------------
INSPECTING_FAKE = """#!{python}
import json, os, sys
from pathlib import Path
from recurrent_coreai.coreai.runtime import bundle_signature
args = sys.argv[1:]
bundle = Path(args[2])
Path(os.environ["FAKE_XCRUN_LOG"]).write_text(json.dumps({{"argv": args, "functions": bundle_signature(bundle)}}))
out, arch = Path(args[args.index("--output") + 1]), args[args.index("--architecture") + 1]
(out / (bundle.stem + "." + arch + ".aimodelc")).mkdir()
"""


def test_device_compile_is_handed_a_bundle_with_every_function(tmp_path, monkeypatch):
    """coreai-build compiles the whole .aimodel (there is no per-function option): the bundle the
    aot stage hands it holds every function export.json records — decode and prefill, with their
    shapes — and nothing else is needed on the command line. A fake xcrun, run with this venv's
    Python, reads the bundle it was given with coreai-core."""
    import sys

    import torch

    from recurrent_coreai.coreai import convert
    from recurrent_coreai.families.rwkv7 import FAMILY
    from recurrent_coreai.families.rwkv7.export_graph import RWKV7Decode
    from recurrent_coreai.families.rwkv7.geometry import Geometry

    g = Geometry(layers=1, hidden=64, head_dim=64, ffn=64, vocab=8, decay_lora=4, a_lora=4, v_lora=4, gate_lora=4)
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    states = tuple(s.name for s in FAMILY.state_specs(g))
    functions = convert.convert(FAMILY, RWKV7Decode(g, torch.float16).eval(), export_dir / "m-fp16.aimodel", 4,
                                states)["functions"]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "xcrun"
    exe.write_text(INSPECTING_FAKE.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(tmp_path / "seen.json"))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    out = tmp_path / "aot"
    aot.build_target(export_dir, "m-fp16", "fp16", "h18p", {"kind": "device", "platform": "iOS"}, AOT_CFG, out)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["functions"] == {n: {k: f[k] for k in ("inputs", "outputs", "states")} for n, f in functions.items()}
    assert sorted(seen["functions"]) == ["main", "prefill"]
    assert seen["functions"]["prefill"]["inputs"][0]["shape"] == [1, 4]
    opts = seen["argv"][3:]
    assert sorted(opts[::2]) == ["--architecture", "--min-deployment-version", "--output", "--platform",
                                 "--preferred-compute"]  # no function selection: the whole bundle is compiled
    assert (out / "m-fp16.h18p.aimodelc").is_dir()
