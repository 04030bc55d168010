"""Schemathesis against the service's own OpenAPI document, on a real server process: no generated input, signed
or not, may produce a 5xx, and every documented reply must match its schema."""

import pytest
import requests
import schemathesis
from schemathesis import GenerationMode
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from bridge.protocol import HardwareReport, OrchestratorClient, sign_request
from orchestrator.process import OrchestratorProcess

TOKEN = "fuzz-token"
EXAMPLES = 12
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    config = tmp / "fuzz.toml"
    config.write_text(f'[run]\ndir = "{tmp / "run"}"\n[orchestrator]\nallow_cpu_nodes = true\n'
                      f'admin_token = "{TOKEN}"\nsubmit_rate_per_min = 1e6\nsubmit_burst = 100000\n')
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
                checks = [not_a_server_error] + ([response_schema_conformance] if mode == GenerationMode.POSITIVE
                                                 else [])
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
