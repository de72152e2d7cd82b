rule stage_and_push:
    # The exact Hub tree + receipt, every file checked against the digests its gate recorded;
    # uploads in one commit when publish.push is on and HF_TOKEN is set.
    input:
        unpack(lambda w: stage_inputs(publish_inputs, w)),
    output:
        directory(str(OUT.publish)),
    params:
        settings=settings("stage_and_push"),
        code=code("stage_and_push"),
    log:
        str(OUT.log("publish")),
    resources:
        config_file=CONFIG_FILE,
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/publish.py --config-file {resources.config_file} --model {wildcards.model} "
        "--source {input.source} --card {input.card} --vocab {input.vocab} "
        "--toolchain {input.toolchain} --exports {input.exports} --gates {input.gates} "
        "--aots {input.aots} --tsvs {input.tsvs} --reference {input.reference} --doctors {input.doctors} "
        "--out {output} --log {log}"
