rule toolchain:
    # Versions that shape a bundle. A new Core AI beta changes `params`, Snakemake reruns this
    # rule, and everything built with the old toolchain is rebuilt.
    output:
        f"{RES}/toolchain.json",
    params:
        versions=json.dumps(toolchain.versions(), sort_keys=True),
    log:
        f"{RES}/logs/toolchain.log",
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/toolchain.py --config-file {CONFIG_FILE} --out {output} --log {log}"


rule source:
    output:
        directory(f"{RES}/{{model}}/source"),
    params:
        settings=settings("source"),
    log:
        f"{RES}/logs/{{model}}/source.log",
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/source.py --config-file {CONFIG_FILE} --model {wildcards.model} "
        "--out {output} --log {log}"
