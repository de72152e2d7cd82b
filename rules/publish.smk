rule stage_and_push:
    # The exact Hub tree + receipt; uploads in one commit when publish.push is on and HF_TOKEN is set.
    input:
        card=f"{RES}/{{model}}/card/README.md",
        vocab=f"{RES}/{{model}}/vocab/rwkv_vocab.tsv",
        toolchain=f"{RES}/toolchain.json",
        gates=lambda w: expand(f"{RES}/{w.model}/gate/{{recipe}}.json", recipe=recipes_of(w.model)),
        exports=lambda w: expand(f"{RES}/{w.model}/export/{{recipe}}", recipe=recipes_of(w.model)),
        aots=lambda w: expand(
            f"{RES}/{w.model}/aot/{{target}}/{{recipe}}",
            target=targets_of(w.model),
            recipe=recipes_of(w.model),
        ),
    output:
        directory(f"{RES}/{{model}}/publish"),
    params:
        config=CONFIG_FILE,
        results=lambda w, input: os.path.dirname(input.toolchain),
        settings=settings("publish"),
    log:
        f"{RES}/logs/{{model}}/publish.log",
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/publish.py --config-file {params.config} --model {wildcards.model} "
        "--results {params.results} --out {output} --log {log}"
