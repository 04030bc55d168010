"""The scheduler's hot statements on SQLite's own connection (orchestrator.db.HotPath) against SQLAlchemy's
ordinary execution of the same statements: the same rows (JSON and NULL columns included), the same writes, the
same transactions (a write commits once and fires the commit event that durability.py listens to, a read-only
block commits nothing, an error rolls back); and the whole work flow through both, `direct` on and off (the
path PostgreSQL takes)."""

import pytest
from sqlalchemy import event, select
from test_orchestrator_state import Pool

from bridge.protocol import Verdict
from orchestrator import scheduler as sched
from orchestrator.db import OPEN, SUBMITTED, HotPath, Node, Work, open_database, sqlite_url

STATEMENTS = [
    (sched._BY_ID, {"wid": 2}),
    (sched._BY_ID, {"wid": 99}),
    (sched._BY_BATCH, {"batch": "b-1"}),
    (sched._ID_OF_BATCH, {"batch": "b-2"}),
    (sched._COUNT_K, {"key": "a" * 64, "version": 3}),
    (sched._HELD_CLAIM, {"key": "v" * 64, "now": 150.0}),
    (sched._NEXT_CLAIM, {"now": 150.0}),
    (sched._NEXT_CLAIM, {"now": 50.0}),
]


def _rows(n: int = 4) -> list[dict]:
    out = []
    for i in range(n):
        out.append(
            dict(
                node_key="a" * 64,
                version=3,
                k=i,
                prompts=2,
                samples_per_prompt=2,
                state=SUBMITTED if i else OPEN,
                issued_at=10.0 + i,
                batch_id=f"b-{i}" if i else None,
                store_path=f"file:///s/v000003/b-{i}" if i else None,
                sha256="ab" * 32 if i else None,
                num_samples=4 if i else None,
                num_tokens=2**40 + i if i else None,  # a BigInteger past 32 bits
                announced_at=20.0 - i if i else None,
                claimed_by="v" * 64 if i == 2 else None,
                lease_expires=100.0 if i == 2 else None,
                failed_checks=["toploc", "sampling"] if i == 3 else None,
                rewards=[0.5, -1.25, 1e-300, 3.0] if i == 3 else None,
            )
        )
    return out


@pytest.fixture
def engine(tmp_path):
    engine = open_database(sqlite_url(tmp_path / "o.db"))
    with engine.begin() as conn:
        nodes = [
            {"key": k * 64, "role": "worker", "state": "healthy", "hardware": {}, "first_seen": 0.0, "last_seen": 0.0}
            for k in "av"
        ]
        conn.execute(Node.__table__.insert(), nodes)
        conn.execute(Work.__table__.insert(), _rows())
    yield engine
    engine.dispose()


@pytest.mark.parametrize("stmt,params", STATEMENTS, ids=[f"{i}" for i in range(len(STATEMENTS))])
def test_a_hot_select_returns_what_sqlalchemy_returns(engine, stmt, params):
    with engine.connect() as conn:
        expected = [dict(row._mapping) for row in conn.execute(stmt, params)]
    hot = HotPath(engine)
    assert hot.direct  # SQLite: the driver's connection
    with hot.begin() as conn:
        got = [dict(row) for row in hot.rows(conn, stmt, params)]
    assert got == expected
    assert [type(v) for r in got for v in r.values()] == [type(v) for r in expected for v in r.values()]
    hot.close()


