"""SHARDCAST with real processes on 127.0.0.1: `intellect shardcast origin|relay|fetch` as a user starts them.

Versions are written here by hand (files, a manifest made with hashlib, STABLE last), and what lands is
compared byte for byte with what was written: the reference is the data itself. Failures are staged with
servers built by faulty_shardcast.py (corrupt bytes, throttled bodies) and with SIGKILL.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port

from bridge.shardcast.names import parse_server_url
from bridge.shardcast.transfer import close_idle, open_get, read_body

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def payload(version: int, big: int = 6 * MIB) -> dict[str, bytes]:
    rng = random.Random(version)
    return {
        "config.json": json.dumps({"model_type": "qwen2", "v": version}).encode(),
        "model-00001-of-00002.safetensors": rng.randbytes(big),
        "model-00002-of-00002.safetensors": rng.randbytes(big // 3 + 12345),
        "tokenizer.json": b"{}",
        "added_tokens.txt": b"",
    }


def publish(root: Path, version: int, files: dict[str, bytes], part_size: int | None = None) -> None:
    """The learner's side of docs/design.md section 4, written independently of bridge.weights: files and manifest
    in a hidden directory, renamed into place, then STABLE. With `part_size`, the manifest also lists the sha256
    of each `part_size` slice of every file."""
    staging = root / f".staging-{version}"
    staging.mkdir(parents=True)
    entries = []
    for name, data in sorted(files.items()):
        (staging / name).write_bytes(data)
        entries.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        if part_size is not None:
            step = range(0, len(data), part_size)
            entries[-1]["parts"] = [hashlib.sha256(data[i : i + part_size]).hexdigest() for i in step]
    manifest = {
        "version": version,
        **({"part_size": part_size} if part_size is not None else {}),
        "files": entries,
        "total_size": sum(len(d) for d in files.values()),
        "created": "2026-01-01T00:00:00+00:00",
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    final = root / f"v{version:06d}"
    os.rename(staging, final)
    (final / "STABLE").write_text(f"{version}\n")


def assert_landed(out: Path, version: int, files: dict[str, bytes], origin: Path) -> None:
    vdir = out / f"v{version:06d}"
    assert (vdir / "STABLE").read_text() == f"{version}\n"
    assert (vdir / "manifest.json").read_bytes() == (origin / f"v{version:06d}" / "manifest.json").read_bytes()
    # ".synced": a relay's marker that the version reached its disk (written a few seconds after it landed)
    assert sorted(p.name for p in vdir.iterdir() if p.name != ".synced") == sorted([*files, "manifest.json", "STABLE"])
    for name, data in files.items():
        assert (vdir / name).read_bytes() == data, name


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until(predicate, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Proc:
    """A child process whose stdout lines are collected by a thread (so waits are bounded)."""

    def __init__(self, argv: list[str], log: Path, env: dict):
        self.log = log
        self.popen = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.out.append(line)
            self.lines.put(line)

    def wait_line(self, needle: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            if needle in line:
                return line
        raise AssertionError(f"{self.popen.args} did not print {needle!r}; stderr:\n{self.stderr()[-3000:]}")

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def result(self, timeout: float = 60.0) -> dict:
        """The JSON a `fetch --json` printed, after it exits 0."""
        self.popen.wait(timeout=timeout)
        time.sleep(0.05)  # let the reader thread take the last line
        assert self.popen.returncode == 0, f"exit {self.popen.returncode}; stderr:\n{self.stderr()[-3000:]}"
        return json.loads(self.out[-1])


class Cluster:
    """Starts `intellect shardcast ...` processes; the fixture kills every one of them at the end."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.env = {k: v for k, v in os.environ.items() if not k.upper().startswith("INTELLECT_")}

    def start(self, role: str, *args: str, name: str) -> Proc:
        """`intellect shardcast ROLE ARGS`; with `--test-fault FAULT` among `args`, the misbehaving server of
        faulty_shardcast.py (the shipped command has no such flag)."""
        args = list(args)
        command = [sys.executable, "-m", "intellect"]
        if "--test-fault" in args:
            i = args.index("--test-fault")
            command = [sys.executable, str(Path(__file__).with_name("faulty_shardcast.py")), args[i + 1]]
            del args[i : i + 2]
        proc = Proc([*command, "shardcast", role, *args], self.tmp / f"{name}.log", self.env)
        self.procs.append(proc)
        return proc

    def server(self, role: str, *args: str, name: str) -> tuple[str, Proc]:
        proc = self.start(role, *args, name=name)
        return proc.wait_line("serving").split()[-1], proc

    def origin(self, weights: Path, *args: str, name: str = "origin") -> str:
        return self.server("origin", "--dir", str(weights), "--port", "0", *args, name=name)[0]

    def relay(self, upstream: str, *args: str, name: str, port: int = 0) -> tuple[str, Proc]:
        """A relay; without `--orchestrator` in `args` it trusts its upstreams' manifests (no orchestrator here)."""
        pinning = () if "--orchestrator" in args else ("--shardcast.pin_manifests", "false")
        return self.server(
            "relay",
            "--upstream",
            upstream,
            "--dir",
            str(self.tmp / name),
            "--port",
            str(port),
            *pinning,
            *args,
            name=name,
        )

    def fetch(self, servers: str, out: Path, *args: str, name: str) -> Proc:
        return self.start("fetch", "--servers", servers, "--out", str(out), "--json", *args, name=name)

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.kill()
        for proc in self.procs:
            proc.popen.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def journal_bytes(out: Path, version: int) -> int:
    """Bytes a running fetch has recorded as landed in its progress journal (0 until the first record)."""
    try:
        doc = json.loads((out / f".v{version:06d}.partial" / ".progress.json").read_text())
    except (OSError, ValueError):
        return 0
    return sum(done for f in doc["files"].values() for _, _, done in f["parts"])


