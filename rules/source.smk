rule toolchain:
    # Versions and code that shape a bundle. A new Core AI beta (or a code change) changes
    # `params`, Snakemake reruns this rule, and every export and what follows is rebuilt.
    output:
        f"{RES}/toolchain.json",
    input:
        "requirements.txt",
    params:
        config=CONFIG_FILE,
        record=json.dumps(toolchain.record(), sort_keys=True),
    log:
        f"{RES}/logs/toolchain.log",
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/toolchain.py --config-file {params.config} --out {output} --log {log}"


rule source:
    output:
        directory(f"{RES}/{{model}}/source"),
    params:
        config=CONFIG_FILE,
        settings=settings("source"),
    log:
        f"{RES}/logs/{{model}}/source.log",
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/source.py --config-file {params.config} --model {wildcards.model} "
        "--out {output} --log {log}"
