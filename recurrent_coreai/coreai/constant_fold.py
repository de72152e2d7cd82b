"""A lowering of a bundle with the work the Linux runtime repeats on constant weights done once, for the gate.

The Linux runtime is a reference implementation: it evaluates every op on every call, and its
kernels are sensitive to layout. Two costs dominate the gate's calls, and both are paid on the
constant weights:

* ``coreai.blockwise_shift_scale`` of a quantised bundle: it dequantises each int8 weight into a
  fresh fp16 tensor through software half-float conversion, ~30 ns per weight per call, ~75% of an
  int8 decode call (docs/measurements/2026-12-02-int8-call-profile.md);
* ``coreai.decomposable.broadcasting_batch_matmul`` of a constant ``C`` [M, K] by an activation
  ``y`` [K, N] (how an fp32 bundle holds every linear layer): the runtime's kernel for ``C @ y``
  takes 29-32 ms at M = 65536, K = 128 (a World-vocabulary head), where the same products as
  ``yᵀ @ Cᵀ`` with ``Cᵀ`` stored take 4.4-8.5 ms (docs/measurements/2026-12-06-runtime-linear.md).

No runtime or compiler option keeps a dequantised weight between calls (the int8 document lists
what was tried), and the compiler's canonicalize and sccp passes change neither form.

:func:`fold_constants` reads the shipped ``.aimodel``'s ``main.mlirb`` and

1. replaces each ``blockwise_shift_scale`` whose operands are constants by the fp16 constant it
   computes (:func:`dequantise`: ``scale * (q - offset1) + offset2`` per block in fp32, rounded
   once to fp16 -- with coreai-opt's zero offsets an exact product rounded once, the value any
   correct kernel gives; the decode and prefill functions' copies of a weight share one array);
2. rewrites each ``C @ y`` whose ``C`` is a constant of at least :data:`MATMUL_MIN` values as
   ``(yᵀ @ Cᵀ)ᵀ`` with ``Cᵀ`` a constant (the same values, moved once): the same products, each
   output the same dot product of the same K terms -- where those weights total at most
   :data:`MATMUL_MAX_BYTES` (a World-vocabulary tiny model's head: 32 MB; an fp32 1.5B model's
   linears, ~6 GB, are left as they are: the gate's sizing has no room for the copy).

3. rewrites each fp16 ``coreai.conv2d`` (how an fp16 bundle holds a linear: a 1 x 1
   convolution, which this runtime sums in fp32) of a constant weight ``W`` [M, K, 1, 1] of at
   least :data:`MATMUL_MIN` values as the fp32 matmul ``x32 @ W32ᵀ`` rounded once to fp16, with
   ``W32ᵀ`` (the weight widened, exactly, and stored transposed) a constant: the runtime's 1 x 1
   convolution of a 65536-row head takes 42-59 ms, this form 4.9 ms, and over 30 inputs x 65536
   outputs the two gave the same bits (numpy's fp32 sum differs in 2242 of them:
   docs/measurements/2026-12-07-fp16-head-fold.md). Only where those weights total at most
   :data:`CONV_MAX_BYTES` (a World-vocabulary tiny model's head, 32 MB; at 0.1B the head alone is
   200 MB, which the gate's memory sizing has not been measured with, so larger models keep
   their convolutions).

None is trusted by construction: the gate runs the result only after its logits and states
agree bit for bit with the aot stage's lowering (stages/gate_lowering.py). (An fp16 linear
rewritten as an fp16 matmul was 6x slower in this runtime and not bit-identical.) Everything else is the
pipeline's universal lowering: the same ``compile_to_binary`` (or, where coreai-core has none, the
passes its own ``executable()`` runs) and ``serialize_module_to_odix`` that ``AIModelAsset._write_odix``
calls (:mod:`.lowering`), inside :func:`.reproducible.lowering_scope`. The result is a
scratch lowering the gate runs, never the aot stage's product and never published.

Like :func:`.runtime.lower_universal` this uses coreai-core's compiler bindings, which are private
(``coreai._compiler``): no public API reads or rewrites a bundle's program. One module to change
on a coreai-core upgrade.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import require_space

OP = "coreai.blockwise_shift_scale"
MATMUL = "coreai.decomposable.broadcasting_batch_matmul"
CONV = "coreai.conv2d"
NP_TYPES = {"f16": np.float16, "f32": np.float32, "si8": np.int8, "ui8": np.uint8, "si32": np.int32, "ui32": np.uint32}
# a smaller constant's matmul costs the runtime little a call (128 x 512: ~0.1 ms); a 65536-row
# head is far above it
MATMUL_MIN = 1 << 20
# the matmuls' weights moved at most (bytes, distinct weights): above it they are left as they are.
# The fold holds a moved copy beside the program, and resources.py sizes an fp32 gate shard at 1.5x
# its weights with no room for it (measured only for the quantised fold: 2.9x at 1.5B)
MATMUL_MAX_BYTES = 1 << 30
# the fp32 copies of the fp16 convolutions' weights made at most (bytes): measured at the tiny
# shapes only (rwkv7-tiny fp16: a 32 MB copy, the gate shard's peak RSS within its sizing)
CONV_MAX_BYTES = 64 << 20


class NothingToFold(ValueError):
    """The bundle has no dequantisation and no large constant matmul: the aot stage's lowering is
    the one to run."""


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


def _constant(value, copy_constant_value_to_array, op: str = OP) -> np.ndarray:
    """A constant operand's value, read as coreai-opt reads one (``_get_constant_value_as_np_array``)."""
    owner = value.owner
    if owner.name != "coreai.constant":
        raise ValueError(f"a {op} operand is {owner.name}, not a constant")
    dtype = NP_TYPES.get(str(value.type.element_type))
    if dtype is None:
        raise ValueError(f"a {op} operand has element type {value.type.element_type}")
    shape = tuple(value.type.shape)
    buf = np.zeros(int(np.prod(shape)) * np.dtype(dtype).itemsize, np.uint8)
    copy_constant_value_to_array(constant_op=owner, destination=buf)
    return buf.view(dtype).reshape(shape)


