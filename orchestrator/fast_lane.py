"""The routes every node calls all the time, declared once in `NODE_ROUTES`, checked and answered by one
`NodeLane`. The FastAPI application declares a route from each entry (app.py), for the OpenAPI document and for
whatever the lane hands on; the lane itself is reached two ways: from the HTTP protocol's parser callbacks,
which write its reply to the socket without an ASGI request (server.py, the usual way), and from `fast_lane`, a
plain ASGI handler in front of FastAPI and its middleware (requests the protocol does not take itself, and
servers other than ours).

At scale nine requests in ten are heartbeats (every node, every `heartbeat_interval_s`) and most of the rest
are batch announcements, validation claims and verdicts. FastAPI's routing, dependency injection and exception
middleware cost more CPU than these requests' own work, so the lane answers them directly, with the same
checks, state changes and replies: it calls the `NodeRoutes` of service.py, decodes with `guards.decode_json`
and matches paths with FastAPI's own compiled routes. Anything it does not take on (a body over the size limit,
one without a JSON Content-Type, one that is not strict JSON or not valid for its model, or a path parameter
that does not match: the replies FastAPI and the middleware word) goes to the FastAPI application untouched,
before any state has changed. What the middleware does for the other routes the lane does itself: the body
limit, the latency metric, holding a reply back until its commit is on disk (durability.py), and a 500 for an
unexpected error.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, PlainTextResponse, Response

from bridge.protocol.messages import (
    BATCH_ID_PATTERN,
    BatchAnnouncement,
    BatchRecord,
    ClaimRequest,
    ClaimResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    SessionRequest,
    SessionResponse,
    Verdict,
)
from bridge.protocol.signing import AUTH_HEADERS
from orchestrator.auth import request_target
from orchestrator.durability import tracking_commits
from orchestrator.guards import BodyError, decode_json, is_json_content_type

if TYPE_CHECKING:
    from orchestrator.service import NodeRoutes, Orchestrator

HEARTBEAT_PATH = "/v1/nodes/heartbeat"
_HEADERS = tuple(name.lower().encode("latin-1") for name in AUTH_HEADERS)
_JSON = (b"content-type", b"application/json")
log = logging.getLogger("orchestrator")
_PATH_PARAM = re.compile(BATCH_ID_PATTERN)  # the one path parameter of the table's routes is a batch id


@dataclass(frozen=True)
class NodeRoute:
    """A signed POST route of the nodes' hot path."""

    path: str  # the path template (metrics label requests by it)
    model: type[BaseModel]  # the request body
    reply: type[BaseModel]  # the response model (OpenAPI)
    role: str | None  # the role the signing node must have (None: any)
    answer: str  # the NodeRoutes method: (key, node, body[, path parameter]) -> JSON reply
    empty_body: BaseModel | None = None  # the body a request without one stands for (None: a body is required)
    responses: tuple[tuple[int, str], ...] = ()  # status codes beyond the common ones, for the OpenAPI document
    description: str = ""
    session_ok: bool = False  # a session key may authenticate it in place of a signature (auth.py)


NODE_ROUTES = (
    NodeRoute(
        HEARTBEAT_PATH,
        HeartbeatRequest,
        HeartbeatResponse,
        None,
        "heartbeat",
        description="A node's liveness; a worker's reply lists its open assignments (a new one when there is room). "
        "Signed, or authenticated with the node's session key (X-Session and X-Mac).",
        session_ok=True,
    ),
    NodeRoute(
        "/v1/nodes/session",
        SessionRequest,
        SessionResponse,
        None,
        "open_session",
        responses=((403, "unknown or banned node, or sessions are off"),),
        description="A session key for the node's heartbeats, sealed to the X25519 `box_key` (a new session ends the "
        "node's previous one). Heartbeats may then carry X-Session and X-Mac in place of X-Signature.",
    ),
    NodeRoute(
        "/v1/batches",
        BatchAnnouncement,
        BatchRecord,
        "worker",
        "announce",
        responses=((409, "conflict"), (429, "rate limited")),
        description="A worker announces the batch it committed for one of its assignments.",
    ),
    NodeRoute(
        "/v1/validation/claim",
        ClaimRequest,
        ClaimResponse,
        "validator",
        "claim",
        empty_body=ClaimRequest(),
        description="A validator takes the oldest batch awaiting a verdict (or the one it holds) on a lease.",
    ),
    NodeRoute(
        "/v1/batches/{batch_id}/verdict",
        Verdict,
        BatchRecord,
        "validator",
        "verdict",
        responses=((404, "no such batch"), (409, "not your claim")),
        description="A validator's judgement of a batch it claimed.",
    ),
)

SESSION_ROUTES = tuple(spec.path for spec in NODE_ROUTES if spec.session_ok)


async def read_body(receive: Callable, max_bytes: int) -> bytes | None:
    """A request's body from ASGI `receive`; None if the client went away. Reading stops once it is longer
    than `max_bytes` (the caller refuses it)."""
    chunks, size, more = [], 0, True
    while more and size <= max_bytes:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
    return b"".join(chunks)


def replaying(body: bytes, receive: Callable) -> Callable:
    """An ASGI `receive` that gives `body` once (already read), then whatever `receive` gives."""
    replayed = False

    async def replay():
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


@dataclass(frozen=True)
class Found:
    """A request's entry of NODE_ROUTES, its NodeRoutes method, its FastAPI route and its path parameters."""

    spec: NodeRoute
    answer: Callable
    route: Any
    params: tuple


