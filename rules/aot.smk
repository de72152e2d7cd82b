rule aot:
    # universal: the Linux lowering (.aimodelx); device targets: xcrun coreai-build (macOS only).
    input:
        export=str(OUT.export("{recipe}")),
    output:
        directory(str(OUT.aot("{target}", "{recipe}"))),
    params:
        settings=settings("aot"),
        code=code("aot"),
    log:
        str(OUT.log("aot-{target}-{recipe}")),
    resources:
        config_file=CONFIG_FILE,
        apple_gpu=lambda w: int(config["targets"][w.target]["kind"] == "device"),
        **sizing.for_rule("aot", config, "export"),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/aot.py --config-file {resources.config_file} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --target {wildcards.target} --export {input.export} "
        "--out {output} --log {log}"
