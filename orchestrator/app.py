"""The orchestrator service: `create_app(cfg)` is the FastAPI application (docs/design.md section 8).

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
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Body, Depends, FastAPI, HTTPException, Path as PathParam, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter
from sqlalchemy.orm import sessionmaker

from bridge.protocol import (BATCH_ID_PATTERN, HEADER_KEY, HEADER_NONCE, HEADER_SIGNATURE, HEADER_TIMESTAMP, MAX_INT,
                             PROTOCOL_VERSION, Assignment, BanRequest, BatchAnnouncement, BatchList, BatchStatus,
                             ClaimRequest, ClaimResponse, Health, HeartbeatRequest, Ledger, NodeInfo, NodeList,
                             PolicyAnnouncement, PolicyInfo, PoolRequirements, PublicBatchList, RegisterRequest,
                             RegisterResponse, Verdict, solve_challenge)
from intellect.config import Config
from orchestrator import dashboard
from orchestrator.auth import Authenticator, RateLimiter, start_run, stop_run
from orchestrator.db import SCHEMA_VERSION, open_database, sqlite_url
from orchestrator.durability import WalSync
from orchestrator.fast_lane import NODE_ROUTES, NodeRoute, fast_lane, read_body, replaying
from orchestrator.guards import (BodyError, address_group, decode_json, is_json_content_type, json_error,
                                 validation_errors)
from orchestrator.ledger import build_ledger, ledger_csv
from orchestrator.metrics import Metrics
from orchestrator.nodes import LiveNode, NodeRegistry
from orchestrator.scheduler import WorkScheduler

log = logging.getLogger("orchestrator")


_ASSIGNMENTS = TypeAdapter(list[Assignment])


class Orchestrator:
    """Everything one service instance holds: storage, the node registry, the work scheduler, auth, metrics."""

    def __init__(self, cfg: Config, clock: Callable[[], float] = time.time, database_url: str | None = None):
        oc = cfg.orchestrator
        self.clock = clock
        self.run_name = cfg.run.name
        if database_url is None and oc.database_url is None:
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        # SQLite: checkpoints of the WAL run in WalSync's thread, not inside a request's commit
        self.engine = open_database(database_url or oc.database_url or sqlite_url(cfg.run.db_path),
                                    autocheckpoint=False)
        self.db = sessionmaker(self.engine, expire_on_commit=False)
        self.wal = WalSync(self.engine.url.database, self.engine) if self.engine.dialect.name == "sqlite" else None
        self.requirements = PoolRequirements(min_gpus=oc.min_gpus, min_gpu_memory_gib=oc.min_gpu_memory_gib,
                                             allow_cpu_nodes=oc.allow_cpu_nodes, challenge_size=oc.challenge_side(),
                                             heartbeat_interval_s=oc.heartbeat_interval_s)
        self.registry = NodeRegistry(self.db, self.requirements, oc.unhealthy_after_s, oc.dead_after_s,
                                     oc.challenge_timeout_s, clock, validator_keys=oc.validator_keys)
        if oc.validator_keys is None:
            log.warning("orchestrator.validator_keys is not set: any key may register as a validator (trusted "
                        "pools only; list the validators' public keys in an open pool)")
        relays = cfg.shardcast.relays or [f"http://{cfg.shardcast.host}:{cfg.shardcast.port}"]
        self.scheduler = WorkScheduler(
            self.db, self.registry, async_level=cfg.trainer.async_level, prompts_per_step=cfg.data.prompts_per_step,
            prompts_per_assignment=oc.prompts_per_assignment, samples_per_prompt=cfg.data.samples_per_prompt,
            max_inflight_per_node=oc.max_inflight_per_node, num_tasks=oc.num_tasks, claim_lease_s=oc.claim_lease_s,
            ban_after_rejections=oc.ban_after_rejections, rejection_window_s=oc.rejection_window_s,
            default_relays=relays, clock=clock, deadline_s=oc.deadline_s(cfg.worker.max_tokens or cfg.data.max_new_tokens),
            unproven_share=oc.unproven_share)
        self.auth = Authenticator(oc.max_clock_skew_s, oc.admin_token, clock)
        self.run_id, self.auth.refuse_up_to = start_run(self.db, self.auth.nonces, clock(), oc.max_clock_skew_s)
        if self.wal is not None:  # the start is on disk before any request: a crash from now on is seen as one
            self.wal._fsync()
        if self.auth.refuse_up_to:
            log.warning("the last run of this database did not stop cleanly: signed requests stamped before %.3f "
                        "(start + max_clock_skew_s) are answered 503, as they may be replays", self.auth.refuse_up_to)
        self.limiter = RateLimiter(oc.submit_rate_per_min, oc.submit_burst, clock)
        self.register_limiter = RateLimiter(oc.register_rate_per_min, oc.register_burst, clock,
                                            what="registrations from one address")
        self.pages = PageCache(oc.public_cache_s)
        self.page_size = oc.page_size
        self.metrics = Metrics(self)
        self.max_body_bytes = oc.max_body_bytes
        self.heartbeat_interval_s = oc.heartbeat_interval_s
        self.sweep_interval_s = min(1.0, oc.heartbeat_interval_s / 2)
        self.started = self._pruned = clock()
        self._policy_json: tuple[PolicyInfo | None, bytes] = (None, b"")
        self._interval_json = TypeAdapter(float).dump_json(self.heartbeat_interval_s)

    def heartbeat_reply(self, state: str, work: list[Assignment]) -> bytes:
        """The JSON of a HeartbeatResponse; the policy's part is serialized once per policy."""
        policy = self.scheduler.policy
        if self._policy_json[0] is not policy:
            self._policy_json = (policy, policy.model_dump_json().encode())
        return b"".join((b'{"state":"', state.encode(), b'","policy":', self._policy_json[1], b',"assignments":',
                         _ASSIGNMENTS.dump_json(work), b',"heartbeat_interval_s":', self._interval_json, b"}"))

    def sweep(self, flush: bool = False) -> None:
        """Liveness transitions and heartbeat write-behind (see nodes.py; `flush`: write every heartbeat time
        now), assignments past their deadline (scheduler.py), and forgetting expired nonces."""
        for key in self.registry.sweep(flush):
            log.warning("node %s... is dead; its open assignments are released", key[:16])
        for key, wid in self.scheduler.expire():
            log.warning("assignment %d of node %s... expired (%g s deadline): handed out again, a strike against "
                        "the node", wid, key[:16], self.scheduler.deadline_s)
        self.auth.nonces.prune(self.clock())
        if self.clock() - self._pruned >= 60:
            self.limiter.prune()
            self.register_limiter.prune()
            self._pruned = self.clock()

    def close(self) -> None:
        """A clean stop: heartbeat times and the unexpired nonces written (a restart refuses their replays)."""
        self.sweep(flush=True)
        stop_run(self.db, self.auth.nonces, self.run_id, self.clock())
        self.engine.dispose()


