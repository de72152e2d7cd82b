rule gate:
    # Teacher-forced parity in the Core AI runtime against the reference. Exits nonzero on a
    # failure, so nothing downstream (card, publish) can use that bundle. The JSON records the
    # sha256 of every file it tested: publish ships only those bytes.
    input:
        export=str(OUT.export("{recipe}")),
        aot=str(OUT.aot("universal", "{recipe}")),
        reference=str(OUT.reference),
    output:
        json=str(OUT.gate_json("{recipe}")),
        tsv=str(OUT.gate_tsv("{recipe}")),
    params:
        config_file=config_file("gate"),
        settings=settings("gate"),
        code=code("gate"),
    log:
        str(OUT.log("gate-{recipe}")),
    threads: sizing.gate_threads(config)  # the gate's processes (1 below 0.5 B parameters)
    resources:
        **sizing.for_rule("gate", config, "export"),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/gate.py --config-file {params.config_file} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --export {input.export} --aot {input.aot} "
        "--reference {input.reference} --json {output.json} --tsv {output.tsv} --log {log}"
