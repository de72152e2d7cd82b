"""The export stage: normalised weights + recipe -> ``<dir>.aimodel`` holding every entry point.

Output directory ``results/<model>/export/<recipe>/`` holds ``<dir>.aimodel/`` and
``export.json``. The functions are the rows of :data:`.entrypoints.ENTRY_POINTS` (decode and
chunked prefill), each traced from the SAME (quantised) module — so they quantise the same
layers and the converter stores every weight once — and staged on ONE converter. ``export.json``
records each function (role, inputs and outputs with shapes, states, writes per state per call,
quantised weights), the prefill chunk, the quantisation plan (one plan: it applies to every
function), the bundle size with and without the prefill function, and the toolchain.

Memory: the weights are read one tensor at a time straight into the recipe's dtype onto a
module built on the meta device, a quantised recipe quantises each linear as soon as it is read,
and the conversion frees each torch weight once its Core AI constant holds it; the glibc heap is
trimmed between phases. ``size_bytes_decode_only`` needs a second conversion of the decode
function alone: above ``DECODE_ONLY_MAX_PARAMS`` parameters it is skipped and recorded as null.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from recurrent_coreai.coreai import quantize
from recurrent_coreai.pipeline import stage
from recurrent_coreai.coreai import toolchain
from recurrent_coreai.families.rwkv7.checkpoint import stream_checkpoint
from recurrent_coreai.coreai.entrypoints import DECODE, ENTRY_POINTS, STATE_NAMES, EntryPoint, by_role
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.families.rwkv7.export_graph import PREFILL_CHUNK, RWKV7Decode, build_decode
from recurrent_coreai.util.fsutil import atomic_path, dumps_json, tree_manifest
from recurrent_coreai.families.rwkv7.geometry import expected_shapes
from recurrent_coreai.pipeline.paths import bundle_name
from recurrent_coreai.pipeline.records import EXPORT

DTYPES = {"float32": torch.float32, "float16": torch.float16}
# fixed creation date in metadata.json: a rebuild with identical inputs should not differ by "now"
REPRODUCIBLE_EPOCH = 0.0
QUANTIZED_WEIGHT_OP = "coreai.constexpr_blockwise_shift_scale"  # a coreai-opt quantised weight in the graph
# Above this many parameters the decode-only conversion behind size_bytes_decode_only (a second
# conversion: twice the time and a second copy of the weights) is skipped; it is recorded as null.
DECODE_ONLY_MAX_PARAMS = 50_000_000


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


def map_large_allocations() -> None:
    """glibc: serve every allocation from 1 MiB up with its own mapping, so that a weight freed
    during conversion goes back to the OS at once. (By default the threshold climbs to 32 MiB
    as large buffers are freed, and freed weights then stay in the heap as holes.)"""
    if (libc := _glibc()) is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The decode function's example inputs (what coreai-opt calibrates its observers with)."""
    return by_role(DECODE).example_inputs(1)


WRITE_OPS = {"copy_", "index_put_", "fill_", "zero_", "add_", "mul_"}
VIEW_OPS = {"select", "slice", "view", "reshape", "unsqueeze", "squeeze", "narrow", "as_strided", "expand",
            "permute", "transpose", "t", "alias"}


def _opname(node) -> str | None:
    return getattr(node.target, "_opname", None) if getattr(node, "op", None) == "call_function" else None


def state_writes(ep, states: tuple[str, ...] = STATE_NAMES) -> dict[str, int]:
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


def trace(entry: EntryPoint, decode: torch.nn.Module, chunk: int) -> Traced:
    """torch.export of one entry point (built over ``decode``'s parameters and states) +
    coreai-torch decompositions; records its role, writes per state per call (counted before
    the decompositions functionalise them) and the quantised weights its graph holds."""
    import coreai_torch

    ep = torch.export.export(entry.build(decode, chunk), entry.example_inputs(chunk))
    record = {"role": entry.role, "state_writes": state_writes(ep, entry.states),
              "quantized_weights": sum(str(n.target).startswith(QUANTIZED_WEIGHT_OP) for n in ep.graph.nodes)}
    return Traced(entry, ep.run_decompositions(coreai_torch.get_decomp_table()), record)


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


def save_functions(traced: list[Traced], out: Path, release: bool = False) -> None:
    """ONE converter, one ``add_exported_program`` per function, one ``to_coreai``: a single
    ``.aimodel`` at ``out`` (weights of identical value, dtype and shape are stored once),
    byte-reproducible (seeded by the bundle's name) with a fixed creation date. With
    ``release``, each weight's torch storage is freed once converted (the traced module is
    left empty; see :func:`.reproducible.constants_released`)."""
    import coreai_torch
    from coreai.authoring.asset import AIModelAsset

    from recurrent_coreai.coreai import reproducible

    with reproducible.export_scope(seed=out.name):
        converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
        packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for t in traced:
            before = dict(t.program.state_dict)
            converter.add_exported_program(t.program, input_names=list(t.entry.inputs),
                                           output_names=list(t.entry.outputs), state_names=list(t.entry.states),
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
    AIModelAsset.load(out).update_metadata(lambda m: setattr(m, "creation_date", REPRODUCIBLE_EPOCH))


def bundle_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def parameter_count(module: RWKV7Decode) -> int:
    """The model's weights, from its geometry (a quantised module's parameters hide some)."""
    return sum(math.prod(shape) for shape in expected_shapes(module.g).values())


def convert(module: torch.nn.Module, out: Path, chunk: int = PREFILL_CHUNK, decode_only: bool = True,
            release: bool = False) -> dict:
    """Every entry point of ``module`` (the decode module, quantised or not) into ONE ``.aimodel``
    at ``out``. Returns ``functions``: name -> the trace's record plus the function's inputs,
    outputs and states (name, shape, dtype) as the saved bundle describes them, and
    ``tokens_per_call``; and ``size_bytes_decode_only``: the same conversion of the decode
    function alone (in a temporary directory beside ``out``), so export.json shows what the
    prefill function adds — a few graph ops if the weights are stored once. That second
    conversion runs only if ``decode_only``, else the value is None. ``release`` frees the
    module's weights as they are converted (it is empty afterwards)."""
    from recurrent_coreai.coreai.runtime import bundle_signature

    traced = [trace(e, module, chunk) for e in ENTRY_POINTS]
    trim_heap()
    size_decode_only = None
    if decode_only:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".decode-only-") as tmp:
            alone = Path(tmp) / out.name
            save_functions([t for t in traced if t.entry.role == DECODE], alone)
            size_decode_only = bundle_bytes(alone)
    save_functions(traced, out, release=release)
    signature = bundle_signature(out)
    if sorted(signature) != sorted(t.entry.name for t in traced):
        raise PipelineError(out, f"holds functions {sorted(signature)}, not the {len(traced)} staged "
                            f"({', '.join(t.entry.name for t in traced)})", "this is a bug in the converter or in "
                            "export.py: check the toolchain pins (make setup)")
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


def load_module(source_dir: Path, dtype: torch.dtype, q: dict | None, recipe_name: str) -> tuple[RWKV7Decode, list[dict]]:
    """The decode module read from ``source_dir`` one tensor at a time in ``dtype`` and, for a
    quantised recipe, the plan: each planned linear is quantised as soon as its weight is read
    (the decode module is quantised FIRST: every entry point is then built over it)."""
    geom, weights = stream_checkpoint(source_dir, dtype)
    if not q:
        return build_decode(weights, geom, dtype), []
    with torch.device("meta"):
        layers = quantize.plan(RWKV7Decode(geom, dtype), q, str(dtype).removeprefix("torch."))
    chosen = set(quantize.chosen(layers, q, recipe_name))
    module = build_decode(weights, geom, dtype,
                          lambda name, linear: quantize.quantize_linear(linear, q) if name in chosen else linear)
    quantize.check_done(module, sorted(chosen))
    trim_heap()
    return module, layers


