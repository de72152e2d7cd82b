"""Weight-only quantisation from a recipe (data in config.yaml) through coreai-opt.

We decide ourselves which ``nn.Linear`` gets quantised and hand coreai-opt one exact name
pattern per layer, because coreai-opt silently skips a linear whose input width is not a
multiple of the block. The plan (quantised / kept, with the reason) goes into the export's
metadata, and after ``finalize`` we check that coreai-opt did exactly what was planned.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from .errors import PipelineError


def _matches(name: str, patterns: Iterable[str]) -> str | None:
    for p in patterns:
        if re.fullmatch(p, name):
            return p
    return None


def plan(module: nn.Module, q: dict, dtype_name: str) -> list[dict]:
    """One row per linear layer: name, shape, action (``int8``/``int4`` or the kept dtype), reason."""
    kept = "fp16" if dtype_name == "float16" else "fp32"
    rows = []
    for name, mod in module.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        row = {"layer": name, "shape": list(mod.weight.shape)}
        inc, exc = _matches(name, q["include"]), _matches(name, q.get("exclude", []))
        if inc is None:
            row.update(action=kept, reason="not matched by include")
        elif exc is not None:
            row.update(action=kept, reason=f"excluded by {exc!r}")
        elif mod.in_features % q["block_size"]:
            row.update(action=kept, reason=f"input width {mod.in_features} is not a multiple of block {q['block_size']}")
        else:
            row.update(action=f"int{q['bits']}", reason=f"matched {inc!r}")
        rows.append(row)
    return rows


def _op_config(q: dict) -> dict:
    return {"op_state_spec": {"weight": {
        "dtype": f"int{q['bits']}", "qscheme": "symmetric_with_clipping",
        "granularity": {"type": "per_block", "block_size": q["block_size"], "axis": q["axis"]}}},
        "op_input_spec": None, "op_output_spec": None}


def apply(module: nn.Module, q: dict, dtype_name: str, example_inputs: tuple,
          recipe_name: str = "?") -> tuple[nn.Module, list[dict]]:
    """Quantise ``module`` per recipe; returns the finalised module and the plan."""
    from coreai_opt import ExportBackend
    from coreai_opt.quantization import Quantizer, QuantizerConfig

    rows = plan(module, q, dtype_name)
    chosen = [r["layer"] for r in rows if r["action"].startswith("int")]
    if not chosen:
        widths = sorted({r["shape"][1] for r in rows})
        raise PipelineError(f"recipe {recipe_name}", f"quantize.include {q['include']} matches no linear layer that "
                            f"can be quantised (input widths {widths[:6]}, block {q['block_size']})",
                            f"fix recipes/{recipe_name}/quantize: include/exclude patterns or block_size")
    cfg = QuantizerConfig.from_dict({"quantization_config": {
        "execution_mode": "eager", "global_config": None, "module_type_configs": {},
        "module_name_configs": {re.escape(name): _op_config(q) for name in chosen}}})
    quantizer = Quantizer(module, cfg)
    with torch.no_grad():
        prepared = quantizer.prepare(example_inputs=example_inputs)
        final = quantizer.finalize(prepared, backend=ExportBackend.CoreAI)
    done = sorted(n for n, m in final.named_modules()
                  if isinstance(m, nn.Linear) and hasattr(m, "parametrizations"))
    if done != sorted(chosen):
        raise PipelineError("coreai-opt", f"quantised {len(done)} layers, the plan had {len(chosen)} "
                            f"(difference: {sorted(set(done) ^ set(chosen))[:3]})",
                            "pin coreai-opt==0.4.0 or adjust the recipe")
    return final, rows
