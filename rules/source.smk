rule toolchain:
    # Versions and code that shape a bundle. A new Core AI beta (or a code change) changes
    # `params`, Snakemake reruns this rule, and every export and what follows is rebuilt.
    input:
        "requirements.txt",
    output:
        str(OUT.toolchain),
    params:
        record=json.dumps(toolchain.record(), sort_keys=True),
    log:
        f"{RES}/logs/toolchain.log",
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/toolchain.py --config-file {CONFIG_FILE} --out {output} --log {log}"


rule source:
    output:
        directory(str(OUT.source)),
    params:
        settings=settings("source"),
    log:
        str(OUT.log("source")),
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/source.py --config-file {CONFIG_FILE} --model {wildcards.model} "
        "--out {output} --log {log}"
