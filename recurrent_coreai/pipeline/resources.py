"""Cluster resources per job (``mem_mb``, ``runtime`` in minutes, ``cpus_per_task``) from the
size of the model, for Snakemake's ``resources:`` and so for ``sbatch`` under the SLURM profile.

Sizes come from the geometry the stage before recorded (``manifest.json`` of the source,
``export.json`` of a bundle) -- the real checkpoint, not a guess from config.yaml -- so a job's
numbers are known once its input exists; until then Snakemake shows ``<TBD>`` and evaluates
them when the job is ready to run (a missing record raises FileNotFoundError for that input).

Memory is ``MEMORY[rule]``: base MB + a multiple of the weight bytes, times ``HEADROOM``:
* export: weights are streamed per tensor into the recipe's dtype, so the peak follows the
  bundle: 1.5B-shaped, fp16 3.8 GB for a 3.06 GB bundle, int8keepproj 3.0 GB for 2.17 GB
  (bench/bench_scale.py); rwkv7-tiny: 630 MB (fp32 weights 69 MB).
* source: streamed too (1.5B-shaped: 772 MB peak for the 6.1 GB checkpoint), so it is FLAT.
* aot / gate_shard: rwkv7-tiny 360-440 MB; they hold the bundle (about 2x / 1.5x its bytes).
* runtimes scale with parameters (and gate steps) from rwkv7-tiny on this 2-core machine, with
  a generous ``TIME_HEADROOM``; the gate's float16 rate (one process) is checked at 1.5B: the
  1.5B-shaped fp16 gate took 1089 s CPU for 127 steps and the prefill check (about 5 s per
  billion parameters per step; in 2 processes 13 min wall).
* ``FLAT`` rules do not grow with the model; ``doctor`` (coreai doctor's static lint over the
  checkpoint directory and the bundle) is measured on rwkv7-tiny only.
"""

from __future__ import annotations

import errno
import math
from pathlib import Path
from typing import Callable

from recurrent_coreai import families
from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.pipeline import shards
from recurrent_coreai.pipeline.records import EXPORT, MANIFEST, load_json
from recurrent_coreai.util.errors import exit_on_error

NAMES = ("mem_mb", "runtime", "cpus_per_task")
DTYPE_BYTES = {"float32": 4, "float16": 2}
DTYPE_OF = {"quantized": "float16"}  # the dtype of a rate key that is not one (quantised weights: fp16 activations)
HEADROOM = 1.25  # on memory
TIME_HEADROOM = 3.0  # on run time
RETRY_GROWTH = 0.5  # a retried job (snakemake --retries N) asks for 1.5x, 2x, ... the memory
MIN_RUNTIME = 10  # minutes
# rule -> (base MB, bytes per weight byte, which weights: "fp32" source or the recipe's "bundle")
MEMORY = {
    "reference": (600, 1.5, "fp32"),
    "export": (600, 1.2, "bundle"),
    "aot": (500, 2.0, "bundle"),
    "gate_shard": (500, 1.5, "bundle"),
}
# a quantised bundle's gate shard folds its dequantisation first (stages/gate_lowering.py): the
# program with every weight at fp16, then both lowerings loaded for the bit-for-bit check. Measured
# at 1.5B int8keepproj: peak RSS 8847 MB, 2.9x the fp16 weight bytes (3.06 GB)
FOLDED_GATE_PER_BYTE = 3.0
# rule -> seconds per billion parameters (per gate step for `gate`, per reference step for
# `reference`), by the dtype the stage computes in; measured on rwkv7-tiny (17.2 M parameters)
SECONDS_PER_GPARAM = {
    "reference": {"float32": 1.7},
    "export": {"float32": 1500.0, "float16": 1500.0},
    "aot": {"float32": 120.0, "float16": 120.0},
    # per decode call; "quantized": a recipe with int8/int4 weights, which the Linux runtime dequantises
    # on every call (int8keepproj: tiny 20.7, 1.5B ~25); fp16: tiny 6.1, 1.5B 1089 s CPU for 127 steps
    # and the prefill check (~5.2)
    "gate_shard": {"float32": 7.0, "float16": 6.1, "quantized": 25.0},
}
STARTUP_S = 30  # imports (torch, coreai) and reading the inputs
# rule -> (mem_mb, runtime) for the jobs that do not grow with the model (doctor: a static lint;
# gate: the gather, which reads the shard records and hashes the bundle once)
FLAT = {"toolchain": (500, 5), "gate": (1000, 10), "vocab": (1000, 10), "card": (1000, 10), "doctor": (1000, 15), "report": (1000, 10),
        "stage_and_push": (2000, 30), "source": (2000, 60)}