@dataclass(frozen=True)
class Reply:
    """A whole answer: status, headers (Content-Length and Content-Type among them) and body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def _reply(response: Response) -> Reply:
    return Reply(response.status_code, response.raw_headers, response.body)


INTERNAL_ERROR = _reply(PlainTextResponse("Internal Server Error", 500))


class NodeLane:
    """The checks and answers of NODE_ROUTES, without a transport: `match` a path, `accepts` the head, `decode`
    the body, `answer` it. Both lanes call it: the ASGI one (`fast_lane`) and the one in the HTTP protocol
    (server.py), which answers these routes without building an ASGI request at all. A request it does not
    take (None from `match`, False from `accepts`, None from `decode`) goes to FastAPI before any state has
    changed. `fastapi_routes` maps a path template to its FastAPI route: its compiled pattern matches a path here
    as in FastAPI's router."""

    def __init__(self, svc: Orchestrator, routes: NodeRoutes, fastapi_routes: dict[str, Any]):
        self.svc, self.routes = svc, routes
        self.max_bytes = svc.max_body_bytes
        self._fixed: dict[str, Found] = {}
        self._templated: list[Found] = []
        for spec in NODE_ROUTES:
            found = Found(spec, getattr(routes, spec.answer), fastapi_routes[spec.path], ())
            if found.route.param_convertors:
                self._templated.append(found)
            else:
                self._fixed[spec.path] = found

    def match(self, path: str) -> Found | None:
        found = self._fixed.get(path)
        if found is not None:
            return found
        for entry in self._templated:
            matched = entry.route.path_regex.match(path)
            if matched is not None:
                params = tuple(matched.groupdict().values())
                if all(_PATH_PARAM.fullmatch(p) for p in params):  # else FastAPI answers 422
                    return Found(entry.spec, entry.answer, entry.route, params)
                return None
        return None

    def accepts(self, headers: dict[bytes, bytes]) -> bool:
        """Whether the head announces a body this lane reads: a Content-Length (no chunked body) within the
        body limit (else the middleware answers 413)."""
        length = headers.get(b"content-length", b"0")
        return b"transfer-encoding" not in headers and length.isdigit() and int(length) <= self.max_bytes

    def decode(self, found: Found, headers: dict[bytes, bytes], body: bytes) -> BaseModel | None:
        """The request body as the route's model; None where FastAPI and the middleware word the answer (a body
        over the limit: 413; no body where one is required, a Content-Type that is not JSON, a body that is
        not strict JSON or not valid for the model: 422)."""
        if len(body) > self.max_bytes:
            return None
        if not body:
            return found.spec.empty_body
        if not is_json_content_type(headers.get(b"content-type")):  # FastAPI's 422, as without a body
            return None
        try:
            return found.spec.model.model_validate(decode_json(body))
        except (BodyError, ValidationError):
            return None

    def answer(
        self, found: Found, request: BaseModel, method: str, target: bytes, headers: dict[bytes, bytes], body: bytes
    ) -> tuple[Reply, bool]:
        """Verify the signature over `method` and `target` (the path and query as sent), check the node's role,
        and run the route: the reply, and whether anything was committed (the reply then waits for the commit
        to be durable, durability.py)."""
        values = [headers.get(name) for name in _HEADERS]
        with tracking_commits() as committed:
            try:
                key = self.svc.auth.verify(
                    method,
                    target,
                    body,
                    *(v.decode("latin-1") if v is not None else None for v in values),
                    session_ok=found.spec.session_ok,
                )
                node = self.routes.node_in_role(key, found.spec.role)
                payload = found.answer(key, node, request, *found.params)
                reply = Reply(200, [(b"content-length", str(len(payload)).encode()), _JSON], payload)
            except HTTPException as exc:
                reply = _reply(JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers))
            except Exception:  # as Starlette's ServerErrorMiddleware: logged, 500, the service stays up
                log.exception("%s %s failed", method, target[:200].decode("latin-1"))
                reply = INTERNAL_ERROR
        return reply, committed[0]

    def observe(self, found: Found, status: int, seconds: float) -> None:
        self.svc.metrics.observe("POST", found.spec.path, status, seconds)


def fast_lane(app: Callable, lane: NodeLane) -> Callable:
    """ASGI app: the routes of NODE_ROUTES answered by `lane`, every other request passed on to `app` (the
    FastAPI application with its middleware). What the middleware does for the other routes happens here
    inline: the body limit, the latency metric, holding a reply back until its commit is on disk
    (durability.py), and a 500 for an unexpected error."""
    svc = lane.svc

    async def serve(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        found = lane.match(scope["path"])
        if found is None:
            return await app(scope, receive, send)
        headers = dict(reversed(scope["headers"]))  # a repeated header: the first counts, as in Starlette
        if not lane.accepts(headers):
            return await app(scope, receive, send)
        body = await read_body(receive, lane.max_bytes)
        if body is None:
            return None
        request = lane.decode(found, headers, body)
        if request is None:
            return await app(scope, replaying(body, receive), send)
        scope["route"] = found.route
        start = time.perf_counter()
        reply, committed = lane.answer(found, request, scope["method"], request_target(scope), headers, body)
        try:
            if committed and svc.wal is not None:
                try:
                    await svc.wal.wait()
                except Exception:  # as in the direct lane (server.py): whatever failed the fsync, a 500
                    log.exception("%s %s: the commit could not be made durable", scope["method"], scope["path"])
                    reply = INTERNAL_ERROR
            await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})
            await send({"type": "http.response.body", "body": reply.body})
        finally:
            lane.observe(found, reply.status, time.perf_counter() - start)

    return serve