class NodeRoutes:
    """What the node routes do once a request is authentic and its body valid, shared by the FastAPI routes
    and the fast lane (fast_lane.py). Each returns the JSON reply."""

    def __init__(self, svc: Orchestrator):
        self.svc = svc

    def node_in_role(self, key: str, required: str | None) -> LiveNode:
        """The node of an authentic key; 403 if unknown, banned, or not a `required`."""
        node = self.svc.registry.check_known(key)
        if required is not None and node.role != required:
            raise HTTPException(403, f"this route is for {required}s; node {key[:16]}... is a {node.role}")
        return node

    def heartbeat(self, key: str, _node: LiveNode, body: HeartbeatRequest) -> bytes:
        svc = self.svc
        live = svc.registry.heartbeat(key, dict(body.metrics))
        work = svc.scheduler.open_assignments(key, body.loaded_versions) if live.role == "worker" else []
        return svc.heartbeat_reply(live.state, work)

    def announce(self, key: str, _node: LiveNode, body: BatchAnnouncement) -> bytes:
        self.svc.limiter.take(key)
        return self.svc.scheduler.announce(key, body).model_dump_json().encode()

    def claim(self, key: str, _node: LiveNode, body: ClaimRequest) -> bytes:
        record, expires = self.svc.scheduler.claim(key, body.lease_s)
        pin = None if record is None else self.svc.scheduler.manifests.get(record.version)
        return ClaimResponse(batch=record, lease_expires_at=expires, manifest_sha256=pin).model_dump_json().encode()

    def verdict(self, key: str, _node: LiveNode, body: Verdict, batch_id: str) -> bytes:
        record, new = self.svc.scheduler.verdict(key, batch_id, body)
        if new:
            self.svc.metrics.validation_lag.observe(max(0.0, record.verdict_at - record.announced_at))
        return record.model_dump_json().encode()


