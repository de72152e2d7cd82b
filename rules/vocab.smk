rule vocab:
    input:
        source=str(OUT.source),
    output:
        directory(str(OUT.vocab)),
    params:
        settings=settings("vocab"),
        code=code("vocab"),
    log:
        str(OUT.log("vocab")),
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("vocab", config),
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/vocab.py --config-file {resources.config_file} --model {wildcards.model} "
        "--source {input.source} --out {output} --log {log}"
