"""The SHARDCAST client: what a worker (and a relay, for its upstreams) uses to get policy versions.

    client = ShardcastClient(["http://relay-a:8101", "http://relay-b:8102"])
    version = client.wait_for_version(after=current, timeout=600)   # long-polls every server at once
    result = client.fetch(version, "weights/")                       # -> weights/v000123/, verified, STABLE
    result.path, result.mb_per_s

`fetch` asks every server which versions it holds, takes the manifest from one that holds the version (and
checks it against `manifest_sha256` when the caller knows it from a trusted source), then downloads with
`Download` (parallel parts, weighted server choice, Range resume, sha256 per file, atomic landing). The
client keeps its `ServerPool` between fetches, so what it learned about the servers' speed carries over, and
its direct I/O buffers (`direct_io`, see `bridge.shardcast.direct`), allocated once when it is made.

Pipelining (`pipelined`, the default): a relay that is still receiving a version whose manifest has part
hashes lists it under `partial` in `/versions` (old clients read only `versions`); this client counts such a
relay as a holder, takes the manifest and each part from it with the `X-Shardcast-Partial` header (the relay
holds the request until that part is checked, or answers 503), checks every part's sha256 as it lands (a
file whose parts all match is verified), so a version can reach a worker moments after it reaches the first
relay. A fetch that waited for its version starts from the servers that answered the wait and asks the
others in the background: on a 40 ms RTT link, asking every server again first would cost 80 ms per hop.

Trust: every file is checked against the manifest, so no server can slip in bytes the manifest does not
vouch for; the manifest itself is believed from the first server that offers it unless `manifest_sha256`
pins it (relays pass on the exact manifest bytes, so one sha256 identifies a version on every server). With
a pin (workers, validators and relays take it from the orchestrator, which has it from the learner), a server
that offers another manifest is distrusted and left out of the download, the manifest is taken from another
holder, and a version held locally under another manifest is replaced.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bridge.shardcast import delta as deltas
from bridge.shardcast.direct import ALIGN, HAVE_DIRECT, BufferPool
from bridge.shardcast.disk import held_version
from bridge.shardcast.download import PARTIAL_HEADER, Download, FetchListener, FetchResult
from bridge.shardcast.errors import FetchError, ShardcastError, TransferError, WaitTimeout
from bridge.shardcast.manifest import DEFAULT_MAX_VERSION_BYTES, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from bridge.shardcast.names import (
    MANIFEST_FILE,
    STABLE_FILE,
    ServerURL,
    check_version,
    parse_server_list,
    parse_version_dirname,
    version_dirname,
)
from bridge.shardcast.pool import ServerPool
from bridge.shardcast.transfer import HAVE_SPLICE, get_bytes, get_json

log = logging.getLogger("shardcast.client")

MAX_LISTING_BYTES = 1 << 20
MAX_POLL_S = 30.0
LATE_S = 1.0
GATHER_S = 0.05  # after a long-poll's first answer, how long the others may take to say they have it too
MAX_PARTIAL_WAIT_S = 5.0  # how long a relay may hold a request for a part it is still receiving


def parse_listing(doc: object, server: ServerURL) -> list[int]:
    """The `versions` of a `/versions` answer, validated."""
    if not isinstance(doc, dict) or not isinstance(doc.get("versions"), list) or len(doc["versions"]) > 100_000:
        raise TransferError(server, '/versions: expected {"latest": ..., "versions": [...]}')
    try:
        versions = sorted(check_version(v, f"{server}/versions") for v in doc["versions"])
    except ShardcastError as e:
        raise TransferError(server, str(e)) from None
    if doc.get("latest") != (versions[-1] if versions else None):
        raise TransferError(server, f"/versions: 'latest' {doc.get('latest')!r} is not the newest of the versions")
    return versions


def parse_partial(doc: dict, server: ServerURL) -> list[int]:
    """The `partial` versions of a `/versions` answer (still arriving at the server), validated; [] without."""
    items = doc.get("partial", [])
    if not isinstance(items, list) or len(items) > 100_000:
        raise TransferError(server, "/versions: 'partial' must be a list of versions")
    try:
        return sorted(check_version(v, f"{server}/versions 'partial'") for v in items)
    except ShardcastError as e:
        raise TransferError(server, str(e)) from None


def held_versions(root: Path) -> list[int]:
    """The versions complete (STABLE written) in `root`."""
    try:
        names = [entry.name for entry in os.scandir(root)]
    except FileNotFoundError:
        return []
    versions = [v for v in map(parse_version_dirname, names) if v is not None]
    return [v for v in versions if (root / version_dirname(v) / STABLE_FILE).exists()]


def rebuild_pays(pool: ServerPool, sources: Iterable[ServerURL], rebuild_bytes_per_s: float | None) -> bool:
    """Whether to rebuild files from deltas: the rebuild runs beside the delta's transfer, so it ends after
    about size / rebuild rate, while the full file takes size / bandwidth; rebuild unless the best bandwidth
    measured of `sources` is above `rebuild_bytes_per_s` (always when that is None or nothing is measured)."""
    if rebuild_bytes_per_s is None:
        return True
    best = pool.best_bandwidth(sources)
    return best is None or best <= rebuild_bytes_per_s


def chain_cost(manifest: Manifest) -> int:
    """Bytes to fetch a version from the one before it: each file's delta against `version - 1`, else in full."""
    against_previous = {d.file: d.size for d in manifest.deltas if d.base == manifest.version - 1}
    return sum(against_previous.get(e.name, e.size) for e in manifest.files)


