"""A relay: mirrors its upstreams (an origin or other relays) and serves what it has verified.

The mirror runs in a thread with a `ShardcastClient` on the upstreams: it long-polls them for a version
newer than its newest, fetches the new versions (newest first, at most `keep` of them) with the same
parallel, verified, resumable download a worker uses, and hands each landed version to the event loop, which
advertises it. So a relay never offers a version as complete before every file of it has passed its sha256
check, and a chain of relays behaves like one. Retention (`keep`, `grace_s`) is the `VersionStore`'s.

Pipelining: when the manifest has part hashes, the download reports each part (and file) as it passes its
check (`Announcer`, a `FetchListener`), and the server offers the version under `partial` and serves exactly
those parts while the rest arrives (`bridge.shardcast.server`). A part that fails its sha256 is fetched again
from another upstream and was never offered. The relay's own upstream may itself be a relay still receiving the
version, so every hop of a chain forwards a part moments after it arrived, instead of after the whole version.
A fetch that fails withdraws the version's parts (they are checked again when the fetch resumes).

Durability stays off the path to the workers: a relay advertises a version as soon as its bytes are verified
(in the page cache), and flushes it to disk `SYNC_DELAY_S` later in the background (files, directory, then a
`.synced` marker, itself flushed). A relay that restarts after a crash re-hashes every version without the
marker before serving it, and deletes one that no longer matches its manifest, to be mirrored again; so a
relay never serves bytes it has not verified, and the one fsync per hop that remains on the critical path is
the worker's own (before its STABLE). Measured: 512 MiB origin -> 2 relays -> 1 client took 1.58 s with the
relays syncing before they advertise and 1.28 s without any fsync.

Pinning (`pin_url`, the orchestrator): a relay mirrors a version only under the manifest sha256 the learner
announced for it (`GET /v1/policy`'s `manifests`), so an upstream that offers another manifest is passed
over; it waits for the announcement (polling every `PIN_POLL_S`), mirrors a version announced without a
sha256 unpinned (with a warning), and skips one that has already left the async window.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bridge.shardcast import disk
from bridge.shardcast.client import ShardcastClient
from bridge.shardcast.download import FetchListener
from bridge.shardcast.errors import ManifestError, ShardcastError, TransferError, WaitTimeout
from bridge.shardcast.manifest import DeltaEntry, Manifest, parse_manifest, read_version_dir
from bridge.shardcast.names import (
    MANIFEST_FILE,
    STABLE_FILE,
    check_version,
    parse_version,
    parse_version_dirname,
    version_dirname,
)
from bridge.shardcast.parts import _sha256_file
from bridge.shardcast.server import ServerLimits, ShardcastServer
from bridge.shardcast.store import VersionStore
from bridge.shardcast.transfer import check_status, open_get, receive_into_file

log = logging.getLogger("shardcast.relay")

SYNCED_FILE = ".synced"  # a version directory flushed to disk (never a manifest name: those cannot start with '.')
SYNC_DELAY_S = 5.0
PIN_POLL_S = 0.2
PIN_WAIT_S = 30.0
MAX_POLICY_BYTES = 1 << 20
_HASH_BLOCK = 8 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class AnnouncedPolicy:
    """What a relay needs of the orchestrator's policy: the current version (None before the learner announced
    any), the window's oldest, and the announced manifest sha256 by version."""

    version: int | None
    min_version: int
    manifests: dict[int, str]


def orchestrator_policy(url: str, timeout: float = 10.0) -> AnnouncedPolicy:
    """`GET {url}/v1/policy` (public), validated; OSError or ValueError when it cannot be had."""
    with urllib.request.urlopen(url.rstrip("/") + "/v1/policy", timeout=timeout) as resp:
        raw = resp.read(MAX_POLICY_BYTES + 1)
    if len(raw) > MAX_POLICY_BYTES:
        raise ValueError(f"{url}/v1/policy: answer over {MAX_POLICY_BYTES} bytes")
    doc = json.loads(raw)
    if not isinstance(doc, dict) or not isinstance(doc.get("manifests", {}), dict):
        raise ValueError(f"{url}/v1/policy: not a policy")
    try:
        version = check_version(doc.get("version"), "policy version")
        min_version = check_version(doc.get("min_version"), "policy min_version")
        manifests = {parse_version(k, "a manifests key"): v for k, v in doc.get("manifests", {}).items()}
    except (ShardcastError, TypeError) as e:
        raise ValueError(f"{url}/v1/policy: {e}") from None
    if not all(isinstance(v, str) and _SHA256.fullmatch(v) for v in manifests.values()):
        raise ValueError(f"{url}/v1/policy: a manifest sha256 is not 64 lower-case hex digits")
    return AnnouncedPolicy(version if doc.get("announced_at") is not None else None, min_version, manifests)


