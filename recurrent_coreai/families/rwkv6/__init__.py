"""families/rwkv6: RWKV-6 (x060, "Finch") behind the Family seam.

Layouts: the normal form is ``hf``, the tensor names of ``RWKV/v6-Finch-*-HF`` (transformers
remote code ``modeling_rwkv6.py``, ``model_type: rwkv6``, ``Rwkv6ForCausalLM``: ``rwkv.embeddings``,
``rwkv.blocks.<i>.attention.*``, ``rwkv.blocks.<i>.feed_forward.*``, ``rwkv.ln_out``, ``head``) with
its config.json keys (hidden_size, num_hidden_layers, head_size, head_size_divisor,
intermediate_size, layer_norm_epsilon, vocab_size, attention_hidden_size). Chosen over fla's
``fla-hub/rwkv6-*`` naming because it is a pure RENAME of BlinkDL's x060 tensors (same shapes, same
orientation, the same ddlerp/decay LoRA matrices ``time_maa_w1/w2``, ``time_decay_w1/w2``), so
both accepted layouts normalise tensor by tensor, byte-identically and streamable, and the
reference reads like BlinkDL's code; fla's RWKV-6 re-factors the LoRAs into its own ``LoRA``
modules (with biases and another split of the five mixers) and makes the key width a config
option (``expand_k``), a conversion with more places to go wrong and not needed for Finch weights.
The second layout is ``blinkdl`` (the ``.pth`` BlinkDL publishes; no config.json: geometry from
tensor shapes, LoRA widths included).

Modules: :mod:`.geometry` (Geometry, normal shapes, config.json), :mod:`.layouts` (detection,
normalisation, writing), :mod:`.synthetic`, :mod:`.reference` (the oracle), :mod:`.chunked`
(the prefill's exact chunk form), :mod:`.export_modules` (decode and prefill modules).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping

from recurrent_coreai.families.base import Family, rwkv_time_states
from recurrent_coreai.families.rwkv6 import geometry as _geometry
from recurrent_coreai.families.rwkv6 import layouts as _layouts
from recurrent_coreai.families.rwkv6.geometry import Geometry
from recurrent_coreai.tokenizers import world

_LINEAR = r"rwkv\.blocks\.\d+\."


class Rwkv6Family(Family):
    name: ClassVar[str] = "rwkv6"
    display_name: ClassVar[str] = "RWKV-6 (x060, Finch)"
    catalog_family: ClassVar[str] = "RWKV"
    tokenizer: ClassVar[str] = "world"
    layouts: ClassVar[tuple[str, ...]] = _layouts.LAYOUTS                 # ("hf", "blinkdl"); hf = normal form
    synthetic_layouts: ClassVar[tuple[str, ...]] = _layouts.LAYOUTS
    hf_model_types: ClassVar[tuple[str, ...]] = (_geometry.HF_MODEL_TYPE,)
    roles: ClassVar[dict[str, str]] = {
        "lm_head": r"head",
        "mlp": _LINEAR + r"feed_forward\.(key|value|receptance)",
        "mixer_output": _LINEAR + r"attention\.output",
        "state_inputs": _LINEAR + r"attention\.(receptance|key|value|gate|maa_w1|maa_w2\.\d+|decay_w1|decay_w2)",
    }
    tags: ClassVar[tuple[str, ...]] = ("rwkv", "rwkv6", "finch", "recurrent")
    min_vocab = world.ID_COUNT  # the World vocabulary's ids (0..65529) must all have a row
    vocab_tensors: ClassVar[tuple[str, ...]] = ("rwkv.embeddings.weight", "head.weight")
    max_chunk: ClassVar[int] = 128
    shape_keys: ClassVar[tuple[str, ...]] = _geometry.SHAPE_KEYS
    tiny_shape: ClassVar[dict[str, Any]] = {"layers": 2, "hidden": 128, "head_dim": 64, "ffn": 448, "vocab": 256,
                                            "mix_lora": 8, "decay_lora": 16}
    card_summary: ClassVar[str] = (
        "RWKV-6 (x060, \"Finch\") is a recurrent language model without a KV cache: each layer keeps a "
        "per-head matrix state updated with a data-dependent decay (w = exp(-exp(.)) from a LoRA of the "
        "token-shifted input) plus a bonus for the current token, and a one-row token-shift state per "
        "mix. Memory per sequence is constant, whatever its length.")
    export_sources: ClassVar[tuple[str, ...]] = (
        "recurrent_coreai/families/rwkv6/export_modules.py",
        "recurrent_coreai/families/rwkv6/chunked.py",
    )

    # --- geometry -------------------------------------------------------------------------
    def geometry_from_shape(self, shape: Mapping, where: str | Path) -> Geometry:
        return _geometry.geometry_from_shape(self, shape, where)

    def geometry_from_tensors(self, shapes: Mapping[str, tuple[int, ...]], layout: str,
                              where: str | Path) -> Geometry | None:
        """Both layouts carry every size in their tensors (the LoRA widths too); config.json of the
        hf layout cannot name them in the remote code's own keys, so prefer this when tensors exist."""
        names = _layouts.blinkdl_names() if layout == _layouts.BLINKDL else _layouts.hf_names()
        return _geometry.geometry_from_tensors(shapes, names, _layouts.LABELS[layout], where)

    def geometry_from_dict(self, d: Mapping) -> Geometry:
        return _geometry.geometry_from_dict(d)

    # --- checkpoints ----------------------------------------------------------------------
    def streams(self, layout: str) -> bool:
        return layout in _layouts.LAYOUTS      # both are renames: normalised tensor by tensor

    def write_synthetic(self, geom: Geometry, seed: int, out_dir: Path, layout: str) -> Path:
        """``hf`` (the normal form): written one tensor at a time (the bytes write_layout gives);
        ``blinkdl``: a pickle, written whole by torch.save (write_layout)."""
        if layout == _layouts.HF:
            return _layouts.write_streamed(self.synthetic_tensors(geom, seed), out_dir, geom)
        return super().write_synthetic(geom, seed, out_dir, layout)

    def tuned_states(self, tensors, geom: Geometry, where):
        """A BlinkDL state-tuning file: time_state as recState, shiftState zeros (base.rwkv_time_states)."""
        import numpy as np

        rec, shift = (s for s in self.state_specs(geom))
        return {rec.name: rwkv_time_states(tensors, geom.layers, geom.heads, geom.head_dim, where),
                shift.name: np.zeros(shift.shape, np.float32)}

    def write_layout(self, sd: Mapping[str, Any], out_dir: Path, layout: str, geom: Geometry | None = None) -> Path:
        return _layouts.write_layout(sd, out_dir, layout)

    # --- card -----------------------------------------------------------------------------
    def card_rows(self, geom: Geometry) -> list[tuple[str, str]]:
        return [
            ("Architecture", self.display_name),
            ("Layers", str(geom.layers)),
            ("Hidden size", str(geom.hidden)),
            ("Heads x head size", f"{geom.heads} x {geom.head_dim}"),
            ("FFN size", str(geom.ffn)),
            ("ddlerp LoRA (D_MIX) / decay LoRA (D_DECAY)", f"{geom.mix_lora} / {geom.decay_lora}"),
            ("Parameters", f"{self.parameter_count(geom):,}"),
        ]


FAMILY = Rwkv6Family()