class ShardcastClient:
    def __init__(
        self,
        servers: str | Iterable[str],
        *,
        timeout: float = 30.0,
        patience: float = 300.0,
        parallel: int = 0,
        part_bytes: int = 64 << 20,
        max_version_bytes: int = DEFAULT_MAX_VERSION_BYTES,
        fsync: bool = True,
        use_splice: bool = HAVE_SPLICE,
        pool: ServerPool | None = None,
        direct_io: bool = True,
        buffer_bytes: int = 32 << 20,
        use_deltas: bool = True,
        mirror_deltas: bool = False,
        pipelined: bool = True,
        rebuild_bytes_per_s: float | None = None,
    ):
        """`servers`: `URL[,URL...]` or a list; `timeout`: seconds a server may take to answer or to move 1 MiB;
        `patience`: seconds a fetch keeps trying without receiving a byte before it gives up; `parallel`:
        concurrent downloads, 0 for one per CPU up to 4 (receiving and hashing are CPU work: more streams than
        cores only contend); `direct_io`: land files with O_DIRECT from 2 * parallel + 2 buffers of
        `buffer_bytes` (parts are then at most that long), where the platform and filesystem allow it;
        `use_deltas`: rebuild files from versions held in the output directory where the manifest lists deltas
        (`bridge.shardcast.delta`); `mirror_deltas`: land the delta files too (relays, which serve them);
        `pipelined`: also fetch versions with part hashes from servers still receiving them (see above);
        `rebuild_bytes_per_s`: this host's rebuild rate (`benchmarks/shardcast_delta_bytes.py` reports it): a
        fetch whose servers' best measured bandwidth is above it takes the full files, which then arrive sooner
        than a rebuild would finish (`rebuild_pays`); None: always rebuild (fewest bytes)."""
        self.rebuild_bytes_per_s = rebuild_bytes_per_s
        self.use_deltas, self.mirror_deltas, self.pipelined = use_deltas, mirror_deltas, pipelined
        self.servers = parse_server_list(servers if isinstance(servers, str) else list(servers))
        self.parallel = parallel or min(4, os.cpu_count() or 1)
        self.timeout, self.patience, self.part_bytes = timeout, patience, part_bytes
        self.partial_wait = min(timeout / 2, MAX_PARTIAL_WAIT_S)
        self.max_version_bytes, self.fsync, self.use_splice = max_version_bytes, fsync, use_splice
        self.pool = pool or ServerPool(self.servers)
        if direct_io and buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes {buffer_bytes}: direct I/O needs a multiple of {ALIGN}")
        self.buffers = BufferPool(2 * self.parallel + 2, buffer_bytes) if direct_io and HAVE_DIRECT else None
        self.last_errors: dict[ServerURL, str] = {}

    def same_servers(self, servers: str | Iterable[str]) -> bool:
        """Whether `servers` names exactly this client's servers (a long-lived caller keeps the client, with its
        measured speeds and its buffers, until the list changes)."""
        return self.servers == parse_server_list(servers if isinstance(servers, str) else list(servers))

    # ---- what the servers hold ------------------------------------------------------------------------

    def _listing(
        self, server: ServerURL, after: int | None = None, wait: float = 0.0, on_open=None
    ) -> tuple[list[int], list[int]]:
        """(complete versions, versions still arriving: [] unless `pipelined`) of one server; a long-poll with
        `wait` returns once either has one newer than `after` (servers that pipeline nothing ignore `partial`)."""
        path = "/versions"
        if wait > 0:
            path += f"?wait={wait:.3f}" + (f"&after={after}" if after is not None else "")
            path += "&partial=1" if self.pipelined else ""
        doc = get_json(server, path, timeout=self.timeout, limit=MAX_LISTING_BYTES, wait=wait, on_open=on_open)
        versions = parse_listing(doc, server)
        return versions, parse_partial(doc, server) if self.pipelined else []

    def versions(self, servers: Iterable[ServerURL] | None = None) -> dict[ServerURL, list[int]]:
        """Complete versions held by the servers that answer (see `_ask`)."""
        return {s: complete for s, (complete, _) in self._ask(servers).items()}

    def offers(self, servers: Iterable[ServerURL] | None = None) -> dict[ServerURL, list[int]]:
        """Versions each server that answers can serve: complete ones, and (`pipelined`) those still arriving."""
        return {s: sorted(set(complete) | set(partial)) for s, (complete, partial) in self._ask(servers).items()}

    def _ask(self, servers: Iterable[ServerURL] | None = None) -> dict[ServerURL, tuple[list[int], list[int]]]:
        """Listings of the servers that answer, asked in parallel; the others land in `last_errors`.
        Once one server has answered, the slower ones get `LATE_S` more seconds, so one hung server does not
        hold up every fetch for a whole time-out."""
        servers = list(servers or self.servers)
        found: dict[ServerURL, tuple[list[int], list[int]]] = {}
        pool = cf.ThreadPoolExecutor(len(servers))
        futures = {pool.submit(self._listing, s): s for s in servers}
        deadline = time.monotonic() + self.timeout + 1.0
        pending = set(futures)
        try:
            while pending and (left := deadline - time.monotonic()) > 0:
                done, pending = cf.wait(pending, timeout=left, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    server = futures[fut]
                    try:
                        found[server] = fut.result()
                        self.last_errors.pop(server, None)
                        deadline = min(deadline, time.monotonic() + LATE_S)
                    except ShardcastError as e:
                        self.last_errors[server] = str(e)
            for fut in pending:
                self.last_errors[futures[fut]] = f"{futures[fut]}: no answer to /versions in time"
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return found

    def _holders(self, version: int) -> set[ServerURL]:
        """The servers that answer and offer `version` (complete, or arriving with `pipelined`)."""
        return {s for s, vs in self.offers().items() if version in vs}

    def latest(self) -> int | None:
        """The newest version any server offers (None when none offers anything)."""
        return max((v[-1] for v in self.versions().values() if v), default=None)

    def wait_for_version(self, after: int | None = None, timeout: float = 600.0) -> int:
        """The newest version a server offers that is newer than `after` (any version when None), waiting up to
        `timeout` seconds; every server is long-polled at once and the first to have one answers. With
        `pipelined`, a version a server is still receiving counts (`fetch` takes it part by part)."""
        return max(v for vs in self.wait_for_offers(after, timeout, gather=0.0).values() for v in vs)

    def wait_for_offers(
        self, after: int | None = None, timeout: float = 600.0, gather: float = GATHER_S
    ) -> dict[ServerURL, list[int]]:
        """Like `wait_for_version`, but what the first server to offer a version newer than `after` offers (as
        `offers` gives it), with any other server that answers within `gather` seconds after it: handed to
        `fetch(offers=...)`, it saves asking every server again before the fetch starts. WaitTimeout when none
        does within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        found: queue.Queue[tuple[ServerURL, list[int]]] = queue.Queue()
        stop = threading.Event()
        in_flight: dict[ServerURL, socket.socket] = {}  # the long-polls to cut short when the wait is over
        socks_lock = threading.Lock()

        def register(server: ServerURL, sock: socket.socket) -> None:
            with socks_lock:
                if stop.is_set():
                    raise OSError("the wait is over")
                in_flight[server] = sock

        def poll(server: ServerURL) -> None:
            backoff = 0.1
            while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
                try:
                    try:
                        complete, partial = self._listing(
                            server, after, min(left, MAX_POLL_S), on_open=functools.partial(register, server)
                        )
                    finally:
                        with socks_lock:  # its socket is kept alive for the next request, or closed
                            in_flight.pop(server, None)
                    self.last_errors.pop(server, None)
                    backoff = 0.1
                    newest = max(complete + partial, default=None)
                    if newest is not None and (after is None or newest > after):
                        found.put((server, sorted(set(complete) | set(partial))))
                        return
                except ShardcastError as e:
                    if stop.is_set():
                        return
                    self.last_errors[server] = str(e)
                    stop.wait(min(backoff, max(0.0, deadline - time.monotonic())))
                    backoff = min(2 * backoff, 2.0)

        threads = [
            threading.Thread(target=poll, args=(s,), daemon=True, name=f"shardcast-poll-{s}") for s in self.servers
        ]
        for t in threads:
            t.start()
        try:
            server, offered = found.get(timeout=max(0.0, timeout))
            seen = {server: offered}
            until = time.monotonic() + gather  # servers that got the version at about the same time
            while len(seen) < len(self.servers) and (left := until - time.monotonic()) > 0:
                try:
                    server, offered = found.get(timeout=left)
                except queue.Empty:
                    break
                seen[server] = offered
            return seen
        except queue.Empty:
            errors = "; ".join(self.last_errors.get(s, f"{s}: nothing newer") for s in self.servers)
            raise WaitTimeout(f"no version newer than {after} within {timeout:.0f} s ({errors})") from None
        finally:
            with socks_lock:
                stop.set()
                for sock in in_flight.values():
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    # ---- fetching -------------------------------------------------------------------------------------

    def fetch(
        self,
        version: int | str,
        out_root: str | Path,
        *,
        wait: float = 0.0,
        manifest_sha256: str | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        listener: FetchListener | None = None,
        offers: dict[ServerURL, list[int]] | None = None,
    ) -> FetchResult:
        """Fetch `version` ("latest" or an int) into `out_root/v{version:06d}/` and return what happened.

        `wait`: seconds to wait for the version to be offered (0: fail at once if no server has it).
        A version already complete in `out_root` is returned without a transfer. `listener`: told of every
        part and file checked as the download goes (a relay serves them before the version is complete).
        `offers`: what `wait_for_offers` returned just now; the fetch starts from the servers in it that offer
        the version, without asking every server first (they are asked in the background, and join)."""
        out_root = Path(out_root)
        if version != "latest":
            version = check_version(version, "version")
            local = out_root / version_dirname(version)
            if (local / STABLE_FILE).exists():
                try:
                    held = held_version(local, version, manifest_sha256)
                    return FetchResult(version, local, held.total_size, 0, 0, 0.0, {}, already_present=True)
                except FetchError as e:
                    if manifest_sha256 is None:
                        raise
                    log.warning("%s: fetching the pinned manifest's version in its place", e)
        seen = {s: vs for s, vs in (offers or {}).items() if version in vs}
        if seen:  # from `wait_for_offers`: fetch from them at once, the other servers are asked meanwhile
            holders, partly = sorted(seen, key=str), True
        else:
            holders, version, partly = self._locate(version, wait)
        try:
            manifest, impostors = self._manifest(version, holders, manifest_sha256)
        except FetchError as e:
            if not partly:
                raise
            log.info("%s; asking every server", e)  # those that answered the wait: none had a good manifest
            holders, partly = sorted(self._holders(version), key=str), False
            manifest, impostors = self._manifest(version, holders, manifest_sha256)
        sources = [s for s in holders if s not in impostors]
        use_deltas = self.use_deltas and rebuild_pays(self.pool, sources, self.rebuild_bytes_per_s)
        if use_deltas and not self.mirror_deltas and listener is None and deltas.HAVE_ZSTD:
            chain = tuple(self.fetch(step, out_root) for step in self._chain(version, manifest, out_root, sources))
        else:
            chain = ()
        log.info(
            "fetching %s (%d files, %.1f MiB) from %s",
            version_dirname(version),
            len(manifest.files),
            manifest.total_size / 2**20,
            ", ".join(map(str, sources)),
        )
        download = Download(
            manifest=manifest,
            root=out_root,
            pool=self.pool,
            candidates=set(sources),
            refresh=lambda: self._holders(version) - impostors,
            timeout=self.timeout,
            patience=self.patience,
            parallel=self.parallel,
            part_bytes=self.part_bytes,
            fsync=self.fsync,
            use_splice=self.use_splice,
            buffers=self.buffers,
            on_progress=on_progress,
            replace_held=manifest_sha256 is not None,
            use_deltas=use_deltas,
            mirror_deltas=self.mirror_deltas,
            listener=listener,
            partial_wait=self.partial_wait if self.pipelined else None,
            refresh_first=partly,
        )
        result = download.run()
        if chain:
            result = dataclasses.replace(result, chain=chain)
        if not result.already_present:
            log.info(
                "fetched %s: %.1f MiB in %.2f s (%.0f MB/s; %d of %d files rebuilt from deltas)",
                version_dirname(version),
                result.received_bytes / 2**20,
                result.seconds,
                result.mb_per_s,
                result.rebuilt_files,
                len(manifest.files),
            )
        return result

    def _chain(self, version: int, manifest: Manifest, out_root: Path, sources: list[ServerURL]) -> list[int]:
        """The versions to land before `version` so that each one, and then `version`, is rebuilt from the one
        before through its delta: from the newest version held below it, when no delta of `version` has a held
        base, the gap is at most `ANCHOR_EVERY` versions (a chain is never longer than the anchor interval),
        every link's manifest is served, and the chain's bytes are fewer than `version` in full. Else none."""
        held = sorted(v for v in held_versions(out_root) if v < version)
        if not held or any(d.base in held for d in manifest.deltas) or version - held[-1] > deltas.ANCHOR_EVERY:
            return []
        steps = list(range(held[-1] + 1, version))
        cost = 0
        for step in steps:
            try:
                link, _ = self._manifest(step, sources, None)
            except FetchError as e:
                log.info("no delta chain to %s: %s", version_dirname(version), e)
                return []
            cost += chain_cost(link)
        cost += chain_cost(manifest)
        if cost >= manifest.total_size:
            return []
        log.info(
            "rebuilding %s through %s: %.1f MiB instead of %.1f MiB in full",
            version_dirname(version),
            ", ".join(map(version_dirname, steps)),
            cost / 2**20,
            manifest.total_size / 2**20,
        )
        return steps

    def _locate(self, version: int | str, wait: float) -> tuple[list[ServerURL], int, bool]:
        """The servers that offer `version` (resolving "latest"), waiting up to `wait` seconds for one, and
        whether they are only those that answered a wait (the others not asked again since)."""
        deadline = time.monotonic() + wait
        listings, partly = self.offers(), False
        while True:
            if version == "latest":
                target = max((vs[-1] for vs in listings.values() if vs), default=None)
            else:
                target = version
            holders = [s for s, vs in listings.items() if target is not None and target in vs]
            if holders:
                return sorted(holders, key=str), target, partly
            left = deadline - time.monotonic()
            if left <= 0:
                offered = {str(s): vs for s, vs in listings.items()}
                errors = "; ".join(self.last_errors.values())
                what = "any version" if version == "latest" else f"version {version}"
                raise FetchError(
                    f"no server offers {what} (offered: {offered or 'nothing'}"
                    + (f"; errors: {errors}" if errors else "")
                    + ")"
                )
            newest = max((vs[-1] for vs in listings.values() if vs), default=None)
            after = None if version == "latest" or version == 0 else version - 1
            if after is not None and newest is not None and newest >= version:
                time.sleep(min(left, 0.5))  # it was offered but not by anyone right now: look again shortly
                listings, partly = self.offers(), False
                continue
            try:  # the answer is used as it is: asking every server again would cost round trips
                listings, partly = self.wait_for_offers(after, left), True
            except WaitTimeout:
                listings, partly = self.offers(), False

    def _manifest(self, version: int, holders: list[ServerURL], pin: str | None) -> tuple[Manifest, set[ServerURL]]:
        """The version's manifest from the first holder (in pool order) that serves a valid one (the pinned
        one, given `pin`), and the holders that offered another manifest (impostors: no bytes are taken
        from them for this version)."""
        errors: list[str] = []
        impostors: set[ServerURL] = set()
        remaining = list(holders)
        while remaining:
            server = self.pool.choose(remaining) or remaining[0]
            remaining.remove(server)
            path = f"/v/{version}/{MANIFEST_FILE}"
            try:
                headers = {PARTIAL_HEADER: "0"} if self.pipelined else None  # a holder may still be receiving it
                raw = get_bytes(server, path, timeout=self.timeout, limit=MAX_MANIFEST_BYTES, headers=headers)
                manifest = parse_manifest(raw, f"{server}{path}", version=version, max_total=self.max_version_bytes)
            except ShardcastError as e:
                self.pool.record(server, False)
                errors.append(str(e))
                continue
            if pin is not None and manifest.sha256 != pin:
                self.pool.distrust(server)
                impostors.add(server)
                errors.append(f"{server}{path}: sha256 {manifest.sha256} is not the expected {pin}")
                log.warning(
                    "%s offers another manifest for %s (sha256 %s, pinned %s): distrusted",
                    server,
                    version_dirname(version),
                    manifest.sha256[:12],
                    pin[:12],
                )
                continue
            return manifest, impostors
        raise FetchError(f"no valid manifest for version {version}: " + "; ".join(errors))
