"""Issue 18, the orchestrator's part: each finding sent as an attacker would, to `intellect orchestrator` in its own
process on 127.0.0.1, and the answer checked. Addresses 127.0.0.2 and up (all loopback on Linux) stand for other
clients, so that per-address limits can be told apart from the test's own traffic.

1. assignments expire; free keys cannot hold the window      6. weak (small-order, non-canonical) keys refused
2. no replay across a clean restart or a crash                8. paged, public-only pages; registration rate limit
3. connection limits, time-outs, head size                      (and 100,000 nodes: tests/.. test_pages_at_scale)
4/5. hostile bodies: 422, never echoed, never 5xx; no Content-Type answered as FastAPI does, in both lanes
"""

import json
import socket
import threading
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import OrchestratorProcess

from bridge.protocol import (
    BatchAnnouncement,
    HardwareReport,
    OrchestratorClient,
    OrchestratorError,
    RetryPolicy,
    Verdict,
    sign_request,
)

HW = HardwareReport(cpu_count=2, memory_gib=4)
TOKEN = "hostile-admin"
JSON = {"Content-Type": "application/json"}
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ONCE = RetryPolicy(attempts=1)


LIVENESS = "heartbeat_interval_s = 0.5\nunhealthy_after_s = 20.0\ndead_after_s = 60.0"


def config(tmp_path, orchestrator: str = "", prompts_per_step: int = 4, liveness: str = LIVENESS) -> str:
    path = tmp_path / "hostile.toml"
    path.write_text(f"""
[run]
dir = "{tmp_path / "run"}"
[orchestrator]
allow_cpu_nodes = true
worker_store_writes = true
admin_token = "{TOKEN}"
prompts_per_assignment = 2
num_tasks = 100
{liveness}
public_cache_s = 0
{orchestrator}
[data]
prompts_per_step = {prompts_per_step}
samples_per_prompt = 2
[trainer]
batch_size = {2 * prompts_per_step}
micro_batch_size = 8
async_level = 1
""")
    return path


def client(url, key=None, source: str | None = None, retry=ONCE, token=None) -> OrchestratorClient:
    """A client whose connections come from the loopback address `source`."""
    http = httpx.Client(timeout=10, transport=httpx.HTTPTransport(local_address=source)) if source else None
    return OrchestratorClient(url, key=key or Ed25519PrivateKey.generate(), retry=retry, http=http, admin_token=token)


def join(url, role, source=None) -> OrchestratorClient:
    node = client(url, source=source)
    assert node.register(role, HW).status == "admitted"
    return node


def announce(worker, a, name):
    n = a.prompts * a.samples_per_prompt
    return worker.announce_batch(
        BatchAnnouncement(
            batch_id=name,
            assignment_id=a.id,
            version=a.version,
            num_samples=n,
            num_tokens=5 * n,
            store_path=f"file:///store/v{a.version:06d}/{name}",
            sha256="cd" * 32,
        )
    )


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Window capacity (1 + 1) x ceil(4 / 2) = 4, of which fresh keys may hold 2; assignments expire after 2 s;
    two strikes ban; registrations: 40 at once per address."""
    tmp = tmp_path_factory.mktemp("pool")
    proc = OrchestratorProcess(
        tmp / "server.log",
        config(
            tmp,
            """
