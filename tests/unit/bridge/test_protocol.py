"""bridge.protocol: signing against an independent construction, the challenge, models, and the client's
retries (on httpx's MockTransport, no server)."""

import hashlib
import json
import random
import stat

import httpx
import numpy as np
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from bridge import protocol
from bridge.protocol import (
    BatchAnnouncement,
    GpuInfo,
    HardwareReport,
    OrchestratorClient,
    OrchestratorError,
    PolicyInfo,
    PoolRequirements,
    RetryPolicy,
    Verdict,
    load_or_create_key,
    public_key_hex,
    sign_request,
    signing_string,
    solve_challenge,
    verify_signature,
)

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
POLICY = {"version": 3, "learner_step": 3, "async_level": 2, "min_version": 1, "relays": [], "announced_at": None}


def test_signature_is_ed25519_over_the_design_string():
    body = b'{"role":"worker"}'
    headers = sign_request(KEY, "post", "/v1/nodes/register?x=1", body, timestamp_ms=1700000000123, nonce="ab" * 8)
    # The docs/design.md section 8 string, built here by hand, verified with cryptography directly.
    expected = f"POST\n/v1/nodes/register?x=1\n1700000000123\n{'ab' * 8}\n{hashlib.sha256(body).hexdigest()}"
    public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(headers["X-Node-Key"]))
    public.verify(bytes.fromhex(headers["X-Signature"]), expected.encode())  # raises if wrong
    assert headers["X-Node-Key"] == KEY.public_key().public_bytes_raw().hex()
    assert headers["X-Timestamp"] == "1700000000123" and headers["X-Nonce"] == "ab" * 8


@pytest.mark.parametrize("change", ["method", "target", "timestamp", "nonce", "body", "key"])
def test_any_changed_part_fails_verification(change):
    parts = {"method": "POST", "target": "/v1/batches", "timestamp": "1700000000000", "nonce": "cd" * 8, "body": b"{}"}
    headers = sign_request(
        KEY, parts["method"], parts["target"], parts["body"], int(parts["timestamp"]), parts["nonce"]
    )
    key = headers["X-Node-Key"]
    args = dict(parts)
    if change == "key":
        key = public_key_hex(Ed25519PrivateKey.generate())
    else:
        args[change] = {
            "method": "PUT",
            "target": "/v1/batches?a=1",
            "timestamp": "1700000000001",
            "nonce": "ce" * 8,
            "body": b"{ }",
        }[change]
    assert verify_signature(
        headers["X-Node-Key"],
        headers["X-Signature"],
        parts["method"],
        parts["target"],
        parts["timestamp"],
        parts["nonce"],
        parts["body"],
    )
    assert not verify_signature(
        key, headers["X-Signature"], args["method"], args["target"], args["timestamp"], args["nonce"], args["body"]
    )


@pytest.mark.parametrize(
    "key,signature", [("zz" * 32, "00" * 64), ("ab" * 31, "00" * 64), ("ab" * 32, "0"), ("ab" * 32, "xy" * 64)]
)
def test_malformed_key_or_signature_is_false_not_an_exception(key, signature):
    assert verify_signature(key, signature, "GET", "/", "0", "00" * 8, b"") is False


def test_verification_agrees_with_openssl_on_honest_and_altered_signatures():
    """verify_signature (libsodium) against OpenSSL's ed25519 through `cryptography`, the independent reference:
    every honest signature of many keys passes both, every altered one fails both, and a signature whose S is
    pushed past the group order (a malleated copy of an honest one) is refused."""
    order = 2**252 + 27742317777372353535851937790883648493
    rng = np.random.default_rng(5)
    for i in range(64):
        key = Ed25519PrivateKey.from_private_bytes(rng.bytes(32))
        body = rng.bytes(int(rng.integers(0, 300)))
        headers = sign_request(key, "POST", f"/v1/x/{i}", body, timestamp_ms=1700000000000 + i, nonce="ef" * 8)
        node, signature = headers["X-Node-Key"], bytes.fromhex(headers["X-Signature"])
        message = signing_string("POST", f"/v1/x/{i}", 1700000000000 + i, "ef" * 8, body)
        public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(node))
        public.verify(signature, message)  # OpenSSL accepts it
        assert verify_signature(node, signature.hex(), "POST", f"/v1/x/{i}", str(1700000000000 + i), "ef" * 8, body)
        bad = bytearray(signature)
        bad[int(rng.integers(0, 64))] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(InvalidSignature):
            public.verify(bytes(bad), message)
        assert not verify_signature(node, bad.hex(), "POST", f"/v1/x/{i}", str(1700000000000 + i), "ef" * 8, body)
        s = int.from_bytes(signature[32:], "little") + order
        if s < 2**256:
            malleated = signature[:32] + s.to_bytes(32, "little")
            assert not verify_signature(
                node, malleated.hex(), "POST", f"/v1/x/{i}", str(1700000000000 + i), "ef" * 8, body
            )


