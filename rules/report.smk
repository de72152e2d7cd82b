from rwkv7_coreai.report import report_inputs, report_path


rule report:
    # One self-contained HTML page per model (inline SVG, no JavaScript, nothing fetched): gate
    # verdicts and numbers, max|dlogits| and reference margin per step, bundle sizes, export time
    # and peak RSS (from the export logs: not content-addressed, fine for a report), the prefill
    # speedup when the gate measured one, coreai doctor's findings and the card preview.
    input:
        unpack(lambda w: stage_inputs(report_inputs, w)),
    output:
        str(report_path(OUT)),
    params:
        settings=settings("report"),
        code=CODE["report"],
    log:
        str(OUT.log("report")),
    resources:
        **sizing.for_rule("report", config),
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/report.py --config-file {CONFIG_FILE} --model {wildcards.model} "
        "--gates {input.gates} --tsvs {input.tsvs} --exports {input.exports} --logs {input.logs} "
        "--doctors {input.doctors} --card {input.card} --out {output} --log {log}"
