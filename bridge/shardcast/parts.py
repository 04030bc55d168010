"""What a download is made of: files (`_File`) cut into parts (`_Part`), and the servers that failed a part."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from bridge.shardcast.manifest import FileEntry
from bridge.shardcast.names import ServerURL

HASH_CHUNK = 8 << 20


class _Part:
    __slots__ = ("start", "length", "done", "buf", "ready", "verified", "mismatches")

    def __init__(self, start: int, length: int, done: int = 0):
        self.start, self.length, self.done = start, length, done
        self.buf = None  # direct I/O: the pool buffer the part is received into, until it is hashed
        self.ready = False  # direct I/O: every byte is in the file (and in `buf`, if not hashed yet)
        self.verified = False  # a file with part hashes: the part's bytes match its sha256 in the manifest
        self.mismatches = 0  # times the part's bytes failed its sha256


class _File:
    def __init__(self, entry: FileEntry, path: Path, parts: list[_Part], cond: threading.Condition):
        self.entry, self.path, self.parts, self.cond = entry, path, parts, cond
        self.fd: int | None = None
        self.direct = False  # parts go through pool buffers and O_DIRECT writes (`bridge.shardcast.direct`)
        self.dfd: int | None = None  # the O_DIRECT descriptor of a direct file
        self.direct_refused = False  # the filesystem refused an O_DIRECT write: ordinary writes from then on
        self.sources: set[ServerURL] = set()
        self.single_source = False  # after a mismatch with several sources: one part, one server at a time
        self.generation = 0  # bumped whenever landed bytes are thrown away; the hasher restarts
        self.mismatches = 0
        self.verified = False
        self.hashing = False
        self.finishing = False  # a file with part hashes: its last part is checked, it is being landed
        # the manifest's sha256 of each part (`bridge.shardcast.manifest`): every part is then exactly one
        # of them, checked on its own as it lands, and only checked parts count as landed
        self.part_hashed = bool(entry.parts)

    def close_direct(self) -> None:
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def prefix(self) -> int:
        """Bytes landed contiguously from the start of the file (a file without part hashes)."""
        end = 0
        for part in self.parts:
            end = part.start + part.done
            if part.done < part.length:
                break
        return end

    def complete(self) -> bool:
        return all(p.done == p.length and (p.verified or not self.part_hashed) for p in self.parts)


@dataclass
class _Tried:
    """The servers that failed the current part since the last back-off, and the next back-off."""

    failed: set = field(default_factory=set)
    backoff: float = 0.1


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _split(size: int, part_bytes: int, first: int = 0) -> list[_Part]:
    return [_Part(start, min(part_bytes, size - start)) for start in range(first, size, part_bytes)]
