"""Read a checkpoint in any layout its family accepts and normalise it (family-generic).

The family (``recurrent_coreai.families.get(name)``) says which layouts it accepts, recognises
them by their tensor names, reads its geometry from ``config.json`` (or off the tensors for a
layout without one) and maps every layout to its ONE normal form, name by name; this module reads
the files. A checkpoint whose tensor names another family recognises is one line naming that
family (``family:`` in config.yaml is wrong).

Weights come from one file, every ``*.safetensors`` of a directory (else every ``*.pth`` / ``*.bin``,
pickles read with ``torch.load(weights_only=True)``: tensors and plain containers only, never
code), or exactly the shards that ``model.safetensors.index.json`` names. Every tensor is checked as it is read (float32/float16/
bfloat16, finite) and stored once; anything else is a :class:`PipelineError` naming it.

A pickle in torch.save's zip format (every ``.pth``/``.bin`` since torch 1.6, transformers'
``pytorch_model.bin``) has its members' CRC-32s checked first, member by member
(:func:`check_zip`): ``torch.load(mmap=True)`` itself never checks them, and a flipped byte would
otherwise be normalised and the reference built from the same wrong bytes. torch.save's legacy
(non-zip, ``_use_new_zipfile_serialization=False``) format stores no checksum: it is read as it
is; only what the unpickler and the value checks see can be caught there. A sparse, meta or
quantized tensor is refused by name; a non-contiguous (strided view, expanded) dense tensor is
read as the values it shows.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors import safe_open

from recurrent_coreai import families
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import why_missing
from recurrent_coreai.util.progress import Progress
from recurrent_coreai.util.safetensors_stream import NORMAL_METADATA, WEIGHT_FILE, save_normalized  # noqa: F401 - re-exported
from recurrent_coreai.util.safetensors_stream import save_streamed

INDEX_FILE = "model.safetensors.index.json"  # the HF sharded layout: {"weight_map": {tensor: shard file}}
PICKLE_SUFFIXES = (".pth", ".bin")  # PyTorch pickles: read with weights_only=True
SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def weight_files(src: Path) -> list[Path]:
    """The weight files of a checkpoint: the file itself, the shards its index names, or every
    ``*.safetensors`` (else every ``*.pth``) of the directory."""
    if src.is_file():
        if src.suffix not in SUFFIXES:
            raise PipelineError(src, f"is not a weights file (suffix {src.suffix or 'none'!r}); accepted are "
                                "*.safetensors, *.pth, *.bin or a directory in Hugging Face layout",
                                "point source.path at the checkpoint's weights file or its directory")
        return [src]
    index = shard_index(src)
    if index is not None:
        return _indexed_files(src, index)
    files = sorted(src.glob("*.safetensors"))
    for suffix in PICKLE_SUFFIXES:
        files = files or sorted(src.glob(f"*{suffix}"))
    if not files:
        raise PipelineError(src, "no *.safetensors, *.pth or *.bin weights found",
                            "point the source at a directory holding the checkpoint")
    return files


def shard_index(src: Path) -> dict[str, str] | None:
    """The ``weight_map`` (tensor -> shard file) of the directory's shard index, if it has one."""
    path = src / INDEX_FILE
    if not path.is_file():
        return None
    fix = "repair or re-download model.safetensors.index.json (or delete it to read every *.safetensors)"
    index = _read_json(path, fix)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise PipelineError(path, "has no weight_map object {tensor: shard file}", fix)
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or Path(shard).suffix != ".safetensors":
            raise PipelineError(path, f"maps tensor {tensor} to {shard!r}, not a *.safetensors file beside the index",
                                fix)
    return weight_map


def _indexed_files(src: Path, index: dict[str, str]) -> list[Path]:
    named = sorted(set(index.values()))
    for shard in named:
        if not (src / shard).is_file():
            raise PipelineError(src / INDEX_FILE, f"names shard {shard}, which is missing",
                                "download every shard the index names (an interrupted download?)")
    unnamed = sorted(p.name for p in src.glob("*.safetensors") if p.name not in named)
    if unnamed:
        raise PipelineError(src / INDEX_FILE, f"does not name {unnamed[0]} ({len(unnamed)} unnamed *.safetensors in "
                            f"{src})", f"remove {unnamed[0]} from the directory or use the index that lists it")
    return [src / shard for shard in named]


ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError, RuntimeError,
              zlib.error, OSError)


