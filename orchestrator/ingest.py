"""The ingest: receives rollout batches that workers upload and writes them to the rollout store, the only role
that holds the store's write credentials (docs/design.md sections 6 and 8).

`PUT /v1/uploads/{assignment_id}/{batch_id}` with `Content-Length`, `X-Batch-Sha256` (the batch's COMMIT
digest) and the node signature headers, signed over METHOD, TARGET, TIMESTAMP, NONCE and that digest. The body
is the batch's upload stream (`bridge.upload`). In order, before anything is stored:

1. the path (a numeric assignment id and a batch id of `BATCH_ID_PATTERN`, as sent, nothing escaped, no
   query), the method, a Content-Length (no chunked body) and a well-formed digest: else 404/405/411/422;
2. uploads in progress in this process, in all (`ingest.max_uploads`: 503) and from the client's address
   (`ingest.max_uploads_per_ip`: 429), both with Retry-After;
3. the orchestrator's admission (`orchestrator.uploads`): the signature (401), an admitted, unbanned worker
   (403), its announcement rate (429), its own open assignment without a batch (404, 409, 410) and without
   another upload in progress (429, Retry-After), a free batch id (409); it reserves the assignment and the id;
4. the Content-Length against the largest batch the assignment allows (413): exactly its sample count, the
   pool's prompt and completion lengths per sample, the proof bytes of its completions;
5. the body, within `ingest.upload_timeout_s` of the admission (else 408 and the connection is closed: a
   slow-loris holds a slot for that long at most), laid into the batch's arrays as it arrives: meta.json names
   this batch, node, version and assignment and its counts fit the assignment (422, 413), and the stream is as
   long as meta.json says (422);
6. the write, in a thread (`RolloutStore.write(expect_sha256=)`): every invariant of the batch first (422),
   then the arrays, hashed in parallel while they are written, and `COMMIT` last, only if the values hash to
   the signed digest (else what was written is deleted: 422) and the batch id has no `COMMIT` yet (409); a
   store that fails answers 503;
7. the announcement (`finish`); if the orchestrator refuses it now (the deadline passed meanwhile: 410), what
   was written is deleted.

Any refusal drops the reservation, and a refusal before the body is read closes the connection; nothing an
upload is refused for is left in the store, and a committed batch is never touched. Workers cannot read, list
or delete batches through the ingest: it answers only this route (and `/healthz`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import time
from typing import Any

from bridge.protocol.messages import BATCH_ID_PATTERN
from bridge.protocol.signing import (
    HEADER_KEY,
    HEADER_MAC,
    HEADER_NONCE,
    HEADER_SESSION,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
)
from bridge.rollouts import ReadLimits, RolloutStore, RolloutStoreError
from bridge.upload import HEADER_BATCH_SHA256, UPLOAD_PREFIX, UploadDecoder, UploadError, max_stream_length
from orchestrator.config import IngestConfig
from orchestrator.guards import address_group
from orchestrator.uploads import LOST_RESERVATION, Gate, IngestAbort, IngestBegin, IngestFinish, IngestRefused

log = logging.getLogger("ingest")
_PATH = re.compile(rb"/v1/uploads/([0-9]{1,16})/(" + BATCH_ID_PATTERN.strip("^$").encode() + rb")")
_SHA = re.compile(r"[0-9a-f]{64}")
_AUTH = tuple(h.lower().encode() for h in (HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE))
_SESSION = (HEADER_SESSION.lower().encode(), HEADER_MAC.lower().encode())


class _Refuse(Exception):
    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None):
        self.status, self.detail, self.headers = status, detail, headers or {}


class UploadIngest:
    """The ASGI handler of uploads (module docstring), writing to `store` and asking `gate` (a `LocalGate` in the
    orchestrator's process, a `RemoteGate` in `intellect ingest`)."""

    def __init__(self, store: RolloutStore, gate: Gate, cfg: IngestConfig):
        self.store, self.gate, self.cfg = store, gate, cfg
        self.active = 0
        self.by_address: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[int] = collections.Counter()
        self.bytes_stored = 0

    # -- answers -----------------------------------------------------------------------------------------------

    async def _answer(self, send, status: int, body: bytes, headers: dict[str, str] | None = None, close=False):
        self.outcomes[status] += 1
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        raw += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (headers or {}).items()]
        if close:
            raw.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})

    async def _refuse(self, send, status: int, detail: Any, headers=None, close: bool = True) -> None:
        body = json.dumps({"detail": detail}, separators=(",", ":"), default=str).encode()
        await self._answer(send, status, body, headers, close)

    # -- the route ---------------------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._upload(scope, receive, send)
        except _Refuse as r:
            await self._refuse(send, r.status, r.detail, r.headers)

    def _head(self, scope) -> tuple[int, str, int, str, dict[bytes, bytes]]:
        """(assignment id, batch id, content length, announced sha256, headers) of a well-formed upload head."""
        raw = scope.get("raw_path") or scope["path"].encode()
        if not raw.startswith(UPLOAD_PREFIX.encode()):
            raise _Refuse(404, "not found")
        match = _PATH.fullmatch(raw)
        if match is None:
            raise _Refuse(
                422,
                [
                    {
                        "loc": ["path"],
                        "msg": "an upload goes to /v1/uploads/{assignment_id}/{batch_id}: a decimal assignment id and "
                        "a batch id of 1-128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit, "
                        "sent as is (nothing escaped)",
                        "type": "value_error",
                    }
                ],
            )
        if scope["method"] != "PUT":
            raise _Refuse(
                405, f"{scope['method']} is not allowed here: batches are uploaded with PUT", {"Allow": "PUT"}
            )
        if scope.get("query_string"):
            raise _Refuse(422, "an upload takes no query string")
        headers = dict(reversed(scope["headers"]))
        if b"transfer-encoding" in headers or b"content-length" not in headers:
            raise _Refuse(411, "send the body with a Content-Length (no chunked transfer encoding)")
        length = headers[b"content-length"]
        if not length.isdigit() or len(length) > 15:
            raise _Refuse(400, "Content-Length is not a number")
        sha = headers.get(HEADER_BATCH_SHA256.lower().encode(), b"").decode("latin-1")
        if not _SHA.fullmatch(sha):
            raise _Refuse(422, f"{HEADER_BATCH_SHA256} must be the batch's COMMIT digest: 64 lowercase hex digits")
        if any(h in headers for h in _SESSION):
            raise _Refuse(401, f"uploads are signed ({HEADER_SIGNATURE}); a session key authenticates heartbeats only")
        return int(match.group(1)), match.group(2).decode(), int(length), sha, headers

    async def _upload(self, scope, receive, send) -> None:
        assignment_id, batch_id, length, sha, headers = self._head(scope)
        client = scope.get("client")
        address = address_group(client[0]) if client else ""
        if self.by_address[address] >= self.cfg.max_uploads_per_ip:
            raise _Refuse(
                429,
                f"this address has {self.by_address[address]} uploads in progress here "
                f"(ingest.max_uploads_per_ip); retry when one is done",
                {"Retry-After": "5"},
            )
        if self.active >= self.cfg.max_uploads:
            raise _Refuse(
                503, "the ingest is receiving its most uploads at once (ingest.max_uploads)", {"Retry-After": "5"}
            )
        self.active += 1
        self.by_address[address] += 1
        try:
            await self._admitted(scope, receive, send, assignment_id, batch_id, length, sha, headers)
        finally:
            self.active -= 1
            self.by_address[address] -= 1
            if not self.by_address[address]:
                del self.by_address[address]

    async def _admitted(self, scope, receive, send, assignment_id, batch_id, length, sha, headers) -> None:
        values = [headers.get(h, b"").decode("latin-1") for h in _AUTH]
        target = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        try:
            begin = IngestBegin(
                method=scope["method"],
                target=target,
                node_key=values[0],
                timestamp=values[1],
                nonce=values[2],
                signature=values[3],
                sha256=sha,
                assignment_id=assignment_id,
                batch_id=batch_id,
                timeout_s=self.cfg.upload_timeout_s,
            )
        except ValueError:
            raise _Refuse(401, "malformed signature headers") from None
        started = time.monotonic()
        try:
            admission = await self.gate.begin(begin)
        except IngestRefused as r:
            raise _Refuse(r.status, r.detail, r.headers) from None
        ticket = admission.ticket

        async def drop(status: int, detail: Any, extra: dict[str, str] | None = None, close: bool = True) -> None:
            await self.gate.abort(IngestAbort(ticket=ticket, reason=f"HTTP {status}: {str(detail)[:900]}"))
            log.info("upload %s/%s refused: %s %s", assignment_id, batch_id, status, str(detail)[:300])
            await self._refuse(send, status, detail, extra, close)

        limits = ReadLimits.for_assignment(admission.num_samples, admission.max_tokens, admission.max_model_len)
        most = max_stream_length(limits)
        if length > most:
            return await drop(
                413,
                f"Content-Length {length} is over the {most} bytes a batch of assignment {assignment_id} may take "
                f"({admission.num_samples} samples of at most {admission.max_model_len} tokens)",
            )
        decoder = UploadDecoder(
            batch_id=batch_id,
            node_key=admission.node_key,
            version=admission.version,
            assignment_id=assignment_id,
            length=length,
            limits=limits,
        )
        left = self.cfg.upload_timeout_s - (time.monotonic() - started)
        try:
            async with asyncio.timeout(max(0.0, left)):
                while not decoder.done:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        await self.gate.abort(IngestAbort(ticket=ticket, reason="the client went away mid-upload"))
                        return
                    body = message.get("body", b"")
                    if body:
                        decoder.feed(body)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await drop(
                408,
                f"the upload took longer than {self.cfg.upload_timeout_s:g} s (ingest.upload_timeout_s): "
                f"{decoder.received} of {length} bytes arrived",
            )
        except UploadError as e:
            return await drop(e.status, f"batch {batch_id}: {e}")
        if not decoder.done:
            return await drop(400, f"the body ended after {decoder.received} of {length} bytes")
        batch = decoder.batch()
        try:
            await asyncio.to_thread(self.store.write, batch, expect_sha256=sha)
        except RolloutStoreError as e:
            if e.field == "COMMIT" and "already committed" in e.reason:
                return await drop(409, str(e), close=False)
            if e.field == "COMMIT" and "hash to" in e.reason:
                return await drop(422, f"{e} (the signed {HEADER_BATCH_SHA256})", close=False)
            if " failed: " in e.reason:
                log.error("upload %s/%s: the store failed: %s", assignment_id, batch_id, e)
                return await drop(503, f"the rollout store failed: {e}", {"Retry-After": "10"}, close=False)
            return await drop(422, str(e), close=False)
        finish = IngestFinish(
            ticket=ticket,
            num_tokens=int(len(batch.tokens)),
            store_path=self.store.batch_url(admission.version, batch_id),
        )
        try:
            record = await self.gate.finish(finish)
        except IngestRefused as r:
            await asyncio.to_thread(self.store.delete, admission.version, batch_id)
            log.info("upload %s/%s not announced (%s): its batch was deleted", assignment_id, batch_id, r)
            if r.status == 404:  # the reservation is gone, not the worker's fault: it sends the batch again
                return await self._refuse(send, 503, LOST_RESERVATION, {"Retry-After": "1"}, close=False)
            return await self._refuse(send, r.status, r.detail, r.headers, close=False)
        self.bytes_stored += length
        await self._answer(send, 200, record)

    def health(self) -> dict[str, Any]:
        return {
            "uploads_in_progress": self.active,
            "answers": {str(k): v for k, v in sorted(self.outcomes.items())},
            "bytes_stored": self.bytes_stored,
        }


class IngestApp:
    """`intellect ingest`'s whole ASGI application: the upload route, `/healthz`, and 404 for anything else."""

    def __init__(self, ingest: UploadIngest):
        self.ingest = ingest

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.ingest.gate.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope.get("raw_path") or scope["path"].encode()
        if path.startswith(UPLOAD_PREFIX.encode()):
            return await self.ingest(scope, receive, send)
        if path == b"/healthz" and scope["method"] in ("GET", "HEAD"):
            body = json.dumps({"status": "ok", "role": "ingest", **self.ingest.health()}).encode()
            return await self.ingest._answer(send, 200, body)
        await self.ingest._refuse(send, 404, "not found: this ingest answers PUT /v1/uploads/... only", close=False)
