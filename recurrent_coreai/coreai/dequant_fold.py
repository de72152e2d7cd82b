"""A lowering of a quantised bundle with its dequantisation evaluated once, for the gate.

The Linux runtime runs every ``coreai.blockwise_shift_scale`` of a quantised bundle on every call:
it dequantises each int8 weight into a fresh fp16 tensor through software half-float conversion,
~30 ns per weight per call, ~75% of an int8 decode call (docs/measurements/2026-12-02-int8-call-profile.md).
No runtime or compiler option keeps the result between calls (that document lists what was tried).

:func:`fold_dequantisation` reads the shipped ``.aimodel``'s ``main.mlirb`` and replaces each
``blockwise_shift_scale`` whose operands are constants by the fp16 constant it computes
(:func:`dequantise`: ``scale * (q - offset1) + offset2`` per block in fp32, rounded once to fp16 --
with coreai-opt's zero offsets an exact product rounded once, the value any correct kernel gives;
the decode and prefill functions' copies of a weight share one array). Everything else is the
pipeline's universal lowering: the same ``compile_to_binary`` and ``serialize_module_to_odix`` that
``AIModelAsset._write_odix`` calls, inside :func:`.reproducible.lowering_scope`. The result is a
scratch lowering the gate runs, never the aot stage's product and never published; the gate
trusts it only after logits and states agree bit for bit with the pipeline's lowering
(stages/gate.py ``gate_lowering``).

Like :func:`.runtime.lower_universal` this uses coreai-core's compiler bindings, which are private
(``coreai._compiler``): no public API reads or rewrites a bundle's program. One module to change
on a coreai-core upgrade.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import require_space

OP = "coreai.blockwise_shift_scale"
NP_TYPES = {"f16": np.float16, "f32": np.float32, "si8": np.int8, "ui8": np.uint8}
FOLDED_RATIO = 1.5  # room the folded lowering needs over its .aimodel: int8 weights become fp16 (0.1B/0.4B: 1.33x, 1.37x)


def dequantise(q: np.ndarray, scale: np.ndarray, off1: np.ndarray, off2: np.ndarray) -> np.ndarray:
    """``coreai.blockwise_shift_scale``: ``scale * (q - off1) + off2`` per block, in fp32, rounded
    once to fp16. ``scale``/``off1``/``off2`` have one entry per block along each axis of ``q``."""
    if q.ndim != scale.ndim or any(a % b for a, b in zip(q.shape, scale.shape)):
        raise ValueError(f"scale {scale.shape} does not tile the weight {q.shape} in whole blocks")
    blocks = [a // b for a, b in zip(q.shape, scale.shape)]
    split = [d for s, n in zip(scale.shape, blocks) for d in (s, n)]  # each axis as (blocks, block)
    per_block = [d for s in scale.shape for d in (s, 1)]

    def widen(x):
        return np.broadcast_to(x, scale.shape).astype(np.float32).reshape(per_block)
    out = widen(scale) * (q.astype(np.float32).reshape(split) - widen(off1)) + widen(off2)
    return out.astype(np.float16).reshape(q.shape)


def _constant(value, copy_constant_value_to_array) -> np.ndarray:
    """A constant operand's value, read as coreai-opt reads one (``_get_constant_value_as_np_array``)."""
    owner = value.owner
    if owner.name != "coreai.constant":
        raise ValueError(f"a {OP} operand is {owner.name}, not a constant")
    dtype = NP_TYPES.get(str(value.type.element_type))
    if dtype is None:
        raise ValueError(f"a {OP} operand has element type {value.type.element_type}")
    shape = tuple(value.type.shape)
    buf = np.zeros(int(np.prod(shape)) * np.dtype(dtype).itemsize, np.uint8)
    copy_constant_value_to_array(constant_op=owner, destination=buf)
    return buf.view(dtype).reshape(shape)


def fold_dequantisation(aimodel: Path, out_dir: Path) -> dict:
    """Lower ``aimodel`` into ``out_dir`` (an existing, empty ``*.aimodelx`` directory) with every
    dequantisation of constants folded. Returns what was folded: ``folded_ops``,
    ``distinct_weights``, ``folded_weights`` (int8 values). A bundle with nothing to fold raises
    ``ValueError`` (the gate then runs the pipeline's lowering)."""
    from coreai.authoring.asset import Context  # first: coreai.authoring's imports are order-sensitive
    from coreai._compiler.dialects import coreai as cai
    from coreai._compiler.ir import DenseResourceElementsAttr, InsertionPoint, WalkResult

    from recurrent_coreai.coreai import reproducible

    asset = importlib.import_module(reproducible.ASSET)  # the lowering's own entry points, as _write_odix calls them
    from coreai._compiler._mlir_libs._coreaiIR._bindings.compiler import copy_constant_value_to_array

    src = Path(aimodel) / "main.mlirb"
    if not src.is_file():
        raise PipelineError(aimodel, "has no main.mlirb", "re-run the export stage")
    require_space(out_dir, int(src.stat().st_size * FOLDED_RATIO) + (8 << 20), f"the folded lowering of {Path(aimodel).name}")
    module = asset.load_module_from_bytecode(context=Context()._mlir_context, path=src)  # noqa: SLF001 - as _write_odix
    ops = []

    def collect(op):
        if op.name == OP:
            ops.append(op)
        return WalkResult.ADVANCE
    module.operation.walk(collect)
    if not ops:
        raise ValueError(f"{Path(aimodel).name} has no {OP}: nothing to fold")

    values, operands, weights = {}, [], 0
    with module.context:
        for op in ops:
            key = tuple(str(v.owner.attributes["value"]) for v in op.operands)  # resource names: the same weight
            if key not in values:
                q, scale, off1, off2 = (_constant(v, copy_constant_value_to_array) for v in op.operands)
                values[key] = DenseResourceElementsAttr.get_from_buffer(
                    dequantise(q, scale, off1, off2), f"dequantised_{len(values)}", op.results[0].type)
                weights += q.size
                del q, scale, off1, off2
            with InsertionPoint(op), op.location:
                folded = cai.ConstantOp(value=values[key])
            operands.extend(v.owner for v in op.operands if not any(v.owner == o for o in operands))
            op.results[0].replace_all_uses_with(folded.result)
            op.erase()
        for const in operands:  # the int8 weights and their scales (each once): gone once nothing uses them
            if not list(const.results[0].uses):
                const.erase()
    with reproducible.lowering_scope():
        asset.compile_to_binary(module=module, output_directory=out_dir, enable_debug_info=False)
        asset.serialize_module_to_odix(module=module, path=out_dir / "main-universal.odix")
    return {"folded_ops": len(ops), "distinct_weights": len(values), "folded_weights": int(weights)}