SIZED = tuple(MEMORY)


def parameters_recorded(family: str, record_dir: str | Path) -> int:
    """The parameter count (the family's) of the geometry a stage recorded in ``record_dir``
    (``manifest.json`` or ``export.json``). Missing -> FileNotFoundError naming ``record_dir``
    (Snakemake's cue for ``<TBD>``)."""
    record_dir = Path(record_dir)
    fam = families.get(family)
    for name in (MANIFEST, EXPORT):
        if (record_dir / name).is_file():
            return fam.parameter_count(fam.geometry_from_dict(load_json(record_dir / name)["geometry"]))
    raise FileNotFoundError(errno.ENOENT, "no manifest.json or export.json yet", str(record_dir))


def cpus_for(params: int) -> int:
    """Threads worth asking for: 1 below 0.5 B parameters, then 2, 4, 8."""
    return next(c for limit, c in ((0.5e9, 1), (1e9, 2), (2e9, 4), (math.inf, 8)) if params < limit)


def rate_key(recipe: dict) -> str:
    """Which rate of SECONDS_PER_GPARAM a recipe runs at: ``quantized`` for quantised weights
    (where a rule has that rate), else its dtype."""
    return "quantized" if recipe.get("quantize") else recipe.get("dtype", "float32")


def estimate(rule: str, params: int | None = None, dtype: str = "float32", steps: int = 1, attempt: int = 1) -> dict:
    """``{mem_mb, runtime, cpus_per_task}`` of one job of ``rule``. ``params`` (the parameter
    count) is required for the
    rules whose needs grow with the model (``SIZED``); ``dtype`` is the recipe's rate_key, ``steps`` the
    gate's (reference and gate run one model step per token)."""
    grow = 1 + RETRY_GROWTH * (max(attempt, 1) - 1)
    if rule not in SIZED and rule not in FLAT:
        raise ValueError(f"recurrent_coreai/pipeline/resources.py has no size for rule {rule!r}: add it to FLAT or MEMORY")
    if rule not in SIZED:
        mem, minutes = FLAT[rule]
        return {"mem_mb": int(mem * grow), "runtime": minutes, "cpus_per_task": 1}
    base, per_byte, weights = MEMORY[rule]
    if rule == "gate_shard" and dtype == "quantized":
        per_byte = FOLDED_GATE_PER_BYTE
    weight_bytes = params * (4 if weights == "fp32" else DTYPE_BYTES[DTYPE_OF.get(dtype, dtype)])
    mem = (base + per_byte * weight_bytes / 1e6) * HEADROOM * grow
    rates = SECONDS_PER_GPARAM[rule]
    work = steps if rule in ("gate_shard", "reference") else 1
    rate = rates.get(dtype, rates.get(DTYPE_OF.get(dtype, dtype), rates["float32"]))
    seconds = STARTUP_S + rate * params / 1e9 * work
    return {"mem_mb": int(math.ceil(mem / 100) * 100),
            "runtime": max(MIN_RUNTIME, int(math.ceil(seconds * TIME_HEADROOM / 60))),
            "cpus_per_task": cpus_for(params)}