def _is_constant(value) -> bool:
    return getattr(value.owner, "name", None) == "coreai.constant"


def _matmul_by_constant(op, matmul_min: int) -> bool:
    """``C @ y``: C a rank-2 constant of at least ``matmul_min`` values, y a rank-2 activation."""
    c, y = op.operands
    return (_is_constant(c) and not _is_constant(y) and len(c.type.shape) == 2 and len(y.type.shape) == 2
            and int(np.prod(c.type.shape)) >= matmul_min)


def _reshaped_constant(value):
    """The constant ``value`` holds, read through one ``coreai.reshape`` (how a quantised bundle
    feeds a dequantised [M, K] weight to a convolution as [M, K, 1, 1]: the same values in the
    same order); else None."""
    if _is_constant(value):
        return value
    owner = value.owner
    if getattr(owner, "name", None) == "coreai.reshape" and _is_constant(owner.operands[0]):
        return owner.operands[0]
    return None


def _conv_by_constant(op, matmul_min: int, copy_constant_value_to_array) -> bool:
    """An fp16 linear as a 1 x 1 convolution: input [1, K, 1, N] fp16, a constant weight
    [M, K, 1, 1] (or a constant reshaped to it) of at least ``matmul_min`` values, stride and
    dilation 1, one group."""
    x, w, stride, dilation, groups = op.operands
    if not (_reshaped_constant(w) is not None and all(map(_is_constant, (stride, dilation, groups)))
            and not _is_constant(x)):
        return False
    xs, ws = list(x.type.shape), list(w.type.shape)
    if not (len(xs) == 4 and len(ws) == 4 and xs[0] == 1 and xs[2] == 1 and ws[2:] == [1, 1] and xs[1] == ws[1]
            and str(x.type.element_type) == "f16" and str(w.type.element_type) == "f16"
            and ws[0] * ws[1] >= matmul_min):
        return False
    read = lambda v: _constant(v, copy_constant_value_to_array, CONV).reshape(-1).tolist()  # noqa: E731
    return read(stride) == [1, 1] and read(dilation) == [1, 1] and read(groups) == [1]


