"""A small, strict reader and a streaming writer for the safetensors format.

Format: 8 bytes little-endian header length N, N bytes of JSON header
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the raw tensor
bytes, little-endian, C order, offsets relative to the end of the header.

Why our own: the reference library's numpy backend has no bfloat16, and the weight bridge needs (1) memory
maps so that a host reads only the slices of a tensor its devices hold, (2) a writer that streams tensor by
tensor while hashing, and (3) errors that name the file and what is wrong with it. Files written here load in
`safetensors`, `transformers` and vLLM (tests check that).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file is malformed or truncated; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def dtype_name(dtype) -> str:
    try:
        return DTYPE_NAMES[np.dtype(dtype)]
    except KeyError:
        raise SafetensorsError(
            f"dtype {dtype} has no safetensors name (supported: {sorted(DTYPE_NAMES.values())})"
        ) from None


class SafetensorsFile:
    """Parse and validate a file's header; `array(name)` is a read-only memory map of one tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise SafetensorsError(f"{self.path}: corrupt safetensors file: {size} bytes, no header length")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER_BYTES or n + 8 > size:
                    raise SafetensorsError(
                        f"{self.path}: corrupt safetensors file: header length {n} does not fit in {size} bytes"
                    )
                raw = f.read(n)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read ({e})") from e
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{self.path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, entry in header.items():
            info = self._entry(name, entry, size)
            self.tensors[name] = info
            spans.append((info.begin, info.end, name))
        pos = self.data_start
        for begin, end, name in sorted(spans):
            if begin != pos:
                raise SafetensorsError(
                    f"{self.path}: corrupt safetensors file: tensor {name!r} starts at {begin - self.data_start}, "
                    f"expected {pos - self.data_start} (overlap or hole)"
                )
            pos = end
        if pos != size:
            raise SafetensorsError(
                f"{self.path}: corrupt safetensors file: tensors end at byte {pos} but the file has {size} bytes"
            )

    def _entry(self, name: str, entry, size: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise SafetensorsError(f"{where}: header entry needs dtype, shape and data_offsets, got {entry!r}")
        if entry["dtype"] not in DTYPES:
            raise SafetensorsError(f"{where}: unsupported dtype {entry['dtype']!r}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise SafetensorsError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise SafetensorsError(f"{where}: bad data_offsets {offsets!r}")
        dtype = DTYPES[entry["dtype"]]
        begin, end = self.data_start + offsets[0], self.data_start + offsets[1]
        if end - begin != math.prod(shape) * dtype.itemsize or begin < self.data_start:
            raise SafetensorsError(
                f"{where}: data_offsets {offsets} hold {end - begin} bytes but shape {shape} of {entry['dtype']} "
                f"needs {math.prod(shape) * dtype.itemsize}"
            )
        if end > size:
            raise SafetensorsError(f"{where}: data ends at byte {end} but the file has only {size} (truncated?)")
        return TensorInfo(name, dtype, tuple(shape), begin, end)

    def array(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info.nbytes == 0:
            return np.zeros(info.shape, info.dtype)
        return np.memmap(self.path, dtype=info.dtype, mode="r", offset=info.begin, shape=info.shape)


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written: name, dtype, shape (its bytes are produced later, in order)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def encode_header(tensors: Iterable[PlannedTensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length plus JSON header for tensors laid out back to back in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so that the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw
