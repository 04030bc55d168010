"""The manifest of a version (docs/design.md section 4): parsed from untrusted bytes, checked against a directory.

`parse_manifest` accepts only what `bridge.weights.write_version` writes: `{"version", "files": [{"name",
"size", "sha256"}...], "total_size", "created"}` with plain, distinct file names, sizes that add up to
`total_size`, lower-case hex sha256 digests, and limits on the count of files and on the total size; and the
optional `deltas` (`bridge.shardcast.delta`): `[{"name", "file", "base", "base_sha256", "encoding", "size",
"sha256"}...]`, each the delta of one of the files against an older version, under a name of its own. Deltas are
not part of the version (`files` and `total_size` are what lands); servers mirror and serve them like files. The
raw bytes are kept: every server hands on exactly the bytes it received, so a manifest's sha256 identifies a
version end to end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from bridge.shardcast.errors import ManifestError, ShardcastError
from bridge.shardcast.names import MANIFEST_FILE, STABLE_FILE, check_file_name, check_version, version_dirname

MAX_MANIFEST_BYTES = 16 << 20  # ~30k files, or ~200k part hashes (6.5 TiB at the default part size)
MAX_FILES = 10_000
DEFAULT_MAX_VERSION_BYTES = 4 << 40  # 4 TiB: twice a 1T-parameter model in bf16
PART_SIZE = 32 << 20  # the learner's part size: one client direct I/O buffer (`shardcast.buffer_mib`)
PART_ALIGN = 4096  # part boundaries fall on O_DIRECT and mmap boundaries
MIN_PART_SIZE = 64 << 10
MAX_PART_SIZE = 1 << 30
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str
    parts: tuple[str, ...] = ()  # the sha256 of each `Manifest.part_size` slice; () without part hashes


@dataclass(frozen=True)
class DeltaEntry(FileEntry):
    """The delta file `name` rebuilds the version's `file` from that file of version `base` (whose sha256 was
    `base_sha256`); `size` and `sha256` are the delta file's own."""

    file: str = ""
    base: int = 0
    base_sha256: str = ""
    encoding: str = ""


@dataclass(frozen=True)
class Manifest:
    version: int
    files: tuple[FileEntry, ...]
    total_size: int
    raw: bytes  # the exact bytes, as served and stored
    deltas: tuple[DeltaEntry, ...] = ()
    part_size: int | None = None  # set when every file lists its part hashes (`FileEntry.parts`)
    base_version: int | None = None  # a LoRA adapter version: the full version it applies to (kept beside it)
    by_name: dict[str, FileEntry] = field(init=False, repr=False, compare=False)
    served: dict[str, FileEntry] = field(init=False, repr=False, compare=False)  # files and deltas by name

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {e.name: e for e in self.files})
        object.__setattr__(self, "served", {**self.by_name, **{d.name: d for d in self.deltas}})

    def deltas_for(self, name: str) -> list[DeltaEntry]:
        """The deltas that rebuild file `name`, newest base first."""
        return sorted((d for d in self.deltas if d.file == name), key=lambda d: -d.base)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    def part_range(self, index: int, size: int) -> tuple[int, int]:
        """(start, length) of part `index` of a file of `size` bytes (the manifest has part hashes)."""
        start = index * self.part_size
        return start, min(self.part_size, size - start)