FAST = ("--shardcast.timeout_s", "3", "--shardcast.patience_s", "30", "--shardcast.part_mib", "2")


def test_origin_two_chained_relays_and_several_clients(cluster, tmp_path):
    weights = tmp_path / "weights"
    v1 = payload(1)
    publish(weights, 1, v1)
    origin = cluster.origin(weights)
    relay_a, _ = cluster.relay(origin, *FAST, name="relay-a")
    relay_b, _ = cluster.relay(relay_a, *FAST, name="relay-b")  # chained behind relay A
    clients = [
        cluster.fetch(f"{relay_a},{relay_b}", tmp_path / f"client{i}", "--wait", "30", *FAST, name=f"client{i}")
        for i in range(3)
    ]
    results = [c.result() for c in clients]
    for i, result in enumerate(results):
        assert result["version"] == 1 and result["total_bytes"] == sum(map(len, v1.values()))
        assert_landed(tmp_path / f"client{i}", 1, v1, weights)
    assert_landed(tmp_path / "relay-b", 1, v1, weights)

    # a new version: relays learn of it by long-poll and offer it only once verified; a waiting client gets it
    waiter = cluster.fetch(relay_b, tmp_path / "client0", "--after", "1", "--wait", "30", *FAST, name="waiter")
    v2 = payload(2, big=3 * MIB)
    publish(weights, 2, v2)
    listing = get_json(f"{relay_b}/versions?after=1&wait=20", timeout=30)
    assert listing["latest"] == 2 and listing["versions"] == [1, 2]
    assert_landed(tmp_path / "relay-b", 2, v2, weights)
    assert waiter.result()["version"] == 2
    assert_landed(tmp_path / "client0", 2, v2, weights)


