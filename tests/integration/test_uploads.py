"""Uploads from workers without storage credentials (docs/design.md section 8, uploads), on a real S3 API server.

Started as a user starts them, all on 127.0.0.1: moto's S3 server with IAM enforced (a user per trusted role,
none for workers), `intellect orchestrator` taking uploads itself, and one `intellect ingest` process beside it;
both write to the bucket through tensorstore's s3 driver with the ingest's credentials. Workers are test code
built on the public API (`bridge.protocol`, `bridge.upload`): register, heartbeat, upload.

Honest uploads through either endpoint are announced once, at the ingest's store path, and read back with the
validator's credentials under the announced digest. Every attack is refused with a 4xx, and the bucket's bytes
are the same before and after (`S3Server.snapshot`): another node's assignment, an expired or judged one, a
second upload, one larger than the assignment allows, a slow one (slow-loris, and the per-address limit), a
body whose values do not hash to the signed digest, a path-like batch id, a replay to the other process, and a
worker trying to read, list or delete batches (no route takes it, and the S3 server refuses a request without
credentials; the validator's credentials cannot delete either). The GCS form runs on gcp-storage-emulator:
uploads land, and the one thing that fails there is named.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers import OrchestratorProcess, S3Server, free_port

from bridge.protocol import HardwareReport, OrchestratorClient, OrchestratorError, load_or_create_key, public_key_hex
from bridge.protocol.signing import sign_request
from bridge.protocol.upload_client import upload_batch
from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore, canonical_sha256, meta_json
from bridge.upload import encode

TOKEN = "uploads-admin"
CONFIG = """
[run]
dir = "{run}"
log_level = "INFO"
[data]
prompts_per_step = 8
samples_per_prompt = 2
max_prompt_len = 16
max_new_tokens = 32
[trainer]
batch_size = 16
[model]
max_seq_len = 64
[orchestrator]
allow_cpu_nodes = true
admin_token = "{token}"
prompts_per_assignment = 2
max_inflight_per_node = 8
unproven_share = 1.0
assignment_deadline_s = {deadline}
ban_after_rejections = 0
submit_rate_per_min = 6000
submit_burst = 1000
[ingest]
store_url = '{store}'
upload_timeout_s = {upload_timeout}
max_uploads_per_ip = 2
orchestrator_url = "{url}"
port = {ingest_port}
urls = ["http://127.0.0.1:{ingest_port}"]
"""


class Pool:
    def __init__(
        self,
        tmp: Path,
        s3: S3Server,
        prefix: str,
        deadline: float = 600.0,
        ingest: bool = True,
        upload_timeout: float = 4.0,
    ):
        self.tmp, self.s3, self.prefix = tmp, s3, prefix
        self.config = tmp / f"{prefix}.toml"
        self.orch_port, self.ingest_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.orch_port}"
        self.ingest_url = f"http://127.0.0.1:{self.ingest_port}"
        self.config.write_text(
            CONFIG.format(
                run=tmp / prefix,
                token=TOKEN,
                deadline=deadline,
                store=s3.spec(prefix + "/"),
                url=self.url,
                ingest_port=self.ingest_port,
                upload_timeout=upload_timeout,
            )
        )
        creds = s3.credentials("ingest")
        self.orchestrator = OrchestratorProcess(tmp / f"{prefix}-orch.log", self.config, port=self.orch_port, env=creds)
        self.orchestrator.start()
        self.ingest = None
        if ingest:
            log = open(tmp / f"{prefix}-ingest.log", "ab")
            env = {**os.environ, **creds, "INTELLECT_INGEST__TOKEN": TOKEN}
            self.ingest = subprocess.Popen(
                [sys.executable, "-m", "intellect", "ingest", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            deadline_at = time.monotonic() + 60
            while True:
                assert self.ingest.poll() is None, (tmp / f"{prefix}-ingest.log").read_text()[-2000:]
                try:
                    with urllib.request.urlopen(self.ingest_url + "/healthz", timeout=1):
                        break
                except OSError:
                    assert time.monotonic() < deadline_at, "the ingest did not answer"
                    time.sleep(0.1)
        self.used: set[int] = set()

    def worker(self, name: str) -> tuple[object, str, OrchestratorClient]:
        key = load_or_create_key(self.tmp / "keys" / f"{self.prefix}-{name}.key")
        client = OrchestratorClient(self.url, key=key)
        assert client.register("worker", HardwareReport(gpus=[], cpu_count=2, memory_gib=8)).status == "admitted"
        return key, public_key_hex(key), client

    def assignment(self, client: OrchestratorClient):
        """An open assignment of this worker no test has used yet."""
        for a in client.heartbeat().assignments:
            if a.id not in self.used:
                self.used.add(a.id)
                return a
        raise AssertionError("no fresh assignment")

    def close(self) -> None:
        if self.ingest is not None:
            self.ingest.terminate()
            self.ingest.wait(15)
        self.orchestrator.stop()


def make_batch(node_key: str, a, *, seed: int = 0, batch_id: str | None = None, samples: int | None = None):
    """A well-formed batch for assignment `a` (the ingest checks form, not content: validators judge that)."""
    rng = np.random.default_rng(seed)
    n = samples if samples is not None else a.prompts * a.samples_per_prompt
    tokens, prompt_lens, logprobs, proofs = [], [], [], []
    for _ in range(n):
        prompt, completion = int(rng.integers(2, 16)), int(rng.integers(1, 32))
        tokens.append(rng.integers(0, 1000, prompt + completion))
        prompt_lens.append(prompt)
        logprobs.append(np.concatenate([np.zeros(prompt, np.float32), -rng.random(completion, np.float32) - 0.01]))
        proofs.append(rng.integers(0, 256, -(-completion // 32) * 258, dtype=np.uint8).tobytes())
    meta = BatchMeta(batch_id or f"{node_key[:16]}-a{a.id}", node_key, a.version, a.id, {"temperature": 0.6})
    return RolloutBatch.from_samples(
        meta,
        tokens=tokens,
        prompt_lens=prompt_lens,
        logprobs=logprobs,
        task_ids=[i // a.samples_per_prompt for i in range(n)],
        group_ids=[i // a.samples_per_prompt for i in range(n)],
        seeds=list(range(n)),
        finish=[0] * n,
        rewards=[0.5] * n,
        proofs=proofs,
    )


def digest_of(batch: RolloutBatch) -> str:
    return canonical_sha256(
        batch.arrays(), meta_json(batch.meta, batch.num_samples, len(batch.tokens), len(batch.proofs))
    )


def upload(url: str, key, a, batch: RolloutBatch, sha: str | None = None, batch_id: str | None = None):
    length, pieces = encode(batch)
    return upload_batch(url, key, a.id, batch_id or batch.meta.batch_id, sha or digest_of(batch), length, pieces)


def signed_stream(key, a, batch: RolloutBatch) -> tuple[bytes, bytes]:
    """A signed upload's request head and its whole body, for tests that send them by hand, piece by piece."""
    sha = digest_of(batch)
    length, pieces = encode(batch)
    target = f"/v1/uploads/{a.id}/{batch.meta.batch_id}"
    headers = {
        "Content-Length": str(length),
        "X-Batch-Sha256": sha,
        **sign_request(key, "PUT", target, b"", body_sha256=sha),
    }
    head = f"PUT {target} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode(), b"".join(bytes(piece) for piece in pieces)


