"""Delta files: a version's file sent as the zstd-compressed XOR of its bytes with the same file of a base version.

At lr 3e-7 an AdamW step moves most bf16 weights by less than one unit in the last place, so consecutive exports
share most of their bytes: their XOR is mostly zero bytes, which zstd squeezes to a small fraction of the file.
The learner writes the delta files at export (`write_deltas`, called by `bridge.weights.write_version`) against
the previous version and the newest anchor (a version divisible by `ANCHOR_EVERY`), and lists them in the
manifest's `deltas` (`bridge.shardcast.manifest.DeltaEntry`) beside the full files. A client that holds a base
rebuilds the file (`apply_delta`: streaming, a few MiB of memory) and checks it against the full file's sha256
from the manifest before it counts; anything else falls back to the full file.

A delta is made only for a file of the same size in the base whose safetensors header (tensor names, dtypes,
shapes, offsets) is identical: a dtype change or a new tensor sends the full file. A delta that compresses to
more than `MAX_RATIO` of its file is not worth its round trip and is not written either.

Encoding "xor-zstd": one zstd frame whose content is `target XOR base`, byte for byte, exactly as long as the
file (chosen over changed-index/value runs by `benchmarks/shardcast_delta_bytes.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from bridge.shardcast.errors import ShardcastError
from bridge.shardcast.names import MANIFEST_FILE, STABLE_FILE, parse_version_dirname, version_dirname

ENCODING = "xor-zstd"
ANCHOR_EVERY = 8  # every version divisible by this is a base for the deltas of the versions after it
MAX_RATIO = 0.5
CHUNK = 4 << 20
LEVEL = 3

try:
    import zstandard
except ImportError:  # no deltas written, none used: every file goes in full
    zstandard = None

HAVE_ZSTD = zstandard is not None


class DeltaError(ShardcastError):
    """A delta that cannot be made or applied (its base is not the expected one, or its bytes are broken)."""


def delta_name(file: str, base: int) -> str:
    """The delta file of `file` against version `base`: `model-00001-of-00001.safetensors.v000122.xzst`."""
    return f"{file}.{version_dirname(base)}.xzst"


def _safetensors_header(path: Path) -> bytes | None:
    """The length prefix and JSON header of a safetensors file (None for another kind of file)."""
    if not path.name.endswith(".safetensors"):
        return None
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, 100 << 20))


def compatible(base: Path, target: Path) -> bool:
    """Whether a delta of `target` against `base` is meaningful: same size, and for safetensors the same header
    (a dtype change or a new tensor changes it, and then the full file is sent)."""
    try:
        if base.stat().st_size != target.stat().st_size:
            return False
        return _safetensors_header(base) == _safetensors_header(target)
    except OSError:
        return False


def _xor(a: bytes | memoryview, b: bytes | memoryview) -> bytes:
    import numpy as np

    n = len(a)
    if n % 8 == 0:
        return np.bitwise_xor(np.frombuffer(a, np.uint64), np.frombuffer(b, np.uint64)).tobytes()
    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()


class _HashingWriter:
    def __init__(self, f):
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def encode_delta(base: Path, target: Path, out: Path, level: int = LEVEL, threads: int = 0) -> tuple[int, str]:
    """Write `out` = zstd(target XOR base), streaming; returns its (size, sha256)."""
    if zstandard is None:
        raise DeltaError("the zstandard module is not installed")
    size = target.stat().st_size
    cctx = zstandard.ZstdCompressor(level=level, threads=threads)
    with open(base, "rb") as fb, open(target, "rb") as ft, open(out, "wb") as fo:
        sink = _HashingWriter(fo)
        with cctx.stream_writer(sink, size=size, closefd=False) as writer:
            while block := ft.read(CHUNK):
                other = fb.read(len(block))
                if len(other) != len(block):
                    raise DeltaError(f"{base}: shorter than {target}")
                writer.write(_xor(block, other))
        return sink.size, sink.digest.hexdigest()


def apply_delta(
    base: Path,
    delta: Path | BinaryIO,
    out_fd: int,
    size: int,
    on_written: Callable[[int, int], None] | None = None,
) -> str:
    """Write base XOR unzstd(delta) (`size` bytes) to `out_fd` from offset 0, streaming; returns its sha256.
    `delta` is a file, or an object whose `read(n)` gives its next bytes (b"" at its end): a delta still
    arriving is applied as it arrives. `on_written(offset, length)` after each block is written (to start its
    writeback). DeltaError when the delta is broken, or it or the base is not `size` bytes long."""
    if zstandard is None:
        raise DeltaError("the zstandard module is not installed")
    import numpy as np

    digest = hashlib.sha256()
    pos = 0
    try:
        source = open(delta, "rb") if isinstance(delta, (str, os.PathLike)) else contextlib.nullcontext(delta)
        with open(base, "rb") as fb, source as fd:
            if os.fstat(fb.fileno()).st_size != size:
                raise DeltaError(f"{base}: {os.fstat(fb.fileno()).st_size} bytes, expected {size}")
            reader = zstandard.ZstdDecompressor().stream_reader(fd, read_across_frames=False)
            xor, block = bytearray(CHUNK), bytearray(CHUNK)  # XORed into the base's block in place: no copies
            while pos < size:
                want = min(CHUNK, size - pos)
                got = 0
                with memoryview(xor) as into:
                    while got < want:
                        n = reader.readinto(into[got:want])
                        if not n:
                            raise DeltaError(f"{delta}: ends after {pos + got} of {size} bytes")
                        got += n
                with memoryview(block) as into:
                    if fb.readinto(into[:want]) != want:
                        raise DeltaError(f"{base}: shorter than {size} bytes")
                data = np.frombuffer(block, np.uint8, want)
                np.bitwise_xor(data, np.frombuffer(xor, np.uint8, want), out=data)
                with memoryview(block)[:want] as view:
                    digest.update(view)
                    at, left = pos, view
                    while left:
                        n = os.pwrite(out_fd, left, at)
                        left, at = left[n:], at + n
                if on_written is not None:
                    on_written(pos, want)
                pos += want
            if reader.read(1):
                raise DeltaError(f"{delta}: longer than {size} bytes")
    except zstandard.ZstdError as e:
        raise DeltaError(f"{delta}: not a valid zstd stream ({e})") from None
    return digest.hexdigest()


def anchor_before(version: int, every: int = ANCHOR_EVERY) -> int:
    """The newest anchor version older than `version`."""
    return (version - 1) // every * every


def retained(
    versions: Iterable[int],
    keep: int,
    keep_anchor: bool = True,
    every: int = ANCHOR_EVERY,
    bases: Iterable[int] = (),
) -> set[int]:
    """The versions a server or worker holding `versions` keeps: the newest `keep`, and with `keep_anchor` the
    newest anchor among them, the base of the anchor deltas of every version after it: those of `bases` (the
    bases the newest version's manifest lists deltas against: the previous version and the anchor) it holds,
    else the newest held version divisible by `every`. So at most `keep + 1` versions are on disk."""
    if keep <= 0:
        raise ValueError(f"retained: keep must be positive, got {keep}")
    ordered = sorted(set(versions), reverse=True)
    kept = set(ordered[:keep])
    if keep_anchor:
        listed = set(bases) & kept.union(ordered)
        anchors = [v for v in ordered if v % every == 0]
        kept |= listed or set(anchors[:1])
    return kept


def delta_bases(weights_dir: Path, version: int, every: int = ANCHOR_EVERY) -> list[tuple[int, Path]]:
    """The complete versions in `weights_dir` a new `version` gets deltas against: the newest older one, and the
    newest anchor (a version divisible by `every`) if that is another one."""
    held = []
    try:
        for entry in os.scandir(weights_dir):
            v = parse_version_dirname(entry.name)
            if v is not None and v < version and os.path.exists(os.path.join(entry.path, STABLE_FILE)):
                held.append(v)
    except FileNotFoundError:
        return []
    if not held:
        return []
    chosen = {max(held)}
    anchors = [v for v in held if v % every == 0]
    if anchors:
        chosen.add(max(anchors))
    return [(v, Path(weights_dir) / version_dirname(v)) for v in sorted(chosen, reverse=True)]


def _base_files(base_dir: Path) -> dict[str, dict]:
    import json

    try:
        doc = json.loads((base_dir / MANIFEST_FILE).read_bytes())
        return {e["name"]: e for e in doc["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def write_deltas(
    version_dir: Path,
    files: Iterable[dict],
    bases: Iterable[tuple[int, Path]],
    *,
    level: int = LEVEL,
    max_ratio: float = MAX_RATIO,
) -> list[dict]:
    """Write the delta files of `version_dir`'s `files` (manifest entries: name, size, sha256) against each base
    (version, its complete directory); returns the manifest's `deltas` entries. Files without a compatible
    counterpart in a base, and deltas over `max_ratio` of their file, are left out."""
    if zstandard is None:
        return []
    entries = []
    for base, base_dir in bases:
        held = _base_files(Path(base_dir))
        for f in files:
            name, size = f["name"], f["size"]
            old = held.get(name)
            if old is None or old.get("size") != size or size < 4096:
                continue
            if not compatible(Path(base_dir) / name, version_dir / name):
                continue
            out = version_dir / delta_name(name, base)
            dsize, dsha = encode_delta(Path(base_dir) / name, version_dir / name, out, level=level)
            if dsize > max_ratio * size:
                out.unlink()
                continue
            entries.append(
                {
                    "name": out.name,
                    "file": name,
                    "base": base,
                    "base_sha256": old["sha256"],
                    "encoding": ENCODING,
                    "size": dsize,
                    "sha256": dsha,
                }
            )
    return entries
