"""The versions one server advertises and serves: a directory of `v000123/` version directories.

A `VersionStore` lives on the server's event loop (one thread; no locks). Its states:

- advertised: complete and checked (STABLE, manifest, every file with its size); listed by `/versions`;
- retiring (relays only): older than the newest `keep` versions, no longer listed but still served, and
  deleted only once nothing is pinning it (a response being sent) and nobody has touched it for `grace_s`
  seconds, so a client that is between two files of a download does not lose the version under it.

The origin rescans its directory (`scan`), because the learner writes new versions into it; a relay adds the
versions it has mirrored and verified (`add`). Long-polls wait on `wait_newer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

from bridge.shardcast.errors import ManifestError
from bridge.shardcast.manifest import Manifest, read_version_dir, version_path
from bridge.shardcast.names import STABLE_FILE, parse_version_dirname, version_dirname

log = logging.getLogger("shardcast.store")


class VersionStore:
    def __init__(self, root: Path, *, keep: int | None = None, grace_s: float = 30.0):
        """`keep` None: never delete anything (the origin serves the learner's directory as it is)."""
        self.root = Path(root)
        self.keep = keep
        self.grace_s = grace_s
        self.advertised: dict[int, Manifest] = {}
        self.retiring: dict[int, Manifest] = {}
        self._pins: Counter[int] = Counter()
        self._last_access: dict[int, float] = {}
        self._rejected: dict[int, float] = {}  # version -> mtime of the STABLE we refused (log once)
        self._changed = asyncio.Event()

    @property
    def latest(self) -> int | None:
        return max(self.advertised, default=None)

    def listing(self) -> dict:
        return {"latest": self.latest, "versions": sorted(self.advertised)}

    def path(self, version: int) -> Path:
        return version_path(self.root, version)

    def lookup(self, version: int) -> Manifest | None:
        """The manifest of a version this server still serves (advertised or retiring)."""
        return self.advertised.get(version) or self.retiring.get(version)

    def scan(self) -> None:
        """Advertise every complete version in the directory that is not advertised yet; forget vanished ones."""
        try:
            names = [entry.name for entry in os.scandir(self.root)]
        except FileNotFoundError:
            names = []
        present = {v for v in map(parse_version_dirname, names) if v is not None}
        for version in sorted(present - self.advertised.keys() - self.retiring.keys()):
            stable = self.path(version) / STABLE_FILE
            try:
                mtime = stable.stat().st_mtime
            except OSError:
                continue  # still being written
            if self._rejected.get(version) == mtime:
                continue
            try:
                self._advertise(version, read_version_dir(self.path(version), version, with_deltas=True))
            except ManifestError as e:
                self._rejected[version] = mtime
                log.error("not serving %s: %s", version_dirname(version), e)
        for version in list(self.advertised):
            if version not in present:
                log.info("%s left %s; no longer served", version_dirname(version), self.root)
                del self.advertised[version]
                self._notify()
        self.prune()

    def add(self, version: int, manifest: Manifest) -> None:
        """A version landed (complete and verified) in the directory: advertise it."""
        self._advertise(version, manifest)
        self.prune()

    def _advertise(self, version: int, manifest: Manifest) -> None:
        self.advertised[version] = manifest
        self._rejected.pop(version, None)
        log.info(
            "serving %s (%d files, %.1f MiB)",
            version_dirname(version),
            len(manifest.files),
            manifest.total_size / 2**20,
        )
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_newer(self, after: int, timeout: float) -> None:
        """Return once a version newer than `after` is advertised, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (self.latest is None or self.latest <= after) and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    @contextlib.contextmanager
    def pinned(self, version: int):
        """Hold a version while a response from it is being sent; touches its last-access time."""
        self._pins[version] += 1
        self._last_access[version] = time.monotonic()
        try:
            yield
        finally:
            self._pins[version] -= 1
            self._last_access[version] = time.monotonic()

    def touch(self, version: int) -> None:
        self._last_access[version] = time.monotonic()

    def prune(self) -> None:
        """Retire versions beyond the newest `keep`; delete retired ones that are idle (relays only)."""
        if self.keep is None:
            return
        for version in sorted(self.advertised)[: -self.keep]:
            self.retiring[version] = self.advertised.pop(version)
            self._last_access[version] = time.monotonic()
            log.info("retiring %s (keeping the newest %d)", version_dirname(version), self.keep)
            self._notify()
        now = time.monotonic()
        for version in list(self.retiring):
            if self._pins[version] == 0 and now - self._last_access.get(version, 0.0) >= self.grace_s:
                del self.retiring[version]
                self._pins.pop(version, None)
                self._last_access.pop(version, None)
                self._delete(version)

    def _delete(self, version: int) -> None:
        path = self.path(version)
        trash = self.root / f".{path.name}.deleting-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except OSError as e:
            log.error("cannot delete %s: %s", path, e)
            return
        log.info("deleted %s", version_dirname(version))
        asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, trash, True)
