"""The manifest of a version (docs/design.md section 4): parsed from untrusted bytes, checked against a directory.

`parse_manifest` accepts only what `bridge.weights.export_params` writes: `{"version", "files": [{"name",
"size", "sha256"}...], "total_size", "created"}` with plain, distinct file names, sizes that add up to
`total_size`, lower-case hex sha256 digests, and limits on the count of files and on the total size. The
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

MAX_MANIFEST_BYTES = 4 << 20  # ~30k files; an HF export has a few dozen
MAX_FILES = 10_000
DEFAULT_MAX_VERSION_BYTES = 4 << 40  # 4 TiB: twice a 1T-parameter model in bf16
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    version: int
    files: tuple[FileEntry, ...]
    total_size: int
    raw: bytes  # the exact bytes, as served and stored
    by_name: dict[str, FileEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {e.name: e for e in self.files})

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()


def parse_manifest(raw: bytes, where: str, *, version: int | None = None,
                   max_total: int = DEFAULT_MAX_VERSION_BYTES) -> Manifest:
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
        total += size
        entries.append(FileEntry(name, size, digest))
    if total > max_total:
        raise ManifestError(f"{where}: files add up to {total} bytes, over the limit of {max_total}")
    if doc.get("total_size") != total:
        raise ManifestError(f"{where}: field 'total_size' is {doc.get('total_size')!r} but the files add up to {total}")
    return Manifest(declared, tuple(entries), total, bytes(raw))


def read_version_dir(path: Path, version: int) -> Manifest:
    """The manifest of a complete version directory (STABLE present), checking that every file is there with
    its size (hashes are the writer's word: `export_params` and a SHARDCAST landing both verify before STABLE)."""
    if not (path / STABLE_FILE).is_file():
        raise ManifestError(f"{path}: no {STABLE_FILE} file (an incomplete version)")
    try:
        raw = (path / MANIFEST_FILE).read_bytes()
    except OSError as e:
        raise ManifestError(f"{path / MANIFEST_FILE}: unreadable ({e})") from e
    manifest = parse_manifest(raw, str(path / MANIFEST_FILE), version=version)
    for entry in manifest.files:
        try:
            size = os.stat(path / entry.name).st_size
        except OSError as e:
            raise ManifestError(f"{path / entry.name}: listed in the manifest but unreadable ({e})") from e
        if size != entry.size:
            raise ManifestError(f"{path / entry.name}: size {size} but the manifest says {entry.size}")
    return manifest


def version_path(root: Path, version: int) -> Path:
    return root / version_dirname(version)
