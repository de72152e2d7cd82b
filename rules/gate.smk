rule gate:
    # Teacher-forced parity in the Core AI runtime against the reference. Exits nonzero on a
    # failure, so nothing downstream (card, publish) can use that bundle.
    input:
        export=f"{RES}/{{model}}/export/{{recipe}}",
        aot=f"{RES}/{{model}}/aot/universal/{{recipe}}",
        reference=f"{RES}/{{model}}/reference/stream.npz",
    output:
        json=f"{RES}/{{model}}/gate/{{recipe}}.json",
        tsv=f"{RES}/{{model}}/gate/{{recipe}}.tsv",
    params:
        config=CONFIG_FILE,
        settings=settings("gate"),
    log:
        f"{RES}/logs/{{model}}/gate-{{recipe}}.log",
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/gate.py --config-file {params.config} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --export {input.export} --aot {input.aot} "
        "--reference {input.reference} --json {output.json} --tsv {output.tsv} --log {log}"