def test_a_relay_flushes_after_advertising_and_rechecks_what_it_had_not_flushed(cluster, tmp_path):
    """A relay advertises a version once verified and flushes it to disk a few seconds later (".synced"). After
    a crash before that flush, the restarted relay re-hashes the version: a torn file is deleted and mirrored
    again, never served."""
    weights = tmp_path / "weights"
    v1 = payload(1)
    publish(weights, 1, v1)
    origin = cluster.origin(weights)
    relay, proc = cluster.relay(origin, *FAST, name="relay")
    copy = tmp_path / "relay" / "v000001"
    wait_until(lambda: get_json(f"{relay}/versions")["latest"] == 1, 30, "the relay to advertise v1")
    assert not (copy / ".synced").exists()  # advertised before the flush
    wait_until(lambda: (copy / ".synced").exists(), 30, "the background flush", step=0.2)
    assert_landed(tmp_path / "relay", 1, v1, weights)

    proc.popen.kill()  # a crash before the flush of what it holds: simulated by removing the marker
    proc.popen.wait(timeout=10)
    (copy / ".synced").unlink()
    shard = copy / "model-00001-of-00002.safetensors"
    torn = bytearray(shard.read_bytes())
    torn[len(torn) // 2] ^= 0xFF
    shard.write_bytes(bytes(torn))
    relay, proc = cluster.relay(origin, *FAST, name="relay")
    assert "fails its check" in proc.stderr() and "deleted" in proc.stderr()
    wait_until(lambda: get_json(f"{relay}/versions")["latest"] == 1, 30, "the relay to mirror v1 again")
    assert_landed(tmp_path / "relay", 1, v1, weights)
    client = cluster.fetch(relay, tmp_path / "client", "--wait", "30", *FAST, name="client")
    assert client.result()["version"] == 1
    assert_landed(tmp_path / "client", 1, v1, weights)

    wait_until(lambda: (copy / ".synced").exists(), 30, "the background flush", step=0.2)
    proc.popen.kill()  # an intact version without the marker is re-verified, flushed and kept (not fetched again)
    proc.popen.wait(timeout=10)
    (copy / ".synced").unlink()
    relay, proc = cluster.relay(origin, *FAST, name="relay")
    assert (copy / ".synced").exists() and "re-verified and flushed" in proc.stderr()
    assert get_json(f"{relay}/versions")["latest"] == 1 and "fetching" not in proc.stderr()


def test_corrupting_relay_is_detected_and_client_completes_elsewhere(cluster, tmp_path):
    weights = tmp_path / "weights"
    v1 = payload(1)
    publish(weights, 1, v1)
    origin = cluster.origin(weights)
    bad, _ = cluster.relay(origin, "--test-fault", "corrupt", *FAST, name="bad-relay")
    good_port = free_port()
    good = f"http://127.0.0.1:{good_port}"
    # at first only the corrupting relay is up, so the client must take bytes from it
    client = cluster.fetch(f"{bad},{good}", tmp_path / "client", "--wait", "30", *FAST, name="client")
    wait_until(lambda: "sha256 mismatch" in client.stderr(), 30, "the client to reject the corrupt bytes")
    assert not (tmp_path / "client" / "v000001").exists()
    cluster.relay(origin, *FAST, name="good-relay", port=good_port)
    result = client.result()
    assert_landed(tmp_path / "client", 1, v1, weights)
    assert result["servers"][bad]["distrusted"] is True
    assert result["servers"][good]["distrusted"] is False and result["servers"][good]["bytes"] > 0


def test_relay_killed_mid_transfer_client_resumes_from_another(cluster, tmp_path):
    weights = tmp_path / "weights"
    v1 = payload(1, big=8 * MIB)
    total = sum(map(len, v1.values()))
    publish(weights, 1, v1)
    origin = cluster.origin(weights)
    dying, dying_proc = cluster.relay(origin, "--test-fault", "slow:2000000", *FAST, name="dying-relay")
    other_port = free_port()
    other = f"http://127.0.0.1:{other_port}"
    client = cluster.fetch(
        f"{dying},{other}", tmp_path / "client", "--wait", "30", *FAST, "--shardcast.part_mib", "64", name="client"
    )
    wait_until(lambda: journal_bytes(tmp_path / "client", 1) > MIB, 30, "the client to receive a first MiB")
    dying_proc.popen.send_signal(signal.SIGKILL)
    cluster.relay(origin, *FAST, name="other-relay", port=other_port)
    result = client.result()
    assert_landed(tmp_path / "client", 1, v1, weights)
    got_dying, got_other = result["servers"][dying]["bytes"], result["servers"][other]["bytes"]
    assert got_dying > MIB and got_other > 0
    assert got_dying + got_other == total  # resumed with Range: not a byte fetched twice
    assert result["servers"][dying]["errors"] >= 1


def test_client_killed_and_restarted_resumes(cluster, tmp_path):
    weights = tmp_path / "weights"
    v1 = payload(1, big=8 * MIB)
    total = sum(map(len, v1.values()))
    publish(weights, 1, v1)
    origin = cluster.origin(weights, "--test-fault", "slow:2000000")
    out = tmp_path / "client"
    first = cluster.fetch(origin, out, *FAST, "--shardcast.parallel", "1", name="client-first")
    landed = wait_until(
        lambda: journal_bytes(out, 1) >= 2 * MIB and journal_bytes(out, 1), 30, "the first client to record 2 MiB"
    )
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait(timeout=10)
    result = cluster.fetch(origin, out, *FAST, name="client-second").result()
    assert_landed(out, 1, v1, weights)
    assert result["resumed_bytes"] >= landed
    assert result["received_bytes"] + result["resumed_bytes"] == total
    assert not (out / ".v000001.partial").exists()


def test_retention_spares_a_version_a_client_is_fetching(cluster, tmp_path):
    weights = tmp_path / "weights"
    versions = {v: payload(v, big=2 * MIB) for v in (1, 2, 3)}
    publish(weights, 1, versions[1])
    origin = cluster.origin(weights)
    relay, _ = cluster.relay(
        origin, "--keep", "1", "--test-fault", "slow:1000000", "--shardcast.retire_grace_s", "1", *FAST, name="relay"
    )
    relay_dir = tmp_path / "relay"
    wait_until(lambda: get_json(f"{relay}/versions")["latest"] == 1, 30, "the relay to offer v1")
    slow = cluster.fetch(
        relay, tmp_path / "slow-client", "--version", "1", *FAST, "--shardcast.parallel", "1", name="slow-client"
    )
    wait_until(lambda: journal_bytes(tmp_path / "slow-client", 1) > 0, 30, "the slow client to start")
    # two newer versions arrive while the client is mid-download; the relay keeps 1
    publish(weights, 2, versions[2])
    publish(weights, 3, versions[3])
    wait_until(lambda: get_json(f"{relay}/versions")["versions"] == [3], 30, "the relay to offer only v3")
    assert (relay_dir / "v000001").is_dir(), "v1 was deleted while a client was fetching it"
    assert slow.popen.poll() is None, "the slow client finished too early for this test to mean anything"
    assert slow.result()["version"] == 1
    assert_landed(tmp_path / "slow-client", 1, versions[1], weights)
    wait_until(lambda: not (relay_dir / "v000001").exists(), 30, "the relay to delete v1 once idle")
    assert not (relay_dir / "v000002").exists()
    assert get_json(f"{relay}/versions") == {"latest": 3, "versions": [3]}
    waiter = cluster.fetch(relay, tmp_path / "next-client", "--after", "1", "--wait", "10", *FAST, name="next")
    assert waiter.result()["version"] == 3


def test_the_origin_keeps_a_connection_for_the_next_request(cluster, tmp_path):
    """The client's kept-alive socket (bridge.shardcast.transfer) against the real server: the listing, then the
    version's manifest, on one socket."""
    publish(tmp_path / "weights", 1, {"a.bin": b"hello" * 1000})
    url = parse_server_url(cluster.origin(tmp_path / "weights"))
    close_idle()
    first = open_get(url, "/versions", timeout=10)
    port = first.sock.getsockname()[1]
    assert json.loads(read_body(first, 1 << 16, timeout=10))["versions"] == [1]
    first.close()
    second = open_get(url, "/v/1/manifest.json", timeout=10)
    try:
        assert second.status == 200
        assert second.sock.getsockname()[1] == port
    finally:
        second.close()
        close_idle()


# ---- a hostile client against a real origin --------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_origin(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    weights = tmp / "weights"
    files = {"config.json": b'{"a": 1}', "big.safetensors": random.Random(9).randbytes(32 * MIB)}
    publish(weights, 1, files)
    (weights / "v000001" / "secret.txt").write_text("a file the manifest does not list")
    (weights / "v000002").mkdir()  # no STABLE: incomplete, never served
    (weights / "v000002" / "config.json").write_text("{}")
    cluster = Cluster(tmp)
    url = cluster.origin(weights, "--shardcast.max_connections_per_ip", "8", "--shardcast.timeout_s", "1")
    yield url, files, tmp
    cluster.close()


def raw_request(
    url: str, target: str, *, method: str = "GET", headers: tuple[str, ...] = (), limit: int = MIB
) -> tuple[int, dict, bytes]:
    """Send the request line exactly as given (no client-side normalisation) and read the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            "\r\n".join(
                [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close", *headers, "", ""]
            ).encode()
        )
        data = bytearray()
        while len(data) < limit and (chunk := s.recv(1 << 20)):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), fields, body


@pytest.mark.parametrize(
    "target, status",
    [
        ("/v/1/..%2F..%2F..%2Fetc%2Fpasswd", 400),
        ("/v/1/%2e%2e", 400),
        ("/v/1/../../../etc/passwd", (400, 404)),
        ("/v/../v000001/manifest.json", (400, 404)),
        ("/v/0001/manifest.json", 400),
        ("/v/-1/manifest.json", 400),
        ("/v/v000001/config.json", 400),
        ("/v/1/STABLE", 400),
        ("/v/1/.hidden", 400),
        ("/v/1/secret.txt", 404),
        ("/v/1/config.json/x", 404),
        ("/v/2/manifest.json", 404),
        ("/v/2/config.json", 404),
        ("/etc/passwd", 404),
        ("/versions?after=-1", 400),
        ("/versions?after=abc&wait=1", 400),
        ("/versions?wait=1e9", 400),
        ("/versions?wait=nan", 400),
    ],
)
def test_server_refuses_whatever_is_not_a_listed_file(hostile_origin, target, status):
    url, _, _ = hostile_origin
    got, _, body = raw_request(url, target)
    assert got in (status if isinstance(status, tuple) else (status,)), (got, body[:200])
    assert b"root:" not in body and b"does not list" not in body


def test_server_methods_ranges_and_oversized_headers(hostile_origin):
    url, files, _ = hostile_origin
    data = files["big.safetensors"]
    assert raw_request(url, "/versions", method="POST")[0] == 405
    assert json.loads(raw_request(url, "/versions")[2]) == {"latest": 1, "versions": [1]}
    for rng, expected in [
        ("bytes=3-", data[3:]),
        ("bytes=-10", data[-10:]),
        ("bytes=5-9", data[5:10]),
        ("bytes=0-", data),
    ]:
        status, headers, body = raw_request(url, "/v/1/big.safetensors", headers=(f"Range: {rng}",), limit=64 * MIB)
        assert status == 206 and body == expected and int(headers["Content-Length"]) == len(expected), rng
    for rng in [
        "bytes=9-5",
        f"bytes={len(data)}-",
        "bytes=0-1,5-6",
        "lines=1-2",
        "bytes=-0",
        "bytes=-",
        "bytes=" + "0" * 30 + "1-",
    ]:  # bytes=-0 selects no byte: 416 (it answered 206 with the file)
        status, headers, _ = raw_request(url, "/v/1/big.safetensors", headers=(f"Range: {rng}",))
        assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}", rng
    status, headers, body = raw_request(url, "/v/1/big.safetensors", method="HEAD")
    assert status == 200 and int(headers["Content-Length"]) == len(data) and body == b""
    assert headers["ETag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert raw_request(url, "/versions", headers=("X-Big: " + "y" * 100_000,))[0] in (400, 431)


def test_many_slow_connections_are_bounded(hostile_origin, tmp_path):
    """A client on another address opens 20 connections and reads nothing: 8 (the per-address cap) are
    answered, the rest closed at once, and the 8 are dropped once stalled; others are served meanwhile."""
    from bridge.shardcast import ShardcastClient

    url, files, tmp = hostile_origin
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for _ in range(20):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.bind(("127.0.0.2", 0))
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /v/1/big.safetensors HTTP/1.1\r\nHost: x\r\n\r\n")
        socks.append(s)
    answered = []
    for s in socks:
        s.settimeout(5)
        try:
            first = s.recv(1)
        except ConnectionResetError:
            first = b""
        (answered if first else []).append(s)
    assert len(answered) == 8
    # an honest client is served in full while the hostile one holds its 8 connections
    result = ShardcastClient(url, timeout=5, fsync=False).fetch(1, tmp_path)
    assert (result.path / "big.safetensors").read_bytes() == files["big.safetensors"]
    time.sleep(2.5)  # past the server's 1 s time-out for a response that makes no progress
    for s in answered:  # each stalled connection ends (the server gave up on it) long before the file does
        got = 0
        s.settimeout(15)
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < len(files["big.safetensors"]) // 2
    for s in socks:
        s.close()
    assert get_json(f"{url}/healthz")["ok"] is True
    log = (tmp / "origin.log").read_text()
    assert "refused" in log and "Traceback" not in log  # refusals are logged, and cost no traceback


# ---- connection limits against a real origin: each client address is its own 127.0.0.x ----------------------

LIMITS = (
    "--shardcast.max_connections_per_ip",
    "8",
    "--shardcast.max_connections",
    "32",
    "--shardcast.header_timeout_s",
    "1",
    "--shardcast.keepalive_s",
    "2",
    "--shardcast.max_header_kib",
    "8",
    "--shardcast.timeout_s",
    "2",
)


@pytest.fixture(scope="module")
def limited_origin(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limited")
    weights = tmp / "weights"
    publish(weights, 1, {"config.json": b'{"a": 1}', "w.safetensors": random.Random(4).randbytes(MIB)})
    cluster = Cluster(tmp)
    url = cluster.origin(weights, *LIMITS)
    yield url, int(url.rsplit(":", 1)[1])
    cluster.close()


def connect_from(ip: str, port: int, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(ip, 0))


def closed_by_server(s: socket.socket, within: float) -> tuple[bool, bytes]:
    """(whether the server closed the connection within `within` seconds, what it sent before)."""
    s.settimeout(0.1)
    got = bytearray()
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, bytes(got)
        if not chunk:
            return True, bytes(got)
        got += chunk
    return False, bytes(got)


def get_from(ip: str, port: int, target: str = "/versions", timeout: float = 3.0) -> int:
    """Status of one GET sent from `ip` (0: the connection was refused or reset)."""
    try:
        with connect_from(ip, port, timeout) as s:
            s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            head = s.recv(4096)
    except OSError:
        return 0
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else 0


def test_idle_sockets_from_one_address_do_not_lock_its_other_clients_out(limited_origin):
    """Finding 9: the per-address cap of idle sockets locked the address out for the keep-alive time. Now a
    newcomer displaces an idle socket of its address that has done nothing for a second."""
    _, port = limited_origin
    idle = [connect_from("127.0.0.3", port) for _ in range(8)]  # the address's whole share, sending nothing
    time.sleep(1.3)
    t0 = time.monotonic()
    statuses = [get_from("127.0.0.3", port) for _ in range(5)]
    assert statuses == [200] * 5 and time.monotonic() - t0 < 3
    assert sum(closed_by_server(s, 0.5)[0] for s in idle) >= 5  # the displaced ones
    assert all(closed_by_server(s, 3.0)[0] for s in idle)  # the rest: closed after keepalive_s (2 s)
    for s in idle:
        s.close()


def test_total_cap_displaces_idle_sockets_of_the_fullest_address(limited_origin):
    _, port = limited_origin
    idle = [connect_from(f"127.0.0.{4 + i}", port) for i in range(4) for _ in range(8)]  # 32: the total cap
    time.sleep(1.3)
    assert [get_from("127.0.0.20", port) for _ in range(3)] == [200] * 3
    for s in idle:
        s.close()


def test_long_polls_do_not_lock_out_their_address(limited_origin):
    _, port = limited_origin
    polls = []
    for _ in range(8):
        s = connect_from("127.0.0.21", port)
        s.sendall(b"GET /versions?after=5&wait=30 HTTP/1.1\r\nHost: x\r\n\r\n")
        polls.append(s)
    time.sleep(1.3)
    assert get_from("127.0.0.21", port) == 200
    assert get_from("127.0.0.21", port, "/v/1/manifest.json") == 200
    for s in polls:
        s.close()


def test_a_trickled_head_is_answered_408_and_closed(limited_origin):
    _, port = limited_origin
    with connect_from("127.0.0.22", port) as s:
        s.sendall(b"GET /versions HTTP/1.1\r\n")
        t0 = time.monotonic()
        got, closed = b"", False
        for i in range(40):  # a header byte every 0.1 s, for at most 4 s
            try:
                s.sendall(b"X-Slow: " if i == 0 else b"y")
            except OSError:  # reset: the server closed while this byte was on its way; its answer came before
                closed, got = True, closed_by_server(s, 0.5)[1]
                break
            closed, got = closed_by_server(s, 0.1)
            if closed:
                break
        assert closed and time.monotonic() - t0 < 2.5, "the trickled head was not cut off"
        assert got.startswith(b"HTTP/1.1 408"), got[:80]


def test_a_connection_without_a_request_is_closed_after_keepalive(limited_origin):
    _, port = limited_origin
    with connect_from("127.0.0.23", port) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive: the connection stays open after it
        t0 = time.monotonic()
        closed, got = closed_by_server(s, 5.0)
        assert closed and got.startswith(b"HTTP/1.1 200") and 1.5 < time.monotonic() - t0 < 4.0


@pytest.mark.parametrize("fields", [[("X-Big", "y" * 100_000)], [(f"X-F{i}", "z" * 1000) for i in range(64)]])
def test_oversized_heads_are_refused_early(limited_origin, fields):
    """One huge field, or many fields each under the per-field limit: refused once the head passes 8 KiB."""
    _, port = limited_origin
    head = "GET /versions HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields) + "\r\n"
    with connect_from("127.0.0.24", port) as s:
        try:
            s.sendall(head.encode())
        except OSError:
            pass
        closed, got = closed_by_server(s, 3.0)
    assert closed and got[:9] in (b"HTTP/1.1 ", b"HTTP/1.0 ") and got[9:12] in (b"431", b"400"), got[:80]
    assert get_from("127.0.0.24", port, "/healthz") == 200


def test_a_get_with_a_body_is_refused_without_reading_it(limited_origin):
    _, port = limited_origin
    with connect_from("127.0.0.25", port) as s:
        s.sendall(b"GET /versions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n0123456789")
        t0 = time.monotonic()
        closed, got = closed_by_server(s, 3.0)
    assert closed and got.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 1.0, got[:80]
