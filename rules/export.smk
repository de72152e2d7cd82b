rule export:
    input:
        source=str(OUT.source),
        toolchain=str(OUT.toolchain),
    output:
        directory(str(OUT.export("{recipe}"))),
    params:
        config_file=config_file("export"),
        settings=settings("export"),
        code=code("export"),
    log:
        str(OUT.log("export-{recipe}")),
    resources:
        **sizing.for_rule("export", config, "source"),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/export.py --config-file {params.config_file} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --source {input.source} --out {output} --log {log}"
