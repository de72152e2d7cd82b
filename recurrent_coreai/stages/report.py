"""The build report: one self-contained HTML page per model, ``results/<m>/report/index.html``.

Per recipe: the gate verdict and its numbers, plots of max|Δlogits| and of the reference's top-2
margin per step (inline SVG drawn here: no JavaScript, nothing fetched), bundle sizes, the prefill
check, and coreai doctor's findings; then a preview of the model card (Markdown rendered with
markdown-it-py, raw HTML in the card escaped).

Everything shown comes from the stage outputs the rule declares as inputs, each checked against its
stage's record first (pipeline/records.py, the integrity chain: the gate JSON's seal and its TSV's
digest, export.json and its bundle, the doctor JSON, the card's seal line), and the page is sealed
the same way as the card (its last line: :func:`records.seal_report`). So a rebuild from the same
inputs writes the same bytes: run measurements (export time, peak RSS) are not shown; they are in
the export log's summary line (``results/logs/<m>/export-<r>.log``) and in ``bench/``.
"""

from __future__ import annotations

import csv
import functools
import io
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path

import jinja2
from markupsafe import Markup

from recurrent_coreai.coreai import fold_words
from recurrent_coreai.pipeline import stage
from recurrent_coreai.stages.doctor import doctor_json
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.frontmatter import FRONT
from recurrent_coreai.util.fsutil import write_text_atomic
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import (read_card, read_doctor, read_export, read_gate, read_gate_tsv,
                                                seal_report)

TEMPLATE = "report.html.j2"


def report_path(lay: Layout) -> Path:
    return lay.base / "report" / "index.html"


def report_inputs(lay: Layout, recipes: list[str], targets: list[str] = ()) -> dict[str, Path | list[Path]]:
    """What the report reads, by name (the rule's inputs and the CLI's ``--<name>`` lists)."""
    del targets
    return {"gates": [lay.gate_json(r) for r in recipes], "tsvs": [lay.gate_tsv(r) for r in recipes],
            "exports": [lay.export(r) for r in recipes], "doctors": [doctor_json(lay, r) for r in recipes],
            "card": lay.card}


# ---------------------------------------------------------------------------------------------
# reading the inputs
# ---------------------------------------------------------------------------------------------
TSV_USED = ("step", "prompt", "near_tie", "agree", "ref_margin", "max_abs_dlogits", "kl")  # of gate.TSV_COLUMNS
FLOATS = ("ref_margin", "max_abs_dlogits", "kl")


def read_tsv(path: Path, gate: dict) -> list[dict]:
    """The gate's per-step rows (the columns the plots use), numbers as numbers; the TSV is checked
    against the digest its gate JSON (``gate``) recorded."""
    rows = list(csv.DictReader(io.StringIO(read_gate_tsv(path, gate), newline=""), delimiter="\t"))
    missing = [c for c in TSV_USED if not rows or c not in rows[0]]
    if missing:
        raise PipelineError(path, f"is not a gate TSV (no rows, or no column {missing[0]!r})", "rerun the gate stage")
    return [{k: float(r[k]) if k in FLOATS else int(r[k]) for k in TSV_USED} for r in rows]


@dataclass
class Recipe:
    name: str
    gate: dict
    rows: list[dict]
    export: dict
    doctor: dict

    @property
    def lowered_bytes(self) -> int:
        return sum(f["size"] for f in self.gate["tested_files"]["lowered"].values())

    @property
    def prefill(self) -> dict | None:
        """The gate's prefill check (chunked prefill + decode tail vs the reference), or None for a
        bundle without a prefill function."""
        return self.gate.get("prefill")

    @property
    def state_writes(self) -> dict[str, dict[str, int]]:
        """Writes per state per call, by function (as the gate recorded them)."""
        return self.gate.get("state_writes") or {}


def tsv_name(gate_path: Path, gate: dict) -> str:
    """The file name of the TSV the gate wrote beside its JSON (``<r>.tsv``, or ``<r>.failed.tsv``
    beside a ``<r>.failed.json``), as the gate JSON records it."""
    return (gate.get("tsv") or {}).get("name") or Path(gate_path).with_suffix(".tsv").name


