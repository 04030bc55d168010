"""Batch uploads through the pool's ingest against direct writes, on an S3 API server and a local directory, in
one run (issue 48).

Batches are the QwQ-32B recipe's assignment (configs/intellect2_qwq32b.toml: prompts_per_assignment 8 x
samples_per_prompt 16 = 128 samples of 4,096 tokens each: 256-token prompts, Zipf-distributed token ids over a
151,936 vocabulary, logprobs and full-distribution logprobs, TOPLOC proofs of 258 bytes per 32 completion
tokens): about 10.3 MB of batch data each, the size of its upload stream. Started as a user starts them, all on
127.0.0.1: moto's S3 server (`python -m moto.server`), `intellect orchestrator` (taking no uploads itself), and
`intellect ingest` processes writing to the S3 server or to a local directory.

Measured, each over `--batches` batches:

- `direct_local`, `direct_s3`: `RolloutStore.write` from this process, one batch at a time (what a worker with
  credentials did: hash, compress, write);
- `upload_s3`: one batch at a time through one ingest process to the S3 server (the client computes the digest
  and streams the batch; the ingest admits it with the orchestrator, hashes it as it arrives, writes it, checks
  it, announces it); `cost_ratio` = upload_s3 / direct_s3 seconds per batch;
- `sustained_{s3,local}_{1,2}proc`: `--clients` concurrent uploads through one or two ingest processes: the
  batches per second and MB/s of batch data one process sustains and what a second adds;
- `read_local`, `read_s3`: `RolloutStore.read` with the digest check (what validators and the learner do).

Load averages are recorded beside each figure: the machine is shared, so rerun when they are high.

    python benchmarks/uploads.py [--batches 8] [--clients 4] [--out results.json]

Prints one JSON object (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from _common import OrchestratorProcess, free_port

from bridge.protocol import HardwareReport, OrchestratorClient, load_or_create_key, public_key_hex
from bridge.protocol.upload_client import upload_batch
from bridge.rollouts import (
    PROOF_CHUNK_BYTES,
    PROOF_CHUNK_TOKENS,
    BatchMeta,
    RolloutBatch,
    RolloutStore,
    canonical_sha256,
    meta_json,
)
from bridge.upload import encode

VOCAB = 151936
SAMPLES, TOKENS, PROMPT = 128, 4096, 256
TOKEN = "bench-admin"
CONFIG = """
[run]
dir = "{run}"
log_level = "WARNING"
[data]
prompts_per_step = 512
samples_per_prompt = 16
max_prompt_len = 512
max_new_tokens = 3840
[model]
max_seq_len = 4352
[trainer]
batch_size = 8192
async_level = 2
[orchestrator]
allow_cpu_nodes = true
admin_token = "{token}"
prompts_per_assignment = 8
max_inflight_per_node = 100
unproven_share = 1.0
submit_rate_per_min = 100000
submit_burst = 100000
[ingest]
in_process = false
urls = ["http://127.0.0.1:1"]
orchestrator_url = "{url}"
max_uploads = 16
max_uploads_per_ip = 16
upload_timeout_s = 600
"""


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def template() -> RolloutBatch:
    rng = np.random.default_rng(0)
    n, total = SAMPLES, SAMPLES * TOKENS
    tokens = np.minimum(rng.zipf(1.2, total), VOCAB - 1).astype(np.int32)
    offsets = np.arange(0, total + 1, TOKENS, dtype=np.int64)
    logprobs = (-rng.exponential(0.5, total)).astype(np.float32)
    position = np.arange(total) % TOKENS
    logprobs[position < PROMPT] = 0.0
    full = np.where(logprobs != 0, logprobs - 0.05, 0).astype(np.float32)
    chunks = -(-(TOKENS - PROMPT) // PROOF_CHUNK_TOKENS)
    proofs = rng.integers(0, 256, n * chunks * PROOF_CHUNK_BYTES, dtype=np.uint8)
    return RolloutBatch(
        meta=BatchMeta("x", "ab" * 32, 0, 0, {"temperature": 0.6}),
        tokens=tokens,
        offsets=offsets,
        prompt_lens=np.full(n, PROMPT, np.int32),
        logprobs=logprobs,
        task_ids=np.repeat(np.arange(8, dtype=np.int64), 16),
        group_ids=np.repeat(np.arange(8, dtype=np.int32), 16),
        target_lens=np.zeros(n, np.int32),
        seeds=np.arange(n, dtype=np.uint64),
        finish=np.ones(n, np.uint8),
        rewards=np.full(n, 0.5, np.float32),
        proofs=proofs,
        proof_offsets=np.arange(0, n * chunks * PROOF_CHUNK_BYTES + 1, chunks * PROOF_CHUNK_BYTES, dtype=np.int64),
        full_logprobs=full,
    )


def for_assignment(base: RolloutBatch, node: str, a) -> RolloutBatch:
    return dataclasses.replace(base, meta=BatchMeta(f"{node[:16]}-a{a.id}", node, a.version, a.id, base.meta.sampling))


def digest(batch: RolloutBatch) -> str:
    return canonical_sha256(
        batch.arrays(), meta_json(batch.meta, batch.num_samples, len(batch.tokens), len(batch.proofs))
    )


class Moto:
    def __init__(self, tmp: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=open(tmp / "moto.log", "ab"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("moto did not start") from None
                time.sleep(0.2)
        urllib.request.urlopen(urllib.request.Request(self.endpoint + "/rollouts", method="PUT"))

    def spec(self, path: str) -> str:
        return json.dumps(
            {"driver": "s3", "bucket": "rollouts", "path": path, "endpoint": self.endpoint, "aws_region": "us-east-1"}
        )

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


class Ingest:
    def __init__(self, tmp: Path, config: Path, store: str, name: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "intellect", "ingest", str(config), "--ingest.port", str(self.port)]
        self.proc = subprocess.Popen(
            [*argv, "--ingest.store_url", store],
            stdout=open(tmp / f"ingest-{name}.log", "ab"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "INTELLECT_INGEST__TOKEN": TOKEN},
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(self.url + "/healthz", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"ingest {name} did not start") from None
                time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


class Workers:
    """Worker keys with open assignments to upload for (each upload uses one)."""

    def __init__(self, tmp: Path, url: str, count: int):
        self.url, self.pool = url, []
        for i in range(count):
            key = load_or_create_key(tmp / "keys" / f"w{i}.key")
            client = OrchestratorClient(url, key=key)
            client.register("worker", HardwareReport(gpus=[], cpu_count=2, memory_gib=8))
            self.pool.append((key, public_key_hex(key), client, []))

    def take(self, n: int) -> list[tuple]:
        out = []
        while len(out) < n:
            for key, node, client, used in self.pool:
                for a in client.heartbeat().assignments:
                    if a.id not in used and len(out) < n:
                        used.append(a.id)
                        out.append((key, node, a))
        return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(label: str, fn, count: int, nbytes: int, cpu_of: dict[str, int] | None = None, **extra) -> dict:
    """Wall time of `fn` (uploading or writing `count` batches of `nbytes`), and the CPU seconds the processes
    `cpu_of` (name -> pid) spent meanwhile: MB per CPU-second is what one core of such a process sustains,
    whatever else the machine is running."""
    before = load()
    cpu0 = {name: cpu_seconds(pid) for name, pid in (cpu_of or {}).items()}
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    cpu = {name: round(cpu_seconds(pid) - cpu0[name], 3) for name, pid in (cpu_of or {}).items()}
    if cpu:
        extra["cpu_s"] = cpu
        extra["MB_per_cpu_s"] = {name: round(count * nbytes / max(c, 1e-9) / 1e6, 1) for name, c in cpu.items()}
    out = {
        "batches": count,
        "seconds": round(seconds, 3),
        "s_per_batch": round(seconds / count, 4),
        "batches_per_s": round(count / seconds, 2),
        "MB_per_s": round(count * nbytes / seconds / 1e6, 1),
        "load_before": before,
        "load_after": load(),
        **extra,
    }
    log(f"{label}: {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=8, help="batches per measurement")
    parser.add_argument("--clients", type=int, default=4, help="concurrent uploads in the sustained runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    n, clients = args.batches, args.clients
    base = template()
    nbytes = encode(base)[0]
    tmp = Path(tempfile.mkdtemp(prefix="uploads-bench-"))
    results: dict = {
        "batch": {"samples": SAMPLES, "tokens_per_sample": TOKENS, "bytes": nbytes},
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
    }
    moto = Moto(tmp)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    config = tmp / "pool.toml"
    orch = OrchestratorProcess(tmp / "orchestrator.log", config)
    config.write_text(CONFIG.format(run=tmp / "run", token=TOKEN, url=orch.url))
    ingests = []
    try:
        with orch:
            workers = Workers(tmp, orch.url, 4)
            local = RolloutStore.open(tmp / "direct-local")
            s3 = RolloutStore.open(moto.spec("direct/"))
            warm = for_assignment(base, "cd" * 32, type("A", (), {"id": 10**9, "version": 0})())
            local.write(warm), s3.write(warm)  # warm both stores (threads, connections)

            def direct(store: RolloutStore, tag: str):
                def run():
                    for i in range(n):
                        fake = type("A", (), {"id": i, "version": 1})()
                        store.write(for_assignment(base, f"{tag}{i:02d}".ljust(64, "0"), fake))

                return run

            me = {"this process": os.getpid()}
            client = {"client": os.getpid()}
            results["direct_local"] = timed("direct_local", direct(local, "aa"), n, nbytes, me)
            results["direct_s3"] = timed("direct_s3", direct(s3, "bb"), n, nbytes, {**me, "moto": moto.proc.pid})

            ingests.append(Ingest(tmp, config, moto.spec("up1/"), "s3-1"))

            def uploads(jobs: list[tuple], urls: list[str], concurrency: int):
                def one(i_job):
                    i, (key, node, a) = i_job
                    batch = for_assignment(base, node, a)
                    length, pieces = encode(batch)
                    upload_batch(urls[i % len(urls)], key, a.id, batch.meta.batch_id, digest(batch), length, pieces)

                def run():
                    with cf.ThreadPoolExecutor(concurrency) as pool:
                        list(pool.map(one, enumerate(jobs)))

                return run

            one_url = [ingests[0].url]
            uploads(workers.take(1), one_url, 1)()  # warm the ingest
            procs = {"ingest": ingests[0].proc.pid, "moto": moto.proc.pid, "orchestrator": orch.proc.pid, **client}
            results["upload_s3"] = timed("upload_s3", uploads(workers.take(n), one_url, 1), n, nbytes, procs)
            results["cost_ratio"] = round(results["upload_s3"]["s_per_batch"] / results["direct_s3"]["s_per_batch"], 3)
            log(f"cost_ratio: {results['cost_ratio']}")
            m = n * 2
            results["sustained_s3_1proc"] = timed(
                "sustained_s3_1proc", uploads(workers.take(m), one_url, clients), m, nbytes, procs, clients=clients
            )
            ingests.append(Ingest(tmp, config, moto.spec("up2/"), "s3-2"))
            two_urls = [ingests[0].url, ingests[1].url]
            uploads(workers.take(1), [two_urls[1]], 1)()
            procs2 = {**procs, "ingest2": ingests[1].proc.pid}
            results["sustained_s3_2proc"] = timed(
                "sustained_s3_2proc", uploads(workers.take(m), two_urls, clients), m, nbytes, procs2, clients=clients
            )
            for proc in ingests:
                proc.close()
            ingests = [Ingest(tmp, config, str(tmp / "up-local-1"), "local-1")]
            uploads(workers.take(1), [ingests[0].url], 1)()
            procs = {"ingest": ingests[0].proc.pid, "orchestrator": orch.proc.pid, **client}
            results["sustained_local_1proc"] = timed(
                "sustained_local_1proc",
                uploads(workers.take(m), [ingests[0].url], clients),
                m,
                nbytes,
                procs,
                clients=clients,
            )
            ingests.append(Ingest(tmp, config, str(tmp / "up-local-2"), "local-2"))
            local_urls = [ingests[0].url, ingests[1].url]
            uploads(workers.take(1), [local_urls[1]], 1)()
            results["sustained_local_2proc"] = timed(
                "sustained_local_2proc",
                uploads(workers.take(m), local_urls, clients),
                m,
                nbytes,
                {**procs, "ingest2": ingests[1].proc.pid},
                clients=clients,
            )

            def reads(store: RolloutStore):
                refs = store.list()[:n]
                digests = {r: store.commit(r.version, r.batch_id) for r in refs}

                def run():
                    for r in refs:
                        store.read(r.version, r.batch_id, expect_sha256=digests[r])

                return run, len(refs)

            run, count = reads(local)
            results["read_local"] = timed("read_local", run, count, nbytes, me)
            run, count = reads(s3)
            results["read_s3"] = timed("read_s3", run, count, nbytes, {**me, "moto": moto.proc.pid})
    finally:
        for proc in ingests:
            proc.close()
        moto.close()
    results["second_process_gain"] = {
        sink: round(results[f"sustained_{sink}_2proc"]["MB_per_s"] / results[f"sustained_{sink}_1proc"]["MB_per_s"], 3)
        for sink in ("s3", "local")
    }
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