def _json(reply: bytes) -> Response:
    return Response(reply, media_type="application/json")


def _limit_body(app: Callable, max_bytes: int) -> Callable:
    """ASGI middleware: a request body over `max_bytes` is answered 413, and a POST body with a JSON Content-Type
    that is not strict JSON (guards.decode_json) 422, before any handler sees it."""

    async def refuse(send, status: int = 413,
                     detail: str | list = f"request body over the limit of {max_bytes} bytes "
                                          "(orchestrator.max_body_bytes)") -> None:
        body = json.dumps({"detail": detail}, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
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
        if body and scope["method"] == "POST" and is_json_content_type(
                dict(reversed(scope["headers"])).get(b"content-type")):
            try:
                decode_json(body)
            except BodyError as exc:
                return await refuse(send, 422, json_error(str(exc)))
        return await app(scope, replaying(body, receive), send)

    return guarded


_ERRORS = {401: {"description": "signature missing, malformed, stale, replayed or wrong"},
           403: {"description": "unknown, banned, not admitted, or wrong role"},
           413: {"description": "body over orchestrator.max_body_bytes"},
           422: {"description": "a field failed validation; `detail` names it"}}

# Security schemes of the OpenAPI document; the checks themselves are in auth.py.
_SIGNED = {"NodeKey": "hex ed25519 public key of the node",
           "Timestamp": "unix milliseconds; at most orchestrator.max_clock_skew_s off the service's clock",
           "Nonce": "16-64 random lowercase hex characters, used once",
           "Signature": "hex ed25519 signature of METHOD\\nPATH?QUERY\\nTIMESTAMP\\nNONCE\\nsha256hex(body)"}
_HEADERS = dict(zip(_SIGNED, (HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE)))
_SIGNED_ROUTE = {"security": [{name: [] for name in _SIGNED}]}
_ADMIN_ROUTE = {"security": [{"AdminToken": []}]}
_LEARNER_OPTIONAL = {"security": [{}, {"AdminToken": []}]}


def _reply(model: BaseModel) -> Response:
    """A reply serialized once (FastAPI would validate a returned model against response_model again)."""
    return Response(model.model_dump_json(), media_type="application/json")


def create_app(cfg: Config, clock: Callable[[], float] = time.time, database_url: str | None = None) -> FastAPI:
    """The service on `cfg` (storage: `database_url`, else orchestrator.database_url, else run.dir's SQLite)."""
    svc = Orchestrator(cfg, clock, database_url)
    node_routes = NodeRoutes(svc)

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
            if svc.wal is not None:
                await svc.wal.close()
            svc.close()

    app = _Service(title="intellect orchestrator", version=str(PROTOCOL_VERSION), lifespan=lifespan,
                  description="Admission, heartbeats, deterministic work, verdicts and the contribution ledger of a "
                              "decentralized RL run (docs/design.md section 8). Node routes are signed with ed25519.")
    app.state.orchestrator = svc

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 without the input it would repeat (guards.py)."""
        return JSONResponse({"detail": validation_errors(exc.errors())}, 422)

    async def signed(request: Request) -> str:
        h = request.headers
        return svc.auth.verify(request.scope, await request.body(), h.get(HEADER_KEY), h.get(HEADER_TIMESTAMP),
                               h.get(HEADER_NONCE), h.get(HEADER_SIGNATURE))

    async def new_node(request: Request) -> str:
        key = await signed(request)
        svc.registry.check_known(key, allow_unknown=True)
        return key

    def role(required: str | None) -> Callable:
        async def known(request: Request) -> tuple[str, LiveNode]:
            key = await signed(request)
            return key, node_routes.node_in_role(key, required)

        return known

    def admin(request: Request) -> None:
        svc.auth.require_admin(request)

    def maybe_learner(request: Request) -> bool:
        return svc.auth.is_admin(request)

    @app.get("/healthz", response_model=Health, tags=["public"])
    async def healthz() -> Health:
        return Health(status="ok", protocol=PROTOCOL_VERSION, schema_version=SCHEMA_VERSION,
                      uptime_s=svc.clock() - svc.started)

    @app.get("/v1/policy", response_model=PolicyInfo, tags=["public"])
    async def get_policy() -> PolicyInfo:
        return svc.scheduler.policy

    def registration_rate(request: Request) -> None:
        client = request.scope.get("client")
        svc.register_limiter.take(address_group(client[0]) if client else "")

    @app.post("/v1/nodes/register", response_model=RegisterResponse, dependencies=[Depends(registration_rate)],
              responses={**_ERRORS, 429: {"description": "too many registrations from this address"}},
              tags=["nodes"], openapi_extra=_SIGNED_ROUTE)
    async def register(body: RegisterRequest, key: Annotated[str, Depends(new_node)]) -> Response:
        """Admission. Limited per client address (orchestrator.register_rate_per_min, checked before the
        signature); an answered challenge is checked in a thread."""
        solved = None
        seed = svc.registry.pending_challenge(key) if body.challenge_answer is not None else None
        if seed is not None:
            solved = (seed, await asyncio.to_thread(solve_challenge, seed, svc.requirements.challenge_size))
        status, reasons, challenge = svc.registry.register(key, body.role, body.hardware, body.challenge_answer,
                                                           solved)
        if status == "refused":
            log.info("registration of %s... refused: %s", key[:16], "; ".join(reasons))
        return _reply(RegisterResponse(status=status, node_key=key, reasons=reasons, requirements=svc.requirements,
                                       challenge=challenge, policy=svc.scheduler.policy))

    for spec in NODE_ROUTES:  # also served by the fast lane (fast_lane.py), from the same table
        _declare(app, spec, getattr(node_routes, spec.answer), role(spec.role))

    @app.post("/v1/nodes/deregister", response_model=NodeInfo, responses=_ERRORS, tags=["nodes"],
              openapi_extra=_SIGNED_ROUTE)
    async def deregister(node: Annotated[tuple, Depends(role(None))]) -> Response:
        """A node signs off: it is marked dead now and its open assignments are handed out again."""
        svc.registry.leave(node[0])
        with svc.db() as s:
            return _reply(svc.registry.info(s, [node[0]])[0])

    @app.get("/v1/batches", response_model=BatchList | PublicBatchList, responses=_ERRORS, tags=["work"],
             openapi_extra=_LEARNER_OPTIONAL)
    async def list_batches(learner: Annotated[bool, Depends(maybe_learner)], status: BatchStatus = "accepted",
                           min_version: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
                           after: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
                           limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Response:
        """Batches by status. With the admin token (the learner) every field (BatchList), and accepted batches
        count as delivered; without it only the public fields (PublicBatchList: no store path, digest,
        validator, rewards or reasons)."""
        records, cursor = svc.scheduler.batches(status, min_version, after, limit, learner)
        return _json(json.dumps({"batches": records, "next_after": cursor}, separators=(",", ":"),
                                allow_nan=False).encode())

    @app.post("/v1/policy", response_model=PolicyInfo, responses={**_ERRORS, 409: {"description": "older version"}},
              dependencies=[Depends(admin)], tags=["admin"], openapi_extra=_ADMIN_ROUTE)
    async def announce_policy(body: PolicyAnnouncement) -> Response:
        return _reply(svc.scheduler.announce_policy(body))

    @app.get("/v1/nodes", response_model=NodeList, responses=_ERRORS, dependencies=[Depends(admin)], tags=["admin"],
             openapi_extra=_ADMIN_ROUTE)
    async def list_nodes(after: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$")] = None,
                         limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> Response:
        """A page of nodes in key order; `next_after` names the next page's `after`."""
        with svc.db() as s:
            nodes = svc.registry.info(s, after=after, limit=limit)
        return _reply(NodeList(nodes=nodes, next_after=nodes[-1].key if len(nodes) == limit else None))

    @app.post("/v1/nodes/{node_key}/ban", response_model=NodeInfo,
              responses={**_ERRORS, 404: {"description": "unknown node"}}, dependencies=[Depends(admin)],
              tags=["admin"], openapi_extra=_ADMIN_ROUTE)
    async def ban(node_key: Annotated[str, PathParam(pattern=r"^[0-9a-f]{64}$")], body: BanRequest) -> Response:
        svc.registry.ban(node_key, body.reason)
        log.warning("node %s... banned by an operator: %s", node_key[:16], body.reason)
        with svc.db() as s:
            return _reply(svc.registry.info(s, [node_key])[0])

    @app.get("/v1/ledger", response_model=Ledger, tags=["public"],
             responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}})
    async def ledger(format: Literal["json", "csv"] = "json",
                     after: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$")] = None,
                     limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> Response:
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
    app.fast_lane = fast_lane(functools.partial(FastAPI.__call__, app), svc, node_routes, by_path)
    if svc.wal is not None:
        app.add_middleware(_Middleware, wrap=svc.wal.middleware)
    app.add_middleware(_Middleware, wrap=svc.metrics.middleware)
    app.add_middleware(_Middleware, wrap=lambda inner: _limit_body(inner, svc.max_body_bytes))
    return app


def _declare(app: FastAPI, spec: NodeRoute, answer: Callable[..., bytes], node: Callable) -> None:
    """The FastAPI route of a NODE_ROUTES entry: its body model, the signed-node dependency `node` and a
    BATCH_ID_PATTERN check of each path parameter, answered by the NodeRoutes method `answer`."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("node", keyword, annotation=Annotated[tuple, Depends(node)]),
              inspect.Parameter("body", keyword, annotation=Annotated[spec.model, Body()],
                                default=inspect.Parameter.empty if spec.empty_body is None else spec.empty_body)]
    params += [inspect.Parameter(name, keyword, annotation=Annotated[str, PathParam(pattern=BATCH_ID_PATTERN)])
               for name in re.findall(r"{(\w+)}", spec.path)]

    async def endpoint(**values) -> Response:
        key, live = values.pop("node")
        body = values.pop("body")
        return _json(answer(key, live, body, *values.values()))

    endpoint.__signature__ = inspect.Signature(params)
    endpoint.__name__ = spec.answer
    app.add_api_route(spec.path, endpoint, methods=["POST"], response_model=spec.reply, description=spec.description,
                      responses={**_ERRORS, **{code: {"description": text} for code, text in spec.responses}},
                      tags=["nodes" if spec.role is None else "work"], openapi_extra=_SIGNED_ROUTE)


def _openapi(app: FastAPI) -> dict:
    """The generated document plus the security schemes the routes name (signature headers, admin token)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemes = {name: {"type": "apiKey", "in": "header", "name": _HEADERS[name], "description": text}
                   for name, text in _SIGNED.items()}
        schemes["AdminToken"] = {"type": "http", "scheme": "bearer", "description": "orchestrator.admin_token"}
        schema.setdefault("components", {})["securitySchemes"] = schemes
        app.openapi_schema = schema
    return app.openapi_schema


class PageCache:
    """Answers of the public pages by their query, reused for `ttl_s` seconds (monotonic), at most `size` kept:
    a flood of page requests costs one rendering per page and period."""

    def __init__(self, ttl_s: float, size: int = 256):
        self.ttl_s = ttl_s
        self.size = size
        self._answers: dict[tuple, tuple[float, Response]] = {}

    def get(self, key: tuple, render: Callable[[], Response]) -> Response:
        now = time.monotonic()
        held = self._answers.get(key)
        if held is not None and now < held[0]:
            return held[1]
        answer = render()
        if self.ttl_s > 0:
            if len(self._answers) >= self.size:
                self._answers = {k: v for k, v in self._answers.items() if v[0] > now}
                if len(self._answers) >= self.size:
                    self._answers.pop(next(iter(self._answers)))
            self._answers[key] = (now + self.ttl_s, answer)
        return answer


class _Service(FastAPI):
    """The FastAPI application with the fast lane (fast_lane.py) in front of its middleware stack."""

    fast_lane: Callable | None = None

    async def __call__(self, scope, receive, send):
        if self.fast_lane is None:
            return await super().__call__(scope, receive, send)
        await self.fast_lane(scope, receive, send)


class _Middleware:
    """Adapts a function `wrap(asgi_app) -> asgi_app` to Starlette's `add_middleware`."""

    def __init__(self, app: Callable, wrap: Callable[[Callable], Callable]):
        self.app = wrap(app)

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
