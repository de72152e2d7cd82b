# rwkv7-coreai: RWKV-7 checkpoint -> verified Core AI bundles.
#   snakemake --cores 1 publish        (the default target)
# Stages, one file each under rules/: source -> vocab -> reference -> export -> aot -> gate
# -> card -> publish. dvc.yaml is generated from this DAG (scripts/gen_dvc.py).
from snakemake.utils import min_version, validate

min_version("9.27")


configfile: "config.yaml"


validate(config, schema="rwkv7_coreai/schemas/config.schema.yaml")


include: "rules/common.smk"
include: "rules/source.smk"
include: "rules/vocab.smk"
include: "rules/reference.smk"
include: "rules/export.smk"
include: "rules/aot.smk"
include: "rules/gate.smk"
include: "rules/card.smk"
include: "rules/publish.smk"


rule publish:
    default_target: True
    input:
        publish_targets(),
