"""A download's files rebuilt from a held base and a delta (`bridge.shardcast.delta`), before any part.

The delta is fetched whole from one server at a time and checked against its sha256 (a server whose delta
fails it is distrusted); the rebuilt file is checked against the full file's sha256. The rebuild runs in a
thread of its own while the delta lands, reading each delta byte once it has landed, so most of it is done
when the last byte arrives; a rebuild from a delta that then fails its sha256, or whose transfer breaks off,
is abandoned and started again from the next server's. A file that cannot be rebuilt is left to be fetched
in full.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bridge.shardcast import delta as deltas
from bridge.shardcast import disk
from bridge.shardcast.errors import FetchError, TransferError
from bridge.shardcast.manifest import DeltaEntry, FileEntry, Manifest
from bridge.shardcast.names import STABLE_FILE, ServerURL, version_dirname
from bridge.shardcast.parts import _sha256_file
from bridge.shardcast.transfer import check_status, open_get, receive_into_file

log = logging.getLogger("shardcast.download")


class Rebuild:
    """Mixin of `Download`: `_rebuild` the files that have a usable delta."""

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
        """Fetch the delta (unless held already) while rebuilding `entry` from it as it lands, then check the
        delta's sha256 and the rebuilt file's."""
        mirrored = d.name in {e.name for e in self.entries}
        delta_path = self.partial / (d.name if mirrored else f".{d.name}")
        base_file = self.bases_root / version_dirname(d.base) / entry.name
        t0 = time.monotonic()
        fd = os.open(self.partial / entry.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            writeback = (lambda pos, n: disk.start_writeback(fd, pos, n)) if self.fsync else None

            def rebuild(source: Path | _Landing) -> _Applier:
                return _Applier(base_file, source, fd, entry.size, writeback)

            if d.name in done:  # mirrored and checked already
                applier = rebuild(delta_path)
            elif (applier := self._fetch_verified(d, delta_path, rebuild)) is None:
                return False
            t1 = time.monotonic()
            try:
                if mirrored:
                    done.add(d.name)
                    self.listener.file_verified(d.name)  # a relay serves it now, while it finishes the file from it
            finally:
                digest = applier.finish(True)
            if isinstance(digest, Exception):
                log.warning(
                    "version %d, %s: cannot rebuild from %s (%s); fetching it in full",
                    self.version,
                    entry.name,
                    d.name,
                    digest,
                )
                return False
            if digest != entry.sha256:
                log.warning(
                    "version %d, %s rebuilt from the verified delta %s has a wrong sha256: the held base "
                    "%s is corrupt; fetching it in full",
                    self.version,
                    entry.name,
                    d.name,
                    base_file,
                )
                return False
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
            if not mirrored:
                delta_path.unlink(missing_ok=True)
        log.info(
            "version %d, %s: rebuilt from %s (%.2f s to fetch the delta while rebuilding, %.2f s more to finish "
            "and check the file)",
            self.version,
            entry.name,
            d.name,
            t1 - t0,
            time.monotonic() - t1,
        )
        return True

    def _fetch_verified(self, entry: FileEntry, path: Path, follow: Callable[[_Landing], _Applier]) -> _Applier | None:
        """Fetch `entry` whole into `path` from one server after another until its bytes have its sha256,
        applying it (`follow`) as its bytes land; returns that server's applier, still running. A server whose
        bytes do not have the sha256 is distrusted for the rest of the fetch. None when no server delivered."""
        tried: set[ServerURL] = set()
        url_path = f"/v/{self.version}/{entry.name}"
        while self._error is None:
            with self._lock:
                choices = sorted(self.candidates - self._distrusted - tried, key=str)
            if not choices:
                return None
            server = self.pool.choose(choices) or choices[0]
            tried.add(server)
            t0 = time.monotonic()
            applier: _Applier | None = None
            try:
                resp = open_get(server, url_path, timeout=self.timeout, headers=self._headers, wait=self.partial_wait)
                try:
                    check_status(resp, url_path, (200,), self.timeout)
                    if resp.content_length() != entry.size:
                        raise TransferError(
                            server,
                            f"GET {url_path}: Content-Length {resp.content_length()}, the manifest says {entry.size}",
                        )
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        landing = _Landing(path, fd, entry.size)
                        applier = follow(landing)

                        def progress(n: int) -> None:
                            self._count(server, n)  # noqa: B023 (called before the loop moves on)
                            landing.add(n)  # noqa: B023

                        receive_into_file(
                            resp,
                            fd,
                            0,
                            entry.size,
                            timeout=self.timeout,
                            progress=progress,
                            use_splice=self.use_splice,
                        )
                    finally:
                        os.close(fd)
                finally:
                    resp.close()
                self.pool.record(server, True, entry.size, time.monotonic() - t0)
                if _sha256_file(path) == entry.sha256:
                    return applier
                applier.finish(False)  # below: the server is distrusted
            except BaseException as e:  # a rebuild still running never outlives its attempt
                if applier is not None:
                    applier.finish(False)
                if not isinstance(e, TransferError):
                    raise
                self.pool.record(server, False)
                with self._lock:
                    self._errors[server] += 1
                    self._last_error[server] = str(e)
                log.info("version %d, %s: %s", self.version, entry.name, e)
                continue
            with self._lock:
                self._distrusted.add(server)
                self._last_error[server] = f"sent {entry.name} with a wrong sha256"
            self.pool.distrust(server)
            log.warning(
                "version %d, %s: sha256 mismatch; every byte came from %s, which is now distrusted",
                self.version,
                entry.name,
                server,
            )
        return None

    def _count(self, server: ServerURL, n: int) -> None:
        with self._lock:
            self._received += n
            self._bytes[server] += n
            self._last_progress = time.monotonic()


class _Landing:
    """A file's bytes in order as a transfer lands them (`add`), for `apply_delta` in another thread: `read`
    waits for bytes that have not landed yet, and fails once the transfer is abandoned."""

    def __init__(self, path: Path, fd: int, size: int):
        self.path, self.fd, self.size = path, os.dup(fd), size  # read after the transfer has closed its own
        self._cond = threading.Condition()
        self._landed = self._pos = 0
        self._abandoned = False

    def __str__(self) -> str:
        return str(self.path)

    def add(self, n: int) -> None:
        with self._cond:
            self._landed += n
            self._cond.notify()

    def abandon(self) -> None:
        with self._cond:
            self._abandoned = True
            self._cond.notify()

    def read(self, n: int = -1) -> bytes:
        with self._cond:
            while self._landed <= self._pos < self.size and not self._abandoned:
                self._cond.wait()
            if self._abandoned:
                raise deltas.DeltaError(f"{self.path}: its transfer was abandoned")
            ready = self._landed - self._pos
        data = os.pread(self.fd, ready if n < 0 else min(n, ready), self._pos)
        self._pos += len(data)
        return data


class _Applier:
    """`apply_delta` in a thread of its own (the delta may still be landing); `finish` gives its result."""

    def __init__(self, base: Path, source: Path | _Landing, fd: int, size: int, writeback):
        self._source = source
        self._result: str | Exception | None = None
        self._thread = threading.Thread(
            target=self._run, args=(base, source, fd, size, writeback), daemon=True, name="shardcast-rebuild"
        )
        self._thread.start()

    def _run(self, base, source, fd, size, writeback) -> None:
        try:
            self._result = deltas.apply_delta(base, source, fd, size, writeback)
        except (deltas.DeltaError, OSError) as e:
            self._result = e
        finally:
            if isinstance(source, _Landing):
                os.close(source.fd)

    def finish(self, keep: bool) -> str | Exception | None:
        """The rebuilt file's sha256 (or why it failed) once done; `keep=False` abandons a rebuild whose delta
        did not arrive whole or was wrong."""
        if not keep and isinstance(self._source, _Landing):
            self._source.abandon()
        self._thread.join()
        return self._result
