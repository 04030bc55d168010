"""The orchestrator's state machines on a fake clock: liveness, lease expiry, pacing by the async window,
automatic bans, the compute challenge, and schema versions. The app runs in process (Starlette's TestClient)
with the real client from bridge.protocol; the clock is injected into both sides."""

import shutil
import sqlite3

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from sqlalchemy import text

from bridge.assignment import assigned_sample_seeds, assigned_task_ids
from bridge.protocol import (
    BatchAnnouncement,
    GpuInfo,
    HardwareReport,
    OrchestratorClient,
    OrchestratorError,
    RetryPolicy,
    Verdict,
    solve_challenge,
)
from intellect.config_io import load_config
from intellect.orchestrator_cli import build_app
from orchestrator.db import SCHEMA_VERSION, SchemaError, open_database, sqlite_url

HW = HardwareReport(cpu_count=2, memory_gib=4)
START = 1_800_000_000.0


class FakeClock:
    def __init__(self):
        self.t = START

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Pool:
    """One in-process service and clients on one fake clock."""

    def __init__(self, tmp_path, **settings):
        self.clock = FakeClock()
        overrides = {
            "run.dir": tmp_path,
            "orchestrator.allow_cpu_nodes": "true",
            "orchestrator.admin_token": "tok",
            "orchestrator.worker_store_writes": "true",  # these tests announce batches themselves
            "orchestrator.heartbeat_interval_s": 2,
            "orchestrator.unhealthy_after_s": 6,
            "orchestrator.dead_after_s": 20,
            "orchestrator.claim_lease_s": 30,
            "trainer.async_level": 1,
            "data.prompts_per_step": 4,
            "data.samples_per_prompt": 2,
            "trainer.batch_size": 8,
            "trainer.micro_batch_size": 8,
            "orchestrator.prompts_per_assignment": 2,
            **settings,
        }
        cfg = load_config(None, [f"--{k}={v}" for k, v in overrides.items()], env={})
        self.app = build_app(cfg, clock=self.clock)
        self.svc = self.app.state.orchestrator
        self.http = TestClient(self.app)
        self.admin = self.client(admin_token="tok")

    def client(self, key=None, admin_token=None) -> OrchestratorClient:
        return OrchestratorClient(
            "http://testserver",
            key=key,
            admin_token=admin_token,
            clock=self.clock,
            retry=RetryPolicy(attempts=1),
            http=self.http,
        )

    def node(self, role: str) -> OrchestratorClient:
        client = self.client(Ed25519PrivateKey.generate())
        assert client.register(role, HW).status == "admitted"
        return client

    def state_of(self, client: OrchestratorClient) -> str:
        return {n.key: n.state for n in self.admin.nodes().nodes}[client.node_key]

    def submit(self, worker: OrchestratorClient, assignment, name: str):
        n = assignment.prompts * assignment.samples_per_prompt
        return worker.announce_batch(
            BatchAnnouncement(
                batch_id=name,
                assignment_id=assignment.id,
                version=assignment.version,
                num_samples=n,
                num_tokens=10 * n,
                store_path=f"file:///store/v{assignment.version:06d}/{name}",
                sha256="ab" * 32,
            )
        )


