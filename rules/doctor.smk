from recurrent_coreai.stages.doctor import doctor_json


rule doctor:
    # The peer lint: coreai doctor (coreai-cli, pinned) over the export graph's source, the
    # checkpoint and the recipe's bundle. A fatal/silent finding fails the build (exit 2, one
    # line); the JSON (every target's report) lands beside the gate result.
    input:
        sources=lambda w: list(family_of(w.model).doctor_sources()),
        checkpoint=str(OUT.source),
        export=str(OUT.export("{recipe}")),
    output:
        str(doctor_json(OUT, "{recipe}")),
    params:
        settings=settings("doctor"),
        code=code("doctor"),
    log:
        str(OUT.log("doctor-{recipe}")),
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("doctor", config),
    conda:
        "../envs/coreai.yaml"
    shell:
        "python scripts/doctor.py --config-file {resources.config_file} --model {wildcards.model} "
        "--recipe {wildcards.recipe} --sources {input.sources} --checkpoint {input.checkpoint} "
        "--export {input.export} --out {output} --log {log}"
