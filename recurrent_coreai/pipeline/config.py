"""Load, validate and query config.yaml (the same rules the Snakefile applies on start)."""

from __future__ import annotations

import copy
import json
import functools
import math
import re
from collections.abc import Sequence
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
# libyaml's loader where PyYAML was built with it (its wheels are), ~5x faster than the pure-Python one
_SAFE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
PLACEHOLDER_REVISION = "0" * 40


def schema() -> dict:
    return copy.deepcopy(_schema())


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    """The package's config schema, parsed once per process (every validate() used to parse it again:
    ~150 ms of pure-Python YAML each time)."""
    return yaml.load(resources.files(__package__).joinpath("schemas/config.schema.yaml").read_text(), Loader=_SAFE)


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
    _refuse_non_finite(cfg, where)
    errors = sorted(jsonschema.Draft202012Validator(schema()).iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        # the deepest error of the first failing field says the most (oneOf branches nest theirs)
        first = min(errors, key=lambda e: (list(map(str, e.absolute_path))[:1], -len(e.absolute_path)))
        what, fix = _schema_error(jsonschema.exceptions.best_match([first]))
        raise PipelineError(where, what, fix)
    _refuse_reserved_model_names(cfg, where)
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
    text_settings(cfg["gate"], cfg["prefill"]["chunk"], where)
    for name, model in cfg["models"].items():
        check_family(name, model, where)
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
        _check_dir_length(name, model, cfg["targets"], where)
    _refuse_shared_publish_repos(cfg["models"], where)
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


def _check_dir_length(name: str, model: dict, targets: dict, where: str) -> None:
    """``dir`` leaves room, in one path component (paths.NAME_MAX bytes), for the longest name the
    pipeline makes from it: ``<dir>-<recipe>`` (paths.bundle_name), a suffix (paths.BUNDLE_SUFFIXES,
    ``.<arch>.aimodelc`` for a device target) and atomic_path's temporary around it."""
    from recurrent_coreai.pipeline.paths import BUNDLE_SUFFIXES, NAME_MAX, bundle_name, device_suffix
    from recurrent_coreai.util.fsutil import TEMP_NAME_EXTRA

    bundles = [bundle_name(model, r) for r in model["recipes"]] or [model["dir"]]
    bundle = max(bundles, key=lambda b: len(b.encode()))
    suffixes = list(BUNDLE_SUFFIXES) + [device_suffix(t) for t in model["targets"]
                                        if targets.get(t, {}).get("kind") == "device"]
    suffix = max(suffixes, key=len)
    size, added = len(model["dir"].encode()), len(bundle.encode()) - len(model["dir"].encode())
    if size + added + len(suffix.encode()) + TEMP_NAME_EXTRA <= NAME_MAX:
        return
    room = NAME_MAX - added - len(suffix.encode()) - TEMP_NAME_EXTRA
    extra = (f"'{bundle[len(model['dir']):]}' (recipe), " if added else "") + f"'{suffix}' and {TEMP_NAME_EXTRA} for a " \
        "temporary's '.<name>.XXXXXXXX.tmp'"
    raise PipelineError(where, f"models/{name}/dir is {size} bytes: with what the pipeline appends to it ({extra}) a "
                        f"name would be {size + NAME_MAX - room} bytes, over the {NAME_MAX} one path component "
                        "may hold", f"shorten models/{name}/dir to at most {room} bytes")


def _refuse_shared_publish_repos(models: dict, where: str) -> None:
    """Two models that push (``publish.push: true``) to one Hub repo: the second push replaces the
    first's README.md (and a bundle folder of the same name). Repo ids compared ignoring case, as
    the Hub resolves them. A shared ``dir`` alone clashes nowhere: results/ is per model name and
    the published layout per repo (rwkv7-1.5b-shape mirrors rwkv7-goose-1.5b's, unpushed)."""
    seen: dict[str, str] = {}
    for name, model in models.items():
        pub = model["publish"]
        if not (pub["push"] and pub["repo"]):
            continue
        other = seen.setdefault(pub["repo"].casefold(), name)
        if other != name:
            same_dir = " and the same dir" if models[other]["dir"] == model["dir"] else ""
            raise PipelineError(where, f"models/{other} and models/{name} both push to {pub['repo']}{same_dir}: the "
                                "second push would replace the first's README.md" + (" and bundles" if same_dir else ""),
                                f"give models/{name}/publish/repo a repo of its own, or set its push: false")


def check_family(name: str, model: dict, where: str) -> None:
    """``models.<name>.family`` is a registered family, ``tokenizer_eos`` is set only for the
    ``bytes`` tokenizer kind, and a synthetic source's ``shape`` and ``layout`` are ones that family
    accepts (the family checks its own geometry; its vocab holds the model's tokenizer kind's ids)."""
    from recurrent_coreai import families, tokenizers

    try:
        family = families.get(model["family"], where)
    except PipelineError as exc:
        raise PipelineError(where, f"models/{name}/family: {exc.what}", exc.fix) from None
    kind = families.tokenizer_of(model, where)  # the schema allows only tokenizers.KINDS
    if model.get(tokenizers.EOS_KEY) is not None and kind != "bytes":
        raise PipelineError(where, f"models/{name}/{tokenizers.EOS_KEY} is set, but the model's tokenizer is {kind}, "
                            "whose end of text is its own (World: token 0; the BPE kinds: the checkpoint's "
                            "tokenizer_config.json)", f"remove {tokenizers.EOS_KEY}, or set models/{name}/tokenizer: "
                            "bytes if the model is byte-level")
    src = model["source"]
    if src["kind"] != "synthetic":
        return
    try:
        geom = family.geometry_from_shape(src["shape"], where)
    except PipelineError as exc:
        raise PipelineError(where, f"models/{name}/{exc.what}", exc.fix) from None
    least = tokenizers.kind(kind).MIN_VOCAB  # the model's kind's ids (bytes 256, World 65530)
    if getattr(geom, "vocab", least) < least:
        raise PipelineError(where, f"models/{name}/source/shape/vocab {geom.vocab} is smaller than the "
                            f"{kind} tokenizer's {least} ids",
                            f"use vocab >= {least}" + (" (65536 for the World vocabulary)" if kind == "world" else "")
                            + f", or set models/{name}/tokenizer to the kind the model was trained with")
    layout = src.get("layout", family.layouts[0])
    if layout not in family.synthetic_layouts:
        raise PipelineError(where, f"models/{name}/source/layout {layout!r} is not one family {family.name} writes",
                            f"use one of {', '.join(family.synthetic_layouts)}")


def read_yaml(path: str | Path) -> object:
    """A YAML file; a syntax error names the file and the line, a duplicate key both lines."""
    path = Path(path)
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise PipelineError(path, "config file not found", "run from the repository root or pass the right path") from None
    except IsADirectoryError:
        raise PipelineError(path, "is a directory, not a config file", "pass the path of a YAML file") from None
    except UnicodeDecodeError:
        raise PipelineError(path, "is not UTF-8 text", "save the config as UTF-8 YAML") from None
    except DuplicateKeyError as exc:
        raise _duplicate_key(path, exc) from None
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


def merged(base: dict, over: dict) -> dict:
    """``over`` merged into ``base`` as Snakemake merges a ``--configfile`` over config.yaml: a
    mapping into a mapping key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_for_tool(path: str | Path = DEFAULT_FILE) -> dict:
    """The config a tool (generate, status) reads for ``--config-file``: a whole config as it is; a
    fragment -- a mapping without ``results:``, what ``snakemake --configfile`` merges over
    config.yaml, e.g. one that adds a model -- merged over config.yaml the same way, so the tools
    see the config the build ran with (errors name ``config.yaml + <fragment>``)."""
    path = Path(path)
    raw = read_yaml(path)
    default = Path(DEFAULT_FILE)
    if (not isinstance(raw, dict) or "results" in raw or ORIGIN_KEY in raw or not default.is_file()
            or path.resolve() == default.resolve()):
        return load(path)
    where = f"{DEFAULT_FILE} + {path}"
    base = read_yaml(default)
    cfg = validate(merged(base if isinstance(base, dict) else {}, raw), where)
    cfg[ORIGIN_KEY] = where
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
    # the tokenizer kind (models.<m>.tokenizer, default the family's: families.tokenizer_of) picks the
    # source's tokenizer files and fit check, the vocab stage's bake and the reference's prompts; the
    # bytes kind's end of text (tokenizer_eos) is the vocab stage's alone (its output carries it on)
    "source": [("models", "{model}", "family"), ("models", "{model}", "tokenizer"), ("models", "{model}", "source"),
               ("models", "{model}", "license"), ("vocab",)],
    "vocab": [("models", "{model}", "family"), ("models", "{model}", "tokenizer"), ("models", "{model}", "tokenizer_eos"),
              ("vocab",)],
    "reference": [("models", "{model}", "family"), ("models", "{model}", "tokenizer"), ("gate", "prompts"),
                  ("gate", "steps"), ("gate", "text"), ("prefill",), ("reference",)],
    "export": [("models", "{model}", "family"), ("recipes", "{recipe}"), ("models", "{model}", "dir"),
               ("models", "{model}", "shipped"), ("prefill", "chunk")],
    "aot": [("targets", "{target}"), ("aot",), ("models", "{model}", "dir"), ("models", "{model}", "shipped")],
    "gate": [("gate", "prompts"), ("gate", "steps"), ("gate", "near_tie_epsilon"), ("gate", "thresholds", "{recipe}"),
             ("gate", "text"), ("models", "{model}", "gate")],
    # a shard records the gate's settings, and the gather refuses one made with others; how many
    # shards (from gate/shard_seconds) is on its command line, and Snakemake's param
    "gate_shard": [("gate", "prompts"), ("gate", "steps"), ("gate", "near_tie_epsilon"),
                   ("gate", "thresholds", "{recipe}"), ("gate", "text"), ("models", "{model}", "gate")],
    "card": [("models", "{model}"), ("recipes",), ("targets",)],
    # publish renders the card again, recomputes each gate verdict from its TSV and bakes the vocab
    # stage's tables again (stages/derivation.py): the card's settings and the gate's, every recipe's
    # thresholds, the tokenizer settings
    "stage_and_push": [("models", "{model}"), ("recipes",), ("targets",), ("gate", "prompts"), ("gate", "steps"),
                       ("gate", "near_tie_epsilon"), ("gate", "thresholds"), ("gate", "text"), ("vocab",)],
    "doctor": [("models", "{model}", "family")],
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


def prefill_length(prefill: dict, config_file: str = "config.yaml") -> int:
    """Tokens in the gate's prefill stream: ``prefill.gate_tokens``, by default 2*chunk+5."""
    chunk = prefill["chunk"]
    n = prefill.get("gate_tokens", 2 * chunk + 5)
    if n < chunk + 1:
        raise PipelineError(config_file, f"prefill.gate_tokens {n} is shorter than chunk + 1 ({chunk + 1}): the gate "
                            "would not run a full chunk and a tail", "raise prefill.gate_tokens or leave it out "
                            "(default 2*chunk+5)")
    return n


def text_settings(gate: dict, chunk: int, config_file: str | Path = DEFAULT_FILE) -> dict | None:
    """The gate's long text stream (``gate.text``), checked against the prefill chunk: None where
    the config has none. The horizons are ascending multiples of ``chunk`` within ``tokens``: the
    chunk before each one goes through ``main`` token by token (stages/gate.py: text_check)."""
    text = gate.get("text")
    if text is None:
        return None
    tokens, horizons = int(text["tokens"]), [int(h) for h in text["horizons"]]
    fix = (f"set gate.text.horizons to ascending multiples of prefill.chunk ({chunk}) up to gate.text.tokens "
           f"({tokens}), e.g. [{chunk * 2}, {tokens - tokens % chunk}]")
    if horizons != sorted(horizons):
        raise PipelineError(config_file, f"gate.text.horizons {horizons} are not in ascending order", fix)
    for h in horizons:
        if h % chunk or h > tokens:
            raise PipelineError(config_file, f"gate.text.horizons holds {h}, which is "
                                + ("beyond gate.text.tokens " + str(tokens) if h > tokens
                                   else f"not a multiple of prefill.chunk {chunk}"), fix)
    return {"file": text["file"], "tokens": tokens, "horizons": horizons}


def gate_step_count(prompt_tokens: Sequence[int], steps: int) -> int:
    """The steps the gate compares for prompts of these token counts (the chat prompts as this
    model's tokenizer writes them): ``steps`` (gate/steps, or the model's own), raised to what the
    prompts need when they need more -- each prompt's tokens plus one generated step. A byte-level
    or small vocabulary spends more tokens on the same prompts; the gate then compares every prompt
    token and one generated step each, instead of refusing (the gate JSON and the card say so:
    ``steps_raised``). A token count of 0 (not recorded) needs one step."""
    return max(int(steps), sum(int(n) + 1 for n in prompt_tokens))


def prompt_budgets(prompt_tokens: Sequence[int], steps: int, config_file: str | Path = DEFAULT_FILE,
                   setting: str = "gate.steps") -> list[int]:
    """Each prompt's share of ``steps`` gate steps, from its token count (the chat prompt as the
    tokenizer writes it): a prompt needs its tokens plus one generated step. The rule: the steps
    are shared equally (the first prompts get the remainder); a prompt whose need exceeds its share
    gets exactly its need, and the steps left are shared equally among the others, again until
    every prompt's need fits its share. Whenever every prompt's need fits its equal share these are
    the equal shares. A token count of 0 (not known) needs one step. Refused in one line naming
    ``config_file`` when the needs together exceed ``steps`` (``setting`` names where the steps
    are configured)."""
    needs = [int(n) + 1 for n in prompt_tokens]
    if not needs:
        raise ValueError("prompt_budgets needs at least one prompt")
    if sum(needs) > steps:
        raise PipelineError(config_file, f"gate.prompts are {', '.join(str(n) for n in prompt_tokens)} tokens: with one "
                            f"generated step each they need {sum(needs)} steps, more than {setting}={steps}",
                            f"raise {setting} to at least {sum(needs)} or shorten the prompts")
    budgets: dict[int, int] = {}  # the prompts given exactly their need
    while True:
        shared = [i for i in range(len(needs)) if i not in budgets]
        base, extra = divmod(steps - sum(budgets.values()), len(shared))
        share = {i: base + (1 if k < extra else 0) for k, i in enumerate(shared)}
        over = {i: needs[i] for i in shared if needs[i] > share[i]}
        if not over:  # at least one prompt stays shared: the needs together fit steps
            return [budgets.get(i, share.get(i)) for i in range(len(needs))]
        budgets.update(over)


# --- What YAML, JSON and JSON Schema would accept silently (refused on start) -------------------
# Kept apart from validate(), which calls _refuse_non_finite and _refuse_reserved_model_names.


class DuplicateKeyError(yaml.MarkedYAMLError):
    """Two equal keys in one mapping: YAML (and JSON) keep the last one without a word."""

    def __init__(self, key: str, first: yaml.Mark, second: yaml.Mark):
        super().__init__(problem=f"duplicate key {key}", problem_mark=second)
        self.key, self.lines = key, (first.line + 1, second.line + 1)


class _UniqueKeyLoader(_SAFE):
    """safe_load that refuses a key given twice in one mapping (merge keys ``<<`` may still be
    overridden: that is what they are for)."""

    def construct_document(self, node):
        self._unique_keys(node, (), set())
        return super().construct_document(node)

    def _unique_keys(self, node, path: tuple[str, ...], seen: set[int]) -> None:
        if id(node) in seen:  # an alias: checked where its anchor is
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._unique_keys(item, path + (str(i),), seen)
        elif isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    self._unique_keys(value_node, path, seen)
                    continue
                key = self.construct_object(key_node)
                if key in first:
                    raise DuplicateKeyError("/".join(path + (str(key),)), first[key].start_mark, key_node.start_mark)
                first[key] = key_node
                self._unique_keys(value_node, path + (str(key),), seen)


def _duplicate_key(path: Path, exc: DuplicateKeyError) -> PipelineError:
    return PipelineError(path, f"{exc.problem} at lines {exc.lines[0]} and {exc.lines[1]} (YAML silently keeps "
                         "the last one)", "keep one of the two")


class _JsonPairs(list):
    """A JSON object as its (key, value) pairs, duplicates kept (json's object_pairs_hook)."""


def _json_duplicate(value, path: tuple[str, ...] = ()) -> str | None:
    """The path of the first key given twice in one object of JSON read with ``_JsonPairs``."""
    if isinstance(value, _JsonPairs):
        keys: set[str] = set()
        for key, item in value:
            if key in keys:
                return "/".join(path + (key,))
            keys.add(key)
            if (found := _json_duplicate(item, path + (key,))) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := _json_duplicate(item, path + (str(i),))) is not None:
                return found
    return None


