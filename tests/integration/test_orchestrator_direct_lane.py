"""The nodes' hot routes answered by the HTTP protocol itself (orchestrator/server.py, the direct lane) against
`intellect orchestrator` in its own process: the same replies as the ASGI lane, pipelined requests answered in
order (also behind a reply that waits for its commit to be durable), `Connection: close` and HTTP/1.0 honoured,
and whatever the lane does not take handed to the ASGI application as it arrived.

A request reaches the ASGI lane instead when its path is escaped (`/v1/validation/clai%6D`: uvicorn unescapes
it, the direct lane declines escaped paths), so the same request can be sent down both lanes and the answers
compared byte for byte (less the Date header)."""

import json
import socket

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import OrchestratorProcess
from test_orchestrator_hostile import config, join

from bridge.protocol import BatchAnnouncement, sign_request
from bridge.protocol.signing import HEADER_NONCE, HEADER_SIGNATURE, HEADER_TIMESTAMP, signing_string


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct")
    proc = OrchestratorProcess(tmp / "server.log", config(tmp, "submit_burst = 100\n")).start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log(), proc.log()[-3000:]


def connect(server) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.settimeout(10)
    return sock


def request(node, target: str, body: bytes, extra: str = "", version: str = "1.1", forged: bool = False) -> bytes:
    """A POST signed by `node` as bytes on the wire; `forged`: the signature is another key's."""
    headers = sign_request(node.key, "POST", target, body)
    if forged:
        other = Ed25519PrivateKey.generate()
        headers[HEADER_SIGNATURE] = other.sign(
            signing_string("POST", target, int(headers[HEADER_TIMESTAMP]), headers[HEADER_NONCE], body)
        ).hex()
    lines = [
        f"POST {target} HTTP/{version}",
        "Host: x",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode() + body


HEARTBEAT = json.dumps({"loaded_versions": [], "metrics": {}}).encode()


def announcement_for(a, name: str) -> bytes:
    """The body of an announcement of batch `name` for assignment `a`."""
    return (
        BatchAnnouncement(
            batch_id=name,
            assignment_id=a.id,
            version=a.version,
            num_samples=a.prompts * a.samples_per_prompt,
            num_tokens=1,
            store_path=f"file:///x/v{a.version:06d}/{name}",
            sha256="00" * 32,
        )
        .model_dump_json()
        .encode()
    )


class Replies:
    """Responses read one by one from a socket (Content-Length framed)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.data = sock, b""

    def next(self) -> tuple[int, dict[bytes, bytes], bytes]:
        while b"\r\n\r\n" not in self.data:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed; read so far: {self.data[:300]!r}"
            self.data += chunk
        head, _, rest = self.data.partition(b"\r\n\r\n")
        status_line, *lines = head.split(b"\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers[b"content-length"])
        while len(rest) < length:
            chunk = self.sock.recv(65536)
            assert chunk, "connection closed inside a body"
            rest += chunk
        self.data = rest[length:]
        return int(status_line.split()[1]), headers, rest[:length]

    def closed(self) -> bool:
        """True once the server has closed the connection (nothing more comes)."""
        return self.data == b"" and self.sock.recv(65536) == b""


def test_both_lanes_give_the_same_answers(server):
    """A validator's heartbeat (200), a worker's claim (403: wrong role), an unknown key's heartbeat (403), a bad
    signature (401): answered by the direct lane and by the ASGI lane, the same status, headers and body."""
    worker, validator = join(server.url, "worker"), join(server.url, "validator")
    stranger = type("Stranger", (), {"key": Ed25519PrivateKey.generate()})()
    cases = [
        (validator, "/v1/nodes/heartbeat", "/v1/nodes/heartbea%74", HEARTBEAT, 200),
        (worker, "/v1/validation/claim", "/v1/validation/clai%6D", b"{}", 403),
        (stranger, "/v1/nodes/heartbeat", "/v1/nodes/heartbea%74", HEARTBEAT, 403),
    ]
    sock = connect(server)
    replies = Replies(sock)
    for node, plain, escaped, body, status in cases:
        answers = []
        for target in (plain, escaped):
            sock.sendall(request(node, target, body))
            code, headers, content = replies.next()
            headers.pop(b"date")
            answers.append((code, headers, content))
        assert answers[0] == answers[1], (plain, answers)
        assert answers[0][0] == status, answers[0]
    answers = []
    for target in ("/v1/nodes/heartbeat", "/v1/nodes/heartbea%74"):
        sock.sendall(request(validator, target, HEARTBEAT, forged=True))
        code, headers, content = replies.next()
        headers.pop(b"date")
        answers.append((code, headers, content))
    assert answers[0] == answers[1] and answers[0][0] == 401, answers
    sock.close()


def test_pipelined_requests_are_answered_in_order_also_behind_a_durable_commit(server):
    """One write carries: an announcement (it commits, so its reply waits for the fsync), a heartbeat, a GET
    /healthz (FastAPI's), a verdict on a batch that does not exist, and another heartbeat. The replies come in
    that order, each the right one."""
    worker, validator = join(server.url, "worker"), join(server.url, "validator")
    [a] = worker.heartbeat().assignments[:1]
    announcement = announcement_for(a, "piped-1")
    verdict = json.dumps({"accepted": False, "reason": "x", "num_tokens": 0}).encode()
    wire = b"".join(
        (
            request(worker, "/v1/batches", announcement),
            request(worker, "/v1/nodes/heartbeat", HEARTBEAT),
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
            request(validator, "/v1/batches/no-such-batch/verdict", verdict),
            request(validator, "/v1/nodes/heartbeat", HEARTBEAT),
        )
    )
    sock = connect(server)
    sock.sendall(wire)
    replies = Replies(sock)
    got = [replies.next() for _ in range(5)]
    assert [code for code, _, _ in got] == [200, 200, 200, 404, 200], got
    assert json.loads(got[0][2])["batch_id"] == "piped-1"
    assert "assignments" in json.loads(got[1][2])
    assert json.loads(got[2][2])["status"] == "ok"
    assert "no-such-batch" in json.loads(got[3][2])["detail"]
    assert json.loads(got[4][2])["assignments"] == []  # the validator's heartbeat
    sock.close()


@pytest.mark.parametrize(("version", "extra"), [("1.1", "Connection: close\r\n"), ("1.0", "")])
def test_a_connection_that_asks_to_close_is_closed_after_its_reply(server, version, extra):
    validator = join(server.url, "validator")
    body = HEARTBEAT
    sock = connect(server)
    sock.sendall(request(validator, "/v1/nodes/heartbeat", body, extra=extra, version=version))
    replies = Replies(sock)
    code, headers, _ = replies.next()
    assert code == 200 and headers[b"connection"] == b"close"
    assert replies.closed()
    sock.close()


def test_a_body_fastapi_must_word_goes_the_asgi_way(server):
    """A heartbeat whose body is not valid for its model, taken up by the direct lane and handed on: FastAPI's
    422, naming the field; the connection then serves the next request."""
    validator = join(server.url, "validator")
    sock = connect(server)
    replies = Replies(sock)
    sock.sendall(request(validator, "/v1/nodes/heartbeat", b'{"loaded_versions": "x"}'))
    code, _, content = replies.next()
    assert code == 422 and json.loads(content)["detail"][0]["loc"] == ["body", "loaded_versions"]
    sock.sendall(request(validator, "/v1/nodes/heartbeat", b"{}"))
    assert replies.next()[0] == 200
    sock.close()
