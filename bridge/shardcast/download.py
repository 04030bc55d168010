"""One version fetched in parallel parts from the best servers, verified file by file, landed atomically.

Every file is cut into parts of `part_bytes`; `parallel` worker threads take parts in file order, each from a
server chosen by the `ServerPool`, and resume a broken part with `Range` from wherever they switch to. One
hashing thread per file follows the contiguous prefix that has landed, so that a file's sha256 is known moments
after its last byte: with direct I/O (`buffers`, a client's default) from each part's pool buffer, in file
order, after the part was written with O_DIRECT; otherwise straight from the page cache, through a memory
map. A mismatch whose bytes all came from one server marks that server as distrusted for the rest of the
fetch; with several sources the culprit is unknown, so the file is fetched again from one server at a time
(through the page cache). Every `REFRESH_S` the servers are asked
again who holds the version, so relays that finish mirroring it join a long fetch. Progress is journaled
every second (`disk`), so a fetch that is killed resumes where it stood.

Deltas (`bridge.shardcast.delta`): before the parts, every file the manifest has a delta for, against a version
held complete in `bases_root`, is rebuilt from that base and the delta (fetched whole from one server at a time
and checked against its sha256: a server whose delta fails it is distrusted), then checked against the file's
own sha256; a file that cannot be rebuilt (no base, a corrupt base, no server with a good delta) is fetched in
full like any other. A relay (`mirror_deltas`) also lands the delta files themselves, to serve them.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bridge.shardcast import delta as deltas
from bridge.shardcast import disk
from bridge.shardcast.direct import BufferPool, open_direct, write_part
from bridge.shardcast.errors import FetchError, NotFound, ShardcastError, TransferError
from bridge.shardcast.manifest import DeltaEntry, FileEntry, Manifest
from bridge.shardcast.names import STABLE_FILE, ServerURL, version_dirname
from bridge.shardcast.pool import ServerPool
from bridge.shardcast.transfer import (HAVE_SPLICE, check_status, open_get, receive_into_buffer,
                                       receive_into_file)

log = logging.getLogger("shardcast.download")

HASH_CHUNK = 8 << 20
TICK_S = 0.2
REFRESH_S = 2.0  # how often a long fetch asks which servers hold the version by now
JOURNAL_EVERY_S = 1.0


@dataclass
class FetchResult:
    version: int
    path: Path
    total_bytes: int
    received_bytes: int  # bytes that came over the network in this run
    resumed_bytes: int  # bytes already on disk from an interrupted run
    seconds: float
    servers: dict[str, dict]  # per server URL: bytes, errors, distrusted
    already_present: bool = False
    direct_io: bool = False  # the bytes went to disk with O_DIRECT, not through the page cache
    rebuilt_files: int = 0  # files rebuilt from a held base and a delta

    @property
    def mb_per_s(self) -> float:
        return self.received_bytes / max(self.seconds, 1e-9) / 1e6

    def to_json(self) -> dict:
        return {"version": self.version, "path": str(self.path), "total_bytes": self.total_bytes,
                "received_bytes": self.received_bytes, "resumed_bytes": self.resumed_bytes,
                "seconds": round(self.seconds, 4), "mb_per_s": round(self.mb_per_s, 1), "servers": self.servers,
                "already_present": self.already_present, "direct_io": self.direct_io,
                "rebuilt_files": self.rebuilt_files}


class _Part:
    __slots__ = ("start", "length", "done", "buf", "ready")

    def __init__(self, start: int, length: int, done: int = 0):
        self.start, self.length, self.done = start, length, done
        self.buf = None  # direct I/O: the pool buffer the part is received into, until it is hashed
        self.ready = False  # direct I/O: every byte is in the file (and in `buf`, if not hashed yet)


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

    def close_direct(self) -> None:
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def prefix(self) -> int:
        """Bytes landed contiguously from the start of the file."""
        end = 0
        for part in self.parts:
            end = part.start + part.done
            if part.done < part.length:
                break
        return end

    def complete(self) -> bool:
        return all(p.done == p.length for p in self.parts)


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


class Download:
    """Fetch `manifest`'s version from `candidates` into `root`; `run()` returns a FetchResult or raises."""

    def __init__(self, *, manifest: Manifest, root: Path, pool: ServerPool, candidates: set[ServerURL],
                 refresh: Callable[[], set[ServerURL]], timeout: float, patience: float, parallel: int,
                 part_bytes: int, fsync: bool = True, use_splice: bool = HAVE_SPLICE,
                 buffers: BufferPool | None = None, on_progress: Callable[[int, int], None] | None = None,
                 replace_held: bool = False, use_deltas: bool = True, mirror_deltas: bool = False,
                 bases_root: Path | None = None):
        """`replace_held`: a version already landed in `root` under another manifest is removed and this one
        fetched in its place (the manifest is pinned from a trusted source); otherwise that is an error.
        `use_deltas`: rebuild files from the versions held in `bases_root` (default `root`) where the manifest
        has deltas; `mirror_deltas`: land the delta files too (a relay, which serves them)."""
        self.manifest, self.version = manifest, manifest.version
        self.use_deltas = use_deltas and deltas.HAVE_ZSTD
        self.entries: list[FileEntry] = list(manifest.files) + (list(manifest.deltas) if mirror_deltas else [])
        self.total = sum(e.size for e in self.entries)
        self.bases_root = Path(bases_root if bases_root is not None else root)
        self._rebuilt = 0
        self.replace_held = replace_held
        self.root = Path(root)
        self.final = self.root / version_dirname(self.version)
        self.partial = disk.partial_dir(self.root, self.version)
        self.pool, self.candidates, self.refresh = pool, set(candidates), refresh
        self.timeout, self.patience, self.parallel, self.part_bytes = timeout, patience, parallel, part_bytes
        self.fsync, self.use_splice, self.on_progress = fsync, use_splice, on_progress
        self.buffers = buffers
        self._direct = False  # this download holds `buffers` and lands files with direct I/O where it can
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._queue_cv = threading.Condition(self._lock)
        self._queue: collections.deque[tuple[_File, _Part]] = collections.deque()
        self._files: list[_File] = []
        self._error: ShardcastError | None = None
        self._distrusted: set[ServerURL] = set()
        self._bytes: collections.Counter[ServerURL] = collections.Counter()
        self._errors: collections.Counter[ServerURL] = collections.Counter()
        self._last_error: dict[ServerURL, str] = {}
        self._received = 0
        self._resumed = 0
        self._landed = 0
        self._last_progress = time.monotonic()
        self._refresh_lock = threading.Lock()
        self._last_refresh = time.monotonic()

    # ---- the whole fetch ------------------------------------------------------------------------------

    def run(self) -> FetchResult:
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        lock_path = disk.lock_path(self.root, self.version)
        with open(lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FetchError(f"{self.final}: another process is fetching version {self.version} here") from None
            if (self.final / STABLE_FILE).exists():
                try:
                    held = disk.held_version(self.final, self.version, self.manifest.sha256)
                    return FetchResult(self.version, self.final, held.total_size, 0, 0, time.monotonic() - t0, {},
                                       already_present=True)
                except FetchError:
                    if not self.replace_held:
                        raise
                    disk.discard(self.final)
            if self.final.exists():
                shutil.rmtree(self.final)  # a leftover without STABLE is incomplete
            self._direct = self.buffers is not None and self.buffers.claim()
            try:
                self._prepare()
                self._transfer()
            except BaseException as e:
                self._fail(e if isinstance(e, ShardcastError) else FetchError(f"interrupted ({e!r})"))
                self._write_journal()
                raise
            finally:
                self._close_files()
                if self._direct:
                    self._return_buffers()
            disk.land(self.root, self.manifest, self.fsync)
            lock_path.unlink(missing_ok=True)
        return FetchResult(self.version, self.final, self.manifest.total_size, self._received, self._resumed,
                           time.monotonic() - t0, self._server_summary(),
                           direct_io=any(f.direct for f in self._files), rebuilt_files=self._rebuilt)

    def _prepare(self) -> None:
        """Files and parts, restored from the journal of an interrupted fetch of the same manifest."""
        journal = disk.read_journal(self.partial, self.manifest, self.entries)
        if journal is None and self.partial.exists():
            shutil.rmtree(self.partial)
        self.partial.mkdir(exist_ok=True)
        fresh = []
        part_bytes = min(self.part_bytes, self.buffers.size) if self._direct else self.part_bytes
        rebuilt = self._rebuild(journal) if self.use_deltas and self.manifest.deltas else set()
        for entry in self.entries:
            path = self.partial / entry.name
            saved = journal.get(entry.name) if journal else None
            if entry.name in rebuilt:
                f = _File(entry, path, [_Part(p.start, p.length, p.length) for p in _split(entry.size, part_bytes)],
                          threading.Condition(self._lock))
                f.verified = True
            elif saved is not None and path.is_file() and path.stat().st_size == entry.size:
                parts = [_Part(*p) for p in saved["parts"]]
                if self._direct and not saved["verified"]:  # whole parts stay; the rest is fetched anew
                    parts = [q for p in parts for q in ([p] if p.done == p.length else
                                                        _split(p.start + p.length, part_bytes, p.start))]
                    for p in parts:
                        p.ready = p.done == p.length
                f = _File(entry, path, parts, threading.Condition(self._lock))
                f.verified = saved["verified"]
            else:
                f = _File(entry, path, _split(entry.size, part_bytes), threading.Condition(self._lock))
                fresh.append(f)
            if entry.name not in rebuilt:
                self._resumed += entry.size if f.verified else sum(p.done for p in f.parts)
            self._files.append(f)
            if f.verified:
                self._landed += 1
            else:
                self._queue.extend((f, p) for p in f.parts if p.done < p.length)
        disk.check_space(self.partial, sum(f.entry.size for f in fresh), f"version {self.version}")
        for f in fresh:
            disk.allocate(f.path, f.entry.size)
        if self._direct:
            for f in self._files:
                if not f.verified:
                    f.dfd = open_direct(f.path)
                    f.direct = f.dfd is not None
        if self._resumed:
            log.info("%s: resuming, %.1f MiB already here", version_dirname(self.version), self._resumed / 2**20)

    def _write_journal(self) -> None:
        with self._lock:
            # a direct part still in its buffer may not be in the file yet: it counts as not received
            files = {f.entry.name: {"verified": f.verified,
                                    "parts": [[p.start, p.length, p.done if p.buf is None else 0] for p in f.parts]}
                     for f in self._files}
        try:
            disk.write_journal(self.partial, self.manifest, files)
        except OSError as e:
            log.warning("cannot record progress in %s: %s", self.partial, e)

    def _transfer(self) -> None:
        workers = self._workers = [threading.Thread(target=self._worker, name=f"shardcast-get-{i}", daemon=True)
                                   for i in range(self.parallel)]
        for f in self._files:
            if not f.verified and f.complete():
                self._start_hasher(f)
        for t in workers:
            t.start()
        last_journal = time.monotonic()
        with self._lock:
            while self._error is None and self._landed < len(self._files):
                self._queue_cv.wait(TICK_S)
                done = self._resumed + self._received
                if self.on_progress is not None:
                    self._lock.release()
                    try:
                        self.on_progress(done, self.total)
                    finally:
                        self._lock.acquire()
                if time.monotonic() - last_journal >= JOURNAL_EVERY_S:
                    self._lock.release()
                    try:
                        self._write_journal()
                    finally:
                        self._lock.acquire()
                    last_journal = time.monotonic()
            self._queue_cv.notify_all()
            for f in self._files:
                f.cond.notify_all()
        for t in workers:
            t.join()
        if self._error is not None:
            raise self._error
        if self.on_progress is not None:
            self.on_progress(self.total, self.total)

    # ---- deltas ---------------------------------------------------------------------------------------

    def _rebuild(self, journal: dict | None) -> set[str]:
        """Rebuild the files that have a delta against a held base (before any part is fetched); returns the
        names now verified in the partial directory: rebuilt files, and delta files fetched on the way."""
        done: set[str] = set()
        bases: dict[int, Manifest | None] = {}
        for entry in self.manifest.files:
            if journal and journal.get(entry.name, {}).get("verified"):
                continue
            for d in self.manifest.deltas_for(entry.name):
                if d.encoding != deltas.ENCODING:
                    continue
                base = self._held_base(d, bases)
                if base is None:
                    continue
                held = base.by_name.get(entry.name)
                if held is None or held.sha256 != d.base_sha256 or held.size != entry.size:
                    continue
                if self._rebuild_one(entry, d, done):
                    self._rebuilt += 1
                    done.add(entry.name)
                    break
        return done

    def _held_base(self, d: DeltaEntry, bases: dict[int, Manifest | None]) -> Manifest | None:
        if d.base not in bases:
            path = self.bases_root / version_dirname(d.base)
            try:
                bases[d.base] = disk.held_version(path, d.base) if (path / STABLE_FILE).exists() else None
            except FetchError as e:
                log.info("base %s not usable: %s", version_dirname(d.base), e)
                bases[d.base] = None
        return bases[d.base]

    def _rebuild_one(self, entry: FileEntry, d: DeltaEntry, done: set[str]) -> bool:
        """Fetch the delta (unless held already), rebuild `entry` from it and check the result's sha256."""
        mirrored = d.name in {e.name for e in self.entries}
        delta_path = self.partial / (d.name if mirrored else f".{d.name}")
        if d.name not in done and not self._fetch_verified(d, delta_path):
            return False
        if mirrored:
            done.add(d.name)
        base_file = self.bases_root / version_dirname(d.base) / entry.name
        out = self.partial / entry.name
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            digest = deltas.apply_delta(base_file, delta_path, fd, entry.size)
            if digest == entry.sha256 and self.fsync:
                os.fsync(fd)
        except (deltas.DeltaError, OSError) as e:
            log.warning("version %d, %s: cannot rebuild from %s (%s); fetching it in full", self.version,
                        entry.name, d.name, e)
            digest = None
        finally:
            os.close(fd)
            if not mirrored:
                delta_path.unlink(missing_ok=True)
        if digest != entry.sha256:
            if digest is not None:
                log.warning("version %d, %s rebuilt from the verified delta %s has a wrong sha256: the held base "
                            "%s is corrupt; fetching it in full", self.version, entry.name, d.name, base_file)
            return False
        return True

    def _fetch_verified(self, entry: FileEntry, path: Path) -> bool:
        """Fetch `entry` whole into `path` from one server after another until its bytes have its sha256; a
        server whose bytes do not is distrusted for the rest of the fetch. False when no server delivered."""
        tried: set[ServerURL] = set()
        url_path = f"/v/{self.version}/{entry.name}"
        while self._error is None:
            with self._lock:
                choices = sorted(self.candidates - self._distrusted - tried, key=str)
            if not choices:
                return False
            server = self.pool.choose(choices) or choices[0]
            tried.add(server)
            t0 = time.monotonic()
            try:
                resp = open_get(server, url_path, timeout=self.timeout)
                try:
                    check_status(resp, url_path, (200,), self.timeout)
                    if resp.content_length() != entry.size:
                        raise TransferError(server, f"GET {url_path}: Content-Length {resp.content_length()}, "
                                                    f"the manifest says {entry.size}")
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        receive_into_file(resp, fd, 0, entry.size, timeout=self.timeout,
                                          progress=lambda n: self._count(server, n), use_splice=self.use_splice)
                    finally:
                        os.close(fd)
                finally:
                    resp.close()
            except TransferError as e:
                self.pool.record(server, False)
                with self._lock:
                    self._errors[server] += 1
                    self._last_error[server] = str(e)
                log.info("version %d, %s: %s", self.version, entry.name, e)
                continue
            self.pool.record(server, True, entry.size, time.monotonic() - t0)
            if _sha256_file(path) == entry.sha256:
                return True
            with self._lock:
                self._distrusted.add(server)
                self._last_error[server] = f"sent {entry.name} with a wrong sha256"
            self.pool.distrust(server)
            log.warning("version %d, %s: sha256 mismatch; every byte came from %s, which is now distrusted",
                        self.version, entry.name, server)
        return False

    def _count(self, server: ServerURL, n: int) -> None:
        with self._lock:
            self._received += n
            self._bytes[server] += n
            self._last_progress = time.monotonic()

    def _fail(self, error: ShardcastError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            self._queue_cv.notify_all()

    def _close_files(self) -> None:
        for f in self._files:
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
            f.close_direct()

    def _return_buffers(self) -> None:
        """Hand every buffer back to the pool, unless a worker may still be receiving into one (the fetch was
        interrupted from outside): then the pool is retired and later fetches land through the page cache."""
        if any(t.is_alive() for t in self._workers):
            self.buffers.retire()
        else:
            with self._lock:
                for f in self._files:
                    for p in f.parts:
                        if p.buf is not None:
                            self.buffers.give_back(p.buf)
                            p.buf = None
        self.buffers.unclaim()

    def _server_summary(self) -> dict[str, dict]:
        servers = set(self._bytes) | set(self._errors) | self._distrusted
        return {str(s): {"bytes": self._bytes[s], "errors": self._errors[s], "distrusted": s in self._distrusted}
                for s in sorted(servers, key=str)}

    # ---- workers --------------------------------------------------------------------------------------

    def _worker(self) -> None:
        try:
            while True:
                with self._lock:
                    # a direct part waits for a pool buffer; parts take buffers in file order, so the part
                    # every hasher waits for always holds one and the pool cannot deadlock
                    while not self._can_start() and self._error is None and self._landed < len(self._files):
                        self._queue_cv.wait()
                    if self._error is not None or not self._queue:
                        return
                    f, part = self._queue.popleft()
                    if f.direct:
                        part.buf = self.buffers.take()
                    if f.fd is None:
                        f.fd = os.open(f.path, os.O_RDWR)
                    if not f.hashing:
                        self._start_hasher(f)
                self._fetch_part(f, part)
        except ShardcastError as e:
            self._fail(e)
        except Exception as e:  # a local failure (disk, memory): the fetch cannot go on, and says why
            self._fail(FetchError(f"version {self.version}: {type(e).__name__}: {e}"))

    def _can_start(self) -> bool:
        if not self._queue:
            return False
        f, _ = self._queue[0]
        return not f.direct or self.buffers.available() > 0

    def _fetch_part(self, f: _File, part: _Part) -> None:
        tried = _Tried()
        source: ServerURL | None = None
        path = f"/v/{self.version}/{f.entry.name}"
        while part.done < part.length and self._error is None:
            server = self._choose(f, tried)
            if f.single_source and source is not None and server != source and part.done:
                with self._lock:  # do not mix servers in a file that already failed its sha256 check
                    part.done = 0
                    f.generation += 1
                    f.sources.clear()
            source = server
            start, end = part.start + part.done, part.start + part.length - 1
            before, t0 = part.done, time.monotonic()
            try:
                resp = open_get(server, path, timeout=self.timeout, headers={"Range": f"bytes={start}-{end}"})
                try:
                    check_status(resp, path, (200, 206), self.timeout)
                    self._check_range(resp, start, end, f.entry.size)
                    with self._lock:
                        f.sources.add(server)
                    progress = lambda n: self._advance(f, part, server, n)  # noqa: E731
                    if part.buf is not None:
                        with memoryview(part.buf) as view:
                            receive_into_buffer(resp, view[part.done:part.length], timeout=self.timeout,
                                                progress=progress)
                    else:
                        receive_into_file(resp, f.fd, start, end - start + 1, timeout=self.timeout,
                                          progress=progress, use_splice=self.use_splice)
                finally:
                    resp.close()
                self.pool.record(server, True, part.done - before, time.monotonic() - t0)
                tried.backoff = 0.1
            except TransferError as e:
                self.pool.record(server, False)
                tried.failed.add(server)
                with self._lock:
                    self._errors[server] += 1
                    repeated = self._last_error.get(server) == str(e)
                    self._last_error[server] = str(e)
                    if isinstance(e, NotFound):
                        self.candidates.discard(server)
                log.log(logging.DEBUG if repeated else logging.INFO, "version %d, %s: %s", self.version,
                        f.entry.name, e)
        if part.buf is not None and part.done == part.length:
            with memoryview(part.buf) as view:
                if not write_part(None if f.direct_refused else f.dfd, f.fd, view[:part.length], part.start):
                    f.direct_refused = True  # refused at write time: the rest goes through the page cache
            with self._lock:
                part.ready = True
                f.cond.notify_all()

    def _check_range(self, resp, start: int, end: int, size: int) -> None:
        length = resp.content_length()
        if resp.status == 206:
            expected = f"bytes {start}-{end}/{size}"
            got = resp.headers.get("Content-Range", "")
            if got.strip() != expected:
                raise TransferError(resp.server, f"asked for {expected}, got Content-Range {got[:80]!r}")
        elif start != 0 or end != size - 1:
            raise TransferError(resp.server, f"ignored the Range request for bytes {start}-{end}")
        if length != end - start + 1:
            raise TransferError(resp.server, f"Content-Length {length} for a range of {end - start + 1} bytes")

    def _advance(self, f: _File, part: _Part, server: ServerURL, n: int) -> None:
        with self._lock:
            part.done += n
            self._received += n
            self._bytes[server] += n
            self._last_progress = time.monotonic()
            f.cond.notify_all()

    def _choose(self, f: _File, tried: _Tried) -> ServerURL:
        """A server for the next request. When every candidate has failed this part, back off, ask all servers
        again who holds the version (one may have come up or caught up), and start over; give up after
        `patience` seconds without a byte received."""
        if time.monotonic() - self._last_refresh > REFRESH_S:  # servers that caught up since share the load
            self._last_refresh = time.monotonic()
            threading.Thread(target=self._refresh_candidates, name="shardcast-refresh", daemon=True).start()
        while True:
            with self._lock:
                if self._error is not None:
                    raise self._error
                choices = self.candidates - self._distrusted - tried.failed
                stalled = time.monotonic() - self._last_progress
            if choices:
                server = self.pool.choose(sorted(choices, key=str))
                if server is not None:
                    return server
            if self._distrusted >= set(self.pool.servers):
                raise FetchError(f"version {self.version}: every server sent bytes that failed the sha256 check "
                                 f"({', '.join(sorted(map(str, self._distrusted)))})")
            if stalled > self.patience:
                with self._lock:
                    errors = "; ".join(self._last_error.get(s, f"{s}: no answer")
                                       for s in sorted(set(self._last_error) | self.candidates, key=str))
                raise FetchError(f"version {self.version}, {f.entry.name}: nothing received for "
                                 f"{self.patience:.0f} s; last errors: {errors or 'no server offers it'}")
            time.sleep(tried.backoff)
            tried.backoff = min(2 * tried.backoff, 2.0)
            tried.failed.clear()
            self._refresh_candidates()

    def _refresh_candidates(self) -> None:
        """Add the servers that offer the version now (one asking at a time; the others go on)."""
        if not self._refresh_lock.acquire(blocking=False):
            return
        try:
            found = self.refresh()
        finally:
            self._last_refresh = time.monotonic()
            self._refresh_lock.release()
        with self._lock:
            self.candidates |= found

    # ---- hashing --------------------------------------------------------------------------------------

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
                    digest.update(view[:part.length])
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
            if digest == f.entry.sha256:
                fd, f.fd = f.fd, None
                f.close_direct()
            else:
                self._mismatch(f)
                return False
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
        return True

    def _mismatch(self, f: _File) -> None:
        """Called with the lock held: the file's bytes do not have the manifest's sha256."""
        f.mismatches += 1
        sources = sorted(f.sources, key=str)
        if len(sources) == 1:
            self._distrusted.add(sources[0])
            self.pool.distrust(sources[0])
            self._last_error[sources[0]] = f"sent {f.entry.name} with a wrong sha256"
            log.warning("version %d, %s: sha256 mismatch; every byte came from %s, which is now distrusted",
                        self.version, f.entry.name, sources[0])
        else:
            for server in sources:
                self.pool.record(server, False)
            log.warning("version %d, %s: sha256 mismatch from %s; fetching it again from one server",
                        self.version, f.entry.name, ", ".join(map(str, sources)))
        if f.mismatches > 2 * len(self.pool.servers) + 1:
            self._error = FetchError(f"version {self.version}, {f.entry.name}: sha256 mismatch {f.mismatches} "
                                     f"times (sources: {', '.join(map(str, sources))})")
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