def test_challenge_hash_matches_exact_float64_and_python_int_products():
    a, b = protocol.challenge_matrices(seed=7, size=48)
    exact = (a.astype(np.float64) @ b.astype(np.float64)).astype("<i8")  # < 2**53: float64 is exact
    assert solve_challenge(7, 48) == hashlib.sha256(exact.tobytes()).hexdigest()
    small_a, small_b = protocol.challenge_matrices(seed=9, size=5)
    product = [[sum(int(small_a[i, k]) * int(small_b[k, j]) for k in range(5)) for j in range(5)] for i in range(5)]
    packed = b"".join(v.to_bytes(8, "little", signed=True) for row in product for v in row)
    assert solve_challenge(9, 5) == hashlib.sha256(packed).hexdigest()
    assert solve_challenge(7, 48) != solve_challenge(8, 48)


def test_pool_requirements_name_what_is_missing():
    req = PoolRequirements(
        min_gpus=2, min_gpu_memory_gib=40, allow_cpu_nodes=False, challenge_size=0, heartbeat_interval_s=10
    )
    cpu = HardwareReport(cpu_count=8, memory_gib=32)
    assert "CPU-only" in req.failures(cpu)[0]
    one_small = HardwareReport(gpus=[GpuInfo(name="L4", memory_gib=24)], cpu_count=8, memory_gib=32)
    problems = req.failures(one_small)
    assert any("1 GPU(s) reported" in p for p in problems) and any("L4 (24 GiB)" in p for p in problems)
    good = HardwareReport(gpus=[GpuInfo(name="H100", memory_gib=80)] * 2, cpu_count=8, memory_gib=32)
    assert req.failures(good) == []
    assert req.model_copy(update={"allow_cpu_nodes": True}).failures(cpu) == []


def test_requests_are_strict_and_replies_tolerant():
    with pytest.raises(ValidationError, match="extra"):
        BatchAnnouncement.model_validate(
            {
                "batch_id": "b",
                "assignment_id": 1,
                "version": 0,
                "store_path": "x",
                "sha256": "0" * 64,
                "num_samples": 1,
                "num_tokens": 1,
                "bonus": 1,
            }
        )
    with pytest.raises(ValidationError, match="batch_id"):
        BatchAnnouncement(
            batch_id="../etc", assignment_id=1, version=0, store_path="x", sha256="0" * 64, num_samples=1, num_tokens=1
        )
    assert PolicyInfo.model_validate({**POLICY, "added_later": True}).version == 3
    with pytest.raises(ValidationError, match="failed_checks must be empty"):
        Verdict(accepted=True, failed_checks=["toploc"], num_tokens=1)
    with pytest.raises(ValidationError, match="needs failed_checks or a reason"):
        Verdict(accepted=False, num_tokens=1)
    with pytest.raises(ValidationError, match="finite"):
        Verdict(accepted=True, rewards=[float("nan")], num_tokens=1)


def test_key_file_is_created_private_and_read_back(tmp_path):
    path = tmp_path / "keys" / "worker.key"
    key = load_or_create_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert public_key_hex(load_or_create_key(path)) == public_key_hex(key)


def test_retry_delays_are_full_jitter_within_the_cap():
    policy = RetryPolicy(attempts=8, base_delay_s=0.5, max_delay_s=3.0)
    rng = random.Random(0)
    for retry in range(8):
        delays = [policy.delay(retry, rng) for _ in range(200)]
        cap = min(3.0, 0.5 * 2**retry)
        assert all(0 <= d <= cap for d in delays) and max(delays) > 0.8 * cap  # spread over [0, cap]
    assert policy.delay(0, rng, retry_after=2.0) == 2.0 and policy.delay(0, rng, retry_after=60) == 3.0


def _client(handler, **kwargs):
    sleeps = []
    client = OrchestratorClient(
        "http://orchestrator.test",
        key=KEY,
        seed=0,
        sleep=sleeps.append,
        http=httpx.Client(transport=httpx.MockTransport(handler)),
        **kwargs,
    )
    return client, sleeps


def test_client_retries_5xx_and_connection_errors_signing_each_attempt_afresh():
    seen = []

    def handler(request):
        if request.url.path == "/v1/nodes/session":  # a service without sessions: every heartbeat is signed
            return httpx.Response(404, json={"detail": "Not Found"})
        seen.append(request)
        if len(seen) == 1:
            raise httpx.ConnectError("refused")
        if len(seen) == 2:
            return httpx.Response(503, json={"detail": "busy"})
        return httpx.Response(
            200, json={"state": "healthy", "policy": POLICY, "assignments": [], "heartbeat_interval_s": 10}
        )

    client, sleeps = _client(handler)
    reply = client.heartbeat(loaded_versions=[3])
    assert reply.state == "healthy" and reply.policy.version == 3 and len(sleeps) == 2
    nonces = {r.headers["X-Nonce"] for r in seen}
    assert len(nonces) == 3  # never a replayed nonce
    for r in seen:
        assert verify_signature(
            r.headers["X-Node-Key"],
            r.headers["X-Signature"],
            "POST",
            "/v1/nodes/heartbeat",
            r.headers["X-Timestamp"],
            r.headers["X-Nonce"],
            r.content,
        )
        assert json.loads(r.content) == {"loaded_versions": [3], "metrics": {}}