def load_recipes(gates, tsvs, exports, doctors) -> list[Recipe]:
    """Every recipe's inputs, each checked against its stage's record (one line naming the file and
    the stage to rerun when one differs)."""
    by_tsv = {Path(p).name: Path(p) for p in tsvs}
    by_doctor = {Path(p).name.removesuffix(".doctor.json"): Path(p) for p in doctors}
    by_export = {read_export(p)["recipe"]: Path(p) for p in exports}
    recipes = []
    for path in gates:
        gate = read_gate(path)
        r = gate["recipe"]
        for table, key, what in ((by_tsv, tsv_name(path, gate), "gate TSV"), (by_doctor, r, "doctor JSON"),
                                 (by_export, r, "export directory")):
            if key not in table:
                raise PipelineError(path, f"recipe {r} has no {what} among the report's inputs",
                                    "pass every recipe's inputs (rules/report.smk lists them)")
        recipes.append(Recipe(r, gate, read_tsv(by_tsv[tsv_name(path, gate)], gate), read_export(by_export[r]),
                              read_doctor(by_doctor[r])))
    return recipes


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
W, H = 720, 220
PAD_L, PAD_R, PAD_T, PAD_B = 62, 12, 24, 30


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def svg_plot(ys: list[float], title: str, key: str, *, hline: float | None = None, hline_label: str = "",
             marks: dict[str, list[int]] | None = None, boundaries: list[int] = ()) -> Markup:
    """A line plot of ``ys`` over the steps 0..n-1, with y from 0: one ``polyline.series`` of n
    points, a dashed horizontal threshold (named in the title instead when it is more than twice
    the largest value: it would flatten the data), circles for marked steps (class = the mark's
    name) and dotted lines where a new prompt starts."""
    n, peak = len(ys), max(ys, default=0.0)
    if hline is not None and hline > 2 * peak:
        title, hline = f"{title} ({hline_label}: off the scale)", None
    top = max(peak, hline or 0.0) * 1.08 or 1.0
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def px(i: float) -> float:
        return PAD_L + (pw * i / (n - 1) if n > 1 else pw / 2)

    def py(v: float) -> float:
        return PAD_T + ph * (1 - v / top)

    out = [f'<svg class="plot" data-key="{key}" data-points="{n}" xmlns="http://www.w3.org/2000/svg" '
           f'viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{escape(title)}">',
           f'<text class="title" x="{PAD_L}" y="15">{escape(title)}</text>',
           f'<line class="axis" x1="{PAD_L}" y1="{PAD_T + ph}" x2="{PAD_L + pw}" y2="{PAD_T + ph}"/>',
           f'<line class="axis" x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{PAD_T + ph}"/>']
    for k in range(5):
        v = top * k / 4
        out.append(f'<line class="grid" x1="{PAD_L}" y1="{py(v):.1f}" x2="{PAD_L + pw}" y2="{py(v):.1f}"/>'
                   f'<text class="tick" x="{PAD_L - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    for i in sorted({0, n - 1, *boundaries}):
        out.append(f'<text class="tick" x="{px(i):.1f}" y="{H - 12}" text-anchor="middle">{i}</text>')
    for i in boundaries:
        out.append(f'<line class="prompt-start" x1="{px(i - 0.5):.1f}" y1="{PAD_T}" x2="{px(i - 0.5):.1f}" '
                   f'y2="{PAD_T + ph}"/>')
    if hline is not None:
        out.append(f'<line class="threshold" x1="{PAD_L}" y1="{py(hline):.1f}" x2="{PAD_L + pw}" '
                   f'y2="{py(hline):.1f}"/><text class="tick" x="{PAD_L + pw}" y="{py(hline) - 4:.1f}" '
                   f'text-anchor="end">{escape(hline_label)}</text>')
    points = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(ys))
    out.append(f'<polyline class="series" fill="none" points="{points}"/>')
    for cls, steps in (marks or {}).items():
        out += [f'<circle class="{cls}" data-step="{i}" cx="{px(i):.1f}" cy="{py(ys[i]):.1f}" r="3.5"/>'
                for i in steps]
    out.append("</svg>")
    return Markup("".join(out))


