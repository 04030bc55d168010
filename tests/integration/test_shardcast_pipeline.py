"""Pipelined relays on 127.0.0.1: versions whose manifest has part hashes pass each part on as soon as it is
checked, while the rest of the version is still arriving; versions without them go store-and-forward.

The origin and relays are real `intellect shardcast` processes (a slow or corrupting one is built by
faulty_shardcast.py); clients are `ShardcastClient`s in this process, so that the moment their first bytes land
can be compared with the moment a relay has the whole version. Every landed byte is compared with what was
published, and every part a relay serves while receiving is compared with the data it stands for.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port
from test_shardcast import FAST, Cluster, assert_landed, get_json, payload, publish, wait_until

from bridge.shardcast import ShardcastClient

MIB = 1 << 20
PART = 256 << 10
VERSION = 1


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def publish_parts(root: Path, version: int, files: dict[str, bytes], part_size: int = PART) -> None:
    """The learner's layout with part hashes (`test_shardcast.publish`)."""
    publish(root, version, files, part_size)


def relay_args(cluster: Cluster, upstream: str, name: str, port: int) -> list[str]:
    """`Cluster.relay`'s arguments, for starting several relays at once."""
    pinning = ["--shardcast.pin_manifests", "false"]
    return ["--upstream", upstream, "--dir", str(cluster.tmp / name), "--port", str(port), *pinning, *FAST]


def client(servers: str, **kw) -> ShardcastClient:
    return ShardcastClient(
        servers, **{"timeout": 3.0, "patience": 30.0, "fsync": False, "direct_io": False, "parallel": 2, **kw}
    )


def request(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, bytes, dict]:
    """(status, body, headers) of a GET, errors included."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


class Watch:
    """Polls a relay's `/versions` every 20 ms in a thread: when it first listed the version as arriving
    (`partial`), when as complete (`versions`), and `incomplete_at`: when the last request was sent whose
    answer did not list it as complete (the relay did not have the whole version at some moment after that)."""

    def __init__(self, url: str, version: int = VERSION):
        self.url, self.version = url, version
        self.partial_at: float | None = None
        self.complete_at: float | None = None
        self.incomplete_at: float | None = None
        self.listings: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.complete_at is None:
            sent = time.monotonic()
            try:
                doc = get_json(f"{self.url}/versions", timeout=5)
            except OSError:
                doc = None
            if doc is not None:
                self.listings.append(doc)
                if self.version in doc.get("partial", []) and self.partial_at is None:
                    self.partial_at = time.monotonic()
                if self.version in doc["versions"]:
                    self.complete_at = time.monotonic()
                else:
                    self.incomplete_at = sent
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class FirstBytes:
    """A fetch's `on_progress`: the moment the first received bytes were reported."""

    def __init__(self):
        self.at: float | None = None

    def __call__(self, done: int, total: int) -> None:
        if done > 0 and self.at is None:
            self.at = time.monotonic()


