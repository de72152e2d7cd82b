"""The streaming safetensors writer and the source stage's memory.

``safetensors_stream`` writes a file tensor by tensor (header first, each tensor's bytes at its
offset, in any order): the bytes must be exactly ``safetensors.torch.save_file``'s, over dtypes,
shapes (scalars, empty), names (escapes, non-ASCII, orderings) and metadata. The source stage
uses it to synthesise and to normalise a checkpoint holding one tensor at a time: a child process
builds a mid-size fla-packed synthetic source (synthesised, then normalised to fla-split, then
hashed) and its peak RSS above the warmed process must stay a fraction of the checkpoint — a
stage that holds the whole state dict again (as it did: 7.7 GB for the 6.1 GB 1.5B checkpoint)
breaks the bound.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from recurrent_coreai.checkpoints import reader as checkpoint
from recurrent_coreai.families.rwkv7 import synthetic
from recurrent_coreai.families.rwkv7.geometry import Geometry, expected_shapes
from recurrent_coreai.util.safetensors_stream import DTYPES, layout, safetensors_writer, save_streamed

NAMES = ["a", "b", "B", "aa", "a.b", "a_b", "a-b", "z9", "é", "😀", "lm_head.weight", "model.x",
         'q"uote\\back\nline\ttab\x01\x7f/']


def header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


def random_tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
    t = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randint(0, 2**31))) * 50
    return torch.complex(t, -t) if dtype == torch.complex64 else t.to(dtype)


@pytest.mark.parametrize("seed", range(40))
def test_bytes_are_save_files(tmp_path, seed):
    rng = random.Random(seed)
    tensors = {name: random_tensor(rng, rng.choice(list(DTYPES)))
               for name in rng.sample(NAMES, rng.randint(0, len(NAMES)))}
    metadata = [None, {"format": "pt"}, {"k": 'é "v"\n'}, {"b": "1", "a": "2", "c": "3"}][seed % 4]
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)
    if metadata and len(metadata) > 1:
        # save_file writes a __metadata__ of several keys in a random order (a Rust HashMap); we
        # write the order given: give the one it picked, then the bytes must match
        metadata = header(tmp_path / "ref.safetensors")["__metadata__"]
    items = list(tensors.items())
    rng.shuffle(items)  # any order in, save_file's layout out
    specs = {name: (t.dtype, t.shape) for name, t in tensors.items()}
    save_streamed(tmp_path / "got.safetensors", specs, items, metadata)
    assert (tmp_path / "got.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_every_dtype_in_one_file(tmp_path):
    rng = random.Random(1)
    tensors = {f"t{i}": random_tensor(rng, d) for i, d in enumerate(DTYPES)}
    tensors.update({f"s{i}": torch.zeros((), dtype=d) for i, d in enumerate(DTYPES)})
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    save_streamed(tmp_path / "got.safetensors", {n: (t.dtype, t.shape) for n, t in tensors.items()},
                  reversed(list(tensors.items())), {"format": "pt"})
    assert (tmp_path / "got.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_header_is_padded_to_8_with_spaces():
    for n in range(1, 12):
        head, offsets = layout({"x" * n: (torch.float32, (n,))}, {"format": "pt"})
        size = int.from_bytes(head[:8], "little")
        assert size % 8 == 0 and len(head) == 8 + size and offsets == {"x" * n: 8 + size}
        assert head[8:].rstrip(b" ").endswith(b"}") and set(head[8 + len(head[8:].rstrip(b" ")):]) <= {32}


def test_wrong_tensors_are_refused_and_leave_nothing(tmp_path):
    out = tmp_path / "m.safetensors"
    specs = {"a": (torch.float32, (2,)), "b": (torch.float16, (1, 3))}
    with pytest.raises(ValueError, match="not a tensor of this file"):
        save_streamed(out, specs, [("c", torch.zeros(2))])
    with pytest.raises(ValueError, match="declared"):
        save_streamed(out, specs, [("a", torch.zeros(3))])
    with pytest.raises(ValueError, match="declared"):
        save_streamed(out, specs, [("b", torch.zeros(1, 3))])  # float32, declared float16
    with pytest.raises(ValueError, match="already written"):
        save_streamed(out, specs, [("a", torch.zeros(2)), ("a", torch.zeros(2))])
    with pytest.raises(ValueError, match="never written"):
        save_streamed(out, specs, [("a", torch.zeros(2))])
    assert list(tmp_path.iterdir()) == []  # atomic: no file, no temporary
    with safetensors_writer(out, specs) as w:
        w.write("b", torch.ones(1, 3, dtype=torch.float16))
        w.write("a", torch.arange(2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


# --- the synthetic source, streamed ----------------------------------------------------------
G = Geometry(layers=2, hidden=128, head_dim=64, ffn=256, vocab=512, decay_lora=16, a_lora=8, v_lora=24, gate_lora=32)


@pytest.mark.parametrize("layout_", ["fla-split", "fla-packed"])
def test_write_synthetic_is_write_weights(tmp_path, layout_):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    synthetic.write_weights(synthetic.synthetic_state_dict(G, 3), tmp_path / "a", layout_)
    synthetic.write_synthetic(G, 3, tmp_path / "b", layout_)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("layout_", ["fla-split", "fla-packed", "blinkdl"])
def test_write_normalized_is_save_normalized(tmp_path, layout_):
    sd = synthetic.synthetic_state_dict(G, 4)
    src = tmp_path / "src"
    src.mkdir()
    synthetic.write_weights(sd, src, layout_)
    (src / "config.json").write_text(json.dumps(G.to_hf_config()))
    ck = checkpoint.write_normalized(src, tmp_path / "got.safetensors")
    checkpoint.save_normalized(sd, tmp_path / "ref.safetensors")
    assert (tmp_path / "got.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert (ck.geometry, ck.layout, list(ck.tensors)) == (G, layout_, list(expected_shapes(G)))


# --- memory of the source stage ----------------------------------------------------------------
# Both go through the source stage, which refuses fewer embedding/head rows than the RWKV World
# vocabulary has ids (65530; tokenizers/fit.py): vocab 65536, as real checkpoints. MID keeps the
# old mid shape's profile (8 layers, hidden 512, vocab 4096: 123 MB, largest tensors 8, 8, 4, 4 MiB)
# with a narrow hidden and a wide ffn: embedding and head [65536, 32] 8 MiB each, ffn key/value
# 4 MiB each, 12 layers: 118 MB. WARM stays tiny beside it (its largest tensor 256 KB, the old one's
# 128 KB): a warm run on 8 MiB rows (hidden 32) leaves malloc a heap that the mid run reuses and
# hides half its growth (measured 0.09x against 0.14-0.21x).
MID = dict(layers=12, hidden=32, head_dim=32, ffn=32768, vocab=65536, decay_lora=32, a_lora=32, v_lora=32,
           gate_lora=64)  # ~30M weights: a 118 MB fp32 checkpoint, no tensor above 8 MB
WARM = dict(MID, layers=1, hidden=1, head_dim=1, ffn=256, decay_lora=8, a_lora=8, v_lora=8, gate_lora=16)
RSS_PER_CHECKPOINT_BYTE = 0.4  # measured 0.14-0.21 (the old shape 0.14-0.28): 8-16 MB draw temporaries, malloc's retained heap

CHILD = """
import json, re, sys
from pathlib import Path
from recurrent_coreai.stages.source import build_source
cfg, root = json.loads(sys.argv[1]), Path(sys.argv[2])
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
out = {}
for name in ("warm", "mid"):
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (the peak) to the current RSS
    base = status("VmRSS")
    build_source(name, cfg["models"][name], cfg["vocab"], root / name)
    out[name] = {"base": base, "peak": status("VmHWM"), "bytes": (root / name / "model.safetensors").stat().st_size}
