# Shared helpers: the config file the stages read, wildcard constraints, target lists.
import json
import os
import re

from rwkv7_coreai import config as cfgmod
from rwkv7_coreai import toolchain

if set(workflow.config_settings.config) - {"build"}:
    raise ValueError(
        "config.yaml: --config may only set `build` (the stages read their settings from the "
        "config file) -- fix: edit the file or pass another with --configfile"
    )
if len(workflow.overwrite_configfiles) > 1:
    raise ValueError("--configfile: give one config file -- fix: merge them into one file")
CONFIG_FILE = (workflow.overwrite_configfiles or ["config.yaml"])[-1]
cfgmod.validate(config, CONFIG_FILE)

RES = config["results"]
MODELS = cfgmod.models_to_build(config)


wildcard_constraints:
    model="|".join(map(re.escape, config["models"])),
    recipe="|".join(map(re.escape, config["recipes"])),
    target="|".join(map(re.escape, config["targets"])),


def settings(stage):
    """params: the config values a stage depends on (a change reruns it)."""
    return lambda w: json.dumps(
        cfgmod.stage_params(config, stage, w.model, w.get("recipe"), w.get("target")), sort_keys=True
    )


def bundle_dir(w):
    return config["models"][w.model]["dir"]


def recipes_of(model):
    return config["models"][model]["recipes"]


def targets_of(model):
    return config["models"][model]["targets"]


def publish_targets():
    return expand(f"{RES}/{{model}}/publish", model=MODELS)


onsuccess:
    # Record what Snakemake built in DVC, so `dvc status` is clean and `dvc push` has it.
    if os.path.isdir(".dvc"):
        shell("python scripts/dvc_record.py")
