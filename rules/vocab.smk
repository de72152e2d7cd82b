rule vocab:
    input:
        source=str(OUT.source),
    output:
        directory(str(OUT.vocab)),
    params:
        config_file=config_file("vocab"),
        settings=settings("vocab"),
        code=code("vocab"),
    log:
        str(OUT.log("vocab")),
    resources:
        **sizing.for_rule("vocab", config),
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/vocab.py --config-file {params.config_file} --model {wildcards.model} "
        "--source {input.source} --out {output} --log {log}"
