"""The orchestrator's API as every role sees it (docs/design.md section 8): messages, request signing, the deterministic
assignment, the compute challenge, and the client that workers, validators and the learner use.

The service (`orchestrator/`) declares its routes with these same models, so the two sides cannot drift apart.

Signing. A node's identity is its ed25519 public key (32 bytes, lowercase hex). Every node request carries

    X-Node-Key   hex public key          X-Timestamp  unix milliseconds
    X-Nonce      random hex (16-64)      X-Signature  hex signature of the signing string

where the signing string is `METHOD\\nTARGET\\nTIMESTAMP\\nNONCE\\nsha256hex(body)`: TARGET is the request target
exactly as sent on the wire, the path followed by `?QUERY` when there is a query string (no `?` without one),
and the body hash is taken over the raw body bytes (empty body: the hash of b""). The server accepts a
timestamp at most 30 s off its clock and each nonce once. Operators and the learner use
`Authorization: Bearer <token>` instead.

Requests are strict (unknown fields are refused, every number and string is bounded); replies ignore fields
they do not know, so an older client keeps working against a newer service.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import random
import secrets
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Re-exported: docs/design.md §8 puts the deterministic assignment here; bridge.assignment is its one implementation.
from bridge.assignment import assigned_sample_seeds, assigned_task_ids, assignment_seed  # noqa: F401


PROTOCOL_VERSION = 1
HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE = "X-Node-Key", "X-Timestamp", "X-Nonce", "X-Signature"
MAX_CLOCK_SKEW_S = 30.0

# ---------------------------------------------------------------------------------------------------------
# Field types. Every integer fits SQLite's and PostgreSQL's 64-bit columns, every string is bounded and free
# of NUL (PostgreSQL text cannot hold it).

MAX_INT = 2**53
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Version = Annotated[int, Field(ge=0, le=2**31 - 1, description="policy version: optimizer steps since the base")]
Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="64 lowercase hex characters")]
NodeKey = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="ed25519 public key, 64 lowercase hex")]
# The one definition of a batch id (the orchestrator's routes, the fast lane and the rollout store use it).
BATCH_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
BatchId = Annotated[str, Field(pattern=BATCH_ID_PATTERN,
                               description="batch id: letters, digits, '.', '_', '-'; at most 128")]
Text = Annotated[str, Field(max_length=1000, pattern=r"^[^\x00]*$")]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00]*$")]
Url = Annotated[str, Field(min_length=1, max_length=1000, pattern=r"^https?://[^\s\x00]+$")]
Finite = Annotated[float, Field(allow_inf_nan=False, ge=-1e300, le=1e300)]
Seconds = Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e12)]
Role = Literal["worker", "validator"]
NodeState = Literal["pending", "healthy", "unhealthy", "dead"]
BatchStatus = Literal["submitted", "validating", "accepted", "rejected"]


class Request(BaseModel):
    """A message a client sends: strict."""

    model_config = ConfigDict(extra="forbid")


class Reply(BaseModel):
    """A message the service sends: unknown fields are ignored (forward compatible)."""

    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------------------
# Messages.

class GpuInfo(Request):
    name: Name
    memory_gib: float = Field(ge=0, le=1e5, allow_inf_nan=False)


class HardwareReport(Request):
    """What a node says it has; checked against the pool's requirements at registration."""

    gpus: list[GpuInfo] = Field(default=[], max_length=64)
    cpu_count: int = Field(ge=1, le=1 << 20)
    memory_gib: float = Field(ge=0, le=1e7, allow_inf_nan=False)
    platform: str = Field("", max_length=256, pattern=r"^[^\x00]*$")

    @classmethod
    def this_machine_cpu_only(cls) -> HardwareReport:
        """A report of this machine's CPUs and memory, no GPUs (demos and tests)."""
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return cls(cpu_count=os.cpu_count() or 1, memory_gib=pages * page_size / 2**30, platform=os.uname().sysname)


