"""The coordination service's section of the configuration, `[orchestrator]`: its address, storage,
admission, liveness, pacing and connection limits. `intellect.config.Config` composes it with the other
sections; the service takes it plus the few values of other sections it needs (`orchestrator.service`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from bridge.config import Section, require

DEFAULT_CHALLENGE_SIZE = 512  # ~35 ms of float64 BLAS to verify, what a GPU does in about a millisecond


class OrchestratorConfig(Section):
    """[orchestrator]: the coordination service's address, storage, admission and liveness rules."""

    host: str = "127.0.0.1"
    """Address the orchestrator's HTTP API listens on."""
    port: int = Field(8000, ge=1, le=65535)
    """Port of the orchestrator's HTTP API."""
    database_url: str | None = None
    """SQLAlchemy URL of the orchestrator's database (None: SQLite at <run.dir>/orchestrator.db)."""
    admin_token: str | None = None
    """Bearer token for admin routes (None: admin routes are refused)."""
    prompts_per_assignment: int = Field(8, gt=0)
    """Prompts in one assignment; a worker's batch holds this many x data.samples_per_prompt samples."""
    heartbeat_interval_s: float = Field(10.0, gt=0)
    """Seconds between a node's heartbeats."""
    unhealthy_after_s: float = Field(30.0, gt=0)
    """A node silent this long gets no new assignments."""
    dead_after_s: float = Field(120.0, gt=0)
    """A node silent this long is dropped and its unfinished assignments are handed out again."""
    max_body_bytes: int = Field(1 << 20, gt=0)
    """Largest request body accepted, in bytes."""
    allow_cpu_nodes: bool = False
    """Admit workers and validators without a GPU (demos and tests)."""
    min_gpus: int = Field(1, ge=0)
    """GPUs a node must report to be admitted (unless it is CPU-only and allow_cpu_nodes is set)."""
    min_gpu_memory_gib: float = Field(0.0, ge=0)
    """Memory each reported GPU must have, in GiB."""
    challenge_size: int | None = Field(None, ge=0, le=4096)
    """Side of the registration compute challenge's matrices (0: none; None: 512, or 0 where allow_cpu_nodes)."""
    challenge_timeout_s: float = Field(30.0, gt=0)
    """Seconds a node has to answer the compute challenge."""
    max_inflight_per_node: int = Field(1, gt=0)
    """Open assignments (given out, no batch announced yet) one worker may hold at once."""
    num_tasks: int | None = Field(None, gt=0)
    """Prompts in the task's dataset, to list each assignment's task ids (None: workers draw them themselves)."""
    claim_lease_s: float = Field(600.0, gt=0)
    """Seconds a validator's claim on a batch lasts before another validator may take the batch."""
    ban_after_rejections: int = Field(3, ge=0)
    """Ban a worker automatically after this many rejected batches within rejection_window_s (0: never)."""
    rejection_window_s: float = Field(3600.0, gt=0)
    """Window in seconds over which rejected batches are counted for automatic bans."""
    near_tie_rate: float | None = Field(None, ge=0)
    """Near-tie cost per completion token a worker's accepted batches may spend, plus near_tie_slack (None: off)."""
    near_tie_slack: float = Field(2.0, ge=0)
    """Near-tie cost a worker may spend beyond near_tie_rate x its tokens over its lifetime."""
    submit_rate_per_min: float = Field(60.0, gt=0)
    """Batch announcements a node may make per minute on average (token bucket)."""
    submit_burst: int = Field(10, gt=0)
    """Batch announcements a node may make at once before the rate limit applies."""
    validator_keys: list[str] | None = None
    """Hex public keys that may register as validators (None: any key; trusted pools only, an open pool lists them)."""
    max_clock_skew_s: float = Field(30.0, gt=0)
    """Largest difference between a signed request's timestamp and the service's clock, in seconds."""
    session_ttl_s: float = Field(3600.0, ge=0)
    """Lifetime of a node's session key, which authenticates its heartbeats in place of a signature (0: off)."""
    assignment_deadline_s: float | None = Field(None, gt=0)
    """Seconds to announce an assignment's batch before it expires (None: max tokens / generation_tokens_per_s)."""
    generation_tokens_per_s: float = Field(10.0, gt=0)
    """Slowest per-sequence generation an honest worker is expected to reach, in tokens/s (sizes the deadline)."""
    min_assignment_deadline_s: float = Field(600.0, gt=0)
    """Floor of the derived assignment deadline in seconds (weight download and engine start fit in it)."""
    unproven_share: float = Field(0.5, gt=0, le=1)
    """Share of the async window that workers without an accepted batch may hold at once (1: no limit)."""
    register_rate_per_min: float = Field(60.0, gt=0)
    """Registration requests one client address may make per minute on average (token bucket)."""
    register_burst: int = Field(60, gt=0)
    """Registration requests one client address may make at once before the rate limit applies."""
    public_cache_s: float = Field(2.0, ge=0)
    """Seconds the dashboard and ledger answers are reused before being rendered again (0: never reused)."""
    page_size: int = Field(100, gt=0, le=10000)
    """Nodes per page of the dashboard's tables and default page of GET /v1/ledger."""
    max_connections: int = Field(4096, gt=0)
    """Connections the service holds at once; a newcomer displaces an idle or stalled one, else gets 503."""
    max_connections_per_ip: int = Field(64, gt=0)
    """Connections the service holds at once from one client address (IPv6: one /64); beyond it, as above."""
    max_header_kib: int = Field(16, gt=0, le=1024)
    """Largest request head (request line and headers) read, in KiB; a larger one gets 431 and is closed."""
    header_timeout_s: float = Field(10.0, gt=0)
    """Seconds a request head may take from its first byte to its last; a slower one gets 408 and is closed."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Seconds a request body may take after its head; a slower one gets 408 and is closed."""
    keepalive_s: float = Field(20.0, gt=0)
    """Seconds a connection is kept with no request in progress (clients keep theirs 15 s at most: aiohttp)."""
    trusted_proxies: list[str] = []
    """Addresses of reverse proxies: their X-Forwarded-For names the client, and no per-address limit applies."""
    worker_store_writes: bool = False
    """Trusted workers write the rollout store and announce batches (POST /v1/batches); False: uploads only."""

    def challenge_side(self) -> int:
        """The challenge size in effect: `challenge_size`, or its default (on unless CPU nodes are allowed)."""
        if self.challenge_size is not None:
            return self.challenge_size
        return 0 if self.allow_cpu_nodes else DEFAULT_CHALLENGE_SIZE

    def deadline_s(self, max_tokens: int) -> float:
        """The assignment deadline in effect for completions of up to `max_tokens` tokens."""
        if self.assignment_deadline_s is not None:
            return self.assignment_deadline_s
        return max(self.min_assignment_deadline_s, max_tokens / self.generation_tokens_per_s)

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        require(
            self.heartbeat_interval_s < self.unhealthy_after_s < self.dead_after_s,
            ("orchestrator.heartbeat_interval_s", "orchestrator.unhealthy_after_s", "orchestrator.dead_after_s"),
            "need orchestrator.heartbeat_interval_s < unhealthy_after_s < dead_after_s, got "
            f"{self.heartbeat_interval_s} / {self.unhealthy_after_s} / {self.dead_after_s}",
        )
        return self


