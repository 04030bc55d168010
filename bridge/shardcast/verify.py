"""A download's verification: one hashing thread per file without part hashes follows what has landed and
checks the file's sha256.

With direct I/O the hasher takes each part's pool buffer in file order; otherwise it hashes the contiguous
prefix straight from the page cache through a memory map. A mismatch whose bytes all came from one server
distrusts that server; with several sources the file is fetched again from one server at a time. A file with
part hashes has no hasher: each part is checked as it lands (`download`), and the file is verified with its
last part (`_parts_landed`).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import threading

from bridge.shardcast import disk
from bridge.shardcast.errors import FetchError
from bridge.shardcast.parts import HASH_CHUNK, _File, _split

log = logging.getLogger("shardcast.download")


class Verification:
    """Mixin of `Download`: the hashing threads and what a mismatch does."""

    def _start_hasher(self, f: _File) -> None:
        f.hashing = True
        threading.Thread(target=self._hash, args=(f,), name=f"shardcast-hash-{f.entry.name}", daemon=True).start()

    def _hash(self, f: _File) -> None:
        try:
            if not (f.direct and self._hash_direct(f)):
                self._hash_loop(f)  # a page-cache file, or a direct one that failed its check (fetched anew)
        except Exception as e:
            self._fail(FetchError(f"version {self.version}, {f.path}: {type(e).__name__}: {e}"))

    def _hash_loop(self, f: _File) -> None:
        size = f.entry.size
        fd = os.open(f.path, os.O_RDONLY)
        view = None
        try:
            if size:  # hash straight from the page cache through a map: no copy
                mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                view = memoryview(mapped)
            generation, digest, pos = None, hashlib.sha256(), 0
            while True:
                with self._lock:
                    while True:
                        if self._error is not None:
                            return
                        if f.generation != generation:
                            generation, digest, pos = f.generation, hashlib.sha256(), 0
                        ready = f.prefix()
                        if ready - pos >= HASH_CHUNK or (ready == size and f.complete()):
                            break
                        f.cond.wait()
                while pos < ready:
                    end = min(pos + HASH_CHUNK, ready)
                    digest.update(view[pos:end])
                    if self.fsync:
                        disk.start_writeback(fd, pos, end - pos)
                    pos = end
                if pos == size and self._finish(f, generation, digest.hexdigest()):
                    return
        finally:
            if view is not None:
                view.release()
                mapped.close()
            os.close(fd)

    def _hash_direct(self, f: _File) -> bool:
        """Hash a direct file part by part in file order, from each part's buffer (then given back to the pool)
        or, for a part resumed from disk, from the file. True when the hasher is done (the file verified, or the
        fetch failed); False after a mismatch, once the file is fetched again through the page cache."""
        with self._lock:
            generation, parts = f.generation, list(f.parts)
        digest = hashlib.sha256()
        for part in parts:
            with self._lock:
                while not part.ready and self._error is None:
                    f.cond.wait()
                if self._error is not None:
                    return True
                buf = part.buf
            if buf is not None:
                with memoryview(buf) as view:
                    digest.update(view[: part.length])
                with self._lock:
                    if part.buf is buf:
                        self.buffers.give_back(buf)
                        part.buf = None
                        self._queue_cv.notify_all()
            else:
                with open(f.path, "rb", buffering=0) as fh:
                    pos, end = part.start, part.start + part.length
                    while pos < end:
                        block = os.pread(fh.fileno(), min(HASH_CHUNK, end - pos), pos)
                        if not block:
                            raise FetchError(f"{f.path}: ends at {pos}, before its {f.entry.size} bytes")
                        digest.update(block)
                        pos += len(block)
        return self._finish(f, generation, digest.hexdigest())

    def _finish(self, f: _File, generation: int, digest: str) -> bool:
        """True once the file is verified; on a mismatch, requeue it and keep the hasher going."""
        with self._lock:
            if generation != f.generation or not f.complete():
                return False
            if digest != f.entry.sha256:
                self._mismatch(f)
                return False
            fd, f.fd = f.fd, None
            f.close_direct()
        self._land_file(f, fd)
        return True

    def _parts_landed(self, f: _File) -> None:
        """A file with part hashes whose last part was just checked: every byte is in a checked part, so the file
        is verified; it is made durable and counts as landed."""
        with self._lock:
            fd, f.fd = f.fd, None
            f.close_direct()
        self._land_file(f, fd)

    def _land_file(self, f: _File, fd: int | None) -> None:
        """A verified file: fsync'd (with `fsync`), then counted as landed and reported."""
        if fd is not None:
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
        elif self.fsync:
            with open(f.path, "rb+") as fh:
                os.fsync(fh.fileno())
        with self._lock:
            f.verified = True
            self._landed += 1
            self._queue_cv.notify_all()
        self.listener.file_verified(f.entry.name)

    def _mismatch(self, f: _File) -> None:
        """Called with the lock held: the file's bytes do not have the manifest's sha256."""
        f.mismatches += 1
        sources = sorted(f.sources, key=str)
        self._blame(f, sources, len(sources) == 1, f.entry.name, "sha256 mismatch")
        if f.mismatches > 2 * len(self.pool.servers) + 1:
            self._error = FetchError(
                f"version {self.version}, {f.entry.name}: sha256 mismatch {f.mismatches} "
                f"times (sources: {', '.join(map(str, sources))})"
            )
            self._queue_cv.notify_all()
            return
        f.single_source = True
        if f.direct:  # fetched anew from one server through the page cache, hashed from there
            f.direct = False
            f.close_direct()
        f.generation += 1
        f.sources.clear()
        f.parts = _split(f.entry.size, f.entry.size or 1)
        self._queue.extend((f, p) for p in f.parts)
        self._queue_cv.notify_all()

    def _blame(self, f: _File, sources, single: bool, what: str, failure: str) -> None:
        """Called with the lock held: bytes of `what` (a file, or a part of it) from `sources` failed their
        sha256. A single source is distrusted; with several, each is marked failed (the caller fetches again
        from one server)."""
        if single:
            (server,) = sources
            self._distrusted.add(server)
            self.pool.distrust(server)
            self._last_error[server] = f"sent {what} with a wrong sha256"
            log.warning(
                "version %d, %s: %s; every byte came from %s, which is now distrusted",
                self.version,
                f.entry.name,
                failure,
                server,
            )
            return
        for server in sources:
            self.pool.record(server, False)
        log.warning(
            "version %d, %s: %s (bytes from %s); fetching it again from one server",
            self.version,
            f.entry.name,
            failure,
            ", ".join(sorted(map(str, sources))) or "an earlier run",
        )
