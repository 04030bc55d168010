"""Pinned manifests (issue 18, finding 7): a hostile SHARDCAST server offers its own manifest and files for a
version beside the honest origin. Without a pin a client believes whichever manifest it asks for first; with
the sha256 the learner announced (carried by the orchestrator's policy, heartbeats and claims) no client,
relay or validator ever lands the hostile files.

The servers are real `intellect shardcast origin|relay` processes on 127.0.0.1 (the hostile one is an origin
over another directory holding the same version number); the orchestrator runs in process (TestClient).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from test_shardcast import MIB, Cluster, assert_landed, get_json, publish, wait_until

from bridge.protocol import (
    BatchAnnouncement,
    HardwareReport,
    OrchestratorClient,
    OrchestratorError,
    PolicyInfo,
    RetryPolicy,
)
from bridge.shardcast import FetchError, ShardcastClient, ShardcastError
from bridge.shardcast.names import parse_server_list
from bridge.shardcast.pool import ServerPool

N_FETCHES = 8


def files_of(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "config.json": json.dumps({"model_type": "qwen2", "seed": seed}).encode(),
        "model.safetensors": rng.randbytes(2 * MIB),
        "tokenizer.json": json.dumps({"seed": seed}).encode(),
    }


def manifest_sha256(weights: Path, version: int) -> str:
    return hashlib.sha256((weights / f"v{version:06d}" / "manifest.json").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(honest url, hostile url, honest files, hostile files, honest weights dir, the pinned sha256)."""
    tmp = tmp_path_factory.mktemp("pinning")
    honest_files, hostile_files = files_of(1), files_of(666)
    publish(tmp / "honest", 1, honest_files)
    publish(tmp / "hostile", 1, hostile_files)
    cluster = Cluster(tmp)
    honest = cluster.origin(tmp / "honest", name="honest")
    hostile = cluster.origin(tmp / "hostile", name="hostile")
    yield honest, hostile, honest_files, hostile_files, tmp / "honest", manifest_sha256(tmp / "honest", 1)
    cluster.close()


def client(urls: list[str], seed: int) -> ShardcastClient:
    """A client whose server choice is seeded, so that each fetch's order of asking is fixed."""
    pool = ServerPool(parse_server_list(urls), rng=random.Random(seed))
    return ShardcastClient(urls, timeout=3, patience=20, fsync=False, direct_io=False, pool=pool)


def landed(out: Path) -> dict[str, bytes]:
    vdir = out / "v000001"
    return {p.name: p.read_bytes() for p in vdir.iterdir() if p.name not in ("manifest.json", "STABLE")}


def test_without_a_pin_the_hostile_manifest_lands(servers, tmp_path):
    """The attack, as the issue measured it: the manifest is believed from whichever holder is asked first."""
    honest, hostile, honest_files, hostile_files, _, _ = servers
    outcomes = []
    for i in range(N_FETCHES):
        out = tmp_path / f"c{i}"
        client([hostile, honest], seed=i).fetch(1, out)
        outcomes.append("hostile" if landed(out) == hostile_files else "honest")
        assert landed(out) in (hostile_files, honest_files)
    assert "hostile" in outcomes, outcomes


def test_with_the_pin_the_hostile_server_never_lands_a_file(servers, tmp_path):
    honest, hostile, honest_files, hostile_files, weights, pin = servers
    hostile_bytes = set(hostile_files.values()) - set(honest_files.values())
    for i in range(N_FETCHES):
        out = tmp_path / f"c{i}"
        c = client([hostile, honest] if i % 2 else [honest, hostile], seed=i)
        result = c.fetch(1, out, manifest_sha256=pin)
        assert_landed(out, 1, honest_files, weights)
        assert not hostile_bytes & {p.read_bytes() for p in (out / "v000001").iterdir()}
        # the impostor either offered its manifest (then nothing was taken from it) or, never asked for one,
        # sent bytes of its own files under the pinned names: they failed their sha256 and it was distrusted
        seen = result.servers.get(hostile, {"bytes": 0})
        assert seen["bytes"] == 0 or seen["distrusted"], seen
    with pytest.raises(FetchError, match="is not the expected"):  # only the impostor: nothing lands
        client([hostile], seed=0).fetch(1, tmp_path / "alone", manifest_sha256=pin)
    assert not (tmp_path / "alone" / "v000001").exists()