print(json.dumps(out))
"""


def test_source_stage_holds_one_tensor_at_a_time(tmp_path, cfg):
    """A fla-packed synthetic source (written, normalised, hashed) in a child process: its peak RSS
    above the warmed process (the same stage on a tiny shape first) is a fraction of the checkpoint."""
    models = {name: {"family": "rwkv7", "source": {"kind": "synthetic", "seed": 1, "layout": "fla-packed", "shape": shape},
                     "license": "mit"} for name, shape in (("warm", WARM), ("mid", MID))}
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"models": models, "vocab": cfg["vocab"]}),
                            str(tmp_path)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "RECURRENT_COREAI_PROGRESS": "0"})
    assert child.returncode == 0, child.stderr[-2000:]
    mid = json.loads(child.stdout.strip().splitlines()[-1])["mid"]
    grown = mid["peak"] - mid["base"]
    print(f"source stage: warmed process {mid['base'] / 2**20:.0f} MiB, peak {mid['peak'] / 2**20:.0f} MiB, "
          f"checkpoint {mid['bytes'] / 1e6:.0f} MB: {grown / mid['bytes']:.2f}x")
    assert mid["bytes"] > 100e6, mid
    assert grown <= RSS_PER_CHECKPOINT_BYTE * mid["bytes"], (
        f"the source stage took {grown / 1e6:.0f} MB above the warmed process for a {mid['bytes'] / 1e6:.0f} MB "
        f"checkpoint ({grown / mid['bytes']:.2f}x, bound {RSS_PER_CHECKPOINT_BYTE}x): it holds the state dict again")
