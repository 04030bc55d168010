"""Schemathesis against the service's own OpenAPI document, on a real server process: no generated input, signed
or not, may produce a 5xx, and every documented reply must match its schema. Then hostile values (NaN, Infinity,
overflowing and huge numbers, lone surrogates, deep nesting) in every operation, in both lanes."""

import json

import pytest
import requests
import schemathesis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import OrchestratorProcess
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from bridge.protocol import HardwareReport, OrchestratorClient, sign_request

TOKEN = "fuzz-token"
EXAMPLES = 12
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    config = tmp / "fuzz.toml"
    config.write_text(
        f'[run]\ndir = "{tmp / "run"}"\n[orchestrator]\nallow_cpu_nodes = true\n'
        f'admin_token = "{TOKEN}"\nsubmit_rate_per_min = 1e6\nsubmit_burst = 100000\n'
        "register_rate_per_min = 1e6\nregister_burst = 100000\n"
    )
    proc = OrchestratorProcess(tmp / "server.log", config).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()[-3000:]


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


@pytest.fixture(scope="module")
def signer(fuzz_server):
    """requests auth signing as a registered worker (a validator on validation routes), with the admin token."""
    keys = {}
    for role in ("worker", "validator"):
        key = Ed25519PrivateKey.generate()
        OrchestratorClient(fuzz_server.url, key=key).register(role, HardwareReport(cpu_count=1, memory_gib=1))
        keys[role] = key

    class Sign(requests.auth.AuthBase):
        def __call__(self, r):
            body = r.body or b""
            body = body.encode() if isinstance(body, str) else body
            role = "validator" if "/validation/" in r.path_url or "/verdict" in r.path_url else "worker"
            r.headers.update(sign_request(keys[role], r.method, r.path_url, body))
            r.headers["Authorization"] = f"Bearer {TOKEN}"
            return r

    return Sign()


def _fuzz(api_schema, **call_kwargs) -> None:
    """Every operation of the document, EXAMPLES valid and EXAMPLES invalid cases each (schemathesis' pytest
    plugin predates pytest 9, so the operations are driven with hypothesis directly)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @FUZZ
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                checks = [not_a_server_error] + (
                    [response_schema_conformance] if mode == GenerationMode.POSITIVE else []
                )
                case.call_and_validate(checks=checks, timeout=30, **call_kwargs)

            try:
                check()
            except Unsatisfiable:  # an operation without parameters or body has no invalid input
                assert mode == GenerationMode.NEGATIVE and not _has_inputs(operation), operation.path


def _has_inputs(operation) -> bool:
    return bool(operation.body or operation.query or operation.path_parameters)


def test_generated_requests_never_get_a_5xx(api_schema):
    _fuzz(api_schema)


def test_generated_signed_requests_never_get_a_5xx(api_schema, signer):
    _fuzz(api_schema, auth=signer)


# Values Python's json module accepts and the models or the reply encoder choke on, and bodies nested past any
# parser's patience: each in place of the whole body, of every top-level field, and inside a field.
HOSTILE = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e999",
    b"-1e999",
    b'"\\ud800"',
    b'"\\udfff x"',
    b'"\xed\xa0\x80"',
    b"9" * 5000,
]
DEEP = b"[" * 150_000 + b"]" * 150_000
ECHOES = (b"NaN", b"Infinity", b"1e999", b"ud800", b"udfff", b"\xed\xa0\x80", b"99999", b"[[[[")


def _bodies(doc: dict, operation: dict) -> list[bytes]:
    bodies = HOSTILE + [DEEP]
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    ref = schema.get("$ref") or next((s.get("$ref") for s in schema.get("anyOf", ()) if "$ref" in s), None)
    fields = doc["components"]["schemas"][ref.rsplit("/", 1)[1]].get("properties", {}) if ref else {}
    for name in fields:
        key = json.dumps(name).encode()
        bodies += [b"{" + key + b":" + value + b"}" for value in HOSTILE]
        bodies += [b"{" + key + b':{"x":NaN}}', b"{" + key + b":[1e999]}", b"{" + key + b":" + DEEP + b"}"]
    return bodies


def test_hostile_values_in_every_operation_never_get_a_5xx(fuzz_server, signer):
    """NaN, Infinity, overflowing and huge numbers, lone surrogates and deep nesting in the body (and the query)
    of every operation, signed and unsigned: FastAPI's routes and the fast lane's alike answer 4xx, never echo
    the value, and the log stays small."""
    doc = requests.get(fuzz_server.url + "/openapi.json").json()
    params = {"batch_id": "fuzz-batch", "node_key": "ab" * 32, "assignment_id": 1}
    log_before, sent = fuzz_server.log_path.stat().st_size, 0
    with requests.Session() as http:
        for path, methods in doc["paths"].items():
            for method, operation in methods.items():
                url = fuzz_server.url + path.format(**params)
                requests_to_send = [
                    dict(url=url, data=body, headers={"Content-Type": "application/json"})
                    for body in _bodies(doc, operation)
                ]
                for q in (p["name"] for p in operation.get("parameters", ()) if p["in"] == "query"):
                    requests_to_send += [dict(url=f"{url}?{q}={v}") for v in ("NaN", "1e999", "%ED%A0%80", "9" * 5000)]
                for request in requests_to_send:
                    for auth in (signer, None):
                        reply = http.request(method.upper(), auth=auth, timeout=30, **request)
                        sent += 1
                        assert reply.status_code < 500, (method, path, request, reply.status_code, reply.text[:300])
                        if reply.status_code >= 400:
                            echoed = [e for e in ECHOES if e in reply.content]
                            assert not echoed, (method, path, reply.text[:300])
    assert sent > 600
    assert fuzz_server.log_path.stat().st_size - log_before < 50 * sent  # no request is logged at length
