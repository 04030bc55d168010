"""The orchestrator service's routes: `create_app(cfg, run)` is the FastAPI application (docs/design.md section 8).

Handlers are coroutines that call the database synchronously, so each request's reads and writes run without
interleaving with another's: the scheduler's decisions (pacing, claims, k counters) and its in-memory caches
need no locks. The price is that a slow query holds the event loop: with SQLite a transaction takes tens of
microseconds, because the fsync that makes it durable runs in a thread before the reply leaves
(`durability.py`). CPU-heavy work (checking a compute challenge) runs in a thread too. Run one process per
database.

Every clock reading goes through the injected `clock` (unix seconds), so tests drive liveness, leases and
signature windows with a fake one.
"""

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from bridge.protocol.challenge import solve_challenge
from bridge.protocol.messages import (
    BATCH_ID_PATTERN,
    MAX_INT,
    PROTOCOL_VERSION,
    BanRequest,
    BatchList,
    BatchRecord,
    BatchStatus,
    Health,
    Ledger,
    NodeInfo,
    NodeList,
    PolicyAnnouncement,
    PolicyInfo,
    PublicBatchList,
    RegisterRequest,
    RegisterResponse,
)
from bridge.protocol.signing import AUTH_HEADERS
from bridge.upload import UPLOAD_PREFIX
from orchestrator import dashboard
from orchestrator.auth import request_target
from orchestrator.config import IngestConfig, OrchestratorConfig
from orchestrator.db import SCHEMA_VERSION
from orchestrator.fast_lane import NODE_ROUTES, SESSION_ROUTES, NodeLane, NodeRoute, fast_lane, read_body, replaying
from orchestrator.guards import (
    BodyError,
    address_group,
    decode_json,
    is_json_content_type,
    json_error,
    validation_errors,
)
from orchestrator.ingest import UploadIngest
from orchestrator.ledger import build_ledger, ledger_csv
from orchestrator.nodes import LiveNode
from orchestrator.service import NodeRoutes, Orchestrator, RunValues
from orchestrator.uploads import LocalGate, UploadDesk
from orchestrator.uploads import declare_routes as declare_ingest_routes

log = logging.getLogger("orchestrator")
UPLOAD_ROUTE = "/v1/uploads/{assignment_id}/{batch_id}"


def _json(reply: bytes) -> Response:
    return Response(reply, media_type="application/json")