def reference_text_steps(config: dict, text: dict, params: int | None) -> float:
    """The reference stage's text stream in model steps: one per token, or, for a model of at
    least ``reference.chunked.from_params`` parameters (stages/text_chunked.py), its chunked form's
    calls (the plan's prefill calls at :func:`shards.prefill_call_cost`, its main calls at 1) plus
    the check's steps over the first horizon. An hf checkpoint's size is not known when Snakemake
    plans (``params`` None): token by token, the longer."""
    chunked = config.get("reference", {}).get("chunked")
    if chunked is None or params is None or params < chunked["from_params"]:
        return text["tokens"]
    chunk = config["prefill"]["chunk"]
    return shards.text_check_cost((text["tokens"], text["horizons"]), chunk) + text["horizons"][0]


def job_needs(rule: str, config: dict, wildcards: dict, params: int | None, attempt: int = 1,
              threads: int = 1) -> dict:
    """``{mem_mb, runtime, cpus_per_task}`` of one job of ``rule`` with these ``wildcards``, for a
    model of ``params`` parameters (its stage's record; None for the rules that do not grow). A
    gate shard's steps are its plan's longest shard (decode calls, warm-up included; shards.py),
    and it asks for ``threads`` CPUs and memory for that many processes, each holding the bundle."""
    recipe = config["recipes"].get(wildcards.get("recipe"), {})
    steps = config["gate"]["steps"]
    if rule == "reference":  # one model step per token of every stream: the prompts, prefill and text
        text = cfgmod.text_settings(config["gate"], config["prefill"]["chunk"])
        steps += cfgmod.prefill_length(config["prefill"]) + (reference_text_steps(config, text, params) if text else 0)
    if rule == "gate_shard":
        lengths, tokens, chunk, text = gate_plan_shape(config, wildcards["model"], wildcards["recipe"])
        steps = math.ceil(shards.critical_cost(lengths, tokens, chunk, gate_shards(config, wildcards["model"],
                                                                                  wildcards["recipe"]), text))
    need = estimate(rule, params, dtype=rate_key(recipe), steps=steps, attempt=attempt)
    if rule == "gate_shard":
        need.update(mem_mb=need["mem_mb"] * threads, cpus_per_task=threads)
    return need


def for_rule(rule: str, config: dict, record: str | None = None) -> dict[str, Callable]:
    """``resources:`` of a rule as Snakemake callables (:func:`job_needs`): ``resources:
    **for_rule("export", config, "source")`` sizes each export from the geometry recorded in its
    ``input.source``."""

    def one(name: str) -> Callable:
        def value(wildcards, input, attempt, threads):  # noqa: A002 - Snakemake passes these by name
            # a record Snakemake sizes a job from that is refused (its seal, its MAC under
            # RECURRENT_COREAI_RECORD_KEY) is the house's one line and exit 1, not Snakemake's
            # InputFunctionException traceback
            n = exit_on_error(lambda: parameters_recorded(config["models"][wildcards.model]["family"],
                                                          input[record])) if record else None
            return job_needs(rule, config, dict(wildcards.items()), n, attempt, threads)[name]
        return value

    return {name: one(name) for name in NAMES}


MAX_GATE_THREADS = 4  # the gate's units: the prefill check and one per prompt (4 by default)


def _wildcard(wildcards, name: str) -> str:
    """A wildcard's value from Snakemake's wildcards (attributes) or a plain dict (tools, tests)."""
    return wildcards[name] if isinstance(wildcards, dict) else getattr(wildcards, name)


def shard_threads(config: dict) -> Callable:
    """``threads:`` of a gate shard: the gate's (:func:`gate_threads`) when the gate is one
    shard (its pieces then run in that many processes); 1 when it has several, which the
    scheduler places side by side instead."""
    whole = gate_threads(config)

    def value(wildcards):
        one = gate_shards(config, _wildcard(wildcards, "model"), _wildcard(wildcards, "recipe")) == 1
        return whole(wildcards) if one else 1

    return value


