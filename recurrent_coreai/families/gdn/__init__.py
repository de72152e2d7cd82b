"""families/gdn: Gated DeltaNet (fla's GatedDeltaNetForCausalLM, pure: no attention layers) behind
the Family seam.

Modules: geometry (shapes, fla's config.json), layouts (the normal form and the published variants),
synthetic (seeded weights), recurrence (the gated delta rule: step and exact chunk form), reference
(the token-by-token oracle), export_modules (decode and prefill graphs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from recurrent_coreai.families import base
from recurrent_coreai.families.gdn import geometry as _geometry
from recurrent_coreai.families.gdn import layouts as _layouts
from recurrent_coreai.families.gdn.geometry import Geometry

_LAYER = r"model\.layers\.\d+\."



class GatedDeltaNetFamily(base.Family):
    name = "gdn"
    display_name = "Gated DeltaNet"
    catalog_family = "GatedDeltaNet"
    tokenizer = "sp-bpe"
    layouts = _layouts.LAYOUTS                   # ("fla", "fla-zero-d", "fla-tied"); fla is the normal form
    synthetic_layouts = _layouts.SYNTHETIC_LAYOUTS
    hf_model_types = ("gated_deltanet",)
    roles = {
        "lm_head": r"lm_head",
        "mlp": _LAYER + r"mlp\.(gate|up|down)_proj",
        "mixer_output": _LAYER + r"attn\.o_proj",
        # q/k/v, the decay (a) and write strength (b), and the output gate g (as RWKV-6's gate and
        # Mamba-2's z inside in_proj are in this role)
        "state_inputs": _LAYER + r"attn\.(q|k|v|a|b|g)_proj",
    }
    tags = ("gated-deltanet", "gdn", "linear-attention", "delta-rule", "recurrent")
    max_chunk = _geometry.MAX_CHUNK
    vocab_tensors = ("model.embeddings.weight", "lm_head.weight")
    shape_keys = _geometry.SHAPE_KEYS
    tiny_shape = {"layers": 2, "hidden": 64, "heads": 2, "head_dim": 16, "vocab": 512, "intermediate": 128,
                  "v_heads": 4, "expand_v": 2.0, "allow_neg_eigval": True}
    card_summary = (
        "Gated DeltaNet is a linear-attention recurrence with a delta-rule update: each layer projects its input to "
        "queries, keys and values (each through a short causal convolution and SiLU; q and k L2-normalised), a "
        "per-head decay g = -exp(A_log)·softplus(a + dt_bias) and a write strength beta = sigmoid(b); each value "
        "head's state S (head_dim x head_v_dim) decays by exp(g), then is corrected towards v at key k "
        "(S += k·beta(v - Sᵀk)ᵀ) and read by q, then RMS-normalised and gated by SiLU(g_proj x); a SwiGLU MLP "
        "follows. No attention and no KV cache: the bundle carries fixed-size states, the three conv windows "
        "and the delta-rule state (recurrentState), whatever the context length.")
    export_sources = ("recurrent_coreai/families/gdn/export_modules.py", "recurrent_coreai/families/gdn/recurrence.py")

    # --- geometry ------------------------------------------------------------------------
    def geometry_from_shape(self, shape: Mapping, where: str | Path) -> Geometry:
        return _geometry.geometry_from_shape(self, shape, where)

    def geometry_from_dict(self, d: Mapping) -> Geometry:
        return Geometry(**dict(d)).check("geometry record")

    def parameter_count(self, geom: Geometry) -> int:
        """The model's own parameters: a tied head is the embedding, counted once."""
        return super().parameter_count(geom) - (geom.vocab * geom.hidden if geom.tie_embeddings else 0)

    def tied_linears(self, geom: Geometry) -> dict[str, str]:
        return {"lm_head": "model.embeddings.weight"} if geom.tie_embeddings else {}

    # --- checkpoints ---------------------------------------------------------------------
    def streams(self, layout: str) -> bool:
        """Every layout streams: they differ from the normal form by names only (normal_parts)."""
        return layout in self.layouts

    def write_synthetic(self, geom: Geometry, seed: int, out_dir: Path, layout: str) -> Path:
        """The synthetic weights written one tensor at a time (the bytes write_layout gives)."""
        return _layouts.write_streamed(self.synthetic_tensors(geom, seed), out_dir, layout, geom)

    def write_layout(self, sd: Mapping[str, Any], out_dir: Path, layout: str, geom: Geometry | None = None) -> Path:
        if geom is None:
            raise TypeError("Gated DeltaNet write_layout needs geom= (norm_eps, allow_neg_eigval are not in the shapes)")
        return _layouts.write_layout(sd, out_dir, layout, geom)

    # --- card ----------------------------------------------------------------------------
    def card_rows(self, geom: Geometry) -> list[tuple[str, str]]:
        g = geom
        rows = [
            ("Architecture", "Gated DeltaNet (gated delta rule), no attention"),
            ("Layers", str(g.layers)),
            ("Hidden size", str(g.hidden)),
            ("q/k heads x head_dim", f"{g.heads} x {g.head_dim}"),
            ("Value heads x head_v_dim", f"{g.hv} x {g.head_v_dim}" + (" (GVA)" if g.hv > g.heads else "")),
            ("Short conv size", str(g.conv_size)),
            ("MLP (SwiGLU) width", str(g.intermediate)),
            ("Output gate", "yes" if g.use_gate else "no"),
            ("Negative eigenvalues (beta x 2)", "yes" if g.allow_neg_eigval else "no"),
            ("Tied embeddings", "yes" if g.tie_embeddings else "no"),
            ("Parameters", f"{self.parameter_count(g):,}"),
        ]
        return rows


FAMILY = GatedDeltaNetFamily()