def sync_version(path: Path) -> None:
    """Flush a landed version (its files, its directory and the root's entry of it), then mark it synced."""
    for entry in os.scandir(path):
        if entry.is_file() and entry.name != SYNCED_FILE:
            with open(entry.path, "rb") as f:
                os.fsync(f.fileno())
    disk.fsync_dir(path)
    disk.fsync_dir(path.parent)
    with open(path / SYNCED_FILE, "w") as f:
        f.write("1\n")
        f.flush()
        os.fsync(f.fileno())


def recover_unsynced(root: Path) -> list[int]:
    """At start: re-hash every version that has STABLE but was not marked synced (the relay stopped before its
    background flush); sync and mark those that match their manifest, delete the others. Returns the deleted."""
    deleted = []
    for path in sorted(root.iterdir()):
        version = parse_version_dirname(path.name)
        if version is None or not (path / STABLE_FILE).exists() or (path / SYNCED_FILE).exists():
            continue
        try:
            manifest = read_version_dir(path, version, with_deltas=True)
            for entry in manifest.served.values():
                if isinstance(entry, DeltaEntry) and not (path / entry.name).exists():
                    continue  # a delta file never asked for: fetched when a client first does
                digest = hashlib.sha256()
                with open(path / entry.name, "rb") as f:
                    while block := f.read(_HASH_BLOCK):
                        digest.update(block)
                if digest.hexdigest() != entry.sha256:
                    raise ManifestError(f"{path / entry.name}: sha256 does not match the manifest")
        except (ManifestError, OSError) as e:
            log.warning(
                "%s was not flushed before the relay stopped and fails its check (%s): deleted, to be mirrored again",
                version_dirname(version),
                e,
            )
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(version)
            continue
        sync_version(path)
        log.info("%s was not flushed before the relay stopped; re-verified and flushed", version_dirname(version))
    return deleted


def _leftovers(root: Path, superseded: int | None) -> None:
    """Remove what is of no more use: interrupted deletions, and partial fetches of versions at or below
    `superseded` (the newest landed version); newer partial fetches stay, to be resumed."""
    for path in root.iterdir():
        name = path.name
        if name.startswith(".v") and (".deleting-" in name or ".replaced-" in name):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(".") and name.endswith(".partial") and superseded is not None:
            version = parse_version_dirname(name[1 : -len(".partial")])
            if version is not None and version <= superseded:
                shutil.rmtree(path, ignore_errors=True)
                (root / f".{version_dirname(version)}.lock").unlink(missing_ok=True)


class Announcer(FetchListener):
    """Hands what a mirror's download has checked to the server's store, on the event loop."""

    def __init__(self, store: VersionStore, loop: asyncio.AbstractEventLoop, version: int):
        self.store, self.loop, self.version = store, loop, version

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, self.version, *args)
        except RuntimeError:  # the loop has closed: the relay is stopping
            pass

    def started(self, manifest: Manifest, partial: Path) -> None:
        self._post(self.store.begin_arriving, manifest)

    def part_verified(self, name: str, index: int) -> None:
        self._post(self.store.part_checked, name, index)

    def file_verified(self, name: str) -> None:
        self._post(self.store.file_checked, name)

    def abandoned(self) -> None:
        self._post(self.store.drop_arriving)


