"""The pieces behind issue 18's orchestrator findings, one by one: strict JSON decoding and 422s that never echo
(finding 4), weak ed25519 keys (6), bounded log records, the nonces a clean stop keeps (2), the challenge on by
default and the assignment deadline's size (1, 8), and an operator's ban landing while a registration awaits its
challenge check (10)."""

import logging
import sys

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from bridge.protocol import (
    HardwareReport,
    OrchestratorClient,
    OrchestratorError,
    RetryPolicy,
    sign_request,
    verify_signature,
    weak_public_key,
)
from intellect.config_io import load_config
from orchestrator.config import OrchestratorConfig
from orchestrator.guards import (
    BodyError,
    BoundedFormatter,
    address_group,
    decode_json,
    is_json_content_type,
    validation_errors,
)


@pytest.mark.parametrize(
    "body, why",
    [
        (b'{"a": NaN}', "expected value"),
        (b'{"a": -Infinity}', "invalid number"),
        (b"[1e999]", "overflows"),
        (b'{"a": {"b": [-1E+400]}}', "overflows"),
        (b'"\\ud800"', "hex escape"),
        (b'"\\udc00x"', "surrogate"),
        (b'"\xed\xa0\x80"', "invalid unicode"),
        (b'"\xff"', "invalid unicode"),
        (b"[" * 100_000, "recursion limit"),
        (b"1" * 5000, "out of range"),
        (b'{"a": 1} x', "trailing"),
    ],
)
def test_decode_json_refuses_what_python_json_lets_through(body, why):
    with pytest.raises(BodyError, match=why) as err:
        decode_json(body)
    assert len(str(err.value)) < 120 and "ud800" not in str(err.value)


def test_decode_json_keeps_ordinary_values():
    assert decode_json(b'{"x": [1.5e300, 1e-300, 0.25, 10], "s": "\\ud83d\\ude00 1e999"}') == {
        "x": [1.5e300, 1e-300, 0.25, 10],
        "s": "\U0001f600 1e999",
    }


def test_json_content_types_follow_fastapi():
    assert is_json_content_type(b"application/json") and is_json_content_type(b"Application/JSON; charset=utf-8")
    assert is_json_content_type(b"application/problem+json")
    assert not any(
        map(is_json_content_type, (None, b"", b"text/plain", b"application/json, text/plain", b"multipart/form-data"))
    )


def test_validation_errors_keep_no_input_and_stay_bounded():
    errors = [
        {
            "type": "finite_number",
            "loc": ("body", "metrics", "a" * 500),
            "msg": "Input should be finite",
            "input": float("nan"),
            "ctx": {"error": ValueError("x" * 10_000)},
        },
        {"type": "extra_forbidden", "loc": ("body", "\ud800"), "msg": "m" * 5000, "input": "\ud800"},
    ]
    detail = validation_errors(errors * 20)
    assert len(detail) == 33 and detail[-1]["type"] == "too_many_errors"
    assert set(detail[0]) == {"type", "loc", "msg"} and len(detail[0]["loc"][2]) <= 67
    assert detail[1]["loc"][1] == "?" and len(detail[1]["msg"]) <= 303
    import json

    json.dumps(detail, allow_nan=False).encode("utf-8")  # always encodable


SMALL_ORDER = [
    "0100000000000000000000000000000000000000000000000000000000000000",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0000000000000000000000000000000000000000000000000000000000000080",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
    "0100000000000000000000000000000000000000000000000000000000000080",
]  # identity, sign bit set
NON_CANONICAL = [
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",  # y = p + 1 (the identity)
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",  # y = p
    "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
]


def test_small_order_and_non_canonical_keys_are_weak():
    for key in SMALL_ORDER:
        assert "small order" in weak_public_key(key), key
    for key in NON_CANONICAL:
        assert "non-canonical" in weak_public_key(key), key
    for _ in range(50):
        assert weak_public_key(sign_request(Ed25519PrivateKey.generate(), "GET", "/", b"")["X-Node-Key"]) is None


def test_a_fixed_signature_verifies_under_the_identity_key_but_not_here():
    identity, forged = bytes.fromhex(SMALL_ORDER[0]), bytes.fromhex(SMALL_ORDER[0]) + bytes(32)  # R = 1, S = 0
    for message in (b"register me", b"deregister someone"):
        Ed25519PublicKey.from_public_bytes(identity).verify(forged, message)  # OpenSSL accepts it: the attack
    assert not verify_signature(SMALL_ORDER[0], forged.hex(), "POST", "/v1/nodes/register", "1", "ab" * 8, b"{}")


