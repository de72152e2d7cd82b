"""Write a safetensors file one tensor at a time, byte-identical to ``safetensors.torch.save_file``.

``save_file`` needs every tensor in memory at once. Here the header is written first from the
names, dtypes and shapes alone, and each tensor's bytes go to their place in the file as the
tensor is handed in, in any order: a checkpoint is written holding one tensor at a time.

The layout is the one the safetensors crate (pinned 0.8.0) writes: an 8-byte little-endian header
length; the JSON header (compact, ``__metadata__`` first if given, then the tensors in data
order, each ``{"dtype","shape","data_offsets"}``), padded with spaces to a multiple of 8; then the
data, tensors sorted by dtype (descending, in the crate's ``Dtype`` enum order) and then by
name. ``tests/test_safetensors_stream.py`` checks the bytes against ``save_file``. Differences:
``save_file`` writes a ``__metadata__`` of several keys in a random order (a Rust HashMap), this
writer in the order given; with no tensors and ``metadata={}`` save_file writes a broken header
(``{},"__metadata__":{}}``), this writer ``{"__metadata__":{}}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from recurrent_coreai.util.fsutil import atomic_path
from recurrent_coreai.util.normal_form import WEIGHT_FILE  # noqa: F401 - re-exported: the file it writes

# torch dtype -> safetensors dtype name (safetensors.torch's table)
DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32",
    torch.float32: "F32", torch.complex64: "C64", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e8m0fnu: "F8_E8M0",
}
# the same table read the other way: a safetensors header's dtype name -> torch dtype (what the
# checkpoint reader reads a header with; a name torch has no dtype for is absent)
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPES.items()}
# the crate's ``Dtype`` enum, in declaration order (its ``Ord``): the data area is sorted by it, descending
DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
               "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
ALIGN = 8
NORMAL_METADATA = {"format": "pt"}  # the __metadata__ of a normalised model.safetensors
MAX_WRITE = 1 << 30  # bytes per pwrite call (Linux writes at most ~2 GiB at once)

Spec = tuple[torch.dtype, Sequence[int]]


def layout(specs: Mapping[str, Spec], metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """(everything before the data: length + JSON header + padding, name -> absolute file offset of
    its data) for tensors ``{name: (dtype, shape)}``."""
    rank = {name: i for i, name in enumerate(DTYPE_ORDER)}
    order = sorted(specs, key=lambda n: (-rank[DTYPES[specs[n][0]]], n.encode("utf-8")))
    header: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offsets, at = {}, 0
    for name in order:
        dtype, shape = specs[name]
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": DTYPES[dtype], "shape": [int(s) for s in shape], "data_offsets": [at, at + n]}
        offsets[name], at = at, at + n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % ALIGN)
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, {name: start + off for name, off in offsets.items()}


class _Writer:
    def __init__(self, fd: int, specs: Mapping[str, Spec], metadata: Mapping[str, str] | None):
        self.fd = fd
        self.specs = {name: (dtype, tuple(int(s) for s in shape)) for name, (dtype, shape) in specs.items()}
        head, self.offsets = layout(self.specs, metadata)
        self.todo = set(self.specs)
        self._pwrite(memoryview(head), 0)
        os.ftruncate(fd, len(head) + sum(_nbytes(*s) for s in self.specs.values()))  # holes, filled as tensors come

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Put one tensor's bytes at its place in the file."""
        if name not in self.todo:
            raise ValueError(f"{name} is not a tensor of this file" if name not in self.specs
                             else f"{name} was already written")
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: got {tensor.dtype} {list(tensor.shape)}, declared {dtype} {list(shape)}")
        if tensor.numel():
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            self._pwrite(memoryview(data), self.offsets[name])
        self.todo.discard(name)

    def _pwrite(self, buf: memoryview, at: int) -> None:
        while len(buf):
            n = os.pwrite(self.fd, buf[:MAX_WRITE], at)
            buf, at = buf[n:], at + n


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


@contextlib.contextmanager
def safetensors_writer(path: str | Path, specs: Mapping[str, Spec],
                       metadata: Mapping[str, str] | None = None) -> Iterator[_Writer]:
    """``with safetensors_writer(path, {name: (dtype, shape)}) as w: w.write(name, tensor)`` for
    every declared tensor exactly once, in any order; the file appears at ``path`` (atomically,
    :func:`fsutil.atomic_path`) only when all were written."""
    if sys.byteorder != "little":  # safetensors is little-endian; save_file byte-swaps, we do not
        raise NotImplementedError("streaming safetensors writes need a little-endian machine")
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            w = _Writer(fd, specs, metadata)
            yield w
            if w.todo:
                raise ValueError(f"{len(w.todo)} declared tensors were never written, e.g. {sorted(w.todo)[0]}")
        finally:
            os.close(fd)


def save_streamed(path: str | Path, specs: Mapping[str, Spec], tensors: Iterable[tuple[str, torch.Tensor]],
                  metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``(name, tensor)`` pairs (each declared in ``specs``) to ``path``; the same bytes as
    ``save_file(dict(tensors), path, metadata)``, without holding more than the tensor at hand."""
    with safetensors_writer(path, specs, metadata) as w:
        for name, t in tensors:
            w.write(name, t)
            del t  # not held while the next one is made
    return Path(path)


def save_normalized(sd: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Normal-form weights as ``model.safetensors`` (the bytes of ``safetensors.torch.save_file``).
    Tensors that share one storage (a tied head that torch.save stored once, as in a transformers
    ``pytorch_model.bin``) are each written in full: save_file refuses shared memory."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for k, v in sd.items():
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    save_file(out, str(path), metadata=NORMAL_METADATA)
