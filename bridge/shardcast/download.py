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
full like any other. A relay (`mirror_deltas`) also lands the delta files against the newest version it holds
below this one (first, so that it can serve them early), to serve them; it fetches any other delta file only
when a client first asks for it (`bridge.shardcast.relay.LazyDeltas`), so its hop costs what a worker's does.

Part hashes (a manifest with `part_size`): such a file is fetched in exactly the manifest's parts, and each part
is checked against its own sha256 as soon as its last byte has landed, before it counts: with direct I/O from
its buffer before it is written, otherwise from the page cache. A part that fails is fetched again (a server
whose bytes alone failed it is distrusted), so a lying server costs one part, not a file. The file is verified
once its last part is: the manifest's part hashes cover every byte (`manifest` refuses a file whose part count
does not match its size), and the manifest is the one pinned by the learner's announcement, so hashing the
whole file again would check nothing more and cost every hop one more pass over the bytes. A `FetchListener`
hears of every checked part and file (a relay serves them while the rest arrives: `bridge.shardcast.relay`), and
`partial_wait` asks servers for parts of versions they are still receiving, waiting up to that many seconds.

`Download` schedules the parts (this module) and takes its other concerns from mixins, one module each:
`journal` (files and parts restored from an interrupted fetch, the progress journal), `rebuild` (deltas),
`choice` (which server for each request), `verify` (the hashing threads, mismatches); `parts` holds the
structures they share.
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
from dataclasses import dataclass
from pathlib import Path

from bridge.shardcast import delta as deltas
from bridge.shardcast import disk
from bridge.shardcast.choice import ServerChoice
from bridge.shardcast.direct import BufferPool, write_part
from bridge.shardcast.errors import FetchError, NotFound, ShardcastError, TransferError
from bridge.shardcast.journal import Resume
from bridge.shardcast.manifest import DeltaEntry, FileEntry, Manifest
from bridge.shardcast.names import STABLE_FILE, ServerURL, parse_version_dirname, version_dirname
from bridge.shardcast.parts import _File, _Part, _Tried
from bridge.shardcast.pool import ServerPool
from bridge.shardcast.rebuild import Rebuild
from bridge.shardcast.transfer import HAVE_SPLICE, check_status, open_get, receive_into_buffer, receive_into_file
from bridge.shardcast.verify import Verification

log = logging.getLogger("shardcast.download")

TICK_S = 0.2
JOURNAL_EVERY_S = 1.0
PARTIAL_HEADER = "X-Shardcast-Partial"  # "WAIT": serve checked parts of a version still arriving (server.py)


def eager_deltas(manifest: Manifest, bases_root: Path) -> list[DeltaEntry]:
    """The delta files a relay mirrors with a version: those against the newest version complete in
    `bases_root` below it (its clients', who fetch every version, base); none when it holds no older one."""
    held = []
    for entry in os.scandir(bases_root) if bases_root.is_dir() else ():
        v = parse_version_dirname(entry.name)
        if v is not None and v < manifest.version and os.path.exists(os.path.join(entry.path, STABLE_FILE)):
            held.append(v)
    if not held:
        return []
    return [d for d in manifest.deltas if d.base == max(held)]


class FetchListener:
    """What a download has checked so far, as it happens (a relay's server serves it at once). Called from the
    download's threads; the default does nothing."""

    def started(self, manifest: Manifest, partial: Path) -> None:
        """The files are in `partial` at their full size; nothing of them is checked yet unless reported."""

    def part_verified(self, name: str, index: int) -> None:
        """Part `index` of file `name` matches its sha256 in the manifest, and is final on disk."""

    def file_verified(self, name: str) -> None:
        """The whole file `name` is verified (its sha256, or every part's) and is final on disk."""

    def abandoned(self) -> None:
        """The fetch failed: what it reported may be rewritten by a later attempt."""


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
    chain: tuple[FetchResult, ...] = ()  # versions landed first, each rebuilt from the one before (a delta chain)

    @property
    def mb_per_s(self) -> float:
        return self.received_bytes / max(self.seconds, 1e-9) / 1e6

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "path": str(self.path),
            "total_bytes": self.total_bytes,
            "received_bytes": self.received_bytes,
            "resumed_bytes": self.resumed_bytes,
            "seconds": round(self.seconds, 4),
            "mb_per_s": round(self.mb_per_s, 1),
            "servers": self.servers,
            "already_present": self.already_present,
            "direct_io": self.direct_io,
            "rebuilt_files": self.rebuilt_files,
            "chain": [r.to_json() for r in self.chain],
        }


