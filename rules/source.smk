rule toolchain:
    # Versions of the toolchain that shapes a bundle. A new Core AI beta changes `params` (and
    # the pins in requirements.txt), Snakemake reruns this rule, and every export and what
    # follows is rebuilt. Code changes rerun only the stages whose code changed (CODE).
    input:
        "requirements.txt",
    output:
        str(OUT.toolchain),
    params:
        config_file=config_file("toolchain"),
        record=json.dumps(toolchain.record(), sort_keys=True),
        code=code("toolchain"),
    log:
        f"{RES}/logs/toolchain.log",
    resources:
        **sizing.for_rule("toolchain", config),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/toolchain.py --config-file {params.config_file} --out {output} --log {log}"


rule source:
    input:
        path_source,
    output:
        directory(str(OUT.source)),
    params:
        config_file=config_file("source"),
        settings=settings("source"),
        code=code("source"),
    log:
        str(OUT.log("source")),
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/source.py --config-file {params.config_file} --model {wildcards.model} "
        "--out {output} --log {log}"
