"""The orchestrator's side of uploads (docs/design.md section 8): who may upload what, decided before a byte of
the batch is read, and the announcement once the ingest has stored it.

An upload (`PUT /v1/uploads/{assignment_id}/{batch_id}`, received by `orchestrator.ingest`) goes through three
steps here, whether the ingest runs in this process (`LocalGate`) or in `intellect ingest` processes beside it
(`RemoteGate`, over the routes `declare_routes` adds, with the ingest token):

- `begin`: the request's signature, checked over its target and the COMMIT digest it announces
  (X-Batch-Sha256) in place of the body's hash, with the service's clock and nonce cache, so a replay to any
  ingest process is refused; the signer is an admitted, unbanned worker within its announcement rate; the
  assignment is its own, open and in time, has no batch and no other upload in progress, and the batch id is
  not taken. The answer is a ticket and what the batch must be: its version, its exact sample count and the
  bounds of its tokens and proof bytes. The ticket reserves the assignment and the batch id until the upload
  ends or its deadline passes.
- `finish`: the ingest stored the batch and found that it hashes to the announced digest; the batch is
  announced as the worker's (`WorkScheduler.announce`, which checks the assignment again in its transaction),
  at the path the ingest wrote it to.
- `abort`: the upload failed; the reservation is dropped.

Refusals are `HTTPException`s with the status and reason the ingest passes on to the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response
from pydantic import Field

from bridge.protocol.messages import MAX_INT, BatchAnnouncement, BatchId, BatchRecord, Hex64, Reply
from bridge.protocol.messages import Request as Msg

if TYPE_CHECKING:
    from orchestrator.service import NodeRoutes, Orchestrator

log = logging.getLogger("orchestrator")
RESERVATION_SLACK_S = 30.0  # a reservation outlives its upload's deadline by this much (the ingest's clean-up)


class IngestBegin(Msg):
    """An upload's request head, as the ingest received it: what the worker signed."""

    method: str = Field(pattern=r"^[A-Z]{1,10}$")
    target: str = Field(min_length=1, max_length=400, pattern=r"^/[\x21-\x7e]*$")
    node_key: str = Field(max_length=128)
    timestamp: str = Field(max_length=32)
    nonce: str = Field(max_length=128)
    signature: str = Field(max_length=256)
    sha256: Hex64
    assignment_id: int = Field(ge=0, le=MAX_INT)
    batch_id: BatchId
    timeout_s: float = Field(gt=0, le=86400, allow_inf_nan=False, description="the ingest's deadline for the body")


class IngestAdmission(Reply):
    """What an admitted upload must be."""

    ticket: str
    node_key: str
    version: int
    num_samples: int = Field(description="exactly: prompts x samples per prompt of the assignment")
    max_tokens: int = Field(description="completion tokens per sample (sizes the proofs)")
    max_model_len: int = Field(description="prompt and completion tokens per sample")
    expires_at: float | None = Field(description="the assignment's deadline (unix seconds)")


LOST_RESERVATION = "the pool lost this upload's reservation (a restart, or it took too long): upload it again"


class IngestFinish(Msg):
    ticket: str = Field(pattern=r"^[0-9a-f]{32}$")
    num_tokens: int = Field(ge=0, le=1 << 40)
    store_path: str = Field(min_length=1, max_length=2048, pattern=r"^[^\x00]*$")


class IngestAbort(Msg):
    ticket: str = Field(pattern=r"^[0-9a-f]{32}$")
    reason: str = Field("", max_length=1000, pattern=r"^[^\x00]*$")


@dataclass
class _Reservation:
    node_key: str
    assignment_id: int
    batch_id: str
    version: int
    sha256: str
    num_samples: int
    expires: float