def _limit_body(app: Callable, max_bytes: int) -> Callable:
    """ASGI middleware: a request body over `max_bytes` is answered 413, and a POST body with a JSON Content-Type
    that is not strict JSON (guards.decode_json) 422, before any handler sees it."""

    async def refuse(
        send,
        status: int = 413,
        detail: str | list = f"request body over the limit of {max_bytes} bytes (orchestrator.max_body_bytes)",
    ) -> None:
        body = json.dumps({"detail": detail}, separators=(",", ":")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def guarded(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit():
            return await refuse(send, 400, "Content-Length is not a number")
        if int(length) > max_bytes:
            return await refuse(send)
        body = await read_body(receive, max_bytes)
        if body is None:
            return None
        if len(body) > max_bytes:
            return await refuse(send)
        if (
            body
            and scope["method"] == "POST"
            and is_json_content_type(dict(reversed(scope["headers"])).get(b"content-type"))
        ):
            try:
                decode_json(body)
            except BodyError as exc:
                return await refuse(send, 422, json_error(str(exc)))
        return await app(scope, replaying(body, receive), send)

    return guarded


_ERRORS = {
    401: {"description": "signature missing, malformed, stale, replayed or wrong"},
    403: {"description": "unknown, banned, not admitted, or wrong role"},
    413: {"description": "body over orchestrator.max_body_bytes"},
    422: {"description": "a field failed validation; `detail` names it"},
}

# Security schemes of the OpenAPI document; the checks themselves are in auth.py.
_SCHEMES = {
    scheme: (header, description)
    for header, (scheme, description) in zip(
        AUTH_HEADERS,
        (
            ("NodeKey", "hex ed25519 public key of the node"),
            ("Timestamp", "unix milliseconds; at most orchestrator.max_clock_skew_s off the service's clock"),
            ("Nonce", "16-64 random lowercase hex characters, used once"),
            ("Signature", "hex ed25519 signature of METHOD\\nPATH?QUERY\\nTIMESTAMP\\nNONCE\\nsha256hex(body)"),
            ("Session", "the id of the node's session (POST /v1/nodes/session)"),
            ("Mac", "hex HMAC-SHA256 under the session key of the string a signature covers"),
        ),
        strict=True,
    )
}
_SIGNED = {name: [] for name in ("NodeKey", "Timestamp", "Nonce", "Signature")}
_SIGNED_ROUTE = {"security": [_SIGNED]}
_SESSION_ROUTE = {"security": [_SIGNED, {name: [] for name in ("NodeKey", "Timestamp", "Nonce", "Session", "Mac")}]}
_ADMIN_ROUTE = {"security": [{"AdminToken": []}]}
_LEARNER_OPTIONAL = {"security": [{}, {"AdminToken": []}]}


def _reply(model: BaseModel) -> Response:
    """A reply serialized once (FastAPI would validate a returned model against response_model again)."""
    return Response(model.model_dump_json(), media_type="application/json")


def create_app(
    cfg: OrchestratorConfig,
    run: RunValues,
    clock: Callable[[], float] = time.time,
    ingest: IngestConfig | None = None,
) -> FastAPI:
    """The service of config section `cfg` and the run's values `run` (storage: `run.database_url`); with
    `ingest` (its section) it takes uploads itself when `ingest.in_process` and `run.rollout_store` is set, and
    answers the routes of `intellect ingest` processes."""
    ingest = ingest or IngestConfig(in_process=False)
    svc = Orchestrator(cfg, run, clock)
    node_routes = NodeRoutes(svc, SESSION_ROUTES, uploads_only=not cfg.worker_store_writes)
    desk = UploadDesk(svc, node_routes, run.max_tokens, run.max_prompt_len + run.max_tokens)
    svc.scheduler.set_upload_urls(ingest.urls)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async def sweeper() -> None:
            while True:
                await asyncio.sleep(svc.sweep_interval_s)
                try:
                    svc.sweep()
                except Exception:  # a failed sweep is retried at the next tick; the service stays up
                    log.exception("sweep failed")

        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()
            if app.uploads is not None:
                await app.uploads.gate.close()
            if svc.wal is not None:
                await svc.wal.close()
            svc.close()

    app = _Service(
        title="intellect orchestrator",
        version=str(PROTOCOL_VERSION),
        lifespan=lifespan,
        description="Admission, heartbeats, deterministic work, verdicts and the contribution ledger of a "
        "decentralized RL run (docs/design.md section 8). Node routes are signed with ed25519.",
    )
    app.state.orchestrator = svc
    if ingest.in_process and run.rollout_store is not None:
        from bridge.rollouts import RolloutStore

        store = RolloutStore.open(run.rollout_store, compression=ingest.compression)
        app.uploads = UploadIngest(store, LocalGate(desk), ingest)
        log.info("taking uploads into %s", store.url)
    declare_ingest_routes(app, desk, ingest.token, cfg.admin_token)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 without the input it would repeat (guards.py)."""
        return JSONResponse({"detail": validation_errors(exc.errors())}, 422)

    async def signed(request: Request, session_ok: bool = False) -> str:
        h = request.headers
        return svc.auth.verify(
            request.method,
            request_target(request.scope),
            await request.body(),
            *(h.get(name) for name in AUTH_HEADERS),
            session_ok=session_ok,
        )

    async def new_node(request: Request) -> str:
        key = await signed(request)
        svc.registry.check_known(key, allow_unknown=True)
        return key

    def role(required: str | None, session_ok: bool = False) -> Callable:
        async def known(request: Request) -> tuple[str, LiveNode]:
            key = await signed(request, session_ok)
            return key, node_routes.node_in_role(key, required)

        return known

    def admin(request: Request) -> None:
        svc.auth.require_admin(request)

    def maybe_learner(request: Request) -> bool:
        return svc.auth.is_admin(request)

    @app.get("/healthz", response_model=Health, tags=["public"])
    async def healthz() -> Health:
        return Health(
            status="ok", protocol=PROTOCOL_VERSION, schema_version=SCHEMA_VERSION, uptime_s=svc.clock() - svc.started
        )

    @app.get("/v1/policy", response_model=PolicyInfo, tags=["public"])
    async def get_policy() -> PolicyInfo:
        return svc.scheduler.policy

    def registration_rate(request: Request) -> None:
        client = request.scope.get("client")
        svc.register_limiter.take(address_group(client[0]) if client else "")

    @app.post(
        "/v1/nodes/register",
        response_model=RegisterResponse,
        dependencies=[Depends(registration_rate)],
        responses={**_ERRORS, 429: {"description": "too many registrations from this address"}},
        tags=["nodes"],
        openapi_extra=_SIGNED_ROUTE,
    )
    async def register(body: RegisterRequest, key: Annotated[str, Depends(new_node)]) -> Response:
        """Admission. Limited per client address (orchestrator.register_rate_per_min, checked before the
        signature); an answered challenge is checked in a thread."""
        solved = None
        seed = svc.registry.pending_challenge(key) if body.challenge_answer is not None else None
        if seed is not None:
            solved = (seed, await asyncio.to_thread(solve_challenge, seed, svc.requirements.challenge_size))
        status, reasons, challenge = svc.registry.register(key, body.role, body.hardware, body.challenge_answer, solved)
        if status == "refused":
            log.info("registration of %s... refused: %s", key[:16], "; ".join(reasons))
        return _reply(
            RegisterResponse(
                status=status,
                node_key=key,
                reasons=reasons,
                requirements=svc.requirements,
                challenge=challenge,
                policy=svc.scheduler.policy,
            )
        )

    for spec in NODE_ROUTES:  # also served by the fast lane (fast_lane.py), from the same table
        _declare(app, spec, getattr(node_routes, spec.answer), role(spec.role, spec.session_ok))

    @app.post(
        "/v1/nodes/deregister", response_model=NodeInfo, responses=_ERRORS, tags=["nodes"], openapi_extra=_SIGNED_ROUTE
    )
    async def deregister(node: Annotated[tuple, Depends(role(None))]) -> Response:
        """A node signs off: it is marked dead now and its open assignments are handed out again."""
        svc.registry.leave(node[0])
        svc.auth.sessions.end(node[0])
        with svc.db() as s:
            return _reply(svc.registry.info(s, [node[0]])[0])

    @app.put(
        "/v1/uploads/{assignment_id}/{batch_id}",
        response_model=BatchRecord,
        responses={
            **_ERRORS,
            404: {"description": "not this node's assignment, or this service takes no uploads (see ingest.urls)"},
            408: {"description": "the upload took longer than ingest.upload_timeout_s"},
            409: {"description": "the assignment has a batch, or the batch id is taken"},
            410: {"description": "the assignment was lost or expired"},
            411: {"description": "no Content-Length"},
            413: {"description": "larger than the assignment's batch may be"},
            429: {"description": "an upload of the assignment in progress, or too many from this address or node"},
        },
        tags=["work"],
        openapi_extra={
            **_SIGNED_ROUTE,
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            },
        },
    )
    async def upload(
        assignment_id: Annotated[int, PathParam(ge=0, le=MAX_INT)],
        batch_id: Annotated[str, PathParam(pattern=BATCH_ID_PATTERN)],
    ) -> Response:
        """Upload a batch: the body is its upload stream (bridge/upload.py), `X-Batch-Sha256` its COMMIT digest,
        signed in place of the body's hash. Answered by the ingest (orchestrator/ingest.py) where this service
        takes uploads; here only when it does not."""
        return JSONResponse(
            {"detail": "this service takes no uploads: send them to one of the policy's upload URLs"}, 404
        )

    @app.get(
        "/v1/batches",
        response_model=BatchList | PublicBatchList,
        responses=_ERRORS,
        tags=["work"],
        openapi_extra=_LEARNER_OPTIONAL,
    )
    async def list_batches(
        learner: Annotated[bool, Depends(maybe_learner)],
        status: BatchStatus = "accepted",
        min_version: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
        after: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> Response:
        """Batches by status. With the admin token (the learner) every field (BatchList), and accepted batches
        count as delivered; without it only the public fields (PublicBatchList: no store path, digest,
        validator, rewards or reasons)."""
        records, cursor = svc.scheduler.batches(status, min_version, after, limit, learner)
        return _json(
            json.dumps({"batches": records, "next_after": cursor}, separators=(",", ":"), allow_nan=False).encode()
        )

    @app.post(
        "/v1/policy",
        response_model=PolicyInfo,
        responses={**_ERRORS, 409: {"description": "older version"}},
        dependencies=[Depends(admin)],
        tags=["admin"],
        openapi_extra=_ADMIN_ROUTE,
    )
    async def announce_policy(body: PolicyAnnouncement) -> Response:
        return _reply(svc.scheduler.announce_policy(body))

    @app.get(
        "/v1/nodes",
        response_model=NodeList,
        responses=_ERRORS,
        dependencies=[Depends(admin)],
        tags=["admin"],
        openapi_extra=_ADMIN_ROUTE,
    )
    async def list_nodes(
        after: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$")] = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> Response:
        """A page of nodes in key order; `next_after` names the next page's `after`."""
        with svc.db() as s:
            nodes = svc.registry.info(s, after=after, limit=limit)
        return _reply(NodeList(nodes=nodes, next_after=nodes[-1].key if len(nodes) == limit else None))

    @app.post(
        "/v1/nodes/{node_key}/ban",
        response_model=NodeInfo,
        responses={**_ERRORS, 404: {"description": "unknown node"}},
        dependencies=[Depends(admin)],
        tags=["admin"],
        openapi_extra=_ADMIN_ROUTE,
    )
    async def ban(node_key: Annotated[str, PathParam(pattern=r"^[0-9a-f]{64}$")], body: BanRequest) -> Response:
        svc.registry.ban(node_key, body.reason)
        log.warning("node %s... banned by an operator: %s", node_key[:16], body.reason)
        with svc.db() as s:
            return _reply(svc.registry.info(s, [node_key])[0])

    @app.get(
        "/v1/ledger",
        response_model=Ledger,
        tags=["public"],
        responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}},
    )
    async def ledger(
        format: Literal["json", "csv"] = "json",
        after: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$")] = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> Response:
        """A page of the ledger in node-key order (`next_after`, or the X-Next-After header of the CSV, names
        the next page's `after`). Answers are reused for orchestrator.public_cache_s."""

        def render() -> Response:
            with svc.db() as s:
                data = build_ledger(s, svc.registry, svc.clock(), after, limit)
            headers = {"X-Next-After": data.next_after} if data.next_after else {}
            if format == "csv":
                return PlainTextResponse(ledger_csv(data), media_type="text/csv", headers=headers)
            return Response(data.model_dump_json(), media_type="application/json", headers=headers)

        return svc.pages.get(("ledger", format, after, limit), render)

    @app.get("/metrics", response_class=PlainTextResponse, tags=["public"])
    async def metrics() -> Response:
        return Response(svc.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse, tags=["public"])
    async def index(after: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$")] = None) -> Response:
        """The dashboard: totals, and one page (orchestrator.page_size) of the nodes and the ledger, in key
        order, after the key `after`. Reused for orchestrator.public_cache_s."""

        def render() -> Response:
            with svc.db() as s:
                nodes = svc.registry.info(s, after=after, limit=svc.page_size)
                data = build_ledger(s, svc.registry, svc.clock(), after, svc.page_size)
            more = nodes[-1].key if len(nodes) == svc.page_size else None
            return HTMLResponse(dashboard.render(svc, svc.scheduler.policy, nodes, data, after, more))

        return svc.pages.get(("dashboard", after), render)

    app.openapi = functools.partial(_openapi, app)
    by_path = {getattr(r, "path", None): r for r in app.routes if "POST" in getattr(r, "methods", ())}
    app.node_lane = NodeLane(svc, node_routes, by_path)  # server.py answers these routes from it directly
    app.fast_lane = fast_lane(functools.partial(FastAPI.__call__, app), app.node_lane)
    if svc.wal is not None:
        app.add_middleware(_Middleware, wrap=svc.wal.middleware)
    app.add_middleware(_Middleware, wrap=svc.metrics.middleware)
    app.add_middleware(_Middleware, wrap=lambda inner: _limit_body(inner, svc.max_body_bytes))
    return app


def _declare(app: FastAPI, spec: NodeRoute, answer: Callable[..., bytes], node: Callable) -> None:
    """The FastAPI route of a NODE_ROUTES entry: its body model, the signed-node dependency `node` and a
    BATCH_ID_PATTERN check of each path parameter, answered by the NodeRoutes method `answer`."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("node", keyword, annotation=Annotated[tuple, Depends(node)]),
        inspect.Parameter(
            "body",
            keyword,
            annotation=Annotated[spec.model, Body()],
            default=inspect.Parameter.empty if spec.empty_body is None else spec.empty_body,
        ),
    ]
    params += [
        inspect.Parameter(name, keyword, annotation=Annotated[str, PathParam(pattern=BATCH_ID_PATTERN)])
        for name in re.findall(r"{(\w+)}", spec.path)
    ]

    async def endpoint(**values) -> Response:
        key, live = values.pop("node")
        body = values.pop("body")
        return _json(answer(key, live, body, *values.values()))

    endpoint.__signature__ = inspect.Signature(params)
    endpoint.__name__ = spec.answer
    app.add_api_route(
        spec.path,
        endpoint,
        methods=["POST"],
        response_model=spec.reply,
        description=spec.description,
        responses={**_ERRORS, **{code: {"description": text} for code, text in spec.responses}},
        tags=["nodes" if spec.role is None else "work"],
        openapi_extra=_SESSION_ROUTE if spec.session_ok else _SIGNED_ROUTE,
    )


def _openapi(app: FastAPI) -> dict:
    """The generated document plus the security schemes the routes name (signature headers, admin token)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemes = {
            name: {"type": "apiKey", "in": "header", "name": header, "description": text}
            for name, (header, text) in _SCHEMES.items()
        }
        schemes["AdminToken"] = {"type": "http", "scheme": "bearer", "description": "orchestrator.admin_token"}
        schema.setdefault("components", {})["securitySchemes"] = schemes
        app.openapi_schema = schema
    return app.openapi_schema


class _Service(FastAPI):
    """The FastAPI application with the fast lane (fast_lane.py) in front of its middleware stack, and the
    ingest (ingest.py) in front of both for uploads, which stream their bodies past the body limit."""

    fast_lane: Callable | None = None
    node_lane: NodeLane | None = None
    uploads: UploadIngest | None = None

    async def __call__(self, scope, receive, send):
        if self.uploads is not None and scope["type"] == "http" and scope["path"].startswith(UPLOAD_PREFIX):
            start = time.perf_counter()
            status = [500]

            async def observed(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            await self.uploads(scope, receive, observed)
            self.state.orchestrator.metrics.observe("PUT", UPLOAD_ROUTE, status[0], time.perf_counter() - start)
            return None
        if self.fast_lane is None:
            return await super().__call__(scope, receive, send)
        await self.fast_lane(scope, receive, send)


class _Middleware:
    """Adapts a function `wrap(asgi_app) -> asgi_app` to Starlette's `add_middleware`."""

    def __init__(self, app: Callable, wrap: Callable[[Callable], Callable]):
        self.app = wrap(app)

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