def test_client_honours_retry_after_and_gives_up_with_the_cause():
    client, sleeps = _client(
        lambda r: httpx.Response(429, headers={"Retry-After": "7"}, json={"detail": "slow"}),
        retry=RetryPolicy(attempts=3, max_delay_s=30),
    )
    with pytest.raises(OrchestratorError, match="after 3 attempts.*HTTP 429") as err:
        client.policy()
    assert err.value.status == 0 and sleeps == [7.0, 7.0]


def test_client_does_not_retry_4xx_and_reports_the_detail():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(403, json={"detail": "node abc is banned: cheating"})

    client, sleeps = _client(handler)
    with pytest.raises(OrchestratorError, match="HTTP 403: node abc is banned") as err:
        client.claim()
    assert err.value.status == 403 and len(calls) == 1 and sleeps == []


def test_admin_calls_carry_the_bearer_token_and_query():
    captured = []

    def handler(request):
        captured.append(request)
        return httpx.Response(200, json={"batches": [], "next_after": 5})

    client, _ = _client(handler, admin_token="s3cret")
    assert client.batches(min_version=2, after=5).next_after == 5
    assert captured[0].headers["Authorization"] == "Bearer s3cret"
    assert captured[0].url.params == httpx.QueryParams({"status": "accepted", "min_version": "2", "after": "5"})
    assert "X-Signature" not in captured[0].headers


class _SessionService:
    """A mock service that opens real sessions (sealed keys) and checks MACs with hmac, as the orchestrator states
    it; `refuse_macs` makes it answer every MAC 401 (a proxy that drops the headers, or a restart each time)."""

    def __init__(self, refuse_macs: bool = False):
        self.refuse_macs = refuse_macs
        self.secrets: dict[str, bytes] = {}
        self.log: list[tuple[str, str]] = []  # (path, how it was authenticated)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        import hmac

        import nacl.public

        h = request.headers
        how = "mac" if "x-mac" in h else "signature" if "x-signature" in h else "none"
        self.log.append((request.url.path, how))
        if request.url.path == "/v1/nodes/session":
            session, secret = f"{len(self.secrets):032x}", bytes([len(self.secrets)]) * 32
            self.secrets[session] = secret
            box = nacl.public.PublicKey(bytes.fromhex(json.loads(request.content)["box_key"]))
            sealed = nacl.public.SealedBox(box).encrypt(secret).hex()
            reply = {"session": session, "sealed_key": sealed, "expires_at": 4e9, "routes": ["/v1/nodes/heartbeat"]}
            return httpx.Response(200, json=reply)
        if how == "mac":
            message = "\n".join(
                ["POST", request.url.path, h["x-timestamp"], h["x-nonce"], hashlib.sha256(request.content).hexdigest()]
            )
            secret = self.secrets.get(h["x-session"])
            good = secret is not None and hmac.new(secret, message.encode(), "sha256").hexdigest() == h["x-mac"]
            if self.refuse_macs or not good:
                return httpx.Response(401, json={"detail": "unknown or expired session"})
        beat = {"state": "healthy", "policy": POLICY, "assignments": [], "heartbeat_interval_s": 10}
        return httpx.Response(200, json=beat)


def test_the_client_heartbeats_with_its_session_and_renews_one_a_restart_forgot():
    service = _SessionService()
    client, sleeps = _client(service)
    for _ in range(3):
        assert client.heartbeat().state == "healthy"
    assert service.log == [("/v1/nodes/session", "signature")] + [("/v1/nodes/heartbeat", "mac")] * 3
    service.secrets.clear()  # the service restarted: it knows no session
    service.log.clear()
    for _ in range(2):
        assert client.heartbeat().state == "healthy"
    assert service.log == [
        ("/v1/nodes/heartbeat", "mac"),  # refused: 401
        ("/v1/nodes/heartbeat", "signature"),  # sent again at once, signed
        ("/v1/nodes/session", "signature"),  # the next heartbeat opens a new session first
        ("/v1/nodes/heartbeat", "mac"),
    ]
    assert sleeps == []


def test_a_session_that_never_works_is_not_opened_again_for_a_while():
    service = _SessionService(refuse_macs=True)
    now = [1000.0]
    client, sleeps = _client(service, clock=lambda: now[0])
    for _ in range(4):
        assert client.heartbeat().state == "healthy"
    opened = [path for path, _ in service.log if path == "/v1/nodes/session"]
    assert len(opened) == 1  # one try, then signed heartbeats only
    assert [how for path, how in service.log if path == "/v1/nodes/heartbeat"] == ["mac"] + ["signature"] * 4
    now[0] += protocol.clients.SESSION_RETRY_S
    assert client.heartbeat().state == "healthy"
    assert [path for path, _ in service.log].count("/v1/nodes/session") == 2  # asked again after the pause
