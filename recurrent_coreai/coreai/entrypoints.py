"""The bundle's entry points, as data: ONE table, and the only place that names them.

Each row is a function of the ``.aimodel``: its name, its role, the module that builds it over
the decode module's parameters and states, its example inputs (which fix its static shapes) and
the names of its inputs, outputs and states. The export stages every row on one converter and
records each function in ``export.json`` (``functions``: role, inputs and outputs with shapes,
states, writes per state per call, tokens per call); everything after the export — the runtime
wrapper, the gate, the card, the AOT stage — reads names and shapes from there
(:func:`bundle_functions`), never from this table.

* role ``decode``: one token per call;
* role ``prefill``: ``chunk`` tokens per call (the exact chunked form of :mod:`.chunked`),
  logits of the last one; a prompt's tail shorter than a chunk goes through the decode function.

Importing this module does not import torch (the card reads roles from here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from recurrent_coreai.util.errors import PipelineError

DECODE, PREFILL = "decode", "prefill"
INPUT_NAMES = ("input_ids", "position_ids")   # position_ids: accepted, unused (engine parity)
OUTPUT_NAMES = ("logits",)
STATE_NAMES = ("recState", "shiftState")


def _decode_module(decode, chunk: int):
    del chunk  # one token per call
    return decode


def _prefill_module(decode, chunk: int):
    from recurrent_coreai.families.rwkv7.export_graph import build_prefill

    return build_prefill(decode, chunk)


def decode_example_inputs(chunk: int = 1) -> tuple:
    import torch

    del chunk
    return torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)


def _prefill_example_inputs(chunk: int) -> tuple:
    from recurrent_coreai.families.rwkv7.export_graph import prefill_example_inputs

    return prefill_example_inputs(chunk)


@dataclass(frozen=True)
class EntryPoint:
    name: str
    role: str
    build: Callable[[object, int], object]        # (decode module, chunk) -> the function's nn.Module
    example_inputs: Callable[[int], tuple]        # chunk -> example inputs (their shapes are the function's)
    inputs: tuple[str, ...] = INPUT_NAMES
    outputs: tuple[str, ...] = OUTPUT_NAMES
    states: tuple[str, ...] = STATE_NAMES


ENTRY_POINTS: tuple[EntryPoint, ...] = (
    EntryPoint("main", DECODE, _decode_module, decode_example_inputs),
    EntryPoint("prefill", PREFILL, _prefill_module, _prefill_example_inputs),
)


def by_role(role: str) -> EntryPoint:
    return next(e for e in ENTRY_POINTS if e.role == role)


def bundle_functions(export_record: dict) -> dict[str, dict]:
    """A bundle's functions as its export.json records them, by role; each record plus its
    ``name``. An export.json without ``functions`` (from before this table) is refused."""
    functions = export_record.get("functions")
    if not isinstance(functions, dict) or not functions:
        raise PipelineError(f"export.json of {export_record.get('bundle', 'the bundle')}",
                            "records no functions (an export from before the prefill entry point)",
                            "rerun the export stage (snakemake --forcerun export)")
    return {f["role"]: {**f, "name": name} for name, f in functions.items()}
