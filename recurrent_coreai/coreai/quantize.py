"""Weight-only quantisation from a recipe (data in config.yaml) through coreai-opt.

We decide ourselves which ``nn.Linear`` gets quantised and hand coreai-opt one exact name
pattern per layer, because coreai-opt silently skips a linear whose input width is not a
multiple of the block. The plan (quantised / kept, with the reason) goes into the export's
metadata, and after ``finalize`` we check that coreai-opt did exactly what was planned.

A linear whose weight is TIED to another tensor (a head tied to the embedding: the family's
``tied_linears``) is stored once with it in an fp16 bundle (the converter keeps one copy of equal
weights). Quantising it would add an int8 copy beside the fp16 table the other user still reads,
so a role never quantises a tied linear; a raw ``include`` pattern that matches it does, and its
row says that the table is then held twice.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch
from torch import nn

from recurrent_coreai.util.errors import PipelineError


def resolve_roles(q: dict, roles: dict[str, str], recipe_name: str = "?",
                  tied: Mapping[str, str] | None = None) -> dict:
    """The recipe's ``quantize`` with its ``roles`` (``mlp``, ``lm_head``, … : families.base.ROLES)
    turned into the family's patterns, ahead of any raw ``include`` patterns; unchanged without
    roles and ties. ``tied``: linear name -> the tensor its weight is tied to; :func:`plan` keeps
    such a linear unless a raw ``include`` pattern (``include_raw``) names it."""
    if not q.get("roles") and not tied:
        return q
    unknown = [r for r in q.get("roles", []) if r not in roles]
    if unknown:
        raise PipelineError(f"recipe {recipe_name}", f"quantize.roles names {unknown[0]!r}, which this model's family "
                            f"does not define (it has {', '.join(sorted(roles))})",
                            f"fix recipes/{recipe_name}/quantize/roles")
    raw = list(q.get("include", []))
    out = {**q, "include": [roles[r] for r in q.get("roles", [])] + raw}
    if tied:
        out.update(tied=dict(tied), include_raw=raw)
    return out


def matching_pattern(name: str, patterns: Iterable[str]) -> str | None:
    """The first pattern that matches ``name`` in full (``re.fullmatch``), or None."""
    for p in patterns:
        if re.fullmatch(p, name):
            return p
    return None


def plan(module: nn.Module, q: dict, dtype_name: str) -> list[dict]:
    """One row per linear layer: name, shape, action (``int8``/``int4`` or the kept dtype), reason;
    a tied linear's row (``q["tied"]``, :func:`resolve_roles`) also names what it is tied to."""
    kept = "fp16" if dtype_name == "float16" else "fp32"
    tied = q.get("tied", {})
    rows = []
    for name, mod in module.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        row = {"layer": name, "shape": list(mod.weight.shape)}
        if name in tied:
            row["tied_to"] = tied[name]
        inc, exc = matching_pattern(name, q["include"]), matching_pattern(name, q.get("exclude", []))
        raw = matching_pattern(name, q.get("include_raw", q["include"])) if name in tied else None
        if inc is None:
            row.update(action=kept, reason="not matched by include")
        elif exc is not None:
            row.update(action=kept, reason=f"excluded by {exc!r}")
        elif name in tied and raw is None:
            row.update(action=kept, reason=f"tied to {tied[name]}: one {kept} table serves both, and a role does "
                                           "not quantise a tied linear")
        elif mod.in_features % q["block_size"]:
            row.update(action=kept, reason=f"input width {mod.in_features} is not a multiple of block {q['block_size']}")
        elif name in tied:
            row.update(action=f"int{q['bits']}", reason=f"matched {raw!r}, although tied to {tied[name]}: "
                                                         f"the bundle holds that table in {kept} and this int{q['bits']} copy")
        else:
            row.update(action=f"int{q['bits']}", reason=f"matched {inc!r}")
        rows.append(row)
    return rows


QUANT_CHUNK_WEIGHTS = 1 << 22   # a linear with more weights is quantised in slices of rows
DEQUANT_BUFFERS = ("quantized_data", "scale", "zero_point", "minval")  # coreai-torch's WeightDequantizeModule


def _op_config(q: dict) -> dict:
    return {"op_state_spec": {"weight": {
        "dtype": f"int{q['bits']}", "qscheme": "symmetric_with_clipping",
        "granularity": {"type": "per_block", "block_size": q["block_size"], "axis": q["axis"]}}},
        "op_input_spec": None, "op_output_spec": None}