def test_liveness_healthy_unhealthy_dead_and_back(tmp_path):
    pool = Pool(
        tmp_path,
        **{
            "data.prompts_per_step": 2,
            "trainer.batch_size": 4,
            "trainer.micro_batch_size": 4,
            "trainer.async_level": 0,
            "orchestrator.assignment_deadline_s": 50,
        },
    )  # room for exactly one assignment
    a, b = pool.node("worker"), pool.node("worker")
    [work] = a.heartbeat().assignments
    assert b.heartbeat().assignments == []  # the window is full
    pool.clock.advance(5.9)
    pool.svc.sweep()
    assert pool.state_of(a) == "healthy"
    b.heartbeat()
    pool.clock.advance(0.2)  # a: 6.1 s silent
    pool.svc.sweep()
    assert (pool.state_of(a), pool.state_of(b)) == ("unhealthy", "healthy")
    assert a.heartbeat().state == "healthy"  # a heartbeat brings it back
    pool.clock.advance(19.9)
    b.heartbeat()
    pool.svc.sweep()
    assert pool.state_of(a) == "unhealthy"
    pool.clock.advance(0.2)  # a: 20.1 s silent -> dead; its assignment stays its own until the deadline (50 s)
    pool.svc.sweep()
    assert pool.state_of(a) == "dead"
    assert b.heartbeat().assignments == []
    # a comes back with the batch it finished within the deadline: accepted for validation, not thrown away
    reply = a.heartbeat()
    assert reply.state == "healthy" and [x.id for x in reply.assignments] == [work.id]
    assert pool.submit(a, work, "late-batch").status == "submitted"
    assert b.heartbeat().assignments == []  # the batch holds the window's room until the learner reads it
    metrics = pool.http.get("/metrics").text
    assert 'orchestrator_assignments{state="lost"} 0.0' in metrics
    assert 'orchestrator_assignments{state="submitted"} 1.0' in metrics


def test_validation_lease_expires_to_another_validator(tmp_path):
    pool = Pool(tmp_path)
    worker, v1, v2 = pool.node("worker"), pool.node("validator"), pool.node("validator")
    [work] = worker.heartbeat().assignments
    pool.submit(worker, work, "b0")
    claim = v1.claim()
    assert claim.batch.batch_id == "b0" and claim.lease_expires_at == pytest.approx(START + 30)
    assert v1.claim().batch.batch_id == "b0"  # a repeated claim gets the batch it holds
    assert v2.claim().batch is None
    pool.clock.advance(29)
    assert v2.claim().batch is None
    pool.clock.advance(1.5)
    assert v2.claim().batch.batch_id == "b0"  # v1's lease lapsed
    with pytest.raises(OrchestratorError, match="does not hold its claim") as err:
        v1.verdict("b0", Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=40))
    assert err.value.status == 409
    record = v2.verdict("b0", Verdict(accepted=True, rewards=[1, 0, 0.5, 1], num_tokens=38))
    assert (record.status, record.rewards, record.validator_key) == ("accepted", [1, 0, 0.5, 1], v2.node_key)
    assert v2.verdict("b0", Verdict(accepted=True, rewards=[1, 0, 0.5, 1], num_tokens=38)).verdict_seq == 1
    assert v1.claim().batch is None