class IngestConfig(Section):
    """[ingest]: where uploaded batches go and who takes them (docs/design.md section 8, uploads): the
    orchestrator itself (`in_process`) and/or `intellect ingest` processes beside it (`urls`). The ingest is the
    only writer of the rollout store; workers hold no storage credentials."""

    store_url: str | None = None
    """Rollout store uploads go to: path, file://, s3://, gs:// or a JSON kvstore spec (None: <run.dir>/rollouts)."""
    in_process: bool = True
    """The orchestrator takes uploads itself, on its own address (PUT /v1/uploads/...)."""
    urls: list[str] = []
    """Public URLs of `intellect ingest` processes, handed to workers with the policy (empty: the orchestrator)."""
    orchestrator_url: str = "http://127.0.0.1:8000"
    """Where an `intellect ingest` process reaches the orchestrator (its /v1/ingest/* routes)."""
    token: str | None = None
    """Bearer secret an `intellect ingest` process shows the orchestrator (None: the admin token)."""
    host: str = "127.0.0.1"
    """Address an `intellect ingest` process listens on."""
    port: int = Field(8001, ge=1, le=65535)
    """Port an `intellect ingest` process listens on."""
    upload_timeout_s: float = Field(120.0, gt=0)
    """Seconds an upload may take from its admission to its last byte; a slower one gets 408 and is dropped."""
    max_uploads: int = Field(16, gt=0)
    """Uploads one process receives at once (each holds at most one batch in memory); beyond it: 503."""
    max_uploads_per_ip: int = Field(2, gt=0)
    """Uploads one client address (IPv6: one /64) may send to one process at once; beyond: 429."""
    compression: Literal["blosc-lz4", "blosc-zstd", "zstd", "none"] = "blosc-lz4"
    """Codec of the arrays the ingest writes (readers read any codec)."""

    @model_validator(mode="after")
    def _check(self) -> IngestConfig:
        require(
            self.in_process or bool(self.urls),
            ("ingest.in_process", "ingest.urls"),
            "with ingest.in_process off, list the `intellect ingest` processes' URLs in ingest.urls: workers "
            "would have nowhere to upload",
        )
        return self
