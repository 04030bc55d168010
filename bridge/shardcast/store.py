"""The versions one server advertises and serves: a directory of `v000123/` version directories.

A `VersionStore` lives on the server's event loop (one thread; no locks). Its states:

- advertised: complete and checked (STABLE, manifest, every file with its size); listed by `/versions`;
- retiring (relays only): older than the newest `keep` versions (the newest anchor version, the base of the
  anchor deltas, stays advertised beside them), no longer listed but still served, and
  deleted only once nothing is pinning it (a response being sent) and nobody has touched it for `grace_s`
  seconds, so a client that is between two files of a download does not lose the version under it.

- arriving (relays only, manifests with part hashes): being mirrored into its partial directory; listed by
  `/versions` under `partial`, never under `versions`; only the parts (and whole files) the mirror has checked
  against the manifest are served, and only to requests that ask for a partial version (`Arriving`).

The origin rescans its directory (`scan`), because the learner writes new versions into it; a relay adds the
versions it has mirrored and verified (`add`), and reports what it has checked of the one arriving
(`begin_arriving`, `part_checked`, `file_checked`, `drop_arriving`). Long-polls wait on `wait_newer`, requests
for a part not checked yet on `wait_checked`.
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

from bridge.shardcast import disk
from bridge.shardcast.delta import retained
from bridge.shardcast.errors import ManifestError
from bridge.shardcast.manifest import Manifest, read_version_dir, version_path
from bridge.shardcast.names import STABLE_FILE, parse_version_dirname, version_dirname

log = logging.getLogger("shardcast.store")


class Arriving:
    """A version a relay is still receiving: its manifest and what of it has been checked so far."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.parts: dict[str, set[int]] = {}  # file name -> indices of the parts that match their sha256
        self.files: set[str] = set()  # files (or delta files) verified: their sha256, or every part's

    def checked(self, name: str, start: int, count: int) -> bool:
        """Whether bytes `start`..`start + count - 1` of file `name` lie in checked parts (or a checked file)."""
        if name in self.files:
            return True
        entry = self.manifest.served.get(name)
        if entry is None or not entry.parts or count <= 0:
            return False
        held = self.parts.get(name, ())
        size = self.manifest.part_size
        return all(i in held for i in range(start // size, (start + count - 1) // size + 1))


class VersionStore:
    def __init__(self, root: Path, *, keep: int | None = None, grace_s: float = 30.0, keep_anchor: bool = True):
        """`keep` None: never delete anything (the origin serves the learner's directory as it is); `keep_anchor`:
        also keep the newest anchor version (`bridge.shardcast.delta.retained`), the base of later deltas."""
        self.root = Path(root)
        self.keep = keep
        self.keep_anchor = keep_anchor
        self.grace_s = grace_s
        self.advertised: dict[int, Manifest] = {}
        self.retiring: dict[int, Manifest] = {}
        self._pins: Counter[int] = Counter()
        self._last_access: dict[int, float] = {}
        self._rejected: dict[int, float] = {}  # version -> mtime of the STABLE we refused (log once)
        self._changed = asyncio.Event()
        self.arriving: dict[int, Arriving] = {}
        self._checked = asyncio.Event()  # set (and replaced) whenever something more of an arriving version counts

    @property
    def latest(self) -> int | None:
        return max(self.advertised, default=None)

    def listing(self) -> dict:
        """`/versions`: `partial` (versions still arriving) only when there is one, so that the answer of a
        server that pipelines nothing is what it always was."""
        doc: dict = {"latest": self.latest, "versions": sorted(self.advertised)}
        if self.arriving:
            doc["partial"] = sorted(self.arriving)
        return doc

    def partial_path(self, version: int) -> Path:
        return disk.partial_dir(self.root, version)

    # ---- a version still arriving (a relay's mirror reports from its thread, through the event loop) ----

    def begin_arriving(self, version: int, manifest: Manifest) -> None:
        """The mirror started (or restarted) fetching `version`: nothing of it is checked yet."""
        if version in self.advertised or version in self.retiring or manifest.part_size is None:
            return
        self.arriving[version] = Arriving(manifest)
        log.info("serving %s part by part while it arrives", version_dirname(version))
        self._notify()
        self._notify_checked()

    def part_checked(self, version: int, name: str, index: int) -> None:
        arriving = self.arriving.get(version)
        if arriving is not None:
            arriving.parts.setdefault(name, set()).add(index)
            self._notify_checked()

    def file_checked(self, version: int, name: str) -> None:
        arriving = self.arriving.get(version)
        if arriving is not None:
            arriving.files.add(name)
            self._notify_checked()

    def drop_arriving(self, version: int) -> None:
        """The mirror gave up on `version` (it will start over): stop serving what it had checked."""
        if self.arriving.pop(version, None) is not None:
            log.info("no longer serving %s part by part (its fetch failed)", version_dirname(version))
            self._notify()
            self._notify_checked()

    def _notify_checked(self) -> None:
        self._checked.set()
        self._checked = asyncio.Event()

    async def wait_checked(self, timeout: float) -> None:
        """Return when anything more of an arriving version counts (or it lands, or is dropped), or after
        `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._checked.wait(), timeout)

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
        if self.arriving.pop(version, None) is not None:
            self._notify_checked()
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

    async def wait_newer(self, after: int, timeout: float, partial: bool = False) -> None:
        """Return once a version newer than `after` is advertised (or, with `partial`, arriving), or after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout

        def newest() -> int | None:
            return max([*self.advertised, *(self.arriving if partial else ())], default=None)

        while ((n := newest()) is None or n <= after) and (left := deadline - time.monotonic()) > 0:
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
        """Retire versions beyond the newest `keep` (but the newest anchor, with `keep_anchor`); delete retired
        ones that are idle (relays only)."""
        if self.keep is None:
            return
        latest = self.advertised.get(self.latest) if self.advertised else None
        bases = {d.base for d in latest.deltas} if latest is not None else set()
        kept = retained(self.advertised, self.keep, self.keep_anchor, bases=bases)
        if latest is not None and latest.base_version in self.advertised:  # a LoRA adapter's base stays beside it
            kept.add(latest.base_version)
        for version in sorted(set(self.advertised) - kept):
            self.retiring[version] = self.advertised.pop(version)
            self._last_access[version] = time.monotonic()
            log.info("retiring %s (keeping the newest %d and the newest anchor)", version_dirname(version), self.keep)
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
