"""The orchestrator as users run it: `intellect orchestrator CONFIG` in its own process on 127.0.0.1, spoken to
over real sockets with bridge.protocol's client or raw signed requests. Covers the whole work flow, every
signature refusal, admin auth, body limits, rate limits, metrics, the dashboard in headless Chromium, and a
kill -9 in the middle of a burst of announcements."""

import asyncio
import csv
import hashlib
import html.parser
import io
import json
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import OrchestratorProcess, free_port
from prometheus_client.parser import text_string_to_metric_families

from bridge.assignment import assigned_task_ids
from bridge.protocol import (
    AsyncOrchestratorClient,
    BatchAnnouncement,
    HardwareReport,
    OrchestratorClient,
    OrchestratorError,
    RetryPolicy,
    Verdict,
    sign_request,
    solve_challenge,
)

HW = HardwareReport(cpu_count=2, memory_gib=4)
TOKEN = "admin-secret"
CHROMIUM = "/usr/bin/chromium"
JSON = {"Content-Type": "application/json"}
BASE_CONFIG = """
[run]
dir = "{dir}"
name = "itest-pool"
[orchestrator]
allow_cpu_nodes = true
worker_store_writes = true
admin_token = "{token}"
challenge_size = 48
prompts_per_assignment = 2
num_tasks = 500
submit_rate_per_min = {rate}
submit_burst = {burst}
max_inflight_per_node = 4
max_clock_skew_s = {skew}
public_cache_s = 0
[data]
prompts_per_step = {prompts}
samples_per_prompt = 2
[trainer]
batch_size = {batch}
micro_batch_size = 16
async_level = 1
"""


def write_config(tmp_path, rate=60, burst=5, prompts_per_step=16, skew=30.0):
    """Room in the async window: (async_level 1 + 1) x prompts_per_step / 2 prompts per assignment."""
    path = tmp_path / "orchestrator.toml"
    path.write_text(
        BASE_CONFIG.format(
            dir=tmp_path / "run",
            token=TOKEN,
            rate=rate,
            burst=burst,
            skew=skew,
            prompts=prompts_per_step,
            batch=2 * prompts_per_step,
        )
    )
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orchestrator")
    proc = OrchestratorProcess(tmp / "server.log", write_config(tmp)).start()
    yield proc
    proc.stop()


def join(url, role, key=None, retry=RetryPolicy(attempts=1)) -> OrchestratorClient:
    client = OrchestratorClient(url, key=key or Ed25519PrivateKey.generate(), retry=retry)
    first = client.register(role, HW)
    assert first.status == "challenge"
    admitted = client.register(role, HW, challenge_answer=solve_challenge(first.challenge.seed, first.challenge.size))
    assert admitted.status == "admitted", admitted.reasons
    return client


def submit(worker, assignment, batch_id):
    n = assignment.prompts * assignment.samples_per_prompt
    return worker.announce_batch(
        BatchAnnouncement(
            batch_id=batch_id,
            assignment_id=assignment.id,
            version=assignment.version,
            num_samples=n,
            num_tokens=7 * n,
            store_path=f"file:///rollouts/v{assignment.version:06d}/{batch_id}",
            sha256=hashlib.sha256(batch_id.encode()).hexdigest(),
        )
    )


