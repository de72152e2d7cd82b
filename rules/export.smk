rule export:
    input:
        source=f"{RES}/{{model}}/source",
        toolchain=f"{RES}/toolchain.json",
    output:
        directory(f"{RES}/{{model}}/export/{{recipe}}"),
    params:
        config=CONFIG_FILE,
        settings=settings("export"),
    log:
        f"{RES}/logs/{{model}}/export-{{recipe}}.log",
    resources:
        mem_mb=16000,
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/export.py --config-file {params.config} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --source {input.source} --out {output} --log {log}"
