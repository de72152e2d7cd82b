# Shared: the effective config every stage reads, the results layout, wildcard constraints.
import json
import os
import re
import time
from pathlib import Path

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai import families
from recurrent_coreai.pipeline import fingerprint, warm
from recurrent_coreai.coreai import toolchain
from recurrent_coreai.pipeline import resources as sizing  # cluster resources from the model's size
from recurrent_coreai.util import env, fsutil
from recurrent_coreai.util.errors import PipelineError, exit_on_error
from recurrent_coreai.pipeline.paths import STATE_DIR, Layout, card_inputs, publish_inputs
from recurrent_coreai.stages.card import curated_card as curated_path

RUN_START = time.time()  # outputs newer than this were built by this run (see scripts/dvc_record.py)
# RECURRENT_COREAI_RECORD_KEY set but empty (an unset CI secret) is one line before anything runs
exit_on_error(env.record_key)
# Snakemake merged config.yaml, every --configfile and --config into `config`; the stages read
# exactly that (CONFIG_FILE is config.yaml itself when nothing was merged over it).
ORIGINS = [f for f in ["config.yaml"] if os.path.exists(f)] + list(map(str, workflow.overwrite_configfiles))
ORIGINS += ["--config"] if workflow.config_settings.config else []
CONFIG_FILE = exit_on_error(
    lambda: cfgmod.write_effective(cfgmod.validate(config, " + ".join(ORIGINS)), ORIGINS, STATE_DIR)
)
# content digest of the code each stage runs (its module and imports, its model's family folder and
# tokenizer kind): a change reruns that stage, for the models of that family (or kind) only
CODE = {}
RES = config["results"]
exit_on_error(lambda: fsutil.check_writable(RES))  # a read-only results/ is one line, before any job
OUT = Layout(RES, "{model}")  # output path patterns, wildcards left in
MODELS = cfgmod.models_to_build(config)


wildcard_constraints:
    model="|".join(map(re.escape, config["models"])),
    recipe="|".join(map(re.escape, config["recipes"])),
    target="|".join(map(re.escape, config["targets"])),
    shard="[0-9]+",


def family_of(model):
    """The model's family (recurrent_coreai.families registry)."""
    return families.get(config["models"][model]["family"])


def code(rule):
    """params: the digest of the code the rule's stage runs for this job's model (fingerprint.py)."""

    def digest(w):
        model = config["models"][w.model] if "model" in w.keys() else None
        family = model["family"] if model else None
        kind = families.tokenizer_of(model) if model else None  # models.<m>.tokenizer, else the family's
        key = (rule, family, kind)
        if key not in CODE:
            CODE[key] = fingerprint.digest(rule, family, kind)
        return CODE[key]

    return digest


# Every stage's command reads ``--config-file {resources.config_file}``: CONFIG_FILE, config.yaml
# itself or the merged file of a --config/--configfile run. A resource, not a param: which file
# holds the settings is no rerun trigger (Snakemake compares params, not resources) -- the settings
# a stage reads are, by value (``settings`` below). As a param, a model moved from a --configfile
# fragment into config.yaml with the same settings reran all its jobs (issue 34, case 10).
# (A global named in the shell directive did the same, but `snakemake --lint` refuses it.)


def settings(stage):
    """params: the config values the stage reads, by value (a change reruns exactly that stage)."""
    return lambda w: json.dumps(cfgmod.settings(config, stage, **dict(w.items())), sort_keys=True)


def stage_inputs(inputs_of, w):
    """Named inputs of a stage that reads every recipe (and target) of its model."""
    lay, model = Layout(RES, w.model), config["models"][w.model]
    named = inputs_of(lay, model["recipes"], model["targets"])
    return {k: list(map(str, v)) if isinstance(v, list) else str(v) for k, v in named.items()}


def gate_shard_count(w):
    """How many gate_shard jobs gate this recipe (pipeline/resources.py gate_shards: about
    gate/shard_seconds of runtime work each; 1 for the tiny defaults)."""
    return sizing.gate_shards(config, w.model, w.recipe)


def path_source(w):
    """A ``kind: path`` source's file or directory, relative to the repo (the trained fixtures):
    an input, so a changed checkpoint reruns the source stage and DVC records its digest. An
    absolute path (a user's checkpoint elsewhere) is left to the source stage's own record."""
    spec = config["models"][w.model]["source"]
    if spec["kind"] == "path" and not Path(spec["path"]).is_absolute() and Path(spec["path"]).exists():
        return [spec["path"]]
    return []


def gate_text(w):
    """The gate's held-out text (gate/text/file, relative to the repo): an input of the reference
    stage, so an edited text reruns it and DVC records its digest. A missing file is the reference
    stage's one-line error."""
    text = config["gate"].get("text")
    if text and Path(text["file"]).is_file():
        return [text["file"]]
    return []


def curated_card(w):
    """A maintainer-curated card to merge into, when there is one (an input, so edits rerun the card)."""
    path = curated_path(w.model)
    return [str(path)] if path else []


onsuccess:
    if said := warm.close_run():  # the warm process stopped: what it ran
        print(said)
    # Record in DVC what this run built (and only that), so `dvc status` is clean and `dvc push` has it.
    shell(f"python scripts/dvc_record.py --config-file {CONFIG_FILE} --since {RUN_START!r}")


onerror:
    if said := warm.close_run():
        print(said)
    # Jobs that finished before the failure are recorded too; a failed job leaves no output.
    shell(f"python scripts/dvc_record.py --config-file {CONFIG_FILE} --since {RUN_START!r} || true")


onstart:
    # The jobs of the stages that import torch run one after another in one warm process (started
    # by the first of them): local execution in this environment only (pipeline/warm.py).
    if getattr(workflow.executor_plugin, "name", None) == "local" and not workflow.deployment_settings.deployment_method:
        warm.open_run(os.getpid())
    # Under the SLURM executor (profiles/slurm): the cluster must answer before any job is
    # submitted or any output of a --forcerun job is deleted (they are deleted when a job starts).
    if getattr(workflow.executor_plugin, "name", None) == "slurm":
        import importlib.util

        spec = importlib.util.spec_from_file_location("check_cluster", "profiles/slurm/check_cluster.py")
        check_cluster = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(check_cluster)
        defaults = workflow.resource_settings.default_resources
        partition = defaults["slurm_partition"].raw if defaults and "slurm_partition" in defaults else None
        status = getattr(workflow.executor_settings, "status_command", None) or "sacct"
        exit_on_error(lambda: check_cluster.check(str(partition).strip("'\"") if partition else None, status))