def chosen(rows: list[dict], q: dict, recipe_name: str = "?") -> list[str]:
    """The layers the plan quantises; a plan that quantises nothing is an error."""
    names = [r["layer"] for r in rows if r["action"].startswith("int")]
    if not names:
        widths = sorted({r["shape"][1] for r in rows})
        tied = [r["layer"] for r in rows if "tied_to" in r]
        raise PipelineError(f"recipe {recipe_name}", f"quantize.include {q['include']} matches no linear layer that "
                            f"can be quantised (input widths {widths[:6]}, block {q['block_size']}"
                            + (f"; tied {', '.join(tied)} kept: a role does not quantise a tied linear" if tied else "")
                            + ")", f"fix recipes/{recipe_name}/quantize: include/exclude patterns or block_size")
    tied = {r["layer"]: r["tied_to"] for r in rows if "tied_to" in r and r["layer"] in names}
    if len(tied) == len(names):
        # only tied linears: each int8 copy sits beside the fp16 table its other user reads, so the
        # bundle grows and none of the model's own weights is quantised
        copies = ", ".join(f"{layer} (tied to {to})" for layer, to in tied.items())
        raise PipelineError(f"recipe {recipe_name}", f"quantises only {copies}: the bundle would keep that table in "
                            f"fp16 and add an int{q['bits']} copy (larger than fp16) and quantise none of this model's "
                            f"own linears (include {q['include']} matches no other)",
                            f"drop {recipe_name} from this model's recipes, or name linears it has in "
                            f"recipes/{recipe_name}/quantize (roles or include)")
    return names


def _quantizer(module: nn.Module, names: Iterable[str], q: dict):
    from coreai_opt.quantization import Quantizer, QuantizerConfig

    return Quantizer(module, QuantizerConfig.from_dict({"quantization_config": {
        "execution_mode": "eager", "global_config": None, "module_type_configs": {},
        "module_name_configs": {re.escape(name): _op_config(q) for name in names}}}))


def _finalize(module: nn.Module, names: Iterable[str], q: dict, example_inputs: tuple) -> nn.Module:
    from coreai_opt import ExportBackend

    quantizer = _quantizer(module, names, q)
    with torch.no_grad():
        prepared = quantizer.prepare(example_inputs=example_inputs)
        return quantizer.finalize(prepared, backend=ExportBackend.CoreAI)


def check_done(module: nn.Module, names: list[str]) -> None:
    """coreai-opt quantised exactly the planned layers (it skips some silently)."""
    done = sorted(n for n, m in module.named_modules() if isinstance(m, nn.Linear) and hasattr(m, "parametrizations"))
    if done != sorted(names):
        raise PipelineError("coreai-opt", f"quantised {len(done)} layers, the plan had {len(names)} "
                            f"(difference: {sorted(set(done) ^ set(names))[:3]})",
                            "pin coreai-opt==0.4.0 or adjust the recipe")


class _Holder(nn.Module):
    """A linear alone under the name ``linear``: what :func:`quantize_linear` hands coreai-opt."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _quantize_alone(linear: nn.Linear, q: dict) -> nn.Linear:
    holder = _Holder(linear)
    example = (torch.zeros(1, linear.in_features, dtype=linear.weight.dtype),)
    return _finalize(holder, ["linear"], q, example).linear


def quantize_linear(linear: nn.Linear, q: dict) -> nn.Linear:
    """One linear quantised on its own, so that a model can be quantised while it is read and
    no dense copy of it is held (coreai-opt's finalize frees the dense weight). Weight-only and
    per block along the input axis, each output row is quantised on its own: a linear of more
    than QUANT_CHUNK_WEIGHTS weights goes through coreai-opt in slices of rows (its temporaries
    take ~12 bytes per weight) and the slices' quantised data and scales are concatenated —
    the same values as in one piece."""
    rows = max(1, QUANT_CHUNK_WEIGHTS // linear.in_features)
    if linear.out_features <= rows or q["axis"] != 1:
        return _quantize_alone(linear, q)
    pieces = []
    for at in range(0, linear.out_features, rows):
        piece = nn.Linear(linear.in_features, min(rows, linear.out_features - at), bias=False, device="meta")
        piece.weight = nn.Parameter(linear.weight.detach()[at:at + rows].clone())
        pieces.append(_quantize_alone(piece, q))
    first, slices = pieces[0], [p.parametrizations.weight[0] for p in pieces]
    for name in DEQUANT_BUFFERS:
        if getattr(slices[0], name) is not None:
            setattr(slices[0], name, torch.cat([getattr(d, name) for d in slices]))
    first.out_features, first.bias = linear.out_features, linear.bias
    return first


def apply(module: nn.Module, q: dict, dtype_name: str, example_inputs: tuple,
          recipe_name: str = "?") -> tuple[nn.Module, list[dict]]:
    """Quantise the whole ``module`` per recipe; returns the finalised module and the plan.
    (The export stage quantises each linear as it is read instead: :func:`quantize_linear`.)"""
    rows = plan(module, q, dtype_name)
    names = chosen(rows, q, recipe_name)
    final = _finalize(module, names, q, example_inputs)
    check_done(final, names)
    return final, rows
