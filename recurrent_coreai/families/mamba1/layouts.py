"""Mamba-1 checkpoint layouts and their normalisation to ONE normal form.

* ``hf`` (the normal form): transformers ``MambaForCausalLM`` / ``FalconMambaForCausalLM``,
  ``model.safetensors`` + config.json (``model_type: mamba | falcon_mamba``):
  ``backbone.embeddings.weight``, per layer ``backbone.layers.{i}.norm.weight`` and
  ``backbone.layers.{i}.mixer.{in_proj.weight, conv1d.weight, conv1d.bias, x_proj.weight,
  dt_proj.weight, dt_proj.bias, A_log, D, out_proj.weight}``, ``backbone.norm_f.weight``,
  ``lm_head.weight`` (absent when ``tie_word_embeddings``). Falcon Mamba's B/C/dt norms have no
  stored weight (transformers keeps a non-persistent buffer of ones).
* ``mamba-ssm``: the original ``state-spaces/mamba-*`` release, ``pytorch_model.bin`` (a pickled
  state dict, read with ``torch.load(weights_only=True)``) + mamba_ssm's config.json
  (``d_model``, ``n_layer``, ``ssm_cfg`` ...): the same names except ``backbone.embedding.weight``
  (singular; transformers' load hook renames it), and ``lm_head.weight`` stored beside it, the
  same storage (the head is always tied there; mamba_ssm's ``save_pretrained`` saves ``state_dict()``).

The normal form always holds ``lm_head.weight``: a tied head is materialised as a copy of the
embedding (so a tied model's normal form has the table twice; a head stored beside a tied
embedding must equal it).

The layout code is both Mamba families' (families/ssm.py); what is Mamba-1's here: how its
tensors are told (x_proj, dt_proj) and the x_proj row-count message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recurrent_coreai.families import ssm
from recurrent_coreai.families.mamba1.geometry import (Geometry, geometry_from_config, hf_config, mamba_ssm_config,
                                                        normal_shapes)
from recurrent_coreai.families.ssm import (EMBED, HEAD, HF, LAYOUTS, MAMBA_SSM, NORMAL_EMBED,  # noqa: F401
                                           NORMAL_METADATA, TIED_FIX, WEIGHT_FILES, normal_parts, normal_stream,
                                           original_name)
from recurrent_coreai.util.errors import PipelineError


def _is_mamba1(names: set[str]) -> bool:
    """A ``mixer.dt_proj`` and a ``mixer.x_proj``: Mamba-2 has a ``dt_bias`` and no x_proj."""
    return any(n.startswith("backbone.layers.") and n.endswith(".mixer.dt_proj.weight") for n in names) and \
        any(n.startswith("backbone.layers.") and n.endswith(".mixer.x_proj.weight") for n in names)


def _mismatch(name: str, stored: str, t: Any, shape: tuple, g: Geometry, where: str | Path) -> PipelineError | None:
    """x_proj's rows are dt_rank + 2*d_state: a wrong config.json shows there first."""
    if name.endswith("mixer.x_proj.weight") and len(t.shape) == 2 and t.shape[1] == shape[1]:
        return PipelineError(where, f"tensor {stored} has {t.shape[0]} output rows, but config.json implies "
                             f"dt_rank + 2*d_state = {g.dt_rank} + 2*{g.d_state} = {shape[0]}",
                             "fix time_step_rank/state_size in config.json to match the weights")
    return None


LAYOUT = ssm.Layouts(label="Mamba-1", marker="dt_proj/x_proj", is_family=_is_mamba1, normal_shapes=normal_shapes,
                     hf_config=hf_config, mamba_ssm_config=mamba_ssm_config,
                     geometry_from_config=geometry_from_config, mismatch=_mismatch)
detect_layout = LAYOUT.detect_layout      # "hf" or "mamba-ssm" when the names are Mamba-1's, else None
normalize = LAYOUT.normalize
write_streamed = LAYOUT.write_streamed
write_layout = LAYOUT.write_layout        # mamba-ssm holds only a plain, tied Mamba-1 (mamba_ssm_config)
read_dir = LAYOUT.read_dir
