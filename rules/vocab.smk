rule vocab:
    input:
        source=f"{RES}/{{model}}/source",
    output:
        f"{RES}/{{model}}/vocab/rwkv_vocab.tsv",
    params:
        config=CONFIG_FILE,
        settings=settings("vocab"),
    log:
        f"{RES}/logs/{{model}}/vocab.log",
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/vocab.py --config-file {params.config} --model {wildcards.model} "
        "--source {input.source} --out {output} --log {log}"
