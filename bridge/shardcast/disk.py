"""The on-disk side of a fetch: reserving files, the progress journal, early writeback, and the atomic landing.

Layout under a destination root (a client's output directory or a relay's own directory):

    .v000123.lock       flock held while a process fetches v123 here
    .v000123.partial/   the files being fetched, at their full size from the start, and `.progress.json`
    v000123/            the landed version: every file verified, manifest.json, then STABLE written last

`.progress.json` holds the manifest's sha256 and, per file, whether it is verified and how much of each part
has landed; a fetch of the same manifest resumes from it, and anything that does not tile the files exactly
is ignored (the fetch then starts over).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from bridge.shardcast.errors import FetchError, ManifestError
from bridge.shardcast.manifest import Manifest, read_version_dir
from bridge.shardcast.names import MANIFEST_FILE, STABLE_FILE, version_dirname

JOURNAL = ".progress.json"


def partial_dir(root: Path, version: int) -> Path:
    return root / f".{version_dirname(version)}.partial"


def lock_path(root: Path, version: int) -> Path:
    return root / f".{version_dirname(version)}.lock"


def held_version(path: Path, version: int, expected_sha256: str | None = None) -> Manifest:
    """The manifest of a version already landed at `path`; refuses a broken one or a different one."""
    try:
        held = read_version_dir(path, version)
    except ManifestError as e:
        raise FetchError(f"{path}: has {STABLE_FILE} but is not a complete version ({e}); remove it") from e
    if expected_sha256 is not None and held.sha256 != expected_sha256:
        raise FetchError(
            f"{path}: holds a different version {version} (manifest sha256 {held.sha256[:12]}, "
            f"expected {expected_sha256[:12]}); remove it"
        )
    return held


def held_manifest_sha256(path: Path) -> str | None:
    """The sha256 of the manifest of the version landed at `path` (None: no complete version there)."""
    try:
        if not (path / STABLE_FILE).exists():
            return None
        return hashlib.sha256((path / MANIFEST_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def discard(path: Path) -> None:
    """Remove a landed version directory: renamed aside first (atomic), so it is never seen half-deleted."""
    trash = path.with_name(f".{path.name}.replaced-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def check_space(path: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(path).free
    if needed > free:
        raise FetchError(f"{what} needs {needed / 2**30:.2f} GiB more but {path} has {free / 2**30:.2f} GiB free")


def allocate(path: Path, size: int) -> None:
    """Create the file at its full size, its blocks reserved up front where the filesystem can (a full disk
    fails here, not midway, and writes into reserved blocks skip delayed allocation)."""
    with open(path, "wb") as f:
        try:
            if size:
                os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise FetchError(f"{path}: cannot reserve {size} bytes ({e})") from e
            f.truncate(size)


def read_journal(partial: Path, manifest: Manifest, entries=None) -> dict | None:
    """Per file name: {"verified": bool, "parts": [[start, length, done], ...]}, or None when there is no
    usable journal for this manifest (and these `entries`, the manifest's files unless given)."""
    try:
        doc = json.loads((partial / JOURNAL).read_text())
        if doc["manifest_sha256"] != manifest.sha256:
            return None
        files = doc["files"]
        for entry in manifest.files if entries is None else entries:
            saved = files[entry.name]
            pos = 0
            for start, length, done in saved["parts"]:
                if start != pos or not 0 <= done <= length:
                    raise ValueError(entry.name)
                pos += length
            if pos != entry.size or not isinstance(saved["verified"], bool):
                raise ValueError(entry.name)
        return files
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_journal(partial: Path, manifest: Manifest, files: dict) -> None:
    tmp = partial / (JOURNAL + ".tmp")
    tmp.write_text(json.dumps({"manifest_sha256": manifest.sha256, "files": files}))
    os.replace(tmp, partial / JOURNAL)


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing verified bytes to disk now (Linux `sync_file_range`, without waiting), so that the fsync
    before STABLE has only the tail left; where it is missing, the final fsync does all the work."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def land(root: Path, manifest: Manifest, fsync: bool) -> Path:
    """Turn a partial directory whose files are all verified into the version: manifest.json, rename, STABLE."""
    partial, final = partial_dir(root, manifest.version), root / version_dirname(manifest.version)
    (partial / JOURNAL).unlink(missing_ok=True)
    (partial / MANIFEST_FILE).write_bytes(manifest.raw)
    if fsync:
        fsync_dir(partial)
    os.rename(partial, final)
    with open(final / STABLE_FILE, "w") as f:
        f.write(f"{manifest.version}\n")
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    if fsync:
        fsync_dir(final)
        fsync_dir(root)
    return final
