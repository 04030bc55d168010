"""Work: the policy version, deterministic assignments paced by the async window, batch announcements,
validation claims with leases, verdicts, and the learner's listing of accepted batches.

Pacing (docs/design.md section 3). With current version V, the learner's next steps train on versions in
[V - async_level, V]. Work "in the window" is an open assignment, a submitted batch, or an accepted batch no
learner step has taken yet, at a version in the window. At most `(async_level + 1) x assignments_per_step` of it
exist at once, where assignments_per_step = ceil(data.prompts_per_step / orchestrator.prompts_per_assignment):
enough to feed the learner's next async_level + 1 steps and no more, so that nothing finished goes stale
unread. A batch leaves the count when a learner step takes it (the learner's next policy announcement lists
it in `consumed`: trained on, or skipped), when it is rejected, when its assignment is lost, or when its
version leaves the window; each frees room for a new assignment. Reading the listing frees nothing: the learner
reads ahead (it prefetches batches it will train on several steps later), and a window freed by reads let
workers run ahead of the learner until their batches went stale unread. On top of that a worker holds at most
`max_inflight_per_node` open assignments.

Deadlines and strikes. An assignment not announced within `deadline_s` of its issue expires (`expire()`, from
the service's sweep): it leaves the window, so its room is handed out again, and it counts against its node like
a rejection. An assignment its node gave up by leaving the pool is lost and counts the same (`_released`).
`ban_after_rejections` strikes of any of these kinds within `rejection_window_s` ban the node. Lost and expired
are final: a batch announced for one, or for an open assignment past its deadline, is refused with 410 and
never validated. Together these make every assignment drawn either announced (and judged) or a strike, so a
worker cannot draw assignments and train the pool only on those whose rewards it liked (issue 36). Workers that
have never had a batch accepted ("unproven": every fresh key) hold at most `unproven_share` of the window's
capacity between them, so keys that heartbeat and never deliver cannot hold the window, not even for one
deadline.

The near-tie ledger (`near_tie_rate`, off when None). A validator's verdict carries the batch's near-tie cost,
what its replay check charged for tokens that were not the seed's exact choice but within the engines' rounding
(`gpu_workers.checks`), and the completion tokens it judged. Every batch's cost is within the validator's
per-batch budget, which must hold an honest batch's chance fluctuations; a cheater may spend that room on
choices that raise its reward in every batch. Summed over a worker's accepted batches, an honest worker's cost
settles near its engines' rate, so an accepted verdict that would take the worker's total over near_tie_rate x
its tokens + near_tie_slack is recorded as a rejection of the "replay" check instead (a strike).

Assignments are given at V, the newest version the learner announced (it announces a version once its weights
are published): the orchestrator chooses, whatever versions the worker says it holds (it fetches V if it has
not). The k-th assignment of a node at version v has its prompts and seeds drawn by `bridge.assignment` from
(node key, v, k) and a salt, an HMAC of those under the service's secret (`orchestrator.db.service_secrets`),
stored with the assignment when it is issued: the worker learns the salt with its assignment, a validator
with the batch it claims, and nobody before the assignment exists, so no key's draws can be computed (and the
key chosen) ahead of registering it. k only grows, so a node never draws the same slot twice.

The hot paths (issuing an assignment, announcing, claiming, judging) run prebuilt SQLAlchemy Core statements
through `HotPath` (db.py): one held connection, each statement compiled once, and on SQLite executed on the
driver's connection itself. At a 1,000-node pool's request rate, ORM sessions, the building of statements and
SQLAlchemy's per-execution machinery each cost the event loop more CPU than the SQL itself.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from fastapi import HTTPException
from sqlalchemy import Engine, bindparam, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from bridge.assignment import assigned_sample_seeds, assigned_task_ids, assignment_salt
from bridge.curriculum import Curriculum, solve_rate
from bridge.protocol.messages import (
    Assignment,
    BatchAnnouncement,
    BatchRecord,
    BatchStatus,
    PolicyAnnouncement,
    PolicyInfo,
    Verdict,
)
from orchestrator.db import (
    ACCEPTED,
    ASSIGNMENT_SECRET,
    EXPIRED,
    LOST,
    OPEN,
    REJECTED,
    SUBMITTED,
    HotPath,
    Policy,
    Work,
    service_secret,
)
from orchestrator.nodes import NodeRegistry

log = logging.getLogger("orchestrator")
_TABLE = Work.__table__
W = _TABLE.c

# The hot paths' statements, built once: building a statement and its cache key costs more than running it.
_COUNT_K = (
    select(func.count()).select_from(_TABLE).where(W.node_key == bindparam("key"), W.version == bindparam("version"))
)
_INSERT = _TABLE.insert()
_BY_ID = select(_TABLE).where(W.id == bindparam("wid"))
_BY_BATCH = select(_TABLE).where(W.batch_id == bindparam("batch"))
_ID_OF_BATCH = select(W.id).where(W.batch_id == bindparam("batch"))
_UPDATE = _TABLE.update().where(W.id == bindparam("wid"))  # SET: the columns named in the parameters
_NEAR_TIES = select(func.sum(W.near_tie_cost).label("cost"), func.sum(W.near_tie_tokens).label("tokens")).where(
    W.node_key == bindparam("node"), W.state == bindparam("state")
)
_EXPIRE = (
    _TABLE.update().where(W.id == bindparam("wid"), W.state == OPEN).values(state=EXPIRED, expired_at=bindparam("when"))
)
_HELD_CLAIM = (
    select(_TABLE)
    .where(W.state == SUBMITTED, W.claimed_by == bindparam("key"), W.lease_expires > bindparam("now"))
    .order_by(W.id)
    .limit(1)
)
_NEXT_CLAIM = (
    select(_TABLE)
    .where(W.state == SUBMITTED, or_(W.claimed_by.is_(None), W.lease_expires <= bindparam("now")))
    .order_by(W.announced_at, W.id)
    .limit(1)
)
# The listings (the learner polls accepted batches every second): one shape per status, every filter bound (a
# missing `min_version` binds 0, a missing cursor -1), so each compiles once.
_LISTED = select(_TABLE).limit(bindparam("limit"))
_LIST_DECIDED = _LISTED.where(
    W.state == bindparam("state"), W.version >= bindparam("min_version"), W.verdict_seq > bindparam("after")
).order_by(W.verdict_seq)
_LIVE_CLAIM = W.claimed_by.is_not(None) & (W.lease_expires > bindparam("now"))
_LIST_SUBMITTED = {
    live: _LISTED.where(
        W.state == SUBMITTED,
        W.version >= bindparam("min_version"),
        W.id > bindparam("after"),
        _LIVE_CLAIM if live else ~_LIVE_CLAIM,
    ).order_by(W.id)
    for live in (True, False)
}


def near_tie_allowance(rate: float, slack: float, tokens: int) -> float:
    """The near-tie cost a worker's accepted batches may spend in all over `tokens` completion tokens."""
    return rate * tokens + slack