def refused(call) -> OrchestratorError:
    with pytest.raises(OrchestratorError) as info:
        call()
    assert 400 <= info.value.status < 500, info.value
    return info.value


def raw(url: str, method: str, target: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory, s3):
    p = Pool(tmp_path_factory.mktemp("uploads"), s3, "main")
    yield p
    p.close()


def test_honest_uploads_through_both_endpoints_are_stored_and_read_back(pool, s3, monkeypatch):
    key, node, client = pool.worker("honest")
    for url in (pool.url, pool.ingest_url):
        a = pool.assignment(client)
        batch = make_batch(node, a, seed=a.id)
        record = upload(url, key, a, batch)
        assert (record.status, record.batch_id, record.sha256) == ("submitted", batch.meta.batch_id, digest_of(batch))
        assert json.loads(record.store_path.rsplit("/v0", 1)[0])["bucket"] == "rollouts"
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.credentials("validator")["AWS_ACCESS_KEY_ID"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.credentials("validator")["AWS_SECRET_ACCESS_KEY"])
        store = RolloutStore.open(s3.spec("main/"))
        assert record.store_path == store.batch_url(a.version, batch.meta.batch_id)
        got = store.read(a.version, batch.meta.batch_id, expect_sha256=record.sha256)
        assert all(np.array_equal(getattr(got, f), getattr(batch, f)) for f, _, _ in batch.fields())
    # the policy names the ingest process to workers, and the orchestrator's own store path is the same store
    assert client.policy().uploads == [pool.ingest_url]
    # POST /v1/batches, the route of workers that write the store themselves, is closed in an upload pool
    a = pool.assignment(client)
    from bridge.protocol import BatchAnnouncement

    err = refused(
        lambda: client.announce_batch(
            BatchAnnouncement(
                batch_id=f"{node[:16]}-a{a.id}",
                assignment_id=a.id,
                version=a.version,
                store_path="s3://rollouts/elsewhere/v000000/x",
                sha256="0" * 64,
                num_samples=4,
                num_tokens=10,
            )
        )
    )
    assert err.status == 403 and "uploads only" in str(err.detail)


