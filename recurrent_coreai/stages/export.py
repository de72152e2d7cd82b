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
trimmed between phases, each time after a full garbage collection that walks only what the export
made (the imports' objects are frozen meanwhile: ``convert.imports_frozen``).
``size_bytes_decode_only`` needs a second conversion of the decode function alone: above
``DECODE_ONLY_MAX_PARAMS`` parameters it is skipped and recorded as null.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from recurrent_coreai.checkpoints.reader import stream_checkpoint
from recurrent_coreai.coreai import contract, quantize, reproducible, toolchain
from recurrent_coreai.coreai.convert import check_quantized, convert, imports_frozen, map_large_allocations, trim_heap
from recurrent_coreai.coreai.entrypoints import DECODE, by_role
from recurrent_coreai.coreai.stateful import PREFILL_CHUNK  # the default; config.yaml's prefill.chunk is the setting
from recurrent_coreai.pipeline import stage
from recurrent_coreai.pipeline.paths import bundle_name
from recurrent_coreai.pipeline.records import EXPORT, read_manifest, write_sealed
from recurrent_coreai.stages.model_source import family_and_source
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.fsutil import atomic_path, tree_manifest

DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Above this many parameters the decode-only conversion behind size_bytes_decode_only (a second
# conversion: twice the time and a second copy of the weights) is skipped; it is recorded as null.
DECODE_ONLY_MAX_PARAMS = 50_000_000




def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The decode function's example inputs (what coreai-opt calibrates its observers with)."""
    return by_role(DECODE).example_inputs(1)


FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
FIT_SLICE = 1 << 20  # weights checked at a time by fitting()


def fitting(weights, dtype: torch.dtype, recipe_name: str, where: Path):
    """The weights as they come, each checked to fit ``dtype``: the source stage refuses inf and
    NaN weights, so an inf after the cast to float16 is a finite weight beyond its range (|x| >
    65504), which made the bundle's logits inf or its states NaN at the gate with no tensor named.
    Every such tensor is named, in one line, once all are read."""
    over = []
    for name, tensor in weights:
        if dtype == torch.float16 and tensor.is_floating_point():
            # in slices: isinf(...).sum() over the whole tensor makes a bool and an int64 copy of
            # it (9 bytes a weight: 3x the fp16 bundle's peak RSS at a 65536-row embedding)
            n = sum(int(torch.count_nonzero(torch.isinf(part))) for part in tensor.reshape(-1).split(FIT_SLICE))
            if n:
                over.append(f"{name} ({n} of {tensor.numel()})")
        yield name, tensor
    if over:
        shown = ", ".join(over[:4]) + (f" and {len(over) - 4} more" if len(over) > 4 else "")
        raise PipelineError(where, f"{len(over)} tensor(s) hold weights beyond float16's range (|x| > "
                            f"{FP16_MAX:g}), which recipe {recipe_name} (float16) would store as inf: {shown}",
                            "use a float32 recipe for this checkpoint, or check those weights (a diverged or "
                            "mis-converted checkpoint)")


def check_states_kept(functions: dict, states: tuple[str, ...], recipe_name: str) -> None:
    """Every function holds the model's states as Core AI states. coreai-torch 0.4.2 (with
    coreai-core 1.0.0b2) makes them plain inputs and outputs instead: a bundle the runtime sessions
    and the gate cannot run, whose record would look complete. One line, nothing written."""
    for name, fn in functions.items():
        held = {t["name"] for t in fn["states"]}
        if held != set(states):
            moved = sorted(set(states) & {t["name"] for t in fn["inputs"]} - held)
            versions = toolchain.versions()
            raise PipelineError(f"export {recipe_name}", f"coreai-torch {versions['coreai-torch']} (coreai-core "
                                f"{versions['coreai-core']}) made function {name!r} hold states {sorted(held)}, not "
                                f"{list(states)}" + (f" ({', '.join(moved)} became plain inputs and outputs)" if moved
                                                     else ""), "install a toolchain that keeps them Core AI states "
                                "(the pins: make setup); see docs/toolchain.md")


def load_module(family, source_dir: Path, dtype: torch.dtype, q: dict | None,
                recipe_name: str, geometry=None) -> tuple[torch.nn.Module, list[dict], object]:
    """The decode module read from ``source_dir`` one tensor at a time in ``dtype`` and, for a
    quantised recipe, the plan: each planned linear is quantised as soon as its weight is read
    (the decode module is quantised FIRST: every entry point is then built over it). ``geometry``:
    the one the source stage recorded (None: read from the directory's config.json). A weight
    that does not fit ``dtype`` is one line naming it (:func:`fitting`)."""
    geom, weights = stream_checkpoint(source_dir, dtype, family, geometry)
    weights = fitting(weights, dtype, recipe_name, Path(source_dir) / "model.safetensors")
    if not q:
        return family.build_decode(weights, geom, dtype), [], geom
    # a tied linear (a head tied to the embedding) is kept unless a raw include names it
    q = quantize.resolve_roles(q, family.roles, recipe_name, family.tied_linears(geom))
    layers = quantize.plan(family.decode_skeleton(geom, dtype), q, str(dtype).removeprefix("torch."))
    chosen = set(quantize.chosen(layers, q, recipe_name))
    module = family.build_decode(weights, geom, dtype,
                                 lambda name, linear: quantize.quantize_linear(linear, q) if name in chosen else linear)
    quantize.check_done(module, sorted(chosen))
    trim_heap()
    return module, layers, geom


def export_recipe(family, source_dir: Path, recipe_name: str, recipe: dict, bundle: str, out_dir: Path,
                  chunk: int = PREFILL_CHUNK, geometry=None) -> dict:
    """``<bundle>.aimodel`` and ``export.json`` of one recipe of a ``family`` model in ``out_dir``;
    ``geometry``: the source stage's (its manifest's), else read from the directory's config.json."""
    if not 1 <= chunk <= family.max_chunk:
        raise PipelineError(f"prefill.chunk {chunk}", f"is outside 1..{family.max_chunk}, what family {family.name}'s "
                            "chunked prefill allows", f"set prefill.chunk to at most {family.max_chunk}")
    if recipe.get("dtype") not in DTYPES:
        raise PipelineError(f"recipe {recipe_name}", f"dtype {recipe.get('dtype')!r} is not supported",
                            f"use one of {sorted(DTYPES)}")
    dtype = DTYPES[recipe["dtype"]]
    q = recipe.get("quantize")
    if q and dtype != torch.float16:
        raise PipelineError(f"recipe {recipe_name}", "weight quantisation is only supported on a float16 graph",
                            "set dtype: float16 for a quantised recipe")
    t0 = time.perf_counter()
    with imports_frozen():  # the collections between phases walk only what the export makes
        map_large_allocations()
        module, layers, geom = load_module(family, source_dir, dtype, q, recipe_name, geometry)
        states = tuple(s.name for s in family.state_specs(geom))
        with atomic_path(out_dir, directory=True) as tmp:
            aimodel = tmp / f"{bundle}.aimodel"
            try:
                with reproducible.collect_misses() as misses:  # patches a toolchain lacks: skipped, said below
                    converted = convert(family, module, aimodel, chunk, states, release=True,
                                        decode_only=family.parameter_count(geom) <= DECODE_ONLY_MAX_PARAMS)
            except PipelineError:
                raise
            except Exception as exc:  # noqa: BLE001 - the converter raises many types
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise PipelineError(f"export {recipe_name}", f"conversion failed ({type(exc).__name__}: {first})",
                                    "check the recipe; run with the pinned toolchain (make setup)") from None
            functions = converted["functions"]
            check_states_kept(functions, states, recipe_name)
            check_quantized(functions, layers, recipe_name)
            decode = next(f for f in functions.values() if f["role"] == DECODE)
            files = tree_manifest(aimodel)
            record = {
                "recipe": recipe_name, "recipe_spec": recipe, "bundle": aimodel.name,
                "functions": functions, "prefill_chunk": chunk,
                # every function has these names and states (their shapes per function are in `functions`)
                "inputs": [t["name"] for t in decode["inputs"]], "outputs": [t["name"] for t in decode["outputs"]],
                "states": {t["name"]: t["shape"] for t in decode["states"]},
                "state_dtype": recipe["dtype"], "geometry": geom.as_dict(),
                # ONE plan: every function is built over the same quantised module (see functions.*.quantized_weights)
                "quantization_applies_to": sorted(functions) if q else [],
                "quantized": [r for r in layers if r["action"].startswith("int")],
                "kept": [r for r in layers if not r["action"].startswith("int")],
                "size_bytes": sum(f["size"] for f in files.values()),
                # null above DECODE_ONLY_MAX_PARAMS parameters (a second conversion would be needed)
                "size_bytes_decode_only": converted["size_bytes_decode_only"], "files": files,
                "toolchain": toolchain.versions(),
                # only on a toolchain the reproducible-build patches do not fit (docs/toolchain.md)
                **contract.degraded_fields(misses),
            }
            write_sealed(tmp / EXPORT, record, "export")  # sealed: see pipeline/records.py
        record["export_seconds"] = round(time.perf_counter() - t0, 2)
        return record


@main_guard
def main(argv=None) -> int:
    """The export stage: ``scripts/export.py --model M --recipe R --source DIR --out DIR``."""
    ns = stage.parser("export", "model", "recipe", "source", "out").parse_args(argv)
    s, _ = stage.setup("export", ns)
    t0 = time.perf_counter()
    family, source = family_and_source(s, ns.model, ns.source)  # the manifest checked, and every file against it
    geom = family.geometry_from_dict(read_manifest(source, files=False)["geometry"])  # as the source stage found it
    rec = export_recipe(family, source, ns.recipe, s["recipes"][ns.recipe],
                        bundle_name(s["models"][ns.model], ns.recipe), Path(ns.out), s["prefill"]["chunk"], geom)
    alone = rec["size_bytes_decode_only"]
    stage.log.info("export %s/%s: %s, %.1f MB (%s without prefill) in %.1f s, peak RSS %.0f MB; "
                   "functions %s; quantised %d linears, kept %d", ns.model, ns.recipe, rec["bundle"], rec["size_bytes"] / 1e6,
                   "not measured" if alone is None else f"{alone / 1e6:.1f} MB", time.perf_counter() - t0,
                   stage.rss_mb(), ", ".join(f"{n} ({f['tokens_per_call']} tok/call)" for n, f in rec["functions"].items()),
                   len(rec["quantized"]), len(rec["kept"]))
    for row in rec["kept"] + rec["quantized"]:
        stage.log.info("  %-40s %-5s %s", row["layer"], row["action"], row["reason"])
