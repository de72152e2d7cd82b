"""Every stage's entry point by stage name (for tests and tools; ``scripts/<stage>.py`` call the
stage modules directly). Each is ``main`` of the module that holds the stage's logic, so a
stage's code fingerprint covers that module and its imports only (see fingerprint.py)."""

from __future__ import annotations

from .aot import main as aot
from .card import main as card
from .doctor import main as doctor
from .export import main as export
from .gate import main as gate
from .publish import main as publish
from .reference_stream import main as reference
from .report import main as report
from .source import main as source
from .toolchain import main as toolchain
from .vocab import main as vocab

__all__ = ["aot", "card", "doctor", "export", "gate", "publish", "reference", "report", "source", "toolchain", "vocab"]
