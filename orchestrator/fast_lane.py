"""The routes every node calls all the time, as a plain ASGI handler in front of the FastAPI application and
its middleware.

At scale nine requests in ten are heartbeats (every node, every `heartbeat_interval_s`) and most of the rest
are batch announcements, validation claims and verdicts. FastAPI's routing, dependency injection and exception
middleware cost more CPU than these requests' own work, so this handler answers them directly, with the same
checks, state changes and replies: both sides call the `NodeRoutes` of app.py, and the FastAPI routes stay
declared for the OpenAPI document. Anything it does not take on (a body over the size limit, one that is not
valid for its model, or a path parameter that does not match: the replies FastAPI and the middleware word) goes
to the FastAPI application untouched, before any state has changed. What the middleware does for the other
routes happens here inline: the body limit, the latency metric, holding a reply back until its commit is on
disk (durability.py), and a 500 for an unexpected error.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, PlainTextResponse

from bridge.protocol import (HEADER_KEY, HEADER_NONCE, HEADER_SIGNATURE, HEADER_TIMESTAMP, BatchAnnouncement,
                             ClaimRequest, HeartbeatRequest, Verdict)
from orchestrator.durability import tracking_commits

if TYPE_CHECKING:
    from orchestrator.app import NodeRoutes, Orchestrator

HEARTBEAT_PATH = "/v1/nodes/heartbeat"
_HEADERS = tuple(name.lower().encode("latin-1") for name in (HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE,
                                                                  HEADER_SIGNATURE))
_JSON = (b"content-type", b"application/json")
log = logging.getLogger("orchestrator")
_VERDICT = re.compile(r"/v1/batches/([A-Za-z0-9][A-Za-z0-9._-]{0,127})/verdict")


@dataclass(frozen=True)
class _Route:
    path: str  # the FastAPI route's path template (metrics label requests by it)
    model: type[BaseModel]
    role: str | None  # the role the signing node must have (None: any)
    empty_body: BaseModel | None  # the body a request without one stands for (None: a body is required)
    answer: Callable[..., bytes]  # (routes, key, node, body[, path parameter]) -> JSON reply


def _is_json(content_type: bytes | None) -> bool:
    """The content types for which FastAPI parses a body as JSON (none given counts)."""
    if content_type is None:
        return True
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


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


def fast_lane(app: Callable, svc: Orchestrator, routes: NodeRoutes, fastapi_routes: dict[str, object]) -> Callable:
    """ASGI app: the hot node routes answered here, every other request passed on to `app` (the FastAPI
    application with its middleware). `fastapi_routes` maps a path template to its FastAPI route, put in the
    scope as the router would."""
    decode = json.JSONDecoder().decode
    max_bytes = svc.max_body_bytes
    table = {
        HEARTBEAT_PATH: _Route(HEARTBEAT_PATH, HeartbeatRequest, None, None, routes.heartbeat),
        "/v1/batches": _Route("/v1/batches", BatchAnnouncement, "worker", None, routes.announce),
        "/v1/validation/claim": _Route("/v1/validation/claim", ClaimRequest, "validator", ClaimRequest(),
                                       routes.claim),
    }
    verdict = _Route("/v1/batches/{batch_id}/verdict", Verdict, "validator", None, routes.verdict)


    async def serve(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        path = scope["path"]
        route, extra = table.get(path), ()
        if route is None:
            match = _VERDICT.fullmatch(path)
            if match is None:
                return await app(scope, receive, send)
            route, extra = verdict, (match.group(1),)
        headers = dict(reversed(scope["headers"]))  # a repeated header: the first counts, as in Starlette
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > max_bytes:
            return await app(scope, receive, send)
        body = await read_body(receive, max_bytes)
        if body is None:
            return None
        request: Any = None
        if len(body) <= max_bytes:  # else the middleware answers 413
            if not body and route.empty_body is not None:
                request = route.empty_body
            elif body and _is_json(headers.get(b"content-type")):
                try:
                    request = route.model.model_validate(decode(body.decode("utf-8")))
                except (ValueError, ValidationError):  # FastAPI words the 422 (a JSONDecodeError is a ValueError)
                    request = None
        if request is None:
            return await app(scope, replaying(body, receive), send)
        scope["route"] = fastapi_routes[route.path]
        values = [headers.get(name) for name in _HEADERS]
        start, status, failure = time.perf_counter(), 200, None
        with tracking_commits() as committed:
            try:
                key = svc.auth.verify(scope, body, *(v.decode("latin-1") if v is not None else None for v in values))
                node = routes.node_in_role(key, route.role)
                reply = route.answer(key, node, request, *extra)
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
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-length", str(len(reply)).encode()), _JSON]})
                await send({"type": "http.response.body", "body": reply})
        finally:
            svc.metrics.observe("POST", route.path, status, time.perf_counter() - start)

    return serve
