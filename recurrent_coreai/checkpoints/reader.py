"""Read a checkpoint in any layout its family accepts and normalise it (family-generic).

The family (``recurrent_coreai.families.get(name)``) says which layouts it accepts, recognises
them by their tensor names, reads its geometry from ``config.json`` (or off the tensors for a
layout without one) and maps every layout to its ONE normal form, name by name; this module reads
the files. A checkpoint whose tensor names another family recognises is one line naming that
family (``family:`` in config.yaml is wrong).

Weights come from one file, every ``*.safetensors`` of a directory (else every ``*.pth`` / ``*.bin``,
pickles read with ``torch.load(weights_only=True)``: tensors and plain containers only, never
code), or exactly the shards that ``model.safetensors.index.json`` names. Every tensor is checked
(float32/float16/bfloat16, finite) and stored once; anything else is a :class:`PipelineError`
naming it.

ONE read path (:class:`Stored`) serves every reader here: it opens the weight files -- safetensors
with ``safe_open`` (pread, never a whole-file map), pickles with ``torch.load(mmap=True,
weights_only=True)`` -- and knows every tensor's name, dtype and shape, checked (a tensor in two
files, a shard the index does not name it in, a sparse, meta or quantized tensor, a dtype other
than float32/float16/bfloat16), before any value is read; then it reads tensors one at a time,
each checked as read (:func:`check_values`), a safetensors tensor in slices of rows straight into
the dtype asked for. On it: :func:`read_checkpoint` (the whole normal form in memory: the
reference), :func:`stream_checkpoint` (the normal form one tensor at a time in a dtype: the
export) and :func:`write_normalized` (the normal form written one tensor at a time: the source
stage). Where a problem is in the names (the family, the layout, config.json, a missing or
misshaped tensor) the values are checked first, so a corrupted file is named as corrupted
whatever else is wrong with it.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from safetensors import safe_open

from recurrent_coreai import families
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import why_missing
from recurrent_coreai.util.progress import Progress
from recurrent_coreai.util.safetensors_stream import NORMAL_METADATA, WEIGHT_FILE, save_normalized  # noqa: F401 - re-exported
from recurrent_coreai.util.safetensors_stream import TORCH_DTYPES, save_streamed

INDEX_FILE = "model.safetensors.index.json"  # the HF sharded layout: {"weight_map": {tensor: shard file}}
PICKLE_SUFFIXES = (".pth", ".bin")  # PyTorch pickles: read with weights_only=True
SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
READ_CHUNK = 16 << 20  # bytes of a safetensors tensor read at a time when it is read into another dtype
UNREADABLE = "re-download the file; it is truncated or corrupted"


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


def load_pickle(f: Path) -> object:
    """A PyTorch pickle (``.pth``/``.bin``) loaded with ``weights_only=True``: torch's restricted
    unpickler, which builds tensors and plain containers and refuses any other global (a pickle
    that would call ``os.system`` is refused here, in one line, and never runs). A zip-format file
    has its CRC-32s checked first (:func:`check_zip`) and is memory-mapped (``mmap=True``: a
    tensor's bytes are read when used); a legacy one has no checksum to check and no zip members
    to map: it is read whole."""
    import pickle

    zipped = is_zip(f)
    if zipped:
        check_zip(f)
    try:
        return torch.load(f, map_location="cpu", mmap=zipped, weights_only=True)
    except RuntimeError as exc:
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


def check_dtype(f: Path, name: str, dtype: torch.dtype | str) -> None:
    """A weight is float32, float16 or bfloat16 (``dtype`` a torch dtype, or a safetensors name
    torch has none for)."""
    if dtype not in FLOAT_DTYPES:
        said = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        raise PipelineError(f, f"tensor {name} has dtype {said}; weights must be float32, float16 or bfloat16",
                            "the file is corrupted or not a model checkpoint: re-download it or convert it with "
                            "floating-point weights")


def check_values(f: Path, name: str, t: torch.Tensor) -> None:
    """A weight must be a dense array (:func:`check_storage`), floating point (:func:`check_dtype`)
    and finite. One fused min/max pass (no copy of the tensor); the NaN/Inf count is only computed
    for the message."""
    check_storage(f, name, t)
    check_dtype(f, name, t.dtype)
    if not _finite(t):
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        raise PipelineError(f, f"tensor {name} has {nan} NaN and {inf} infinite values (of {t.numel()})",
                            "the weights are corrupted (or come from a diverged run): "
                            "re-download or use another checkpoint")


def _finite(t: torch.Tensor) -> bool:
    return not t.numel() or all(bool(torch.isfinite(x)) for x in torch.aminmax(t))


@dataclass(frozen=True)
class Entry:
    """One stored tensor, as its file's header (or pickle) says, before its values are read."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass
class Stored:
    """The weight files of one checkpoint, opened (:meth:`open`): every tensor's :class:`Entry`
    (in file order, then each file's own order), checked, before any value is read; values are
    read one tensor at a time, each checked as it is read."""

    src: Path
    files: list[Path]
    index: dict[str, str] | None
    entries: dict[str, Entry] = field(default_factory=dict)
    _pickled: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # mmap'd, read when used
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)          # open safe_open readers

    @classmethod
    def open(cls, src: str | Path) -> "Stored":
        """A checkpoint: a weights file, or a directory (:func:`weight_files`, :func:`shard_index`)."""
        src = Path(src)
        return cls.of(src, weight_files(src), shard_index(src) if src.is_dir() else None)

    @classmethod
    def of(cls, src: Path, files: list[Path], index: Mapping[str, str] | None) -> "Stored":
        stored = cls(src, list(files), dict(index) if index is not None else None)
        for f in stored.files:
            for name, dtype, shape in stored._scan(f):
                stored._add(f, name, dtype, shape)
        for name, shard in (stored.index or {}).items():
            if name not in stored.entries:
                raise PipelineError(stored.files[0].parent / INDEX_FILE, f"maps tensor {name} to {shard}, which "
                                    "does not hold it", "re-download the checkpoint: its shards and index do not match")
        return stored

    @property
    def where(self) -> Path:
        """What a message about the tensors names: the one weights file, or the directory."""
        return self.files[0] if len(self.files) == 1 else self.src

    @property
    def inputs(self) -> list[Path]:
        """The files read for the tensors: the weights and the shard index."""
        return list(self.files) + ([self.src / INDEX_FILE] if self.index is not None else [])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: e.shape for name, e in self.entries.items()}

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor on the meta device (names, dtypes, shapes): what a family normalises first."""
        return {name: torch.empty(e.shape, dtype=e.dtype, device="meta") for name, e in self.entries.items()}

    # --- opening ----------------------------------------------------------------------------
    def _scan(self, f: Path) -> Iterator[tuple[str, torch.dtype | str, tuple[int, ...]]]:
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
            for name, t in sd.items():
                self._pickled[name] = t
                yield name, t.dtype, tuple(t.shape)
            return
        fh = self._reader(f)
        try:
            for name in fh.keys():
                info = fh.get_slice(name)
                yield name, TORCH_DTYPES.get(info.get_dtype(), info.get_dtype()), tuple(info.get_shape())
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad headers
            raise PipelineError(f, f"cannot read safetensors ({exc})", UNREADABLE) from None

    def _add(self, f: Path, name: str, dtype: torch.dtype | str, shape: tuple[int, ...]) -> None:
        if name in self.entries:
            raise PipelineError(f.parent, f"tensor {name} is in both {self.entries[name].file.name} and {f.name}",
                                "remove the stale or duplicated shard so that each tensor is stored once")
        if self.index is not None and self.index.get(name) != f.name:
            what = (f"holds tensor {name}, which {INDEX_FILE} maps to {self.index[name]}" if name in self.index
                    else f"holds tensor {name}, which {INDEX_FILE} does not list")
            raise PipelineError(f, what, "re-download the checkpoint: its shards and index do not match")
        if name in self._pickled:
            check_storage(f, name, self._pickled[name])
        check_dtype(f, name, dtype)
        self.entries[name] = Entry(f, dtype, shape)  # type: ignore[arg-type]

    def _reader(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(f, framework="pt", backend="pread")
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad headers
                raise PipelineError(f, f"cannot read safetensors ({exc})", UNREADABLE) from None
        return self._handles[f]

    # --- reading ----------------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """One tensor as stored (a pickle's: its mmap'd view), its values checked."""
        e = self.entries[name]
        if name in self._pickled:
            t = self._pickled[name]
        else:
            try:
                t = self._reader(e.file).get_tensor(name)
            except Exception as exc:  # noqa: BLE001 - as the header's errors
                raise PipelineError(e.file, f"cannot read safetensors ({exc})", UNREADABLE) from None
        check_values(e.file, name, t)
        return t

    def read_as(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One tensor in ``dtype``, its values checked in the stored dtype. A safetensors tensor of
        another dtype is read READ_CHUNK bytes at a time straight into it (safe_open reads a
        tensor whole, slices too): never a whole copy in its stored dtype beside it."""
        e = self.entries[name]
        if name in self._pickled or e.dtype == dtype or e.nbytes <= READ_CHUNK:
            return self.read(name).to(dtype)
        out = torch.empty(e.shape, dtype=dtype)
        flat, item, at = out.view(-1), e.dtype.itemsize, 0
        step = READ_CHUNK // item
        buf = torch.empty(step * item, dtype=torch.uint8)
        with open(e.file, "rb") as fh:
            fh.seek(self._data_start(e.file, name))
            while at < flat.numel():
                n = min(step, flat.numel() - at)
                if fh.readinto(buf[:n * item].numpy()) != n * item:
                    raise PipelineError(e.file, f"tensor {name} is cut short", "re-download the file; it is truncated")
                chunk = buf[:n * item].view(e.dtype)
                if not _finite(chunk):
                    self.read(name)  # rare: the whole tensor, for the exact count in the message
                flat[at:at + n].copy_(chunk)
                at += n
        return out

    def _data_start(self, f: Path, name: str) -> int:
        """Where a tensor's bytes start in a safetensors file safe_open has read (its header:
        8 bytes of length, the JSON, then the data at the entry's data_offsets)."""
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            return 8 + size + json.loads(fh.read(size))[name]["data_offsets"][0]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as stored, in file order, checked (:meth:`read`)."""
        for name in self.entries:
            yield name, self.read(name)

    def read_all(self) -> dict[str, torch.Tensor]:
        return dict(self)

    def check_all(self) -> None:
        """Every tensor's values, one at a time (nothing is kept)."""
        for name, t in self:
            del t