def test_another_nodes_assignment_and_batch_id_are_refused(pool, s3):
    key_a, node_a, client_a = pool.worker("alice")
    key_b, node_b, client_b = pool.worker("mallory")
    a = pool.assignment(client_a)
    before = s3.snapshot()
    for url in (pool.url, pool.ingest_url):
        # Mallory signs an upload for Alice's assignment, with her own node key in meta.json or with Alice's
        for meta_key in (node_b, node_a):
            err = refused(lambda: upload(url, key_b, a, make_batch(meta_key, a)))
            assert err.status == 404 and "no such assignment of this node" in str(err.detail)
    assert s3.snapshot() == before
    # Alice's batch still goes in, once
    upload(pool.url, key_a, a, make_batch(node_a, a))
    # Mallory squats Alice's (public) batch id under an assignment of her own: taken
    b = pool.assignment(client_b)
    before = s3.snapshot()
    err = refused(lambda: upload(pool.ingest_url, key_b, b, make_batch(node_b, b, batch_id=f"{node_a[:16]}-a{a.id}")))
    assert err.status == 409 and "already taken" in str(err.detail)
    assert s3.snapshot() == before


def test_twice_and_judged_are_refused_without_touching_the_stored_batch(pool, s3):
    key, node, client = pool.worker("twice")
    a = pool.assignment(client)
    batch = make_batch(node, a, seed=1)
    upload(pool.url, key, a, batch)
    before = s3.snapshot()
    for url in (pool.url, pool.ingest_url):
        err = refused(lambda: upload(url, key, a, batch))  # the same bytes again
        assert err.status == 409 and "already has batch" in str(err.detail)
        err = refused(lambda: upload(url, key, a, make_batch(node, a, seed=2)))  # other values, same id
        assert err.status == 409
    assert s3.snapshot() == before
    # judged: a validator rejects it; the assignment takes no batch again
    vkey = load_or_create_key(pool.tmp / "keys" / "validator.key")
    validator = OrchestratorClient(pool.url, key=vkey)
    assert validator.register("validator", HardwareReport(gpus=[], cpu_count=2, memory_gib=8)).status == "admitted"
    from bridge.protocol import Verdict

    for _ in range(50):
        claim = validator.claim()
        if claim.batch is None:
            break
        validator.verdict(claim.batch.batch_id, Verdict(accepted=False, failed_checks=["store"], num_tokens=0))
    judged = [
        r for r in OrchestratorClient(pool.url, admin_token=TOKEN).all_batches("rejected")[0] if r.assignment_id == a.id
    ]
    assert judged, "the batch was not judged"
    before = s3.snapshot()
    for url in (pool.url, pool.ingest_url):
        err = refused(lambda: upload(url, key, a, make_batch(node, a, seed=3)))
        assert err.status == 409 and "rejected" in str(err.detail)
    assert s3.snapshot() == before


