"""Core AI conversion, family-independent: trace every entry point of a decode module with
torch.export, count the writes per state, stage every function on ONE coreai-torch converter and
save one byte-reproducible ``.aimodel`` (see :mod:`.reproducible`).

Memory: the conversion frees each torch weight once its Core AI constant holds it (``release``),
an int4 weight is packed once for both functions, and the glibc heap is trimmed between phases.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from recurrent_coreai.coreai.entrypoints import DECODE, ENTRY_POINTS, EntryPoint
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import require_space

# fixed creation date in metadata.json: a rebuild with identical inputs should not differ by "now"
REPRODUCIBLE_EPOCH = 0.0
QUANTIZED_WEIGHT_OP = "coreai.constexpr_blockwise_shift_scale"  # a coreai-opt quantised weight in the graph
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 1 << 20


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the heap is the allocator's business
        return None


def trim_heap() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc ``malloc_trim``), so that
    one phase's freed buffers do not stay in the resident set through the next."""
    gc.collect()
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def imports_frozen():
    """The block's full garbage collections (:func:`trim_heap`, 7-8 in an export) walk only the
    objects made inside it. What the converter's imports leave (torch, ``torch.export``,
    coreai-torch, coreai's authoring, and what ``torch.export`` imports at its first call:
    ``torch._dynamo``, sympy, networkx, ...; ~340,000 tracked objects, 0.1-0.35 s a full
    collection on this project's host) is imported first, collected once and frozen for the block
    (``gc.freeze``), then handed back to the collector (``gc.unfreeze``). Nothing the block makes
    is frozen: its garbage is collected as before. Inside another such block, or in a process that
    froze its imports itself (``gc.get_freeze_count()``), it does nothing."""
    if gc.get_freeze_count():  # frozen already: by an outer block, or by the process itself
        yield
        return
    with contextlib.suppress(ImportError):  # what is missing fails where it is used, with its own line
        import coreai_torch  # noqa: F401 - imported here for its objects to be frozen
        import torch.export  # noqa: F401
        from coreai.authoring import asset  # noqa: F401
        # what torch.export imports at its first call (sympy, networkx, torch.distributed: ~1250
        # modules, ~140,000 tracked objects, 0.1 s a collection were they not frozen)
        import torch._dynamo  # noqa: F401
        import torch._functorch.aot_autograd  # noqa: F401
        import torch.export._trace  # noqa: F401
        import torch.fx.experimental.proxy_tensor  # noqa: F401
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def map_large_allocations() -> None:
    """glibc: serve every allocation from 1 MiB up with its own mapping, so that a weight freed
    during conversion goes back to the OS at once. (By default the threshold climbs to 32 MiB
    as large buffers are freed, and freed weights then stay in the heap as holes.)"""
    if (libc := _glibc()) is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


WRITE_OPS = {"copy_", "index_put_", "fill_", "zero_", "add_", "mul_"}
VIEW_OPS = {"select", "slice", "view", "reshape", "unsqueeze", "squeeze", "narrow", "as_strided", "expand",
            "permute", "transpose", "t", "alias"}


def _opname(node) -> str | None:
    return getattr(node.target, "_opname", None) if getattr(node, "op", None) == "call_function" else None


def state_writes(ep, states: tuple[str, ...]) -> dict[str, int]:
    """How many in-place writes each state buffer receives per call, read off the exported graph
    (before functionalisation merges them). The device GPU delegate keeps only one of several
    writes to a state in a step, so anything but exactly 1 is a broken bundle. A write's target
    is followed back through views AND earlier writes: ``x.copy_(a); x.copy_(b)`` traces the
    second copy onto the first one's output, and both are writes to ``x``."""
    placeholder_to_buffer = dict(ep.graph_signature.inputs_to_buffers)
    counts = {name: 0 for name in states}
    for node in ep.graph.nodes:
        if _opname(node) not in WRITE_OPS:
            continue
        base = node.args[0]
        while _opname(base) in VIEW_OPS | WRITE_OPS:
            base = base.args[0]
        buffer = placeholder_to_buffer.get(getattr(base, "name", None))
        if buffer in counts:
            counts[buffer] += 1
    return counts


@dataclass
class Traced:
    """One entry point, exported: the decomposed program and what the trace tells about it."""
    entry: EntryPoint
    program: object
    record: dict
    states: tuple[str, ...]


