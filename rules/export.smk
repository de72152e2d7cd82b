rule export:
    input:
        source=f"{RES}/{{model}}/source",
        toolchain=f"{RES}/toolchain.json",
    output:
        directory(f"{RES}/{{model}}/export/{{recipe}}"),
    params:
        settings=settings("export"),
    log:
        f"{RES}/logs/{{model}}/export-{{recipe}}.log",
    resources:
        mem_mb=16000,
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/export.py --config-file {CONFIG_FILE} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --source {input.source} --out {output} --log {log}"