def test_pacing_by_the_async_window_and_learner_reads(tmp_path):
    # capacity (1 + 1) x ceil(4 / 2) = 4; fresh workers may fill all of it (unproven_share 1)
    pool = Pool(tmp_path, **{"orchestrator.num_tasks": 100, "orchestrator.unproven_share": 1.0})
    validator = pool.node("validator")
    workers = [pool.node("worker") for _ in range(6)]
    given = {w.node_key: w.heartbeat().assignments for w in workers}
    busy = [w for w in workers if given[w.node_key]]
    assert len(busy) == 4
    for w in busy:  # deterministic prompts and seeds, from (key, version, k)
        [a] = given[w.node_key]
        assert (a.version, a.k) == (0, 0)
        assert a.salt is not None  # the orchestrator's salt of the draws (bridge.assignment)
        assert a.task_ids == assigned_task_ids(w.node_key, 0, 0, 100, 2, a.salt)
        assert a.sample_seeds == assigned_sample_seeds(w.node_key, 0, 0, 4, a.salt)
        assert [x.id for x in w.heartbeat().assignments] == [a.id]  # in-flight limit 1: the same one again
    for i, w in enumerate(busy[:2]):
        pool.submit(w, given[w.node_key][0], f"b{i}")
        validator.claim()
        validator.verdict(f"b{i}", Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=40))
    idle = [w for w in workers if not given[w.node_key]]
    assert all(w.heartbeat().assignments == [] for w in idle)  # accepted but unread still fills the window
    public = pool.client().batches()
    assert [b.batch_id for b in public.batches] == ["b0", "b1"]
    assert all(w.heartbeat().assignments == [] for w in idle)  # a public read is not the learner's
    read, cursor = pool.admin.all_batches(min_version=0, page=1)  # three pages: 1, 1, 0 batches
    assert [b.rewards for b in read] == [[1.0] * 4] * 2 and cursor == 2
    assert all(w.heartbeat().assignments == [] for w in idle)  # read ahead, not trained: still in the window
    assert pool.admin.batches(after=cursor).batches == []
    # the learner's steps took them: its announcement says so (an unknown id and a repeat change nothing)
    policy = pool.admin.announce_policy(1, consumed=["b0", "no-such-batch"])
    assert policy.min_version == 0  # version 0's work is still in the window
    pool.admin.announce_policy(1, consumed=["b0", "b1"])  # the same version again: only the consumption counts
    assert [len(w.heartbeat().assignments) for w in idle] == [1, 1]  # room for two
    # Version 2 with async_level 1: the window is [1, 2]; version-0 work no longer counts.
    policy = pool.admin.announce_policy(2, relays=["http://relay.test:8100"])
    assert (policy.min_version, policy.relays) == (1, ["http://relay.test:8100"])
    w = busy[0]  # its batch b0 was taken, so it has room
    [a] = w.heartbeat(loaded_versions=[0, 1]).assignments
    assert (a.version, a.k) == (2, 0)  # the current version, whichever the worker holds
    assert pool.submit(w, a, "b2").version == 2
    [a] = w.heartbeat().assignments
    assert (a.version, a.k) == (2, 1)
    with pytest.raises(OrchestratorError, match="older than the current version 2"):
        pool.admin.announce_policy(1)
    assert pool.admin.announce_policy(2).announced_at == policy.announced_at  # repeating is a no-op
    validator.claim()
    validator.verdict("b2", Verdict(accepted=False, failed_checks=["sampling"], num_tokens=1))
    cached = pool.svc.scheduler.window_work()
    # w's open one and the idle workers' two of version 1; b2 was rejected; version 0 left the window
    assert cached == pool.svc.scheduler.window_work(recount=True) == 3


def test_listings_page_by_status_version_and_cursor_and_consumption_frees_the_window_once(tmp_path):
    """The learner's pages free nothing (it reads ahead); its announcement frees the window for exactly the accepted
    batches it says its steps took, once; the other statuses list by assignment id; the expected sets are built
    from what the test did, not from the service."""
    pool = Pool(tmp_path, **{"orchestrator.num_tasks": 100, "orchestrator.unproven_share": 1.0})
    validator = pool.node("validator")
    workers = [pool.node("worker") for _ in range(4)]
    work = [(w, a) for w in workers for a in w.heartbeat().assignments]
    assert len(work) == 4
    names = [f"b{i}" for i in range(4)]
    for (w, a), name in zip(work, names):
        pool.submit(w, a, name)
    decided = []
    for accepted in (True, False, True, True):  # b0, b1 (rejected), b2, b3 in claim order
        batch = validator.claim().batch
        decided.append(batch.batch_id)
        verdict = Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=40) if accepted else None
        validator.verdict(batch.batch_id, verdict or Verdict(accepted=False, failed_checks=["toploc"], num_tokens=1))
    accepted = [decided[0], decided[2], decided[3]]
    scheduler = pool.svc.scheduler
    assert scheduler.window_work(recount=True) == 3
    first = pool.admin.batches(limit=1)
    assert [b.batch_id for b in first.batches] == accepted[:1] and first.next_after == 1
    rest = pool.admin.batches(after=first.next_after, limit=10)
    assert [b.batch_id for b in rest.batches] == accepted[1:] and rest.next_after == 4
    assert scheduler.window_work() == scheduler.window_work(recount=True) == 3  # read, not taken: nothing freed
    pool.admin.announce_policy(0, consumed=[accepted[0], decided[1]])  # a rejected one was never in the count
    assert scheduler.window_work() == scheduler.window_work(recount=True) == 2
    pool.admin.announce_policy(0, consumed=accepted)  # taken again: nothing is freed twice
    assert scheduler.window_work() == scheduler.window_work(recount=True) == 0
    again = pool.admin.batches(limit=10)  # read again from the start: the listing is unchanged
    assert [b.batch_id for b in again.batches] == accepted and again.next_after == 4
    assert pool.admin.batches(after=4).batches == [] and pool.admin.batches(after=4).next_after == 4
    assert pool.admin.batches(min_version=1).batches == []
    assert [b.batch_id for b in pool.admin.batches(status="rejected").batches] == [decided[1]]
    # Submitted and validating: by assignment id, the live claim decides which.
    more = [(w, a) for w in workers for a in w.heartbeat().assignments]
    assert more, "the window has room again"
    for i, (w, a) in enumerate(more):
        pool.submit(w, a, f"c{i}")
    ids = sorted(a.id for _, a in more)
    submitted = pool.admin.batches(status="submitted", limit=1000)
    assert [b.assignment_id for b in submitted.batches] == ids and submitted.next_after == ids[-1]
    held = validator.claim().batch
    assert [b.batch_id for b in pool.admin.batches(status="validating").batches] == [held.batch_id]
    assert held.assignment_id not in [b.assignment_id for b in pool.admin.batches(status="submitted").batches]
    paged = pool.admin.batches(status="submitted", after=ids[0], limit=1)
    assert [b.assignment_id for b in paged.batches] == [i for i in ids if i != held.assignment_id and i > ids[0]][:1]
    pool.clock.advance(31)  # the lease lapses: submitted again
    assert held.assignment_id in [b.assignment_id for b in pool.admin.batches(status="submitted").batches]
    assert pool.admin.batches(status="validating").batches == []