def trace(entry: EntryPoint, family, decode: torch.nn.Module, chunk: int, states: tuple[str, ...]) -> Traced:
    """torch.export of one entry point (built by ``family`` over ``decode``'s parameters and states) +
    coreai-torch decompositions; records its role, writes per state per call (counted before
    the decompositions functionalise them) and the quantised weights its graph holds."""
    import coreai_torch

    ep = torch.export.export(entry.module(family, decode, chunk), entry.example_inputs(chunk))
    record = {"role": entry.role, "state_writes": state_writes(ep, states),
              "quantized_weights": sum(str(n.target).startswith(QUANTIZED_WEIGHT_OP) for n in ep.graph.nodes)}
    return Traced(entry, ep.run_decompositions(coreai_torch.get_decomp_table()), record, states)


def share_packed(state_dict: dict, before: dict, packed: dict[int, tuple]) -> None:
    """coreai-torch's ``add_exported_program`` packs every sub-byte (int4) weight of the program's
    ``state_dict`` into a new tensor, once per function: here each function's copy is replaced by
    the first function's (``packed``: id of the unpacked weight -> (it, its packed tensor)), so a
    weight is held once, in torch and in the IR, and the unpacked int8 original can be freed."""
    for target, tensor in state_dict.items():
        old = before.get(target)
        if old is None or tensor is old:
            continue
        if id(old) in packed:
            state_dict[target] = packed[id(old)][1]
        else:
            packed[id(old)] = (old, tensor)


@imports_frozen()
def save_functions(traced: list[Traced], out: Path, release: bool = False) -> dict:
    """ONE converter, one ``add_exported_program`` per function, one ``to_coreai``: a single
    ``.aimodel`` at ``out`` (weights of identical value, dtype and shape are stored once),
    byte-reproducible (seeded by the bundle's name) with a fixed creation date, its states Core AI
    states (:func:`promote_states`). With ``release``, each weight's torch storage is freed once
    converted (the traced module is left empty; see :func:`.reproducible.constants_released`).
    Returns the saved bundle's signature (:func:`.runtime.bundle_signature`)."""
    import coreai_torch
    from coreai.authoring.asset import AIModelAsset

    from recurrent_coreai.coreai import reproducible

    with reproducible.export_scope(seed=out.name):
        converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
        packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for t in traced:
            before = dict(t.program.state_dict)
            converter.add_exported_program(t.program, input_names=list(t.entry.inputs),
                                           output_names=list(t.entry.outputs), state_names=list(t.states),
                                           entrypoint_name=t.entry.name)
            share_packed(t.program.state_dict, before, packed)
        if release:
            for unpacked, _ in packed.values():
                unpacked.data = torch.empty(0, dtype=unpacked.dtype)
        del packed
        with reproducible.constants_released() if release else contextlib.nullcontext():
            program = converter.to_coreai()
        del converter
        trim_heap()
        program.save_asset(out)
        del program
        trim_heap()
        signature = promote_states(out, sorted({s for t in traced for s in t.states}))
    trim_heap()
    AIModelAsset.load(out).update_metadata(lambda m: setattr(m, "creation_date", REPRODUCIBLE_EPOCH))
    return signature


def promote_states(out: Path, states: list[str]) -> dict:
    """Where the converter left the model's ``states`` as plain arguments and results of every
    function of the saved bundle ``out`` (coreai-torch 0.4.2 marks them only with a
    ``MutableBuffers.buffer_mutation`` attribute, and leaves to the caller the pre-compilation
    rewrite 0.4.3 runs inside ``to_coreai``), run that rewrite, coreai-core's public
    ``AIProgram.optimize()``, which makes them Core AI states, and save the bundle again (inside
    the caller's :func:`.reproducible.export_scope`, as the first save); said once
    per run as a toolchain miss (export.json ``toolchain_misses``). Returns the bundle's signature
    (:func:`.runtime.bundle_signature`) as saved last. A bundle that holds its states, or a
    coreai-core without ``optimize``, is left as it is (the export's
    :func:`~recurrent_coreai.stages.export.check_states_kept` then says what is wrong)."""
    from coreai.authoring.asset import AIModelAsset

    from recurrent_coreai.coreai.reproducible.patches import miss, warn_misses
    from recurrent_coreai.coreai.runtime import bundle_signature

    signature = bundle_signature(out)
    arguments = {t["name"] for f in signature.values() for t in f["inputs"]}
    held = {t["name"] for f in signature.values() for t in f["states"]}
    if not states or held or not set(states) <= arguments:
        return signature
    program = AIModelAsset.load(out).program
    if not callable(getattr(program, "optimize", None)):
        return signature
    program.optimize()
    staged = out.with_name(f".{out.stem}.promoted{out.suffix}")
    program.save_asset(staged)
    del program
    shutil.rmtree(out)
    staged.rename(out)
    trim_heap()
    warn_misses([miss("coreai_torch:TorchConverter.to_coreai", f"left the states {', '.join(states)} as plain "
                      "arguments and results (MutableBuffers.buffer_mutation)", "convert.promote_states made them "
                      "Core AI states with coreai-core's AIProgram.optimize() (the rewrite coreai-torch 0.4.3 runs "
                      "in to_coreai)", False)])
    return bundle_signature(out)