def gate_threads(config: dict) -> Callable:
    """``threads:`` of the gate: its ``cpus_per_task`` from the model's configured shape (a
    synthetic source), else :data:`MAX_GATE_THREADS` (an hf checkpoint's shape is known only
    once it is downloaded, and Snakemake needs threads before that). Snakemake caps it at
    ``--cores``; the stage runs as many processes as it is granted (gate.workers_granted)."""

    def value(wildcards):
        params = configured_parameters(config["models"][_wildcard(wildcards, "model")])
        return MAX_GATE_THREADS if params is None else cpus_for(params)

    return value


SHARD_SECONDS = 600  # gate/shard_seconds where a config leaves it out (config.yaml states it)


WEIGHT_SUFFIXES = (".safetensors", ".pth", ".bin", ".pt")


def path_parameters(source: dict) -> int | None:
    """An upper bound of a ``kind: path`` checkpoint's parameter count from its weight files' sizes
    (2 bytes a parameter: fp16/bf16; an fp32 file is counted twice its size, which plans more
    shards, never fewer); None for other sources or a path that is not there yet."""
    if source.get("kind") != "path":
        return None
    path = Path(source["path"])
    files = [path] if path.is_file() else sorted(path.glob("*")) if path.is_dir() else []
    total = sum(f.stat().st_size for f in files if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    return total // 2 if total else None


def configured_parameters(model: dict) -> int | None:
    """The parameter count of a model's configured shape (a synthetic source), an upper bound of a
    local checkpoint's (:func:`path_parameters`), else None: an hf checkpoint's shape is known only
    once it is downloaded, after Snakemake built its DAG."""
    source = model["source"]
    shape = source.get("shape")
    if not shape:
        return path_parameters(source)
    fam = families.get(model["family"])
    return fam.parameter_count(fam.geometry_from_shape(shape, "config.yaml"))


def gate_call_seconds(params: int | None, key: str) -> float | None:
    """One decode call of a bundle in the Linux runtime (SECONDS_PER_GPARAM; ``key``: rate_key of
    its recipe), None if unknown."""
    return None if params is None else SECONDS_PER_GPARAM["gate_shard"][key] * params / 1e9


def gate_plan_shape(cfg: dict, model: str, recipe: str) -> tuple[list[int], int, int, tuple | None]:
    """(steps per prompt, prefill check tokens, prefill chunk, (text tokens, horizons) or None) of
    a gate as configured: the
    steps shared equally by the prompts (what config.prompt_budgets gives when every prompt fits
    its share, as the default prompts do; a reference that records longer prompts gets its own
    plan from the same shard count, stages/gate.py)."""
    g = cfgmod.gate_settings(cfgmod.settings(cfg, "gate", model=model, recipe=recipe), recipe)
    lengths = cfgmod.prompt_budgets([0] * len(g["prompts"]), g["steps"])
    text = cfgmod.text_settings(cfg["gate"], cfg["prefill"]["chunk"])
    return (lengths, cfgmod.prefill_length(cfg["prefill"]), cfg["prefill"]["chunk"],
            None if text is None else (text["tokens"], text["horizons"]))


def gate_shards(cfg: dict, model: str, recipe: str) -> int:
    """How many ``gate_shard`` jobs gate ``model``'s ``recipe`` (shards.shard_count): about
    ``gate/shard_seconds`` of runtime each by the per-call cost above; as many as shorten the
    gate where the parameter count is not known yet (an hf source). 1 for the tiny defaults."""
    m = cfg["models"][model]
    seconds = gate_call_seconds(configured_parameters(m), rate_key(cfg["recipes"][recipe]))
    lengths, tokens, chunk, text = gate_plan_shape(cfg, model, recipe)
    return shards.shard_count(lengths, tokens, chunk, seconds, cfg["gate"].get("shard_seconds", SHARD_SECONDS), text)
