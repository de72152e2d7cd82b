rule aot:
    # universal: the Linux lowering (.aimodelx); device targets: xcrun coreai-build (macOS only).
    input:
        export=f"{RES}/{{model}}/export/{{recipe}}",
    output:
        directory(f"{RES}/{{model}}/aot/{{target}}/{{recipe}}"),
    params:
        config=CONFIG_FILE,
        settings=settings("aot"),
    log:
        f"{RES}/logs/{{model}}/aot-{{target}}-{{recipe}}.log",
    resources:
        apple_gpu=lambda w: int(config["targets"][w.target]["kind"] == "device"),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/aot.py --config-file {params.config} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --target {wildcards.target} --export {input.export} "
        "--out {output} --log {log}"
