"""The SHARDCAST client against scripted servers on real sockets: hostile manifests and listings, servers that
stall or break off, oversized answers, and the two ways of landing bytes (splice and recv/pwrite).

Each scripted server is a thread on 127.0.0.1 that answers raw HTTP/1.1 the way the test says; what lands is
compared with the bytes the test served.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from bridge.shardcast import FetchError, ShardcastClient, WaitTimeout
from bridge.shardcast.names import parse_server_url
from bridge.shardcast.transfer import HAVE_SPLICE, TransferError, get_json, open_get, receive_into_file

DATA = random.Random(3).randbytes(3 << 20)
FILES = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": DATA}


def manifest_bytes(files=FILES, version=1, **override) -> bytes:
    entries = [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in sorted(files.items())]
    doc = {"version": version, "files": entries, "total_size": sum(len(d) for d in files.values()), "created": "t"}
    doc.update(override)
    return json.dumps(doc).encode()


def response(status: int, body: bytes = b"", headers: dict | None = None, length: int | None = None) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body) if length is None else length}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ScriptedServer:
    """Accepts connections on 127.0.0.1 and hands each request to `script(path, headers, conn)`."""

    def __init__(self, script):
        self.script = script
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[tuple[str, dict]] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                buf += chunk
            lines = buf.split(b"\r\n\r\n")[0].decode().split("\r\n")
            path = lines[0].split()[1]
            headers = dict(line.split(": ", 1) for line in lines[1:])
            self.requests.append((path, headers))
            try:
                self.script(path, headers, conn)
            except OSError:
                pass

    def stall(self) -> None:
        self.closed.wait(30)

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@pytest.fixture
def serve():
    servers: list[ScriptedServer] = []

    def start(script) -> ScriptedServer:
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def honest(files=FILES, manifest: bytes | None = None, listing=b'{"latest": 1, "versions": [1]}'):
    """A script that serves a version correctly (Range included)."""
    manifest = manifest or manifest_bytes(files)

    def script(path, headers, conn):
        if path.startswith("/versions"):
            conn.sendall(response(200, listing))
        elif path == "/v/1/manifest.json":
            conn.sendall(response(200, manifest))
        else:
            data = files[path.rsplit("/", 1)[1]]
            first, last = headers["Range"].removeprefix("bytes=").split("-")
            first, last = int(first), int(last)
            conn.sendall(response(206, data[first : last + 1], {"Content-Range": f"bytes {first}-{last}/{len(data)}"}))

    return script


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def client(url, **kw) -> ShardcastClient:
    return ShardcastClient(url, **{"timeout": 1.0, "patience": 2.0, "part_bytes": 1 << 20, "fsync": False, **kw})


@pytest.mark.parametrize("use_splice", [True, False] if HAVE_SPLICE else [False])
def test_fetch_lands_exact_bytes(serve, tmp_path, use_splice):
    server = serve(honest())
    result = client(server.url, use_splice=use_splice).fetch(1, tmp_path)
    vdir = tmp_path / "v000001"
    assert all((vdir / n).read_bytes() == d for n, d in FILES.items())
    assert (vdir / "manifest.json").read_bytes() == manifest_bytes() and (vdir / "STABLE").read_text() == "1\n"
    assert result.received_bytes == len(DATA) + len(FILES["config.json"]) and result.resumed_bytes == 0
    again = client(server.url).fetch(1, tmp_path)
    assert again.already_present and again.received_bytes == 0


@pytest.mark.parametrize(
    "manifest, message",
    [
        (manifest_bytes(files={"../evil": b"x"}), "not an acceptable file name"),
        (manifest_bytes(files={"sub/evil": b"x"}), "not an acceptable file name"),
        (manifest_bytes(version=2), "declares version 2, expected 1"),
        (manifest_bytes(total_size=1), "'total_size' is 1"),
        (
            json.dumps(
                {"version": 1, "files": [{"name": "a", "size": 1 << 50, "sha256": "0" * 64}], "total_size": 1 << 50}
            ).encode(),
            "over the limit|size",
        ),
        (b"<html>not json</html>", "not valid JSON"),
    ],
)
def test_hostile_manifest_lands_nothing(serve, tmp_path, manifest, message):
    out = tmp_path / "out"
    server = serve(honest(manifest=manifest))
    with pytest.raises(FetchError, match=message):
        client(server.url, max_version_bytes=1 << 40).fetch(1, out)
    assert tree(tmp_path) == []  # nothing written, inside `out` or anywhere else


def test_pinned_manifest_sha256_refuses_another_manifest(serve, tmp_path):
    server = serve(honest())
    with pytest.raises(FetchError, match="is not the expected"):
        client(server.url).fetch(1, tmp_path, manifest_sha256="0" * 64)
    result = client(server.url).fetch(1, tmp_path, manifest_sha256=hashlib.sha256(manifest_bytes()).hexdigest())
    assert result.version == 1


def test_oversized_answer_is_refused_without_reading_it(serve):
    def script(path, headers, conn):
        conn.sendall(response(200, b"{", length=1 << 30))
        conn.sendall(b" " * 65536)

    server = serve(script)
    with pytest.raises(TransferError, match="larger than the limit"):
        get_json(parse_server_url(server.url), "/versions", timeout=2, limit=1 << 20)


@pytest.mark.parametrize(
    "answer, message",
    [
        (response(200, b"[1, 2"), "malformed JSON"),
        (response(200, b'{"latest": 3, "versions": [1, 2]}'), "not the newest"),
        (response(200, b'{"latest": -1, "versions": [-1]}'), "not a version"),
        (response(200, b'{"versions": "all"}'), "expected"),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{}", "Content-Length"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x response"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000, "longer than"),
        (response(500, b'{"error": "disk on fire"}'), "HTTP 500: disk on fire"),
        (response(200, b'{"latest": null, "versions": [], "partial": "all"}'), "'partial' must be a list"),
        (response(200, b'{"latest": null, "versions": [], "partial": [1.5]}'), "is not a version"),
    ],
)
def test_malformed_listings_are_reported_per_server(serve, tmp_path, answer, message):
    server = serve(lambda path, headers, conn: conn.sendall(answer))
    c = client(server.url)
    with pytest.raises(FetchError, match="no server offers any version"):
        c.fetch("latest", tmp_path)
    assert message in next(iter(c.last_errors.values()))


def test_stalled_server_times_out_instead_of_hanging(serve, tmp_path):
    let_go = threading.Event()  # the server stalls until the fetch has given up (or 30 s)

    server = serve(lambda path, headers, conn: let_go.wait(30))
    with pytest.raises(FetchError, match="stalled"):
        client(server.url, timeout=0.5).fetch("latest", tmp_path)
    assert not let_go.is_set()  # bounded by the time-out, not by the server: it is still stalling
    let_go.set()


@pytest.mark.parametrize("direct_io, use_splice", [(True, False), (False, True), (False, False)])
def test_server_that_keeps_the_connection_open_after_a_body(serve, tmp_path, direct_io, use_splice):
    """A part is done when its last byte is in, not when the server closes the connection: a server that
    neither sends more nor closes after a body costs no wait (a reader that waited for more, say for a socket
    low-water mark, would sit out the time-out at the end of every part)."""
    part = (1 << 20) - (100 << 10)  # parts that do not end on a power of two
    files = {"config.json": FILES["config.json"], "model.safetensors": DATA[: 3 * part]}
    script = honest(files=files)

    def lingering(path, headers, conn):
        script(path, headers, conn)
        if path.endswith("model.safetensors"):
            server.stall()

    server = serve(lingering)
    result = client(server.url, direct_io=direct_io, use_splice=use_splice, part_bytes=part, timeout=20.0).fetch(
        1, tmp_path
    )
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == files["model.safetensors"]
    # no read waited for bytes that never came: that would have lasted the 20 s time-out, then failed or settled
    assert result.servers[server.url]["errors"] == 0 and result.seconds < 20
    assert len([p for p, _ in server.requests if p.endswith(".safetensors")]) == 3


@pytest.mark.parametrize("direct_io, use_splice", [(True, False), (False, True), (False, False)])
def test_body_that_stalls_midway_is_resumed_with_range(serve, tmp_path, direct_io, use_splice):
    """The first answer breaks off after half the bytes and hangs; the client times out, keeps every byte that
    arrived and resumes from there (each of the three ways of landing bytes)."""
    script = honest()
    first = threading.Event()

    def flaky(path, headers, conn):
        if path.endswith("model.safetensors") and not first.is_set():
            first.set()
            conn.sendall(
                response(
                    206,
                    DATA[: len(DATA) // 2],
                    {"Content-Range": f"bytes 0-{len(DATA) - 1}/{len(DATA)}"},
                    length=len(DATA),
                )
            )
            server.stall()
        else:
            script(path, headers, conn)

    server = serve(flaky)
    result = client(server.url, timeout=0.5, part_bytes=8 << 20, direct_io=direct_io, use_splice=use_splice).fetch(
        1, tmp_path
    )
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    ranges = [h["Range"] for p, h in server.requests if p.endswith("model.safetensors")]
    assert ranges == [f"bytes=0-{len(DATA) - 1}", f"bytes={len(DATA) // 2}-{len(DATA) - 1}"]
    assert result.servers[server.url]["errors"] == 1 and result.received_bytes == sum(map(len, FILES.values()))


def test_wrong_range_answer_is_not_written(serve, tmp_path):
    """A server that answers a Range request with the whole file from byte 0 is refused, not trusted."""

    def script(path, headers, conn):
        if path.endswith("model.safetensors") and headers["Range"] != f"bytes=0-{len(DATA) - 1}":
            conn.sendall(response(200, DATA))
        else:
            honest()(path, headers, conn)

    server = serve(script)
    with pytest.raises(FetchError, match="ignored the Range request"):
        client(server.url, part_bytes=1 << 20, patience=0.5).fetch(1, tmp_path)


def test_every_server_sending_wrong_bytes_fails_the_fetch(serve, tmp_path):
    bad = dict(FILES, **{"model.safetensors": DATA[:-1] + b"\x00"})
    server = serve(honest(files=bad, manifest=manifest_bytes()))
    with pytest.raises(FetchError, match="every server sent bytes that failed the sha256 check"):
        client(server.url).fetch(1, tmp_path)
    assert not (tmp_path / "v000001").exists()


def test_wait_for_version_long_polls_every_server(serve, tmp_path):
    def later(path, headers, conn):
        time.sleep(0.3)
        conn.sendall(response(200, b'{"latest": 5, "versions": [4, 5]}'))

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    good = serve(later)
    c = client(f"{dead},{good.url}")
    assert c.wait_for_version(after=4, timeout=10) == 5
    assert "wait=" in good.requests[0][0] and "after=4" in good.requests[0][0]
    with pytest.raises(WaitTimeout, match="no version newer than 5"):
        c.wait_for_version(after=5, timeout=1.0)


def test_a_fetch_that_waited_starts_from_the_answer_without_asking_again(serve, tmp_path):
    """`fetch(1, wait=...)`: the version is not there, then a long-poll answers that it is. The manifest is
    asked for next, not every server's listing first (a round trip per server and hop on a WAN); the other
    servers are asked in the background once the parts start, and join."""
    script = honest()
    listed = {"now": b'{"latest": 0, "versions": [0]}'}

    def appears(path, headers, conn):
        if path.startswith("/versions"):
            if "wait=" in path:
                time.sleep(0.3)
                listed["now"] = b'{"latest": 1, "versions": [0, 1]}'
            conn.sendall(response(200, listed["now"]))
        else:
            script(path, headers, conn)

    second_listed = threading.Event()

    def lists(path, headers, conn):
        if path.startswith("/versions"):
            second_listed.set()
        script(path, headers, conn)

    first, second = serve(appears), serve(lists)
    result = client(first.url).fetch(1, tmp_path, wait=10)
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    paths = [p for p, _ in first.requests]
    manifest_at = paths.index("/v/1/manifest.json")
    assert "wait=" in paths[manifest_at - 1], paths  # the long-poll's answer, then straight to the manifest
    assert result.servers[first.url]["bytes"] > 0

    def soon(path, headers, conn):
        time.sleep(0.3)
        conn.sendall(response(200, b'{"latest": 1, "versions": [0, 1]}'))

    a, b = serve(soon), serve(soon)  # two servers that get the version at the same moment: both are holders
    # the gathering ends as soon as both have answered; its length only bounds how late the second may be
    got = client(f"{a.url},{b.url}").wait_for_offers(after=0, timeout=30, gather=30.0)
    assert got == {parse_server_url(a.url): [0, 1], parse_server_url(b.url): [0, 1]}

    # offers from a wait: the other server is asked in the background once the parts start, and joins. The
    # server that answered the wait holds its parts until then (so the fetch cannot end before the background
    # question, however fast or slow the machine is); without that question it gives up holding after 20 s.
    gate: list[bool] = []  # per part request: whether the other server had been asked when it was answered

    def held_until_second_listed(path, headers, conn):
        if path.endswith(".safetensors"):
            gate.append(second_listed.wait(20))
        script(path, headers, conn)

    second_listed.clear()
    waited = serve(held_until_second_listed)
    c = client(f"{waited.url},{second.url}", parallel=1, timeout=30.0)
    c.fetch(1, tmp_path / "b", offers={parse_server_url(waited.url): [0, 1]})
    assert (tmp_path / "b" / "v000001" / "model.safetensors").read_bytes() == DATA
    assert gate and all(gate), "the other server was not asked who holds the version as the parts started"
    assert waited.requests[0][0] == "/v/1/manifest.json", waited.requests  # the offer is not asked again first

    # the only server that answered the wait offers another manifest than the pinned one: every server is asked
    liar = serve(honest(files=dict(FILES, **{"config.json": b"{}"})))
    pin = hashlib.sha256(manifest_bytes()).hexdigest()
    c = client(f"{liar.url},{second.url}")
    c.fetch(1, tmp_path / "c", manifest_sha256=pin, offers={parse_server_url(liar.url): [1]})
    assert (tmp_path / "c" / "v000001" / "model.safetensors").read_bytes() == DATA
    assert not any(p.endswith(".safetensors") for p, _ in liar.requests)


@pytest.mark.parametrize("use_splice", [True, False] if HAVE_SPLICE else [False])
def test_receive_into_file_at_an_offset(serve, tmp_path, use_splice):
    server = serve(lambda path, headers, conn: conn.sendall(response(200, DATA)))
    path = tmp_path / "f"
    path.write_bytes(b"\x01" * (len(DATA) + 100))
    seen = []
    resp = open_get(parse_server_url(server.url), "/x", timeout=2)
    with open(path, "r+b") as f:
        receive_into_file(resp, f.fileno(), 100, len(DATA), timeout=2, progress=seen.append, use_splice=use_splice)
    resp.close()
    assert path.read_bytes() == b"\x01" * 100 + DATA and sum(seen) == len(DATA)


def test_a_hung_server_does_not_hold_up_the_others(serve, tmp_path):
    let_go = threading.Event()  # the hung server answers nothing until the fetch is over (or 30 s)
    hung = serve(lambda path, headers, conn: let_go.wait(30))
    good = serve(honest())
    c = client(f"{hung.url},{good.url}", timeout=20)
    start = time.monotonic()
    result = c.fetch("latest", tmp_path)
    assert time.monotonic() - start < c.timeout  # not the 20 s the hung server could take
    let_go.set()
    assert result.version == 1 and (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    assert "no answer to /versions in time" in c.last_errors[parse_server_url(hung.url)]


# ---- direct I/O (the default of a client) ------------------------------------------------------------------


def test_direct_io_lands_exact_bytes_and_returns_every_buffer(serve, tmp_path):
    """Parts of 64 KiB through a pool of 2 * 4 + 2 buffers, four workers, two servers of which one answers every
    part late: the pool never deadlocks, every byte lands, and every buffer is back in the pool."""
    fast = serve(honest())
    slow_script = honest()

    def slow(path, headers, conn):
        time.sleep(0.01)
        slow_script(path, headers, conn)

    slow_server = serve(slow)
    c = client(f"{fast.url},{slow_server.url}", parallel=4, buffer_bytes=64 << 10)
    result = c.fetch(1, tmp_path)
    assert result.direct_io and (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    ranges = [h["Range"] for p, h in fast.requests + slow_server.requests if p.endswith("model.safetensors")]
    assert len(ranges) == len(DATA) // (64 << 10)  # parts are at most one buffer long
    assert c.buffers.available() == 10
    assert not client(fast.url, direct_io=False).fetch(1, tmp_path / "paged").direct_io


def test_interrupted_direct_fetch_resumes_whole_parts(serve, tmp_path):
    """A server that breaks off in the fifth 256 KiB part: the journal keeps the parts that were written and
    hashed, and the next fetch asks only for the rest."""
    part = 256 << 10
    script = honest()

    def breaks(path, headers, conn):
        if path.endswith("model.safetensors") and int(headers["Range"].split("=")[1].split("-")[0]) >= 4 * part:
            conn.sendall(
                response(
                    206,
                    DATA[4 * part : 4 * part + 10],
                    {"Content-Range": f"bytes {4 * part}-{5 * part - 1}/{len(DATA)}"},
                    length=part,
                )
            )
            return
        script(path, headers, conn)

    broken = serve(breaks)
    c = client(broken.url, parallel=1, buffer_bytes=part, patience=0.5)
    with pytest.raises(FetchError, match="nothing received"):
        c.fetch(1, tmp_path)
    assert c.buffers.available() == 4
    good = serve(honest())
    result = client(good.url, parallel=1, buffer_bytes=part).fetch(1, tmp_path)
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    assert result.resumed_bytes == 4 * part + len(FILES["config.json"])  # config.json had landed too
    first = min(int(h["Range"].split("=")[1].split("-")[0]) for p, h in good.requests if p.endswith(".safetensors"))
    assert first == 4 * part


def test_direct_fetch_with_a_lying_server_refetches_through_the_page_cache(serve, tmp_path):
    """One of two servers flips a byte: the file fails its check, is fetched again from one server at a time,
    and the liar ends up distrusted once its bytes alone fail."""
    bad = dict(FILES, **{"model.safetensors": DATA[:100] + bytes([DATA[100] ^ 1]) + DATA[101:]})
    liar = serve(honest(files=bad, manifest=manifest_bytes()))
    good = serve(honest())
    result = client(f"{liar.url},{good.url}", parallel=2, buffer_bytes=1 << 20, patience=5).fetch(1, tmp_path)
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    assert result.servers[good.url]["distrusted"] is False


def test_buffer_pool_lends_nothing_before_its_pages_are_touched(monkeypatch):
    """The pool touches its pages in a background thread by writing into them: a download that claimed the
    pool before that was over would have bytes it received overwritten with zeros (a fetch right after the
    client was made then failed its sha256 check now and then)."""
    from bridge.shardcast import direct

    touch = direct.BufferPool._touch

    touched = threading.Event()

    def slow_touch(self):
        time.sleep(0.3)  # a loaded machine
        touch(self)
        touched.set()

    monkeypatch.setattr(direct.BufferPool, "_touch", slow_touch)
    pool = direct.BufferPool(2, 4 * mmap.PAGESIZE)
    assert pool.claim()
    buf = pool.take()
    buf[:] = b"\xff" * len(buf)  # what a transfer receives
    assert touched.wait(30)  # the touch thread has finished
    assert buf[:] == b"\xff" * len(buf)


def test_write_part_aligned_bulk_unaligned_tail_and_refusal(tmp_path):
    from bridge.shardcast.direct import ALIGN, open_direct, write_part

    path = tmp_path / "f"
    path.write_bytes(b"\x00" * (3 * ALIGN + 300))
    dfd, fd = open_direct(path), os.open(path, os.O_RDWR)
    assert dfd is not None  # the test filesystem takes O_DIRECT
    try:
        buf = mmap.mmap(-1, 2 * ALIGN + 300)  # page-aligned, as the pool's buffers are
        buf[:] = DATA[: len(buf)]
        assert write_part(dfd, fd, memoryview(buf), ALIGN)  # 2 blocks direct, 300 bytes through the page cache
        assert path.read_bytes()[ALIGN:] == DATA[: len(buf)]
        unaligned = memoryview(bytearray(b"\x07" * (ALIGN + 1)))[1:]  # the kernel refuses this address
        assert ctypes.addressof(ctypes.c_char.from_buffer(unaligned)) % 512
        assert write_part(dfd, fd, unaligned, 0) is False  # O_DIRECT refused it: written through the page cache
        assert path.read_bytes()[:ALIGN] == b"\x07" * ALIGN
    finally:
        os.close(dfd)
        os.close(fd)


# ---- part hashes: parts checked as they land, servers still receiving the version ------------------------

PART = 1 << 20  # DATA is three parts


def parted_manifest(files=FILES, version=1) -> bytes:
    doc = json.loads(manifest_bytes(files, version))
    doc["part_size"] = PART
    for entry in doc["files"]:
        data = files[entry["name"]]
        entry["parts"] = [hashlib.sha256(data[i : i + PART]).hexdigest() for i in range(0, len(data), PART)]
    return json.dumps(doc).encode()


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_part_with_wrong_bytes_is_caught_at_the_part_and_taken_from_another_server(serve, tmp_path, direct_io):
    """A server whose second part of the model has one flipped byte: that part fails its own sha256 as soon
    as it has landed, the server is distrusted, only that part is fetched again, and nothing is refetched
    whole."""
    bad = dict(FILES, **{"model.safetensors": DATA[: PART + 7] + bytes([DATA[PART + 7] ^ 1]) + DATA[PART + 8 :]})
    manifest = parted_manifest()
    liar = serve(honest(files=bad, manifest=manifest))
    good = serve(honest(manifest=manifest))

    class LiarFirst:  # every part is asked of the liar while it is trusted
        def __init__(self, pool):
            self.pool = pool

        def __getattr__(self, name):
            return getattr(self.pool, name)

        def choose(self, candidates):
            candidates = list(candidates)
            return next((s for s in candidates if str(s) == liar.url), None) or self.pool.choose(candidates)

    c = client(f"{liar.url},{good.url}", parallel=1, buffer_bytes=PART, patience=5, direct_io=direct_io)
    c.pool = LiarFirst(c.pool)
    result = c.fetch(1, tmp_path)
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    assert result.servers[liar.url]["distrusted"] is True and result.servers[good.url]["distrusted"] is False
    model = [h["Range"] for p, h in good.requests if p.endswith("model.safetensors")]
    assert model == [f"bytes={PART}-{2 * PART - 1}", f"bytes={2 * PART}-{3 * PART - 1}"]  # the bad part, the rest
    assert result.received_bytes == sum(map(len, FILES.values())) + PART


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_version_with_part_hashes_is_hashed_once_not_again_whole(serve, tmp_path, monkeypatch, direct_io):
    """Every byte of a version with part hashes is covered by its part's sha256, so the client hashes each byte
    once (its part) and lands the version without a second pass over the whole files; the bytes are exact."""
    server = serve(honest(manifest=parted_manifest()))
    real, hashed = hashlib.sha256, [0]

    class Counting:
        def __init__(self, data=b""):
            self.inner = real()
            self.update(data)

        def update(self, data):
            hashed[0] += memoryview(data).nbytes
            self.inner.update(data)

        def hexdigest(self):
            return self.inner.hexdigest()

    monkeypatch.setattr(hashlib, "sha256", Counting)
    client(server.url, buffer_bytes=PART, direct_io=direct_io).fetch(1, tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    total = sum(map(len, FILES.values()))
    assert total <= hashed[0] < total + (64 << 10), hashed[0]  # the parts, the manifest; not the files again


def test_a_server_still_receiving_the_version_is_asked_for_checked_parts(serve, tmp_path):
    """A server that lists the version only under `partial`, serves its manifest and parts only to requests
    carrying X-Shardcast-Partial, and answers 503 the first time each part is asked for: the client fetches
    from it, counts no 503 as an error, and lands the version verified; a client with `pipelined=False` does
    not take it for a holder."""
    manifest = parted_manifest()
    script = honest(manifest=manifest, listing=b'{"latest": null, "versions": [], "partial": [1]}')
    asked: set[str] = set()

    def partial(path, headers, conn):
        if not path.startswith("/versions") and "X-Shardcast-Partial" not in headers:
            conn.sendall(response(404, b'{"error": "not held"}'))
        elif path.endswith(".safetensors") and headers["Range"] not in asked:
            asked.add(headers["Range"])
            conn.sendall(response(503, b'{"error": "not checked yet"}', {"Retry-After": "1"}))
        else:
            script(path, headers, conn)

    server = serve(partial)
    result = client(server.url, patience=5, direct_io=False).fetch(1, tmp_path)
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    assert result.servers[server.url]["errors"] == 0 and len(asked) == 3
    assert all("X-Shardcast-Partial" in h for p, h in server.requests if not p.startswith("/versions"))
    with pytest.raises(FetchError, match="no server offers version 1"):
        client(server.url, pipelined=False).fetch(1, tmp_path / "old")


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_resumed_fetch_checks_every_part_it_finds_on_disk_again(serve, tmp_path, direct_io):
    """A fetch with part hashes breaks off in the third part; meanwhile the first part's bytes on disk are
    damaged. The resumed fetch checks the parts it finds complete against their sha256: the damaged one is
    fetched again, the intact one is not, and the version lands exact."""
    manifest = parted_manifest()
    script = honest(manifest=manifest)

    def breaks(path, headers, conn):
        if path.endswith("model.safetensors") and int(headers["Range"].split("=")[1].split("-")[0]) >= 2 * PART:
            head = {"Content-Range": f"bytes {2 * PART}-{3 * PART - 1}/{len(DATA)}"}
            conn.sendall(response(206, DATA[2 * PART : 2 * PART + 1000], head, length=PART))
            return
        script(path, headers, conn)

    broken = serve(breaks)
    kw = {"parallel": 1, "buffer_bytes": PART, "direct_io": direct_io}
    with pytest.raises(FetchError, match="nothing received"):
        client(broken.url, patience=0.5, **kw).fetch(1, tmp_path)
    partial = tmp_path / ".v000001.partial" / "model.safetensors"
    with open(partial, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    good = serve(honest(manifest=manifest))
    client(good.url, **kw).fetch(1, tmp_path)
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    starts = sorted(
        int(h["Range"].split("=")[1].split("-")[0]) // PART for p, h in good.requests if p.endswith(".safetensors")
    )
    assert starts == [0, 2]  # the damaged part again, and the one that broke off; the intact one stayed