class Download(Resume, Rebuild, ServerChoice, Verification):
    """Fetch `manifest`'s version from `candidates` into `root`; `run()` returns a FetchResult or raises."""

    def __init__(
        self,
        *,
        manifest: Manifest,
        root: Path,
        pool: ServerPool,
        candidates: set[ServerURL],
        refresh: Callable[[], set[ServerURL]],
        timeout: float,
        patience: float,
        parallel: int,
        part_bytes: int,
        fsync: bool = True,
        use_splice: bool = HAVE_SPLICE,
        buffers: BufferPool | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        replace_held: bool = False,
        use_deltas: bool = True,
        mirror_deltas: bool = False,
        bases_root: Path | None = None,
        listener: FetchListener | None = None,
        partial_wait: float | None = None,
        refresh_first: bool = False,
    ):
        """`replace_held`: a version already landed in `root` under another manifest is removed and this one
        fetched in its place (the manifest is pinned from a trusted source); otherwise that is an error.
        `use_deltas`: rebuild files from the versions held in `bases_root` (default `root`) where the manifest
        has deltas; `mirror_deltas`: land the delta files against the newest version held below this one too (a
        relay, which serves them; it fetches the others when a client first asks: `eager_deltas`). `listener`: told of
        every checked part and file; `partial_wait`: with part hashes, also take parts from servers that are
        still receiving the version, each waiting up to that many seconds for a part (None: never);
        `refresh_first`: `candidates` are the servers that answered a wait, so ask all servers who holds the
        version as soon as the parts start (in the background), not `REFRESH_S` later."""
        self.manifest, self.version = manifest, manifest.version
        self.use_deltas = use_deltas and deltas.HAVE_ZSTD
        self.bases_root = Path(bases_root if bases_root is not None else root)
        mirrored = eager_deltas(manifest, self.bases_root) if mirror_deltas else []
        self.entries: list[FileEntry] = mirrored + list(manifest.files)
        self.listener = listener or FetchListener()
        self._headers = {}
        if partial_wait is not None and manifest.part_size is not None:
            self._headers = {PARTIAL_HEADER: f"{partial_wait:.3f}"}
        self.partial_wait = partial_wait or 0.0
        self.total = sum(e.size for e in self.entries)
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
        self._last_refresh = float("-inf") if refresh_first else time.monotonic()

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
                    return FetchResult(
                        self.version, self.final, held.total_size, 0, 0, time.monotonic() - t0, {}, already_present=True
                    )
                except FetchError:
                    if not self.replace_held:
                        raise
                    disk.discard(self.final)
            if self.final.exists():
                shutil.rmtree(self.final)  # a leftover without STABLE is incomplete
            self._direct = self.buffers is not None and self.buffers.claim()
            try:
                self._prepare()  # tells the listener it started
                for f in self._files:
                    if f.verified:
                        self.listener.file_verified(f.entry.name)
                self._transfer()
            except BaseException as e:
                self._fail(e if isinstance(e, ShardcastError) else FetchError(f"interrupted ({e!r})"))
                self._write_journal()
                self.listener.abandoned()
                raise
            finally:
                self._close_files()
                if self._direct:
                    self._return_buffers()
            disk.land(self.root, self.manifest, self.fsync)
            lock_path.unlink(missing_ok=True)
        return FetchResult(
            self.version,
            self.final,
            self.manifest.total_size,
            self._received,
            self._resumed,
            time.monotonic() - t0,
            self._server_summary(),
            direct_io=any(f.direct for f in self._files),
            rebuilt_files=self._rebuilt,
        )

    def _transfer(self) -> None:
        workers = self._workers = [
            threading.Thread(target=self._worker, name=f"shardcast-get-{i}", daemon=True) for i in range(self.parallel)
        ]
        for f in self._files:
            if not f.verified and not f.part_hashed and f.complete():
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
                    recheck = f.part_hashed and part.done == part.length  # resumed from disk: check it first
                    if f.direct and not recheck:
                        part.buf = self.buffers.take()
                    if f.fd is None:
                        f.fd = os.open(f.path, os.O_RDWR)
                    if not f.hashing and not f.part_hashed:
                        self._start_hasher(f)
                if recheck:
                    self._recheck_part(f, part)
                else:
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
        sources: set[ServerURL] = set()  # the servers the part's bytes came from (with part hashes)
        unknown = part.done > 0  # some bytes came from an earlier run, from servers unknown now
        single = False  # after a part mismatch with several sources: the part from one server
        while self._error is None:
            while part.done < part.length and self._error is None:
                server = self._choose(f, tried)
                if f.single_source and source is not None and server != source and part.done:
                    with self._lock:  # do not mix servers in a file that already failed its sha256 check
                        part.done = 0
                        f.generation += 1
                        f.sources.clear()
                if single and source is not None and server != source and part.done:
                    with self._lock:
                        part.done = 0
                    sources.clear()
                source = server
                start, end = part.start + part.done, part.start + part.length - 1
                before, t0 = part.done, time.monotonic()
                try:
                    resp = open_get(
                        server,
                        path,
                        timeout=self.timeout,
                        headers={"Range": f"bytes={start}-{end}", **self._headers},
                        wait=self.partial_wait,
                    )
                    try:
                        check_status(resp, path, (200, 206), self.timeout)
                        self._check_range(resp, start, end, f.entry.size)
                        with self._lock:
                            f.sources.add(server)
                        sources.add(server)
                        progress = lambda n: self._advance(f, part, server, n)  # noqa: E731, B023 (this iteration)
                        if part.buf is not None:
                            with memoryview(part.buf) as view:
                                receive_into_buffer(
                                    resp, view[part.done : part.length], timeout=self.timeout, progress=progress
                                )
                        else:
                            receive_into_file(
                                resp,
                                f.fd,
                                start,
                                end - start + 1,
                                timeout=self.timeout,
                                progress=progress,
                                use_splice=self.use_splice,
                            )
                    finally:
                        resp.close()
                    self.pool.record(server, True, part.done - before, time.monotonic() - t0)
                    tried.backoff = 0.1
                except TransferError as e:
                    tried.failed.add(server)
                    not_yet = e.status == 503  # a server still receiving the version: no fault of its own
                    if not not_yet:
                        self.pool.record(server, False)
                    with self._lock:
                        if not not_yet:
                            self._errors[server] += 1
                        repeated = self._last_error.get(server) == str(e)
                        self._last_error[server] = str(e)
                        if isinstance(e, NotFound):
                            self.candidates.discard(server)
                    log.log(
                        logging.DEBUG if repeated or not_yet else logging.INFO,
                        "version %d, %s: %s",
                        self.version,
                        f.entry.name,
                        e,
                    )
            if part.done < part.length:
                return  # the fetch failed
            if not f.part_hashed or self._part_matches(f, part):
                break
            single = self._part_mismatch(f, part, sources, unknown)
            sources.clear()
            unknown = False
        if part.done < part.length:
            return
        if part.buf is not None:
            with memoryview(part.buf) as view:
                if not write_part(None if f.direct_refused else f.dfd, f.fd, view[: part.length], part.start):
                    f.direct_refused = True  # refused at write time: the rest goes through the page cache
            with self._lock:
                part.ready = True
                if f.part_hashed:  # checked from the buffer before the write: nothing else needs it
                    self.buffers.give_back(part.buf)
                    part.buf = None
                    self._queue_cv.notify_all()
                f.cond.notify_all()
        elif f.part_hashed and self.fsync:
            disk.start_writeback(f.fd, part.start, part.length)
        if f.part_hashed:
            self._part_verified(f, part)

    def _part_matches(self, f: _File, part: _Part) -> bool:
        """Whether the landed bytes of a whole part have its sha256: from its buffer, else from the file."""
        expected = f.entry.parts[part.start // self.manifest.part_size]
        if part.buf is not None:
            with memoryview(part.buf) as view:
                return hashlib.sha256(view[: part.length]).hexdigest() == expected
        with mmap.mmap(f.fd, part.length, offset=part.start, prot=mmap.PROT_READ) as mapped:
            with memoryview(mapped) as view:
                return hashlib.sha256(view).hexdigest() == expected

    def _part_verified(self, f: _File, part: _Part) -> None:
        with self._lock:
            part.verified = part.ready = True
            last = not f.finishing and f.complete()
            f.finishing = f.finishing or last
            f.cond.notify_all()
            self._queue_cv.notify_all()
        self.listener.part_verified(f.entry.name, part.start // self.manifest.part_size)
        if last:
            self._parts_landed(f)

    def _part_mismatch(self, f: _File, part: _Part, sources: set[ServerURL], unknown: bool) -> bool:
        """A part's bytes failed its sha256: they are thrown away and the part fetched again. Its only source
        is distrusted; with several, each is marked failed and the part is taken from one server. Returns
        whether the next attempt must come from one server."""
        index = part.start // self.manifest.part_size
        with self._lock:
            part.done = 0
            part.mismatches += 1
            named = ", ".join(sorted(map(str, sources))) or "an earlier run"
            if part.mismatches > 2 * len(self.pool.servers) + 1:
                raise FetchError(
                    f"version {self.version}, {f.entry.name}: part {index} failed its sha256 {part.mismatches} "
                    f"times (last from {named})"
                )
            single = len(sources) == 1 and not unknown
            self._blame(f, sources, single, f"part {index} of {f.entry.name}", f"part {index} fails its sha256")
        return not single

    def _recheck_part(self, f: _File, part: _Part) -> None:
        """A whole part resumed from disk: it counts once it matches its sha256, else it is fetched again."""
        if self._part_matches(f, part):
            self._part_verified(f, part)
            return
        log.info("version %d, %s: a resumed part fails its sha256; fetching it again", self.version, f.entry.name)
        with self._lock:
            self._resumed -= part.done
            part.done = 0
            self._queue.appendleft((f, part))
            self._queue_cv.notify_all()

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
