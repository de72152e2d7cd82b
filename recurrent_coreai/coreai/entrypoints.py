"""The bundle's entry points, as data: ONE table, and the only place that names them.

Each row is a function of the ``.aimodel``: its name, its role and the static shape of its inputs.
The module behind a row comes from the model's family (``decode`` is the family's decode module
itself, ``prefill`` is ``family.build_prefill`` over it: same parameters and states); the states
every function reads and writes once are the family's (``family.state_specs``). The export stages
every row on one converter and records each function in ``export.json`` (``functions``: role,
inputs and outputs with shapes, states, writes per state per call, tokens per call); everything
after the export -- the runtime wrapper, the gate, the card, the AOT stage -- reads names and
shapes from there (:func:`bundle_functions`), never from this table.

* role ``decode``: one token per call;
* role ``prefill``: ``chunk`` tokens per call (the family's exact chunked form), logits of the last
  one; a prompt's tail shorter than a chunk goes through the decode function (:func:`split_prompt`).

Importing this module does not import torch (the card reads roles from here).
"""

from __future__ import annotations

from dataclasses import dataclass

from recurrent_coreai.util.errors import PipelineError

DECODE, PREFILL = "decode", "prefill"
INPUT_NAMES = ("input_ids", "position_ids")   # position_ids: accepted, unused (engine parity)
OUTPUT_NAMES = ("logits",)


@dataclass(frozen=True)
class EntryPoint:
    name: str
    role: str
    inputs: tuple[str, ...] = INPUT_NAMES
    outputs: tuple[str, ...] = OUTPUT_NAMES

    def tokens(self, chunk: int) -> int:
        """Tokens per call: 1 for decode, ``chunk`` for prefill."""
        return 1 if self.role == DECODE else chunk

    def example_inputs(self, chunk: int = 1) -> tuple:
        """``input_ids`` zeros and ``position_ids`` 0..T-1, [1,T] int32 (T fixes the static shape)."""
        import torch

        if self.role == DECODE:
            return torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
        return torch.zeros(1, chunk, dtype=torch.int32), torch.arange(chunk, dtype=torch.int32).reshape(1, chunk)

    def module(self, family, decode, chunk: int):
        """The function's ``nn.Module``: ``decode`` itself, or the family's prefill over it."""
        return decode if self.role == DECODE else family.build_prefill(decode, chunk).eval()


ENTRY_POINTS: tuple[EntryPoint, ...] = (EntryPoint("main", DECODE), EntryPoint("prefill", PREFILL))


def by_role(role: str) -> EntryPoint:
    return next(e for e in ENTRY_POINTS if e.role == role)


def split_prompt(n_tokens: int, chunk: int) -> tuple[int, int]:
    """(number of full chunks for prefill, number of tail tokens for decode)."""
    return n_tokens // chunk, n_tokens % chunk


def bundle_functions(export_record: dict) -> dict[str, dict]:
    """A bundle's functions as its export.json records them, by role; each record plus its
    ``name``. An export.json without ``functions`` (from before this table) is refused."""
    functions = export_record.get("functions")
    if not isinstance(functions, dict) or not functions:
        raise PipelineError(f"export.json of {export_record.get('bundle', 'the bundle')}",
                            "records no functions (an export from before the prefill entry point)",
                            "rerun the export stage (snakemake --forcerun export)")
    return {f["role"]: {**f, "name": name} for name, f in functions.items()}


def state_names(export_record: dict) -> tuple[str, ...]:
    """The states of the bundle's decode function, in order, as export.json records them."""
    return tuple(t["name"] for t in bundle_functions(export_record)[DECODE]["states"])