def metric_values(text):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_work_flow_ledger_and_metrics(server):
    worker, validator = join(server.url, "worker"), join(server.url, "validator")
    admin = OrchestratorClient(server.url, admin_token=TOKEN)
    [a] = worker.heartbeat().assignments
    assert a.task_ids == assigned_task_ids(worker.node_key, 0, 0, 500, 2, a.salt) and len(a.sample_seeds) == 4
    submit(worker, a, "flow-ok")
    # Announcing again is harmless (a retry after a lost reply); the same id with other bytes is a conflict.
    assert submit(worker, a, "flow-ok").status == "submitted"
    claim = validator.claim()
    assert claim.batch.batch_id == "flow-ok" and claim.batch.status == "validating"
    validator.verdict("flow-ok", Verdict(accepted=True, rewards=[1.0, 0.0, 0.25, 1.0], num_tokens=27))
    [b] = worker.heartbeat().assignments  # a's batch is announced: a new one
    submit(worker, b, "flow-bad")
    validator.claim()
    validator.verdict(
        "flow-bad", Verdict(accepted=False, failed_checks=["toploc"], reason="proof mismatch", num_tokens=28)
    )

    accepted = admin.batches(status="accepted", min_version=0)
    [rec] = [r for r in accepted.batches if r.batch_id == "flow-ok"]
    assert (rec.rewards, rec.verified_tokens, rec.sha256) == (
        [1.0, 0.0, 0.25, 1.0],
        27,
        hashlib.sha256(b"flow-ok").hexdigest(),
    )
    assert rec.store_path.endswith("v000000/flow-ok") and rec.node_key == worker.node_key
    assert "flow-bad" in [r.batch_id for r in admin.batches(status="rejected").batches]

    ledger = {e.node_key: e for e in worker.ledger().entries}
    mine = ledger[worker.node_key]
    assert (mine.accepted_batches, mine.accepted_samples, mine.accepted_tokens) == (1, 4, 27)
    assert (mine.rejected_batches, mine.rejection_reasons) == (1, {"toploc": 1})
    rows = {r["node_key"]: r for r in csv.DictReader(io.StringIO(worker.ledger_csv()))}
    assert rows[worker.node_key]["accepted_tokens"] == "27" and rows[worker.node_key]["rejection_reasons"] == "toploc=1"
    assert set(rows) == set(ledger)

    worker.heartbeat(metrics={"gpu_util": 0.5})
    nodes = {n.key: n for n in admin.nodes().nodes}
    assert nodes[worker.node_key].metrics == {"gpu_util": 0.5} and nodes[validator.node_key].role == "validator"
    policy = admin.announce_policy(1)
    assert worker.policy().version == 1 and policy.min_version == 0

    values = metric_values(httpx.get(server.url + "/metrics").text)
    assert values[("orchestrator_policy_version", ())] == 1
    assert values[("orchestrator_batches", (("status", "accepted"),))] >= 1
    assert values[("orchestrator_nodes", (("role", "validator"), ("state", "healthy")))] >= 1
    assert values[("orchestrator_validation_lag_seconds_count", ())] >= 2
    assert (
        values[
            (
                "orchestrator_request_seconds_count",
                (("method", "POST"), ("route", "/v1/nodes/heartbeat"), ("status", "200")),
            )
        ]
        >= 2
    )


def test_async_client_speaks_the_same_api(server):
    async def main():
        async with AsyncOrchestratorClient(server.url, key=Ed25519PrivateKey.generate()) as node:
            first = await node.register("validator", HW)
            answer = solve_challenge(first.challenge.seed, first.challenge.size)
            assert (await node.register("validator", HW, challenge_answer=answer)).status == "admitted"
            hb = await node.heartbeat(metrics={"x": 1.0})
            assert hb.state == "healthy" and hb.assignments == []  # validators get no assignments
            assert (await node.policy()).version == hb.policy.version
            assert isinstance((await node.claim()).lease_expires_at, (float, type(None)))
        dead_url = f"http://127.0.0.1:{free_port()}"
        async with AsyncOrchestratorClient(dead_url, retry=RetryPolicy(attempts=3, base_delay_s=0.01)) as dead:
            with pytest.raises(OrchestratorError, match="after 3 attempts") as err:
                await dead.policy()
            assert err.value.status == 0

    asyncio.run(main())


def _signed(url, key, method, path, body=b"", **overrides):
    headers = sign_request(key, method, path, body)
    headers.update(overrides)
    return httpx.request(method, url + path, content=body, headers={**headers, **JSON})


