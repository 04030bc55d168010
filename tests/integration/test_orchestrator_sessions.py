"""Session keys for heartbeats (docs/design.md section 8), attacked as an outsider and as another node would, against
`intellect orchestrator` in its own process on 127.0.0.1.

A node opens a session with one signed request that carries a fresh X25519 public key; the service answers with a
random 32-byte key sealed to it. Heartbeats may then carry X-Session and X-Mac (HMAC-SHA256 of the signing
string under that key) instead of an ed25519 signature. The MACs below are computed here from that formula with
`hmac` and `hashlib`, not with the package's helper, and every attacker's request is built by hand.
"""

import hashlib
import hmac
import json
import secrets
import time

import httpx
import nacl.exceptions
import nacl.public
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import OrchestratorProcess

from bridge.protocol import HardwareReport, OrchestratorClient, RetryPolicy, sign_request

HW = HardwareReport(cpu_count=2, memory_gib=4)
TOKEN = "sessions-admin"
JSON = {"Content-Type": "application/json"}
BEAT = "/v1/nodes/heartbeat"
BEAT_BODY = b'{"loaded_versions":[],"metrics":{}}'
ONCE = RetryPolicy(attempts=1)


def config(tmp_path, extra: str = "") -> str:
    path = tmp_path / "sessions.toml"
    path.write_text(f"""
[run]
dir = "{tmp_path / "run"}"
[orchestrator]
allow_cpu_nodes = true
worker_store_writes = true
admin_token = "{TOKEN}"
heartbeat_interval_s = 0.5
unhealthy_after_s = 20.0
dead_after_s = 60.0
prompts_per_assignment = 2
num_tasks = 100
{extra}
[data]
prompts_per_step = 4
samples_per_prompt = 2
[trainer]
batch_size = 8
micro_batch_size = 8
async_level = 1
""")
    return path


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sessions")
    proc = OrchestratorProcess(tmp / "server.log", config(tmp, "session_ttl_s = 4.0")).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()[-3000:]


def join(url, role="worker", **kwargs) -> OrchestratorClient:
    node = OrchestratorClient(url, key=Ed25519PrivateKey.generate(), retry=ONCE, **kwargs)
    assert node.register(role, HW).status == "admitted"
    return node


def signed_post(url, key, route, body: bytes = b"", stamp=None) -> httpx.Response:
    headers = {**sign_request(key, "POST", route, body, timestamp_ms=stamp), **JSON}
    return httpx.post(url + route, content=body, headers=headers)


def open_session(url, key) -> tuple[str, bytes, float]:
    """(session id, session key, expiry) as a node gets them: a fresh box key, the sealed reply opened with it."""
    box = nacl.public.PrivateKey.generate()
    body = json.dumps({"box_key": bytes(box.public_key).hex()}).encode()
    reply = signed_post(url, key, "/v1/nodes/session", body)
    assert reply.status_code == 200, reply.text
    got = reply.json()
    assert got["routes"] == [BEAT]
    secret = nacl.public.SealedBox(box).decrypt(bytes.fromhex(got["sealed_key"]))
    assert len(secret) == 32
    return got["session"], secret, got["expires_at"]


def mac(secret: bytes, method: str, target: str, stamp: int, nonce: str, body: bytes) -> str:
    """HMAC-SHA256 of METHOD\\nTARGET\\nTIMESTAMP\\nNONCE\\nsha256hex(body), as docs/design.md states it."""
    message = f"{method}\n{target}\n{stamp}\n{nonce}\n{hashlib.sha256(body).hexdigest()}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def mac_headers(node_key: str, session: str, secret: bytes, route=BEAT, body=BEAT_BODY, stamp=None, nonce=None):
    stamp = int(time.time() * 1000) if stamp is None else stamp
    nonce = secrets.token_hex(16) if nonce is None else nonce
    return {
        "X-Node-Key": node_key,
        "X-Timestamp": str(stamp),
        "X-Nonce": nonce,
        "X-Session": session,
        "X-Mac": mac(secret, "POST", route, stamp, nonce, body),
        **JSON,
    }


def post(url, route, body, headers) -> httpx.Response:
    return httpx.post(url + route, content=body, headers=headers)


