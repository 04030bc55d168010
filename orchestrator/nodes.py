"""Nodes: admission (hardware check, optional compute challenge), liveness, bans.

Liveness is a function of the time since a node's last heartbeat:

    healthy  --silent unhealthy_after_s-->  unhealthy  --silent dead_after_s-->  dead
       ^-------------------- any heartbeat (from either) -------------------------'

`sweep()` applies it to every node (the service calls it about every second). A dead node gets no new work
but keeps its open assignments: a worker generating a long batch is silent meanwhile, and one that restarts
finds its assignment in the next heartbeat's answer; what it does not announce by the deadline expires, a
strike (scheduler.py). A node that leaves (deregisters) or is banned loses its open assignments at once (state
`lost`, `abandoned_at` set): their room in the async window is handed out again, each counts against the node
like an expiry, and a batch announced for one later is refused. So no way out of an assignment is free: a
worker cannot draw assignments and keep only those whose rewards it likes (docs/orchestrator.md).

The registry keeps every node's key, role, state, ban and last heartbeat in memory (the hot path of every
request) and writes each change through to the database, except what a heartbeat changes: the time of the last
heartbeat and a silent node turning healthy again are written behind, within FLUSH_S (a restart recomputes the
state from that time, and nothing else reads it back). Each node's turn for that comes at its own moment within
FLUSH_S (from its key), so every sweep writes a small share of the pool rather than every fifth sweep all of it.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastapi import HTTPException
from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from bridge.protocol.messages import Challenge, HardwareReport, NodeInfo, PoolRequirements, Role
from orchestrator.db import LOST, OPEN, Node, Work

HEALTHY, UNHEALTHY, DEAD, PENDING = "healthy", "unhealthy", "dead", "pending"
FLUSH_S = 5.0  # heartbeat times reach the database at most this long after they happen


_NODES = Node.__table__
# The sweep's write of state and heartbeat time, built once (building it cost more than running it).
_WRITE_BEHIND = (
    update(_NODES).where(_NODES.c.key == bindparam("k")).values(state=bindparam("st"), last_seen=bindparam("seen"))
)


def _first_flush(key: str, now: float) -> float:
    """When a node's heartbeat time is first written behind: a moment within FLUSH_S of `now` that follows from
    its key (keys are random), so that the pool's turns are spread evenly."""
    return now + FLUSH_S * zlib.crc32(key.encode()) / 2**32


def liveness(silent_s: float, unhealthy_after_s: float, dead_after_s: float) -> str:
    """The state of an admitted node that has been silent for `silent_s` seconds."""
    if silent_s >= dead_after_s:
        return DEAD
    return UNHEALTHY if silent_s >= unhealthy_after_s else HEALTHY


@dataclass
class LiveNode:
    role: str
    state: str
    banned: bool
    last_seen: float
    flushed: float  # last_seen as the database has it
    metrics: dict[str, float] = field(default_factory=dict)  # from the last heartbeat, kept in memory only
    left: bool = False  # signed off (deregistered): dead until its next heartbeat, whatever its silence
    flush_due: float = 0.0  # when its heartbeat time is next written behind (see _first_flush)


