"""families/mamba2: Mamba-2 (state-spaces/mamba2-*, transformers Mamba2ForCausalLM) behind the Family seam.

Modules: geometry (shapes, both config.json styles), layouts (the two checkpoint layouts and the
normal form), synthetic (seeded weights), reference (the token-by-token oracle), ssd (the exact
chunk form), export_modules (decode and prefill graphs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from recurrent_coreai.families import base
from recurrent_coreai.families.mamba2 import geometry as _geometry
from recurrent_coreai.families.mamba2 import layouts as _layouts
from recurrent_coreai.families.mamba2.geometry import Geometry


class Mamba2Family(base.Family):
    name = "mamba2"
    display_name = "Mamba-2"
    catalog_family = "Mamba"
    tokenizer = "hf-bpe"
    layouts = _layouts.LAYOUTS                   # ("hf", "mamba-ssm"); "hf" is the normal form
    synthetic_layouts = _layouts.LAYOUTS
    hf_model_types = ("mamba2",)
    roles = {
        "lm_head": r"lm_head",
        "mlp": r"(?!)",                           # Mamba-2 has no MLP: matches nothing
        "mixer_output": r"backbone\.layers\.\d+\.mixer\.out_proj",
        "state_inputs": r"backbone\.layers\.\d+\.mixer\.in_proj",
    }
    tags = ("mamba", "mamba2", "ssm", "state-space-model")
    max_chunk = 256
    vocab_tensors = ("backbone.embeddings.weight", "lm_head.weight")
    shape_keys = tuple(_geometry.SHAPE_KEYS)
    tiny_shape = {"layers": 2, "hidden": 64, "d_state": 16, "headdim": 16, "n_groups": 2, "vocab": 256}
    card_summary = (
        "Mamba-2 is a selective state-space model: each layer projects its input once (in_proj) into a gate z, "
        "the SSM input x, the grouped state projections B and C and a step size dt per head; x, B and C pass a "
        "short causal depthwise convolution, and each head's state S (headdim x d_state) decays by the scalar "
        "exp(dt*A) and accumulates dt*x*Bᵀ, read out by C, plus a D skip, gated by silu(z) and RMS-normalised "
        "per group. No attention and no KV cache: the bundle carries two fixed-size states, the conv window "
        "(convState) and the SSM state (ssmState), whatever the context length.")
    export_sources = ("recurrent_coreai/families/mamba2/export_modules.py", "recurrent_coreai/families/mamba2/ssd.py",
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
        """As the seam says, plus ``geom``: Mamba-2's n_groups and norm eps are not in the tensor
        shapes, so config.json cannot be written from the weights alone (required)."""
        if geom is None:
            raise TypeError("Mamba-2 write_layout needs geom= (n_groups and norm_eps are not in the tensor shapes)")
        return _layouts.write_layout(sd, out_dir, layout, geom)

    # --- card ----------------------------------------------------------------------------
    def card_rows(self, geom: Geometry) -> list[tuple[str, str]]:
        g = geom
        return [
            ("Architecture", "Mamba-2 (SSD), no attention"),
            ("Layers", str(g.layers)),
            ("Hidden size (d_model)", str(g.hidden)),
            ("Inner width (expand x d_model)", f"{g.intermediate} ({g.expand} x {g.hidden})"),
            ("Heads x head dim", f"{g.heads} x {g.headdim}"),
            ("State size (d_state)", str(g.d_state)),
            ("Groups (B/C)", str(g.n_groups)),
            ("Conv kernel", str(g.conv_kernel)),
            ("Tied embeddings", "yes" if g.tie_embeddings else "no"),
            ("Parameters", f"{self.parameter_count(g):,}"),
        ]


FAMILY = Mamba2Family()