def test_a_node_heartbeats_with_its_session_key_and_the_client_does_so_by_itself(pool):
    worker = join(pool.url)
    session, secret, expires = open_session(pool.url, worker.key)
    assert expires > time.time() + 2
    reply = post(pool.url, BEAT, BEAT_BODY, mac_headers(worker.node_key, session, secret))
    assert reply.status_code == 200, reply.text
    assert reply.json()["state"] == "healthy" and reply.json()["assignments"]

    sent: list[httpx.Request] = []
    http = httpx.Client(timeout=10, event_hooks={"request": [sent.append]})
    node = join(pool.url, http=http)
    for _ in range(3):
        assert node.heartbeat().state == "healthy"
    beats = [r for r in sent if r.url.path == BEAT]
    assert [r.url.path for r in sent].count("/v1/nodes/session") == 1
    assert len(beats) == 3 and all("x-mac" in r.headers and "x-signature" not in r.headers for r in beats)
    announced = [r for r in sent if r.url.path == "/v1/nodes/register"]
    assert announced and all("x-signature" in r.headers and "x-mac" not in r.headers for r in announced)


def test_forged_replayed_and_misused_macs_are_refused(pool):
    victim, other = join(pool.url), join(pool.url, "validator")
    session, secret, _ = open_session(pool.url, victim.key)
    other_session, other_secret, _ = open_session(pool.url, other.key)
    honest = mac_headers(victim.node_key, session, secret)
    assert post(pool.url, BEAT, BEAT_BODY, honest).status_code == 200
    tampered_body = b'{"loaded_versions":[1],"metrics":{}}'
    eavesdropped_guess = hashlib.sha256(bytes.fromhex(session)).digest()
    announce_body = json.dumps({"batch_id": "b", "assignment_id": 1, "version": 0}).encode()
    now = int(time.time() * 1000)
    attacks = {
        "random MAC": {**mac_headers(victim.node_key, session, secret), "X-Mac": secrets.token_hex(32)},
        "MAC over another body": (mac_headers(victim.node_key, session, secret), tampered_body),
        "another node's session": mac_headers(victim.node_key, other_session, other_secret),
        "a session id made up": mac_headers(victim.node_key, secrets.token_hex(16), secret),
        "a key guessed from the public reply": mac_headers(victim.node_key, session, eavesdropped_guess),
        "replayed as sent": honest,
        "stamped 60 s ahead": mac_headers(victim.node_key, session, secret, stamp=now + 60_000),
        "MAC and signature both": {
            **mac_headers(victim.node_key, session, secret),
            **{k: v for k, v in sign_request(victim.key, "POST", BEAT, BEAT_BODY).items() if k == "X-Signature"},
        },
        "MAC without a session id": {
            k: v for k, v in mac_headers(victim.node_key, session, secret).items() if k != "X-Session"
        },
    }
    for name, attack in attacks.items():
        headers, body = attack if isinstance(attack, tuple) else (attack, BEAT_BODY)
        reply = post(pool.url, BEAT, body, headers)
        assert reply.status_code == 401, (name, reply.status_code, reply.text)
    # the routes a node commits itself with take a signature only, however good the MAC
    for route, body in (
        ("/v1/batches", announce_body),
        ("/v1/validation/claim", b"{}"),
        ("/v1/nodes/deregister", b""),
        ("/v1/nodes/session", json.dumps({"box_key": "11" * 32}).encode()),
    ):
        for key, s, k in ((victim.node_key, session, secret), (other.node_key, other_session, other_secret)):
            reply = post(pool.url, route, body, mac_headers(key, s, k, route=route, body=body))
            assert reply.status_code == 401, (route, reply.text)
            assert "X-Signature" in reply.json()["detail"], reply.text
    assert victim.heartbeat().state == "healthy"  # none of it deregistered the victim


def test_box_keys_of_small_order_are_refused(pool):
    """Sealed to a point of small order, the session key could be opened by anyone: no session is made."""
    node = join(pool.url)
    small_order = [  # little-endian u of the curve's points of small order, and non-canonical encodings of them
        "00" * 32,
        "01" + "00" * 31,
        "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
        "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
        "ec" + "ff" * 30 + "7f",
        "ed" + "ff" * 30 + "7f",
        "ee" + "ff" * 30 + "7f",
        "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b880",
    ]
    for box_key in small_order:
        body = json.dumps({"box_key": box_key}).encode()
        reply = signed_post(pool.url, node.key, "/v1/nodes/session", body)
        assert reply.status_code == 422, (box_key, reply.text)
        assert "box_key" in reply.text
    for bad in ("00" * 31, "zz" * 32, "AB" * 32):
        reply = signed_post(pool.url, node.key, "/v1/nodes/session", json.dumps({"box_key": bad}).encode())
        assert reply.status_code == 422, (bad, reply.text)