def test_rejections_within_the_window_ban_the_worker_and_fill_the_ledger(tmp_path):
    pool = Pool(
        tmp_path,
        **{
            "orchestrator.ban_after_rejections": 2,
            "orchestrator.rejection_window_s": 100,
            "orchestrator.max_inflight_per_node": 4,
            "orchestrator.unproven_share": 1.0,
        },
    )
    worker, validator = pool.node("worker"), pool.node("validator")
    works = [worker.heartbeat().assignments[-1] for _ in range(4)]
    assert len({w.id for w in works}) == 4
    verdicts = [(150, ["toploc"], ""), (10, ["toploc", "sampling"], ""), (0, [], "empty completions")]
    for i, (wait, checks, reason) in enumerate(verdicts):
        worker.heartbeat()
        pool.submit(worker, works[i], f"bad{i}")
        validator.claim()
        validator.verdict(f"bad{i}", Verdict(accepted=False, failed_checks=checks, reason=reason, num_tokens=40))
        pool.clock.advance(wait)
        if i == 0:  # the first rejection is 150 s old, outside the 100 s window, when the second comes
            continue
        if i == 1:
            assert worker.heartbeat().state == "healthy"
    with pytest.raises(OrchestratorError, match="banned: automatic: 2 rejected batches within 100 s") as err:
        worker.heartbeat()
    assert err.value.status == 403
    [entry] = [e for e in pool.admin.ledger().entries if e.node_key == worker.node_key]
    assert (entry.rejected_batches, entry.banned) == (3, True)
    assert entry.rejection_reasons == {"toploc": 2, "sampling": 1, "empty completions": 1}
    metrics = pool.http.get("/metrics").text  # the banned worker's open work was released
    assert 'orchestrator_assignments{state="open"} 0.0' in metrics
    assert 'orchestrator_assignments{state="lost"} 0.0' not in metrics


