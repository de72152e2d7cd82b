rule export:
    input:
        source=str(OUT.source),
        toolchain=str(OUT.toolchain),
    output:
        directory(str(OUT.export("{recipe}"))),
    params:
        settings=settings("export"),
        code=code("export"),
    log:
        str(OUT.log("export-{recipe}")),
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("export", config, "source"),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/export.py --config-file {resources.config_file} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --source {input.source} --out {output} --log {log}"
