"""Load, validate and query config.yaml (the same rules the Snakefile applies on start)."""

from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path

import jsonschema
import yaml

from recurrent_coreai.util.errors import PipelineError

DEVICE_ARCHITECTURES = {
    # device identifiers accepted by `xcrun coreai-build compile --architecture`; the compiler
    # itself accepts any name and exits 0, so we validate here.
    "iOS": ("h13g", "h14g", "h15g", "h16g", "h16p", "h17g", "h17p", "h18p"),
    "macOS": ("h16c",),
}
HEX40 = re.compile(r"^[0-9a-f]{40}$")
DEFAULT_FILE = "config.yaml"
ORIGIN_KEY = "_origin"
NAMED_SECTIONS = ("models", "recipes", "targets")
PLACEHOLDER_REVISION = "0" * 40


def schema() -> dict:
    return yaml.safe_load(resources.files(__package__).joinpath("schemas/config.schema.yaml").read_text())


def _where(path) -> str:
    return str(path) if path else "config"


def _branch_error(exc: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """For a ``oneOf`` over ``kind`` (the source kinds): the error of the branch the user meant."""
    if exc.validator != "oneOf" or not isinstance(exc.instance, dict):
        return exc
    kinds = [b.get("properties", {}).get("kind", {}).get("const") for b in exc.validator_value]
    kind = exc.instance.get("kind")
    if kind not in kinds:
        exc.message = f"kind {kind!r} is not one of {', '.join(k for k in kinds if k)}"
        return exc
    branch = [e for e in exc.context if e.schema_path and e.schema_path[0] == kinds.index(kind)]
    return _branch_error(jsonschema.exceptions.best_match(branch)) if branch else exc


def _schema_error(exc: jsonschema.ValidationError) -> tuple[str, str]:
    """One line for a schema violation: where, what, and (from the schema's ``description``) the fix."""
    exc = _branch_error(exc)
    loc = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
    what = exc.message if len(exc.message) <= 160 else exc.message[:157] + "..."
    if exc.validator == "propertyNames":
        return f"{loc}: {what}", "names that become paths use letters, digits, '-', '_' (and '.' in model names)"
    hint = exc.schema.get("description") if isinstance(exc.schema, dict) else None
    return f"invalid value at {loc}: {what}", hint or "correct it as recurrent_coreai/pipeline/schemas/config.schema.yaml describes"


def validate(cfg: dict, path: str | Path | None = None) -> dict:
    """Schema plus the cross-references the schema cannot express. Returns ``cfg``."""
    where = _where(path)
    if not isinstance(cfg, dict):
        raise PipelineError(where, f"the top level is a {type(cfg).__name__}, not a mapping",
                            "start from the shipped config.yaml")
    errors = sorted(jsonschema.Draft202012Validator(schema()).iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        # the deepest error of the first failing field says the most (oneOf branches nest theirs)
        first = min(errors, key=lambda e: (list(map(str, e.absolute_path))[:1], -len(e.absolute_path)))
        what, fix = _schema_error(jsonschema.exceptions.best_match([first]))
        raise PipelineError(where, what, fix)
    results = Path(cfg["results"])
    if results.exists() and not results.is_dir():
        raise PipelineError(where, f"results: {results} is a file, not a directory",
                            "point results: at a directory (it is created if missing)")
    for name, rec in cfg["recipes"].items():
        for key in ("include", "exclude"):
            for pattern in (rec.get("quantize") or {}).get(key, []):
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise PipelineError(where, f"recipes/{name}/quantize/{key}: {pattern!r} is not a valid "
                                        f"regular expression ({exc})", "fix the pattern (Python re syntax, matched in full)")
    for name, model in cfg["models"].items():
        if model.get("shipped") is not None and model["shipped"] not in model["recipes"]:
            raise PipelineError(where, f"models/{name}/shipped {model['shipped']!r} is not one of its recipes "
                                f"{model['recipes']}", "name one of the model's recipes, or remove shipped:")
        for recipe in model["recipes"]:
            if recipe not in cfg["recipes"]:
                raise PipelineError(where, f"models/{name} uses unknown recipe {recipe!r}",
                                    f"use one of {sorted(cfg['recipes'])} or define it under recipes:")
            if recipe not in cfg["gate"]["thresholds"]:
                raise PipelineError(where, f"recipe {recipe!r} has no gate threshold",
                                    f"add gate/thresholds/{recipe}")
        own = model.get("gate", {})
        for key in ("thresholds", "steps"):
            for recipe in own.get(key, {}):
                if recipe not in model["recipes"]:
                    raise PipelineError(where, f"models/{name}/gate/{key}/{recipe}: the model does not build "
                                        f"{recipe!r} (its recipes: {model['recipes']})",
                                        "remove the entry or add the recipe to the model's recipes")
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
    lowest, highest = len(cfg["gate"]["prompts"]), cfg["gate"]["steps"]
    for name in models_to_build(cfg):  # a model not built may keep steps for the usual gate.steps
        for recipe, steps in cfg["models"][name].get("gate", {}).get("steps", {}).items():
            if not lowest <= steps <= highest:
                raise PipelineError(where, f"models/{name}/gate/steps/{recipe} is {steps}: a recipe's gate compares "
                                    f"a part of the reference's gate/steps={highest} steps, at least one per prompt "
                                    f"({lowest})", f"use {lowest}..{highest}, or remove the entry")
    return cfg


def read_yaml(path: str | Path) -> object:
    """A YAML file; a syntax error names the file and the line."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(path, "config file not found", "run from the repository root or pass the right path") from None
    except IsADirectoryError:
        raise PipelineError(path, "is a directory, not a config file", "pass the path of a YAML file") from None
    except UnicodeDecodeError:
        raise PipelineError(path, "is not UTF-8 text", "save the config as UTF-8 YAML") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PipelineError(path, f"invalid YAML at {line}{problem}", "fix the YAML syntax there") from None


def load(path: str | Path = DEFAULT_FILE) -> dict:
    """Read and validate a config file. An effective config written by the Snakefile carries the
    files it was merged from (``_origin``): errors name those, not the generated file."""
    cfg = read_yaml(path)
    origin = cfg.pop(ORIGIN_KEY, None) if isinstance(cfg, dict) else None
    cfg = validate(cfg, origin or path)
    cfg[ORIGIN_KEY] = origin or str(path)
    return cfg


def origin(cfg: dict) -> str:
    """The file(s) the user gave for this config, for error messages."""
    return cfg.get(ORIGIN_KEY, DEFAULT_FILE)


def write_effective(cfg: dict, origins: list[str], state_dir: str | Path) -> str:
    """The config Snakemake merged (``configfile:`` + ``--configfile`` + ``--config``), as the file
    every stage reads. The same settings as config.yaml -> "config.yaml" itself (so the commands
    equal dvc.yaml's and naming it reruns nothing); otherwise a content-addressed file, so
    concurrent runs with different configs never share one."""
    plain = {k: v for k, v in cfg.items() if k != ORIGIN_KEY}
    if Path(DEFAULT_FILE).is_file() and read_yaml(DEFAULT_FILE) == plain:
        return DEFAULT_FILE
    text = yaml.safe_dump({ORIGIN_KEY: " + ".join(origins), **plain}, sort_keys=True, allow_unicode=True)
    import hashlib

    from recurrent_coreai.util.fsutil import write_text_atomic

    path = Path(state_dir) / f"config-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    if not path.is_file():
        write_text_atomic(path, text)
    return str(path)


def differs_from_default(cfg: dict, default_file: str | Path = DEFAULT_FILE) -> list[str]:
    """Top-level-and-below keys where ``cfg`` (minus ``build``, which only selects models)
    differs from config.yaml: the settings dvc.lock would otherwise misdescribe."""
    default = read_yaml(default_file) or {}
    out: list[str] = []

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(a.get(k), b.get(k), path + [str(k)])
        elif a != b:
            out.append(".".join(path))

    walk({k: v for k, v in cfg.items() if k not in ("build", ORIGIN_KEY)},
         {k: v for k, v in default.items() if k != "build"}, [])
    return out


def models_to_build(cfg: dict) -> list[str]:
    wanted = cfg.get("build") or [m for m, spec in cfg["models"].items() if spec["enabled"]]
    return sorted(wanted)


def _lookup(cfg: dict, section: str, kind: str, name: str) -> dict:
    try:
        return cfg[section][name]
    except KeyError:
        raise PipelineError(origin(cfg), f"unknown {kind} {name!r}", f"use one of {sorted(cfg[section])}") from None


def model(cfg: dict, name: str) -> dict:
    return _lookup(cfg, "models", "model", name)


def recipe(cfg: dict, name: str) -> dict:
    return _lookup(cfg, "recipes", "recipe", name)


def target(cfg: dict, name: str) -> dict:
    return _lookup(cfg, "targets", "target", name)


# Which config keys each stage reads: the ONE table behind the stages' reads (they get only
# these, pruned from the config), Snakemake's `params` (a change reruns exactly these stages)
# and DVC's `params` in the generated dvc.yaml. Paths are tuples ("models", "{model}", ...)
# because model names may hold dots.
STAGE_KEYS: dict[str, list[tuple[str, ...]]] = {
    "toolchain": [],
    "source": [("models", "{model}", "source"), ("models", "{model}", "license"), ("vocab",)],
    "vocab": [("vocab",)],
    "reference": [("gate", "prompts"), ("gate", "steps"), ("prefill",)],
    "export": [("recipes", "{recipe}"), ("models", "{model}", "dir"), ("models", "{model}", "shipped"),
               ("prefill", "chunk")],
    "aot": [("targets", "{target}"), ("aot",), ("models", "{model}", "dir"), ("models", "{model}", "shipped")],
    "gate": [("gate", "prompts"), ("gate", "steps"), ("gate", "near_tie_epsilon"), ("gate", "thresholds", "{recipe}"),
             ("models", "{model}", "gate")],
    "card": [("models", "{model}"), ("recipes",), ("targets",)],
    "stage_and_push": [("models", "{model}", k) for k in ("publish", "recipes", "targets", "dir", "shipped")],
    "doctor": [],
    "report": [],
}
_KINDS = {"models": "model", "recipes": "recipe", "targets": "target"}


def stage_keys(stage: str, **names: str | None) -> list[tuple[str, ...]]:
    """The key paths of ``stage`` with its wildcards filled in."""
    return [tuple(part.format(**names) for part in key) for key in STAGE_KEYS[stage]]


def settings(cfg: dict, stage: str, **names: str | None) -> dict:
    """The part of ``cfg`` that ``stage`` may read (same nesting, nothing else): what the stage
    reads, and by value what Snakemake's ``params`` hold. Unknown names are one-line errors;
    optional keys that are absent stay absent."""
    out: dict = {}
    for key in stage_keys(stage, **names):
        src, dst = cfg, out
        for depth, part in enumerate(key):
            if not isinstance(src, dict) or part not in src:
                if depth == 1 and key[0] in _KINDS:
                    _lookup(cfg, key[0], _KINDS[key[0]], part)  # raises "unknown model/recipe/target"
                break
            if depth == len(key) - 1:
                dst[part] = copy.deepcopy(src[part])
            else:
                dst = dst.setdefault(part, {})
                src = src[part]
    return out


def gate_settings(stage_settings: dict, recipe_name: str) -> dict:
    """The gate's settings for one recipe: ``thresholds`` narrowed to it, and ``steps``. The
    model's own (models/<model>/gate) where it sets them, with its ``why`` as ``thresholds_why``
    and ``steps_why``; otherwise gate/thresholds and gate/steps."""
    g = copy.deepcopy(stage_settings["gate"])
    g["thresholds"] = g["thresholds"][recipe_name]
    for model in stage_settings.get("models", {}).values():
        own = model.get("gate", {})
        if recipe_name in own.get("thresholds", {}):
            g["thresholds"] = copy.deepcopy(own["thresholds"][recipe_name])
            g["thresholds_why"] = own["why"]
        if recipe_name in own.get("steps", {}):
            g["steps"] = own["steps"][recipe_name]
            g["steps_why"] = own["why"]
    return g


def prompt_budgets(n_prompts: int, steps: int) -> list[int]:
    """Each prompt's share of ``steps`` gate steps (the first ones get the remainder)."""
    base, extra = divmod(steps, n_prompts)
    return [base + (1 if i < extra else 0) for i in range(n_prompts)]