def export_recipe(source_dir: Path, recipe_name: str, recipe: dict, bundle: str, out_dir: Path,
                  chunk: int = PREFILL_CHUNK) -> dict:
    if recipe.get("dtype") not in DTYPES:
        raise PipelineError(f"recipe {recipe_name}", f"dtype {recipe.get('dtype')!r} is not supported",
                            f"use one of {sorted(DTYPES)}")
    dtype = DTYPES[recipe["dtype"]]
    q = recipe.get("quantize")
    if q and dtype != torch.float16:
        raise PipelineError(f"recipe {recipe_name}", "weight quantisation is only supported on a float16 graph",
                            "set dtype: float16 for a quantised recipe")
    t0 = time.perf_counter()
    map_large_allocations()
    module, layers = load_module(source_dir, dtype, q, recipe_name)
    with atomic_path(out_dir, directory=True) as tmp:
        aimodel = tmp / f"{bundle}.aimodel"
        try:
            converted = convert(module, aimodel, chunk, release=True,
                                decode_only=parameter_count(module) <= DECODE_ONLY_MAX_PARAMS)
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - the converter raises many types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise PipelineError(f"export {recipe_name}", f"conversion failed ({type(exc).__name__}: {first})",
                                "check the recipe; run with the pinned toolchain (make setup)") from None
        functions = converted["functions"]
        check_quantized(functions, layers, recipe_name)
        decode = next(f for f in functions.values() if f["role"] == DECODE)
        files = tree_manifest(aimodel)
        record = {
            "recipe": recipe_name, "recipe_spec": recipe, "bundle": aimodel.name,
            "functions": functions, "prefill_chunk": chunk,
            # every function has these names and states (their shapes per function are in `functions`)
            "inputs": [t["name"] for t in decode["inputs"]], "outputs": [t["name"] for t in decode["outputs"]],
            "states": {t["name"]: t["shape"] for t in decode["states"]},
            "state_dtype": recipe["dtype"], "geometry": module.g.as_dict(),
            # ONE plan: every function is built over the same quantised module (see functions.*.quantized_weights)
            "quantization_applies_to": sorted(functions) if q else [],
            "quantized": [r for r in layers if r["action"].startswith("int")],
            "kept": [r for r in layers if not r["action"].startswith("int")],
            "size_bytes": sum(f["size"] for f in files.values()),
            # null above DECODE_ONLY_MAX_PARAMS parameters (a second conversion would be needed)
            "size_bytes_decode_only": converted["size_bytes_decode_only"], "files": files,
            "toolchain": toolchain.versions(),
        }
        (tmp / EXPORT).write_text(dumps_json(record))
    record["export_seconds"] = round(time.perf_counter() - t0, 2)
    return record


@main_guard
def main(argv=None) -> int:
    """The export stage: ``scripts/export.py --model M --recipe R --source DIR --out DIR``."""
    ns = stage.parser("export", "model", "recipe", "source", "out").parse_args(argv)
    s, _ = stage.setup("export", ns)
    t0 = time.perf_counter()
    rec = export_recipe(Path(ns.source), ns.recipe, s["recipes"][ns.recipe],
                        bundle_name(s["models"][ns.model], ns.recipe), Path(ns.out), s["prefill"]["chunk"])
    alone = rec["size_bytes_decode_only"]
    stage.log.info("export %s/%s: %s, %.1f MB (%s without prefill) in %.1f s, peak RSS %.0f MB; "
                   "functions %s; quantised %d linears, kept %d", ns.model, ns.recipe, rec["bundle"], rec["size_bytes"] / 1e6,
                   "not measured" if alone is None else f"{alone / 1e6:.1f} MB", time.perf_counter() - t0,
                   stage.rss_mb(), ", ".join(f"{n} ({f['tokens_per_call']} tok/call)" for n, f in rec["functions"].items()),
                   len(rec["quantized"]), len(rec["kept"]))
    for row in rec["kept"] + rec["quantized"]:
        stage.log.info("  %-40s %-5s %s", row["layer"], row["action"], row["reason"])
