"""Does a vocabulary fit the model? Every id a tokenizer can produce (``0 .. n_ids - 1``, added
tokens included) must have a row in each tensor indexed by token id (the embedding, the head);
rows beyond the tokenizer's ids are padding (a checkpoint padded to a multiple of 8, 64 ...): fine,
and said so on the card. Each tokenizer kind calls :func:`check` from its ``fits`` with its own
wording; the card shows :func:`describe`.

Shared layer: no family imports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from recurrent_coreai.util.errors import PipelineError


def check(where: str | Path, rows: Mapping[str, int], n_ids: int, tokenizer: str, fix: str) -> None:
    """One line naming the first tensor of ``rows`` ({tensor name: rows}) with fewer rows than the
    ``n_ids`` ids of ``tokenizer`` (what the message calls it)."""
    for name, n in rows.items():
        if n < n_ids:
            raise PipelineError(where, f"{name} has {n} rows, but {tokenizer} has token ids up to {n_ids - 1}: "
                                f"ids {n}..{n_ids - 1} have no row", fix)


def describe(rows: int, n_ids: int) -> str:
    """The card's statement of the vocabulary: the model's rows, the tokenizer's ids, the padding."""
    text = f"{rows} rows, tokenizer {n_ids} ids"
    pad = rows - n_ids
    if pad > 0:
        text += f": {pad} padding row{'s' if pad != 1 else ''} never produced by the tokenizer"
    return text
