"""The state of one orchestrator service instance, apart from its routes: storage, the node registry, the work
scheduler, auth and rate limits, metrics, the public pages' cache (`Orchestrator`), and what the hot node
routes do once a request is authentic (`NodeRoutes`, shared by the FastAPI routes of app.py and the fast lane).

The service is built from its own config section (`OrchestratorConfig`) plus the few values of the run's other
sections it needs (`RunValues`), which the command line (`intellect orchestrator`) resolves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import HTTPException
from fastapi.responses import Response
from pydantic import TypeAdapter
from sqlalchemy.orm import sessionmaker

from bridge.curriculum import Curriculum
from bridge.protocol.messages import (
    Assignment,
    BatchAnnouncement,
    ClaimRequest,
    ClaimResponse,
    HeartbeatRequest,
    PolicyInfo,
    PoolRequirements,
    SessionRequest,
    SessionResponse,
    Verdict,
)
from orchestrator.auth import Authenticator, RateLimiter, start_run, stop_run
from orchestrator.config import OrchestratorConfig
from orchestrator.db import open_database
from orchestrator.durability import WalSync
from orchestrator.metrics import Metrics
from orchestrator.nodes import LiveNode, NodeRegistry
from orchestrator.scheduler import WorkScheduler

log = logging.getLogger("orchestrator")


@dataclass(frozen=True)
class RunValues:
    """What the service needs from the run's other config sections."""

    name: str
    """The run's name (run.name), the dashboard's title."""
    database_url: str
    """SQLAlchemy URL of the service's database (orchestrator.database_url, else SQLite in run.dir)."""
    async_level: int
    """Policy versions a batch may lag behind the learner (trainer.async_level)."""
    prompts_per_step: int
    """Prompts in one learner step (data.prompts_per_step)."""
    samples_per_prompt: int
    """Samples per prompt, the group size (data.samples_per_prompt)."""
    max_tokens: int
    """Longest completion a worker generates (worker.max_tokens, else data.max_new_tokens): sizes the deadline."""
    relays: Sequence[str]
    """SHARDCAST relays announced with each policy unless the learner names others."""
    max_prompt_len: int = 0
    """Longest prompt in tokens (data.max_prompt_len): with max_tokens it bounds an uploaded batch's samples."""
    rollout_store: str | None = None
    """The rollout store the in-process ingest writes uploads to (ingest.store_url, else <run.dir>/rollouts;
    None: this service takes no uploads itself)."""
    curriculum: Curriculum | None = None
    """The difficulty curriculum's rule (data.curriculum and its settings; None: one level)."""


_ASSIGNMENTS = TypeAdapter(list[Assignment])