def _read_config_file(path: Path) -> object:
    """A config file as Snakemake reads it (JSON or YAML), refusing duplicate keys: as YAML
    (errors with lines), else as JSON (a JSON file YAML cannot read, e.g. tab-indented)."""
    try:
        return read_yaml(path)
    except PipelineError as yaml_error:
        try:
            text = path.read_text(encoding="utf-8")
            duplicate = _json_duplicate(json.loads(text, object_pairs_hook=_JsonPairs))
        except (ValueError, OSError):
            raise yaml_error from None
        if duplicate is not None:
            raise PipelineError(path, f"duplicate key {duplicate} (JSON silently keeps the last one)",
                                "keep one of the two") from None
        return json.loads(text)


def check_config_files(paths) -> None:
    """Every config file of a run, read as Snakemake reads it: one line for a missing file, a
    YAML error (file and line), a duplicate key (both lines), an empty file or a top level that
    is not a mapping. The Snakefile runs this before Snakemake merges config.yaml."""
    for path in map(Path, paths):
        data = _read_config_file(path)
        if data is None:
            raise PipelineError(path, "is empty (no settings)", "write the settings as a YAML mapping (key: value), "
                                "or leave the file out")
        if not isinstance(data, dict):
            raise PipelineError(path, f"the top level is a {type(data).__name__}, not a mapping",
                                "write the settings as a YAML mapping (key: value), as config.yaml does")