def test_a_client_gets_a_whole_verified_version_through_relays_still_receiving_it(cluster, tmp_path):
    """origin (sending slowly) -> relay A -> relay B -> client: the client's first bytes land while relay A,
    and so relay B, are still receiving the version, and the client still ends with every file verified whole.
    Meanwhile relay B lists the version only as `partial`, refuses it to a request that did not ask for a
    partial version (an old client), and answers 503 for a part it has not checked yet."""
    weights = tmp_path / "weights"
    files = payload(VERSION, big=6 * MIB)
    total = sum(map(len, files.values()))
    publish_parts(weights, VERSION, files)
    origin = cluster.origin(weights, "--test-fault", "slow:1500000")  # ~3 s for the version, 2 streams
    # both relays start at once: relay B must be up while relay A still receives the version, however long a
    # process start takes on a loaded machine (started one after the other, A could finish before B was up)
    port_a, port_b = free_port(), free_port()
    relay_a, relay_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    started = [
        cluster.start("relay", *relay_args(cluster, origin, "relay-a", port_a), name="relay-a"),
        cluster.start("relay", *relay_args(cluster, relay_a, "relay-b", port_b), name="relay-b"),
    ]
    for proc in started:
        proc.wait_line("serving")
    watch_a, watch_b = Watch(relay_a), Watch(relay_b)
    try:
        wait_until(lambda: watch_b.partial_at, 30, "relay B to list the version as arriving")
        assert watch_a.complete_at is None, "relay A had the whole version already: nothing was pipelined"
        listing = get_json(f"{relay_b}/versions")
        assert listing["versions"] == [] and listing["latest"] is None and listing["partial"] == [VERSION]
        big = "model-00001-of-00002.safetensors"
        status, _, _ = request(f"{relay_b}/v/{VERSION}/{big}")  # no partial header: as for a version not held
        assert status == 404
        last = len(files[big]) - 1
        status, _, headers = request(
            f"{relay_b}/v/{VERSION}/{big}", {"Range": f"bytes={last}-{last}", "X-Shardcast-Partial": "0"}
        )
        assert status == 503 and headers.get("Retry-After") == "1"
        status, body, _ = request(f"{relay_b}/v/{VERSION}/manifest.json", {"X-Shardcast-Partial": "0"})
        assert status == 200 and body == (weights / "v000001" / "manifest.json").read_bytes()

        first = FirstBytes()
        result = client(relay_b).fetch(VERSION, tmp_path / "client", wait=30, on_progress=first)
        wait_until(lambda: watch_a.complete_at and watch_b.complete_at, 30, "both relays to complete the version")
    finally:
        watch_a.stop()
        watch_b.stop()
    assert_landed(tmp_path / "client", VERSION, files, weights)
    assert result.received_bytes == total and result.servers[relay_b]["bytes"] == total
    # the client had bytes while relay A (and so relay B behind it) was still receiving the version
    assert first.at is not None and watch_a.incomplete_at is not None
    assert first.at < watch_a.incomplete_at, (
        f"the client's first bytes came {first.at - watch_a.incomplete_at:.2f} s after relay A last lacked the version"
    )
    assert first.at < watch_b.incomplete_at
    assert_landed(tmp_path / "relay-a", VERSION, files, weights)
    assert_landed(tmp_path / "relay-b", VERSION, files, weights)


def probe_parts(relay: str, files: dict[str, bytes], stop: threading.Event, seen: dict) -> None:
    """Ask `relay` for every part of the version, again and again, as a pipelining client would; every body
    it serves must be exactly the published bytes of that part."""
    while not stop.is_set():
        for name, data in files.items():
            for start in range(0, len(data), PART):
                end = min(start + PART, len(data)) - 1
                status, body, _ = request(
                    f"{relay}/v/{VERSION}/{name}",
                    {"Range": f"bytes={start}-{end}", "X-Shardcast-Partial": "0"},
                    timeout=5,
                )
                seen[status] = seen.get(status, 0) + 1
                if status in (200, 206) and body != data[start : end + 1]:
                    seen.setdefault("wrong", []).append((name, start))
        stop.wait(0.02)


def test_a_relay_never_serves_a_part_that_failed_its_hash(cluster, tmp_path):
    """A relay whose only upstream at first sends corrupt bytes: the parts that fail their sha256 are never
    served (a probe asks for every part all along and gets only the published bytes, or 503), the upstream is
    distrusted, and the parts come again from a good upstream once it is up."""
    weights = tmp_path / "weights"
    files = payload(VERSION, big=4 * MIB)
    publish_parts(weights, VERSION, files)
    bad = cluster.origin(weights, "--test-fault", "corrupt", name="bad-origin")
    good_port = free_port()
    good = f"http://127.0.0.1:{good_port}"
    relay, relay_proc = cluster.relay(f"{bad},{good}", *FAST, name="relay")
    stop, seen = threading.Event(), {}
    probe = threading.Thread(target=probe_parts, args=(relay, files, stop, seen), daemon=True)
    probe.start()
    try:
        wait_until(lambda: "fails its sha256" in relay_proc.stderr(), 30, "the relay to reject a corrupt part")
        assert get_json(f"{relay}/versions")["partial"] == [VERSION]
        cluster.server("origin", "--dir", str(weights), "--port", str(good_port), name="good-origin")
        wait_until(lambda: VERSION in get_json(f"{relay}/versions")["versions"], 30, "the relay to complete")
        result = client(relay).fetch(VERSION, tmp_path / "client")
    finally:
        stop.set()
        probe.join(10)
    wrong = seen.get("wrong", [])
    assert not wrong, f"the relay served {len(wrong)} parts that are not the published bytes, e.g. {wrong[:5]}"
    assert seen.get(206, 0) > 0, f"the probe never got a part: {seen}"
    assert "distrusted" in relay_proc.stderr()
    assert_landed(tmp_path / "relay", VERSION, files, weights)
    assert_landed(tmp_path / "client", VERSION, files, weights)
    assert result.servers[relay]["distrusted"] is False