class UploadDesk:
    """Uploads in progress, by ticket, assignment and batch id (in memory: after a restart an upload in flight
    fails at `finish`, which checks the assignment again)."""

    def __init__(self, svc: Orchestrator, node_routes: NodeRoutes, max_tokens: int, max_model_len: int):
        self.svc, self.node_routes = svc, node_routes
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self._tickets: dict[str, _Reservation] = {}
        self._by_assignment: dict[int, str] = {}
        self._by_batch: dict[str, str] = {}

    def _drop_expired(self, now: float) -> None:
        for ticket in [t for t, r in self._tickets.items() if r.expires <= now]:
            self._release(ticket)

    def _release(self, ticket: str) -> _Reservation | None:
        held = self._tickets.pop(ticket, None)
        if held is not None:
            self._by_assignment.pop(held.assignment_id, None)
            self._by_batch.pop(held.batch_id, None)
        return held

    def begin(self, msg: IngestBegin) -> IngestAdmission:
        svc = self.svc
        key = svc.auth.verify(
            msg.method,
            msg.target.encode("latin-1"),
            b"",
            msg.node_key,
            msg.timestamp,
            msg.nonce,
            msg.signature,
            body_sha256=msg.sha256,
        )
        self.node_routes.node_in_role(key, "worker")
        svc.limiter.take(key)
        work = svc.scheduler.upload_target(key, msg.assignment_id, msg.batch_id)
        now = svc.clock()
        self._drop_expired(now)
        for held, what in (
            (self._by_assignment.get(msg.assignment_id), f"assignment {msg.assignment_id}"),
            (self._by_batch.get(msg.batch_id), f"batch_id {msg.batch_id!r}"),
        ):
            if held is not None:  # 429: retry once it ends (or its reservation lapses, if its ingest vanished)
                wait = max(1, math.ceil(min(self._tickets[held].expires - now, 60)))
                raise HTTPException(
                    429,
                    f"{what}: an upload of it is in progress; retry in {wait} s",
                    headers={"Retry-After": str(wait)},
                )
        ticket = secrets.token_hex(16)
        num_samples = work.prompts * work.samples_per_prompt
        self._tickets[ticket] = _Reservation(
            key, work.id, msg.batch_id, work.version, msg.sha256, num_samples, now + msg.timeout_s + RESERVATION_SLACK_S
        )
        self._by_assignment[work.id], self._by_batch[msg.batch_id] = ticket, ticket
        deadline = svc.scheduler.deadline_s
        return IngestAdmission(
            ticket=ticket,
            node_key=key,
            version=work.version,
            num_samples=num_samples,
            max_tokens=self.max_tokens,
            max_model_len=self.max_model_len,
            expires_at=work.issued_at + deadline if deadline != float("inf") else None,
        )

    def finish(self, msg: IngestFinish) -> BatchRecord:
        held = self._release(msg.ticket)
        if held is None:  # the orchestrator restarted, or the upload outlived its reservation
            # a 4xx here (an unknown ticket is the caller's to fix); the ingest tells the worker to send it again
            raise HTTPException(404, LOST_RESERVATION)
        note = BatchAnnouncement(
            batch_id=held.batch_id,
            assignment_id=held.assignment_id,
            version=held.version,
            store_path=msg.store_path,
            sha256=held.sha256,
            num_samples=held.num_samples,
            num_tokens=msg.num_tokens,
        )
        record = self.svc.scheduler.announce(held.node_key, note)
        log.info("batch %s of node %s... uploaded and announced", held.batch_id, held.node_key[:16])
        return record

    def abort(self, msg: IngestAbort) -> None:
        held = self._release(msg.ticket)
        if held is not None and msg.reason:
            log.info("upload of %s by %s... dropped: %s", held.batch_id, held.node_key[:16], msg.reason[:300])


class IngestRefused(Exception):
    """The orchestrator (or the ingest itself) refused an upload: `status` and `detail` go back to the worker."""

    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail, self.headers = status, detail, headers or {}


def _refused(exc: HTTPException) -> IngestRefused:
    return IngestRefused(exc.status_code, exc.detail, dict(exc.headers or {}))


class LocalGate:
    """The desk of the orchestrator this ingest runs in."""

    def __init__(self, desk: UploadDesk):
        self.desk = desk

    async def begin(self, msg: IngestBegin) -> IngestAdmission:
        try:
            return self.desk.begin(msg)
        except HTTPException as exc:
            raise _refused(exc) from None

    async def finish(self, msg: IngestFinish) -> bytes:
        try:
            record = self.desk.finish(msg)
        except HTTPException as exc:
            raise _refused(exc) from None
        wal = self.desk.svc.wal
        if wal is not None:  # the announcement is on disk before the worker hears of it
            await wal.wait()
        return record.model_dump_json().encode()

    async def abort(self, msg: IngestAbort) -> None:
        self.desk.abort(msg)

    async def close(self) -> None:
        pass


