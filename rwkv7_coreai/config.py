"""Load, validate and query config.yaml (the same rules the Snakefile applies on start)."""

from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .errors import PipelineError

DEVICE_ARCHITECTURES = {
    # device identifiers accepted by `xcrun coreai-build compile --architecture`; the compiler
    # itself accepts any name and exits 0, so we validate here.
    "iOS": ("h13g", "h14g", "h15g", "h16g", "h16p", "h17g", "h17p", "h18p"),
    "macOS": ("h16c",),
}
HEX40 = re.compile(r"^[0-9a-f]{40}$")
PLACEHOLDER_REVISION = "0" * 40


def schema() -> dict:
    return yaml.safe_load(resources.files(__package__).joinpath("schemas/config.schema.yaml").read_text())


def _where(path) -> str:
    return str(path) if path else "config"


def validate(cfg: dict, path: str | Path | None = None) -> dict:
    """Schema plus the cross-references the schema cannot express. Returns ``cfg``."""
    where = _where(path)
    try:
        jsonschema.validate(cfg, schema())
    except jsonschema.ValidationError as exc:
        loc = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise PipelineError(where, f"invalid value at {loc}: {exc.message}",
                            "correct it as rwkv7_coreai/schemas/config.schema.yaml describes") from None
    for name, model in cfg["models"].items():
        for recipe in model["recipes"]:
            if recipe not in cfg["recipes"]:
                raise PipelineError(where, f"models/{name} uses unknown recipe {recipe!r}",
                                    f"use one of {sorted(cfg['recipes'])} or define it under recipes:")
            if recipe not in cfg["gate"]["thresholds"]:
                raise PipelineError(where, f"recipe {recipe!r} has no gate threshold",
                                    f"add gate/thresholds/{recipe}")
        for target in model["targets"]:
            if target not in cfg["targets"]:
                raise PipelineError(where, f"models/{name} uses unknown target {target!r}",
                                    f"use one of {sorted(cfg['targets'])} or define it under targets:")
        src = model["source"]
        if src["kind"] == "hf" and not HEX40.match(src["revision"]):
            raise PipelineError(where, f"models/{name}/source/revision {src['revision']!r} is not a full 40-hex commit hash",
                                "pin the exact commit (python scripts/pin_revision.py MODEL) for a reproducible build")
        if model["publish"]["push"] and not model["publish"]["repo"]:
            raise PipelineError(where, f"models/{name}/publish/push is on but no repo is named",
                                "set publish.repo to <user>/<repo> or push: false")
    for target, spec in cfg["targets"].items():
        if spec["kind"] == "device":
            platform = spec.get("platform", "iOS")
            if target not in DEVICE_ARCHITECTURES[platform]:
                raise PipelineError(where, f"targets/{target} is not a known {platform} architecture",
                                    f"use one of {', '.join(DEVICE_ARCHITECTURES[platform])}")
    for name in cfg.get("build", []):
        if name not in cfg["models"]:
            raise PipelineError(where, f"build names unknown model {name!r}", f"use one of {sorted(cfg['models'])}")
    return cfg


def load(path: str | Path = "config.yaml") -> dict:
    path = Path(path)
    try:
        cfg = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PipelineError(path, "config file not found", "run from the repository root or pass --config-file") from None
    except yaml.YAMLError as exc:
        raise PipelineError(path, f"invalid YAML ({str(exc).splitlines()[0]})", "fix the YAML syntax") from None
    return validate(cfg, path)


def models_to_build(cfg: dict) -> list[str]:
    wanted = cfg.get("build") or [m for m, spec in cfg["models"].items() if spec["enabled"]]
    return sorted(wanted)


def _lookup(cfg: dict, section: str, kind: str, name: str) -> dict:
    try:
        return cfg[section][name]
    except KeyError:
        raise PipelineError("config", f"unknown {kind} {name!r}", f"use one of {sorted(cfg[section])}") from None


def model(cfg: dict, name: str) -> dict:
    return _lookup(cfg, "models", "model", name)


def recipe(cfg: dict, name: str) -> dict:
    return _lookup(cfg, "recipes", "recipe", name)


def target(cfg: dict, name: str) -> dict:
    return _lookup(cfg, "targets", "target", name)


def gate_settings(cfg: dict, recipe_name: str) -> dict:
    g = copy.deepcopy(cfg["gate"])
    g["thresholds"] = g["thresholds"][recipe_name]
    return g


def stage_params(cfg: dict, stage: str, model_name: str, recipe_name: str | None = None,
                 target_name: str | None = None) -> dict[str, Any]:
    """The config values one stage depends on (Snakemake ``params:`` so that a change reruns it)."""
    m = model(cfg, model_name)
    out: dict[str, Any] = {}
    if stage == "source":
        out = {"source": m["source"], "vocab": cfg["vocab"]}
    elif stage == "vocab":
        out = {"vocab": cfg["vocab"]}
    elif stage == "reference":
        out = {"prompts": cfg["gate"]["prompts"], "steps": cfg["gate"]["steps"]}
    elif stage == "export":
        out = {"recipe": recipe(cfg, recipe_name), "dir": m["dir"]}
    elif stage == "aot":
        out = {"target": target(cfg, target_name), "aot": cfg["aot"], "dir": m["dir"]}
    elif stage == "gate":
        out = gate_settings(cfg, recipe_name)
    elif stage == "card":
        out = {k: m.get(k) for k in ("description", "license", "recipes", "targets", "dir", "device_numbers")}
    elif stage == "publish":
        out = {"publish": m["publish"], "recipes": m["recipes"], "targets": m["targets"], "dir": m["dir"]}
    return copy.deepcopy(out)
