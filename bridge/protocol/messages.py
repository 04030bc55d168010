"""The orchestrator API's messages (docs/design.md section 8): the request and reply models that the service
declares its routes with and that the clients send and parse, so the two sides cannot drift apart.

Requests are strict (unknown fields are refused, every number and string is bounded); replies ignore fields
they do not know, so an older client keeps working against a newer service.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bridge.protocol.signing import weak_box_key

PROTOCOL_VERSION = 3
"""2: assignments carry the orchestrator's salt (`bridge.assignment`); verdicts the digest of the validator's
logprobs; workers upload batches (`PUT /v1/uploads/...`) and announce only with `orchestrator.worker_store_writes`."""

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
BatchId = Annotated[
    str, Field(pattern=BATCH_ID_PATTERN, description="batch id: letters, digits, '.', '_', '-'; at most 128")
]
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
            return (
                []
                if self.allow_cpu_nodes
                else [f"no GPU reported; this pool needs {self.min_gpus} GPU(s) and does not admit CPU-only nodes"]
            )
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
    manifests: dict[int, str] = Field(
        default={},
        description="sha256 of each window version's manifest.json, as "
        "the learner announced it: SHARDCAST clients accept no other manifest",
    )
    uploads: list[str] = Field(
        default=[],
        description="base URLs that take batch uploads (PUT /v1/uploads/...); empty: the orchestrator itself",
    )


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


class SessionRequest(Request):
    box_key: Hex64 = Field(
        description="a fresh X25519 public key of the node's; the session key comes back sealed to it"
    )

    @field_validator("box_key")
    @classmethod
    def _not_weak(cls, value: str) -> str:
        reason = weak_box_key(value)
        if reason is not None:
            raise ValueError(f"box_key is {reason}: use a key made by X25519 key generation")
        return value


class SessionResponse(Reply):
    session: str = Field(description="the session id, sent as X-Session")
    sealed_key: str = Field(description="hex sealed box (X25519, XSalsa20-Poly1305) of the 32-byte session key")
    expires_at: float = Field(description="unix seconds after which the session is refused; open a new one before")
    routes: list[str] = Field(description="the routes that take X-Session and X-Mac in place of X-Signature")


class HeartbeatRequest(Request):
    loaded_versions: list[Version] = Field(
        default=[],
        max_length=64,
        description="policy versions whose weights the node holds (not a choice: the orchestrator assigns the "
        "current version whatever the node holds)",
    )
    metrics: dict[Annotated[str, Field(max_length=64, pattern=r"^[^\x00]*$")], Finite] = Field(
        default={}, max_length=64, description="free-form numbers shown to the operator"
    )


class Assignment(Reply):
    """Work for one batch: `prompts` prompts x `samples_per_prompt` samples at policy `version`.

    The prompts and seeds follow from (node key, version, k) and `salt`, the orchestrator's secret mixed in
    (`assigned_task_ids`, `assigned_sample_seeds`), so a validator recomputes them and nobody computes them
    before the assignment is issued. `task_ids` is None when the service does not know the dataset's size; the
    worker then draws them from its own copy with `assigned_task_ids(..., salt=salt)`.
    """

    id: int
    version: int
    k: int
    prompts: int
    samples_per_prompt: int
    task_ids: list[int] | None
    sample_seeds: list[int] = Field(description="one per sample, prompt-major")
    salt: str | None = Field(
        None, description="the orchestrator's salt of this assignment's draws (None: a protocol-1 service, unsalted)"
    )
    level: int = Field(
        0,
        ge=0,
        le=1 << 16,
        description="the curriculum level whose task slice the prompts come from (bridge.curriculum)",
    )
    issued_at: float
    expires_at: float | None = Field(
        None,
        description="announce the batch before this (unix seconds), or the "
        "assignment expires and counts against the node",
    )


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
    store_path: str = Field(
        min_length=1, max_length=2048, pattern=r"^[^\x00]*$", description="<store>/v{version:06d}/{batch_id}"
    )
    sha256: Hex64 = Field(description="the batch's COMMIT hash")
    num_samples: int = Field(ge=1, le=1 << 24)
    num_tokens: int = Field(ge=0, le=1 << 40)


class BatchRecord(Reply):
    batch_id: str
    node_key: str
    assignment_id: int
    assignment_k: int = Field(0, description="k of the assignment: with node key and version it fixes the prompts")
    assignment_salt: str | None = Field(
        None, description="the salt of the assignment's draws (validators recompute its prompts and seeds with it)"
    )
    assignment_level: int = Field(
        0, ge=0, le=1 << 16, description="the assignment's curriculum level (its prompts' task slice)"
    )
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
    logprobs_sha256: str | None = Field(
        None, description="digest of the validator's logprobs written beside the batch (`bridge.validator_logprobs`)"
    )
    near_tie_samples: list[int] = Field(
        [], description="samples whose replay took a near tie (the verdict's; accepted batches): not trained by default"
    )


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
    lease_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="lease length (default: the service's orchestrator.claim_lease_s)",
    )


class ClaimResponse(Reply):
    batch: BatchRecord | None
    lease_expires_at: float | None
    manifest_sha256: str | None = Field(
        None, description="sha256 of the manifest of the batch's policy version, when the learner announced one"
    )


SampleIndex = Annotated[int, Field(ge=0, lt=1 << 24)]
CheckName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_.-]+$")]


class Verdict(Request):
    """A validator's judgement of a batch it has claimed."""

    accepted: bool
    failed_checks: list[CheckName] = Field(
        default=[], max_length=64, description="names of the checks that failed (toploc, sampling, ...)"
    )
    reason: Text = ""
    rewards: list[Finite] = Field(
        default=[], max_length=1 << 24, description="recomputed reward of every sample (required when accepted)"
    )
    num_tokens: int = Field(ge=0, le=1 << 40, description="tokens in the batch as the validator counted them")
    near_tie_cost: float = Field(
        0.0,
        ge=0,
        le=1e12,
        allow_inf_nan=False,
        description="the replay check's near-tie cost summed over the batch (the worker's near-tie ledger)",
    )
    near_tie_tokens: int = Field(0, ge=0, le=1 << 40, description="completion tokens the replay check judged")
    near_tie_samples: list[SampleIndex] = Field(
        default=[],
        max_length=1 << 24,
        description="indices (increasing) of the samples whose replay took a near tie: a token that is not the "
        "seed's choice by the validator's logits, within the engines' rounding of it. A worker could have chosen "
        'it; the learner trains none of them unless `[loss] near_tie_samples = "train"`',
    )
    logprobs_sha256: Hex64 | None = Field(
        None,
        description="digest of the logprobs the validator recomputed and wrote beside the batch "
        "(`bridge.validator_logprobs`; accepted batches only): the learner reads them only under this digest",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Verdict:
        if any(b <= a for a, b in zip(self.near_tie_samples, self.near_tie_samples[1:])):
            raise ValueError("near_tie_samples must be increasing sample indices")
        if self.accepted and self.near_tie_samples and self.near_tie_samples[-1] >= len(self.rewards):
            raise ValueError(
                f"near_tie_samples: index {self.near_tie_samples[-1]} for {len(self.rewards)} rewarded samples"
            )
        if self.accepted and self.failed_checks:
            raise ValueError("failed_checks must be empty when accepted is true")
        if not self.accepted and self.logprobs_sha256 is not None:
            raise ValueError("logprobs_sha256 is for accepted batches only")
        if not self.accepted and not (self.failed_checks or self.reason):
            raise ValueError("a rejection needs failed_checks or a reason")
        return self


class PolicyAnnouncement(Request):
    """From the learner, once the weights of `version` are exported and STABLE."""

    version: Version
    learner_step: int | None = Field(None, ge=0, le=2**31 - 1, description="default: version")
    relays: list[Url] | None = Field(None, max_length=64, description="replaces the relay list when given")
    manifest_sha256: Hex64 | None = Field(
        None,
        description="sha256 of the version's manifest.json; workers, "
        "validators and relays accept no other manifest for the version",
    )
    consumed: list[BatchId] = Field(
        [],
        max_length=4096,
        description="accepted batches the learner's steps since its last announcement took (trained on, or "
        "skipped as stale, unreadable or all-equal): they leave the async window (pacing, design section 3)",
    )


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
    lost_assignments: int = Field(
        0, description="assignments the node gave up by leaving the pool (or held when banned); strikes like expiries"
    )
    first_seen: float
    last_seen: float
    banned: bool
    near_tie_cost: float = Field(0.0, description="the replay check's near-tie cost over its accepted batches")
    near_tie_tokens: int = Field(0, description="completion tokens of its accepted batches the replay check judged")


class Ledger(Reply):
    entries: list[LedgerEntry]
    generated_at: float
    next_after: str | None = Field(None, description="more nodes follow: pass as `after` for the next page")


class Health(Reply):
    status: Literal["ok"]
    protocol: int
    schema_version: int
    uptime_s: float