assignment_deadline_s = 2.0
ban_after_rejections = 2
rejection_window_s = 600
unproven_share = 0.5
register_burst = 40
register_rate_per_min = 60
submit_burst = 100
page_size = 5
""",
        ),
    ).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()[-3000:]


def test_expired_assignments_go_back_count_as_strikes_and_free_keys_cannot_hold_the_window(pool):
    admin = client(pool.url, token=TOKEN)
    honest, validator = join(pool.url, "worker"), join(pool.url, "validator")
    [first] = honest.heartbeat().assignments
    assert first.expires_at == pytest.approx(first.issued_at + 2.0)
    announce(honest, first, "honest-0")
    validator.claim()
    validator.verdict("honest-0", Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=20))  # honest is proven now
    free = [join(pool.url, "worker", source="127.0.0.7") for _ in range(4)]
    held = {f.node_key: f.heartbeat().assignments for f in free}
    assert sum(map(len, held.values())) == 2  # fresh keys hold at most unproven_share x capacity between them
    got, deadline, i = 0, time.monotonic() + 30, 1  # ends as soon as both are seen; the bound is for a busy host
    strikes_seen = False
    while time.monotonic() < deadline:  # the free keys beat and never deliver; the honest worker keeps working
        for f in free:
            try:
                f.heartbeat()
            except OrchestratorError as err:
                assert err.status == 403 and "expired assignments" in str(err.detail)
        for a in honest.heartbeat().assignments if got < 3 else ():  # within the announcement rate limit
            announce(honest, a, f"honest-{i}")
            claim = validator.claim()
            validator.verdict(claim.batch.batch_id, Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=20))
            got, i = got + 1, i + 1
        admin.batches(status="accepted")  # the learner reads: room in the window
        nodes = {n.key: n for n in admin.nodes().nodes}
        strikes_seen = all(nodes[f.node_key].banned for f in free if held[f.node_key])
        if strikes_seen and got >= 3:
            break
        time.sleep(0.3)
    assert strikes_seen, "keys whose assignments expired twice were not banned"
    assert got >= 3, f"the honest worker got only {got} assignments while free keys held theirs"
    ledger = {e.node_key: e for e in admin.ledger().entries}
    holders = [f for f in free if held[f.node_key]]
    assert all(ledger[f.node_key].expired_assignments >= 2 for f in holders)
    assert ledger[honest.node_key].expired_assignments == 0 and not ledger[honest.node_key].banned
    csv_rows = admin.ledger_csv().splitlines()
    assert "expired_assignments" in csv_rows[0].split(",")
    page = httpx.get(pool.url + "/").text
    assert 'id="assignments-expired">' in page
    expired = int(page.split('id="assignments-expired">')[1].split("<")[0])
    assert expired >= 2 * len(holders)
    metrics = httpx.get(pool.url + "/metrics").text
    assert 'orchestrator_assignments{state="expired"}' in metrics


def test_weak_public_keys_are_refused(pool):
    """The identity point (01 00...00), its non-canonical encoding (y = p + 1) and another small-order point, each
    with a signature that the curve equation accepts for any message (R = identity, S = 0)."""
    body = json.dumps({"role": "worker", "hardware": HW.model_dump()}).encode()
    for key, words in (
        ("01" + "00" * 31, "small order"),
        ("ee" + "ff" * 30 + "7f", "non-canonical"),
        ("00" * 32, "small order"),
        ("ec" + "ff" * 30 + "7f", "small order"),
    ):
        headers = {
            "X-Node-Key": key,
            "X-Timestamp": str(int(time.time() * 1000)),
            "X-Nonce": "ab" * 8,
            "X-Signature": "01" + "00" * 63,
            **JSON,
        }
        reply = httpx.post(pool.url + "/v1/nodes/register", content=body, headers=headers)
        assert reply.status_code == 401 and words in reply.json()["detail"], (key, reply.text)
    keys = {n.key for n in client(pool.url, token=TOKEN).nodes().nodes}
    assert not keys & {"01" + "00" * 31, "ee" + "ff" * 30 + "7f", "00" * 32}


HOSTILE = {  # body -> what must not come back
    b'{"loaded_versions":[],"metrics":{"a":NaN}}': b"NaN",
    b'{"loaded_versions":[],"metrics":{"a":Infinity}}': b"Infinity",
    b'{"loaded_versions":[],"metrics":{"a":-1e999}}': b"1e999",
    b'{"loaded_versions":[1e999],"metrics":{}}': b"1e999",
    b'{"loaded_versions":[],"metrics":{"\\ud800":1.0}}': b"ud800",
    b'{"loaded_versions":[],"metrics":{"a":"\xed\xa0\x80"}}': b"\xed\xa0\x80",
    b"[" * 200_000 + b"]" * 200_000: b"[[[[",
    b'{"loaded_versions":[' + b"9" * 5000 + b"]}": b"99999",
}


def test_hostile_bodies_get_a_422_that_never_echoes_them_in_both_lanes(pool):
    """The heartbeat is a fast-lane route, registration a FastAPI one; signed or not. The log grows by a bounded
    amount and holds no traceback."""
    worker = join(pool.url, "worker")
    size = pool.log_path.stat().st_size
    for path in ("/v1/nodes/heartbeat", "/v1/nodes/register"):
        for body, token in HOSTILE.items():
            for headers in (sign_request(worker.key, "POST", path, body), {}):
                reply = httpx.post(pool.url + path, content=body, headers={**headers, **JSON})
                assert reply.status_code == 422, (path, body[:40], reply.status_code, reply.text[:300])
                assert token not in reply.content and len(reply.content) < 2000, reply.text[:300]
                assert reply.json()["detail"][0]["loc"][0] == "body"
    assert pool.log_path.stat().st_size - size < 20_000
    assert "Traceback" not in pool.log()


def test_without_a_content_type_the_fast_lane_answers_as_fastapi_does(pool):
    """Heartbeat, announce, claim and verdict with a valid JSON body and no Content-Type: FastAPI's 422 (the body
    is not JSON to FastAPI), and no state changes (no assignment issued by that heartbeat)."""
    worker, validator = join(pool.url, "worker"), join(pool.url, "validator")
    cases = [
        (worker, "/v1/nodes/heartbeat", {"loaded_versions": [], "metrics": {}}),
        (
            worker,
            "/v1/batches",
            {
                "batch_id": "nct",
                "assignment_id": 1,
                "version": 0,
                "num_samples": 4,
                "num_tokens": 1,
                "store_path": "x/v000000/nct",
                "sha256": "00" * 32,
            },
        ),
        (validator, "/v1/validation/claim", {}),
        (validator, "/v1/batches/nct/verdict", {"accepted": False, "reason": "x", "num_tokens": 0}),
        (worker, "/v1/nodes/register", {"role": "worker", "hardware": HW.model_dump()}),
    ]  # FastAPI's own
    answers = []
    for node, path, payload in cases:
        body = json.dumps(payload).encode()
        reply = httpx.post(pool.url + path, content=body, headers=sign_request(node.key, "POST", path, body))
        assert reply.status_code == 422, (path, reply.text)
        answers.append(reply.json())
    assert all(a == answers[-1] for a in answers), answers  # word for word the answer of a FastAPI-only route
    nodes = {n.key: n for n in client(pool.url, token=TOKEN).nodes().nodes}
    assert nodes[worker.node_key].open_assignments == 0


def test_one_batch_id_definition():
    from pathlib import Path

    import bridge.rollouts
    from bridge.protocol import BATCH_ID_PATTERN

    root = Path(__file__).resolve().parents[2]
    declared = [
        p.relative_to(root).as_posix()
        for d in ("bridge", "orchestrator")
        for p in (root / d).rglob("*.py")
        if "A-Za-z0-9._-]{0,127}" in p.read_text()
    ]
    assert declared == ["bridge/protocol/messages.py"]
    assert bridge.rollouts._BATCH_ID.pattern == BATCH_ID_PATTERN


def test_batch_listing_without_the_token_shows_public_fields_only(pool):
    worker, validator = join(pool.url, "worker", source="127.0.0.8"), join(pool.url, "validator")
    admin = client(pool.url, token=TOKEN)
    deadline = time.monotonic() + 30  # earlier tests' assignments may hold the window until they expire
    while not (assigned := worker.heartbeat().assignments) and time.monotonic() < deadline:
        taken = [b.batch_id for b in admin.batches(status="accepted", limit=1000).batches]
        admin.announce_policy(admin.policy().version, consumed=taken)  # the learner took them: room in the window
        time.sleep(0.3)
    assert assigned, "the worker got no assignment in 30 s"
    for a in assigned:
        announce(worker, a, f"public-{a.id}")
    private = {
        "store_path",
        "sha256",
        "claimed_by",
        "validator_key",
        "rewards",
        "reason",
        "failed_checks",
        "lease_expires_at",
        "verified_tokens",
    }
    public = httpx.get(pool.url + "/v1/batches", params={"status": "submitted"}).json()["batches"]
    assert public and all(not private & set(b) for b in public)
    full = httpx.get(pool.url + "/v1/batches", params={"status": "submitted"}, headers=ADMIN).json()["batches"]
    assert full and all(private <= set(b) for b in full)
    listed = client(pool.url).batches(status="submitted")  # the client parses the public listing
    assert {b.batch_id for b in listed.batches} == {b["batch_id"] for b in public}
    assert {b.batch_id for b in admin.batches(status="submitted").batches} == {b["batch_id"] for b in full}
    while (claim := validator.claim()).batch is not None:  # leave nothing awaiting a verdict
        validator.verdict(claim.batch.batch_id, Verdict(accepted=False, reason="test", num_tokens=0))


def test_dashboard_ledger_and_node_list_are_paged(pool):
    for _ in range(6):
        join(pool.url, "worker", source="127.0.0.11")
    admin = client(pool.url, token=TOKEN)
    everyone = []
    after = None
    while True:  # the node list, 4 at a time
        page = admin.nodes(after=after, limit=4)
        everyone += [n.key for n in page.nodes]
        if page.next_after is None:
            break
        after = page.next_after
    assert everyone == sorted(everyone) and len(everyone) == len(set(everyone)) >= 7
    first = admin.ledger(limit=3)
    assert len(first.entries) == 3 and first.next_after == first.entries[-1].node_key
    second = admin.ledger(after=first.next_after, limit=3)
    assert second.entries[0].node_key > first.next_after
    reply = httpx.get(pool.url + "/v1/ledger", params={"format": "csv", "limit": 2})
    assert reply.headers["X-Next-After"] == reply.text.splitlines()[-1].split(",")[0]
    page = httpx.get(pool.url + "/").text
    assert page.count('<tr id="node-') == 5 and page.count('<tr id="ledger-') == 5  # page_size 5
    next_key = page.split('id="next-page" href="/?after=')[1].split('"')[0]
    following = httpx.get(pool.url + "/", params={"after": next_key}).text
    rows = [r.split('"')[0] for r in following.split('<tr id="node-')[1:]]
    assert rows and all(r > next_key for r in rows) and rows == everyone[5:10]


def test_registrations_are_rate_limited_per_address(pool):
    """register_burst 40: the 41st registration request from one address within a few seconds is refused with
    429 and Retry-After, before its signature is even checked; another address is not affected."""
    statuses = []
    flood = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.9"))
    body = json.dumps({"role": "worker", "hardware": HW.model_dump()}).encode()
    for _ in range(45):
        key = Ed25519PrivateKey.generate()
        reply = flood.post(
            pool.url + "/v1/nodes/register",
            content=body,
            headers={**sign_request(key, "POST", "/v1/nodes/register", body), **JSON},
        )
        statuses.append(reply.status_code)
    assert statuses[:40] == [200] * 40 and statuses[40:].count(429) >= 3  # (a token refills every second)
    assert int(reply.headers["Retry-After"]) >= 1 and "registrations from one address" in reply.json()["detail"]
    unsigned = flood.post(pool.url + "/v1/nodes/register", content=body, headers=JSON)
    assert unsigned.status_code == 429  # refused before the signature is looked at
    assert join(pool.url, "worker", source="127.0.0.10").node_key  # a neighbour on another address


# -- 2. replays across restarts -----------------------------------------------------------------------------------


def test_a_restart_does_not_reopen_old_signatures(tmp_path):
    """Requests stamped 2 s in the future (within the allowed skew), sent once, are replayed after a clean restart
    (refused: the nonces were kept) and after a kill -9 (refused with 503 and Retry-After until start + skew,
    when they are stale anyway); a fresh request passes once the client re-signs."""
    path = config(tmp_path, "max_clock_skew_s = 4.0")
    proc = OrchestratorProcess(tmp_path / "a.log", path).start()
    worker = join(proc.url, "worker")
    future = int((time.time() + 2) * 1000)

    def signed(route, body=b""):
        return (route, body, {**sign_request(worker.key, "POST", route, body, timestamp_ms=future), **JSON})

    beat = signed("/v1/nodes/heartbeat", b'{"loaded_versions":[],"metrics":{}}')
    leave = signed("/v1/nodes/deregister")
    send = lambda p, route, body, headers: httpx.post(p.url + route, content=body, headers=headers)  # noqa: E731
    assert send(proc, *beat).status_code == 200 and send(proc, *leave).status_code == 200
    proc.stop()  # SIGTERM: a clean stop saves the unexpired nonces
    proc = OrchestratorProcess(tmp_path / "b.log", path, port=proc.port).start()
    try:
        for request in (beat, leave):
            reply = send(proc, *request)
            assert reply.status_code == 401 and "replayed" in reply.json()["detail"], reply.text
        assert worker.heartbeat().state == "healthy"  # a fresh request from the same node
        future = int((time.time() + 2) * 1000)
        captured = signed("/v1/nodes/deregister")
        assert send(proc, *captured).status_code == 200
    finally:
        proc.kill()  # an unclean stop: the nonces of the last moments are gone
    proc = OrchestratorProcess(tmp_path / "c.log", path, port=proc.port).start()
    try:
        reply = send(proc, *captured)
        assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1, reply.text
        assert "unclean stop" in reply.json()["detail"]
        patient = client(proc.url, key=worker.key, retry=RetryPolicy(attempts=10, base_delay_s=0.2, max_delay_s=2))
        assert patient.heartbeat().state == "healthy"  # re-signed until past start + skew
        assert send(proc, *captured).status_code in (401, 503)  # never taken
    finally:
        proc.stop()


# -- 3. connection limits ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    proc = OrchestratorProcess(
        tmp / "server.log",
        config(
            tmp,
            """
