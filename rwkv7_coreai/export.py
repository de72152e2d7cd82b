"""The export stage: normalised weights + recipe -> ``<dir>.aimodel`` (function ``main``).

Output directory ``results/<model>/export/<recipe>/`` holds ``<dir>.aimodel/`` and
``export.json`` (recipe, quantisation plan, sizes, toolchain). A second entry point (a
chunked ``prefill``) is staged on the same converter with ``entrypoint_name="prefill"``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from . import quantize, stage, toolchain
from .checkpoint import load_checkpoint
from .errors import PipelineError, main_guard
from .export_graph import INPUT_NAMES, OUTPUT_NAMES, STATE_NAMES, build_decode
from .fsutil import atomic_path, dumps_json, tree_manifest
from .paths import bundle_name
from .records import EXPORT

DTYPES = {"float32": torch.float32, "float16": torch.float16}
# fixed creation date in metadata.json: a rebuild with identical inputs should not differ by "now"
REPRODUCIBLE_EPOCH = 0.0


def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)


WRITE_OPS = {"copy_", "index_put_", "fill_", "zero_", "add_", "mul_"}
VIEW_OPS = {"select", "slice", "view", "reshape", "unsqueeze", "squeeze", "narrow", "as_strided", "expand",
            "permute", "transpose", "t", "alias"}


def state_writes(ep) -> dict[str, int]:
    """How many in-place writes each state buffer receives per call, read off the exported graph
    (before functionalisation merges them). The device GPU delegate keeps only one of several
    writes to a state in a step, so anything but exactly 1 is a broken bundle."""
    placeholder_to_buffer = dict(ep.graph_signature.inputs_to_buffers)
    counts = {name: 0 for name in STATE_NAMES}
    for node in ep.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "_opname", None) not in WRITE_OPS:
            continue
        base = node.args[0]
        while getattr(base, "op", None) == "call_function" and getattr(base.target, "_opname", None) in VIEW_OPS:
            base = base.args[0]
        buffer = placeholder_to_buffer.get(getattr(base, "name", None))
        if buffer in counts:
            counts[buffer] += 1
    return counts


def convert(module: torch.nn.Module, out: Path) -> dict[str, int]:
    """torch.export + coreai-torch conversion of the decode module into ``out`` (.aimodel).
    Returns the number of writes per state (see :func:`state_writes`)."""
    import coreai_torch
    from coreai.authoring.asset import AIModelAsset

    from . import reproducible

    ep = torch.export.export(module, example_inputs())
    writes = state_writes(ep)
    ep = ep.run_decompositions(coreai_torch.get_decomp_table())
    with reproducible.export_scope(seed=out.name):  # byte-identical bundles for identical inputs
        converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
        converter.add_exported_program(ep, input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES),
                                       state_names=list(STATE_NAMES), entrypoint_name="main")
        converter.to_coreai().save_asset(out)
    AIModelAsset.load(out).update_metadata(lambda m: setattr(m, "creation_date", REPRODUCIBLE_EPOCH))
    return writes


def export_recipe(source_dir: Path, recipe_name: str, recipe: dict, bundle: str, out_dir: Path) -> dict:
    if recipe.get("dtype") not in DTYPES:
        raise PipelineError(f"recipe {recipe_name}", f"dtype {recipe.get('dtype')!r} is not supported",
                            f"use one of {sorted(DTYPES)}")
    dtype = DTYPES[recipe["dtype"]]
    t0 = time.perf_counter()
    geom, weights = load_checkpoint(source_dir)
    module = build_decode(weights, geom, dtype)
    del weights
    layers: list[dict] = []
    q = recipe.get("quantize")
    if q:
        if dtype != torch.float16:
            raise PipelineError(f"recipe {recipe_name}", "weight quantisation is only supported on a float16 graph",
                                "set dtype: float16 for a quantised recipe")
        module, layers = quantize.apply(module, q, recipe["dtype"], example_inputs(), recipe_name)
    with atomic_path(out_dir, directory=True) as tmp:
        aimodel = tmp / f"{bundle}.aimodel"
        try:
            writes = convert(module, aimodel)
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - the converter raises many types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise PipelineError(f"export {recipe_name}", f"conversion failed ({type(exc).__name__}: {first})",
                                "check the recipe; run with the pinned toolchain (make setup)") from None
        files = tree_manifest(aimodel)
        record = {
            "recipe": recipe_name, "recipe_spec": recipe, "bundle": aimodel.name,
            "function": "main", "inputs": list(INPUT_NAMES), "outputs": list(OUTPUT_NAMES),
            "states": {"recState": [geom.layers, 1, geom.heads, geom.head_dim, geom.head_dim],
                       "shiftState": [geom.layers, 1, 2, geom.hidden]},
            "state_dtype": recipe["dtype"], "geometry": geom.as_dict(), "state_writes_per_step": writes,
            "quantized": [r for r in layers if r["action"].startswith("int")],
            "kept": [r for r in layers if not r["action"].startswith("int")],
            "size_bytes": sum(f["size"] for f in files.values()), "files": files,
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
                        bundle_name(s["models"][ns.model]["dir"], ns.recipe), Path(ns.out))
    stage.log.info("export %s/%s: %s, %.1f MB in %.1f s, peak RSS %.0f MB; quantised %d linears, kept %d",
                   ns.model, ns.recipe, rec["bundle"], rec["size_bytes"] / 1e6, time.perf_counter() - t0,
                   stage.rss_mb(), len(rec["quantized"]), len(rec["kept"]))
    for row in rec["kept"] + rec["quantized"]:
        stage.log.info("  %-40s %-5s %s", row["layer"], row["action"], row["reason"])