# what the converter writes beyond the weights (graph, metadata), as a share of them and a constant
SAVE_OVERHEAD, SAVE_SLACK = 1.05, 8 << 20


def weight_bytes(traced: list[Traced]) -> int:
    """The bytes of the distinct tensors (weights, quantisation scales, constants) the programs hold."""
    seen: dict[tuple, int] = {}
    for t in traced:
        for tensor in [*t.program.state_dict.values(), *getattr(t.program, "constants", {}).values()]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                seen[(tensor.untyped_storage().data_ptr(), tensor.dtype, tuple(tensor.shape))] = \
                    tensor.numel() * tensor.element_size()
    return sum(seen.values())


def bundle_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


@imports_frozen()
def convert(family, module: torch.nn.Module, out: Path, chunk: int, states: tuple[str, ...],
            decode_only: bool = True, release: bool = False) -> dict:
    """Every entry point of ``module`` (``family``'s decode module, quantised or not; its state
    buffers ``states``) into ONE ``.aimodel``
    at ``out``. Returns ``functions``: name -> the trace's record plus the function's inputs,
    outputs and states (name, shape, dtype) as the saved bundle describes them, and
    ``tokens_per_call``; and ``size_bytes_decode_only``: the same conversion of the decode
    function alone (in a temporary directory beside ``out``), so export.json shows what the
    prefill function adds — a few graph ops if the weights are stored once. That second
    conversion runs only if ``decode_only``, else the value is None. ``release`` frees the
    module's weights as they are converted (it is empty afterwards)."""
    traced = [trace(e, family, module, chunk, states) for e in ENTRY_POINTS]
    trim_heap()
    # LLVM's output stream meets a full disk with "LLVM ERROR: IO failure" and exits the process:
    # no exception to catch, so the space is checked before the converter writes
    require_space(out.parent, int(weight_bytes(traced) * SAVE_OVERHEAD) + SAVE_SLACK, f"the bundle {out.name}")
    size_decode_only = None
    if decode_only:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".decode-only-") as tmp:
            alone = Path(tmp) / out.name
            save_functions([t for t in traced if t.entry.role == DECODE], alone)
            size_decode_only = bundle_bytes(alone)
    signature = save_functions(traced, out, release=release)
    if sorted(signature) != sorted(t.entry.name for t in traced):
        raise PipelineError(out, f"holds functions {sorted(signature)}, not the {len(traced)} staged "
                            f"({', '.join(t.entry.name for t in traced)})", "this is a bug in the converter or in "
                            "coreai/convert.py: check the toolchain pins (make setup)")
    functions = {}
    for t in traced:
        sig = signature[t.entry.name]
        functions[t.entry.name] = {**t.record, **sig, "tokens_per_call": sig["inputs"][0]["shape"][-1]}
    return {"functions": functions, "size_bytes_decode_only": size_decode_only}


def check_quantized(functions: dict, layers: list[dict], recipe_name: str) -> None:
    """Each function's graph holds exactly the planned number of quantised weights."""
    planned = sum(r["action"].startswith("int") for r in layers)
    for name, f in functions.items():
        if f["quantized_weights"] != planned:
            raise PipelineError(f"export {recipe_name}", f"function {name} holds {f['quantized_weights']} quantised "
                                f"weights, the plan has {planned}", "this is a bug: every function must be built "
                                "over the one quantised module (entrypoints.ENTRY_POINTS)")
