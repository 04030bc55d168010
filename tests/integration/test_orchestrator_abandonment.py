"""Issue 36, item 1: selective submission through abandonment. Each attack as a cheating worker would try it
against the in-process service on a fake clock (the Pool of test_orchestrator_state), and what it costs:

- leaving and rejoining to throw assignments away: a strike per assignment given up, banned like expiring;
- going silent: the assignment stays the node's (no new draw when it comes back) and its lapse is a strike;
- announcing an assignment after it was lost or expired: refused (410), never validated;
- claiming to hold only an older version: the orchestrator still assigns the current one;
- the ledger, its CSV, the dashboard and the metrics count what was given up.

An honest worker that announces before its deadline is accepted, even after the service took it for dead.
"""

import csv
import io
import sqlite3

import pytest
from test_orchestrator_state import START, Pool

from bridge.assignment import assigned_sample_seeds
from bridge.protocol import OrchestratorError
from orchestrator.db import SCHEMA_VERSION

STRIKES = {
    "orchestrator.ban_after_rejections": 2,
    "orchestrator.rejection_window_s": 1000,
    "orchestrator.assignment_deadline_s": 100,
    "orchestrator.unproven_share": 1.0,
    "orchestrator.public_cache_s": 0,  # the ledger is read twice within a test
}


def test_leaving_and_rejoining_to_discard_assignments_is_banned_like_expiring(tmp_path):
    pool = Pool(tmp_path, **STRIKES)
    leaver, expirer = pool.node("worker"), pool.node("worker")
    [first] = leaver.heartbeat().assignments
    assert (first.version, first.k) == (0, 0)
    assert leaver.deregister().open_assignments == 0
    [second] = leaver.heartbeat().assignments  # back at once, with a fresh draw: the next k, never k again
    assert (second.version, second.k) == (0, 1)
    assert second.sample_seeds == assigned_sample_seeds(leaver.node_key, 0, 1, 4, second.salt) != first.sample_seeds
    [entry] = [e for e in pool.admin.ledger().entries if e.node_key == leaver.node_key]
    assert (entry.lost_assignments, entry.banned) == (1, False)  # one strike, under ban_after_rejections 2
    leaver.deregister()
    with pytest.raises(OrchestratorError, match="banned: automatic") as err:
        leaver.heartbeat()
    assert err.value.status == 403 and "abandoned" in str(err.value.detail)

    # The same two strikes by letting assignments expire ban the same way.
    expirer.heartbeat()
    pool.clock.advance(100)
    pool.svc.sweep()
    [again] = expirer.heartbeat().assignments
    assert again.k == 1
    pool.clock.advance(100)
    pool.svc.sweep()
    with pytest.raises(OrchestratorError, match="banned: automatic") as err:
        expirer.heartbeat()
    assert err.value.status == 403

    ledger = {e.node_key: e for e in pool.admin.ledger().entries}
    assert (ledger[leaver.node_key].lost_assignments, ledger[leaver.node_key].expired_assignments) == (2, 0)
    assert (ledger[expirer.node_key].lost_assignments, ledger[expirer.node_key].expired_assignments) == (0, 2)
    rows = {r["node_key"]: r for r in csv.DictReader(io.StringIO(pool.admin.ledger_csv()))}
    assert (rows[leaver.node_key]["lost_assignments"], rows[expirer.node_key]["lost_assignments"]) == ("2", "0")
    page = pool.http.get("/").text
    row = page.split(f'<tr id="ledger-{leaver.node_key}">')[1].split("</tr>")[0]
    assert row.endswith('<td class="n">2</td><td class="n">0</td>')  # lost, expired
    assert 'id="assignments-lost">2<' in page
    assert 'orchestrator_assignments{state="lost"} 2.0' in pool.http.get("/metrics").text


