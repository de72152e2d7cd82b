# rwkv7-coreai: RWKV-7 checkpoint -> verified Core AI bundles.
#   snakemake --cores 1 publish        (the default target)
# Stages, one file each under rules/: source -> vocab -> reference -> export -> aot -> gate
# -> card -> publish. dvc.yaml is generated from this DAG (scripts/gen_dvc.py).
import os

from snakemake.utils import min_version, validate

from recurrent_coreai.pipeline.config import check_config_files
from recurrent_coreai.util.errors import exit_on_error

min_version("9.27")

# Every file this run merges, before `configfile:` reads config.yaml (Snakemake read the
# --configfile ones already, keeping the last of duplicate keys): a YAML error names the file and
# line, a duplicate key both lines; an empty file or one that is not a mapping is one line too.
# (A --configfile that is missing, empty or not YAML never gets here: Snakemake's command line
# parser refuses it first, with its own message.)
exit_on_error(
    lambda: check_config_files(
        (["config.yaml"] if os.path.exists("config.yaml") else []) + list(map(str, workflow.overwrite_configfiles))
    )
)


configfile: "config.yaml"


include: "rules/common.smk"  # validates the merged config: one line per problem


validate(config, schema="recurrent_coreai/pipeline/schemas/config.schema.yaml")


# download (network, Hugging Face cache) and publish (HF_TOKEN) run where snakemake runs, never
# as cluster jobs (profiles/slurm)
localrules:
    source,
    stage_and_push,
    publish,


include: "rules/source.smk"
include: "rules/vocab.smk"
include: "rules/reference.smk"
include: "rules/export.smk"
include: "rules/aot.smk"
include: "rules/gate.smk"
include: "rules/doctor.smk"
include: "rules/report.smk"
include: "rules/card.smk"
include: "rules/publish.smk"


rule publish:
    default_target: True
    input:
        expand(str(OUT.publish), model=MODELS),
        expand(str(report_path(OUT)), model=MODELS),