class PoolRequirements(Reply):
    """What the pool asks of a node; `failures` lists what a hardware report misses."""

    min_gpus: int
    min_gpu_memory_gib: float
    allow_cpu_nodes: bool
    challenge_size: int = Field(description="side of the challenge matrices (0: no challenge)")
    heartbeat_interval_s: float

    def failures(self, hw: HardwareReport) -> list[str]:
        if not hw.gpus:
            return [] if self.allow_cpu_nodes else [
                f"no GPU reported; this pool needs {self.min_gpus} GPU(s) and does not admit CPU-only nodes"]
        problems = []
        if len(hw.gpus) < self.min_gpus:
            problems.append(f"{len(hw.gpus)} GPU(s) reported, the pool needs at least {self.min_gpus}")
        small = [f"{g.name} ({g.memory_gib:g} GiB)" for g in hw.gpus if g.memory_gib < self.min_gpu_memory_gib]
        if small:
            problems.append(f"GPU memory below the pool's {self.min_gpu_memory_gib:g} GiB: {', '.join(small)}")
        return problems


class Challenge(Reply):
    """Multiply two seeded random matrices and send back the hash of the product before `expires_at`."""

    seed: int
    size: int
    expires_at: float


class PolicyInfo(Reply):
    """The current policy: workers generate with versions in [min_version, version]."""

    version: int
    learner_step: int
    async_level: int
    min_version: int = Field(description="oldest version still inside the async window")
    relays: list[str]
    announced_at: float | None
    manifests: dict[int, str] = Field(default={}, description="sha256 of each window version's manifest.json, as "
                                      "the learner announced it: SHARDCAST clients accept no other manifest")


class RegisterRequest(Request):
    role: Role
    hardware: HardwareReport
    challenge_answer: Hex64 | None = Field(None, description="solve_challenge(seed, size) of the challenge given")


class RegisterResponse(Reply):
    status: Literal["admitted", "challenge", "refused"]
    node_key: str
    reasons: list[str] = Field([], description="why the node was refused")
    requirements: PoolRequirements
    challenge: Challenge | None = None
    policy: PolicyInfo


class HeartbeatRequest(Request):
    loaded_versions: list[Version] = Field(default=[], max_length=64,
                                           description="policy versions whose weights the node holds")
    metrics: dict[Annotated[str, Field(max_length=64, pattern=r"^[^\x00]*$")], Finite] = Field(
        default={}, max_length=64, description="free-form numbers shown to the operator")


class Assignment(Reply):
    """Work for one batch: `prompts` prompts x `samples_per_prompt` samples at policy `version`.

    The prompts and seeds follow from (node key, version, k) alone (`assigned_task_ids`,
    `assigned_sample_seeds`), so a validator recomputes them. `task_ids` is None when the service does not know
    the dataset's size; the worker then draws them from its own copy with `assigned_task_ids`.
    """

    id: int
    version: int
    k: int
    prompts: int
    samples_per_prompt: int
    task_ids: list[int] | None
    sample_seeds: list[int] = Field(description="one per sample, prompt-major")
    issued_at: float
    expires_at: float | None = Field(None, description="announce the batch before this (unix seconds), or the "
                                                       "assignment expires and counts against the node")


class HeartbeatResponse(Reply):
    state: NodeState
    policy: PolicyInfo
    assignments: list[Assignment] = Field(description="the node's open assignments, oldest first")
    heartbeat_interval_s: float


class BatchAnnouncement(Request):
    """A batch committed to the rollout store (docs/design.md section 6) for one assignment."""

    batch_id: BatchId
    assignment_id: int = Field(ge=0, le=MAX_INT)
    version: Version
    store_path: str = Field(min_length=1, max_length=2048, pattern=r"^[^\x00]*$",
                            description="<store>/v{version:06d}/{batch_id}")
    sha256: Hex64 = Field(description="the batch's COMMIT hash")
    num_samples: int = Field(ge=1, le=1 << 24)
    num_tokens: int = Field(ge=0, le=1 << 40)


