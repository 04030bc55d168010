"""SHARDCAST deltas end to end: an origin and a relay (in this process, on 127.0.0.1) serve versions whose
manifests list delta files, and clients with and without a base fetch them.

Every landed file is compared byte for byte with what was published; the attacks (a relay whose delta is
corrupt, a client whose base is corrupt, a new tensor) are staged on the servers' and clients' disks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from bridge.shardcast import ShardcastClient, delta
from bridge.shardcast.download import FetchListener
from bridge.shardcast.origin import serve_origin
from bridge.shardcast.pool import ServerPool
from bridge.shardcast.relay import serve_relay
from bridge.shardcast.server import ShardcastServer

pytest.importorskip("zstandard")

from delta_versions import initial, publish, safetensors_bytes, step  # noqa: E402
from helpers import Served  # noqa: E402


@pytest.fixture
def servers():
    started: list[Served] = []

    def start(serve, *args, **kw) -> Served:
        started.append(Served(serve, *args, **kw))
        return started[-1]

    yield start
    for s in reversed(started):
        s.close()


def versions(root: Path, count: int, every: int = 4) -> dict[int, dict[str, bytes]]:
    weights, out = initial(), {}
    for v in range(count):
        if v:
            weights = step(weights, v)
        out[v] = {"model.safetensors": safetensors_bytes(weights), "config.json": b'{"model_type": "qwen2"}'}
        publish(root, v, out[v], every=every)
    return out


def client(urls, **kw) -> ShardcastClient:
    return ShardcastClient(
        urls, **{"timeout": 5.0, "patience": 5.0, "part_bytes": 256 << 10, "fsync": False, "direct_io": False, **kw}
    )


def landed(out: Path, version: int, files: dict[str, bytes]) -> None:
    vdir = out / f"v{version:06d}"
    assert (vdir / "STABLE").exists()
    assert sorted(p.name for p in vdir.iterdir()) == sorted([*files, "manifest.json", "STABLE"])
    for name, data in files.items():
        assert (vdir / name).read_bytes() == data, name


def full_size(files: dict[str, bytes]) -> int:
    return sum(len(d) for d in files.values())


class Prefer(ServerPool):
    """A pool that always picks `first` when it may (to make a test meet a given server first)."""

    def __init__(self, servers, first):
        super().__init__(servers)
        self.first = first

    def choose(self, candidates):
        candidates = list(candidates)
        return next((s for s in candidates if str(s) == self.first), None) or super().choose(candidates)


def wait_mirrored(url: str, count: int, timeout: float = 20.0) -> None:
    """Until the relay at `url` serves versions 0..count-1."""
    probe, deadline = client(url), time.monotonic() + timeout
    while list(probe.versions().values()) != [list(range(count))]:
        assert time.monotonic() < deadline, f"{url} did not mirror {count} versions in {timeout} s"
        time.sleep(0.05)


def test_clients_with_and_without_the_base_in_one_fetch(servers, tmp_path):
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 3)
    origin = servers(serve_origin, origin_dir)
    relay_dir = tmp_path / "relay"
    relay = servers(serve_relay, relay_dir, origin.url, keep=4, fsync=False, patience=5.0, timeout=5.0)
    wait_mirrored(relay.url, 3)
    # the relay mirrors newest first: v2 in full, then v1 and v0; it held no older version as each arrived, so
    # it mirrored none of their delta files: it fetches one when a client first asks for it
    assert not list(relay_dir.glob("v*/*.xzst"))

    with_base, without = tmp_path / "a", tmp_path / "b"
    client(origin.url).fetch(1, with_base)
    results = {}

    def fetch(name, out):
        results[name] = client(relay.url).fetch(2, out)

    threads = [threading.Thread(target=fetch, args=(n, o)) for n, o in (("a", with_base), ("b", without))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    landed(with_base, 2, published[2])
    landed(without, 2, published[2])
    assert results["a"].rebuilt_files == 1 and results["b"].rebuilt_files == 0
    assert results["a"].received_bytes * 5 < full_size(published[2])  # the delta and config.json
    assert results["b"].received_bytes == full_size(published[2])
    # the relay fetched the delta against v1 (asked for) and not the one against the anchor v0 (never asked)
    assert [p.name for p in relay_dir.glob("v000002/*.xzst")] == [delta.delta_name("model.safetensors", 1)]


def test_a_mirror_reports_each_delta_file_checked_before_its_rebuild_is_done(servers, tmp_path, monkeypatch):
    """A relay's download (`mirror_deltas`) tells its listener that it started, and that a delta file it mirrors
    is checked, before the rebuild of the full file from that delta is done: the relay serves the delta to its
    own clients while it rebuilds, instead of after (a hop's rebuild is off the clients' path). The rebuild
    here holds its result until the delta has been reported (for at most 10 s)."""
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 2)
    origin = servers(serve_origin, origin_dir)
    out = tmp_path / "mirror"
    client(origin.url).fetch(0, out)
    doc = json.loads((origin_dir / "v000001" / "manifest.json").read_bytes())
    (delta_name,) = [d["name"] for d in doc["deltas"] if d["file"] == "model.safetensors"]
    events, reported, waits = [], threading.Event(), []
    real_apply = delta.apply_delta

    def apply_then_wait(*args, **kwargs):
        digest = real_apply(*args, **kwargs)
        waits.append(reported.wait(10.0))
        return digest

    monkeypatch.setattr(delta, "apply_delta", apply_then_wait)

    class Recorder(FetchListener):
        def started(self, manifest, partial):
            events.append("started")

        def file_verified(self, name):
            events.append(name)
            if name == delta_name:
                reported.set()

    result = client(origin.url, mirror_deltas=True).fetch(1, out, listener=Recorder())
    for name, data in published[1].items():
        assert (out / "v000001" / name).read_bytes() == data
    assert result.rebuilt_files == 1
    assert waits == [True]  # the delta was reported while its rebuild was still going
    assert events[0] == "started"
    assert events.index(delta_name) < events.index("model.safetensors")


def test_the_rebuild_reads_the_delta_while_it_is_still_arriving(servers, tmp_path, monkeypatch):
    """The origin sends the first half of the delta, then holds the rest until the client's rebuild has read
    some of it (at most 10 s): a rebuild that started only once the whole delta was in would keep it waiting.
    The version still lands byte for byte."""
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 2)
    read_early, held = threading.Event(), []
    real_apply, real_send = delta.apply_delta, ShardcastServer._send

    def apply_recording(base, source, *args, **kwargs):
        if hasattr(source, "read"):
            real_read = source.read

            def read(n=-1):
                data = real_read(n)
                if data:
                    read_early.set()
                return data

            source.read = read
        return real_apply(base, source, *args, **kwargs)

    async def send_in_two(self, request, resp, f, offset, count):
        if not request.path.endswith(".xzst") or count < 2:
            return await real_send(self, request, resp, f, offset, count)
        half = count // 2
        await real_send(self, request, resp, f, offset, half)
        await resp.drain()
        held.append(await asyncio.get_running_loop().run_in_executor(None, read_early.wait, 10.0))
        await real_send(self, request, resp, f, offset + half, count - half)

    monkeypatch.setattr(delta, "apply_delta", apply_recording)
    monkeypatch.setattr(ShardcastServer, "_send", send_in_two)
    origin = servers(serve_origin, origin_dir)
    out = tmp_path / "client"
    client(origin.url).fetch(0, out)
    result = client(origin.url).fetch(1, out)
    landed(out, 1, published[1])
    assert result.rebuilt_files == 1
    assert held == [True]


def test_a_client_that_holds_only_the_anchor_uses_the_anchor_delta(servers, tmp_path):
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 7, every=4)
    origin = servers(serve_origin, origin_dir)
    out = tmp_path / "out"
    client(origin.url).fetch(4, out)
    result = client(origin.url).fetch(6, out)  # v5 is not held: the delta against the anchor v4 is used
    landed(out, 6, published[6])
    assert result.rebuilt_files == 1 and result.received_bytes * 5 < full_size(published[6])
    result = client(origin.url).fetch(3, out)  # no base older than v3 held: in full
    assert result.rebuilt_files == 0
    landed(out, 3, published[3])


def test_a_relay_serving_a_corrupt_delta_is_distrusted_and_the_file_rebuilt_from_another(servers, tmp_path):
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 2)
    origin = servers(serve_origin, origin_dir)
    relay_dir = tmp_path / "relay"
    relay = servers(serve_relay, relay_dir, origin.url, keep=4, fsync=False, patience=5.0, timeout=5.0)
    wait_mirrored(relay.url, 2)
    name = delta.delta_name("model.safetensors", 0)
    with urllib.request.urlopen(f"{relay.url}/v/1/{name}", timeout=10) as resp:  # the relay fetches it upstream
        assert resp.read() == (origin_dir / "v000001" / name).read_bytes()
    dfile = relay_dir / "v000001" / name
    raw = bytearray(dfile.read_bytes())
    raw[len(raw) // 2] ^= 1  # the same size: only the sha256 tells
    dfile.write_bytes(bytes(raw))
    out = tmp_path / "out"
    client(origin.url).fetch(0, out)
    urls = [relay.url, origin.url]
    c = client(urls)
    c.pool = Prefer(c.servers, relay.url)
    result = c.fetch(1, out)
    landed(out, 1, published[1])
    assert result.rebuilt_files == 1
    assert result.servers[relay.url]["distrusted"] is True
    assert result.received_bytes * 3 < full_size(published[1])


def test_a_corrupt_base_falls_back_to_the_full_file(servers, tmp_path):
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 2)
    origin = servers(serve_origin, origin_dir)
    out = tmp_path / "out"
    client(origin.url).fetch(0, out)
    base = out / "v000000" / "model.safetensors"
    raw = bytearray(base.read_bytes())
    raw[-100] ^= 0x10  # bit rot on the client's disk, after the base was verified
    base.write_bytes(bytes(raw))
    result = client(origin.url).fetch(1, out)
    landed(out, 1, published[1])
    assert result.rebuilt_files == 0
    assert result.servers[origin.url]["distrusted"] is False  # the origin's delta was right
    assert result.received_bytes >= full_size(published[1])


def test_a_new_tensor_is_sent_in_full_beside_rebuilt_files(servers, tmp_path):
    origin_dir = tmp_path / "origin"
    weights = initial()
    v0 = {"model-1.safetensors": safetensors_bytes(weights), "model-2.safetensors": safetensors_bytes(weights)}
    publish(origin_dir, 0, v0)
    nxt = step(weights, 1)
    v1 = {
        "model-1.safetensors": safetensors_bytes(nxt),
        "model-2.safetensors": safetensors_bytes({**nxt, "c.bias": np.zeros(4, np.uint16)}),
    }
    publish(origin_dir, 1, v1)
    origin = servers(serve_origin, origin_dir)
    out = tmp_path / "out"
    client(origin.url).fetch(0, out)
    result = client(origin.url).fetch(1, out)
    landed(out, 1, v1)
    assert result.rebuilt_files == 1
    assert result.received_bytes >= len(v1["model-2.safetensors"])


def test_a_client_told_not_to_use_deltas_fetches_full_files(servers, tmp_path):
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 2)
    origin = servers(serve_origin, origin_dir)
    out = tmp_path / "out"
    client(origin.url).fetch(0, out)
    result = client(origin.url, use_deltas=False).fetch(1, out)
    landed(out, 1, published[1])
    assert result.rebuilt_files == 0
    assert (
        hashlib.sha256((out / "v000001" / "model.safetensors").read_bytes()).hexdigest()
        == hashlib.sha256(published[1]["model.safetensors"]).hexdigest()
    )


def test_a_relay_mirrors_only_the_delta_against_the_version_it_holds_and_keeps_the_anchor(servers, tmp_path):
    """Versions published one at a time: the relay holds the previous one as each arrives, so it downloads that
    delta with the version (and rebuilds from it) but not the one against the anchor, which no client asked
    for; retention (keep=2) still holds the anchor v4 three versions later."""
    origin_dir, relay_dir = tmp_path / "origin", tmp_path / "relay"
    weights = initial()
    publish(origin_dir, 0, {"model.safetensors": safetensors_bytes(weights)}, every=4)
    origin = servers(serve_origin, origin_dir)
    relay = servers(serve_relay, relay_dir, origin.url, keep=2, fsync=False, patience=5.0, timeout=5.0, grace_s=0.0)
    probe = client(relay.url)
    for v in range(1, 8):
        weights = step(weights, v)
        doc = publish(origin_dir, v, {"model.safetensors": safetensors_bytes(weights)}, every=4)
        assert {d["base"] for d in doc["deltas"]} == {v - 1, v // 4 * 4 if v % 4 else v - 4} - {v}
        deadline = time.monotonic() + 20
        while v not in next(iter(probe.versions().values())):
            assert time.monotonic() < deadline, f"the relay did not mirror v{v}"
            time.sleep(0.05)
        on_relay = sorted(p.name for p in (relay_dir / f"v{v:06d}").glob("*.xzst"))
        assert on_relay == [delta.delta_name("model.safetensors", v - 1)], v
    deadline = time.monotonic() + 20
    while sorted(int(p.name[1:]) for p in relay_dir.glob("v0*")) != [4, 6, 7]:
        assert time.monotonic() < deadline, sorted(p.name for p in relay_dir.glob("v0*"))
        time.sleep(0.05)


def test_a_client_two_versions_behind_rebuilds_through_a_chain_of_deltas(servers, tmp_path):
    """Holding v1 and fetching v3 (anchors every 8, so v3's deltas are against v2 and v0, neither held): the
    client lands v2 from its delta against v1, then v3 from its delta against v2, far under the full bytes."""
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 4, every=8)
    origin = servers(serve_origin, origin_dir)
    out = tmp_path / "out"
    client(origin.url).fetch(1, out)
    result = client(origin.url).fetch(3, out)
    landed(out, 2, published[2])
    landed(out, 3, published[3])
    assert [r.version for r in result.chain] == [2]
    assert result.rebuilt_files == 1 and result.chain[0].rebuilt_files == 1
    # what came over the network: each link's delta against the version before it, and config.json twice
    expected = 0
    for v in (2, 3):
        doc = json.loads((origin_dir / f"v{v:06d}" / "manifest.json").read_bytes())
        expected += sum(d["size"] for d in doc["deltas"] if d["base"] == v - 1) + len(published[v]["config.json"])
    received = result.received_bytes + result.chain[0].received_bytes
    assert received == expected
    assert received * 15 < full_size(published[3])


@pytest.mark.parametrize("bandwidth", [1e6, 1e10])
def test_a_client_on_a_link_faster_than_its_rebuild_fetches_full_files(servers, tmp_path, bandwidth):
    """Rebuild rate 1e8 B/s: a server measured at 1e6 B/s (slower) gets the delta, at 1e10 B/s the full file."""
    origin_dir = tmp_path / "origin"
    published = versions(origin_dir, 2)
    origin = servers(serve_origin, origin_dir)
    out = tmp_path / "out"
    client(origin.url).fetch(0, out)
    c = client(origin.url, rebuild_bytes_per_s=1e8)
    (server,) = c.servers
    c.pool.stats[server].bandwidth = bandwidth
    result = c.fetch(1, out)
    landed(out, 1, published[1])
    if bandwidth < 1e8:
        assert result.rebuilt_files == 1 and result.received_bytes * 5 < full_size(published[1])
    else:
        assert result.rebuilt_files == 0 and result.received_bytes == full_size(published[1])