def test_hardware_below_the_pool_requirements_is_refused_with_reasons(tmp_path):
    pool = Pool(
        tmp_path,
        **{
            "orchestrator.allow_cpu_nodes": "false",
            "orchestrator.min_gpus": 2,
            "orchestrator.min_gpu_memory_gib": 40,
            "orchestrator.challenge_size": 0,
        },
    )  # (on by default without CPU nodes)
    node = pool.client(Ed25519PrivateKey.generate())
    reply = node.register("worker", HW)
    assert reply.status == "refused" and "CPU-only" in reply.reasons[0]
    assert (reply.requirements.min_gpus, reply.requirements.min_gpu_memory_gib) == (2, 40)
    small = HardwareReport(gpus=[GpuInfo(name="T4", memory_gib=16)] * 2, cpu_count=8, memory_gib=64)
    assert "T4 (16 GiB)" in node.register("worker", small).reasons[0]
    with pytest.raises(OrchestratorError, match="register first"):  # a refused node is not stored
        node.heartbeat()
    big = HardwareReport(gpus=[GpuInfo(name="H100", memory_gib=80)] * 2, cpu_count=8, memory_gib=64)
    assert node.register("worker", big).status == "admitted"


def test_compute_challenge_admits_only_a_right_and_timely_answer(tmp_path):
    pool = Pool(tmp_path, **{"orchestrator.challenge_size": 32, "orchestrator.challenge_timeout_s": 5})
    node = pool.client(Ed25519PrivateKey.generate())
    first = node.register("worker", HW)
    assert first.status == "challenge" and first.challenge.size == 32
    with pytest.raises(OrchestratorError, match="not admitted yet") as err:
        node.heartbeat()
    assert err.value.status == 403
    wrong = node.register("worker", HW, challenge_answer="00" * 32)
    assert wrong.status == "refused" and "wrong challenge answer" in wrong.reasons[0]
    late = node.register("worker", HW)
    pool.clock.advance(6)
    refused = node.register("worker", HW, challenge_answer=solve_challenge(late.challenge.seed, 32))
    assert refused.status == "refused" and "after its deadline" in refused.reasons[0]
    fresh = node.register("worker", HW)
    ok = node.register("worker", HW, challenge_answer=solve_challenge(fresh.challenge.seed, 32))
    assert ok.status == "admitted" and node.heartbeat().state == "healthy"