def _non_finite_paths(value, path: tuple[str, ...] = ()):
    if isinstance(value, float) and not math.isfinite(value):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():  # in the order written: the first one in the file is named
            yield from _non_finite_paths(v, path + (str(k),))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _non_finite_paths(v, path + (str(i),))


def _finite_validator(schema_: dict) -> jsonschema.protocols.Validator:
    """The schema's validator with "number" meaning a finite number (NaN fails every bound check
    as a comparison, so jsonschema's minimum/maximum let it through)."""
    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine(
        "number", lambda c, x: base.TYPE_CHECKER.is_type(x, "number") and not (isinstance(x, float) and not math.isfinite(x)))
    return jsonschema.validators.extend(base, type_checker=checker)(schema_)


def _type_errors(errors, path: tuple[str, ...]):
    for e in errors:
        if e.validator == "type" and tuple(map(str, e.absolute_path)) == path:
            yield e
        yield from _type_errors(e.context or (), path)


def _show(x: float) -> str:
    return ".nan" if x != x else (".inf" if x > 0 else "-.inf")


def _refuse_non_finite(cfg: dict, where: str) -> None:
    """NaN and infinities where a number is configured: a threshold of .nan passes every
    comparison, so the check it sets is off without a word (and the gate JSON holds NaN, which
    strict JSON parsers refuse). The fix says how to switch a check off: null where the schema
    allows it, else the field's description."""
    paths = list(_non_finite_paths(cfg))
    if not paths:
        return
    errors = list(_finite_validator(schema()).iter_errors(cfg))
    for path in paths:
        value = cfg
        for part in path:
            value = value[int(part)] if isinstance(value, list) else value[part]
        declared = [e for e in _type_errors(errors, path)]
        types = [t for e in declared for t in ([e.validator_value] if isinstance(e.validator_value, str)
                                                else e.validator_value)]
        if declared and "number" not in types:
            continue  # an integer or a string there: the schema's own message says so
        desc = next((e.schema.get("description") for e in declared if e.schema.get("description")), None)
        fix = ("write a finite number, or null to switch this check off" if "null" in types
               else desc or "write a finite number")
        raise PipelineError(where, f"{'/'.join(path)} is {_show(value)}, not a finite number (NaN and infinities "
                            "pass every range check, so a check set to one is silently off)", fix)


