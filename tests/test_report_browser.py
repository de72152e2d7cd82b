"""The HTML build report, opened in headless Chromium: the numbers shown are the gate JSON's and
export.json's, every SVG plot is drawn with one point per gate step (and its points encode the
TSV's values), the card preview is rendered, no run measurement (export time, peak RSS) is shown
but the page says where they are, and the page loads nothing from anywhere.

The inputs are the built tree's (its gate JSONs, TSVs, exports, doctor JSONs and card), as the
report rule passes them. Chromium is a system package: `make test-browser` installs it and runs this
file (RECURRENT_COREAI_TEST_BROWSER=1; a missing Chromium or playwright then fails it); `make test`
skips it, saying so."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from recurrent_coreai.stages import report
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import read_report, write_sealed

RESULTS = None  # the tiny results tree (conftest)
M = "rwkv7-tiny"
CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(os.environ.get("RECURRENT_COREAI_TEST_BROWSER") != "1",
                                reason="needs Chromium, a system package: `make test-browser` installs it and runs "
                                       "this file (RECURRENT_COREAI_TEST_BROWSER=1); `make test` does not")


def recipes() -> list[str]:
    return yaml.safe_load((RESULTS.parent / "config.yaml").read_text())["models"][M]["recipes"]


def build(out: Path, gates: list[Path] | None = None) -> Path:
    lay = Layout(RESULTS, M)
    rs = recipes()
    argv = ["--config-file", str(RESULTS.parent / "config.yaml"), "--model", M, "--card", str(lay.card),
            "--out", str(out), "--gates", *map(str, gates or [lay.gate_json(r) for r in rs]),
            "--tsvs", *[str(lay.gate_tsv(r)) for r in rs], "--exports", *[str(lay.export(r)) for r in rs],
            "--doctors", *[str(lay.doctor_json(r)) for r in rs]]
    assert report.main(argv) == 0
    read_report(out)  # sealed by the report stage
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A directory for the pages built here."""
    return tmp_path_factory.mktemp("report")


@pytest.fixture(scope="module")
def page():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install playwright==1.65.2 (make setup)")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no browser at {CHROMIUM}: apt-get install -y chromium (make browser, as root)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pg = browser.new_page()
        pg.requests = []
        pg.on("request", lambda req: pg.requests.append(req.url))
        yield pg
        browser.close()


def cell(page, recipe: str, key: str) -> str:
    return page.locator(f'#recipes tr[data-recipe="{recipe}"] [data-key="{key}"]').inner_text().strip()


