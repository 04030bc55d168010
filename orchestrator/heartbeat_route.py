"""POST /v1/nodes/heartbeat as a plain ASGI handler in front of the FastAPI application.

Heartbeats are nine requests in ten at scale (every node, every `heartbeat_interval_s`), and FastAPI's routing,
dependency injection and exception middleware cost more CPU than the heartbeat itself. This handler answers a
well-formed heartbeat with the same checks, state changes and reply as the FastAPI route (whose declaration
stays, for the OpenAPI document). Anything it does not take on (a body that is not a valid HeartbeatRequest,
whose 422 FastAPI words) goes to the FastAPI application untouched, before any state has changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import HTTPException
from pydantic import ValidationError
from starlette.responses import JSONResponse

from bridge.protocol import HEADER_KEY, HEADER_NONCE, HEADER_SIGNATURE, HEADER_TIMESTAMP, HeartbeatRequest

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator

PATH = "/v1/nodes/heartbeat"
_HEADERS = tuple(name.lower().encode("latin-1") for name in (HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE,
                                                                  HEADER_SIGNATURE))
_JSON = (b"content-type", b"application/json")


def _is_json(content_type: bytes | None) -> bool:
    """The content types for which FastAPI parses a body as JSON (none given counts)."""
    if content_type is None:
        return True
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


def heartbeat_route(app: Callable, svc: Orchestrator, route: object) -> Callable:
    """ASGI app: heartbeats answered here, every other request passed on to `app`. `route` is the FastAPI route
    of the heartbeat, put in the scope as the router would (metrics label requests by its path)."""
    decode = json.JSONDecoder().decode

    async def error(exc: HTTPException, scope, receive, send) -> None:
        await JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)(scope, receive, send)

    async def serve(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            return await app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        headers = dict(reversed(scope["headers"]))  # a repeated header: the first counts, as in Starlette
        request = None
        if body and _is_json(headers.get(b"content-type")):
            try:
                request = HeartbeatRequest.model_validate(decode(body.decode("utf-8")))
            except (ValueError, ValidationError):  # FastAPI words the 422 (json.JSONDecodeError is a ValueError)
                request = None
        if request is None:
            replayed = False

            async def replay():
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            return await app(scope, replay, send)
        scope["route"] = route
        values = [headers.get(name) for name in _HEADERS]
        try:
            key = svc.auth.verify_raw(scope, body, *(v.decode("latin-1") if v is not None else None for v in values))
            svc.registry.check_known(key)
            live = svc.registry.heartbeat(key, dict(request.metrics))
            work = svc.scheduler.open_assignments(key, request.loaded_versions) if live.role == "worker" else []
        except HTTPException as exc:
            return await error(exc, scope, receive, send)
        reply = svc.heartbeat_reply(live.state, work)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(reply)).encode()), _JSON]})
        await send({"type": "http.response.body", "body": reply})

    return serve