def read_tensors(files: list[Path], index: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the given files (one checkpoint's), each checked (:class:`Stored`): a tensor in
    two files is an error; with a shard ``index``, every tensor must come from the shard the index
    maps it to."""
    return Stored.of(files[0] if len(files) == 1 else files[0].parent, files, index).read_all()


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


def _geometry(family, layout: str, stored: Stored, cfg_dir: Path, where) -> tuple[object, list[Path]]:
    """From config.json when there is one, else off the tensors (a layout without config.json);
    with the config.json read, if one was."""
    if not (cfg_dir / "config.json").exists():
        geom = family.geometry_from_tensors(stored.shapes(), layout, where)
        if geom is not None:
            return geom, []
    return load_geometry(family, cfg_dir), [cfg_dir / "config.json"]


@dataclass(frozen=True)
class Plan:
    """What the names, the headers and config.json say, before a value is read."""

    family: object
    layout: str
    geometry: object
    inputs: list[Path]                    # every file read: the weights, the shard index, config.json
    meta: dict[str, torch.Tensor] | None  # the normal form on the meta device (see :func:`plan`), else None


def plan(stored: Stored, family=None, checked: bool = False, geometry=None) -> Plan:
    """The family (given, or the one that recognises the names), the layout, the geometry (given:
    what the source stage recorded; else from config.json or the tensors) and, for
    a layout that normalises tensor by tensor (``family.normal_stream``) or is the normal form itself,
    the normal form's names and shapes (``family.normalize`` on meta tensors: a missing, extra or
    misshaped tensor is named here). A problem here is reported after every value is checked
    (``checked``: they were already): a corrupted file is named as corrupted first."""
    where = stored.where
    try:
        family = family or detect_family(stored.entries, where)
        layout = check_family(family, stored.entries, where)
        cfg_dir = stored.src if stored.src.is_dir() else stored.src.parent
        geom, cfg = (geometry, []) if geometry is not None else _geometry(family, layout, stored, cfg_dir, where)
        by_name = family.normal_stream(layout, geom, stored.entries) is not None or layout == family.layouts[0]
        meta = family.normalize(stored.meta(), geom, where) if by_name else None
    except PipelineError:
        if not checked:
            stored.check_all()
        raise
    return Plan(family, layout, geom, stored.inputs + cfg, meta)


@dataclass(frozen=True)
class Checkpoint:
    geometry: object                  # the family's Geometry
    tensors: dict[str, torch.Tensor]  # the normal form, in the family's normal_shapes order
    layout: str                       # the layout it was read from
    weights: list[Path]               # the weight files read
    inputs: list[Path]                # every file read: the weights, the shard index, config.json
    family: object = None             # the family that read it


def read_checkpoint(src: str | Path, family=None) -> Checkpoint:
    """Read, check and normalise an HF-layout directory or a single weights file, whole (every
    value checked before the names are). A layout without config.json (a BlinkDL .pth) takes its
    geometry off the tensors when the family can."""
    stored = Stored.open(src)
    raw = stored.read_all()
    p = plan(stored, family, checked=True)
    return Checkpoint(p.geometry, p.family.normalize(raw, p.geometry, stored.where), p.layout, stored.files,
                      p.inputs, p.family)


def load_checkpoint(src: str | Path, dtype: torch.dtype | None = None, family=None) -> tuple[object, dict[str, torch.Tensor]]:
    """Geometry and normalised weights (see :func:`read_checkpoint`), optionally cast to ``dtype``."""
    ck = read_checkpoint(src, family)
    sd = ck.tensors if dtype is None else {k: v.to(dtype) for k, v in ck.tensors.items()}
    return ck.geometry, sd


def stream_checkpoint(src: str | Path, dtype: torch.dtype, family=None,
                      geometry=None) -> tuple[object, Iterator[tuple[str, torch.Tensor]]]:
    """Geometry and the normalised weights as (name, tensor) pairs in ``dtype``, in the normal
    form's order, one tensor at a time: a checkpoint that is the normal form tensor for tensor
    (the source stage's output) is read by name straight into ``dtype`` (:meth:`Stored.read_as`),
    never a whole copy of it, its names and shapes checked before any value is read. Any other is
    read whole and normalised, then cast tensor by tensor. ``geometry``: the one the source stage
    recorded (its manifest), taken as it is instead of read again from config.json."""
    stored = Stored.open(src)
    p = plan(stored, family, geometry=geometry)
    if p.layout == p.family.layouts[0] and p.meta is not None and set(p.meta) == set(stored.entries):
        return p.geometry, ((name, stored.read_as(name, dtype)) for name in p.meta)
    normal = p.family.normalize(stored.read_all(), p.geometry, stored.where)  # e.g. a tied head left out
    return p.geometry, ((k, v.to(dtype)) for k, v in normal.items())


class TiedCheck:
    """A head that config.json ties to the embedding (``family.tied_linears``: ``{linear: the
    embedding's tensor}``) must equal it, read one tensor at a time: each side's digest (its
    values as float32, its shape) is kept as it streams past, the pair compared at the end. The
    whole-file read (the family's ``normalize``) compares the tensors; a streamed read -- a
    sharded checkpoint, or a single file already in the normal form, copied as it is -- did not,
    and a different head was accepted (issue 34, case 4)."""

    def __init__(self, tied: Mapping[str, str], where: str | Path):
        self.pairs = {f"{linear}.weight": embed for linear, embed in tied.items()}
        self.where, self.digests = where, {}

    def see(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pairs or name in self.pairs.values():
            import hashlib

            data = tensor.detach().to(torch.float32).contiguous().numpy().tobytes()
            self.digests[name] = (tuple(tensor.shape), hashlib.sha256(data).hexdigest())

    def check(self) -> None:
        for head, embed in self.pairs.items():
            if head in self.digests and embed in self.digests and self.digests[head] != self.digests[embed]:
                raise PipelineError(self.where, f"tensor {head} differs from the tied embedding {embed} (config.json "
                                    "ties them)", "set tie_word_embeddings false in config.json if the head is its "
                                    "own tensor")


def write_normalized(src: str | Path, dst: str | Path, family=None) -> Checkpoint:
    """Read, check and normalise ``src`` as :func:`read_checkpoint` does and write the normal form to
    ``dst`` as :func:`save_normalized` does (a single normal-form ``.safetensors`` is copied
    unchanged). A layout the family normalises tensor by tensor (``family.normal_stream``) is written
    holding one tensor at a time: names, dtypes and shapes are checked first (:func:`plan`), then
    each tensor is read, checked, turned into its normal-form parts (the family's
    ``normal_stream``, by default its ``normal_parts``: renames, splits) and written at its place in ``dst``
    (:mod:`.safetensors_stream`, the bytes of ``save_file``); the returned Checkpoint's tensors are
    then on the meta device (names, shapes, dtypes). Any other layout is read whole and normalised
    in memory. A family may stream with its geometry and the stored names (``family.normal_stream``:
    e.g. a tied head the file leaves out, written from the embedding)."""
    stored, dst = Stored.open(src), Path(dst)
    p = plan(stored, family)
    as_is = p.layout == p.family.layouts[0] and len(stored.files) == 1 and stored.files[0].suffix == ".safetensors"
    split = p.family.normal_stream(p.layout, p.geometry, stored.entries)
    if split is None:
        normal = p.family.normalize(stored.read_all(), p.geometry, stored.where)
        if as_is and set(stored.entries) == set(normal):
            shutil.copyfile(stored.files[0], dst)  # already the normal form: bytes unchanged
        else:
            save_normalized(normal, dst)
        return Checkpoint(p.geometry, normal, p.layout, stored.files, p.inputs, p.family)

    tied = TiedCheck(p.family.tied_linears(p.geometry), stored.where)

    def parts() -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, in file order, checked, in its normal form; a head stored beside the
        embedding config.json ties it to must equal it (:class:`TiedCheck`), as the whole-file
        read requires."""
        with Progress("normalising weights", total=sum(e.nbytes for e in stored.entries.values()), unit="B") as bar:
            for name, t in stored:
                try:
                    parts = split(name, t)
                except PipelineError as exc:  # a family names the tensor (base.Family.normal_parts); we know the file
                    if exc.where != name:
                        raise
                    raise PipelineError(stored.where, f"tensor {name} {exc.what}", exc.fix) from None
                for part in parts:
                    tied.see(*part)
                yield from parts
                bar.update(t.numel() * t.element_size())
                del t
        tied.check()

    if as_is and set(stored.entries) == set(p.meta):  # not, e.g., a tied head the file leaves out
        for _, t in parts():
            del t  # checked; nothing to write
        shutil.copyfile(stored.files[0], dst)  # already the normal form: bytes unchanged
    else:
        save_streamed(dst, {n: (t.dtype, tuple(t.shape)) for n, t in p.meta.items()}, parts(), NORMAL_METADATA)
    return Checkpoint(p.geometry, p.meta, p.layout, stored.files, p.inputs, p.family)
