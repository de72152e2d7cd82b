"""families/mamba1: Mamba-1 (state-spaces/mamba-*, transformers MambaForCausalLM) and Falcon Mamba
(tiiuae/falcon-mamba-*, FalconMambaForCausalLM) behind the Family seam.

Modules: geometry (shapes, both config.json styles, both model types), layouts (the two checkpoint
layouts and the normal form), synthetic (seeded weights), reference (the token-by-token oracle),
scan (the exact chunk form of the selective scan), export_modules (decode and prefill graphs).
"""

from __future__ import annotations

from recurrent_coreai.families import ssm
from recurrent_coreai.families.mamba1 import geometry as _geometry
from recurrent_coreai.families.mamba1 import layouts as _layouts
from recurrent_coreai.families.mamba1.geometry import Geometry


class Mamba1Family(ssm.Family):
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
    geometry_module, layouts_module, geometry_class = _geometry, _layouts, Geometry
    geom_not_in_shapes = 'the variant (Falcon Mamba\'s norms), dt_rank\'s "auto" and the eps values'
    export_sources = ("recurrent_coreai/families/mamba1/export_modules.py", "recurrent_coreai/families/mamba1/scan.py",
                      "recurrent_coreai/families/ssm.py")

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
