from recurrent_coreai.stages.report import report_inputs, report_path


rule report:
    # One self-contained HTML page per model (inline SVG, no JavaScript, nothing fetched): gate
    # verdicts and numbers, max|dlogits| and reference margin per step, bundle sizes, export time
    # and peak RSS (from the export logs: not content-addressed, fine for a report), the prefill
    # check, coreai doctor's findings and the card preview. A gate run removes the report first
    # (stages/gate.py remove_stale_report): a failing gate never leaves one saying PASS.
    input:
        # the export logs are read when present but are not inputs: logs are not tracked by DVC,
        # and as inputs a `dvc pull` (which restores no logs) would make Snakemake re-export
        unpack(lambda w: {k: v for k, v in stage_inputs(report_inputs, w).items() if k != "logs"}),
    output:
        str(report_path(OUT)),
    params:
        config_file=CONFIG_FILE,
        logs=lambda w: stage_inputs(report_inputs, w)["logs"],
        settings=settings("report"),
        code=code("report"),
    log:
        str(OUT.log("report")),
    resources:
        **sizing.for_rule("report", config),
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/report.py --config-file {params.config_file} --model {wildcards.model} "
        "--gates {input.gates} --tsvs {input.tsvs} --exports {input.exports} --logs {params.logs} "
        "--doctors {input.doctors} --card {input.card} --out {output} --log {log}"