class LazyDeltas:
    """Fetches a delta file the mirror did not land (`bridge.shardcast.download.eager_deltas`: only the deltas
    against the newest version held are mirrored) when a client first asks for it: from each upstream in turn,
    checked against its sha256, then renamed into the version directory and served. Concurrent requests for
    the same file share one fetch; a failed one is tried again on the next request."""

    def __init__(self, client: ShardcastClient, root: Path):
        self.client, self.root = client, root
        self._running: dict[tuple[int, str], asyncio.Future] = {}

    async def __call__(self, version: int, entry: DeltaEntry) -> bool:
        key = (version, entry.name)
        fut = self._running.get(key)
        if fut is None:
            fut = self._running[key] = asyncio.get_running_loop().run_in_executor(None, self.fetch, version, entry)
            fut.add_done_callback(lambda _: self._running.pop(key, None))
        return await asyncio.shield(fut)

    def fetch(self, version: int, entry: DeltaEntry) -> bool:
        """Land `entry` in the version's directory (blocking); whether it is there now."""
        final = self.root / version_dirname(version) / entry.name
        if final.exists():
            return True
        url_path = f"/v/{version}/{entry.name}"
        timeout = self.client.timeout
        for server in self.client.servers:
            tmp = final.with_name(f".{entry.name}.lazy-{uuid.uuid4().hex[:8]}")
            try:
                resp = open_get(server, url_path, timeout=timeout)
                try:
                    check_status(resp, url_path, (200,), timeout)
                    if resp.content_length() != entry.size:
                        raise TransferError(
                            server, f"GET {url_path}: Content-Length {resp.content_length()}, expected {entry.size}"
                        )
                    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        receive_into_file(resp, fd, 0, entry.size, timeout=timeout, progress=lambda n: None)
                    finally:
                        os.close(fd)
                finally:
                    resp.close()
                if _sha256_file(tmp) != entry.sha256:
                    log.warning("%s from %s fails its sha256: trying another upstream", url_path, server)
                    continue
                os.rename(tmp, final)
                log.info("fetched %s on a client's first request (%d bytes)", url_path, entry.size)
                return True
            except (ShardcastError, OSError) as e:
                log.warning("could not fetch %s from %s: %s", url_path, server, e)
            finally:
                tmp.unlink(missing_ok=True)
        return False


class Mirror:
    """Keeps `root` in step with the upstreams; `run()` loops until `stop` is set."""

    def __init__(
        self,
        client: ShardcastClient,
        root: Path,
        keep: int,
        newest: int | None,
        on_landed: Callable[[int, Manifest], None],
        stop: threading.Event,
        durable: bool = True,
        sync_delay_s: float = SYNC_DELAY_S,
        pins: Callable[[], AnnouncedPolicy] | None = None,
        pin_wait_s: float = PIN_WAIT_S,
        listener: Callable[[int], FetchListener] | None = None,
    ):
        """`pins`: the announced policy (None: mirror what the upstreams offer, trusting their manifests);
        `listener(version)`: told of every part and file of the version checked as it arrives."""
        self.listener = listener
        self.client, self.root, self.keep, self.newest = client, root, keep, newest
        self.on_landed, self.stop = on_landed, stop
        self.durable, self.sync_delay_s = durable, sync_delay_s
        self.pins, self.pin_wait_s = pins, pin_wait_s
        self.skipped: set[int] = set()  # versions that left the window before they were announced to us
        self._reported: str | None = None
        self._pins_reported: str | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                seen = self.client.wait_for_offers(self.newest, timeout=30.0)
            except WaitTimeout as e:
                self._report(str(e) if self.client.last_errors else None)
                continue
            self._report(None)
            offered = {v for vs in seen.values() for v in vs}  # other upstreams' versions: on the next round
            wanted = sorted({v for v in offered if (self.newest is None or v > self.newest) and v not in self.skipped})[
                -self.keep :
            ]
            if not wanted:  # only skipped versions are new: wait for another
                self.stop.wait(1.0)
            for version in reversed(wanted):
                if self.stop.is_set():
                    return
                go, pin = self._pin(version)
                if go:
                    self._mirror(version, pin, seen)
            _leftovers(self.root, self.newest)

    def _pin(self, version: int) -> tuple[bool, str | None]:
        """(mirror it now, the manifest sha256 to pin), waiting up to `pin_wait_s` for the announcement."""
        if self.pins is None:
            return True, None
        deadline = time.monotonic() + self.pin_wait_s
        while not self.stop.is_set():
            try:
                policy = self.pins()
                self._report_pins(None)
            except (OSError, ValueError) as e:
                self._report_pins(str(e))
            else:
                if version in policy.manifests:
                    return True, policy.manifests[version]
                if policy.version is not None and policy.version >= version:
                    if version < policy.min_version:
                        log.info(
                            "%s left the async window unannounced to this relay: not mirrored", version_dirname(version)
                        )
                        self.skipped.add(version)
                        return False, None
                    log.warning(
                        "%s was announced without a manifest sha256: mirrored unpinned", version_dirname(version)
                    )
                    return True, None
            if time.monotonic() >= deadline:
                log.warning(
                    "%s is offered upstream but the orchestrator has not announced it within %.0f s: not mirrored yet",
                    version_dirname(version),
                    self.pin_wait_s,
                )
                return False, None
            self.stop.wait(PIN_POLL_S)
        return False, None

    def _report_pins(self, problem: str | None) -> None:
        if problem != self._pins_reported:
            if problem:
                log.warning("cannot read the announced manifests from the orchestrator: %s", problem)
            elif self._pins_reported:
                log.info("the orchestrator answers again")
            self._pins_reported = problem

    def _mirror(self, version: int, pin: str | None = None, seen: dict | None = None) -> None:
        """Fetch `version` into the mirror; `seen`: what the upstream that answered the wait offers."""
        listener = self.listener(version) if self.listener is not None else None
        try:
            result = self.client.fetch(version, self.root, manifest_sha256=pin, listener=listener, offers=seen)
            raw = (result.path / MANIFEST_FILE).read_bytes()
            manifest = parse_manifest(raw, str(result.path / MANIFEST_FILE), version=version)
        except (ShardcastError, OSError) as e:
            log.error("could not mirror %s: %s", version_dirname(version), e)
            if listener is not None:
                listener.abandoned()
            self.stop.wait(1.0)
            return
        self.on_landed(version, manifest)
        self.newest = version if self.newest is None else max(self.newest, version)
        if self.durable:
            timer = threading.Timer(self.sync_delay_s, self._sync, (result.path,))
            timer.daemon = True
            timer.start()

    def _sync(self, path: Path) -> None:
        try:
            sync_version(path)
        except OSError as e:  # retired and deleted meanwhile, or a disk error: a restart re-verifies it
            log.warning("could not flush %s: %s", path.name, e)

    def _report(self, problem: str | None) -> None:
        if problem != self._reported:
            if problem:
                log.warning("upstreams unreachable: %s", problem)
            elif self._reported:
                log.info("upstreams reachable again")
            self._reported = problem