class WorkScheduler:
    def __init__(
        self,
        db: sessionmaker[Session],
        registry: NodeRegistry,
        *,
        async_level: int,
        prompts_per_step: int,
        prompts_per_assignment: int,
        samples_per_prompt: int,
        max_inflight_per_node: int,
        num_tasks: int | None,
        claim_lease_s: float,
        ban_after_rejections: int,
        rejection_window_s: float,
        default_relays: Sequence[str],
        clock: Callable[[], float],
        deadline_s: float = math.inf,
        unproven_share: float = 1.0,
        near_tie_rate: float | None = None,
        near_tie_slack: float = 2.0,
        curriculum: Curriculum | None = None,
    ):
        self.db = db
        self.engine: Engine = db.kw["bind"]
        self.hot = HotPath(self.engine)
        self.registry = registry
        self.async_level = async_level
        self.prompts_per_assignment = prompts_per_assignment
        self.samples_per_prompt = samples_per_prompt
        self.assignments_per_step = math.ceil(prompts_per_step / prompts_per_assignment)
        self.capacity = (async_level + 1) * self.assignments_per_step
        self.max_inflight_per_node = max_inflight_per_node
        self.num_tasks = num_tasks
        self.claim_lease_s = claim_lease_s
        self.ban_after_rejections = ban_after_rejections
        self.rejection_window_s = rejection_window_s
        self.near_tie_rate, self.near_tie_slack = near_tie_rate, near_tie_slack
        self.default_relays = list(default_relays)
        self.curriculum = curriculum
        self.clock = clock
        self.deadline_s = deadline_s
        self.unproven_capacity = max(1, math.floor(unproven_share * self.capacity))
        # Caches of what the heartbeat needs, so that a heartbeat that changes nothing reads no table; every
        # change goes through this object (one process per database), which keeps them exact.
        self._window: int | None = None  # work in the async window, kept by deltas; None: count again
        self._open: dict[str, list[Assignment]] = defaultdict(list)  # open assignments by node, oldest first
        self._next_k: dict[tuple[str, int], int] = {}  # (node, version) -> its next k, once looked up
        # Deadlines of open assignments in the order they were issued, so in deadline order (if the clock steps
        # back, one expires late, never early); an entry whose assignment left the open state is skipped.
        self._deadlines: deque[tuple[float, int, str]] = deque()  # (deadline, assignment id, node)
        with self.engine.connect() as conn:
            self._secret = service_secret(conn, ASSIGNMENT_SECRET)  # salts every assignment's draws
        self.upload_urls: list[str] = []  # where workers upload batches (empty: this service)
        with db() as s:
            latest = s.scalars(select(Policy).order_by(Policy.version.desc()).limit(1)).first()
            # manifest sha256 by version, as announced (SHARDCAST clients pin them; a claim names its version's)
            self.manifests = {
                v: h
                for v, h in s.execute(
                    select(Policy.version, Policy.manifest_sha256).where(Policy.manifest_sha256.is_not(None))
                )
            }
            self.policy = self._policy_info(latest)
            # the curriculum level of each announced version (bridge.curriculum; 0 without one)
            self.levels = dict(s.execute(select(Policy.version, Policy.curriculum_level)).all())
            self._proven = set(s.scalars(select(Work.node_key).where(Work.state == ACCEPTED).distinct()))
            for w in s.scalars(select(Work).where(Work.state == OPEN).order_by(Work.id)):
                self._open[w.node_key].append(self._to_assignment(w))
                self._deadlines.append((w.issued_at + deadline_s, w.id, w.node_key))
            self._verdict_seq = s.scalar(select(func.max(Work.verdict_seq))) or 0
            # no assignment exists at a newer version than this: the first k there is 0, with no count to run
            newest = s.scalar(select(func.max(Work.version)))
            self._newest_at_start = -1 if newest is None else newest
            self.expired_total = s.scalar(select(func.count()).select_from(Work).where(Work.expired_at.is_not(None)))
            self.lost_total = s.scalar(select(func.count()).select_from(Work).where(Work.abandoned_at.is_not(None)))
        # open assignments held by workers without an accepted batch, kept by deltas
        self._unproven_open = sum(len(v) for k, v in self._open.items() if k not in self._proven)
        registry.on_release = self._released

    # -- policy ---------------------------------------------------------------------------------------------

    def _policy_info(self, row: Policy | None) -> PolicyInfo:
        version = row.version if row else 0
        oldest = max(0, version - self.async_level)
        return PolicyInfo(
            version=version,
            learner_step=row.learner_step if row else 0,
            async_level=self.async_level,
            min_version=oldest,
            relays=(row.relays if row and row.relays else self.default_relays),
            announced_at=row.announced_at if row else None,
            manifests={v: self.manifests[v] for v in range(oldest, version + 1) if v in self.manifests},
            uploads=list(self.upload_urls),
        )

    def set_upload_urls(self, urls: Sequence[str]) -> None:
        """The ingest URLs handed to workers with the policy (ingest.urls)."""
        self.upload_urls = list(urls)
        self.policy = self.policy.model_copy(update={"uploads": list(urls)})

    def announce_policy(self, msg: PolicyAnnouncement) -> PolicyInfo:
        """A new version from the learner; announcing the current one again is a no-op, an older one is 409.
        Without `relays` the relays announced last stay."""
        current = self.policy.version
        if msg.version < current:
            raise HTTPException(409, f"version {msg.version} is older than the current version {current}")
        if msg.version == current and self.policy.announced_at is not None:
            pinned = self.manifests.get(current)
            if msg.manifest_sha256 is not None and pinned is not None and msg.manifest_sha256 != pinned:
                raise HTTPException(409, f"version {current} was announced with manifest sha256 {pinned}")
            self._consume(msg.consumed)
            return self.policy
        self._consume(msg.consumed)
        level = self._next_level()
        with self.db.begin() as s:
            last = s.scalars(select(Policy).order_by(Policy.version.desc()).limit(1)).first()
            row = Policy(
                version=msg.version,
                learner_step=msg.version if msg.learner_step is None else msg.learner_step,
                relays=list(msg.relays) if msg.relays is not None else (last.relays if last else []),
                announced_at=self.clock(),
                manifest_sha256=msg.manifest_sha256,
                curriculum_level=level,
            )
            s.add(row)
        if level != self.level:
            log.info("curriculum: version %d moves from level %d to level %d", msg.version, self.level, level)
        self.levels[msg.version] = level
        if msg.manifest_sha256 is not None:
            self.manifests[msg.version] = msg.manifest_sha256
        self.policy, self._window = self._policy_info(row), None
        # k counters of versions that left the window are never needed again (no assignment is issued there)
        self._next_k = {kv: k for kv, k in self._next_k.items() if kv[1] >= self.policy.min_version}
        log.info("policy version %d announced (learner step %d)", row.version, row.learner_step)
        return self.policy

    @property
    def level(self) -> int:
        """The curriculum level of the current version: new assignments draw their prompts from its slice."""
        return self.levels.get(self.policy.version, 0)

    def _next_level(self) -> int:
        """The level of the version being announced (`Curriculum.next_level`, module docstring of
        bridge.curriculum): from the solve rates of the accepted batches of the current level, since it began."""
        if self.curriculum is None:
            return 0
        level, since = self.level, self.policy.version
        while since > 0 and self.levels.get(since - 1, 0) == level:
            since -= 1
        with self.db() as s:
            rewards = s.scalars(
                select(Work.rewards)
                .where(Work.state == ACCEPTED, Work.version >= since, Work.level == level)
                .order_by(Work.verdict_seq.desc())
                .limit(self.curriculum.window)
            ).all()
        rates = [solve_rate(r or []) for r in reversed(rewards)]
        return self.curriculum.next_level(level, rates)

    def _consume(self, batch_ids: Sequence[str]) -> None:
        """The learner's steps took these accepted batches: they leave the async window (each once; ids of
        batches not accepted, or unknown, change nothing)."""
        if not batch_ids:
            return
        with self.db.begin() as s:
            taken = s.execute(
                update(Work)
                .where(Work.batch_id.in_(set(batch_ids)), Work.state == ACCEPTED, Work.delivered_at.is_(None))
                .values(delivered_at=self.clock())
                .returning(Work.version)
            ).all()
        self._window_add(-sum(self._in_window(v) for (v,) in taken))

    # -- assignments ----------------------------------------------------------------------------------------

    def _to_assignment(self, w: Any) -> Assignment:
        """The Assignment of a Work row (ORM object or Core row)."""
        count = w.prompts * w.samples_per_prompt
        key, version, k, salt = w.node_key, w.version, w.k, w.salt
        levels = self.curriculum.levels if self.curriculum is not None else 1
        task_ids = (
            assigned_task_ids(key, version, k, self.num_tasks, w.prompts, salt, w.level, levels)
            if self.num_tasks
            else None
        )
        return Assignment(
            id=w.id,
            version=version,
            k=k,
            prompts=w.prompts,
            samples_per_prompt=w.samples_per_prompt,
            task_ids=task_ids,
            sample_seeds=assigned_sample_seeds(key, version, k, count, salt),
            salt=salt,
            level=w.level,
            issued_at=w.issued_at,
            expires_at=w.issued_at + self.deadline_s if math.isfinite(self.deadline_s) else None,
        )

    def window_work(self, recount: bool = False) -> int:
        """Work in the async window (see the module docstring), from the cache unless `recount`."""
        if self._window is None or recount:
            with self.db() as s:
                self._window = s.scalar(
                    select(func.count())
                    .select_from(Work)
                    .where(
                        Work.version >= self.policy.min_version,
                        or_(Work.state.in_((OPEN, SUBMITTED)), (Work.state == ACCEPTED) & Work.delivered_at.is_(None)),
                    )
                )
        return self._window

    def _in_window(self, version: int) -> bool:
        return version >= self.policy.min_version

    def _window_add(self, delta: int) -> None:
        if self._window is not None:
            self._window += delta

    def _drop_open(self, key: str, ids: set[int] | None = None) -> list[Assignment]:
        """Take the node's open assignments with these `ids` (None: all) out of the cache; returns them."""
        mine = self._open.get(key, [])
        gone = [a for a in mine if ids is None or a.id in ids]
        if gone:
            kept = [a for a in mine if ids is not None and a.id not in ids]
            if kept:
                self._open[key] = kept
            else:
                self._open.pop(key, None)
            if key not in self._proven:
                self._unproven_open -= len(gone)
        return gone

    def _released(self, key: str) -> None:
        """The node's open assignments were marked lost (it left or was banned): out of the window, and a strike
        each, which may ban a node that left."""
        gone = self._drop_open(key)
        self._window_add(-sum(self._in_window(a.version) for a in gone))
        self.lost_total += len(gone)
        if gone and self._should_ban(key, self.clock()):
            self.registry.ban(key, self._strikes_reason())

    def _strikes_reason(self) -> str:
        return (
            f"automatic: {self.ban_after_rejections} rejected batches, abandoned assignments or expired "
            f"assignments within {self.rejection_window_s:g} s"
        )

    def open_assignments(self, key: str) -> list[Assignment]:
        """The worker's open assignments, after giving it a new one if it has room, the window has too, and (for
        a worker without an accepted batch) the unproven share of the window has room."""
        mine = self._open.get(key, [])
        if (
            len(mine) < self.max_inflight_per_node
            and self.window_work() < self.capacity
            and (key in self._proven or self._unproven_open < self.unproven_capacity)
        ):
            work = self._issue(key)
            mine = self._open[key]
            mine.append(self._to_assignment(work))
            self._deadlines.append((work.issued_at + self.deadline_s, work.id, key))
            self._window_add(1)
            if key not in self._proven:
                self._unproven_open += 1
        return list(mine)

    def expire(self) -> list[tuple[str, int]]:
        """Open assignments past their deadline expire: out of the window, a strike against their node (which
        may ban it). Returns (node key, assignment id) of each."""
        now = self.clock()
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, wid, key = self._deadlines.popleft()
            if any(a.id == wid for a in self._open.get(key, ())):
                due.append((key, wid))
        if not due:
            return []
        with self.engine.begin() as conn:
            conn.execute(_EXPIRE, [{"wid": wid, "when": now} for _, wid in due])
        self.expired_total += len(due)
        by_node: dict[str, set[int]] = defaultdict(set)
        for key, wid in due:
            by_node[key].add(wid)
        for key, ids in by_node.items():
            self._window_add(-sum(self._in_window(a.version) for a in self._drop_open(key, ids)))
        for key in by_node:
            if self._should_ban(key, now):
                self.registry.ban(key, self._strikes_reason())
        return due

    def _issue(self, key: str) -> SimpleNamespace:
        version = self.policy.version
        hot = self.hot
        with hot.begin() as conn:
            k = self._next_k.get((key, version))
            if k is None and version > self._newest_at_start:
                k = 0
            elif k is None:  # assignments are only ever added, by this object: counted once, then kept
                k = hot.scalar(conn, _COUNT_K, {"key": key, "version": version})
            work = SimpleNamespace(
                node_key=key,
                version=version,
                k=k,
                salt=assignment_salt(self._secret, key, version, k),
                level=self.level,
                prompts=self.prompts_per_assignment,
                samples_per_prompt=self.samples_per_prompt,
                state=OPEN,
                issued_at=self.clock(),
            )
            work.id = hot.write(conn, _INSERT, vars(work))
        self._next_k[(key, version)] = k + 1
        return work

    # -- batches --------------------------------------------------------------------------------------------

    def announce(self, key: str, msg: BatchAnnouncement) -> BatchRecord:
        """Record a committed batch for one of the worker's open assignments; repeating it is a no-op. An
        assignment lost, expired or past its deadline is refused with 410 (see the module docstring)."""
        hot = self.hot
        now = self.clock()
        with hot.begin() as conn:
            row = hot.first(conn, _BY_ID, {"wid": msg.assignment_id})
            work = None if row is None else SimpleNamespace(**row)
            if work is None or work.node_key != key:
                raise HTTPException(404, f"assignment_id {msg.assignment_id}: no such assignment of this node")
            if work.batch_id is not None:
                if work.batch_id == msg.batch_id and work.sha256 == msg.sha256:
                    return batch_record(work, now)
                raise HTTPException(409, f"assignment {work.id} already has batch {work.batch_id!r}")
            gone = self._gone(work, now)
            if gone is not None:
                raise HTTPException(410, f"assignment {work.id} (version {work.version}, k {work.k}) {gone}")
            expected_samples = work.prompts * work.samples_per_prompt
            problems = []
            if msg.version != work.version:
                problems.append(f"version: {msg.version}, but assignment {work.id} is at version {work.version}")
            if msg.num_samples != expected_samples:
                problems.append(
                    f"num_samples: {msg.num_samples}, but assignment {work.id} asks for "
                    f"{work.prompts} prompts x {work.samples_per_prompt} samples = {expected_samples}"
                )
            suffix = f"v{msg.version:06d}/{msg.batch_id}"
            if not msg.store_path.rstrip("/").endswith(suffix):
                problems.append(f"store_path: {msg.store_path!r} does not end with {suffix!r} (docs/design.md §6)")
            if problems:
                raise HTTPException(
                    422, [{"loc": ["body", p.split(":")[0]], "msg": p, "type": "value_error"} for p in problems]
                )
            if hot.scalar(conn, _ID_OF_BATCH, {"batch": msg.batch_id}) is not None:
                raise HTTPException(409, f"batch_id {msg.batch_id!r} is already taken by another assignment")
            change = dict(
                state=SUBMITTED,
                batch_id=msg.batch_id,
                store_path=msg.store_path,
                sha256=msg.sha256,
                num_samples=msg.num_samples,
                num_tokens=msg.num_tokens,
                announced_at=now,
            )
            hot.write(conn, _UPDATE, {"wid": work.id, **change})
            vars(work).update(change)
            record = batch_record(work, now)
        self._drop_open(key, {msg.assignment_id})  # open -> submitted: it stays in the window
        return record

    def upload_target(self, key: str, assignment_id: int, batch_id: str) -> SimpleNamespace:
        """The open assignment an upload of `key` for `assignment_id` as `batch_id` may land in (its Work row), or
        the refusal: 404 not this node's, 409 it has a batch already or the id is taken, 410 lost or expired.
        Read only: the announcement at the end of the upload checks everything again in its transaction."""
        hot = self.hot
        with hot.begin() as conn:
            row = hot.first(conn, _BY_ID, {"wid": assignment_id})
            work = None if row is None else SimpleNamespace(**row)
            if work is None or work.node_key != key:
                raise HTTPException(404, f"assignment_id {assignment_id}: no such assignment of this node")
            if work.batch_id is not None:
                raise HTTPException(
                    409,
                    f"assignment {work.id} already has batch {work.batch_id!r} ({work.state}): batches are taken once",
                )
            gone = self._gone(work, self.clock())
            if gone is not None:
                raise HTTPException(410, f"assignment {work.id} (version {work.version}, k {work.k}) {gone}")
            if hot.scalar(conn, _ID_OF_BATCH, {"batch": batch_id}) is not None:
                raise HTTPException(409, f"batch_id {batch_id!r} is already taken by another assignment")
        return work

    def _gone(self, work: Any, now: float) -> str | None:
        """Why an assignment without a batch can no longer take one (None: it is open and in time)."""
        deadline = work.issued_at + self.deadline_s
        why = "; a batch for it is never validated: take the next assignment"
        if work.state == LOST and work.abandoned_at is not None:
            return f"was lost at {work.abandoned_at:.3f}: this node left the pool holding it (a strike){why}"
        if work.state == LOST:
            return f"was lost at {work.lost_at:.3f}: the run was rolled back past its version{why}"
        if work.state == EXPIRED or now >= deadline:
            return (
                f"expired: its deadline {deadline:.3f} ({self.deadline_s:g} s after it was issued) passed before "
                f"its batch was announced (a strike){why}"
            )
        return None

    def claim(self, key: str, lease_s: float | None) -> tuple[BatchRecord | None, float | None]:
        """The batch this validator holds a live claim on, else the oldest unclaimed (or lapsed) batch."""
        now = self.clock()
        hot = self.hot
        with hot.begin() as conn:
            row = hot.first(conn, _HELD_CLAIM, {"key": key, "now": now}) or hot.first(conn, _NEXT_CLAIM, {"now": now})
            if row is None:
                return None, None
            work = SimpleNamespace(**row)
            work.claimed_by, work.lease_expires = key, now + (lease_s or self.claim_lease_s)
            hot.write(conn, _UPDATE, {"wid": work.id, "claimed_by": key, "lease_expires": work.lease_expires})
            return batch_record(work, now), work.lease_expires

    def verdict(self, key: str, batch_id: str, msg: Verdict) -> tuple[BatchRecord, bool]:
        """Judge a batch this validator claimed: (the record, False if this repeats a verdict already given).
        A rejection may ban the worker (`ban_after_rejections` within `rejection_window_s`)."""
        now = self.clock()
        hot = self.hot
        with hot.begin() as conn:
            row = hot.first(conn, _BY_BATCH, {"batch": batch_id})
            if row is None:
                raise HTTPException(404, f"no batch {batch_id!r}")
            work = SimpleNamespace(**row)
            if work.state in (ACCEPTED, REJECTED):
                if work.validator_key == key and (work.state == ACCEPTED) == msg.accepted:
                    return batch_record(work, now), False
                raise HTTPException(409, f"batch {batch_id!r} was already judged ({work.state})")
            if work.claimed_by != key:
                raise HTTPException(
                    409,
                    f"batch {batch_id!r}: this validator does not hold its claim "
                    "(POST /v1/validation/claim first; a lapsed lease may have gone to another)",
                )
            if msg.accepted and len(msg.rewards) != work.num_samples:
                raise HTTPException(
                    422,
                    [
                        {
                            "loc": ["body", "rewards"],
                            "type": "value_error",
                            "msg": f"rewards: {len(msg.rewards)} given, batch {batch_id!r} has "
                            f"{work.num_samples} samples",
                        }
                    ],
                )
            over = self._near_tie_overdraft(conn, work.node_key, msg) if msg.accepted else None
            accepted = msg.accepted and over is None
            change = dict(
                state=ACCEPTED if accepted else REJECTED,
                validator_key=key,
                verdict_at=now,
                verdict_seq=self._verdict_seq + 1,
                failed_checks=list(msg.failed_checks) if over is None else ["replay"],
                reason=(msg.reason or None) if over is None else over,
                rewards=list(msg.rewards) if accepted else None,
                verified_tokens=msg.num_tokens,
                near_tie_cost=msg.near_tie_cost,
                near_tie_tokens=msg.near_tie_tokens,
                logprobs_sha256=msg.logprobs_sha256 if accepted else None,
                near_tie_samples=list(msg.near_tie_samples) if accepted else None,
            )
            hot.write(conn, _UPDATE, {"wid": work.id, **change})
            vars(work).update(change)
            record, worker = batch_record(work, now), work.node_key
        self._verdict_seq += 1  # only once the transaction committed
        if accepted and worker not in self._proven:  # its open work no longer counts as unproven
            self._proven.add(worker)
            self._unproven_open -= len(self._open.get(worker, ()))
        if not accepted:
            self._window_add(-int(self._in_window(record.version)))
        if not accepted and self._should_ban(worker, now):
            self.registry.ban(
                worker, f"automatic: {self.ban_after_rejections} rejected batches within {self.rejection_window_s:g} s"
            )
        return record, True

    def _near_tie_overdraft(self, conn, worker: str, msg: Verdict) -> str | None:
        """Why accepting this batch would take the worker's near-tie ledger over its allowance (None: it does not,
        or the ledger is off): near_tie_rate x tokens + near_tie_slack, over its accepted batches and this one."""
        if self.near_tie_rate is None:
            return None
        row = self.hot.first(conn, _NEAR_TIES, {"node": worker, "state": ACCEPTED}) or {}
        cost = (row.get("cost") or 0.0) + msg.near_tie_cost
        judged = (row.get("tokens") or 0) + msg.near_tie_tokens
        allowance = near_tie_allowance(self.near_tie_rate, self.near_tie_slack, judged)
        if cost <= allowance:
            return None
        return (
            f"near-tie ledger: this batch's near-tie cost {msg.near_tie_cost:.2f} would bring the worker's accepted "
            f"batches to {cost:.2f} over {judged} tokens, above its allowance {allowance:.2f} "
            f"(orchestrator.near_tie_rate {self.near_tie_rate:g} x tokens + near_tie_slack {self.near_tie_slack:g})"
        )

    def _should_ban(self, worker: str, now: float) -> bool:
        """Strikes within the window reach ban_after_rejections: rejected batches, expired assignments and
        assignments the node abandoned by leaving the pool (each row is one of these at most)."""
        if self.ban_after_rejections == 0 or self.registry.live[worker].banned:
            return False
        since = now - self.rejection_window_s
        with self.db() as s:
            recent = s.scalar(
                select(func.count())
                .select_from(Work)
                .where(
                    Work.node_key == worker,
                    or_(
                        (Work.state == REJECTED) & (Work.verdict_at > since),
                        Work.expired_at > since,
                        Work.abandoned_at > since,
                    ),
                )
            )
        return recent >= self.ban_after_rejections

    def batches(
        self, status: BatchStatus, min_version: int | None, after: int | None, limit: int, learner: bool
    ) -> tuple[list[dict], int]:
        """Batches by status, oldest first, as the dicts of their BatchRecord (the learner) or PublicBatchRecord
        (anyone else), with the cursor for the next call. Built from Core rows without a model per batch (a poll
        of the learner's cost more in models than in SQL).

        The cursor is the verdict order for accepted and rejected batches and the assignment id for submitted
        and validating ones. A listing changes nothing: the learner's policy announcements say which accepted
        batches its steps took (`PolicyAnnouncement.consumed`), and those leave the async window.
        """
        now = self.clock()
        params = {"min_version": min_version or 0, "after": -1 if after is None else after, "limit": limit}
        if status in (ACCEPTED, REJECTED):
            query, order, params["state"] = _LIST_DECIDED, "verdict_seq", status
        else:
            query, order, params["now"] = _LIST_SUBMITTED[status == "validating"], "id", now
        hot = self.hot
        with hot.begin() as conn:
            rows = hot.rows(conn, query, params)
        records = [batch_dict(w, now, public=not learner) for w in rows]
        cursor = (rows[-1][order] if rows else after) or 0
        return records, cursor