class Orchestrator:
    """Everything one service instance holds: storage, the node registry, the work scheduler, auth, metrics."""

    def __init__(self, cfg: OrchestratorConfig, run: RunValues, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.run_name = run.name
        # SQLite: checkpoints of the WAL run in WalSync's thread, not inside a request's commit
        self.engine = open_database(run.database_url, autocheckpoint=False)
        self.db = sessionmaker(self.engine, expire_on_commit=False)
        self.wal = WalSync(self.engine.url.database, self.engine) if self.engine.dialect.name == "sqlite" else None
        self.requirements = PoolRequirements(
            min_gpus=cfg.min_gpus,
            min_gpu_memory_gib=cfg.min_gpu_memory_gib,
            allow_cpu_nodes=cfg.allow_cpu_nodes,
            challenge_size=cfg.challenge_side(),
            heartbeat_interval_s=cfg.heartbeat_interval_s,
        )
        self.registry = NodeRegistry(
            self.db,
            self.requirements,
            cfg.unhealthy_after_s,
            cfg.dead_after_s,
            cfg.challenge_timeout_s,
            clock,
            validator_keys=cfg.validator_keys,
        )
        if cfg.validator_keys is None:
            log.warning(
                "orchestrator.validator_keys is not set: any key may register as a validator (trusted "
                "pools only; list the validators' public keys in an open pool)"
            )
        self.scheduler = WorkScheduler(
            self.db,
            self.registry,
            async_level=run.async_level,
            prompts_per_step=run.prompts_per_step,
            prompts_per_assignment=cfg.prompts_per_assignment,
            samples_per_prompt=run.samples_per_prompt,
            max_inflight_per_node=cfg.max_inflight_per_node,
            num_tasks=cfg.num_tasks,
            claim_lease_s=cfg.claim_lease_s,
            ban_after_rejections=cfg.ban_after_rejections,
            rejection_window_s=cfg.rejection_window_s,
            near_tie_rate=cfg.near_tie_rate,
            near_tie_slack=cfg.near_tie_slack,
            default_relays=list(run.relays),
            clock=clock,
            deadline_s=cfg.deadline_s(run.max_tokens),
            unproven_share=cfg.unproven_share,
            curriculum=run.curriculum,
        )
        self.auth = Authenticator(cfg.max_clock_skew_s, cfg.admin_token, clock, cfg.session_ttl_s)
        self.run_id, self.auth.refuse_up_to = start_run(self.db, self.auth.nonces, clock(), cfg.max_clock_skew_s)
        if self.wal is not None:  # the start is on disk before any request: a crash from now on is seen as one
            self.wal._fsync()
        if self.auth.refuse_up_to:
            log.warning(
                "the last run of this database did not stop cleanly: signed requests stamped before %.3f "
                "(start + max_clock_skew_s) are answered 503, as they may be replays",
                self.auth.refuse_up_to,
            )
        self.limiter = RateLimiter(cfg.submit_rate_per_min, cfg.submit_burst, clock)
        self.register_limiter = RateLimiter(
            cfg.register_rate_per_min, cfg.register_burst, clock, what="registrations from one address"
        )
        self.pages = PageCache(cfg.public_cache_s)
        self.page_size = cfg.page_size
        self.metrics = Metrics(self)
        self.max_body_bytes = cfg.max_body_bytes
        self.heartbeat_interval_s = cfg.heartbeat_interval_s
        self.sweep_interval_s = min(1.0, cfg.heartbeat_interval_s / 2)
        self.started = self._pruned = clock()
        self._policy_json: tuple[PolicyInfo | None, bytes] = (None, b"")
        self._interval_json = TypeAdapter(float).dump_json(self.heartbeat_interval_s)

    def heartbeat_reply(self, state: str, work: list[Assignment]) -> bytes:
        """The JSON of a HeartbeatResponse; the policy's part is serialized once per policy."""
        policy = self.scheduler.policy
        if self._policy_json[0] is not policy:
            self._policy_json = (policy, policy.model_dump_json().encode())
        return b"".join(
            (
                b'{"state":"',
                state.encode(),
                b'","policy":',
                self._policy_json[1],
                b',"assignments":',
                _ASSIGNMENTS.dump_json(work),
                b',"heartbeat_interval_s":',
                self._interval_json,
                b"}",
            )
        )

    def sweep(self, flush: bool = False) -> None:
        """Liveness transitions and heartbeat write-behind (see nodes.py; `flush`: write every heartbeat time
        now), assignments past their deadline (scheduler.py), and forgetting expired nonces and sessions."""
        for key in self.registry.sweep(flush):
            log.warning("node %s... is dead; its open assignments stay its own until their deadline", key[:16])
        for key, wid in self.scheduler.expire():
            log.warning(
                "assignment %d of node %s... expired (%g s deadline): handed out again, a strike against the node",
                wid,
                key[:16],
                self.scheduler.deadline_s,
            )
        self.auth.nonces.prune(self.clock())
        if self.clock() - self._pruned >= 60:
            self.limiter.prune()
            self.register_limiter.prune()
            self.auth.sessions.prune(self.clock())
            self._pruned = self.clock()

    def close(self) -> None:
        """A clean stop: heartbeat times and the unexpired nonces written (a restart refuses their replays)."""
        self.sweep(flush=True)
        stop_run(self.db, self.auth.nonces, self.run_id, self.clock())
        self.scheduler.hot.close()
        self.engine.dispose()


class NodeRoutes:
    """What the node routes do once a request is authentic and its body valid, shared by the FastAPI routes
    and the fast lane (fast_lane.py). Each returns the JSON reply."""

    def __init__(self, svc: Orchestrator, session_routes: Sequence[str] = (), uploads_only: bool = False):
        self.svc = svc
        self.session_routes = list(session_routes)
        self.uploads_only = uploads_only  # POST /v1/batches refused: batches arrive as uploads only

    def node_in_role(self, key: str, required: str | None) -> LiveNode:
        """The node of an authentic key; 403 if unknown, banned, or not a `required`."""
        node = self.svc.registry.check_known(key)
        if required is not None and node.role != required:
            raise HTTPException(403, f"this route is for {required}s; node {key[:16]}... is a {node.role}")
        return node

    def heartbeat(self, key: str, _node: LiveNode, body: HeartbeatRequest) -> bytes:
        svc = self.svc
        live = svc.registry.heartbeat(key, dict(body.metrics))
        work = svc.scheduler.open_assignments(key) if live.role == "worker" else []
        return svc.heartbeat_reply(live.state, work)

    def announce(self, key: str, _node: LiveNode, body: BatchAnnouncement) -> bytes:
        if self.uploads_only:
            raise HTTPException(
                403,
                "this pool takes batches as uploads only (PUT /v1/uploads/{assignment_id}/{batch_id}): workers "
                "hold no store credentials, and an announced store path is not theirs to name "
                "(orchestrator.worker_store_writes is off)",
            )
        self.svc.limiter.take(key)
        return self.svc.scheduler.announce(key, body).model_dump_json().encode()

    def claim(self, key: str, _node: LiveNode, body: ClaimRequest) -> bytes:
        record, expires = self.svc.scheduler.claim(key, body.lease_s)
        pin = None if record is None else self.svc.scheduler.manifests.get(record.version)
        return ClaimResponse(batch=record, lease_expires_at=expires, manifest_sha256=pin).model_dump_json().encode()

    def open_session(self, key: str, _node: LiveNode, body: SessionRequest) -> bytes:
        """A session key for the node's heartbeats, sealed to `box_key` (its previous session ends); 403 when
        sessions are off. Which routes take it is the `session_ok` entries of NODE_ROUTES (fast_lane.py)."""
        sessions = self.svc.auth.sessions
        if sessions.ttl_s <= 0:
            raise HTTPException(403, "sessions are off on this service (orchestrator.session_ttl_s = 0): sign requests")
        session, sealed, expires = sessions.open(key, body.box_key)
        reply = SessionResponse(
            session=session, sealed_key=sealed.hex(), expires_at=expires, routes=self.session_routes
        )
        return reply.model_dump_json().encode()

    def verdict(self, key: str, _node: LiveNode, body: Verdict, batch_id: str) -> bytes:
        record, new = self.svc.scheduler.verdict(key, batch_id, body)
        if new:
            self.svc.metrics.validation_lag.observe(max(0.0, record.verdict_at - record.announced_at))
        return record.model_dump_json().encode()


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
