"""``scripts/gate_shard.py`` checks ``--shard``/``--shards`` before it removes anything (issue 34,
cases 11 and 12; docs/bad-inputs.md rows 167, N8, N9): a shard number out of range, not a number, or
more shards than the gate's steps and its prefill check is ONE line, exit 1, and the model's report
(which a shard removes once it really runs) is still there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recurrent_coreai.stages import gate_shard

ROOT = Path(__file__).resolve().parents[1]
MODEL, RECIPE = "rwkv7-tiny", "fp16"


def _argv(res: Path, shard: str, count: str) -> list[str]:
    lay = res / MODEL
    return ["--config-file", str(ROOT / "config.yaml"), "--model", MODEL, "--recipe", RECIPE, "--shard", shard,
            "--shards", count, "--export", str(lay / "export" / RECIPE), "--aot", str(lay / "aot/universal" / RECIPE),
            "--reference", str(lay / "reference/stream.npz"), "--out", str(lay / "gate" / RECIPE / f"shard-{shard}.json")]


def _stream(steps: int = 12) -> dict:
    """A gated stream's shape as the plan reads it: two prompts' steps and a 133-token prefill check."""
    return {"prompt": np.array([0] * (steps // 2) + [1] * (steps - steps // 2)),
            "prefill_tokens": np.zeros(133, dtype=np.int64), "prefill_chunk": np.array(64)}


@pytest.fixture
def report(tmp_path) -> Path:
    path = tmp_path / "res" / MODEL / "report" / "index.html"
    path.parent.mkdir(parents=True)
    path.write_text("<p>the previous verdict</p>")
    return path


@pytest.mark.parametrize("shard, count, what", [
    ("5", "3", "is shard 5 of 3: there is no such shard -- fix: run shards 0..2 (--shard K --shards 3)"),
    ("-1", "3", "is shard -1 of 3: there is no such shard -- fix: run shards 0..2 (--shard K --shards 3)"),
    ("0", "0", "is shard 0 of 0: there is no such shard -- fix: give --shards at least 1"),
    ("one", "3", "--shard 'one' --shards '3': not whole numbers -- fix: give --shard K --shards N with 0 <= K < N"),
])
def test_a_bad_shard_number_is_one_line_and_removes_nothing(report, tmp_path, capsys, shard, count, what):
    rc = gate_shard.main(_argv(tmp_path / "res", shard, count))
    err = capsys.readouterr().err
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and what in err, err
    assert report.read_text() == "<p>the previous verdict</p>"
    assert not (tmp_path / "res" / MODEL / "gate").exists()


def test_more_shards_than_the_gate_has_steps_is_one_line_and_removes_nothing(report, tmp_path, capsys, monkeypatch):
    """--shards 500 for a 12-step gate: the plan cannot fill them (it raised ValueError, an
    'internal error'); the stream is read first, the report is kept."""
    monkeypatch.setattr(gate_shard, "gate_inputs", lambda *a, **k: {"stream": _stream(12)})
    rc = gate_shard.main(_argv(tmp_path / "res", "0", "500"))
    err = capsys.readouterr().err
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert ("--shards 500: 500 shards are more than the gate's 12 steps and its checks -- fix: use at most 13 "
            "shards") in err, err
    assert "internal error" not in err and report.read_text() == "<p>the previous verdict</p>"


def test_the_most_shards_the_plan_accepts_is_what_the_line_says():
    gate_shard.check_plan(_stream(12), 13, Path("out.json"))  # a shard per step and one for the prefill check
    with pytest.raises(Exception, match="use at most 13 shards"):
        gate_shard.check_plan(_stream(12), 14, Path("out.json"))