def test_a_silent_worker_keeps_its_assignment_and_its_lapse_is_a_strike(tmp_path):
    pool = Pool(tmp_path, **STRIKES)
    silent, honest, validator = pool.node("worker"), pool.node("worker"), pool.node("validator")
    [held] = silent.heartbeat().assignments
    [slow] = honest.heartbeat().assignments
    pool.clock.advance(21)  # both silent past dead_after_s (20 s)
    pool.svc.sweep()
    assert pool.state_of(silent) == pool.state_of(honest) == "dead"
    # The honest one was generating: it announces before its deadline and is taken, with no strike.
    assert pool.submit(honest, slow, "slow-but-in-time").status == "submitted"
    validator.claim()
    assert validator.verdict("slow-but-in-time", _accept()).status == "accepted"
    # The silent one comes back: the same assignment, not a new draw.
    assert [(a.id, a.k) for a in silent.heartbeat().assignments] == [(held.id, 0)]
    pool.clock.advance(80)  # 101 s after it was issued: past its 100 s deadline
    pool.svc.sweep()
    [fresh] = silent.heartbeat().assignments
    assert fresh.k == 1 and fresh.id != held.id
    ledger = {e.node_key: e for e in pool.admin.ledger().entries}
    assert (ledger[silent.node_key].expired_assignments, ledger[honest.node_key].expired_assignments) == (1, 0)
    pool.clock.advance(100)  # the second lapse within rejection_window_s: banned
    pool.svc.sweep()
    with pytest.raises(OrchestratorError, match="banned: automatic"):
        silent.heartbeat()
    assert honest.heartbeat().state == "healthy"


def test_announcing_a_lost_or_expired_assignment_is_refused(tmp_path):
    pool = Pool(tmp_path, **{**STRIKES, "orchestrator.ban_after_rejections": 0})
    worker = pool.node("worker")
    [lost] = worker.heartbeat().assignments
    worker.deregister()
    with pytest.raises(OrchestratorError) as err:
        pool.submit(worker, lost, "after-leaving")
    assert err.value.status == 410
    assert f"assignment {lost.id}" in str(err.value.detail) and "left the pool" in str(err.value.detail)
    [expired] = worker.heartbeat().assignments
    pool.clock.advance(100)
    pool.svc.sweep()
    with pytest.raises(OrchestratorError) as err:
        pool.submit(worker, expired, "after-the-deadline")
    assert err.value.status == 410
    assert f"assignment {expired.id}" in str(err.value.detail) and "expired" in str(err.value.detail)
    # Past the deadline but before the sweep marked it: refused all the same.
    [late] = worker.heartbeat().assignments
    assert late.expires_at == pytest.approx(START + 200)
    pool.clock.advance(100)
    with pytest.raises(OrchestratorError, match=f"assignment {late.id}.*deadline") as err:
        pool.submit(worker, late, "at-the-deadline")
    assert err.value.status == 410
    listed = {b.batch_id for s in ("submitted", "accepted", "rejected") for b in pool.admin.batches(s).batches}
    assert listed == set()  # nothing of it reached validation
    assert 'orchestrator_assignments{state="submitted"} 0.0' in pool.http.get("/metrics").text


def test_a_worker_claiming_an_older_version_cannot_choose_the_version(tmp_path):
    pool = Pool(tmp_path, **STRIKES)
    for version in (1, 2):
        pool.admin.announce_policy(version)
    assert pool.client().policy().min_version == 1  # async_level 1: versions 1 and 2 train
    worker = pool.node("worker")
    [a] = worker.heartbeat(loaded_versions=[1]).assignments
    assert (a.version, a.k) == (2, 0)
    assert a.sample_seeds == assigned_sample_seeds(worker.node_key, 2, 0, 4, a.salt)
    with pytest.raises(OrchestratorError) as err:  # the batch must be at the assignment's version
        pool.submit(worker, a.model_copy(update={"version": 1}), "at-my-version")
    assert err.value.status == 422 and "assignment" in str(err.value.detail)