def test_every_signature_refusal_says_why(server):
    worker = join(server.url, "worker")
    key = worker.key
    body = b'{"loaded_versions":[],"metrics":{}}'
    hb = "/v1/nodes/heartbeat"
    assert _signed(server.url, key, "POST", hb, body).status_code == 200

    headers = {**sign_request(key, "POST", hb, body), **JSON}
    first = httpx.post(server.url + hb, content=body, headers=headers)
    replay = httpx.post(server.url + hb, content=body, headers=headers)
    assert first.status_code == 200 and replay.status_code == 401 and "replayed" in replay.json()["detail"]

    now_ms = int(time.time() * 1000)
    cases = {  # name: (request, status, words in the reason)
        "stale": (dict(headers=sign_request(key, "POST", hb, body, timestamp_ms=now_ms - 31_000)), 401, "behind"),
        "future": (dict(headers=sign_request(key, "POST", hb, body, timestamp_ms=now_ms + 31_000)), 401, "ahead"),
        "other body": (dict(headers=sign_request(key, "POST", hb, b"{}")), 401, "bad signature"),
        "other path": (dict(headers=sign_request(key, "POST", "/v1/batches", body)), 401, "bad signature"),
        "missing": (dict(headers={}), 401, "missing signature header"),
        "malformed key": (
            dict(headers={**sign_request(key, "POST", hb, body), "X-Node-Key": "xyz"}),
            401,
            "malformed X-Node-Key",
        ),
        "unknown key": (
            dict(headers=sign_request(Ed25519PrivateKey.generate(), "POST", hb, body)),
            403,
            "register first",
        ),
    }
    for name, (request, status, words) in cases.items():
        reply = httpx.post(server.url + hb, content=body, headers={**request["headers"], **JSON})
        assert (reply.status_code, words in reply.json()["detail"]) == (status, True), (name, reply.text)
    # A query string is part of what is signed.
    signed_plain = {**sign_request(key, "POST", hb, body), **JSON}
    assert httpx.post(server.url + hb + "?x=1", content=body, headers=signed_plain).status_code == 401


def test_admin_token_and_bans(server):
    worker = join(server.url, "worker")
    assert httpx.get(server.url + "/v1/nodes").status_code == 401
    assert httpx.get(server.url + "/v1/nodes", headers={"Authorization": "Bearer nope"}).status_code == 403
    wrong_scheme = httpx.get(server.url + "/v1/nodes", headers={"Authorization": f"Basic {TOKEN}"})
    assert wrong_scheme.status_code == 401
    admin = OrchestratorClient(server.url, admin_token=TOKEN)
    with pytest.raises(OrchestratorError) as err:
        OrchestratorClient(server.url, admin_token="nope").announce_policy(5)
    assert err.value.status == 403
    [a] = worker.heartbeat().assignments[:1]
    banned = admin.ban(worker.node_key, "caught cheating")
    assert banned.banned and banned.ban_reason == "caught cheating" and banned.open_assignments == 0
    for call in (worker.heartbeat, lambda: worker.register("worker", HW), lambda: submit(worker, a, "after-ban")):
        with pytest.raises(OrchestratorError, match="banned: caught cheating") as err:
            call()
        assert err.value.status == 403
    with pytest.raises(OrchestratorError) as err:
        admin.ban("ab" * 32)
    assert err.value.status == 404


def test_body_limit_and_validation_errors_name_the_field(server):
    worker = join(server.url, "worker")
    big = b'{"metrics":{}, "loaded_versions":[' + b"0," * 600_000 + b"0]}"
    assert _signed(server.url, worker.key, "POST", "/v1/nodes/heartbeat", big).status_code == 413
    bad_role = json.dumps({"role": "miner", "hardware": HW.model_dump()}).encode()
    reply = _signed(server.url, worker.key, "POST", "/v1/nodes/register", bad_role)
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "role"]
    reply = _signed(server.url, worker.key, "POST", "/v1/nodes/heartbeat", b"{not json")
    assert reply.status_code == 422
    [a] = worker.heartbeat().assignments[:1]
    wrong = BatchAnnouncement(
        batch_id="short",
        assignment_id=a.id,
        version=a.version,
        num_samples=3,
        num_tokens=1,
        store_path="file:///elsewhere/short",
        sha256="00" * 32,
    )
    with pytest.raises(OrchestratorError) as err:
        worker.announce_batch(wrong)
    fields = [d["loc"][-1] for d in err.value.detail]
    assert err.value.status == 422 and fields == ["num_samples", "store_path"]


