"""progress.py with a fake clock: plain lines at most every `interval` seconds (rate, ETA) when
stderr is not a terminal, an in-place bar on a terminal, silence for quick steps."""

from __future__ import annotations

import io

from recurrent_coreai.util.progress import Progress, progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_at_most_every_interval_with_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    bar = Progress("gate fp16", total=100, unit="steps", stream=out, clock=clock, interval=5.0)
    for _ in range(100):  # one step per second: a line at 5 s, 10 s, ... (20 lines) and a final one
        clock.t += 1.0
        bar.update()
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 21
    assert lines[0] == "gate fp16: 5 steps of 100 steps (5%) 1 steps/s ETA 1:35"
    assert lines[9] == "gate fp16: 50 steps of 100 steps (50%) 1 steps/s ETA 0:50"
    assert lines[-1] == "gate fp16: 100 steps in 1:40 (1 steps/s)"
    assert "\r" not in out.getvalue()


def test_bytes_are_scaled_and_rates_follow_the_clock():
    clock, out = Clock(), io.StringIO()
    with Progress("hashing model.safetensors", total=3e9, unit="B", stream=out, clock=clock, interval=2.0) as bar:
        for _ in range(3):
            clock.t += 2.5
            bar.update(0.5e9)  # 200 MB/s
    lines = out.getvalue().splitlines()
    assert lines[0] == "hashing model.safetensors: 500.0 MB of 3.0 GB (17%) 200.0 MB/s ETA 0:12"
    assert lines[-1] == "hashing model.safetensors: 1.5 GB in 0:08 (200.0 MB/s)"


def test_quick_steps_print_nothing():
    for stream in (io.StringIO(), Tty()):
        clock = Clock()
        with Progress("quick", total=10, stream=stream, clock=clock) as bar:
            for _ in range(10):
                clock.t += 0.05
                bar.update()
        assert stream.getvalue() == ""


def test_stderr_by_default_and_off_with_rwkv7_progress_0(monkeypatch, capfd):
    for setting, shown in (("1", True), ("0", False)):
        monkeypatch.setenv("RECURRENT_COREAI_PROGRESS", setting)
        clock = Clock()
        with Progress("export", total=2, clock=clock, interval=1.0) as bar:
            clock.t += 1.5
            bar.update()
        out, err = capfd.readouterr()
        assert out == "" and (err.startswith("export: 1 of 2 (50%)") if shown else err == "")


def test_tty_redraws_one_bar_in_place():
    clock, out = Clock(), Tty()
    items = list(range(40))

    def ticking():
        for i in items:
            clock.t += 0.25
            yield i

    assert list(progress(ticking(), "synthesising", total=40, stream=out, clock=clock)) == items
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, redrawn with \r
    frames = text.split("\r")[1:]
    assert frames[0].startswith("synthesising: [")  # the first frame after the 1 s delay
    assert "[###############...............] 20 of 40 (50%) 4/s ETA 0:05" in text
    assert frames[-1] == "synthesising: 40 in 0:10 (4/s)\x1b[K\n"
    assert len(frames) <= 40