def test_a_schema_5_database_gains_abandoned_at_and_its_lost_work_is_no_strike(tmp_path):
    """Work lost before the upgrade was no strike then (a node that died lost it too): it stays none."""
    pool = Pool(tmp_path, **STRIKES)
    worker = pool.node("worker")
    worker.heartbeat()
    worker.deregister()
    pool.svc.close()
    conn = sqlite3.connect(tmp_path / "orchestrator.db")  # as schema 5 left it
    conn.execute("ALTER TABLE assignments DROP COLUMN abandoned_at")
    conn.execute("UPDATE schema_info SET version = 5")
    conn.commit()
    conn.close()
    again = Pool(tmp_path, **STRIKES)
    worker = again.client(worker.key)
    [entry] = [e for e in again.admin.ledger().entries if e.node_key == worker.node_key]
    assert entry.lost_assignments == 0
    metrics = again.http.get("/metrics").text
    assert 'orchestrator_assignments{state="lost"} 1.0' in metrics  # still lost, no strike
    worker.heartbeat()
    worker.deregister()
    [entry] = [e for e in again.admin.ledger().entries if e.node_key == worker.node_key]
    assert (entry.lost_assignments, entry.banned) == (1, False)  # one strike of two
    with sqlite3.connect(tmp_path / "orchestrator.db") as conn:
        assert conn.execute("SELECT version FROM schema_info").fetchone() == (SCHEMA_VERSION,)


def _upload_through(pool):
    """`upload_batch` as the worker calls it, sent to the in-process service (TestClient) on the pool's clock."""
    from bridge.protocol import BatchRecord
    from bridge.protocol.signing import sign_request

    def upload(base_url, key, assignment_id, batch_id, sha256, length, pieces, **_):
        target = f"/v1/uploads/{assignment_id}/{batch_id}"
        stamp = int(pool.clock() * 1000)
        headers = {"X-Batch-Sha256": sha256, **sign_request(key, "PUT", target, b"", stamp, body_sha256=sha256)}
        reply = pool.http.put(target, content=b"".join(bytes(p) for p in pieces), headers=headers)
        if reply.status_code >= 300:
            raise OrchestratorError(reply.status_code, reply.json()["detail"], "PUT", target)
        return BatchRecord.model_validate_json(reply.content)

    return upload


def test_the_worker_takes_a_refused_upload_as_done_and_goes_on(tmp_path, monkeypatch):
    from test_uploads import make_batch

    import gpu_workers.worker
    from bridge.protocol import HardwareReport, load_or_create_key
    from bridge.shardcast.config import ShardcastConfig
    from gpu_workers.config import DataConfig, WorkerConfig
    from gpu_workers.tasks.dataset import Task, TaskDataset
    from gpu_workers.worker import Worker

    pool = Pool(tmp_path / "pool", **STRIKES)
    tasks = TaskDataset([Task(prompt="1 2", reward="sort")])
    worker = Worker(
        WorkerConfig(),
        DataConfig(),
        ShardcastConfig(),
        tasks,
        key_path=tmp_path / "worker.key",
        weights_dir=tmp_path / "weights",
        outbox=tmp_path / "outbox",
    )
    worker.client = pool.client(load_or_create_key(tmp_path / "worker.key"))
    monkeypatch.setattr(gpu_workers.worker, "upload_batch", _upload_through(pool))

    def in_outbox(a) -> None:  # made by an earlier run: the worker uploads it without generating
        worker.outbox.write(make_batch(worker.node_key, a, seed=a.id))

    assert worker.client.register("worker", HardwareReport(cpu_count=2, memory_gib=4)).status == "admitted"
    [late] = worker.client.heartbeat().assignments
    in_outbox(late)
    pool.clock.advance(100)
    pool.svc.sweep()
    assert worker.submit(late) is True  # refused (410): done with it, not a crash
    assert worker.outbox.list() == []  # and dropped from the outbox
    [fresh] = worker.client.heartbeat().assignments
    in_outbox(fresh)
    assert worker.submit(fresh) is True
    submitted = [b.batch_id for b in pool.admin.batches("submitted").batches]
    assert submitted == [worker.batch_id(fresh)]
    other = fresh.model_copy(update={"id": 10**6})
    in_outbox(other)
    with pytest.raises(OrchestratorError) as err:  # any other refusal still ends the worker
        worker.submit(other)
    assert err.value.status == 404


def _accept():
    from bridge.protocol import Verdict

    return Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=40)