class NodeRegistry:
    def __init__(
        self,
        db: sessionmaker[Session],
        requirements: PoolRequirements,
        unhealthy_after_s: float,
        dead_after_s: float,
        challenge_timeout_s: float,
        clock: Callable[[], float],
        validator_keys: Sequence[str] | None = None,
    ):
        self.db = db
        self.validator_keys = None if validator_keys is None else {k.lower() for k in validator_keys}
        self.requirements = requirements
        self.unhealthy_after_s = unhealthy_after_s
        self.dead_after_s = dead_after_s
        self.challenge_timeout_s = challenge_timeout_s
        self.clock = clock
        # told after a node's open work was lost (it left or was banned)
        self.on_release: Callable[[str], None] = lambda key: None
        now = clock()
        with db() as s:  # columns, not ORM objects: a restart at 100,000 nodes loads in a fraction of a second
            self.live = {
                key: LiveNode(role, state, banned, seen, seen, flush_due=_first_flush(key, now))
                for key, role, state, banned, seen in s.execute(
                    select(Node.key, Node.role, Node.state, Node.banned, Node.last_seen)
                )
            }

    def check_known(self, key: str, *, allow_unknown: bool = False) -> LiveNode | None:
        """The node of an authentic key; 403 if it is banned, or unknown (unless `allow_unknown`)."""
        node = self.live.get(key)
        if node is None and not allow_unknown:
            raise HTTPException(403, f"unknown node key {key[:16]}...: register first (POST /v1/nodes/register)")
        if node is not None and node.banned:
            with self.db() as s:
                reason = s.get(Node, key).ban_reason
            raise HTTPException(403, f"node {key[:16]}... is banned: {reason}")
        return node

    def pending_challenge(self, key: str) -> int | None:
        """The seed of the challenge `key` was given and has not answered yet, if any."""
        node = self.live.get(key)
        if node is None or node.state != PENDING:
            return None
        with self.db() as s:
            return s.get(Node, key).challenge_seed

    def register(
        self, key: str, role: Role, hardware: HardwareReport, answer: str | None, solved: tuple[int, str] | None = None
    ) -> tuple[str, list[str], Challenge | None]:
        """(status, reasons, challenge) of a registration; admitted nodes start healthy.

        `solved` is (seed, solve_challenge(seed, size)) of the node's pending challenge, computed by the caller
        off the event loop; None makes an answer count as wrong. A node banned meanwhile (an operator's ban can
        land while the caller awaits that computation) is refused with 403 and stays banned.
        """
        reasons = self.requirements.failures(hardware) if role == "worker" or not self.validator_keys else []
        if role == "validator" and self.validator_keys is not None and key not in self.validator_keys:
            reasons.append("this key may not validate in this pool: it is not in orchestrator.validator_keys")
        if reasons:
            return "refused", reasons, None
        now = self.clock()
        with self.db.begin() as s:
            node = s.get(Node, key)
            if node is not None and node.banned:  # the database is the record: never overwritten by a registration
                raise HTTPException(403, f"node {key[:16]}... is banned: {node.ban_reason}")
            if node is None:
                node = Node(key=key, role=role, state=PENDING, banned=False, hardware={}, first_seen=now, last_seen=now)
                s.add(node)
            node.role, node.hardware, node.last_seen = role, hardware.model_dump(), now
            status, challenge = "admitted", None
            if node.state == PENDING and self.requirements.challenge_size > 0:
                status, reasons, challenge = self._challenge_step(node, answer, solved, now)
            if status == "admitted":
                node.state, node.challenge_seed, node.challenge_expires = HEALTHY, None, None
            state = node.state
        self.live[key] = LiveNode(role, state, False, now, now, flush_due=_first_flush(key, now))
        return status, reasons, challenge

    def _challenge_step(
        self, node: Node, answer: str | None, solved: tuple[int, str] | None, now: float
    ) -> tuple[str, list[str], Challenge | None]:
        if answer is None or node.challenge_seed is None:
            node.challenge_seed = secrets.randbits(63)
            node.challenge_expires = now + self.challenge_timeout_s
            return (
                "challenge",
                [],
                Challenge(
                    seed=node.challenge_seed, size=self.requirements.challenge_size, expires_at=node.challenge_expires
                ),
            )
        seed, expires = node.challenge_seed, node.challenge_expires
        node.challenge_seed = node.challenge_expires = None  # one answer per challenge
        if now > expires:
            return (
                "refused",
                [f"challenge answered {now - expires:.1f} s after its deadline; register again for a new one"],
                None,
            )
        if solved is None or solved[0] != seed or answer != solved[1]:
            return "refused", ["wrong challenge answer; register again for a new challenge"], None
        return "admitted", [], None

    def heartbeat(self, key: str, metrics: dict[str, float]) -> LiveNode:
        """Record a heartbeat of an admitted node (403 for one still pending); a silent node turns healthy."""
        node = self.live[key]
        if node.state == PENDING:
            raise HTTPException(403, "node not admitted yet: answer the registration challenge")
        # Written behind with the heartbeat time (sweep), not a commit per node: after an outage every node of the
        # pool comes back at once.
        node.last_seen, node.metrics, node.left, node.state = self.clock(), metrics, False, HEALTHY
        return node

    def sweep(self, flush: bool = False) -> list[str]:
        """Move silent nodes along healthy -> unhealthy -> dead and write heartbeat times behind (each node's
        every FLUSH_S, or every one now if `flush`). Returns the keys that died (their open work stays theirs
        until its deadline)."""
        now = self.clock()
        unhealthy_after_s = self.unhealthy_after_s
        died, changes = [], []
        for key, node in self.live.items():
            # Most nodes at most sweeps: healthy, heard from lately, their turn to be written not come yet.
            if (
                node.state == HEALTHY
                and now - node.last_seen < unhealthy_after_s
                and now < node.flush_due
                and not flush
            ):
                continue
            if node.state == PENDING or node.banned or node.left:
                continue
            state = liveness(now - node.last_seen, unhealthy_after_s, self.dead_after_s)
            its_turn = flush or now >= node.flush_due
            if its_turn:
                node.flush_due = now + FLUSH_S
            if state != node.state or (its_turn and node.last_seen != node.flushed):
                changes.append({"k": key, "st": state, "seen": node.last_seen})
            if state == DEAD and node.state != DEAD:
                died.append(key)
        if changes:
            with self.db.begin() as s:
                s.execute(_WRITE_BEHIND, changes)
        for change in changes:
            node = self.live[change["k"]]
            node.state, node.flushed = change["st"], change["seen"]
        return died

    def leave(self, key: str) -> None:
        """A node signing off (SIGTERM): it is dead at once and its open assignments are lost (abandoned: each a
        strike against it, like an expiry, and their room goes back to the queue); a later heartbeat makes it
        healthy again."""
        now = self.clock()
        with self.db.begin() as s:
            s.execute(update(Node).where(Node.key == key).values(state=DEAD, last_seen=now))
            release_open_work(s, key, now)
        node = self.live[key]
        node.state, node.last_seen, node.flushed, node.left = DEAD, now, now, True
        self.on_release(key)

    def ban(self, key: str, reason: str) -> None:
        """Ban `key` (404 if unknown); its open assignments are lost."""
        if key not in self.live:
            raise HTTPException(404, f"no node with key {key}")
        now = self.clock()
        with self.db.begin() as s:
            s.execute(update(Node).where(Node.key == key).values(banned=True, ban_reason=reason, banned_at=now))
            release_open_work(s, key, now)
        self.live[key].banned = True
        self.on_release(key)

    def info(
        self, s: Session, keys: list[str] | None = None, after: str | None = None, limit: int | None = None
    ) -> list[NodeInfo]:
        """Nodes in key order: those in `keys`, else those after the key `after`, at most `limit`. Only the nodes
        listed are read (a page costs the same at 100,000 nodes as at 100)."""
        query = select(Node).order_by(Node.key)
        if keys is not None:
            query = query.where(Node.key.in_(keys))
        if after is not None:
            query = query.where(Node.key > after)
        if limit is not None:
            query = query.limit(limit)
        nodes = list(s.scalars(query))
        listed = [n.key for n in nodes]
        open_counts = (
            dict(
                s.execute(
                    select(Work.node_key, func.count())
                    .where(Work.state == OPEN, Work.node_key.in_(listed))
                    .group_by(Work.node_key)
                ).all()
            )
            if listed
            else {}
        )
        out = []
        for n in nodes:
            live = self.live.get(n.key)
            out.append(
                NodeInfo(
                    key=n.key,
                    role=n.role,
                    state=live.state if live else n.state,
                    banned=n.banned,
                    ban_reason=n.ban_reason,
                    hardware=n.hardware,
                    first_seen=n.first_seen,
                    last_seen=live.last_seen if live else n.last_seen,
                    open_assignments=open_counts.get(n.key, 0),
                    metrics=live.metrics if live else {},
                )
            )
        return out


def release_open_work(s: Session, key: str, now: float) -> None:
    """The node gives its open assignments up: marked lost and abandoned, they no longer hold room in the async
    window, can no longer be announced, and each counts against the node (scheduler.py `_should_ban`)."""
    s.execute(
        update(Work).where(Work.node_key == key, Work.state == OPEN).values(state=LOST, lost_at=now, abandoned_at=now)
    )
