"""The orchestrator on PostgreSQL: a throwaway cluster (initdb, pg_ctl) on 127.0.0.1, the work flow through the
real client, a restart on the same database. Skipped where the PostgreSQL server binaries or the psycopg
driver are missing."""

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from helpers import free_port

from bridge.protocol import BatchAnnouncement, HardwareReport, OrchestratorClient, RetryPolicy, Verdict
from intellect.config_io import load_config
from intellect.orchestrator_cli import build_app

INITDB, PG_CTL = shutil.which("initdb"), shutil.which("pg_ctl")
pytest.importorskip("psycopg", reason="PostgreSQL driver psycopg not installed")
pytestmark = pytest.mark.skipif(not (INITDB and PG_CTL), reason="PostgreSQL server binaries (initdb, pg_ctl) not found")


def _as_postgres_user(argv):
    """PostgreSQL refuses to run as root: run it as the `postgres` account then."""
    if os.geteuid() != 0:
        return argv
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root without a postgres account to run the server as")
    return ["runuser", "-u", "postgres", "--", *argv]


@pytest.fixture(scope="module")
def postgres_url():
    root = Path(tempfile.mkdtemp(prefix="intellect-pg-"))  # not under pytest's tmp: the postgres user must reach it
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port = root / "data", free_port()
    run = lambda argv: subprocess.run(_as_postgres_user(argv), capture_output=True, text=True, timeout=120)
    init = run([INITDB, "-D", str(data), "-A", "trust", "-U", "postgres"])
    assert init.returncode == 0, init.stderr
    start = run(
        [
            PG_CTL,
            "-D",
            str(data),
            "-l",
            str(root / "log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1",
            "start",
        ]
    )
    assert start.returncode == 0, start.stderr + (root / "log").read_text()
    yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    run([PG_CTL, "-D", str(data), "-m", "immediate", "stop"])
    shutil.rmtree(root, ignore_errors=True)


def test_work_flow_and_restart_on_postgresql(postgres_url, tmp_path):
    cfg = load_config(
        None,
        [
            f"--run.dir={tmp_path}",
            "--orchestrator.allow_cpu_nodes=true",
            "--orchestrator.worker_store_writes=true",
            "--orchestrator.admin_token=tok",
        ],
        env={},
    )
    hw = HardwareReport(cpu_count=1, memory_gib=1)
    worker_key, validator_key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    for round_ in range(2):  # the second round is a restart on the same database
        app = build_app(cfg, database_url=postgres_url)
        assert app.state.orchestrator.wal is None  # PostgreSQL makes its commits durable itself
        with TestClient(app) as http:
            client = lambda **kw: OrchestratorClient(
                "http://testserver",
                http=http,
                retry=RetryPolicy(attempts=1),
                **kw,
            )
            worker, validator, admin = client(key=worker_key), client(key=validator_key), client(admin_token="tok")
            assert worker.register("worker", hw).status == validator.register("validator", hw).status == "admitted"
            [a] = worker.heartbeat().assignments
            assert (a.version, a.k) == (round_, 0)  # version 1 was announced before the restart
            n, name = a.prompts * a.samples_per_prompt, f"pg-{round_}"
            worker.announce_batch(
                BatchAnnouncement(
                    batch_id=name,
                    assignment_id=a.id,
                    version=a.version,
                    store_path=f"mem://s/v{a.version:06d}/{name}",
                    sha256="ab" * 32,
                    num_samples=n,
                    num_tokens=3 * n,
                )
            )
            assert validator.claim().batch.batch_id == name
            validator.verdict(name, Verdict(accepted=True, rewards=[0.5] * n, num_tokens=3 * n))
            records, _ = admin.all_batches()
            assert [r.batch_id for r in records] == [f"pg-{i}" for i in range(round_ + 1)]
            [entry] = [e for e in admin.ledger().entries if e.node_key == worker.node_key]
            assert (entry.accepted_batches, entry.accepted_samples) == (round_ + 1, n * (round_ + 1))
            admin.announce_policy(round_ + 1)
            assert http.get("/metrics").status_code == http.get("/").status_code == 200
