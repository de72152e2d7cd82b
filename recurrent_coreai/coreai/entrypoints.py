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


def text_plan(n: int, chunk: int, horizons: list[int]) -> list[tuple[str, int, int]]:
    """How the text stream of ``n`` tokens runs through a bundle, from zero states: (function, start,
    stop) runs. The chunk before each horizon goes through ``main`` token by token (every position
    scored); the others through ``prefill`` (its logits at the chunk's last position); a tail
    shorter than a chunk through ``main``. The reference stores logits exactly where the bundle
    reports them."""
    scored = {h - chunk for h in horizons}
    runs, p = [], 0
    while p < n:
        if p in scored or p + chunk > n:
            stop = min(p + chunk, n)
            runs.append((DECODE, p, stop))
        else:
            stop = p + chunk
            runs.append((PREFILL, p, stop))
        p = stop
    return runs


def text_piece(n: int, chunk: int, horizons: list[int], idx: list[int] | None = None) -> tuple[list, int, list[int]]:
    """A part of the text stream that runs on its own from zero states: the horizons ``idx``
    (consecutive indices into ``horizons``; None: all). Returns (its runs, the first position it
    reports, its horizons): it runs :func:`text_plan` up to its last horizon (the last part: to the
    end of the stream) with only its own horizons' chunks through ``main``, and reports only the
    positions from the horizon before its first on, so the parts together report each position of
    the whole stream's plan once, with the same functions. (The states a part starts its report
    from went through prefill where the whole stream ran the earlier horizons' chunks through main:
    a split stream's numbers differ from the whole one's by the recipe's rounding.)"""
    idx = list(range(len(horizons))) if idx is None else list(idx)
    mine = [horizons[i] for i in idx]
    lo = horizons[idx[0] - 1] if idx[0] > 0 else 0
    hi = mine[-1] if idx[-1] < len(horizons) - 1 else n
    return text_plan(hi, chunk, mine), lo, mine


def text_logit_positions(n: int, chunk: int, horizons: list[int]) -> list[int]:
    """The positions whose logits the bundle reports on the text stream (:func:`text_plan`)."""
    return [q for fn, a, b in text_plan(n, chunk, horizons) for q in (range(a, b) if fn == DECODE else [b - 1])]


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
