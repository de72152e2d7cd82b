"""RWKV-7 ("Goose", x070): the first family.

Checkpoints: fla/HF (split or packed mixers) and BlinkDL x070 ``.pth`` (:mod:`.layouts`); the
normal form is fla's split layout (:mod:`.geometry`). The oracle is :mod:`.reference`; the export
modules are :mod:`.export_graph` (decode) with the exact chunked WKV7 of :mod:`.chunked` (prefill);
synthetic weights come from :mod:`.synthetic`. Tokenizer: the RWKV World vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from recurrent_coreai.families import base
from recurrent_coreai.families.rwkv7.geometry import Geometry, expected_shapes

HERE = Path(__file__).resolve().parent


class Rwkv7Family(base.Family):
    name = "rwkv7"
    display_name = "RWKV-7 (x070, Goose)"
    catalog_family = "RWKV"
    tokenizer = "world"
    layouts = ("fla-split", "fla-packed", "blinkdl")
    synthetic_layouts = ("fla-split", "fla-packed")
    hf_model_types = ("rwkv7",)
    roles = {
        "lm_head": r"lm_head",
        "mlp": r".*\.ffn\.(key|value)",
        "mixer_output": r".*\.attn\.o_proj",
        "state_inputs": r".*\.attn\.([rkv]_proj|[wavg]_lora\.lora\.\d+)",
    }
    tags = ("rwkv7", "rwkv", "linear-attention")
    max_chunk = 128  # chunked.MAX_CHUNK
    vocab_tensors = ("model.embeddings.weight", "lm_head.weight")
    shape_keys = ("layers", "hidden", "head_dim", "ffn", "vocab", "decay_lora", "a_lora", "v_lora", "gate_lora")
    tiny_shape = {"layers": 2, "hidden": 64, "head_dim": 32, "ffn": 128, "vocab": 256, "decay_lora": 8, "a_lora": 8,
                  "v_lora": 8, "gate_lora": 16}
    card_summary = ('RWKV-7 ("Goose", x070) is a recurrent language model: decoding costs O(1) per token and the '
                    "whole context lives in two fixed-size states, so there is **no KV cache** and memory does not "
                    "grow with the conversation.")
    export_module = "export_graph"
    export_sources = ("recurrent_coreai/families/rwkv7/export_graph.py", "recurrent_coreai/families/rwkv7/chunked.py",
                      "recurrent_coreai/coreai/entrypoints.py")

    # --- geometry -------------------------------------------------------------------------
    def geometry_from_shape(self, shape: Mapping, where) -> Geometry:
        return base.shape_to(Geometry, self, shape, where)

    def geometry_from_config(self, cfg, where) -> Geometry:
        return Geometry.from_hf_config(cfg, where)

    def geometry_from_tensors(self, shapes, layout, where):
        if layout != "blinkdl":
            return None
        from recurrent_coreai.families.rwkv7.layouts import geometry_from_tensors

        return geometry_from_tensors(shapes, where)

    def geometry_from_dict(self, d: Mapping) -> Geometry:
        return Geometry(**d)

    def config_json(self, geom: Geometry) -> dict:
        return geom.to_hf_config()

    # --- checkpoints ----------------------------------------------------------------------
    def normal_shapes(self, geom: Geometry) -> dict[str, tuple[int, ...]]:
        return expected_shapes(geom)

    def streams(self, layout: str) -> bool:
        return layout in ("fla-split", "fla-packed")

    def normal_parts(self, layout, name, tensor):
        from recurrent_coreai.families.rwkv7.layouts import normal_parts

        return normal_parts(name, tensor)

    def write_synthetic(self, geom, seed: int, out_dir: Path, layout: str) -> Path:
        from recurrent_coreai.families.rwkv7.synthetic import write_synthetic

        return write_synthetic(geom, seed, out_dir, layout)

    def tuned_states(self, tensors, geom: Geometry, where):
        """A BlinkDL state-tuning file: its time_state as recState, shiftState zeros (base.rwkv_time_states)."""
        import numpy as np

        rec, shift = (s for s in self.state_specs(geom))
        return {rec.name: base.rwkv_time_states(tensors, geom.layers, geom.heads, geom.head_dim, where),
                shift.name: np.zeros(shift.shape, np.float32)}

    def write_layout(self, sd, out_dir: Path, layout: str, geom=None) -> Path:
        import json

        from recurrent_coreai.families.rwkv7.synthetic import write_weights

        path = write_weights(dict(sd), out_dir, layout)
        if geom is not None and layout != "blinkdl":  # a BlinkDL .pth has no config.json
            (Path(out_dir) / "config.json").write_text(json.dumps(self.config_json(geom), indent=2, sort_keys=True) + "\n")
        return path

    # --- card -----------------------------------------------------------------------------
    def card_rows(self, geom: Geometry) -> list[tuple[str, str]]:
        return [("layers", str(geom.layers)), ("hidden size", str(geom.hidden)),
                ("heads × head size", f"{geom.heads} × {geom.head_dim}"),
                ("FFN size", f"{geom.ffn} (squared ReLU)"),
                ("LoRA ranks (decay / a / v / gate)",
                 f"{geom.decay_lora} / {geom.a_lora} / {geom.v_lora} / {geom.gate_lora}")]


FAMILY = Rwkv7Family()