def test_a_lying_relay_is_caught_at_the_part_and_the_client_recovers(cluster, tmp_path):
    """A relay that serves corrupt parts: the client rejects the first bad part by its own sha256 (not the
    whole file after it landed), distrusts that relay, and takes the part from another relay."""
    weights = tmp_path / "weights"
    files = payload(VERSION, big=6 * MIB)
    total = sum(map(len, files.values()))
    publish_parts(weights, VERSION, files)
    origin = cluster.origin(weights)
    bad, _ = cluster.relay(origin, "--test-fault", "corrupt", *FAST, name="bad-relay")
    good_port = free_port()
    good = f"http://127.0.0.1:{good_port}"
    out = tmp_path / "client"
    fetch = cluster.fetch(f"{bad},{good}", out, "--wait", "30", *FAST, name="client")
    wait_until(lambda: "fails its sha256" in fetch.stderr(), 30, "the client to reject a corrupt part")
    assert not (out / "v000001").exists()
    cluster.relay(origin, *FAST, name="good-relay", port=good_port)
    result = fetch.result()
    assert_landed(out, VERSION, files, weights)
    log = fetch.stderr()
    assert "part 0 fails its sha256" in log and "sha256 mismatch" not in log  # caught at the part, not the file
    assert result["servers"][bad]["distrusted"] is True
    assert result["servers"][good]["distrusted"] is False and result["servers"][good]["bytes"] > 0
    # what came from the liar before it was caught is a few parts, not whole files fetched twice
    assert result["servers"][bad]["bytes"] <= 8 * PART and result["received_bytes"] <= total + 8 * PART


def test_a_manifest_without_part_hashes_goes_store_and_forward(cluster, tmp_path):
    """An old manifest (no part hashes): the relay never lists the version as arriving, refuses it even to a
    request that asks for a partial version, and the client, pipelining or not, gets its first byte only after
    the relay has the whole version; everything lands as before."""
    weights = tmp_path / "weights"
    files = payload(VERSION, big=4 * MIB)
    publish(weights, VERSION, files)  # test_shardcast's publisher: no part hashes
    origin = cluster.origin(weights, "--test-fault", "slow:1500000")
    relay, _ = cluster.relay(origin, *FAST, name="relay")
    watch = Watch(relay)
    try:
        wait_until(lambda: (tmp_path / "relay" / ".v000001.partial").exists(), 30, "the relay to start mirroring")
        status, _, _ = request(f"{relay}/v/{VERSION}/manifest.json", {"X-Shardcast-Partial": "0"})
        assert status == 404
        first = FirstBytes()
        result = client(relay).fetch(VERSION, tmp_path / "client", wait=30, on_progress=first)
        old = client(relay, pipelined=False).fetch(VERSION, tmp_path / "old-client", wait=30)
    finally:
        watch.stop()
    assert watch.partial_at is None and all("partial" not in doc for doc in watch.listings)
    assert watch.complete_at is not None and first.at is not None and first.at > watch.incomplete_at
    assert result.received_bytes == old.received_bytes == sum(map(len, files.values()))
    assert_landed(tmp_path / "client", VERSION, files, weights)
    assert_landed(tmp_path / "old-client", VERSION, files, weights)
