"""A client with several download threads against a real pipelining relay, over kept-alive connections, while
the relay is still receiving the version from a throttled origin: the relay answers 503 ("not checked here
yet") to many part requests, on connections the client then reuses for other parts. Every part must land
byte-identical, with no error counted against the relay and no distrust (issue 37: a socket handed back to
the keep-alive pool twice after a 503 was lent to two threads, which read each other's answers).

The origin and relay are real `intellect shardcast` processes (the throttled origin is built by
faulty_shardcast.py); the client is a `ShardcastClient` in this process.
"""

from __future__ import annotations

import pytest
from helpers import free_port
from test_shardcast import Cluster, assert_landed, get_json, payload, publish, wait_until
from test_shardcast_pipeline import FirstBytes, Watch, relay_args

from bridge.shardcast import ShardcastClient
from bridge.shardcast.transfer import close_idle

MIB = 1 << 20
PART = 64 << 10  # the smallest part size a manifest may declare: many parts, many requests per connection
VERSION = 1


@pytest.fixture
def cluster(tmp_path):
    close_idle()
    c = Cluster(tmp_path)
    yield c
    c.close()
    close_idle()


def test_parallel_parts_through_a_relay_still_receiving_land_exact_over_kept_alive_connections(cluster, tmp_path):
    weights = tmp_path / "weights"
    files = payload(VERSION, big=3 * MIB)
    total = sum(map(len, files.values()))
    publish(weights, VERSION, files, PART)
    # both start at once (the relay waits for its upstream): a process start is most of this test's time
    origin_port = free_port()
    origin = cluster.start(
        "origin", "--dir", str(weights), "--port", str(origin_port), "--test-fault", "slow:1000000", name="origin"
    )  # ~2 s for the version, 2 streams
    relay_port = free_port()
    relay_proc = cluster.start(
        "relay", *relay_args(cluster, f"http://127.0.0.1:{origin_port}", "relay", relay_port), name="relay"
    )
    origin.wait_line("serving")
    relay = relay_proc.wait_line("serving").split()[-1]
    watch = Watch(relay)
    client = ShardcastClient(relay, timeout=3.0, patience=30.0, fsync=False, direct_io=False, parallel=4)
    client.partial_wait = 0.0  # a part the relay has not checked yet is answered 503 at once, not held
    first = FirstBytes()
    try:
        wait_until(lambda: watch.partial_at, 30, "the relay to list the version as arriving")
        result = client.fetch(VERSION, tmp_path / "client", wait=30, on_progress=first)
        wait_until(lambda: watch.complete_at, 30, "the relay to complete the version")
    finally:
        watch.stop()
    assert_landed(tmp_path / "client", VERSION, files, weights)
    assert result.received_bytes == total
    assert result.servers[relay] == {"bytes": total, "errors": 0, "distrusted": False}
    # the client asked for parts while they were still arriving at the relay (so it was answered 503)
    assert first.at is not None and watch.incomplete_at is not None and first.at < watch.incomplete_at
    assert get_json(f"{relay}/versions")["versions"] == [VERSION]
    assert_landed(tmp_path / "relay", VERSION, files, weights)
    assert "Traceback" not in relay_proc.stderr()
