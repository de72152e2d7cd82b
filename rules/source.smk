rule toolchain:
    # Versions of the toolchain that shapes a bundle. A new Core AI beta changes `params` (and
    # the pins in requirements.txt), Snakemake reruns this rule, and every export and what
    # follows is rebuilt. Code changes rerun only the stages whose code changed (CODE).
    input:
        "requirements.txt",
    output:
        str(OUT.toolchain),
    params:
        record=json.dumps(toolchain.record(), sort_keys=True),
        code=code("toolchain"),
    log:
        f"{RES}/logs/toolchain.log",
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("toolchain", config),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/toolchain.py --config-file {resources.config_file} --out {output} --log {log}"


rule source:
    input:
        path_source,
    output:
        directory(str(OUT.source)),
    params:
        settings=settings("source"),
        code=code("source"),
    log:
        str(OUT.log("source")),
    resources:
        config_file=CONFIG_FILE,
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/source.py --config-file {resources.config_file} --model {wildcards.model} "
        "--out {output} --log {log}"
