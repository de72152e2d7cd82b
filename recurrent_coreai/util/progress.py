"""Progress of a long step, on stderr.

On a terminal: a bar redrawn in place (at most 10 times a second, and only once the step has run
for ``delay`` seconds, so quick steps stay silent). Otherwise (a log, CI, Snakemake's captured
output): one plain line at most every ``interval`` seconds with the count, the rate and the ETA —
and, if any line was printed, a last one when the step ends.

    with Progress("hashing model.safetensors", total=size, unit="B") as bar:
        for chunk in chunks:
            bar.update(len(chunk))

    for step in progress(steps, "gate fp16", unit="steps"): ...

``RECURRENT_COREAI_PROGRESS=0`` (old name ``RWKV7_PROGRESS``, still read) in the environment turns it off (where stderr must hold nothing but errors,
e.g. tests that check a failing stage prints exactly one line); an explicit ``stream`` ignores it.
"""

from __future__ import annotations

from recurrent_coreai.util import env

import os
import sys
import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")
TTY_REDRAW = 0.1  # seconds between two redraws of the bar


def _scaled(n: float, unit: str) -> str:
    """``1234567, "B"`` -> ``1.2 MB``; other units as plain numbers (``5 steps``)."""
    if unit == "B":
        for prefix in ("", "k", "M", "G", "T"):
            if abs(n) < 1000 or prefix == "T":
                return f"{n:.0f} {prefix}B" if prefix == "" else f"{n:.1f} {prefix}B"
            n /= 1000
    if unit == "params":
        return f"{n / 1e6:.1f}M params" if n >= 1e6 else f"{n:.0f} params"
    return f"{n:.0f} {unit}".rstrip() if float(n).is_integer() else f"{n:.1f} {unit}".rstrip()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, label: str, total: float | None = None, unit: str = "", *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, interval: float = 5.0, delay: float = 1.0,
                 tty: bool | None = None, width: int = 30):
        self.label, self.total, self.unit = label, total, unit
        self.enabled = stream is not None or env.get("RECURRENT_COREAI_PROGRESS", "1") != "0"
        self.stream = stream if stream is not None else sys.stderr
        self.clock, self.interval, self.delay, self.width = clock, interval, delay, width
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0.0
        self.start = self.clock()
        self._last = None  # when the last line/bar was written
        self._drawn = False

    # -- reporting ----------------------------------------------------------------------------
    def update(self, n: float = 1) -> None:
        self.done += n
        now = self.clock()
        if self.tty:
            if now - self.start >= self.delay and (self._last is None or now - self._last >= TTY_REDRAW):
                self._write("\r" + self.line(now) + "\x1b[K")
                self._last = now
        elif now - (self._last if self._last is not None else self.start) >= self.interval:
            self._write(self.line(now) + "\n")
            self._last = now

    def close(self) -> None:
        """The final state, if anything was shown (quick steps stay silent)."""
        if not self._drawn:
            return
        now = self.clock()
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        end = (f"{self.label}: {_scaled(self.done, self.unit)} in {_duration(elapsed)} "
               f"({_scaled(rate, self.unit)}/s)")
        self._write(("\r" + end + "\x1b[K\n") if self.tty else end + "\n")

    def line(self, now: float) -> str:
        """The status text: count (of total, percent), rate, ETA; with a bar on a terminal."""
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.label}:"]
        if self.total:
            frac = min(self.done / self.total, 1.0)
            if self.tty:
                filled = int(frac * self.width)
                parts.append("[" + "#" * filled + "." * (self.width - filled) + "]")
            parts.append(f"{_scaled(self.done, self.unit)} of {_scaled(self.total, self.unit)} ({frac:.0%})")
        else:
            parts.append(_scaled(self.done, self.unit))
        parts.append(f"{_scaled(rate, self.unit)}/s")
        if self.total and rate > 0:
            parts.append(f"ETA {_duration(max(self.total - self.done, 0) / rate)}")
        return " ".join(parts)

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        self.stream.write(text)
        self.stream.flush()
        self._drawn = True

    # -- context manager --------------------------------------------------------------------------
    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(items: Iterable[T], label: str, total: float | None = None, unit: str = "", **kw) -> Iterator[T]:
    """Iterate ``items``, counting one per item (``total`` defaults to ``len(items)``)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(label, total, unit, **kw) as bar:
        for item in items:
            yield item
            bar.update(1)