max_connections = 48
max_connections_per_ip = 6
max_header_kib = 8
header_timeout_s = 2.0
body_timeout_s = 1.0
keepalive_s = 1.5
""",
        ),
    ).start()
    yield proc
    proc.stop()


def connect(server, source="127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect((server.host, server.port))
    return sock


def read_all(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, read whole (leaving the connection open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def healthz(server, source="127.0.0.1") -> bytes:
    sock = connect(server, source)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = read_all(sock)
    sock.close()
    return answer


def test_oversized_heads_are_refused_before_they_are_read(limited):
    sock = connect(limited, "127.0.0.2")
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
    assert read_all(sock).startswith(b"HTTP/1.1 431")
    sock.close()
    # A 32 MiB header streaming in: the server closes after its first 8 KiB; /healthz stays fast meanwhile.
    sent, failed = [0], []

    def stream():
        s = connect(limited, "127.0.0.3")
        try:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range(32 * 16):
                s.sendall(b"b" * 65536)
                sent[0] += 65536
        except OSError as exc:
            failed.append(exc)
        finally:
            s.close()

    thread = threading.Thread(target=stream)
    thread.start()
    worst = 0.0
    while thread.is_alive():
        start = time.perf_counter()
        assert healthz(limited).startswith(b"HTTP/1.1 200")
        worst = max(worst, time.perf_counter() - start)
    thread.join()
    assert failed and sent[0] < 8 << 20, sent  # cut off long before 32 MiB
    assert worst < 0.5, worst


def test_slow_heads_slow_bodies_and_idle_connections_are_closed(limited):
    start = time.monotonic()
    head = connect(limited, "127.0.0.4")
    head.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    body = connect(limited, "127.0.0.4")
    body.sendall(b"POST /v1/nodes/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}")
    idle = connect(limited, "127.0.0.4")  # sends nothing
    kept = connect(limited, "127.0.0.4")
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(kept).startswith(b"HTTP/1.1 200")  # then silent on a kept-alive connection
    answers = {name: read_all(sock) for name, sock in (("head", head), ("body", body), ("idle", idle), ("kept", kept))}
    elapsed = time.monotonic() - start
    assert answers["head"].startswith(b"HTTP/1.1 408") and answers["body"].startswith(b"HTTP/1.1 408")
    assert answers["idle"] == b"" and answers["kept"] == b""  # closed without a word
    assert elapsed < 4, elapsed  # 2 s head and 1 s body time-outs, 1.5 s keep-alive
    for sock in (head, body, idle, kept):
        sock.close()


def test_an_address_at_its_share_displaces_its_idle_or_stalled_connections_never_locks_out(limited):
    """max_connections_per_ip 6. Six idle connections from one address: a seventh from it is served (the oldest
    idle one is closed). Six trickling heads: a newcomer is served once they have stalled over a second (before
    their 2 s head time-out). Six connections busy with requests (bodies awaited): a newcomer gets 503 with
    Retry-After, and is served once their 1 s body time-out has passed; another address is served throughout."""
    idle = [connect(limited, "127.0.0.5") for _ in range(6)]
    time.sleep(0.1)
    assert healthz(limited, "127.0.0.5").startswith(b"HTTP/1.1 200")
    assert idle[0].recv(10) == b""  # the oldest idle connection made room
    trickling = [connect(limited, "127.0.0.6") for _ in range(6)]
    for sock in trickling:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    time.sleep(1.2)  # stalled (heads over stall_s, 1 s), not yet timed out (header_timeout_s 2 s)
    assert healthz(limited, "127.0.0.6").startswith(b"HTTP/1.1 200")
    answers = []
    for sock in trickling:
        sock.settimeout(0.1)
        try:
            answers.append(sock.recv(65536))
        except socket.timeout:
            answers.append(None)
    assert sum(b"displaced" in a for a in answers if a) == 1  # one stalled head made room (oldest, or a tie)
    busy = [connect(limited, "127.0.0.12") for _ in range(6)]
    for sock in busy:
        sock.sendall(b"POST /v1/nodes/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n")
    time.sleep(0.1)
    refused = healthz(limited, "127.0.0.12")
    assert refused.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in refused.lower(), refused[:200]
    assert healthz(limited, "127.0.0.13").startswith(b"HTTP/1.1 200")  # a neighbour on another address
    time.sleep(1.2)  # the busy ones' bodies never came: closed by the body time-out
    assert healthz(limited, "127.0.0.12").startswith(b"HTTP/1.1 200")
    for sock in idle + trickling + busy:
        sock.close()


def test_the_total_limit_displaces_the_longest_idle_connection(limited):
    held = [connect(limited, f"127.0.1.{i // 6 + 1}") for i in range(48)]  # 8 addresses x 6: the total, 48
    time.sleep(0.1)
    assert healthz(limited, "127.0.2.1").startswith(b"HTTP/1.1 200")
    assert held[0].recv(10) == b""
    for sock in held:
        sock.close()


# -- 8. public pages at 100,000 nodes ------------------------------------------------------------------------------


def test_public_pages_and_listings_stay_fast_at_100k_nodes(tmp_path):
    """A database of 100,000 nodes and 50,000 judged batches (written directly, before the service starts): the
    dashboard, the ledger (JSON and CSV), the public batch listing and the admin node list each answer one
    page in well under a second, and a heartbeat stays fast while they are fetched over and over."""
    import hashlib
    import sqlite3

    from orchestrator.db import open_database, sqlite_url

    path = config(tmp_path, liveness="heartbeat_interval_s = 10.0\nunhealthy_after_s = 60.0\ndead_after_s = 600.0")
    (tmp_path / "run").mkdir()
    db_file = tmp_path / "run" / "orchestrator.db"
    open_database(sqlite_url(db_file)).dispose()  # the schema
    now = time.time()
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(100_000)]
    with sqlite3.connect(db_file) as conn:
        conn.executemany(
            "INSERT INTO nodes (key, role, state, banned, hardware, first_seen, last_seen) "
            "VALUES (?, 'worker', 'healthy', 0, '{}', ?, ?)",
            ((k, now, now) for k in keys),
        )
        conn.executemany(
            "INSERT INTO assignments (node_key, version, k, prompts, samples_per_prompt, state, issued_at, batch_id,"
            " store_path, sha256, num_samples, num_tokens, announced_at, validator_key, verdict_at, verdict_seq,"
            " failed_checks, rewards, verified_tokens, delivered_at) VALUES (?, 0, 0, 2, 2, ?, ?, ?, ?, ?, 4, 40, ?,"
            " ?, ?, ?, ?, ?, 40, ?)",
            (
                (
                    keys[i],
                    "accepted" if i % 10 else "rejected",
                    now,
                    f"b{i}",
                    f"s/v000000/b{i}",
                    "ab" * 32,
                    now,
                    "cd" * 32,
                    now,
                    i + 1,
                    "[]" if i % 10 else '["toploc"]',
                    "[1.0, 1.0, 1.0, 1.0]" if i % 10 else None,
                    now,
                )
                for i in range(0, 100_000, 2)
            ),
        )
    print(f"database written in {time.time() - now:.1f} s")
    proc = OrchestratorProcess(tmp_path / "server.log", path).start(timeout_s=120)
    print(f"service up in {time.time() - now:.1f} s")
    try:
        worker = join(proc.url, "worker")
        pages = {
            "dashboard": ("/", {}),
            "ledger": ("/v1/ledger", {}),
            "ledger_csv": ("/v1/ledger", {"params": {"format": "csv"}}),
            "batches": ("/v1/batches", {"params": {"limit": 1000}}),
            "nodes": ("/v1/nodes", {"headers": ADMIN}),
            "dashboard_page_500": ("/", {"params": {"after": keys[500]}}),
        }
        took = {}
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            for name, (route, kwargs) in pages.items():
                start = time.perf_counter()
                reply = http.get(route, **kwargs)
                took[name] = time.perf_counter() - start
                assert reply.status_code == 200 and len(reply.content) < 2_000_000, (name, len(reply.content))
            beats = []
            for _ in range(5):
                for route, kwargs in pages.values():
                    http.get(route, **kwargs)
                start = time.perf_counter()
                worker.heartbeat()
                beats.append(time.perf_counter() - start)
        print("first fetch, s:", {k: round(v, 3) for k, v in took.items()}, "beats, s:", [round(b, 3) for b in beats])
        assert max(took.values()) < 1.0, took
        # the median: one slow beat on a loaded machine (0.36 s once, at load 11) is the scheduler's, while pages
        # that held the service up would slow every beat after them
        assert sorted(beats)[len(beats) // 2] < 0.1 and max(beats) < 1.0, beats
    finally:
        proc.stop()