class BatchRecord(Reply):
    batch_id: str
    node_key: str
    assignment_id: int
    assignment_k: int = Field(0, description="k of the assignment: with node key and version it fixes the prompts")
    version: int
    store_path: str
    sha256: str
    num_samples: int
    num_tokens: int = Field(description="as announced by the worker")
    status: BatchStatus
    announced_at: float
    claimed_by: str | None = None
    lease_expires_at: float | None = None
    validator_key: str | None = None
    verdict_at: float | None = None
    verdict_seq: int | None = Field(None, description="order of verdicts; the `after` cursor of GET /v1/batches")
    failed_checks: list[str] = []
    reason: str | None = None
    rewards: list[float] | None = Field(None, description="the validator's per-sample rewards (accepted batches)")
    verified_tokens: int | None = Field(None, description="tokens as counted by the validator")


class BatchList(Reply):
    batches: list[BatchRecord]
    next_after: int = Field(description="pass as `after` to get only batches judged since this answer")


class PublicBatchRecord(Reply):
    """A batch as GET /v1/batches lists it without the admin token: no store path, digest, validator, rewards or
    reasons."""

    batch_id: str
    node_key: str
    assignment_id: int
    assignment_k: int = 0
    version: int
    num_samples: int
    num_tokens: int = Field(description="as announced by the worker")
    status: BatchStatus
    announced_at: float
    verdict_at: float | None = None
    verdict_seq: int | None = None


class PublicBatchList(Reply):
    batches: list[PublicBatchRecord]
    next_after: int = Field(description="pass as `after` to get only batches judged since this answer")


class ClaimRequest(Request):
    lease_s: float | None = Field(None, gt=0, le=86400, allow_inf_nan=False,
                                  description="lease length (default: the service's orchestrator.claim_lease_s)")


class ClaimResponse(Reply):
    batch: BatchRecord | None
    lease_expires_at: float | None
    manifest_sha256: str | None = Field(None, description="sha256 of the manifest of the batch's policy version, "
                                        "when the learner announced one")


CheckName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+$")]


class Verdict(Request):
    """A validator's judgement of a batch it has claimed."""

    accepted: bool
    failed_checks: list[CheckName] = Field(default=[], max_length=64,
                                           description="names of the checks that failed (toploc, sampling, ...)")
    reason: Text = ""
    rewards: list[Finite] = Field(default=[], max_length=1 << 24,
                                  description="recomputed reward of every sample (required when accepted)")
    num_tokens: int = Field(ge=0, le=1 << 40, description="tokens in the batch as the validator counted them")

    @model_validator(mode="after")
    def _consistent(self) -> Verdict:
        if self.accepted and self.failed_checks:
            raise ValueError("failed_checks must be empty when accepted is true")
        if not self.accepted and not (self.failed_checks or self.reason):
            raise ValueError("a rejection needs failed_checks or a reason")
        return self


class PolicyAnnouncement(Request):
    """From the learner, once the weights of `version` are exported and STABLE."""

    version: Version
    learner_step: int | None = Field(None, ge=0, le=2**31 - 1, description="default: version")
    relays: list[Url] | None = Field(None, max_length=64, description="replaces the relay list when given")
    manifest_sha256: Hex64 | None = Field(None, description="sha256 of the version's manifest.json; workers, "
                                          "validators and relays accept no other manifest for the version")


class NodeInfo(Reply):
    key: str
    role: Role
    state: NodeState
    banned: bool
    ban_reason: str | None
    hardware: dict[str, Any]
    first_seen: float
    last_seen: float
    open_assignments: int
    metrics: dict[str, float] = Field({}, description="from the node's last heartbeat")


class NodeList(Reply):
    nodes: list[NodeInfo]
    next_after: str | None = Field(None, description="more nodes follow: pass as `after` for the next page")


class BanRequest(Request):
    reason: Text = "banned by an operator"


class LedgerEntry(Reply):
    node_key: str
    role: Role
    accepted_batches: int
    accepted_samples: int
    accepted_tokens: int
    rejected_batches: int
    rejection_reasons: dict[str, int] = Field(description="failed check (or reason) -> rejected batches")
    expired_assignments: int = Field(0, description="assignments whose deadline passed before their batch came")
    first_seen: float
    last_seen: float
    banned: bool