def test_a_version_held_under_another_manifest_is_replaced_by_the_pinned_one(servers, tmp_path):
    honest, hostile, honest_files, hostile_files, weights, pin = servers
    out = tmp_path / "node"
    client([hostile], seed=0).fetch(1, out)  # landed before pins existed
    assert landed(out) == hostile_files
    assert client([honest], seed=0).fetch(1, out).already_present  # without a pin it is taken as it is
    result = client([hostile, honest], seed=1).fetch(1, out, manifest_sha256=pin)
    assert not result.already_present
    assert_landed(out, 1, honest_files, weights)
    assert not [p for p in out.iterdir() if ".replaced-" in p.name]


# ---- relays pin what the orchestrator announced ----------------------------------------------------------


class FakePolicy:
    """`GET /v1/policy` as the orchestrator answers it, with the announced version settable by the test."""

    def __init__(self):
        self.doc = {"version": 0, "min_version": 0, "manifests": {}, "announced_at": None}  # nothing announced
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests += 1
                body = json.dumps(outer.doc).encode() if self.path == "/v1/policy" else b"{}"
                self.send_response(200 if self.path == "/v1/policy" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_relays_wait_for_the_announcement_and_mirror_only_the_pinned_manifest(servers, tmp_path):
    honest, hostile, honest_files, hostile_files, weights, pin = servers
    orchestrator = FakePolicy()
    cluster = Cluster(tmp_path)
    try:
        relays = [
            cluster.relay(
                f"{hostile},{honest}" if i % 2 else f"{honest},{hostile}",
                "--orchestrator",
                orchestrator.url,
                "--shardcast.timeout_s",
                "3",
                name=f"relay{i}",
            )
            for i in range(3)
        ]
        # a relay whose only upstream is hostile: whichever server a client picks first, this one has no choice
        cheated_url, cheated = cluster.relay(
            hostile, "--orchestrator", orchestrator.url, "--shardcast.timeout_s", "3", name="relay-hostile-only"
        )
        wait_until(lambda: orchestrator.requests >= 4, 20, "the relays to ask the orchestrator")
        assert all(get_json(f"{url}/versions")["versions"] == [] for url, _ in relays)  # v1 is not announced yet
        orchestrator.doc = {"version": 1, "min_version": 0, "manifests": {"1": pin}, "announced_at": 1.0}
        for i, (url, proc) in enumerate(relays):
            wait_until(lambda: get_json(f"{url}/versions")["latest"] == 1, 30, f"relay{i} to mirror v1")
            assert_landed(tmp_path / f"relay{i}", 1, honest_files, weights)
        wait_until(lambda: "offers another manifest" in cheated.stderr(), 30, "the hostile-only relay to distrust it")
        assert get_json(f"{cheated_url}/versions")["versions"] == []
    finally:
        cluster.close()
        orchestrator.close()


# ---- the orchestrator carries the pin: announcement, policy, heartbeat, claim ----------------------------

HW = HardwareReport(cpu_count=2, memory_gib=4)


def orchestrator(tmp_path):
    from intellect.config_io import load_config
    from intellect.orchestrator_cli import build_app

    overrides = {
        "run.dir": tmp_path,
        "orchestrator.allow_cpu_nodes": "true",
        "orchestrator.worker_store_writes": "true",
        "orchestrator.admin_token": "tok",
        "trainer.async_level": 1,
        "data.prompts_per_step": 4,
        "data.samples_per_prompt": 2,
        "trainer.batch_size": 8,
        "trainer.micro_batch_size": 8,
        "orchestrator.prompts_per_assignment": 2,
        "orchestrator.challenge_size": 0,
    }
    app = build_app(load_config(None, [f"--{k}={v}" for k, v in overrides.items()], env={}))
    http = TestClient(app)

    def node(key=None, admin_token=None) -> OrchestratorClient:
        return OrchestratorClient(
            "http://testserver", key=key, admin_token=admin_token, retry=RetryPolicy(attempts=1), http=http
        )

    return app, node


def test_the_orchestrator_carries_each_versions_manifest_sha256(tmp_path):
    app, node = orchestrator(tmp_path)
    admin = node(admin_token="tok")
    pins = {v: hashlib.sha256(b"manifest %d" % v).hexdigest() for v in range(4)}
    admin.announce_policy(0, manifest_sha256=pins[0])
    policy = admin.announce_policy(1, manifest_sha256=pins[1])
    assert policy.manifests == {0: pins[0], 1: pins[1]}
    with pytest.raises(OrchestratorError) as refused:  # the same version under another manifest
        admin.announce_policy(1, manifest_sha256=pins[2])
    assert refused.value.status == 409
    assert admin.announce_policy(1, manifest_sha256=pins[1]).manifests == policy.manifests  # a repeat: no-op
    with pytest.raises(Exception):
        admin.announce_policy(2, manifest_sha256="not hex")  # refused by the model before it is sent
    worker = node(Ed25519PrivateKey.generate())
    assert worker.register("worker", HW).policy.manifests == {0: pins[0], 1: pins[1]}
    beat = worker.heartbeat()  # the fast lane's heartbeat
    assert beat.policy.manifests == {0: pins[0], 1: pins[1]}
    [work] = beat.assignments
    assert work.version == 1
    admin.announce_policy(2, manifest_sha256=pins[2])
    assert node().policy().manifests == {1: pins[1], 2: pins[2]}  # the window: versions 1 and 2
    n = work.prompts * work.samples_per_prompt
    worker.announce_batch(
        BatchAnnouncement(
            batch_id="b1",
            assignment_id=work.id,
            version=1,
            num_samples=n,
            num_tokens=10 * n,
            store_path="file:///s/v000001/b1",
            sha256="ab" * 32,
        )
    )
    validator = node(Ed25519PrivateKey.generate())
    validator.register("validator", HW)
    claim = validator.claim()
    assert claim.batch.version == 1 and claim.manifest_sha256 == pins[1]
    app.state.orchestrator.close()
    app, node = orchestrator(tmp_path)  # a restart keeps them
    assert node().policy().manifests == {1: pins[1], 2: pins[2]}
    assert app.state.orchestrator.scheduler.manifests == {0: pins[0], 1: pins[1], 2: pins[2]}
    app.state.orchestrator.close()


def test_workers_fetch_window_versions_only_under_their_pin():
    from gpu_workers.worker import pinned_manifest

    policy = PolicyInfo(
        version=3,
        learner_step=3,
        async_level=1,
        min_version=2,
        relays=[],
        announced_at=1.0,
        manifests={2: "a" * 64, 3: "b" * 64},
    )
    assert pinned_manifest(policy, 3) == "b" * 64 and pinned_manifest(policy, 2) == "a" * 64
    with pytest.raises(ShardcastError, match="no announced manifest"):
        pinned_manifest(policy, 1)
    unpinned = policy.model_copy(update={"manifests": {}})  # a learner that announces none: the pool trusts relays
    assert pinned_manifest(unpinned, 1) is None and pinned_manifest(None, 1) is None
    wire = PolicyInfo.model_validate_json(policy.model_dump_json())  # JSON keys are strings; versions come back
    assert wire.manifests == {2: "a" * 64, 3: "b" * 64}


def test_a_validator_judges_with_the_pinned_weights_only(tmp_path, tiny_model):
    """The validator takes the pin from its claims (and heartbeats): a version fetched, or already loaded,
    under another manifest is fetched again from a server that has the pinned one."""
    import shutil

    from bridge.shardcast.config import ShardcastConfig
    from gpu_workers.config import DataConfig, ValidatorConfig, WorkerConfig
    from gpu_workers.node import Stop
    from gpu_workers.tasks import synthetic_tasks
    from gpu_workers.validator import Validator

    model = tiny_model("qwen2")
    real = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    forged = dict(real, **{"config.json": real["config.json"].replace(b"{", b'{"forged": true, ', 1)})
    publish(tmp_path / "honest", 0, real)
    publish(tmp_path / "hostile", 0, forged)
    cluster = Cluster(tmp_path)
    try:
        honest, hostile = (
            cluster.origin(tmp_path / "honest", name="honest"),
            cluster.origin(tmp_path / "hostile", name="hostile"),
        )
        v = Validator(
            ValidatorConfig(orchestrator_url="http://127.0.0.1:9", dtype="float32", allow_uncalibrated=True),
            WorkerConfig(temperature=1.0, max_tokens=8),
            DataConfig(samples_per_prompt=2, max_prompt_len=56, max_new_tokens=8),
            ShardcastConfig(timeout_s=5, direct_io=False),
            synthetic_tasks("sort", 8, 0, 3),
            key_path=tmp_path / "v.key",
            weights_dir=tmp_path / "weights",
            store=str(tmp_path / "store"),
            stop=Stop(install=False),
        )
        v.client.close()
        held = tmp_path / "weights" / "v000000"
        v.relays = [hostile]  # before pins: whatever the relay offers is believed
        v._version(0)
        assert (held / "config.json").read_bytes() == forged["config.json"]
        v.relays = [hostile, honest]
        v._pin({0: manifest_sha256(tmp_path / "honest", 0)})  # as a claim or heartbeat brings it
        v._version(0)
        assert_landed(tmp_path / "weights", 0, real, tmp_path / "honest")
        shutil.rmtree(held)  # a fresh fetch with the pin, the impostor listed first
        v.loaded.clear()
        v._version(0)
        assert_landed(tmp_path / "weights", 0, real, tmp_path / "honest")
    finally:
        cluster.close()


def test_a_relay_pins_waits_skips_or_goes_unpinned_as_the_announcement_says():
    from bridge.shardcast.relay import AnnouncedPolicy, Mirror

    state = {"policy": AnnouncedPolicy(None, 0, {})}  # the orchestrator before the learner announced anything

    def pins():
        if isinstance(state["policy"], Exception):
            raise state["policy"]
        return state["policy"]

    mirror = Mirror(
        None, Path("/nonexistent"), 3, None, lambda v, m: None, threading.Event(), pins=pins, pin_wait_s=0.3
    )
    assert mirror._pin(0) == (False, None)  # v0 is offered before its announcement: wait, do not mirror unpinned
    state["policy"] = AnnouncedPolicy(0, 0, {0: "a" * 64})
    assert mirror._pin(0) == (True, "a" * 64)
    state["policy"] = AnnouncedPolicy(5, 4, {4: "b" * 64})
    assert mirror._pin(5) == (True, None)  # announced without a sha256 (an older learner): unpinned
    assert mirror._pin(2) == (False, None) and mirror.skipped == {2}  # left the window unannounced to us
    state["policy"] = OSError("connection refused")
    assert mirror._pin(6) == (False, None)  # the orchestrator unreachable: not mirrored yet


def test_a_schema_2_database_gains_the_manifest_column(tmp_path):
    from sqlalchemy import text

    from orchestrator.db import SCHEMA_VERSION, open_database, sqlite_url

    url = sqlite_url(tmp_path / "o.db")
    with open_database(url).begin() as conn:  # made as schema 2 left it: no policy.manifest_sha256
        conn.execute(text("ALTER TABLE policy DROP COLUMN manifest_sha256"))
        conn.execute(text("INSERT INTO policy (version, learner_step, relays, announced_at) VALUES (4, 4, '[]', 1)"))
        conn.execute(text("UPDATE schema_info SET version = 2"))
    with open_database(url).connect() as conn:
        assert conn.execute(text("SELECT version FROM schema_info")).scalar_one() == SCHEMA_VERSION
        assert conn.execute(text("SELECT version, manifest_sha256 FROM policy")).all() == [(4, None)]