def test_hot_writes_land_as_sqlalchemys_do_and_commit_once(engine):
    commits = []
    event.listen(engine, "commit", lambda conn: commits.append(1))
    hot = HotPath(engine)
    row = {**_rows(1)[0], "k": 7}
    with hot.begin() as conn:
        new_id = hot.write(conn, sched._INSERT, row)
        hot.write(
            conn,
            sched._UPDATE,
            {"wid": new_id, "state": "accepted", "rewards": [1.0, 0.0], "failed_checks": [], "reason": None},
        )
    assert len(commits) == 1
    with engine.connect() as conn:  # another connection sees it: committed
        stored = conn.execute(select(Work.__table__).where(Work.id == new_id)).one()._mapping
    assert (stored["k"], stored["state"], stored["rewards"], stored["failed_checks"]) == (7, "accepted", [1.0, 0.0], [])
    assert new_id == 5  # after the fixture's 4 rows

    with hot.begin() as conn:  # only reads: nothing to commit, so no reply waits for an fsync
        assert hot.scalar(conn, sched._COUNT_K, {"key": "a" * 64, "version": 3}) == 5
    assert len(commits) == 1

    with pytest.raises(RuntimeError), hot.begin() as conn:  # an error rolls the transaction back
        hot.write(conn, sched._UPDATE, {"wid": new_id, "state": "rejected"})
        raise RuntimeError("boom")
    with engine.connect() as conn:
        assert conn.execute(select(Work.state).where(Work.id == new_id)).scalar() == "accepted"
    assert len(commits) == 1
    hot.close()


@pytest.mark.parametrize("direct", [True, False])
def test_the_work_flow_and_its_k_counters_through_either_path(tmp_path, direct, monkeypatch):
    real_init = HotPath.__init__
    monkeypatch.setattr(HotPath, "__init__", lambda self, engine, d=direct: real_init(self, engine, direct=d))
    pool = Pool(tmp_path)
    assert pool.svc.scheduler.hot.direct is direct
    worker, validator = pool.node("worker"), pool.node("validator")
    assert validator.claim().batch is None  # nothing submitted: the claim commits nothing
    for name in ("first", "second"):
        [work] = worker.heartbeat().assignments
        pool.submit(worker, work, name)
        claim = validator.claim()
        assert claim.batch.batch_id == name and claim.batch.status == "validating"
        record = validator.verdict(name, Verdict(accepted=True, rewards=[1.0, 0.5, 0.0, 2.0], num_tokens=40))
        assert record.rewards == [1.0, 0.5, 0.0, 2.0] and record.status == "accepted"
    assert [(a.version, a.k) for a in [work]] == [(0, 1)]
    pool.svc.close()

    again = Pool(tmp_path)  # a restart: k at version 0 continues from the database's count
    worker = again.client(worker.key)
    [work] = worker.heartbeat().assignments
    assert (work.version, work.k) == (0, 2)
    again.admin.announce_policy(1)
    again.submit(worker, work, "third")
    [work] = worker.heartbeat().assignments
    assert (work.version, work.k) == (1, 0)  # newer than any assignment at the start: 0, nothing to count
    with again.svc.engine.connect() as conn:
        ks = conn.execute(select(Work.version, Work.k).order_by(Work.id)).all()
    assert [tuple(r) for r in ks] == [(0, 0), (0, 1), (0, 2), (1, 0)]


def test_a_failed_commit_loses_its_write_and_the_next_transaction_works(engine, monkeypatch):
    hot = HotPath(engine)
    with hot.begin() as conn:
        hot.write(conn, sched._UPDATE, {"wid": 1, "reason": "first"})
    real_commit = engine.dialect.do_commit

    def failing_commit(dbapi_connection):
        raise OSError("disk full")

    monkeypatch.setattr(engine.dialect, "do_commit", failing_commit)
    with pytest.raises(Exception, match="disk full"), hot.begin() as conn:
        hot.write(conn, sched._UPDATE, {"wid": 1, "reason": "lost"})
    monkeypatch.setattr(engine.dialect, "do_commit", real_commit)
    with hot.begin() as conn:  # the held connection (or its replacement) takes the next transaction
        hot.write(conn, sched._UPDATE, {"wid": 2, "reason": "next"})
    with engine.connect() as conn:
        reasons = dict(conn.execute(select(Work.id, Work.reason).where(Work.id.in_([1, 2]))).all())
    assert reasons == {1: "first", 2: "next"}  # the write whose commit failed did not ride on the next commit
    hot.close()