# A fixed name beside the model directories that Layout does not return: rules/source.smk's
# toolchain log (results/logs/toolchain.log, beside results/logs/<model>/).
_OTHER_PATHS = {("logs", "toolchain.log"): "the toolchain job's log"}
_LAYOUT_WHAT = {"toolchain": "the toolchain record", "log": "every model's job logs"}


def _layout_paths() -> list[tuple[tuple[str, ...], str]]:
    """Every path of paths.Layout below results/ (wildcards as ``{name}``, the model as
    ``\0model``), each with what it holds; then _OTHER_PATHS."""
    import inspect

    from recurrent_coreai.pipeline.paths import Layout

    lay = Layout("results", "\0model")
    out = []
    for attr, member in vars(Layout).items():
        if isinstance(member, property):
            path = getattr(lay, attr)
        elif inspect.isfunction(member) and not attr.startswith("_"):
            path = member(lay, *(f"{{{p}}}" for p in list(inspect.signature(member).parameters)[1:]))
        else:
            continue
        out.append((Path(path).relative_to("results").parts, _LAYOUT_WHAT.get(attr, f"Layout.{attr}")))
    return out + list(_OTHER_PATHS.items())


def reserved_model_names() -> dict[str, tuple[str, str]]:
    """Names the results layout already uses where a model's name goes: each fixed name beside
    a ``<model>`` path component, under the same parent (results/toolchain.json and results/logs/
    beside results/<model>/; results/logs/toolchain.log beside results/logs/<model>/).
    Name -> (the parent, e.g. "results/logs/"; "results/<name>[/] is|holds <what>")."""
    paths = _layout_paths()
    out: dict[str, tuple[str, str]] = {}
    for parts, _ in paths:
        if "\0model" not in parts:
            continue
        depth = parts.index("\0model")
        parent = "/".join(("results",) + parts[:depth]) + "/"
        for other, what in paths:
            if len(other) > depth and other[:depth] == parts[:depth] and other[depth] != "\0model":
                name, is_dir = other[depth], len(other) > depth + 1
                out.setdefault(name, (parent, f"{parent}{name}{'/ holds' if is_dir else ' is'} {what}"))
    return out