def test_the_fast_lane_hands_what_it_does_not_take_to_fastapi(server):
    """Heartbeats, announcements, claims and verdicts are answered in front of FastAPI (fast_lane.py); a body that
    is not valid for the route, a bad path parameter or an oversized body still get FastAPI's and the body
    limit's replies, and the latency metric still counts each route under its template."""
    worker, validator = join(server.url, "worker"), join(server.url, "validator")
    [a] = worker.heartbeat().assignments[:1]
    missing = json.dumps({"batch_id": "x1", "assignment_id": a.id, "version": a.version}).encode()
    reply = _signed(server.url, worker.key, "POST", "/v1/batches", missing)
    assert reply.status_code == 422
    assert {d["loc"][-1] for d in reply.json()["detail"]} == {"num_samples", "num_tokens", "store_path", "sha256"}
    big = b'{"batch_id":"' + b"a" * 2_000_000 + b'"}'
    assert _signed(server.url, worker.key, "POST", "/v1/batches", big).status_code == 413
    assert _signed(server.url, validator.key, "POST", "/v1/validation/claim", b"").status_code == 200  # no body
    reply = _signed(server.url, validator.key, "POST", "/v1/validation/claim", b'{"lease_s": -1}')
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "lease_s"]
    verdict = Verdict(accepted=True, rewards=[1.0], num_tokens=1).model_dump_json().encode()
    reply = _signed(server.url, validator.key, "POST", "/v1/batches/..bad/verdict", verdict)
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["path", "batch_id"]
    reply = _signed(server.url, validator.key, "POST", "/v1/batches/no-such-batch/verdict", verdict)
    assert reply.status_code == 404 and "no-such-batch" in reply.json()["detail"]
    reply = _signed(server.url, worker.key, "POST", "/v1/validation/claim", b"{}")  # the wrong role
    assert reply.status_code == 403 and "for validators" in reply.json()["detail"]
    seen = metric_values(httpx.get(server.url + "/metrics").text)
    count = {labels: v for (name, labels), v in seen.items() if name == "orchestrator_request_seconds_count"}
    by_route = {(dict(labels)["route"], dict(labels)["status"]): v for labels, v in count.items()}
    assert by_route[("/v1/batches/{batch_id}/verdict", "404")] >= 1
    assert by_route[("/v1/validation/claim", "403")] >= 1
    assert by_route[("/v1/nodes/heartbeat", "200")] >= 2


def test_submissions_are_rate_limited_per_node(server):
    worker = join(server.url, "worker")
    other = join(server.url, "worker")
    statuses = []
    for i in range(7):  # burst 5: announcements 6 and 7 are refused before the assignment is even looked at
        reply = _signed(
            server.url,
            worker.key,
            "POST",
            "/v1/batches",
            json.dumps(
                {
                    "batch_id": f"rl{i}",
                    "assignment_id": 10**9,
                    "version": 0,
                    "store_path": f"x/v000000/rl{i}",
                    "sha256": "00" * 32,
                    "num_samples": 4,
                    "num_tokens": 1,
                }
            ).encode(),
        )
        statuses.append(reply.status_code)
    assert statuses == [404] * 5 + [429] * 2
    assert int(reply.headers["Retry-After"]) >= 1 and "rate limit" in reply.json()["detail"]
    [a] = other.heartbeat().assignments[:1]
    assert submit(other, a, "rl-other").status == "submitted"  # another node's bucket is its own


class _Ids(html.parser.HTMLParser):
    """Text of every element with an id, and every external reference."""

    def __init__(self):
        super().__init__()
        self.text, self.external, self._stack = {}, [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href"):
            if attrs.get(name, "").startswith(("http:", "https:", "//")):
                self.external.append(attrs[name])
        self._stack.append(attrs.get("id"))
        if attrs.get("id"):
            self.text[attrs["id"]] = ""

    def handle_endtag(self, tag):
        if self._stack:
            self._stack.pop()

    def handle_data(self, data):
        for ident in filter(None, self._stack):
            self.text[ident] += data


@pytest.mark.skipif(
    not shutil.which(CHROMIUM), reason=f"{CHROMIUM} not installed (Debian: apt-get install -y chromium)"
)
def test_dashboard_renders_in_headless_chromium(server, tmp_path):
    admin = OrchestratorClient(server.url, admin_token=TOKEN)
    worker, validator, cheat = join(server.url, "worker"), join(server.url, "validator"), join(server.url, "worker")
    admin.ban(cheat.node_key, "dashboard test")
    [a] = worker.heartbeat().assignments[:1]
    submit(worker, a, "dash-ok")
    while (claim := validator.claim()).batch is not None and claim.batch.batch_id != "dash-ok":
        validator.verdict(claim.batch.batch_id, Verdict(accepted=False, reason="not this test's", num_tokens=0))
    validator.verdict("dash-ok", Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=111))
    admin.announce_policy(worker.policy().version + 1)
    expected_version = worker.policy().version
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'chrome'}",
            "--dump-dom",
            server.url + "/",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    page = _Ids()
    page.feed(out.stdout)
    truth = {n.key: n for n in admin.nodes().nodes}
    ledger = {e.node_key: e for e in admin.ledger().entries}
    assert page.text["run-name"] == "itest-pool"
    assert page.text["policy-version"] == str(expected_version)
    assert page.text["nodes-banned"] == str(sum(n.banned for n in truth.values()))
    assert page.text["nodes-healthy"] == str(sum(n.state == "healthy" and not n.banned for n in truth.values()))
    assert int(page.text["batches-accepted"]) >= 1 and int(page.text["tokens-10min"]) >= 111
    assert "banned" in page.text[f"node-{cheat.node_key}"] and "dashboard test" in page.text[f"node-{cheat.node_key}"]
    row = page.text[f"ledger-{worker.node_key}"]
    mine = ledger[worker.node_key]
    assert f"{mine.accepted_samples}" in row and f"{mine.accepted_tokens}" in row
    assert page.external == []