def test_a_schema_3_database_gains_the_claim_queue_and_listing_indexes(tmp_path):
    """The claim queries and the learner's listing of accepted batches use them (SQLite's plan): none scans or
    sorts the backlog."""
    from orchestrator.scheduler import _HELD_CLAIM, _LIST_DECIDED, _NEXT_CLAIM

    url = sqlite_url(tmp_path / "o.db")
    with open_database(url).begin() as conn:  # as schema 3 left it
        for name in ("ix_work_claim_queue", "ix_work_claimed_by", "ix_work_state_seq"):
            conn.execute(text(f"DROP INDEX {name}"))
        conn.execute(text("UPDATE schema_info SET version = 3"))
    engine = open_database(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version FROM schema_info")).scalar_one() == SCHEMA_VERSION
        names = {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'index'"))}
        assert {"ix_work_claim_queue", "ix_work_claimed_by", "ix_work_state_seq"} <= names
        for query, index in (
            (_HELD_CLAIM, ("ix_work_claim_queue", "ix_work_claimed_by")),
            (_NEXT_CLAIM, ("ix_work_claim_queue", "ix_work_claimed_by")),
            (_LIST_DECIDED, ("ix_work_state_seq",)),
        ):
            compiled = query.compile(engine)  # SQLite's positional parameters: any values do for a plan
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", tuple(0 for _ in compiled.positiontup))
            plan = " | ".join(row[-1] for row in rows)
            assert "TEMP B-TREE" not in plan and any(name in plan for name in index), plan


def test_schema_is_created_upgraded_or_refused(tmp_path):
    url = sqlite_url(tmp_path / "o.db")
    with open_database(url).connect() as conn:
        assert conn.execute(text("SELECT version FROM schema_info")).scalar_one() == SCHEMA_VERSION
    older = SCHEMA_VERSION - 1
    with open_database(url).begin() as conn:
        conn.execute(text("UPDATE schema_info SET version = :v"), {"v": older})
    with pytest.raises(SchemaError, match=f"schema version {older} and this release cannot upgrade"):
        open_database(url, migrations={})
    ran = []
    engine = open_database(url, migrations={older: lambda conn: ran.append(conn.execute(text("SELECT 1")).scalar())})
    with engine.connect() as conn:
        assert ran == [1] and conn.execute(text("SELECT version FROM schema_info")).scalar_one() == SCHEMA_VERSION
        conn.execute(text("UPDATE schema_info SET version = 99"))
        conn.commit()
    with pytest.raises(SchemaError, match="written by a newer orchestrator"):
        open_database(url)
    foreign = sqlite_url(tmp_path / "other.db")
    with open_database(foreign).begin() as conn:
        conn.execute(text("DROP TABLE schema_info"))
    with pytest.raises(SchemaError, match="not an orchestrator database"):
        open_database(foreign)


def test_a_reply_after_a_write_waits_for_the_wal_fsync(tmp_path):
    pool = Pool(tmp_path)
    wal = pool.svc.wal
    fsyncs = []
    real = wal._fsync
    wal._fsync = lambda: (fsyncs.append(wal.wal_path.stat().st_size), real())[1]
    worker = pool.node("worker")  # register commits
    assert len(fsyncs) == 1 and fsyncs[0] > 0
    [a] = worker.heartbeat().assignments  # issues an assignment: a commit
    assert len(fsyncs) == 2
    worker.heartbeat()  # the same open assignment: nothing written, nothing to wait for
    pool.client().policy()
    assert len(fsyncs) == 2
    pool.submit(worker, a, "durable")
    assert len(fsyncs) == 3 and fsyncs[2] > fsyncs[1]  # the WAL grew by the announcement before it was synced


def test_checkpoints_run_off_the_request_path_and_reach_the_database_file(tmp_path, monkeypatch):
    """The service's connections never checkpoint inside a commit; WalSync's checkpoint copies the WAL into the
    database file (read here from a copy of that file alone, without its -wal)."""
    from orchestrator import durability

    # the flusher's own timed checkpoint (every second) would fire on a loaded machine before the first look
    monkeypatch.setattr(durability, "CHECKPOINT_EVERY_S", 1e9)
    pool = Pool(tmp_path)
    workers = [pool.node("worker") for _ in range(3)]
    db_file = pool.svc.wal.db_path

    def nodes_in_file_alone() -> int:
        copy = tmp_path / "copy.db"
        shutil.copyfile(db_file, copy)
        conn = sqlite3.connect(copy)
        try:
            return conn.execute("SELECT count(*) FROM nodes").fetchone()[0]
        except sqlite3.OperationalError:  # not even the tables have reached the file
            return 0
        finally:
            conn.close()
            copy.unlink()

    assert nodes_in_file_alone() == 0
    pool.svc.wal.checkpoint()
    assert nodes_in_file_alone() == len(workers)


def test_verdict_order_continues_across_a_restart(tmp_path):
    pool = Pool(tmp_path)
    worker, validator = pool.node("worker"), pool.node("validator")
    for name in ("first", "second"):
        [work] = worker.heartbeat().assignments
        pool.submit(worker, work, name)
        assert validator.claim().batch.batch_id == name
        validator.verdict(name, Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=40))
    pool.svc.close()
    again = Pool(tmp_path)  # the same database, a new service
    worker, validator = again.client(worker.key), again.client(validator.key)
    [work] = worker.heartbeat().assignments
    again.submit(worker, work, "third")
    assert validator.claim().batch.batch_id == "third"
    record = validator.verdict("third", Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=40))
    assert record.verdict_seq == 3
    assert [b.batch_id for b in again.admin.batches("accepted").batches] == ["first", "second", "third"]


def test_an_unexpected_error_in_a_fast_route_is_a_500_and_the_service_goes_on(tmp_path, monkeypatch):
    pool = Pool(tmp_path)
    validator = pool.node("validator")

    def broken(*_args):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(pool.svc.scheduler, "claim", broken)
    with pytest.raises(OrchestratorError, match="HTTP 500"):  # a 5xx is retried, then given up on
        validator.claim()
    monkeypatch.undo()
    assert validator.claim().batch is None
    assert validator.heartbeat().state == "healthy"