def part_count(size: int, part_size: int) -> int:
    return -(-size // part_size)


class PartHasher:
    """The sha256 of a stream and of each `part_size` slice of it, for a manifest with part hashes."""

    def __init__(self, part_size: int = PART_SIZE, whole: bool = True):
        """`whole` False: the parts only (a caller hashing the whole stream in another thread)."""
        self.part_size = part_size
        self.whole = hashlib.sha256() if whole else None
        self.parts: list[str] = []
        self._part = hashlib.sha256()
        self._in_part = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if self.whole is not None:
            self.whole.update(view)
        while len(view):
            n = min(len(view), self.part_size - self._in_part)
            self._part.update(view[:n])
            self._in_part += n
            view = view[n:]
            if self._in_part == self.part_size:
                self.parts.append(self._part.hexdigest())
                self._part, self._in_part = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        return self.whole.hexdigest()

    def part_digests(self) -> list[str]:
        """Every part's sha256, the last (shorter) one included; call once the stream is complete."""
        return self.parts + ([self._part.hexdigest()] if self._in_part else [])


def hash_file_parts(path: Path, part_size: int = PART_SIZE, block: int = 8 << 20) -> tuple[str, list[str]]:
    """(sha256, part sha256s) of a file."""
    hasher = PartHasher(part_size)
    with open(path, "rb") as f:
        while data := f.read(block):
            hasher.update(data)
    return hasher.hexdigest(), hasher.part_digests()


def parse_manifest(
    raw: bytes, where: str, *, version: int | None = None, max_total: int = DEFAULT_MAX_VERSION_BYTES
) -> Manifest:
    """Validate a manifest's bytes; `version`, when given, must be the one it declares. Errors name `where`."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: manifest of {len(raw)} bytes exceeds the limit of {MAX_MANIFEST_BYTES}")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where}: manifest is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: manifest must be a JSON object, got {type(doc).__name__}")
    try:
        declared = check_version(doc.get("version"), f"{where}: field 'version'")
    except ShardcastError as e:
        raise ManifestError(str(e)) from None
    if version is not None and declared != version:
        raise ManifestError(f"{where}: manifest declares version {declared}, expected {version}")
    part_size = _part_size(doc, where)
    files = doc.get("files")
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        raise ManifestError(f"{where}: field 'files' must be a list of 1..{MAX_FILES} entries")
    entries: list[FileEntry] = []
    seen: set[str] = set()
    total = 0
    for i, item in enumerate(files):
        at = f"{where}: files[{i}]"
        if not isinstance(item, dict):
            raise ManifestError(f"{at} must be an object with name, size, sha256")
        try:
            name = check_file_name(item.get("name"), f"{at}.name")
        except ShardcastError as e:
            raise ManifestError(str(e)) from None
        if name in seen:
            raise ManifestError(f"{at}.name: {name!r} is listed twice")
        seen.add(name)
        size = item.get("size")
        if type(size) is not int or not 0 <= size <= max_total:
            raise ManifestError(f"{at}.size: {size!r} is not a size in 0..{max_total} bytes")
        digest = item.get("sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ManifestError(f"{at}.sha256: {digest!r} is not 64 lower-case hex digits")
        parts = _parse_parts(item, at, size, part_size)
        total += size
        entries.append(FileEntry(name, size, digest, parts))
    if total > max_total:
        raise ManifestError(f"{where}: files add up to {total} bytes, over the limit of {max_total}")
    if doc.get("total_size") != total:
        raise ManifestError(f"{where}: field 'total_size' is {doc.get('total_size')!r} but the files add up to {total}")
    deltas = _parse_deltas(doc.get("deltas", []), where, declared, {e.name: e for e in entries}, max_total)
    base_version = doc.get("base_version")
    if base_version is not None:
        try:
            base_version = check_version(base_version, f"{where}: field 'base_version'")
        except ShardcastError as e:
            raise ManifestError(str(e)) from None
        if base_version >= declared:
            raise ManifestError(f"{where}: base_version {base_version} is not older than version {declared}")
    return Manifest(declared, tuple(entries), total, bytes(raw), tuple(deltas), part_size, base_version)


def _part_size(doc: dict, where: str) -> int | None:
    if "part_size" not in doc:
        return None
    size = doc["part_size"]
    if type(size) is not int or not MIN_PART_SIZE <= size <= MAX_PART_SIZE or size % PART_ALIGN:
        raise ManifestError(
            f"{where}: field 'part_size' {size!r} is not a multiple of {PART_ALIGN} bytes in "
            f"{MIN_PART_SIZE}..{MAX_PART_SIZE}"
        )
    return size


def _parse_parts(item: dict, at: str, size: int, part_size: int | None) -> tuple[str, ...]:
    """A file entry's `parts`: required with the manifest's `part_size`, refused without it."""
    parts = item.get("parts")
    if part_size is None:
        if parts is not None:
            raise ManifestError(f"{at}.parts: part hashes without the manifest's 'part_size'")
        return ()
    expected = part_count(size, part_size)
    if not isinstance(parts, list):
        raise ManifestError(
            f"{at}.parts: {type(parts).__name__} instead of a list of {expected} part sha256s "
            f"(the manifest has 'part_size' {part_size})"
        )
    if len(parts) != expected:
        raise ManifestError(
            f"{at}.parts: {len(parts)} part sha256s, but {size} bytes in parts of {part_size} make {expected}"
        )
    for j, digest in enumerate(parts):
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ManifestError(f"{at}.parts[{j}]: {str(digest)[:80]!r} is not 64 lower-case hex digits")
    return tuple(parts)


def _parse_deltas(
    items: object, where: str, version: int, files: dict[str, FileEntry], max_total: int
) -> list[DeltaEntry]:
    if not isinstance(items, list) or len(items) > MAX_FILES:
        raise ManifestError(f"{where}: field 'deltas' must be a list of at most {MAX_FILES} entries")
    deltas: list[DeltaEntry] = []
    seen = set(files)
    total = 0
    for i, item in enumerate(items):
        at = f"{where}: deltas[{i}]"
        if not isinstance(item, dict):
            raise ManifestError(f"{at} must be an object with name, file, base, base_sha256, encoding, size, sha256")
        try:
            name = check_file_name(item.get("name"), f"{at}.name")
            base = check_version(item.get("base"), f"{at}.base")
        except ShardcastError as e:
            raise ManifestError(str(e)) from None
        if name in seen:
            raise ManifestError(f"{at}.name: {name!r} is listed twice")
        seen.add(name)
        target = files.get(item.get("file"))  # type: ignore[arg-type]
        if target is None:
            raise ManifestError(f"{at}.file: {item.get('file')!r} is not one of the files")
        if base >= version:
            raise ManifestError(f"{at}.base: {base} is not older than version {version}")
        size = item.get("size")
        if type(size) is not int or not 0 <= size <= max_total:
            raise ManifestError(f"{at}.size: {size!r} is not a size in 0..{max_total} bytes")
        for key in ("sha256", "base_sha256"):
            if not isinstance(item.get(key), str) or not _SHA256.fullmatch(item[key]):
                raise ManifestError(f"{at}.{key}: {item.get(key)!r} is not 64 lower-case hex digits")
        encoding = item.get("encoding")
        if not isinstance(encoding, str) or not 0 < len(encoding) <= 40:
            raise ManifestError(f"{at}.encoding: {encoding!r} is not an encoding name")
        total += size
        deltas.append(
            DeltaEntry(
                name,
                size,
                item["sha256"],
                file=target.name,
                base=base,
                base_sha256=item["base_sha256"],
                encoding=encoding,
            )
        )
    if total > max_total:
        raise ManifestError(f"{where}: deltas add up to {total} bytes, over the limit of {max_total}")
    return deltas


def read_version_dir(path: Path, version: int, *, with_deltas: bool = False) -> Manifest:
    """The manifest of a complete version directory (STABLE present), checking that every file is there with
    its size (hashes are the writer's word: `write_version` and a SHARDCAST landing both verify before STABLE);
    `with_deltas`: the delta files too, those present (a relay holds only the ones it mirrored or was asked
    for; a worker's directory none)."""
    if not (path / STABLE_FILE).is_file():
        raise ManifestError(f"{path}: no {STABLE_FILE} file (an incomplete version)")
    try:
        raw = (path / MANIFEST_FILE).read_bytes()
    except OSError as e:
        raise ManifestError(f"{path / MANIFEST_FILE}: unreadable ({e})") from e
    manifest = parse_manifest(raw, str(path / MANIFEST_FILE), version=version)
    for entry in manifest.served.values() if with_deltas else manifest.files:
        try:
            size = os.stat(path / entry.name).st_size
        except FileNotFoundError as e:
            if isinstance(entry, DeltaEntry):
                continue
            raise ManifestError(f"{path / entry.name}: listed in the manifest but unreadable ({e})") from e
        except OSError as e:
            raise ManifestError(f"{path / entry.name}: listed in the manifest but unreadable ({e})") from e
        if size != entry.size:
            raise ManifestError(f"{path / entry.name}: size {size} but the manifest says {entry.size}")
    return manifest


def version_path(root: Path, version: int) -> Path:
    return root / version_dirname(version)
