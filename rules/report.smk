from recurrent_coreai.stages.report import report_inputs, report_path


rule report:
    # One self-contained HTML page per model (inline SVG, no JavaScript, nothing fetched): gate
    # verdicts and numbers, max|dlogits| and reference margin per step, bundle sizes, the prefill
    # check, coreai doctor's findings and the card preview. Every input is checked against its
    # stage's record and the page is sealed (its last line: records.seal_report), so a rebuild
    # writes the same bytes and dvc.lock agrees. Run measurements (export time, peak RSS) are not
    # inputs: they stay in the export log's summary line, results/logs/<m>/export-<r>.log (logs are
    # not tracked by DVC, so a `dvc pull` restores none and nothing here waits on one). A gate run
    # removes the report first (stages/gate.py remove_stale_report): a failing gate never leaves
    # one saying PASS.
    input:
        unpack(lambda w: stage_inputs(report_inputs, w)),
    output:
        str(report_path(OUT)),
    params:
        settings=settings("report"),
        code=code("report"),
    log:
        str(OUT.log("report")),
    resources:
        config_file=CONFIG_FILE,
        **sizing.for_rule("report", config),
    conda:
        "../envs/hub.yaml"
    shell:
        "python scripts/report.py --config-file {resources.config_file} --model {wildcards.model} "
        "--gates {input.gates} --tsvs {input.tsvs} --exports {input.exports} "
        "--doctors {input.doctors} --card {input.card} --out {output} --log {log}"