def test_only_listed_keys_validate_and_a_deregistered_node_stays_dead_until_it_beats(tmp_path):
    from bridge.protocol import public_key_hex

    trusted = Ed25519PrivateKey.generate()
    pool = Pool(tmp_path, **{"orchestrator.validator_keys": f'["{public_key_hex(trusted)}"]'})
    stranger = pool.client(Ed25519PrivateKey.generate())
    reply = stranger.register("validator", HW)
    assert reply.status == "refused" and "validator_keys" in reply.reasons[0]
    assert stranger.register("worker", HW).status == "admitted"  # anyone may still work
    assert pool.client(trusted).register("validator", HW).status == "admitted"

    worker = pool.node("worker")
    held = worker.heartbeat([0]).assignments
    assert len(held) == 1
    info = worker.deregister()
    assert info.state == "dead" and info.open_assignments == 0
    pool.clock.advance(1)
    pool.svc.sweep()
    assert pool.state_of(worker) == "dead"  # no silence-based revival
    assert worker.heartbeat([0]).state == "healthy"


def test_heartbeat_times_are_written_behind_in_turns_each_within_flush_s(tmp_path):
    """Every node's last heartbeat reaches the database within FLUSH_S (+ one sweep), and a sweep writes only the
    nodes whose turn it is: about a fifth of the pool per one-second sweep, never all of it at once."""
    from orchestrator.db import Node
    from orchestrator.nodes import FLUSH_S

    pool = Pool(tmp_path)
    nodes = [pool.node("worker") for _ in range(40)]
    written: list[int] = []
    for second in range(12):
        beat_at = pool.clock.t
        for node in nodes:
            node.heartbeat()
        pool.clock.advance(1.0)
        with pool.svc.db() as s:
            stored = dict(s.query(Node.key, Node.last_seen))
        written.append(sum(stored[n.node_key] == beat_at for n in nodes))
        pool.svc.sweep()
        with pool.svc.db() as s:
            stored = dict(s.query(Node.key, Node.last_seen))
        written[-1] = sum(stored[n.node_key] == beat_at for n in nodes) - written[-1]
        if second >= FLUSH_S + 1:  # every node's time is at most FLUSH_S + 1 sweep old in the database
            assert all(beat_at - stored[n.node_key] <= FLUSH_S + 1 for n in nodes), second
    assert max(written) <= len(nodes) // 2, written  # turns are spread: no sweep writes the whole pool
    assert sum(written[1:]) >= 2 * len(nodes), written  # yet every node keeps being written


def test_a_silent_node_is_healthy_at_its_heartbeat_and_in_the_database_within_flush_s(tmp_path):
    from sqlalchemy import event

    from orchestrator.db import Node
    from orchestrator.nodes import FLUSH_S

    pool = Pool(tmp_path)
    node = pool.node("validator")  # a worker's heartbeat may issue an assignment, which commits
    pool.clock.advance(7.0)  # silent past unhealthy_after_s (6 s)
    pool.svc.sweep()

    def stored() -> str:
        with pool.svc.db() as s:
            return s.get(Node, node.node_key).state

    assert pool.state_of(node) == stored() == "unhealthy"
    commits = []
    event.listen(pool.svc.engine, "commit", lambda _conn: commits.append(1))
    assert node.heartbeat().state == "healthy" and pool.state_of(node) == "healthy"
    assert commits == []  # no commit of its own: the pool's heartbeats after an outage come all at once
    for _ in range(int(FLUSH_S) + 1):  # heartbeating each second, written behind at the node's turn
        pool.clock.advance(1.0)
        node.heartbeat()
        pool.svc.sweep()
    assert stored() == "healthy"
    pool.clock.advance(7.0)
    pool.svc.sweep()
    assert stored() == "unhealthy"  # a change the sweep makes is written through at once
