"""Ahead-of-time specialisation per target.

* ``universal`` (kind linux): the Linux lowering the Linux runtime loads -> ``<dir>.aimodelx``.
* Apple device architectures (kind device): ``xcrun coreai-build compile`` (macOS, Xcode 27)
  -> ``<dir>.<arch>.aimodelc``. Names are checked against the known list in config.py because
  the compiler itself accepts any name.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from recurrent_coreai.pipeline import stage
from recurrent_coreai.pipeline.config import DEVICE_ARCHITECTURES
from recurrent_coreai.coreai.runtime import lower_universal
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.fsutil import atomic_path, tree_manifest
from recurrent_coreai.pipeline.paths import bundle_name, device_suffix
from recurrent_coreai.pipeline.records import AOT, read_export, write_sealed



def device_command(aimodel: Path, arch: str, platform: str, aot_cfg: dict, out_dir: Path) -> list[str]:
    return ["xcrun", "coreai-build", "compile", str(aimodel),
            "--platform", platform, "--architecture", arch,
            "--preferred-compute", aot_cfg["preferred_compute"],
            "--min-deployment-version", aot_cfg["min_deployment_version"],
            "--output", str(out_dir)]


def compile_device(aimodel: Path, arch: str, platform: str, aot_cfg: dict, out_dir: Path) -> Path:
    if arch not in DEVICE_ARCHITECTURES.get(platform, ()):
        raise PipelineError(f"target {arch}", f"is not a known {platform} architecture",
                            f"use one of {', '.join(DEVICE_ARCHITECTURES.get(platform, ()))}")
    if shutil.which("xcrun") is None:
        raise PipelineError(f"target {arch}", "xcrun not found: device compilation needs macOS with Xcode 27 (coreai-build)",
                            "run this rule on a Mac with Xcode 27, or build only the universal target here")
    cmd = device_command(aimodel, arch, platform, aot_cfg, out_dir)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PipelineError(f"target {arch}", f"coreai-build failed with exit {proc.returncode}: {last}",
                            "check Xcode 27 is selected (xcode-select -p) and the bundle exports")
    product = out_dir / f"{aimodel.stem}{device_suffix(arch)}"
    if not product.exists():
        raise PipelineError(product, "coreai-build exited 0 but wrote no compiled model",
                            "check the Xcode version; the output name must be <dir>.<arch>.aimodelc")
    return product


def build_target(export_dir: Path, bundle: str, recipe: str, target: str, target_cfg: dict, aot_cfg: dict,
                 out_dir: Path) -> dict:
    """Lower or compile ``<bundle>.aimodel`` for ``target`` into ``out_dir``, with ``aot.json``:
    the digests of the bundle it was built from and of what it wrote (the gate and publish
    check both, so a lowering of other bytes is never shipped as this bundle's)."""
    aimodel = export_dir / f"{bundle}.aimodel"
    if not aimodel.is_dir():
        raise PipelineError(aimodel, "export bundle is missing", "run the export stage first")
    source_files = tree_manifest(aimodel)
    with atomic_path(out_dir, directory=True) as tmp:
        if target_cfg["kind"] == "linux":
            product = tmp / f"{bundle}.aimodelx"
            product.mkdir()
            lower_universal(aimodel, product)
        else:
            product = compile_device(aimodel, target, target_cfg.get("platform", "iOS"), aot_cfg, tmp)
        record = {"target": target, "recipe": recipe, "bundle": aimodel.name, "product": product.name,
                  "from": source_files, "files": tree_manifest(tmp)}
        write_sealed(tmp / AOT, record, "aot")  # beside the product; never published; sealed: pipeline/records.py
    return record


@main_guard
def main(argv=None) -> int:
    """The aot stage: ``scripts/aot.py --model M --recipe R --target T --export DIR --out DIR``."""
    import time

    ns = stage.parser("aot", "model", "recipe", "target", "export", "out").parse_args(argv)
    s, _ = stage.setup("aot", ns)
    t0 = time.perf_counter()
    read_export(Path(ns.export))  # the export stage's bytes, as it recorded them
    build_target(Path(ns.export), bundle_name(s["models"][ns.model], ns.recipe), ns.recipe, ns.target,
                 s["targets"][ns.target], s["aot"], Path(ns.out))
    stage.log.info("aot %s/%s/%s -> %s in %.1f s, peak RSS %.0f MB", ns.model, ns.target, ns.recipe, ns.out,
                   time.perf_counter() - t0, stage.rss_mb())