def _status(state: str, claimed_by: str | None, lease_expires: float | None, now: float) -> str:
    if state == SUBMITTED:
        return "validating" if claimed_by is not None and lease_expires > now else "submitted"
    return state


def batch_dict(w: Any, now: float, public: bool) -> dict:
    """The fields of a Work row's BatchRecord (or, `public`, its PublicBatchRecord) as a dict ready for JSON."""
    out = {
        "batch_id": w["batch_id"],
        "node_key": w["node_key"],
        "assignment_id": w["id"],
        "assignment_k": w["k"],
        "version": w["version"],
        "num_samples": w["num_samples"],
        "num_tokens": w["num_tokens"],
        "status": _status(w["state"], w["claimed_by"], w["lease_expires"], now),
        "announced_at": w["announced_at"],
        "verdict_at": w["verdict_at"],
        "verdict_seq": w["verdict_seq"],
    }
    if not public:
        out.update(
            store_path=w["store_path"],
            sha256=w["sha256"],
            claimed_by=w["claimed_by"],
            lease_expires_at=w["lease_expires"],
            validator_key=w["validator_key"],
            failed_checks=w["failed_checks"] or [],
            reason=w["reason"],
            rewards=w["rewards"],
            verified_tokens=w["verified_tokens"],
            assignment_salt=w["salt"],
            assignment_level=w["level"],
            logprobs_sha256=w["logprobs_sha256"],
            near_tie_samples=w["near_tie_samples"] or [],
        )
    return out


def batch_record(w: Any, now: float) -> BatchRecord:
    """The BatchRecord of a Work row (ORM object, or a namespace of a Core row's columns)."""
    status = _status(w.state, w.claimed_by, w.lease_expires, now)
    return BatchRecord(
        batch_id=w.batch_id,
        node_key=w.node_key,
        assignment_id=w.id,
        assignment_k=w.k,
        assignment_salt=w.salt,
        assignment_level=w.level,
        version=w.version,
        store_path=w.store_path,
        sha256=w.sha256,
        num_samples=w.num_samples,
        num_tokens=w.num_tokens,
        status=status,
        announced_at=w.announced_at,
        claimed_by=w.claimed_by,
        lease_expires_at=w.lease_expires,
        validator_key=w.validator_key,
        verdict_at=w.verdict_at,
        verdict_seq=w.verdict_seq,
        failed_checks=w.failed_checks or [],
        reason=w.reason,
        rewards=w.rewards,
        verified_tokens=w.verified_tokens,
        logprobs_sha256=w.logprobs_sha256,
        near_tie_samples=w.near_tie_samples or [],
    )
