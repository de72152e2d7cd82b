"""families/mamba1: Mamba-1 (state-spaces/mamba-*, transformers MambaForCausalLM) and Falcon Mamba
(tiiuae/falcon-mamba-*, FalconMambaForCausalLM) behind the Family seam.

Modules: geometry (shapes, both config.json styles, both model types), layouts (the two checkpoint
layouts and the normal form), synthetic (seeded weights), reference (the token-by-token oracle),
scan (the exact chunk form of the selective scan), export_modules (decode and prefill graphs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from recurrent_coreai.families import base
from recurrent_coreai.families.mamba1 import geometry as _geometry
from recurrent_coreai.families.mamba1 import layouts as _layouts
from recurrent_coreai.families.mamba1.geometry import Geometry


class Mamba1Family(base.Family):
    name = "mamba1"
    display_name = "Mamba-1 (Mamba, Falcon Mamba)"
    catalog_family = "Mamba"
    tokenizer = "hf-bpe"
    layouts = _layouts.LAYOUTS                   # ("hf", "mamba-ssm"); "hf" is the normal form
    synthetic_layouts = _layouts.LAYOUTS
    hf_model_types = (_geometry.MAMBA, _geometry.FALCON)
    roles = {
        "lm_head": r"lm_head",
        "mlp": r"(?!)",                           # Mamba has no MLP: matches nothing
        "mixer_output": r"backbone\.layers\.\d+\.mixer\.out_proj",
        # u (the state's input) and z come from in_proj; Δ, B and C from x_proj and dt_proj
        "state_inputs": r"backbone\.layers\.\d+\.mixer\.(in_proj|x_proj|dt_proj)",
    }
    tags = ("mamba", "mamba1", "ssm", "state-space-model")
    max_chunk = 256
    vocab_tensors = ("backbone.embeddings.weight", "lm_head.weight")
    shape_keys = tuple(_geometry.SHAPE_KEYS)
    tiny_shape = {"layers": 2, "hidden": 64, "d_state": 8, "vocab": 256, "tie_embeddings": True}
    card_summary = (
        "Mamba-1 is a selective state-space model: each layer projects its input (in_proj) into the SSM input u "
        "and a gate z; u passes a short causal depthwise convolution and SiLU, then x_proj makes a low-rank step "
        "input δ and the state projections B and C from it (Falcon Mamba RMS-normalises δ, B and C, without a "
        "weight); the step size Δ = softplus(dt_proj δ) is one per channel, and each channel's state (d_state "
        "values) decays by exp(Δ·A) with A = -exp(A_log) one rate per state entry, and accumulates Δ·u·B, read out "
        "by C, plus a D skip, gated by silu(z). No attention and no KV cache: the bundle carries two fixed-size "
        "states, the conv window (convState) and the SSM state (ssmState), whatever the context length.")
    export_sources = ("recurrent_coreai/families/mamba1/export_modules.py", "recurrent_coreai/families/mamba1/scan.py",
                      "recurrent_coreai/families/ssm.py")

    # --- geometry ------------------------------------------------------------------------
    def geometry_from_shape(self, shape: Mapping, where: str | Path) -> Geometry:
        return _geometry.geometry_from_shape(shape, where)

    def geometry_from_dict(self, d: Mapping) -> Geometry:
        return Geometry(**dict(d)).check("geometry record")

    def parameter_count(self, geom: Geometry) -> int:
        """The model's own parameters: a tied head is the embedding, counted once (the normal
        form holds it twice)."""
        return super().parameter_count(geom) - (geom.vocab * geom.hidden if geom.tie_embeddings else 0)

    def tied_linears(self, geom: Geometry) -> dict[str, str]:
        """Decode-module linears whose weight is tied to another tensor: a tied head is the embedding
        table (one fp16 copy in the bundle serves the lookup and the head, so roles keep it)."""
        return {"lm_head": "backbone.embeddings.weight"} if geom.tie_embeddings else {}

    def config_json(self, geom: Geometry) -> dict:
        return _geometry.hf_config(geom)   # the normal form's (HF) config.json, not mamba_ssm's

    # --- checkpoints ---------------------------------------------------------------------
    def streams(self, layout: str) -> bool:
        """Neither layout normalises by its tensor names alone: whether lm_head is tied (materialised
        from the embedding, or checked equal to it) is in config.json. Both stream with the geometry
        (:meth:`normal_stream`); a synthetic source is written in its layout and normalised so."""
        return False

    def normal_stream(self, layout: str, geom: Geometry, names):
        """Both layouts, one tensor at a time with the geometry (layouts.normal_stream)."""
        return _layouts.normal_stream(layout, geom, names) if layout in self.layouts else None

    def write_synthetic(self, geom: Geometry, seed: int, out_dir: Path, layout: str) -> Path:
        """``hf``: written one tensor at a time (the bytes write_layout gives); ``mamba-ssm``: a
        pickle, written whole by torch.save (write_layout)."""
        if layout == _layouts.HF:
            return _layouts.write_streamed(self.synthetic_tensors(geom, seed), out_dir, geom)
        return super().write_synthetic(geom, seed, out_dir, layout)

    def write_layout(self, sd: Mapping[str, Any], out_dir: Path, layout: str, geom: Geometry | None = None) -> Path:
        """As the seam says, plus ``geom``: dt_rank's "auto", Falcon Mamba's norms and the eps values
        are not all in the tensor shapes, so config.json cannot be written from the weights alone."""
        if geom is None:
            raise TypeError("Mamba-1 write_layout needs geom= (the variant and eps values are not in the tensor shapes)")
        return _layouts.write_layout(sd, out_dir, layout, geom)

    # --- card ----------------------------------------------------------------------------
    def card_rows(self, geom: Geometry) -> list[tuple[str, str]]:
        g = geom
        return [
            ("Architecture", "Falcon Mamba (Mamba-1 with B/C/Δ RMS norms), no attention" if g.falcon
             else "Mamba-1 (selective scan), no attention"),
            ("Layers", str(g.layers)),
            ("Hidden size (d_model)", str(g.hidden)),
            ("Inner width (d_inner)", str(g.intermediate)),
            ("State size (d_state)", str(g.d_state)),
            ("Δ rank (dt_rank)", str(g.dt_rank)),
            ("Conv kernel", str(g.conv_kernel)),
            ("Tied embeddings", "yes" if g.tie_embeddings else "no"),
            ("Parameters", f"{self.parameter_count(g):,}"),
        ]


FAMILY = Mamba1Family()