def is_zip(f: Path) -> bool:
    """torch.save's zip format (as torch.load tells it: a zip local-file header first)."""
    with open(f, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


def check_zip(f: Path) -> None:
    """Every member of a zip-format torch.save file against its CRC-32, read member by member,
    1 MiB at a time (``ZipFile.testzip``): nothing is held whole. A member whose bytes changed is
    one line naming it (a tensor storage ``<archive>/data/<key>`` or the pickle ``data.pkl``)."""
    fix = "re-download the file (or save it again with torch.save): its bytes changed after it was written"
    try:
        with zipfile.ZipFile(f) as z:
            bad = z.testzip()
    except ZIP_ERRORS as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise PipelineError(f, f"cannot read its zip container ({type(exc).__name__}: {first})",
                            "re-download the file: it is truncated (an interrupted download?) or corrupted") from None
    if bad is not None:
        names = _tensors_stored_in(f, bad) if "/data/" in f"/{bad}" else []
        what = ("the pickle of tensor names and shapes" if bad.endswith("data.pkl") else
                f"the bytes of tensor {', '.join(names)}" if names else
                "the bytes of one tensor storage" if "/data/" in f"/{bad}" else "a torch.save record")
        raise PipelineError(f, f"zip member {bad} ({what}) fails its CRC-32 check: the file is corrupted", fix)


def _data_offsets(f: Path) -> dict[str, int]:
    """Where each member's bytes start in a zip file (after its local header: 30 bytes, the name
    and the extra field, whose lengths are at bytes 26 and 28)."""
    out = {}
    with zipfile.ZipFile(f) as z, open(f, "rb") as fh:
        for info in z.infolist():
            fh.seek(info.header_offset)
            head = fh.read(30)
            out[info.filename] = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + \
                int.from_bytes(head[28:30], "little")
    return out


def _tensors_stored_in(f: Path, member: str) -> list[str]:
    """The names of the tensors whose storage is zip member ``member`` of an (otherwise readable)
    torch.save file; [] when that cannot be told. torch.load(mmap=True) maps the file once and
    each storage is a slice at its member's offset: the storages' addresses, less one common
    base, are the members' offsets. Nothing of the damaged bytes is read."""
    try:
        offsets = _data_offsets(f)
        sd = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(sd, Mapping):
            return []
        ptrs = {n: t.untyped_storage().data_ptr() for n, t in sd.items() if isinstance(t, torch.Tensor)}
        starts = {o for name, o in offsets.items() if "/data/" in f"/{name}"}  # the storages
        first = min(ptrs.values(), default=0)
        bases = [first - o for o in starts if all(p - (first - o) in starts for p in ptrs.values())]
        if len(bases) != 1:
            return []
        return [n for n, p in ptrs.items() if p - bases[0] == offsets[member]]
    except Exception:  # noqa: BLE001 - only a better message is at stake: the member is named anyway
        return []


def load_pickle(f: Path, mmap: bool = True) -> object:
    """A PyTorch pickle (``.pth``/``.bin``) loaded with ``weights_only=True``: torch's restricted
    unpickler, which builds tensors and plain containers and refuses any other global (a pickle
    that would call ``os.system`` is refused here, in one line, and never runs). A zip-format file
    has its CRC-32s checked first (:func:`check_zip`); a legacy one has none to check."""
    import pickle

    if is_zip(f):
        check_zip(f)
    try:
        return torch.load(f, map_location="cpu", mmap=mmap, weights_only=True)
    except RuntimeError as exc:
        if mmap and "mmap can only be used" in str(exc):  # a legacy (non-zip) torch.save: read it whole
            return load_pickle(f, mmap=False)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise PipelineError(f, f"cannot read PyTorch checkpoint ({type(exc).__name__}: {first})",
                            "re-download the file; it is truncated or not a state dict") from None
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        unsafe = next((ln for ln in lines if "Unsupported global" in ln or "unsupported global" in ln.lower()), None)
        if unsafe is not None:
            named = re.search(r"global\W+(?:GLOBAL\s+)?([\w.]+)", unsafe, re.I)  # torch words it several ways
            what = named[1].rstrip(".,") if named else "a global"
            raise PipelineError(f, f"the pickle refers to {what}, which weights_only loading refuses (it would run "
                                "code, not load tensors)", "use a checkpoint of plain tensors (a state dict saved "
                                "with torch.save, or safetensors) from a source you trust") from None
        # torch's text starts with paragraphs about its weights_only default: the reason is after "error:"
        said = next((ln for i, ln in enumerate(lines) if i and "error:" in lines[i - 1].lower()), None) or \
            (lines[0] if lines else type(exc).__name__)
        raise PipelineError(f, f"cannot unpickle it ({said[:200]})",
                            "re-download the file; it is truncated or not a PyTorch state dict") from None
    except (EOFError, ValueError, zipfile.BadZipFile, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise PipelineError(f, f"cannot read PyTorch checkpoint ({type(exc).__name__}: {first})",
                            "re-download the file; it is truncated or not a state dict") from None


def _file_tensors(f: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one weights file; safetensors are mmap'd, not copied."""
    if f.suffix in PICKLE_SUFFIXES:
        sd = load_pickle(f)
        fix = "save the weights as a state dict: torch.save(model.state_dict(), path)"
        if not isinstance(sd, Mapping):
            raise PipelineError(f, f"holds a {type(sd).__name__}, not a state dict of tensors", fix)
        for name, t in sd.items():
            if not isinstance(name, str):
                raise PipelineError(f, f"has a key {name!r} that is not a tensor name", fix)
            if not isinstance(t, torch.Tensor):
                raise PipelineError(f, f"entry {name!r} is not a tensor ({type(t).__name__})", fix)
        yield from sd.items()
        return
    try:
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad headers
        raise PipelineError(f, f"cannot read safetensors ({exc})",
                            "re-download the file; it is truncated or corrupted") from None


def check_storage(f: Path, name: str, t: torch.Tensor) -> None:
    """A weight must be a dense array with data: a sparse, meta or quantized tensor (a pickle can
    hold each) is one line naming it. A non-contiguous dense one (a transposed or expanded view) is
    fine: its values are what it shows."""
    shape = list(t.shape)
    if t.layout != torch.strided:
        layout = str(t.layout).removeprefix("torch.")
        raise PipelineError(f, f"tensor {name} is stored in the {layout} layout (sparse), not as a dense array",
                            "save dense weights: torch.save({k: v.to_dense() for k, v in state_dict.items()}, path)")
    if t.is_meta:
        raise PipelineError(f, f"tensor {name} is a meta tensor: shape {shape} but no data (saved from a model "
                            "built on the meta device, before its weights were loaded)",
                            "save the state dict after the weights are loaded (or use the original checkpoint)")
    if t.is_quantized:
        raise PipelineError(f, f"tensor {name} is quantized ({str(t.dtype).removeprefix('torch.')}, "
                            f"{str(t.qscheme()).removeprefix('torch.')}); weights must be float32, float16 or "
                            "bfloat16", "use the unquantized checkpoint (or save t.dequantize() of each tensor)")


def check_values(f: Path, name: str, t: torch.Tensor) -> None:
    """A weight must be a dense array (:func:`check_storage`), floating point and finite. One fused
    min/max pass (no copy of the tensor); the NaN/Inf count is only computed for the message."""
    check_storage(f, name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise PipelineError(f, f"tensor {name} has dtype {str(t.dtype).removeprefix('torch.')}; weights must be "
                            "float32, float16 or bfloat16", "the file is corrupted or not a model checkpoint: "
                            "re-download it or convert it with floating-point weights")
    if t.numel() and not all(torch.isfinite(x) for x in torch.aminmax(t)):
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        raise PipelineError(f, f"tensor {name} has {nan} NaN and {inf} infinite values (of {t.numel()})",
                            "the weights are corrupted (or come from a diverged run): "
                            "re-download or use another checkpoint")


def read_tensors(files: list[Path], index: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the given files, each checked as it is read (see :func:`check_values`).
    A tensor in two files is an error; with a shard ``index``, every tensor must come from the
    shard the index maps it to."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        for name, t in _file_tensors(f):
            if name in origin:
                raise PipelineError(f.parent, f"tensor {name} is in both {origin[name].name} and {f.name}",
                                    "remove the stale or duplicated shard so that each tensor is stored once")
            if index is not None and index.get(name) != f.name:
                what = (f"holds tensor {name}, which {INDEX_FILE} maps to {index[name]}" if name in index
                        else f"holds tensor {name}, which {INDEX_FILE} does not list")
                raise PipelineError(f, what, "re-download the checkpoint: its shards and index do not match")
            check_values(f, name, t)
            out[name], origin[name] = t, f
    for name, shard in (index or {}).items():
        if name not in out:
            raise PipelineError(files[0].parent / INDEX_FILE, f"maps tensor {name} to {shard}, which does not hold it",
                                "re-download the checkpoint: its shards and index do not match")
    return out


def _read_json(path: Path, fix: str) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PipelineError(path, f"invalid JSON ({exc.msg} at line {exc.lineno})", fix) from None
    except UnicodeDecodeError as exc:
        raise PipelineError(path, f"is not UTF-8 text (byte {exc.start})", fix) from None


def check_family(family, names, where: str | Path) -> str:
    """The layout ``family`` recognises in these tensor names; names another family recognises
    (an RWKV-7 checkpoint given as ``family: rwkv6``) or none does are one line."""
    names = list(names)
    layout = family.detect_layout(names)
    if layout is not None:
        return layout
    others = [(f, lay) for f, lay in families.detect(names) if f != family.name]
    if others:
        fam, lay = others[0]
        raise PipelineError(where, f"the tensors look like a {families.get(fam).display_name} checkpoint ({fam}, "
                            f"{lay} layout), not {family.display_name}", f"set family: {fam} for this model in "
                            f"config.yaml (or point the source at a {family.name} checkpoint)")
    sample = ", ".join(sorted(names)[:3]) or "no tensors"
    raise PipelineError(where, f"no {family.display_name} layout has these tensor names ({sample}, ...)",
                        f"use a checkpoint in one of the layouts {', '.join(family.layouts)}")


def detect_family(names, where: str | Path):
    """The one registered family that recognises these tensor names (when the caller names none)."""
    found = families.detect(names)
    if len(found) != 1:
        what = ("no registered family recognises these tensor names" if not found
                else f"the tensor names fit several families ({', '.join(f for f, _ in found)})")
        raise PipelineError(where, what, f"name the family (one of {', '.join(families.available())})")
    return families.get(found[0][0])


def load_geometry(family, src: Path):
    cfg_path = src / "config.json"
    if cfg_path.is_dir():
        raise PipelineError(cfg_path, "is a directory, not a file", "replace it with the checkpoint's config.json")
    if not cfg_path.is_file() and cfg_path.is_symlink():  # a link loop or a broken link: not "missing"
        raise PipelineError(cfg_path, why_missing(cfg_path), "replace it with the checkpoint's config.json")
    if not cfg_path.is_file():
        raise PipelineError(src, "config.json is missing", "use a snapshot in Hugging Face layout (config.json + weights)")
    return family.geometry_from_config(_read_json(cfg_path, "repair or re-download config.json"), cfg_path)


def _geometry(family, layout: str, shapes: Mapping[str, tuple], cfg_dir: Path, where, used: list[Path]):
    """From config.json when there is one, else off the tensors (a layout without config.json)."""
    if not (cfg_dir / "config.json").exists():
        geom = family.geometry_from_tensors(shapes, layout, where)
        if geom is not None:
            return geom
    used.append(cfg_dir / "config.json")
    return load_geometry(family, cfg_dir)


@dataclass(frozen=True)
class Checkpoint:
    geometry: object                  # the family's Geometry
    tensors: dict[str, torch.Tensor]  # the normal form, in the family's normal_shapes order
    layout: str                       # the layout it was read from
    weights: list[Path]               # the weight files read
    inputs: list[Path]                # every file read: the weights, the shard index, config.json
    family: object = None             # the family that read it


def read_checkpoint(src: str | Path, family=None) -> Checkpoint:
    """Read, check and normalise an HF-layout directory or a single weights file, in one pass over
    the weights (mmap'd where possible). A layout without config.json (a BlinkDL .pth) takes its
    geometry off the tensors when the family can."""
    src = Path(src)
    files = weight_files(src)
    where = files[0] if len(files) == 1 else src
    index = shard_index(src) if src.is_dir() else None
    raw = read_tensors(files, index)
    family = family or detect_family(raw.keys(), where)
    layout = check_family(family, raw.keys(), where)
    cfg_dir = src if src.is_dir() else src.parent
    used = list(files) + ([src / INDEX_FILE] if index is not None else [])
    geom = _geometry(family, layout, {k: tuple(v.shape) for k, v in raw.items()}, cfg_dir, where, used)
    return Checkpoint(geom, family.normalize(raw, geom, where), layout, files, used, family)


def load_checkpoint(src: str | Path, dtype: torch.dtype | None = None, family=None) -> tuple[object, dict[str, torch.Tensor]]:
    """Geometry and normalised weights (see :func:`read_checkpoint`), optionally cast to ``dtype``."""
    ck = read_checkpoint(src, family)
    sd = ck.tensors if dtype is None else {k: v.to(dtype) for k, v in ck.tensors.items()}
    return ck.geometry, sd


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
READ_CHUNK = 16 << 20  # bytes read at a time when streaming a tensor


def _safetensors_header(f: Path) -> tuple[dict, int]:
    """(header entries without ``__metadata__``, offset where the data starts) of a safetensors file."""
    fix = "re-download the file; it is truncated or corrupted"
    try:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
    except (OSError, ValueError) as exc:
        raise PipelineError(f, f"cannot read safetensors header ({exc})", fix) from None
    if not isinstance(header, dict):
        raise PipelineError(f, "safetensors header is not an object", fix)
    header.pop("__metadata__", None)
    return header, 8 + size


def _read_into(fh, f: Path, name: str, entry: dict, start: int, out: torch.Tensor) -> None:
    """Fill ``out`` (the target dtype) from one tensor of an open safetensors file, READ_CHUNK
    bytes at a time: each chunk is checked in its stored dtype (:func:`check_values`), then cast."""
    src = SAFETENSORS_DTYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    flat, item = out.view(-1), torch.empty((), dtype=src).element_size()
    if (end - begin) != flat.numel() * item:
        raise PipelineError(f, f"tensor {name} has {end - begin} bytes for shape {entry['shape']}",
                            "re-download the file; it is truncated or corrupted")
    step = max(READ_CHUNK // item, 1)
    buf = torch.empty(min(step, flat.numel()) * item, dtype=torch.uint8)
    fh.seek(start + begin)
    for at in range(0, flat.numel(), step):
        n = min(step, flat.numel() - at)
        if fh.readinto(buf[:n * item].numpy()) != n * item:
            raise PipelineError(f, f"tensor {name} is cut short", "re-download the file; it is truncated")
        chunk = buf[:n * item].view(src)
        if chunk.numel() and not all(torch.isfinite(x) for x in torch.aminmax(chunk)):
            with safe_open(f, framework="pt") as whole:  # rare: the whole tensor for the exact message
                check_values(f, name, whole.get_tensor(name))
        flat[at:at + n].copy_(chunk)


def stream_checkpoint(src: str | Path, dtype: torch.dtype, family=None) -> tuple[object, Iterator[tuple[str, torch.Tensor]]]:
    """Geometry and the normalised weights as (name, tensor) pairs in ``dtype``, one tensor at a
    time: for a directory holding one split-layout ``model.safetensors`` (the source stage's
    output) each tensor is read straight from the file into ``dtype`` — never a whole fp32 copy
    of the checkpoint. Names and shapes are checked (the family's ``normalize`` on meta tensors)
    before any data is read. Any other layout goes through :func:`read_checkpoint` and is cast
    tensor by tensor."""
    src = Path(src)
    files = weight_files(src)
    if not (src.is_dir() and len(files) == 1 and files[0].suffix == ".safetensors" and shard_index(src) is None):
        ck = read_checkpoint(src, family)
        return ck.geometry, ((k, v.to(dtype)) for k, v in ck.tensors.items())
    f = files[0]
    header, start = _safetensors_header(f)
    family = family or detect_family(header, f)
    if (family.detect_layout(header) != family.layouts[0]
            or any(e.get("dtype") not in SAFETENSORS_DTYPES for e in header.values())):
        ck = read_checkpoint(src, family)
        return ck.geometry, ((k, v.to(dtype)) for k, v in ck.tensors.items())
    geom = load_geometry(family, src)
    meta = family.normalize({k: torch.empty(e["shape"], device="meta") for k, e in header.items()}, geom, f)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with open(f, "rb") as fh:
            for name, like in meta.items():
                out = torch.empty(like.shape, dtype=dtype)
                _read_into(fh, f, name, header[name], start, out)
                yield name, out
    return geom, tensors()


def _scan_safetensors(files: list[Path], index: Mapping[str, str] | None) -> dict[str, tuple] | None:
    """name -> (file, dtype, shape) of every tensor, from the headers alone; None if anything there
    is off (an unreadable header, a tensor in two files or in the wrong shard, a dtype that is not
    float32/float16/bfloat16): :func:`read_tensors` then reads the files and names the problem."""
    refs: dict[str, tuple[Path, torch.dtype, tuple]] = {}
    try:
        for f in files:
            with safe_open(f, framework="pt", backend="pread") as fh:
                for name in fh.keys():
                    info = fh.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(info.get_dtype())
                    if name in refs or dtype is None or (index is not None and index.get(name) != f.name):
                        return None
                    refs[name] = (f, dtype, tuple(info.get_shape()))
    except Exception:  # noqa: BLE001 - safetensors raises several types for bad headers
        return None
    return None if index is not None and set(index) - set(refs) else refs


def _write_in_memory(family, src: Path, dst: Path) -> Checkpoint:
    ck = read_checkpoint(src, family)
    if (ck.layout == ck.family.layouts[0] and len(ck.weights) == 1 and ck.weights[0].suffix == ".safetensors"
            and set(_safetensors_header(ck.weights[0])[0]) == set(ck.tensors)):
        shutil.copyfile(ck.weights[0], dst)  # already the normal form: bytes unchanged
    # else normalising changed it: e.g. a tied head the file leaves out (Hugging Face's Mamba-2)
    else:
        save_normalized(ck.tensors, dst)
    return ck


def write_normalized(src: str | Path, dst: str | Path, family=None) -> Checkpoint:
    """Read, check and normalise ``src`` as :func:`read_checkpoint` does and write the normal form to
    ``dst`` as :func:`save_normalized` does (a single split-layout ``.safetensors`` is copied
    unchanged), holding one tensor at a time: names, dtypes and shapes are checked from the
    safetensors headers before any data is read, then each tensor is read (pread, never mmap'd),
    checked (:func:`check_values`), turned into its normal-form parts (the family's ``normal_parts``:
    renames, splits) and written at its place in ``dst`` (:mod:`.safetensors_stream`, the bytes of
    ``save_file``). The returned Checkpoint's tensors are on the meta device (names, shapes,
    dtypes). A pickle, a layout that must be read whole, or a checkpoint whose headers, config.json
    or names show a problem, is read whole by :func:`read_checkpoint`, which reports it as ever."""
    src, dst = Path(src), Path(dst)
    files = weight_files(src)
    index = shard_index(src) if src.is_dir() else None
    refs = _scan_safetensors(files, index) if all(f.suffix == ".safetensors" for f in files) else None
    if family is None and refs is not None:
        family = detect_family(refs, files[0] if len(files) == 1 else src)
    layout = family.detect_layout(refs) if refs is not None else None
    if layout is None or not family.streams(layout):
        return _write_in_memory(family, src, dst)
    cfg_dir = src if src.is_dir() else src.parent
    try:
        geom = load_geometry(family, cfg_dir)
        meta = family.normalize({n: torch.empty(shape, dtype=dtype, device="meta")
                                 for n, (_, dtype, shape) in refs.items()}, geom, files[0] if len(files) == 1 else src)
    except PipelineError:  # read_tensors first: a bad value is reported before a bad name, as ever
        return _write_in_memory(family, src, dst)
    used = list(files) + ([src / INDEX_FILE] if index is not None else []) + [cfg_dir / "config.json"]
    copy = layout == family.layouts[0] and len(files) == 1

    def checked() -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of every file, in read_tensors' order, checked, in its normal form."""
        total = sum(torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in refs.values())
        with Progress("normalising weights", total=total, unit="B") as bar:
            for f in files:
                with safe_open(f, framework="pt", backend="pread") as fh:
                    for name in fh.keys():
                        try:
                            t = fh.get_tensor(name)
                        except Exception as exc:  # noqa: BLE001 - as _file_tensors reports it
                            raise PipelineError(f, f"cannot read safetensors ({exc})",
                                                "re-download the file; it is truncated or corrupted") from None
                        check_values(f, name, t)
                        yield from family.normal_parts(layout, name, t)
                        bar.update(t.numel() * t.element_size())
                        del t

    if copy:
        for name, t in checked():
            del t  # checked; nothing to write
        shutil.copyfile(files[0], dst)  # already the normal form: bytes unchanged
    else:
        save_streamed(dst, {n: (t.dtype, tuple(t.shape)) for n, t in meta.items()}, checked(), NORMAL_METADATA)
    return Checkpoint(geom, meta, layout, files, used, family)