async def serve_relay(
    root: Path,
    upstreams: str | list[str],
    *,
    host: str,
    port: int,
    keep: int,
    ready: Callable[[str], None],
    grace_s: float = 60.0,
    timeout: float = 30.0,
    patience: float = 300.0,
    parallel: int = 0,
    part_bytes: int = 64 << 20,
    max_version_bytes: int | None = None,
    fsync: bool = True,
    limits: ServerLimits = ServerLimits(),
    pin_url: str | None = None,
    keep_anchor: bool = True,
) -> None:
    """Mirror and serve until cancelled; `ready(url)` is called once the port is bound. `pin_url`: the
    orchestrator whose announced manifest sha256s the mirror pins (None: trust the upstreams' manifests);
    `keep_anchor`: keep the newest anchor version beside the newest `keep` (the base of later deltas)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    client_args = {} if max_version_bytes is None else {"max_version_bytes": max_version_bytes}
    # fsync: flushed in the background after advertising (see the module docstring), not before STABLE
    client = ShardcastClient(
        upstreams,
        timeout=timeout,
        patience=patience,
        parallel=parallel,
        part_bytes=part_bytes,
        fsync=False,
        direct_io=False,
        mirror_deltas=True,
        **client_args,
    )
    if fsync:
        recover_unsynced(root)
    store = VersionStore(root, keep=keep, grace_s=grace_s, keep_anchor=keep_anchor)
    store.scan()
    _leftovers(root, store.latest)
    server = ShardcastServer(
        store, role="relay", host=host, port=port, timeout=timeout, limits=limits, missing=LazyDeltas(client, root)
    )
    ready(await server.start())
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    pins = None if pin_url is None else (lambda: orchestrator_policy(pin_url, timeout))
    mirror = Mirror(
        client,
        root,
        keep,
        store.latest,
        lambda v, m: loop.call_soon_threadsafe(store.add, v, m),
        stop,
        durable=fsync,
        pins=pins,
        listener=lambda version: Announcer(store, loop, version),
    )
    thread = threading.Thread(target=mirror.run, name="shardcast-mirror", daemon=True)
    thread.start()
    try:
        while True:
            await asyncio.sleep(min(1.0, grace_s / 4) or 0.05)
            store.prune()
    finally:
        stop.set()
        await server.stop()
