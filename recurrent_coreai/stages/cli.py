"""Every stage's entry point by stage name (for tests and tools; ``scripts/<stage>.py`` call the
stage modules directly). Each is ``main`` of the module that holds the stage's logic, so a
stage's code fingerprint covers that module and its imports only (see fingerprint.py)."""

from __future__ import annotations

from recurrent_coreai.stages.aot import main as aot
from recurrent_coreai.stages.card import main as card
from recurrent_coreai.stages.doctor import main as doctor
from recurrent_coreai.stages.export import main as export
from recurrent_coreai.stages.gate import main as gate
from recurrent_coreai.stages.gate_shard import main as gate_shard
from recurrent_coreai.stages.publish import main as publish
from recurrent_coreai.stages.reference import main as reference
from recurrent_coreai.stages.report import main as report
from recurrent_coreai.stages.source import main as source
from recurrent_coreai.stages.toolchain import main as toolchain
from recurrent_coreai.stages.vocab import main as vocab

__all__ = ["aot", "card", "doctor", "export", "gate", "gate_shard", "publish", "reference", "report", "source", "toolchain", "vocab"]