class Ledger(Reply):
    entries: list[LedgerEntry]
    generated_at: float
    next_after: str | None = Field(None, description="more nodes follow: pass as `after` for the next page")


class Health(Reply):
    status: Literal["ok"]
    protocol: int
    schema_version: int
    uptime_s: float


# ---------------------------------------------------------------------------------------------------------
# Keys and signatures.

def load_or_create_key(path: str | Path) -> Ed25519PrivateKey:
    """The node's private key from a PEM file; a new key is written there (mode 0600) if the file is missing."""
    path = Path(path)
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an ed25519 private key ({type(key).__name__})")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key


def public_key_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def signing_string(method: str, target: str, timestamp_ms: int | str, nonce: str, body: bytes) -> bytes:
    """`METHOD\\nTARGET\\nTIMESTAMP\\nNONCE\\nsha256hex(body)`; TARGET is path[?query] as sent on the wire."""
    return f"{method.upper()}\n{target}\n{timestamp_ms}\n{nonce}\n{hashlib.sha256(body).hexdigest()}".encode()


def sign_request(key: Ed25519PrivateKey, method: str, target: str, body: bytes,
                 timestamp_ms: int | None = None, nonce: str | None = None) -> dict[str, str]:
    """The four signature headers for one request."""
    timestamp_ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    nonce = secrets.token_hex(16) if nonce is None else nonce
    signature = key.sign(signing_string(method, target, timestamp_ms, nonce, body))
    return {HEADER_KEY: public_key_hex(key), HEADER_TIMESTAMP: str(timestamp_ms), HEADER_NONCE: nonce,
            HEADER_SIGNATURE: signature.hex()}


_P25519 = 2**255 - 19
_Y8 = 0x7A03AC9277FDC74EC6CC392CFA53202A0F67100D760B3CBA4FD84D3D706A17C7
# y of the curve's 8 points of small order (x follows from y up to its sign). With one of them as the public key,
# a fixed signature verifies for many messages: RFC 8032 verification (OpenSSL's) does not exclude them.
_SMALL_ORDER_Y = frozenset({0, 1, _P25519 - 1, _Y8, _P25519 - _Y8})


@functools.lru_cache(maxsize=16384)
def weak_public_key(node_key: str) -> str | None:
    """Why the hex ed25519 public key `node_key` is refused as an identity, or None: a non-canonical encoding
    (y >= 2**255 - 19) or a point of small order (the identity `01 00...00` among them)."""
    raw = bytes.fromhex(node_key)
    if len(raw) != 32:
        return "not 32 bytes"
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    if y >= _P25519:
        return "a non-canonical encoding (y >= 2**255 - 19)"
    if y in _SMALL_ORDER_Y:  # x = 0 with the sign bit set (non-canonical) only occurs with y = 1 or -1
        return "a point of small order, for which signatures prove nothing"
    return None


@functools.lru_cache(maxsize=16384)
def _public_key(node_key: str) -> Ed25519PublicKey:
    if weak_public_key(node_key) is not None:
        raise ValueError(f"weak ed25519 public key {node_key[:16]}...")
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(node_key))


def verify_signature(node_key: str, signature_hex: str, method: str, target: str, timestamp_ms: str,
                     nonce: str, body: bytes) -> bool:
    """True if `signature_hex` is `node_key`'s signature of the request; False for any malformed input and for a
    weak key (`weak_public_key`)."""
    try:
        public = _public_key(node_key)
        public.verify(bytes.fromhex(signature_hex), signing_string(method, target, timestamp_ms, nonce, body))
    except (ValueError, InvalidSignature):
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# The compute challenge.

def challenge_matrices(seed: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Two `size` x `size` int64 matrices with entries in [0, 2**16), from numpy's PCG64 stream of `seed`."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, 1 << 16, (size, size), dtype=np.int64), rng.integers(0, 1 << 16, (size, size),
                                                                                   dtype=np.int64)


