"""A worker's upload of a batch (docs/design.md section 8, uploads): one signed `PUT /v1/uploads/{assignment_id}/
{batch_id}` whose body is the batch's upload stream (`bridge.upload.encode`).

The request carries `Expect: 100-continue`: the pool checks the signature, the assignment and the size from the
head alone and answers 100 Continue (then the body is sent) or its refusal (then nothing is sent), so a refused
upload costs no bytes and its reason reaches the worker. A server that says nothing for `continue_wait_s` gets
the body anyway (RFC 9110). The body goes out as the arrays' own memory, with no copy.

Errors raise `OrchestratorError`: the status and the pool's reason, or status 0 when the pool could not be
reached or the connection broke (`gpu_workers.node.patiently` retries those, and 429 and 5xx).
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import urllib.parse
from collections.abc import Iterable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bridge.protocol.clients import OrchestratorError
from bridge.protocol.messages import BatchRecord
from bridge.protocol.signing import sign_request

UPLOAD_PREFIX = "/v1/uploads/"
HEADER_BATCH_SHA256 = "X-Batch-Sha256"
_MAX_HEAD = 64 << 10
_MAX_REPLY = 4 << 20


def _read_reply(fp) -> tuple[int, bytes]:
    """The next final response on `fp` (1xx skipped): (status, body); the body by its Content-Length."""
    while True:
        line = fp.readline(_MAX_HEAD)
        if not line:
            raise ConnectionError("the connection closed before a response")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise ConnectionError(f"not an HTTP response: {line[:80]!r}")
        status = int(parts[1])
        length, read = None, 0
        while True:
            header = fp.readline(_MAX_HEAD)
            read += len(header)
            if header in (b"\r\n", b"\n", b"") or read > _MAX_HEAD:
                break
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"content-length" and value.strip().isdigit():
                length = int(value.strip())
        if 100 <= status < 200:
            continue
        body = fp.read(min(length, _MAX_REPLY)) if length is not None else fp.read(_MAX_REPLY)
        return status, body


def upload_batch(
    base_url: str,
    key: Ed25519PrivateKey,
    assignment_id: int,
    batch_id: str,
    sha256: str,
    length: int,
    pieces: Iterable[memoryview],
    *,
    timeout_s: float = 300.0,
    continue_wait_s: float = 5.0,
) -> BatchRecord:
    """Upload one batch's stream (`length` bytes in `pieces`) to `base_url`; the pool's record of the batch."""
    url = urllib.parse.urlsplit(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"upload URL {base_url!r}: expected http(s)://host[:port][/prefix]")
    target = url.path.rstrip("/") + f"{UPLOAD_PREFIX}{int(assignment_id)}/{batch_id}"
    headers = {
        "Host": url.netloc,
        "Content-Type": "application/octet-stream",
        "Content-Length": str(length),
        HEADER_BATCH_SHA256: sha256,
        "Expect": "100-continue",
        "Connection": "close",
        **sign_request(key, "PUT", target, b"", body_sha256=sha256),
    }
    head = f"PUT {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        sock = socket.create_connection((url.hostname, port), timeout=timeout_s)
    except OSError as exc:
        raise OrchestratorError(0, f"cannot connect: {exc}", "PUT", target) from None
    try:
        if url.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=url.hostname)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fp = sock.makefile("rb")
        try:
            sock.sendall(head.encode("latin-1"))
            status, body = _exchange(sock, fp, pieces, continue_wait_s)
        except (OSError, ConnectionError) as exc:
            raise OrchestratorError(0, f"upload failed: {type(exc).__name__}: {exc}", "PUT", target) from None
        finally:
            fp.close()
    finally:
        sock.close()
    if status >= 300:
        try:
            detail = json.loads(body).get("detail", body.decode("utf-8", "replace"))
        except (ValueError, AttributeError):
            detail = body.decode("utf-8", "replace")[:1000]
        raise OrchestratorError(status, detail, "PUT", target)
    try:
        return BatchRecord.model_validate_json(body)
    except ValueError as exc:
        raise OrchestratorError(status, f"reply does not match BatchRecord: {exc}", "PUT", target) from None


def _exchange(sock: socket.socket, fp, pieces: Iterable[memoryview], continue_wait_s: float) -> tuple[int, bytes]:
    """Wait for 100 Continue (or a refusal), send the body, read the final reply."""
    readable, _, _ = select.select([sock], [], [], continue_wait_s)
    if readable:
        line = fp.readline(_MAX_HEAD)
        if not line.split(None, 2)[1:2] == [b"100"]:  # a final answer before the body: the refusal
            rest = _prefixed(line, fp)
            return _read_reply(rest)
        while fp.readline(_MAX_HEAD) not in (b"\r\n", b"\n", b""):
            pass
    try:
        for piece in pieces:
            sock.sendall(piece)
    except OSError:  # the server stopped reading: its answer may be waiting
        return _read_reply(fp)
    return _read_reply(fp)


class _prefixed:
    """A file-like of `line` followed by `fp` (a status line already read)."""

    def __init__(self, line: bytes, fp):
        self.line, self.fp = line, fp

    def readline(self, limit: int = -1) -> bytes:
        if self.line is not None:
            line, self.line = self.line, None
            return line
        return self.fp.readline(limit)

    def read(self, n: int = -1) -> bytes:
        return self.fp.read(n)