def plots(rec: Recipe) -> list[Markup]:
    rows, gate = rec.rows, rec.gate
    boundaries = [i for i in range(1, len(rows)) if rows[i]["prompt"] != rows[i - 1]["prompt"]]
    mismatch = [i for i, r in enumerate(rows) if not r["agree"]]
    ties = [i for i, r in enumerate(rows) if r["near_tie"]]
    limit = gate["thresholds"].get("max_abs_dlogits")
    eps = gate.get("near_tie_epsilon_used", gate["near_tie_epsilon"])
    return [
        svg_plot([r["max_abs_dlogits"] for r in rows], f"{rec.name}: max |Δlogits| per step, engine vs fp32 reference",
                 "max_abs_dlogits", hline=limit, hline_label=f"the limit {limit:g}" if limit is not None else "",
                 marks={"mismatch": mismatch}, boundaries=boundaries),
        svg_plot([r["ref_margin"] for r in rows], f"{rec.name}: reference top-2 margin per step", "ref_margin",
                 hline=eps, hline_label=f"near-tie ε {eps:g}", marks={"near-tie": ties, "mismatch": mismatch},
                 boundaries=boundaries),
        svg_plot([r["kl"] for r in rows], f"{rec.name}: KL divergence (reference ‖ bundle) per step, nats", "kl",
                 marks={"mismatch": mismatch}, boundaries=boundaries),
        *text_plots(rec),
    ]


def text_plots(rec: Recipe) -> list[Markup]:
    """The held-out text stream (gate JSON ``text``, where the gate ran one): KL per compared
    position, in stream order; a dotted line where each horizon's scored chunk starts."""
    text = rec.gate.get("text")
    if not text:
        return []
    rows = text["rows"]
    starts = {h["horizon"] - text["chunk"] for h in text["horizons"]}
    boundaries = [i for i, r in enumerate(rows) if i and r["pos"] in starts]
    mismatch = [i for i, r in enumerate(rows) if not r["agree"]]
    return [svg_plot([r["kl"] for r in rows], f"{rec.name}: KL divergence per compared position of the held-out text "
                     f"({text['tokens']} tokens; chunk ends, then each horizon's scored chunk), nats", "text_kl",
                     marks={"mismatch": mismatch}, boundaries=boundaries)]


# ---------------------------------------------------------------------------------------------
# the card preview
# ---------------------------------------------------------------------------------------------
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


def card_preview(card: Path) -> tuple[str, Markup]:
    """(front matter YAML, the card body as HTML), the card checked against its seal first.
    Managed-block markers (HTML comments) are dropped; any other raw HTML in the card is shown
    escaped, not rendered."""
    from markdown_it import MarkdownIt

    text = read_card(card)
    m = FRONT.match(text)
    front, body = (m.group(0)[4:-4], text[m.end():]) if m else ("", text)
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    return front, Markup(md.render(HTML_COMMENT.sub("", body)))


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------
def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


@functools.lru_cache(maxsize=1)
def template() -> jinja2.Template:
    """The page's template, compiled once per process (the DVC record renders every report again)."""
    env = jinja2.Environment(loader=jinja2.PackageLoader(__package__, "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters.update(mb=mb, g4=lambda v: f"{v:.4g}")
    env.globals["fold_words"] = fold_words.describe  # what the gate's fold did, as the card says it
    return env.get_template(TEMPLATE)


def render(model: str, recipes: list[Recipe], card: Path) -> str:
    front, card_html = card_preview(card)
    first = recipes[0].gate if recipes else {}
    return template().render(model=model, recipes=recipes, plots={r.name: plots(r) for r in recipes},
                                             front=front, card_html=card_html, toolchain=first.get("toolchain", {}),
                                             prompts=first.get("prompts", []))


def report_text(model: str, inputs: dict) -> tuple[str, list[Recipe]]:
    """The page, sealed, from its inputs (each checked against its stage's record first): what the
    report stage writes, and what stages/derivation.py renders again to check a page."""
    recipes = load_recipes(inputs["gates"], inputs["tsvs"], inputs["exports"], inputs["doctors"])
    return seal_report(render(model, recipes, Path(inputs["card"]))), recipes


def build_report(model: str, inputs: dict, out: Path) -> list[Recipe]:
    """Read and check the inputs, write the page sealed (records.read_report checks it)."""
    text, recipes = report_text(model, inputs)
    write_text_atomic(out, text)
    return recipes


@main_guard
def main(argv=None) -> int:
    """``scripts/report.py --model M --gates J... --tsvs T... --exports D... --doctors J...
    --card README.md --out results/<m>/report/index.html``."""
    ns = stage.parser("report", "model", "card", "out", lists=("gates", "tsvs", "exports", "doctors")
                      ).parse_args(argv)
    stage.setup("report", ns)
    recipes = build_report(ns.model, vars(ns), Path(ns.out))
    stage.log.info("report %s: %d recipes -> %s", ns.model, len(recipes), ns.out)
    return 0