def solve_challenge(seed: int, size: int) -> str:
    """sha256 hex of the product's little-endian int64 bytes. Every entry is below 2**32 * size <= 2**44, so the
    product is exact in int64 and in float64 alike (every partial sum is an integer below 2**53): computed here
    with float64 BLAS (size 512: ~35 ms on one core, against ~0.9 s for numpy's int64 loop); a GPU may do the same."""
    a, b = challenge_matrices(seed, size)
    product = a.astype(np.float64) @ b.astype(np.float64)
    return hashlib.sha256(product.astype("<i8").tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------
# The client.

class OrchestratorError(Exception):
    """The service refused a request (`status` >= 400), or could not be reached after every retry (status 0)."""

    def __init__(self, status: int, detail: Any, method: str, target: str):
        self.status, self.detail, self.method, self.target = status, detail, method, target
        where = f"{method} {target}"
        super().__init__(f"{where}: HTTP {status}: {detail}" if status else f"{where}: {detail}")


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of connection errors, time-outs, 5xx and 429: exponential backoff with full jitter.

    Delay before retry i (from 0) is uniform in [0, min(max_delay_s, base_delay_s * 2**i)]; a 429's
    Retry-After is honoured when it is longer (capped at max_delay_s). Every retry is signed afresh.
    """

    attempts: int = 6
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0

    def delay(self, retry: int, rng: random.Random, retry_after: float | None = None) -> float:
        jittered = rng.uniform(0, min(self.max_delay_s, self.base_delay_s * 2**retry))
        return min(self.max_delay_s, max(jittered, retry_after or 0.0))


_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    reply: type[BaseModel] | None  # None: the raw text
    body: BaseModel | None = None
    params: Mapping[str, Any] | None = None
    auth: Literal["node", "admin", "none"] = "none"


class _Routes:
    """Every route once. The subclass's `_call` (blocking or async) does the HTTP, so each method returns the
    reply model, or an awaitable of it in the async client."""

    _call: Callable[[_Call], Any]

    def health(self) -> Health:
        return self._call(_Call("GET", "/healthz", Health))

    def policy(self) -> PolicyInfo:
        return self._call(_Call("GET", "/v1/policy", PolicyInfo))

    def register(self, role: Role, hardware: HardwareReport, challenge_answer: str | None = None) -> RegisterResponse:
        body = RegisterRequest(role=role, hardware=hardware, challenge_answer=challenge_answer)
        return self._call(_Call("POST", "/v1/nodes/register", RegisterResponse, body, auth="node"))

    def heartbeat(self, loaded_versions: Iterable[int] = (), metrics: Mapping[str, float] | None = None
                  ) -> HeartbeatResponse:
        body = HeartbeatRequest(loaded_versions=list(loaded_versions), metrics=dict(metrics or {}))
        return self._call(_Call("POST", "/v1/nodes/heartbeat", HeartbeatResponse, body, auth="node"))

    def deregister(self) -> NodeInfo:
        """Sign off: the node is marked dead and its open assignments go back to the queue."""
        return self._call(_Call("POST", "/v1/nodes/deregister", NodeInfo, auth="node"))

    def announce_batch(self, announcement: BatchAnnouncement) -> BatchRecord:
        return self._call(_Call("POST", "/v1/batches", BatchRecord, announcement, auth="node"))

    def claim(self, lease_s: float | None = None) -> ClaimResponse:
        return self._call(_Call("POST", "/v1/validation/claim", ClaimResponse, ClaimRequest(lease_s=lease_s),
                                auth="node"))

    def verdict(self, batch_id: str, verdict: Verdict) -> BatchRecord:
        return self._call(_Call("POST", f"/v1/batches/{batch_id}/verdict", BatchRecord, verdict, auth="node"))

    def batches(self, status: BatchStatus = "accepted", min_version: int | None = None, after: int | None = None,
                limit: int | None = None) -> BatchList | PublicBatchList:
        """Batches by status. Called with the admin token (the learner), accepted batches returned are counted
        as delivered to the learner, which frees room in the async window for new assignments; without it, only
        the public fields (PublicBatchList)."""
        params = {"status": status, "min_version": min_version, "after": after, "limit": limit}
        reply = BatchList if getattr(self, "admin_token", None) else PublicBatchList
        return self._call(_Call("GET", "/v1/batches", reply, params={k: v for k, v in params.items()
                                                                       if v is not None}, auth="admin"))

    def announce_policy(self, version: int, learner_step: int | None = None, relays: list[str] | None = None,
                        manifest_sha256: str | None = None) -> PolicyInfo:
        body = PolicyAnnouncement(version=version, learner_step=learner_step, relays=relays,
                                  manifest_sha256=manifest_sha256)
        return self._call(_Call("POST", "/v1/policy", PolicyInfo, body, auth="admin"))

    def nodes(self, after: str | None = None, limit: int | None = None) -> NodeList:
        """A page of nodes in key order (the service's default page without `limit`); see `next_after`."""
        params = {k: v for k, v in {"after": after, "limit": limit}.items() if v is not None}
        return self._call(_Call("GET", "/v1/nodes", NodeList, params=params, auth="admin"))

    def ban(self, node_key: str, reason: str = "banned by an operator") -> NodeInfo:
        return self._call(_Call("POST", f"/v1/nodes/{node_key}/ban", NodeInfo, BanRequest(reason=reason),
                                auth="admin"))

    def ledger(self, after: str | None = None, limit: int | None = None) -> Ledger:
        """A page of the ledger in node-key order (the service's default page without `limit`); see
        `next_after`."""
        params = {k: v for k, v in {"after": after, "limit": limit}.items() if v is not None}
        return self._call(_Call("GET", "/v1/ledger", Ledger, params=params))

    def ledger_csv(self, after: str | None = None, limit: int | None = None) -> str:
        """A page of the ledger as CSV; the X-Next-After reply header names the next page's `after`."""
        params = {k: v for k, v in {"format": "csv", "after": after, "limit": limit}.items() if v is not None}
        return self._call(_Call("GET", "/v1/ledger", None, params=params))


class _Base(_Routes):
    def __init__(self, base_url: str, key: Ed25519PrivateKey | None, admin_token: str | None,
                 retry: RetryPolicy, seed: int | None, clock: Callable[[], float]):
        self.base_url = base_url.rstrip("/")
        self.clock = clock
        self.key = key
        self.node_key = public_key_hex(key) if key is not None else None
        self.admin_token = admin_token
        self.retry = retry
        self._rng = random.Random(seed)

    def _encode(self, call: _Call) -> tuple[str, bytes, dict[str, str]]:
        """(request target, body, headers): signed (node) or with the bearer token (admin, when one is set).
        The target is sent exactly as signed."""
        target = call.path + (f"?{urllib.parse.urlencode(call.params)}" if call.params else "")
        content = call.body.model_dump_json().encode() if call.body is not None else b""
        headers = {"Content-Type": "application/json"} if call.body is not None else {}
        if call.auth == "admin" and self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        if call.auth == "node":
            if self.key is None:
                raise ValueError(f"{call.method} {call.path} is signed by a node: give the client a key")
            headers.update(sign_request(self.key, call.method, target, content,
                                        timestamp_ms=int(self.clock() * 1000)))
        return target, content, headers

    def _outcome(self, call: _Call, status: int, headers: Mapping[str, str], body: bytes) -> tuple[bool, Any]:
        """(True, the parsed reply), or (False, Retry-After seconds or None) for a retryable status; raises
        OrchestratorError for any other error status."""
        if status in _RETRY_STATUS:
            after = headers.get("Retry-After", "")
            return False, float(after) if after.replace(".", "", 1).isdigit() else None
        text = body.decode("utf-8", errors="replace")
        if status >= 400:
            try:
                detail = json.loads(text).get("detail", text)
            except (ValueError, AttributeError):
                detail = text
            raise OrchestratorError(status, detail, call.method, call.path)
        if call.reply is None:
            return True, text
        try:
            return True, call.reply.model_validate_json(body)
        except ValidationError as exc:
            raise OrchestratorError(status, f"reply does not match {call.reply.__name__}: {exc}", call.method,
                                    call.path) from exc

    def _give_up(self, call: _Call, last: str) -> OrchestratorError:
        return OrchestratorError(0, f"no answer from {self.base_url} after {self.retry.attempts} attempts "
                                    f"(last: {last})", call.method, call.path)


class OrchestratorClient(_Base):
    """Blocking client (httpx): `OrchestratorClient(url, key=load_or_create_key(path))` for a node,
    `admin_token=` for the learner or an operator. Use as a context manager, or call `close()`.

    `seed` fixes the retry jitter, `clock` (unix seconds) the signature timestamps, `sleep` the waits between
    retries, and `http` an httpx.Client to use instead of a new one (tests).
    """

    def __init__(self, base_url: str, key: Ed25519PrivateKey | None = None, admin_token: str | None = None,
                 timeout_s: float = 30.0, retry: RetryPolicy = RetryPolicy(), seed: int | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 http: Any = None):
        import httpx

        super().__init__(base_url, key, admin_token, retry, seed, clock)
        self._network_errors = (httpx.TransportError,)
        self._owned = http is None
        self._http = httpx.Client(timeout=timeout_s) if http is None else http
        self._sleep = sleep

    def _call(self, call: _Call) -> Any:
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            target, content, headers = self._encode(call)
            try:
                response = self._http.request(call.method, self.base_url + target, content=content, headers=headers)
            except self._network_errors as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                done, value = self._outcome(call, response.status_code, response.headers, response.content)
                if done:
                    return value
                retry_after, last = value, f"HTTP {response.status_code}"
            if attempt + 1 < self.retry.attempts:
                self._sleep(self.retry.delay(attempt, self._rng, retry_after))
        raise self._give_up(call, last)

    def all_batches(self, status: BatchStatus = "accepted", min_version: int | None = None, after: int = 0,
                    page: int = 1000) -> tuple[list[BatchRecord], int]:
        """Every batch with `status` judged after the cursor `after`, fetched page by page: (records, the
        cursor for the next call). The learner's listing (with the admin token, which marks them delivered)."""
        records: list[BatchRecord] = []
        while True:
            reply = self.batches(status, min_version=min_version, after=after, limit=page)
            records += reply.batches
            after = reply.next_after
            if len(reply.batches) < page:
                return records, after

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def __enter__(self) -> OrchestratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncOrchestratorClient(_Base):
    """The same methods as `OrchestratorClient`, awaited (aiohttp, which keeps up with thousands of concurrent
    requests in one process). `session` lets many clients share one aiohttp.ClientSession."""

    def __init__(self, base_url: str, key: Ed25519PrivateKey | None = None, admin_token: str | None = None,
                 timeout_s: float = 30.0, retry: RetryPolicy = RetryPolicy(), seed: int | None = None,
                 clock: Callable[[], float] = time.time, session: Any = None):
        import aiohttp

        super().__init__(base_url, key, admin_token, retry, seed, clock)
        self._network_errors = (aiohttp.ClientError, asyncio.TimeoutError)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owned = session is None

    async def _call(self, call: _Call) -> Any:
        import aiohttp
        import yarl

        if self._session is None:
            self._session = aiohttp.ClientSession()
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            target, content, headers = self._encode(call)
            url = yarl.URL(self.base_url + target, encoded=True)  # sent exactly as signed
            try:
                async with self._session.request(call.method, url, data=content, headers=headers,
                                                 timeout=self._timeout) as response:
                    status, reply_headers, body = response.status, response.headers, await response.read()
            except self._network_errors as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                done, value = self._outcome(call, status, reply_headers, body)
                if done:
                    return value
                retry_after, last = value, f"HTTP {status}"
            if attempt + 1 < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(attempt, self._rng, retry_after))
        raise self._give_up(call, last)

    async def aclose(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> AsyncOrchestratorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
