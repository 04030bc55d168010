"""A download's files rebuilt from a held base and a delta (`bridge.shardcast.delta`), before any part.

The delta is fetched whole from one server at a time and checked against its sha256 (a server whose delta
fails it is distrusted); the rebuilt file is checked against the full file's sha256. A file that cannot be
rebuilt is left to be fetched in full.
"""

from __future__ import annotations

import logging
import os
import time
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
        """Fetch the delta (unless held already), rebuild `entry` from it and check the result's sha256."""
        mirrored = d.name in {e.name for e in self.entries}
        delta_path = self.partial / (d.name if mirrored else f".{d.name}")
        t0 = time.monotonic()
        if d.name not in done and not self._fetch_verified(d, delta_path):
            return False
        t1 = time.monotonic()
        if mirrored:
            done.add(d.name)
            self.listener.file_verified(d.name)  # a relay serves it now, while it rebuilds the file from it
        base_file = self.bases_root / version_dirname(d.base) / entry.name
        out = self.partial / entry.name
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            writeback = (lambda pos, n: disk.start_writeback(fd, pos, n)) if self.fsync else None
            digest = deltas.apply_delta(base_file, delta_path, fd, entry.size, writeback)
            if digest == entry.sha256 and self.fsync:
                os.fsync(fd)
        except (deltas.DeltaError, OSError) as e:
            log.warning(
                "version %d, %s: cannot rebuild from %s (%s); fetching it in full", self.version, entry.name, d.name, e
            )
            digest = None
        finally:
            os.close(fd)
            if not mirrored:
                delta_path.unlink(missing_ok=True)
        if digest != entry.sha256:
            if digest is not None:
                log.warning(
                    "version %d, %s rebuilt from the verified delta %s has a wrong sha256: the held base "
                    "%s is corrupt; fetching it in full",
                    self.version,
                    entry.name,
                    d.name,
                    base_file,
                )
            return False
        log.info(
            "version %d, %s: rebuilt from %s (%.2f s to fetch the delta, %.2f s to rebuild and check the file)",
            self.version,
            entry.name,
            d.name,
            t1 - t0,
            time.monotonic() - t1,
        )
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
                        receive_into_file(
                            resp,
                            fd,
                            0,
                            entry.size,
                            timeout=self.timeout,
                            progress=lambda n: self._count(server, n),  # noqa: B023 (called before the loop moves on)
                            use_splice=self.use_splice,
                        )
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
            log.warning(
                "version %d, %s: sha256 mismatch; every byte came from %s, which is now distrusted",
                self.version,
                entry.name,
                server,
            )
        return False

    def _count(self, server: ServerURL, n: int) -> None:
        with self._lock:
            self._received += n
            self._bytes[server] += n
            self._last_progress = time.monotonic()
