rule gate_shard:
    # One shard of the gate: its pieces of the plan (pipeline/shards.py) through the Core AI
    # runtime, compared step by step with the reference; a shard that starts mid-prompt first
    # feeds that prompt's earlier tokens through the bundle's own prefill and decode. A separate
    # job, so a cluster executor can place each on its own node. Judges nothing: the gate does.
    input:
        export=str(OUT.export("{recipe}")),
        aot=str(OUT.aot("universal", "{recipe}")),
        reference=str(OUT.reference),
    output:
        str(OUT.gate_shard("{recipe}", "{shard}")),
    params:
        settings=settings("gate_shard"),
        code=code("gate_shard"),
        shards=gate_shard_count,
    log:
        str(OUT.log("gate-{recipe}-shard-{shard}")),
    threads: sizing.shard_threads(config)  # the gate's processes when it is one shard, else 1
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("gate_shard", config, "export"),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/gate_shard.py --config-file {resources.config_file} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --shard {wildcards.shard} --shards {params.shards} "
        "--export {input.export} --aot {input.aot} --reference {input.reference} --out {output} --log {log}"


rule gate:
    # The verdict, gathered from every shard: each shard record is checked (sealed, made for this
    # bundle, lowering, reference, settings and its pieces of the plan) and the rows are judged as
    # one gate. Exits nonzero on a failure, so nothing downstream (card, publish) can use that
    # bundle. The JSON records the sha256 of every file it tested: publish ships only those bytes.
    input:
        export=str(OUT.export("{recipe}")),
        aot=str(OUT.aot("universal", "{recipe}")),
        reference=str(OUT.reference),
        shards=lambda w: [str(Layout(RES, w.model).gate_shard(w.recipe, k)) for k in range(gate_shard_count(w))],
    output:
        json=str(OUT.gate_json("{recipe}")),
        tsv=str(OUT.gate_tsv("{recipe}")),
    params:
        settings=settings("gate"),
        code=code("gate"),
    log:
        str(OUT.log("gate-{recipe}")),
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("gate", config),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/gate.py --config-file {resources.config_file} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --export {input.export} --aot {input.aot} "
        "--reference {input.reference} --shards {input.shards} --json {output.json} --tsv {output.tsv} --log {log}"
