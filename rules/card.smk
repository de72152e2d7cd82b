rule card:
    # Hugging Face model card from the measured numbers (template: rwkv7_coreai/templates/).
    input:
        source=f"{RES}/{{model}}/source",
        vocab=f"{RES}/{{model}}/vocab/rwkv_vocab.tsv",
        toolchain=f"{RES}/toolchain.json",
        exports=lambda w: expand(f"{RES}/{w.model}/export/{{recipe}}", recipe=recipes_of(w.model)),
        gates=lambda w: expand(f"{RES}/{w.model}/gate/{{recipe}}.json", recipe=recipes_of(w.model)),
    output:
        f"{RES}/{{model}}/card/README.md",
    params:
        config=CONFIG_FILE,
        results=lambda w, input: os.path.dirname(input.toolchain),
        settings=settings("card"),
    log:
        f"{RES}/logs/{{model}}/card.log",
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/card.py --config-file {params.config} --model {wildcards.model} "
        "--results {params.results} --out {output} --log {log}"