def _refuse_reserved_model_names(cfg: dict, where: str) -> None:
    """A model named like a fixed name of the results layout shares its directory with it
    (model `logs`: results/logs/ holds every model's job logs; `toolchain.json`: Snakemake's
    ChildIOException). Compared ignoring case, as macOS's file system does; two models that
    differ only in case share a directory there too."""
    reserved = reserved_model_names()
    folded = {name.casefold(): name for name in reserved}
    names = list(cfg["models"])
    for name in names:
        if name.casefold() not in folded:
            continue
        parent, clash = reserved[folded[name.casefold()]]
        kind = "outputs" if parent == "results/" else "job logs"
        uses = [n for n in sorted(reserved) if reserved[n][0] == "results/"]
        deeper = [f"{n} for the logs" for n in sorted(reserved) if reserved[n][0] == "results/logs/"]
        raise PipelineError(where, f"models/{name}: the name is taken: {clash}, and this model's {kind} would go "
                            f"to {parent}{name}/", f"rename the model (names the results layout uses: "
                            f"{', '.join(uses)}{', and ' + ', '.join(deeper) if deeper else ''}; compared ignoring case)")
    seen: dict[str, str] = {}
    for name in sorted(names):
        other = seen.setdefault(name.casefold(), name)
        if other != name:
            raise PipelineError(where, f"models/{other} and models/{name} differ only in case: on a case-insensitive "
                                f"file system (macOS) they share results/{name.casefold()}/", "rename one of them")
