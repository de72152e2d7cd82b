rule card:
    # Hugging Face model card from the measured numbers (template: recurrent_coreai/stages/templates/),
    # merged into cards/<model>.md when a maintainer keeps one.
    input:
        unpack(lambda w: stage_inputs(card_inputs, w)),
        curated=curated_card,
    output:
        str(OUT.card),
    params:
        settings=settings("card"),
        code=code("card"),
    log:
        str(OUT.log("card")),
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("card", config),
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/card.py --config-file {resources.config_file} --model {wildcards.model} "
        "--source {input.source} --vocab {input.vocab} --toolchain {input.toolchain} "
        "--exports {input.exports} --gates {input.gates} --curated {input.curated} "
        "--out {output} --log {log}"