def test_larger_than_the_assignment_allows_is_refused(pool, s3):
    key, node, client = pool.worker("large")
    a = pool.assignment(client)
    before = s3.snapshot()
    target = f"/v1/uploads/{a.id}/{node[:16]}-a{a.id}"
    sha = "1" * 64
    for url in (pool.url, pool.ingest_url):
        # a Content-Length over what 4 samples of at most 48 tokens can take: 413 before any byte is read
        headers = {
            "Content-Length": str(10**9),
            "X-Batch-Sha256": sha,
            **sign_request(key, "PUT", target, b"", body_sha256=sha),
        }
        status, body = _head_only(url, target, headers)
        assert status == 413 and b"may take" in body, body
        # a stream whose meta.json declares more samples than the assignment has (8 for 4)
        err = refused(lambda: upload(url, key, a, make_batch(node, a, samples=8)))
        assert err.status == 413, err
        # no Content-Length (chunked)
        headers = {
            "Transfer-Encoding": "chunked",
            "X-Batch-Sha256": sha,
            **sign_request(key, "PUT", target, b"", body_sha256=sha),
        }
        status, _ = _head_only(url, target, headers)
        assert status == 411
    assert s3.snapshot() == before


def _head_only(url: str, target: str, headers: dict) -> tuple[int, bytes]:
    """Send a request head and no body; the answer the server gives before any body byte."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"PUT {target} HTTP/1.1\r\nHost: {host}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall((head + "\r\n").encode())
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        return reply.status, reply.read()


def test_slow_loris_gets_408_and_its_slot_back(pool, s3):
    key, node, client = pool.worker("slow")
    a = pool.assignment(client)
    batch = make_batch(node, a, seed=5)
    head, stream = signed_stream(key, a, batch)
    before = s3.snapshot()
    host, port = pool.ingest_url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + stream[:10])
        time.sleep(0.5)
        # meanwhile the same assignment through the other endpoint: its upload is in progress (retry later)
        err = refused(lambda: upload(pool.url, key, a, batch))
        assert err.status == 429 and "in progress" in str(err.detail)
        # a second upload from this address still fits (max_uploads_per_ip 2); a third, from a holder of two, not
        other = pool.assignment(client)
        with socket.create_connection((host, int(port)), timeout=30) as second:
            b2 = make_batch(node, other)
            t2 = f"/v1/uploads/{other.id}/{b2.meta.batch_id}"
            s2 = digest_of(b2)
            h2 = {
                "Content-Length": str(encode(b2)[0]),
                "X-Batch-Sha256": s2,
                **sign_request(key, "PUT", t2, b"", body_sha256=s2),
            }
            second.sendall(
                (
                    f"PUT {t2} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h2.items()) + "\r\n"
                ).encode()
            )
            second.sendall(b"\x01")
            time.sleep(0.5)
            third = pool.assignment(client)
            err = refused(lambda: upload(pool.ingest_url, key, third, make_batch(node, third)))
            assert err.status == 429 and "max_uploads_per_ip" in str(err.detail)
        answer = b""
        for i in range(10, 40):  # a byte a second (the upload has 4 s); read the answer as soon as it comes
            readable, _, _ = select.select([sock], [], [], 1.0)
            if readable:
                answer = sock.recv(4096)
                break
            sock.sendall(stream[i : i + 1])
            if time.monotonic() - start > 20:
                break
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - start < 20
    assert s3.snapshot() == before
    # the reservation is gone: the honest upload of the same assignment goes in
    assert upload(pool.ingest_url, key, a, batch).status == "submitted"


def test_values_that_do_not_hash_to_the_signed_digest_are_refused(pool, s3):
    key, node, client = pool.worker("liar")
    a = pool.assignment(client)
    signed, sent = make_batch(node, a, seed=7), make_batch(node, a, seed=8)
    before = s3.snapshot()
    for url in (pool.url, pool.ingest_url):
        err = refused(lambda: upload(url, key, a, sent, sha=digest_of(signed)))
        assert err.status == 422 and "the signed X-Batch-Sha256" in str(err.detail)
        # a body that matches but a signature over another digest: the signature fails
        length, pieces = encode(sent)
        target = f"/v1/uploads/{a.id}/{sent.meta.batch_id}"
        headers = {
            "Content-Length": str(length),
            "X-Batch-Sha256": digest_of(sent),
            **sign_request(key, "PUT", target, b"", body_sha256=digest_of(signed)),
        }
        status, _ = raw(url, "PUT", target, headers, b"".join(bytes(p) for p in pieces))
        assert status == 401
    assert s3.snapshot() == before
    assert upload(pool.url, key, a, sent).status == "submitted"  # nothing was reserved or written by the lies


def test_path_like_batch_ids_are_refused(pool, s3, tmp_path):
    key, node, client = pool.worker("paths")
    a = pool.assignment(client)
    before = s3.snapshot()
    sha = "2" * 64
    for url in (pool.url, pool.ingest_url):
        for bad in ("..%2F..%2Fx", "../../x", "a/b", ".hidden", "%2e%2e", "x%00", "a" * 129, "-x"):
            target = f"/v1/uploads/{a.id}/{bad}"
            headers = {
                "Content-Length": "10",
                "X-Batch-Sha256": sha,
                **sign_request(key, "PUT", target, b"", body_sha256=sha),
            }
            status, body = raw(url, "PUT", target, headers, b"\0" * 10)
            assert 400 <= status < 500, (url, bad, status, body)
        # a valid path whose meta.json names a path-like id: refused by meta.json's own check
        batch = make_batch(node, a)
        evil = RolloutBatch(**{**batch.__dict__, "meta": BatchMeta("../evil", node, a.version, a.id, {})})
        length, pieces = encode(evil)
        target = f"/v1/uploads/{a.id}/{batch.meta.batch_id}"
        s = "3" * 64
        headers = {
            "Content-Length": str(length),
            "X-Batch-Sha256": s,
            **sign_request(key, "PUT", target, b"", body_sha256=s),
        }
        status, body = raw(url, "PUT", target, headers, b"".join(bytes(p) for p in pieces))
        assert status == 422 and b"batch_id" in body, body
    assert s3.snapshot() == before


def test_a_worker_can_neither_read_nor_delete_batches(pool, s3):
    key, node, client = pool.worker("reader")
    victim_key, victim, victim_client = pool.worker("victim")
    a = pool.assignment(victim_client)
    batch = make_batch(victim, a)
    upload(pool.url, victim_key, a, batch)
    before = s3.snapshot()
    path = f"/v1/uploads/{a.id}/{batch.meta.batch_id}"
    for url in (pool.url, pool.ingest_url):
        for method in ("GET", "HEAD", "DELETE", "POST", "PATCH"):
            headers = sign_request(key, method, path, b"")
            status, _ = raw(url, method, path, headers)
            assert status == 405, (url, method, status)
    # the public listing has no store paths or digests; the orchestrator's own routes serve no batch bytes
    listed = json.loads(urllib.request.urlopen(pool.url + "/v1/batches?status=submitted").read())["batches"]
    assert listed and all("store_path" not in b and "sha256" not in b for b in listed)
    # the S3 server: a request without credentials (a worker holds none) reads and deletes nothing, and keys a
    # worker makes up list nothing (moto answers an anonymous listing with a 500 of its own, so it is not sent)
    key_path = f"main/v{a.version:06d}/{batch.meta.batch_id}/COMMIT"
    for method in ("GET", "DELETE"):
        status, _ = raw(s3.endpoint, method, f"/{s3.bucket}/{key_path}")
        assert status == 403, (method, status)
    import boto3
    from botocore.exceptions import ClientError

    guess = boto3.client(
        "s3", endpoint_url=s3.endpoint, region_name=s3.region, aws_access_key_id="AKIAGUESS", aws_secret_access_key="x"
    )
    for call in (
        lambda: guess.list_objects_v2(Bucket=s3.bucket),
        lambda: guess.delete_object(Bucket=s3.bucket, Key=key_path),
        lambda: guess.put_object(Bucket=s3.bucket, Key=key_path, Body=b"0" * 64),
    ):
        with pytest.raises(ClientError) as denied:
            call()
        assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    # nor do the validator's credentials delete (they read)
    with pytest.raises(ClientError) as denied:
        s3.client("validator").delete_object(Bucket=s3.bucket, Key=key_path)
    assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert s3.client("validator").get_object(Bucket=s3.bucket, Key=key_path)["Body"].read() == before[key_path]
    assert s3.snapshot() == before


def test_replays_unsigned_banned_and_validator_keys_are_refused(pool, s3):
    key, node, client = pool.worker("replayer")
    a = pool.assignment(client)
    batch = make_batch(node, a)
    sha = digest_of(batch)
    length, pieces = encode(batch)
    body = b"".join(bytes(p) for p in pieces)
    target = f"/v1/uploads/{a.id}/{batch.meta.batch_id}"
    headers = {
        "Content-Length": str(length),
        "X-Batch-Sha256": sha,
        **sign_request(key, "PUT", target, b"", body_sha256=sha),
    }
    before = s3.snapshot()
    status, _ = raw(pool.url, "PUT", target, {"Content-Length": str(length), "X-Batch-Sha256": sha}, body)
    assert status == 401  # unsigned
    assert raw(pool.url, "PUT", target, headers, body)[0] == 200
    after_first = s3.snapshot()
    assert raw(pool.ingest_url, "PUT", target, headers, body)[0] == 401  # the same request to the other process
    assert s3.snapshot() == after_first != before
    # a validator's key, and a banned worker's
    vkey = load_or_create_key(pool.tmp / "keys" / "validator2.key")
    v = OrchestratorClient(pool.url, key=vkey)
    assert v.register("validator", HardwareReport(gpus=[], cpu_count=2, memory_gib=8)).status == "admitted"
    b = pool.assignment(client)
    vb = make_batch(node, b)
    assert refused(lambda: upload(pool.url, vkey, b, vb)).status == 403
    OrchestratorClient(pool.url, admin_token=TOKEN).ban(node, "test")
    assert refused(lambda: upload(pool.ingest_url, key, b, vb)).status == 403
    assert s3.snapshot() == after_first


def test_an_expired_assignment_takes_no_upload(tmp_path, s3):
    short = Pool(tmp_path, s3, "short", deadline=1.0, ingest=False)
    try:
        key, node, client = short.worker("late")
        a = short.assignment(client)
        time.sleep(2.5)  # past its deadline (the sweep marks it expired)
        before = s3.snapshot()
        err = refused(lambda: upload(short.url, key, a, make_batch(node, a)))
        assert err.status == 410 and "expired" in str(err.detail)
        assert s3.snapshot() == before
    finally:
        short.close()


def test_an_upload_whose_reservation_a_restart_lost_is_sent_again(tmp_path, s3):
    """The orchestrator restarts while the ingest receives a batch: the control call `finish` answers 404 (an
    unknown ticket is a 4xx, never a 5xx), the ingest deletes what it stored and tells the worker 503 with
    Retry-After, and the batch sent again goes in."""
    # the upload waits for the orchestrator's restart: a loaded machine's restart took longer than the 4 s the
    # slow-upload tests use (the ingest then answered 408), so this pool gives an upload a minute
    p = Pool(tmp_path, s3, "restart", upload_timeout=60.0)
    try:
        key, node, client = p.worker("patient")
        a = p.assignment(client)
        batch = make_batch(node, a, seed=11)
        head, stream = signed_stream(key, a, batch)
        before = s3.snapshot()
        host, port = p.ingest_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(head + stream[:10])
            time.sleep(0.5)  # admitted: the reservation is held by this orchestrator process
            p.orchestrator.stop()
            p.orchestrator.start()
            sock.sendall(stream[10:])
            reply = http.client.HTTPResponse(sock)
            reply.begin()
            body = reply.read()
        assert reply.status == 503 and reply.getheader("Retry-After") == "1", body
        assert b"upload it again" in body
        assert s3.snapshot() == before  # what the ingest stored for the lost reservation is gone
        status, answer = raw(
            p.url,
            "POST",
            "/v1/ingest/finish",
            {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            json.dumps({"ticket": "0" * 32, "num_tokens": 1, "store_path": "x"}).encode(),
        )
        assert status == 404 and b"upload it again" in answer
        assert upload(p.ingest_url, key, a, batch).status == "submitted"
    finally:
        p.close()


def test_the_gcs_form_on_gcp_storage_emulator(tmp_path, monkeypatch):
    """Uploads reach a GCS store (tensorstore's gcs driver pointed at gcp-storage-emulator with
    TENSORSTORE_GCS_HTTP_URL): written, committed and listed. Reading a batch back fails there, and this test
    pins why: the emulator answers the reader's one-byte probe past the end of COMMIT with 206 and the range
    "bytes 65-64/65" where GCS answers 416, and tensorstore refuses that answer."""
    port = free_port()
    emulator = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port)]
        + ["--in-memory", "--default-bucket", "rollouts"],
        stdout=open(tmp_path / "gcs.log", "ab"),
        stderr=subprocess.STDOUT,
    )
    gcs = {"TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{port}", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test"}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b", timeout=1)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                assert emulator.poll() is None and time.monotonic() < deadline, "the emulator did not start"
                time.sleep(0.1)
        config = tmp_path / "gcs.toml"
        config.write_text(
            CONFIG.format(
                run=tmp_path / "run",
                token=TOKEN,
                deadline=600,
                store="gs://rollouts/gcs/",
                url="x",
                ingest_port=1,
                upload_timeout=4.0,
            )
        )
        orchestrator = OrchestratorProcess(tmp_path / "orch.log", config, env=gcs).start()
        try:
            key = load_or_create_key(tmp_path / "w.key")
            client = OrchestratorClient(orchestrator.url, key=key)
            assert client.register("worker", HardwareReport(gpus=[], cpu_count=2, memory_gib=8)).status == "admitted"
            a = client.heartbeat().assignments[0]
            batch = make_batch(public_key_hex(key), a)
            record = upload(orchestrator.url, key, a, batch)
            assert record.store_path.startswith("gs://rollouts/gcs/v000000/")
        finally:
            orchestrator.stop()
        for name, value in gcs.items():
            monkeypatch.setenv(name, value)
        store = RolloutStore.open("gs://rollouts/gcs/")
        assert [r.batch_id for r in store.list()] == [batch.meta.batch_id]
        commit = store.kvstore.read(f"v000000/{batch.meta.batch_id}/COMMIT").result().value
        assert commit == (digest_of(batch) + "\n").encode()
        from bridge.rollouts import RolloutStoreError

        with pytest.raises(RolloutStoreError, match="Content-Range"):
            store.read(0, batch.meta.batch_id)
        assert [r.batch_id for r in store.prune(1)] == [batch.meta.batch_id] and store.list() == []
    finally:
        emulator.terminate()
        emulator.wait(15)
