"""What the gate's fold of a bundle did (the record :func:`.constant_fold.fold_constants` returns),
in the words the card and the report use. Apart from constant_fold so that the card and report
stages, which render it, do not import numpy for it."""

from __future__ import annotations


def describe(info: dict) -> str:
    """``info`` (``folded_ops``, ``moved_matmuls``, ``moved_convs``) as the words after "run on a
    lowering of the shipped bundle with"."""
    parts = []
    if info.get("folded_ops"):
        parts.append("its int8 dequantisation evaluated once instead of on every call")
    if n := info.get("moved_matmuls"):
        parts.append(f"its {n} matmul{'s' if n != 1 else ''} by a large constant weight run on that weight stored "
                     "transposed (the same products)")
    if n := info.get("moved_convs"):
        parts.append(f"its {n} fp16 1 x 1 convolution{'s' if n != 1 else ''} by a large constant weight run as fp32 "
                     "matmuls on that weight widened and stored transposed, rounded once to fp16 (the runtime sums "
                     "such a convolution in fp32)")
    return " and ".join(parts)