def test_log_records_are_bounded():
    formatter = BoundedFormatter(logging.Formatter("%(levelname)s %(message)s"), max_chars=1000)
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "body %s", ("z" * 1_000_000,), None)
    assert len(formatter.format(record)) < 1100
    try:
        raise ValueError("q" * 1_000_000)
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = formatter.format(record)
    assert len(text) < 2200 and "ValueError" in text and "characters cut" in text


def test_address_groups():
    assert address_group("192.0.2.7") == "192.0.2.7"
    assert address_group("2001:db8:1:2:aaaa::1") == address_group("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_group("::ffff:192.0.2.7") == "192.0.2.7" and address_group("testclient") == "testclient"


def test_challenge_on_by_default_without_cpu_nodes_and_the_deadline_from_max_tokens():
    assert OrchestratorConfig().challenge_side() == 512
    assert OrchestratorConfig(allow_cpu_nodes=True).challenge_side() == 0
    assert OrchestratorConfig(allow_cpu_nodes=True, challenge_size=64).challenge_side() == 64
    oc = OrchestratorConfig()
    assert oc.deadline_s(30720) == 3072.0 and oc.deadline_s(1024) == 600.0  # 10 tokens/s, 600 s floor
    assert OrchestratorConfig(assignment_deadline_s=90).deadline_s(30720) == 90


def test_nonces_survive_a_clean_stop_only(tmp_path):
    from sqlalchemy.orm import sessionmaker

    from orchestrator.auth import NonceCache, start_run, stop_run
    from orchestrator.db import open_database, sqlite_url

    db = sessionmaker(open_database(sqlite_url(tmp_path / "o.db")))
    first = NonceCache()
    run, refuse = start_run(db, first, now=100.0, max_skew_s=30)
    assert refuse == 0.0  # a new database: nothing to replay
    first.add("aa" * 8, 150.0)
    first.add("bb" * 8, 99.0)  # expired by the stop: not kept
    stop_run(db, first, run, now=120.0)
    second = NonceCache()
    run, refuse = start_run(db, second, now=125.0, max_skew_s=30)
    assert refuse == 0.0 and not second.add("aa" * 8, 200.0) and second.add("bb" * 8, 200.0)
    third = NonceCache()  # the second run never stopped cleanly
    _, refuse = start_run(db, third, now=140.0, max_skew_s=30)
    assert refuse == 170.0 and len(third) == 0


def test_a_ban_during_the_challenge_check_is_kept(tmp_path, monkeypatch):
    """An operator bans a node while its registration awaits solve_challenge in a thread: the registration is
    refused (403) and the node stays banned, in memory and in the database."""
    from fastapi.testclient import TestClient

    import orchestrator.app as service
    from intellect.orchestrator_cli import build_app

    cfg = load_config(
        None,
        [
            f"--run.dir={tmp_path}",
            "--orchestrator.allow_cpu_nodes=true",
            "--orchestrator.challenge_size=16",
            "--orchestrator.admin_token=tok",
        ],
        env={},
    )
    app = build_app(cfg)
    hardware = HardwareReport(cpu_count=1, memory_gib=1)
    solve = service.solve_challenge

    def solve_while_banned(seed, size):  # in the registration's thread; the event loop serves the ban meanwhile
        admin.ban(node.node_key, "caught during admission")
        return solve(seed, size)

    monkeypatch.setattr(service, "solve_challenge", solve_while_banned)
    with TestClient(app) as http:  # one event loop, shared by both clients' requests
        node = OrchestratorClient(
            "http://testserver", key=Ed25519PrivateKey.generate(), retry=RetryPolicy(attempts=1), http=http
        )
        admin = OrchestratorClient("http://testserver", admin_token="tok", retry=RetryPolicy(attempts=1), http=http)
        challenge = node.register("worker", hardware).challenge
        with pytest.raises(OrchestratorError, match="banned: caught during admission") as err:
            node.register("worker", hardware, challenge_answer=solve(challenge.seed, challenge.size))
        assert err.value.status == 403
        assert app.state.orchestrator.registry.live[node.node_key].banned
        assert {n.key: n for n in admin.nodes().nodes}[node.node_key].banned
        with pytest.raises(OrchestratorError, match="banned"):
            node.heartbeat()
