"""The routes every node calls all the time, declared once in `NODE_ROUTES` and served by two lanes: the FastAPI
application (app.py declares a route from each entry, for the OpenAPI document and for whatever the fast lane
hands on) and a plain ASGI handler in front of FastAPI and its middleware (this module).

At scale nine requests in ten are heartbeats (every node, every `heartbeat_interval_s`) and most of the rest
are batch announcements, validation claims and verdicts. FastAPI's routing, dependency injection and exception
middleware cost more CPU than these requests' own work, so the fast lane answers them directly, with the same
checks, state changes and replies: both lanes call the `NodeRoutes` of service.py, decode with
`guards.decode_json` and match paths with FastAPI's own compiled routes. Anything it does not take on (a body
over the size limit, one without a JSON Content-Type, one that is not strict JSON or not valid for its model,
or a path parameter that does not match: the replies FastAPI and the middleware word) goes to the FastAPI
application untouched, before any state has changed. What the middleware does for the other routes happens
here inline: the body limit, the latency metric, holding a reply back until its commit is on disk
(durability.py), and a 500 for an unexpected error.
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
from starlette.responses import JSONResponse, PlainTextResponse

from bridge.protocol.messages import (
    BATCH_ID_PATTERN,
    BatchAnnouncement,
    BatchRecord,
    ClaimRequest,
    ClaimResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    Verdict,
)
from bridge.protocol.signing import HEADER_KEY, HEADER_NONCE, HEADER_SIGNATURE, HEADER_TIMESTAMP
from orchestrator.durability import tracking_commits
from orchestrator.guards import BodyError, decode_json, is_json_content_type

if TYPE_CHECKING:
    from orchestrator.service import NodeRoutes, Orchestrator

HEARTBEAT_PATH = "/v1/nodes/heartbeat"
_HEADERS = tuple(
    name.lower().encode("latin-1") for name in (HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE)
)
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


NODE_ROUTES = (
    NodeRoute(
        HEARTBEAT_PATH,
        HeartbeatRequest,
        HeartbeatResponse,
        None,
        "heartbeat",
        description="A node's liveness; a worker's reply lists its open assignments (a new one when there is room).",
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


def fast_lane(app: Callable, svc: Orchestrator, routes: NodeRoutes, fastapi_routes: dict[str, Any]) -> Callable:
    """ASGI app: the routes of NODE_ROUTES answered here, every other request passed on to `app` (the FastAPI
    application with its middleware). `fastapi_routes` maps a path template to its FastAPI route: its compiled
    pattern matches a path here as in FastAPI's router, and it is put in the scope as the router would."""
    max_bytes = svc.max_body_bytes
    fixed: dict[str, tuple[NodeRoute, Callable, Any]] = {}  # path -> (entry, NodeRoutes method, FastAPI route)
    templated: list[tuple[NodeRoute, Callable, Any]] = []
    for spec in NODE_ROUTES:
        entry = (spec, getattr(routes, spec.answer), fastapi_routes[spec.path])
        if entry[2].param_convertors:
            templated.append(entry)
        else:
            fixed[spec.path] = entry

    def match(path: str) -> tuple[NodeRoute, Callable, Any, tuple] | None:
        found = fixed.get(path)
        if found is not None:
            return (*found, ())
        for spec, answer, route in templated:
            matched = route.path_regex.match(path)
            if matched is not None:
                params = tuple(matched.groupdict().values())
                if all(_PATH_PARAM.fullmatch(p) for p in params):  # else FastAPI answers 422
                    return spec, answer, route, params
                return None
        return None

    async def serve(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        found = match(scope["path"])
        if found is None:
            return await app(scope, receive, send)
        spec, answer, fastapi_route, extra = found
        headers = dict(reversed(scope["headers"]))  # a repeated header: the first counts, as in Starlette
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > max_bytes:
            return await app(scope, receive, send)
        body = await read_body(receive, max_bytes)
        if body is None:
            return None
        request: Any = None
        if len(body) <= max_bytes:  # else the middleware answers 413
            if not body:
                request = spec.empty_body  # None: FastAPI words the 422 of a missing body
            elif is_json_content_type(headers.get(b"content-type")):  # else FastAPI's 422, as without a body
                try:
                    request = spec.model.model_validate(decode_json(body))
                except (BodyError, ValidationError):  # the middleware and FastAPI word the 422
                    request = None
        if request is None:
            return await app(scope, replaying(body, receive), send)
        scope["route"] = fastapi_route
        values = [headers.get(name) for name in _HEADERS]
        start, status, failure = time.perf_counter(), 200, None
        with tracking_commits() as committed:
            try:
                key = svc.auth.verify(scope, body, *(v.decode("latin-1") if v is not None else None for v in values))
                node = routes.node_in_role(key, spec.role)
                reply = answer(key, node, request, *extra)
            except HTTPException as exc:
                status = exc.status_code
                failure = JSONResponse({"detail": exc.detail}, status, headers=exc.headers)
            except Exception:  # as Starlette's ServerErrorMiddleware: logged, 500, the service stays up
                log.exception("%s %s failed", scope["method"], scope["path"])
                status, failure = 500, PlainTextResponse("Internal Server Error", 500)
        try:
            if committed[0] and svc.wal is not None:
                await svc.wal.wait()
            if failure is not None:
                await failure(scope, receive, send)
            else:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-length", str(len(reply)).encode()), _JSON],
                    }
                )
                await send({"type": "http.response.body", "body": reply})
        finally:
            svc.metrics.observe("POST", spec.path, status, time.perf_counter() - start)

    return serve
