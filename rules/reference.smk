rule reference:
    # The oracle's token stream and fp32 logits, computed once per model for every recipe's gate.
    input:
        source=str(OUT.source),
        vocab=str(OUT.vocab),
        text=gate_text,
    output:
        str(OUT.reference),
    params:
        settings=settings("reference"),
        code=code("reference"),
    log:
        str(OUT.log("reference")),
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("reference", config, "source"),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/reference.py --config-file {resources.config_file} --model {wildcards.model} "
        "--source {input.source} --vocab {input.vocab} --out {output} --log {log}"