class RemoteGate:
    """The desk of an orchestrator reached over HTTP (`intellect ingest`), with the ingest token."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 30.0):
        self.base_url, self.token, self.timeout_s = base_url.rstrip("/"), token, timeout_s
        self._session = None

    async def _post(self, route: str, msg: Msg) -> bytes:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        try:
            async with self._session.post(
                f"{self.base_url}/v1/ingest/{route}", data=msg.model_dump_json(), headers=headers
            ) as reply:
                body = await reply.read()
                status, retry = reply.status, reply.headers.get("Retry-After")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise IngestRefused(
                503, f"the orchestrator is unreachable from the ingest: {type(exc).__name__}", {"Retry-After": "5"}
            ) from None
        if status >= 400:
            try:
                detail = json.loads(body).get("detail", body.decode("utf-8", "replace"))
            except (ValueError, AttributeError):
                detail = body.decode("utf-8", "replace")[:1000]
            if status in (401, 403) and route != "begin":  # the ingest's own token, not the worker's fault
                log.error("the orchestrator refused this ingest's token on /v1/ingest/%s: %s", route, detail)
                status, detail = 503, "the ingest cannot reach the orchestrator with its token"
            raise IngestRefused(status, detail, {"Retry-After": retry} if retry else None)
        return body

    async def begin(self, msg: IngestBegin) -> IngestAdmission:
        return IngestAdmission.model_validate_json(await self._post("begin", msg))

    async def finish(self, msg: IngestFinish) -> bytes:
        return await self._post("finish", msg)

    async def abort(self, msg: IngestAbort) -> None:
        try:
            await self._post("abort", msg)
        except IngestRefused as exc:  # the reservation lapses by itself
            log.warning("abort of an upload not delivered: %s", exc)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def declare_routes(app: FastAPI, desk: UploadDesk, token: str | None, admin_token: str | None) -> None:
    """The routes `intellect ingest` processes call, with `token` (else the admin token) as their bearer."""
    accepted = [t.encode() for t in (token, admin_token) if t]

    def ingest_token(request: Request) -> None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HTTPException(
                401, "ingest route: send 'Authorization: Bearer <ingest token>'", headers={"WWW-Authenticate": "Bearer"}
            )
        if not accepted:
            raise HTTPException(403, "ingest routes are disabled: set ingest.token or orchestrator.admin_token")
        if not any(hmac.compare_digest(given.encode(), t) for t in accepted):
            raise HTTPException(403, "wrong ingest token")

    guarded: Any = [Depends(ingest_token)]
    extra = {"security": [{"IngestToken": []}]}
    errors = {401: {"description": "no ingest token"}, 403: {"description": "wrong ingest token"}}

    def reply(model: Any) -> Response:
        return Response(model.model_dump_json(), media_type="application/json")

    @app.post(
        "/v1/ingest/begin",
        response_model=IngestAdmission,
        dependencies=guarded,
        tags=["ingest"],
        responses=errors,
        openapi_extra=extra,
    )
    async def begin(body: IngestBegin) -> Response:
        """An ingest asks whether an upload may proceed (the worker's signature, the assignment, the batch id)."""
        return reply(desk.begin(body))

    @app.post(
        "/v1/ingest/finish",
        response_model=BatchRecord,
        dependencies=guarded,
        tags=["ingest"],
        responses={**errors, 404: {"description": "no reservation with this ticket: the worker uploads again"}},
        openapi_extra=extra,
    )
    async def finish(body: IngestFinish) -> Response:
        """The ingest stored the batch and checked its digest: announce it."""
        return reply(desk.finish(body))

    @app.post("/v1/ingest/abort", dependencies=guarded, tags=["ingest"], responses=errors, openapi_extra=extra)
    async def abort(body: IngestAbort) -> Response:
        """The upload failed: drop its reservation."""
        desk.abort(body)
        return Response(b'{"ok":true}', media_type="application/json")


Gate = LocalGate | RemoteGate
