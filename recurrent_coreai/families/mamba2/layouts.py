"""Mamba-2 checkpoint layouts and their normalisation to ONE normal form.

* ``hf`` (the normal form): transformers ``Mamba2ForCausalLM``, ``model.safetensors`` +
  config.json (``model_type: mamba2``): ``backbone.embeddings.weight``, per layer
  ``backbone.layers.{i}.norm.weight`` and ``backbone.layers.{i}.mixer.{in_proj.weight,
  conv1d.weight, conv1d.bias, dt_bias, A_log, D, norm.weight, out_proj.weight}``,
  ``backbone.norm_f.weight``, ``lm_head.weight`` (absent when ``tie_word_embeddings``).
* ``mamba-ssm``: the original ``state-spaces/mamba2-*`` release, ``pytorch_model.bin`` (a pickled
  state dict, read with ``torch.load(weights_only=True)``) + mamba_ssm's config.json
  (``d_model``, ``n_layer``, ``ssm_cfg`` ...): the same names except ``backbone.embedding.weight``
  (singular; transformers' load hook renames it), and ``lm_head.weight`` stored beside it, the
  same storage, when ``tie_embeddings`` (mamba_ssm's ``save_pretrained`` saves ``state_dict()``).

The normal form always holds ``lm_head.weight``: a tied head is materialised as a copy of the
embedding (so a tied model's normal form has the table twice; a head stored beside a tied
embedding must equal it).

The layout code is both Mamba families' (families/ssm.py); what is Mamba-2's here: how its
tensors are told (dt_bias) and the in_proj row-count message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recurrent_coreai.families import ssm
from recurrent_coreai.families.mamba2.geometry import (Geometry, geometry_from_config, hf_config, mamba_ssm_config,
                                                        normal_shapes)
from recurrent_coreai.families.ssm import (EMBED, HEAD, HF, LAYOUTS, MAMBA_SSM, NORMAL_EMBED,  # noqa: F401
                                           NORMAL_METADATA, TIED_FIX, WEIGHT_FILES, normal_parts, normal_stream,
                                           original_name)
from recurrent_coreai.util.errors import PipelineError


def _is_mamba2(names: set[str]) -> bool:
    """A ``mixer.dt_bias``: Mamba-1 has ``dt_proj`` instead."""
    return any(n.startswith("backbone.layers.") and n.endswith(".mixer.dt_bias") for n in names)


def _mismatch(name: str, stored: str, t: Any, shape: tuple, g: Geometry, where: str | Path) -> PipelineError | None:
    """in_proj's rows are 2I + 2GN + H: a wrong config.json shows there first."""
    if name.endswith("mixer.in_proj.weight") and len(t.shape) == 2 and t.shape[1] == shape[1]:
        return PipelineError(where, f"tensor {stored} has {t.shape[0]} output rows, but config.json implies "
                             f"2*I + 2*G*N + H = 2*{g.intermediate} + 2*{g.n_groups}*{g.d_state} + {g.heads} = "
                             f"{shape[0]} (d_state {g.d_state}, n_groups {g.n_groups}, head_dim {g.headdim})",
                             "fix state_size/n_groups/head_dim in config.json to match the weights")
    return None


LAYOUT = ssm.Layouts(label="Mamba-2", marker="dt_bias", is_family=_is_mamba2, normal_shapes=normal_shapes,
                     hf_config=hf_config, mamba_ssm_config=mamba_ssm_config,
                     geometry_from_config=geometry_from_config, mismatch=_mismatch)
detect_layout = LAYOUT.detect_layout      # "hf" or "mamba-ssm" when the names are Mamba-2's, else None
normalize = LAYOUT.normalize
write_streamed = LAYOUT.write_streamed
write_layout = LAYOUT.write_layout
read_dir = LAYOUT.read_dir