def fold_constants(aimodel: Path, out_dir: Path, matmul_min: int = MATMUL_MIN) -> dict:
    """Lower ``aimodel`` into ``out_dir`` (an existing, empty ``*.aimodelx`` directory) with every
    dequantisation of constants folded, every matmul of a constant of at least ``matmul_min``
    values on the constant stored transposed, and every fp16 1 x 1 convolution of such a
    constant as an fp32 matmul on it widened and stored transposed (module docstring). Returns
    what was done: ``folded_ops``, ``distinct_weights``, ``folded_weights`` (int8 values
    dequantised), ``moved_matmuls``, ``moved_convs``, ``moved_weights`` (values of the distinct
    weights stored transposed). A bundle with none of these raises :class:`NothingToFold`."""
    from recurrent_coreai.coreai import lowering, reproducible

    lowering.asset_module()  # first: coreai.authoring's imports are order-sensitive
    from coreai._compiler.dialects import coreai as cai
    from coreai._compiler.ir import (DenseElementsAttr, DenseResourceElementsAttr, F32Type, InsertionPoint,
                                     IntegerType, RankedTensorType, WalkResult)
    from coreai._compiler._mlir_libs._coreaiIR._bindings.compiler import copy_constant_value_to_array

    src = Path(aimodel) / "main.mlirb"
    if not src.is_file():
        raise PipelineError(aimodel, "has no main.mlirb", "re-run the export stage")
    require_space(out_dir, int(src.stat().st_size * FOLDED_RATIO) + (8 << 20), f"the folded lowering of {Path(aimodel).name}")
    module = lowering.load_program(aimodel)  # the aot stage's lowering reads it the same way

    def ops_named(name: str) -> list:
        found = []

        def collect(op):
            if op.name == name:
                found.append(op)
            return WalkResult.ADVANCE
        module.operation.walk(collect)
        return found

    replaced: list = []  # the constant operands of the ops replaced, each once

    def replace(op, result) -> None:
        """``op``'s uses now read ``result``; ``op`` is gone, its constant operands noted."""
        replaced.extend(v.owner for v in op.operands
                        if _is_constant(v) and not any(v.owner == o for o in replaced))
        if result is not None:  # None: an op nothing uses any more
            op.results[0].replace_all_uses_with(result)
        op.erase()

    ops = ops_named(OP)
    values, weights = {}, 0
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
            replace(op, folded.result)

        matmuls = [op for op in ops_named(MATMUL) if _matmul_by_constant(op, matmul_min)]
        sizes = {str(op.operands[0].owner.attributes["value"]): int(np.prod(op.operands[0].type.shape))
                 * np.dtype(NP_TYPES.get(str(op.operands[0].type.element_type), np.float32)).itemsize for op in matmuls}
        if sum(sizes.values()) > MATMUL_MAX_BYTES:
            matmuls = []
        moved, ui32 = {}, IntegerType.get_unsigned(32)

        def const(values: list[int]):
            """A ui32 vector constant (a permutation, a shape)."""
            return cai.ConstantOp(value=DenseElementsAttr.get(np.array(values, np.uint32), type=RankedTensorType.get(
                [len(values)], ui32))).result

        def transposed(key: str, make, element_type):
            """The weight ``key`` stored transposed (``make()``: its [K, M] values), made once per weight."""
            if key not in moved:
                values = np.ascontiguousarray(make())
                moved[key] = DenseResourceElementsAttr.get_from_buffer(values, f"transposed_{len(moved)}",
                                                                       RankedTensorType.get(list(values.shape), element_type))
            return moved[key]
        for op in matmuls:
            c, y = op.operands
            (m, k), n = c.type.shape, y.type.shape[1]
            key = str(c.owner.attributes["value"])
            with InsertionPoint(op), op.location:
                c_t_value = transposed(key, lambda: _constant(c, copy_constant_value_to_array, MATMUL).T,
                                       c.type.element_type)
                swap = const([1, 0])
                c_t = cai.ConstantOp(value=c_t_value).result
                y_t = cai.TransposeOp(y, swap, results=[RankedTensorType.get([n, k], y.type.element_type)]).result
                out_t = cai.BroadcastingBatchMatmul(y_t, c_t, results=[RankedTensorType.get(
                    [n, m], op.results[0].type.element_type)]).result
                out = cai.TransposeOp(out_t, swap, results=[op.results[0].type]).result
            replace(op, out)

        convs = [op for op in ops_named(CONV) if _conv_by_constant(op, matmul_min, copy_constant_value_to_array)]
        widened = {str(_reshaped_constant(op.operands[1]).owner.attributes["value"]):
                   4 * int(np.prod(op.operands[1].type.shape)) for op in convs}
        if sum(widened.values()) > CONV_MAX_BYTES:
            convs = []
        f32 = F32Type.get()
        for op in convs:
            x, w = op.operands[0], _reshaped_constant(op.operands[1])
            (m, k), n = op.operands[1].type.shape[:2], x.type.shape[3]
            key = str(w.owner.attributes["value"])
            with InsertionPoint(op), op.location:
                w_t_value = transposed(key, lambda: _constant(w, copy_constant_value_to_array, CONV).reshape(m, k)
                                       .astype(np.float32).T, f32)
                swap = const([1, 0])
                x_kn = cai.ReshapeOp(x, const([k, n]), results=[RankedTensorType.get([k, n], x.type.element_type)]).result
                x_nk = cai.TransposeOp(x_kn, swap, results=[RankedTensorType.get([n, k], x.type.element_type)]).result
                wide = cai.CastOp(RankedTensorType.get([n, k], f32), x_nk).result
                out32 = cai.BroadcastingBatchMatmul(wide, cai.ConstantOp(value=w_t_value).result,
                                                   results=[RankedTensorType.get([n, m], f32)]).result
                out16 = cai.CastOp(RankedTensorType.get([n, m], x.type.element_type), out32).result
                out_mn = cai.TransposeOp(out16, swap, results=[RankedTensorType.get([m, n], x.type.element_type)]).result
                out = cai.ReshapeOp(out_mn, const([1, m, 1, n]), results=[op.results[0].type]).result
            reshaped = None if _is_constant(op.operands[1]) else op.operands[1].owner
            replace(op, out)
            if reshaped is not None and not list(reshaped.results[0].uses):  # the weight's reshape, unused now
                replace(reshaped, None)
        for weight in replaced:  # the weights replaced: gone once nothing uses them
            if not list(weight.results[0].uses):
                weight.erase()
    if not ops and not matmuls and not convs:
        raise NothingToFold(f"{Path(aimodel).name} has no {OP}, no {MATMUL} and no fp16 {CONV} of a constant of "
                            f"at least {matmul_min} values: nothing to fold")
    with reproducible.lowering_scope():
        lowering.compile_module(module, out_dir)
        lowering.write_odix(module, out_dir)
    return {"folded_ops": len(ops), "distinct_weights": len(values), "folded_weights": int(weights),
            "moved_matmuls": len(matmuls), "moved_convs": len(convs),
            "moved_weights": int(sum(int(np.prod(v.type.shape)) for v in moved.values()))}
