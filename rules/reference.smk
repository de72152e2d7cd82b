rule reference:
    # The oracle's token stream and fp32 logits, computed once per model for every recipe's gate.
    input:
        source=f"{RES}/{{model}}/source",
        vocab=f"{RES}/{{model}}/vocab/rwkv_vocab.tsv",
    output:
        f"{RES}/{{model}}/reference/stream.npz",
    params:
        config=CONFIG_FILE,
        settings=settings("reference"),
    log:
        f"{RES}/logs/{{model}}/reference.log",
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/reference.py --config-file {params.config} --model {wildcards.model} "
        "--source {input.source} --vocab {input.vocab} --out {output} --log {log}"
