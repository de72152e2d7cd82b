"""families/mamba2: Mamba-2 (state-spaces/mamba2-*, transformers Mamba2ForCausalLM) behind the Family seam.

Modules: geometry (shapes, both config.json styles), layouts (the two checkpoint layouts and the
normal form), synthetic (seeded weights), reference (the token-by-token oracle), ssd (the exact
chunk form), export_modules (decode and prefill graphs).
"""

from __future__ import annotations

from recurrent_coreai.families import ssm
from recurrent_coreai.families.mamba2 import geometry as _geometry
from recurrent_coreai.families.mamba2 import layouts as _layouts
from recurrent_coreai.families.mamba2.geometry import Geometry


class Mamba2Family(ssm.Family):
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
    geometry_module, layouts_module, geometry_class = _geometry, _layouts, Geometry
    geom_not_in_shapes = 'n_groups and norm_eps'
    export_sources = ("recurrent_coreai/families/mamba2/export_modules.py", "recurrent_coreai/families/mamba2/ssd.py",
                      "recurrent_coreai/families/ssm.py")

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