def test_numbers_plots_and_card_in_chromium(inputs, page):
    html = build(inputs / "index.html")
    page.goto(html.as_uri())
    assert page.requests == [html.as_uri()], "the report must not load anything else"
    assert page.locator("script").count() == 0
    lay = Layout(RESULTS, M)
    assert page.locator("#recipes tbody tr").count() == len(recipes()) == 3
    for r in recipes():
        g = json.loads(lay.gate_json(r).read_text())
        assert cell(page, r, "pass") == "PASS"
        assert int(cell(page, r, "agree_counted")) == g["agree_counted"] and int(cell(page, r, "counted")) == g["counted"]
        assert int(cell(page, r, "near_ties")) == g["near_ties"]
        for key in ("max_abs_dlogits", "mean_kl"):
            assert float(cell(page, r, key)) == pytest.approx(g[key], rel=1e-3), key
        assert cell(page, r, "size_bytes") == f"{g['size_bytes'] / 1e6:.1f} MB"
        lowered = sum(f["size"] for f in g["tested_files"]["lowered"].values())
        assert cell(page, r, "lowered_bytes") == f"{lowered / 1e6:.1f} MB"
        pre = g["prefill"]  # the gate's check of the chunked prefill function against the reference
        assert cell(page, r, "prefill_pass") == "PASS" and int(cell(page, r, "prefill_chunk")) == pre["chunk"]
        assert int(cell(page, r, "prefill_agree_counted")) == pre["agree_counted"]
        assert int(cell(page, r, "prefill_counted")) == pre["counted"]
        assert float(cell(page, r, "prefill_max_abs_dstate")) == pytest.approx(pre["max_abs_dstate"], rel=1e-3)
        assert float(cell(page, r, "prefill_max_rel_dstate")) == pytest.approx(pre["max_rel_dstate"], rel=1e-3)
        assert cell(page, r, "doctor_findings") == "0 findings"

        tsv = np.genfromtxt(lay.gate_tsv(r), delimiter="\t", names=True)
        assert len(tsv) == g["steps"]
        for key in ("max_abs_dlogits", "ref_margin"):
            svg = page.locator(f'section[data-recipe="{r}"] svg[data-key="{key}"]')
            drawn = svg.evaluate("""el => {
                const line = el.querySelector('polyline.series'), box = line.getBBox(), rect = el.getBoundingClientRect();
                return {n: line.points.numberOfItems, w: box.width, h: box.height, sw: rect.width, sh: rect.height,
                        ys: Array.from({length: line.points.numberOfItems}, (_, i) => line.points.getItem(i).y)};
            }""")
            assert drawn["n"] == g["steps"], (r, key)
            assert drawn["w"] > 300 and drawn["h"] > 10 and drawn["sw"] > 0 and drawn["sh"] > 0, (r, key, drawn)
            # the points encode the values: y is one affine function of the TSV column (to the drawn 0.1 px)
            v, y = tsv[key], np.array(drawn["ys"])
            lo, hi = int(np.argmin(v)), int(np.argmax(v))
            slope = (y[hi] - y[lo]) / (v[hi] - v[lo])
            assert slope < 0 and np.abs(y[lo] + slope * (v - v[lo]) - y).max() < 0.15, (r, key)
            assert svg.locator("circle.mismatch").count() == int((tsv["agree"] == 0).sum())
    # run measurements are not shown (a rebuild would not reproduce them): the page says where they are
    assert page.locator('[data-key="export_seconds"], [data-key="export_rss_mb"]').count() == 0
    headers = page.locator("#recipes th").all_inner_texts()
    assert not any("RSS" in h or "time" in h for h in headers), headers
    intro = page.locator("p.muted").first.inner_text()
    assert f"results/logs/{M}/export-<recipe>.log" in intro and "bench/" in intro and "docs/measurements/" in intro
    card = lay.card.read_text()
    title = re.search(r"^# (.+)$", card, re.M).group(1)
    assert page.locator("#card h1").inner_text() == title
    separators = re.findall(r"^\|(?:\s*:?-+:?\s*\|)+\s*$", card, re.M)  # one per Markdown table
    assert page.locator("#card table").count() == len(separators) >= 3
    assert "<!--" not in page.locator("#card").inner_text()


def edited_gates(out: Path, edit) -> list[Path]:
    """Every recipe's gate JSON of the build, passed through ``edit(recipe, gate)``, written to ``out``
    sealed as the gate stage seals it (the report refuses a gate JSON its stage did not seal)."""
    paths = []
    for r in recipes():
        g = json.loads(Layout(RESULTS, M).gate_json(r).read_text())
        edit(r, g)
        paths.append(out / f"{r}.json")
        write_sealed(paths[-1], g, "gate")
    return paths


def test_no_prefill_and_failures_are_shown(inputs, page, tmp_path):
    def edit(r, g):
        if r == "fp16":
            g["prefill"]["speedup"] = 11.46  # no stage writes it: the report does not show it (it was a dead field)
        if r == "fp32":
            del g["prefill"]  # a bundle without a prefill function
        if r == "int8keepproj":
            g.update({"pass": False, "reasons": ["top-1 agreement 30/40 outside near-ties is below 1.0"]})

    gates = edited_gates(tmp_path, edit)
    page.goto(build(tmp_path / "index.html", gates).as_uri())
    assert page.locator('[data-key="prefill_speedup"]').count() == 0 and "faster" not in cell(page, "fp16", "prefill")
    assert cell(page, "fp32", "prefill") == "no prefill"
    assert cell(page, "int8keepproj", "pass") == "FAIL" and cell(page, "fp16", "pass") == "PASS"
    assert "top-1 agreement 30/40" in page.locator('section[data-recipe="int8keepproj"] li.fail').inner_text()


def test_a_recipe_gated_at_fewer_steps_is_shown_with_the_reason(inputs, page, tmp_path):
    lay = Layout(RESULTS, M)

    def edit(r, g):
        if r == "int8keepproj":
            g.update(steps=g["reference_steps"] - 11, steps_why="measured: per-call dequantisation")

    gates = edited_gates(tmp_path, edit)
    page.goto(build(tmp_path / "index.html", gates).as_uri())
    full = json.loads(lay.gate_json("fp16").read_text())["steps"]
    section = page.locator('section[data-recipe="int8keepproj"]').inner_text()
    assert (f"Compared at {full - 11} of the reference's {full} steps (each prompt's first share), this model's "
            "choice: measured: per-call dequantisation.") in section
    assert "Compared at" not in page.locator('section[data-recipe="fp16"]').inner_text()
    assert f"Gate stream: {full} teacher-forced steps" in page.inner_text("body")