def test_only_admitted_nodes_open_sessions_and_an_eavesdropper_cannot_open_the_key(pool):
    stranger = Ed25519PrivateKey.generate()
    box = nacl.public.PrivateKey.generate()
    body = json.dumps({"box_key": bytes(box.public_key).hex()}).encode()
    assert signed_post(pool.url, stranger, "/v1/nodes/session", body).status_code == 403
    assert post(pool.url, "/v1/nodes/session", body, JSON).status_code == 401
    node = join(pool.url)
    reply = signed_post(pool.url, node.key, "/v1/nodes/session", body)
    sealed = bytes.fromhex(reply.json()["sealed_key"])
    with pytest.raises(nacl.exceptions.CryptoError):
        nacl.public.SealedBox(nacl.public.PrivateKey.generate()).decrypt(sealed)


def test_sessions_expire_and_end_with_deregistration_a_ban_and_a_new_session(pool):
    admin = OrchestratorClient(pool.url, admin_token=TOKEN, retry=ONCE)
    a, b, c = join(pool.url), join(pool.url), join(pool.url)
    sa, ka, expires = open_session(pool.url, a.key)
    old, old_key, _ = open_session(pool.url, c.key)
    new, new_key, _ = open_session(pool.url, c.key)
    assert post(pool.url, BEAT, BEAT_BODY, mac_headers(c.node_key, old, old_key)).status_code == 401
    assert post(pool.url, BEAT, BEAT_BODY, mac_headers(c.node_key, new, new_key)).status_code == 200

    sb, kb, _ = open_session(pool.url, b.key)
    assert post(pool.url, BEAT, BEAT_BODY, mac_headers(b.node_key, sb, kb)).status_code == 200
    b.deregister()
    reply = post(pool.url, BEAT, BEAT_BODY, mac_headers(b.node_key, sb, kb))
    assert reply.status_code == 401 and "session" in reply.json()["detail"], reply.text

    sc, kc = new, new_key
    admin.ban(c.node_key, "test")
    assert post(pool.url, BEAT, BEAT_BODY, mac_headers(c.node_key, sc, kc)).status_code in (401, 403)

    assert post(pool.url, BEAT, BEAT_BODY, mac_headers(a.node_key, sa, ka)).status_code == 200
    time.sleep(max(0.0, expires - time.time()) + 0.3)
    reply = post(pool.url, BEAT, BEAT_BODY, mac_headers(a.node_key, sa, ka))
    assert reply.status_code == 401 and "session" in reply.json()["detail"], reply.text
    assert a.heartbeat().state == "healthy"  # the client opens a new one by itself


def test_a_restart_forgets_sessions_and_clients_carry_on(tmp_path):
    path = config(tmp_path)
    proc = OrchestratorProcess(tmp_path / "a.log", path).start()
    try:
        node = join(proc.url)
        assert node.heartbeat().state == "healthy"
        session, secret, _ = open_session(proc.url, node.key)
        assert post(proc.url, BEAT, BEAT_BODY, mac_headers(node.node_key, session, secret)).status_code == 200
    finally:
        proc.stop()
    proc = OrchestratorProcess(tmp_path / "b.log", path, port=proc.port).start()
    try:
        reply = post(proc.url, BEAT, BEAT_BODY, mac_headers(node.node_key, session, secret))
        assert reply.status_code == 401, reply.text
        assert node.heartbeat().state == "healthy"  # its own session is gone too: it signs, then opens a new one
        assert node.heartbeat().state == "healthy"
    finally:
        proc.stop()


def test_with_sessions_off_the_route_says_so_and_clients_sign_every_heartbeat(tmp_path):
    proc = OrchestratorProcess(tmp_path / "off.log", config(tmp_path, "session_ttl_s = 0")).start()
    try:
        sent: list[httpx.Request] = []
        node = join(proc.url, http=httpx.Client(timeout=10, event_hooks={"request": [sent.append]}))
        box = nacl.public.PrivateKey.generate()
        body = json.dumps({"box_key": bytes(box.public_key).hex()}).encode()
        reply = signed_post(proc.url, node.key, "/v1/nodes/session", body)
        assert reply.status_code == 403 and "session_ttl_s" in reply.json()["detail"], reply.text
        for _ in range(3):
            assert node.heartbeat().state == "healthy"
        beats = [r for r in sent if r.url.path == BEAT]
        assert len(beats) == 3 and all("x-signature" in r.headers for r in beats)
        assert [r.url.path for r in sent].count("/v1/nodes/session") == 1  # asked once, then never again
    finally:
        proc.stop()


def test_the_async_client_uses_sessions_too(pool):
    import asyncio

    from bridge.protocol import AsyncOrchestratorClient

    async def run() -> list[str]:
        key = Ed25519PrivateKey.generate()
        async with AsyncOrchestratorClient(pool.url, key=key, retry=ONCE) as node:
            assert (await node.register("worker", HW)).status == "admitted"
            states = [(await node.heartbeat()).state for _ in range(3)]
            assert node.session_id is not None
            return states

    assert asyncio.run(run()) == ["healthy"] * 3