def test_kill_9_during_a_burst_keeps_every_acknowledged_record(tmp_path):
    # After a kill -9, requests stamped up to start + max_clock_skew_s get 503 (they may be replays): a short skew
    config = write_config(tmp_path, rate=1e6, burst=10_000, prompts_per_step=1024, skew=3.0)
    proc = OrchestratorProcess(tmp_path / "server.log", config).start()
    try:
        workers = [join(proc.url, "worker") for _ in range(6)]
        acked_batches, acked_work, stop = {}, {}, threading.Event()

        def burst(worker):
            i = 0
            while not stop.is_set():
                try:
                    for a in worker.heartbeat().assignments:
                        acked_work[a.id] = worker.node_key
                        name = f"{worker.node_key[:8]}-{i}"
                        i += 1
                        acked_batches[name] = (submit(worker, a, name).sha256, a.id)
                except (OrchestratorError, httpx.HTTPError):
                    return

        threads = [threading.Thread(target=burst, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(acked_batches) < 60 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.kill()  # SIGKILL mid-burst
        stop.set()
        for t in threads:
            t.join(10)
        assert len(acked_batches) >= 60
    finally:
        proc.kill()
    proc = OrchestratorProcess(tmp_path / "server2.log", config, port=proc.port).start()
    try:
        stored, after = {}, 0
        admin = OrchestratorClient(proc.url, admin_token=TOKEN)
        while True:
            page = httpx.get(
                proc.url + "/v1/batches",
                params={"status": "submitted", "after": after, "limit": 1000},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )  # store paths and digests: admin only
            body = page.json()
            stored.update({b["batch_id"]: (b["sha256"], b["assignment_id"]) for b in body["batches"]})
            if not body["batches"]:
                break
            after = body["next_after"]
        missing = {k: v for k, v in acked_batches.items() if stored.get(k) != v}
        assert not missing, f"{len(missing)} acknowledged batches lost after kill -9"
        retrying = RetryPolicy(attempts=8, base_delay_s=0.2, max_delay_s=2.0)  # through the 503s of the restart
        again = [OrchestratorClient(proc.url, key=w.key, retry=retrying) for w in workers]
        open_after = {a.id for w in again for a in w.heartbeat().assignments}
        unannounced = set(acked_work) - {v[1] for v in stored.values()}
        assert unannounced <= open_after  # acknowledged assignments are still the nodes' open work
        assert {n.key for n in admin.nodes().nodes} >= {w.node_key for w in workers}
    finally:
        proc.stop()


def test_cli_refuses_a_database_from_a_newer_release(tmp_path):
    from sqlalchemy import text

    from orchestrator.db import open_database, sqlite_url

    config = write_config(tmp_path)
    (tmp_path / "run").mkdir()
    with open_database(sqlite_url(tmp_path / "run" / "orchestrator.db")).begin() as conn:
        conn.execute(text("UPDATE schema_info SET version = 999"))
    proc = OrchestratorProcess(tmp_path / "server.log", config)
    with pytest.raises(RuntimeError, match="exited with 1"):
        proc.start(timeout_s=30)
    assert "written by a newer orchestrator" in proc.log()
