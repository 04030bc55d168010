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
- `upload_local`, `upload_s3`: one batch at a time through one ingest process to the same stores (the client
  computes the digest and streams the batch; the ingest admits it with the orchestrator, lays it into arrays
  as it arrives, writes it while hashing it, commits it on the signed digest and announces it). The four kinds
  are interleaved batch by batch so that the machine's noise hits them alike; `cost_ratio` compares medians of
  wall seconds per batch, and CPU seconds per batch summed over every process involved (writer or client,
  ingest, orchestrator, moto);
- `sustained_{tmpfs,s3}_{1,2}proc`: `--clients` uploads at once through one or two ingest processes writing to
  /dev/shm (the ingest's own capacity: a store that costs little) or to the S3 server, interleaved for
  `--repeat` rounds: the batches per second and MB/s of batch data, and MB per CPU-second of the ingest
  processes (what one core of an ingest sustains, whatever else the machine runs); `second_process_gain`;
- `read_local`, `read_s3`: `RolloutStore.read` with the digest check (what validators and the learner do).

With `--ingest-cpus C` each tmpfs ingest process runs in a cgroup of its own capped at C CPUs: on a machine with
few cores the second process otherwise competes with the first, the clients and the orchestrator for the same
cores, and the run cannot tell "a second process adds nothing" from "there was no core left for it".

CPU seconds come from /proc; load averages are recorded at the start and end: the machine is shared, so rerun
when they are high.

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
import shutil
import statistics
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
prompts_per_step = {prompts}
samples_per_prompt = 16
max_prompt_len = 512
max_new_tokens = 3840
[model]
max_seq_len = 4352
[trainer]
batch_size = {samples}
async_level = 2
[orchestrator]
allow_cpu_nodes = true
admin_token = "{token}"
prompts_per_assignment = 8
max_inflight_per_node = 1000
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


def limit_cpu(pid: int, cores: float, name: str) -> Path:
    """Put `pid` in a cgroup of its own allowed `cores` CPUs (cgroup v2 cpu.max, else v1 cfs quota; needs root)."""
    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    if unified.is_file() and "cpu" in unified.read_text().split():
        group = Path("/sys/fs/cgroup") / f"uploads-bench-{name}"
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{int(cores * 100_000)} 100000")
    else:
        group = Path("/sys/fs/cgroup/cpu") / f"uploads-bench-{name}"
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * 100_000)))
    (group / "cgroup.procs").write_text(str(pid))
    return group


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
        out, deadline = [], time.monotonic() + 60
        while len(out) < n:
            if time.monotonic() > deadline:
                raise RuntimeError("no fresh assignments: the async window is full (raise prompts_per_step)")
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


def stats(seconds: list[float], nbytes: int, cpu: dict[str, float] | None = None, per: int = 1) -> dict:
    """Median wall seconds per round of `per` batches, MB/s, and the CPU seconds per batch of each process."""
    med = statistics.median(seconds)
    out = {
        "rounds": len(seconds),
        "batches_per_round": per,
        "s_per_batch": round(med / per, 4),
        "batches_per_s": round(per / med, 2),
        "MB_per_s": round(per * nbytes / med / 1e6, 1),
        "rounds_s": [round(x, 3) for x in seconds],
    }
    if cpu:
        batches = len(seconds) * per
        out["cpu_s_per_batch"] = {name: round(c / batches, 4) for name, c in cpu.items()}
        ingest = sum(c for name, c in cpu.items() if name.startswith("ingest"))
        if ingest:
            out["ingest_MB_per_cpu_s"] = round(batches * nbytes / ingest / 1e6, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=8, help="batches of each kind in the per-batch costs")
    parser.add_argument("--clients", type=int, default=4, help="concurrent uploads in the sustained runs")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each sustained run (interleaved)")
    parser.add_argument(
        "--ingest-cpus",
        type=float,
        default=None,
        help="cap each tmpfs ingest process of the sustained runs at this many CPUs (a cgroup each; root): "
        "whether a second process adds where each has a core's share of its own, on a machine with few cores",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    n, clients = args.batches, args.clients
    base = template()
    nbytes = encode(base)[0]
    tmp = Path(tempfile.mkdtemp(prefix="uploads-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="uploads-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    results: dict = {
        "batch": {"samples": SAMPLES, "tokens_per_sample": TOKENS, "bytes": nbytes},
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "load_start": load(),
    }
    moto = Moto(tmp)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    config = tmp / "pool.toml"
    orch = OrchestratorProcess(tmp / "orchestrator.log", config)
    uploads_planned = 5 + 2 * n + args.repeat * 6 * 2 * clients + 16  # every upload holds an assignment
    prompts = 8 * -(-uploads_planned // 3)  # the window: (async_level 2 + 1) x prompts_per_step / 8 assignments
    config.write_text(CONFIG.format(run=tmp / "run", token=TOKEN, url=orch.url, prompts=prompts, samples=16 * prompts))
    ingests: dict[str, Ingest] = {}
    groups: list[Path] = []
    try:
        with orch:
            workers = Workers(tmp, orch.url, 4)
            local = RolloutStore.open(tmp / "direct-local")
            s3 = RolloutStore.open(moto.spec("direct/"))
            for name, store in (("s3a", moto.spec("up-a/")), ("s3b", moto.spec("up-b/"))):
                ingests[name] = Ingest(tmp, config, store, name)
            for name in ("local", "shma", "shmb"):
                where = tmp / "up-local" if name == "local" else shm / name
                ingests[name] = Ingest(tmp, config, str(where), name)
            pids = {name: proc.proc.pid for name, proc in ingests.items()}
            if args.ingest_cpus is not None:
                results["ingest_cpus"] = args.ingest_cpus
                for name in ("shma", "shmb"):
                    groups.append(limit_cpu(pids[name], args.ingest_cpus, name))
            me, counter = os.getpid(), [0]

            def direct(store: RolloutStore) -> None:
                counter[0] += 1
                fake = type("A", (), {"id": counter[0], "version": 1})()
                store.write(for_assignment(base, f"{counter[0]:064x}", fake))

            def upload(url: str, job: tuple) -> None:
                key, node, a = job
                batch = for_assignment(base, node, a)
                length, pieces = encode(batch)
                upload_batch(url, key, a.id, batch.meta.batch_id, digest(batch), length, pieces)

            for proc in ingests.values():  # warm every store and process
                upload(proc.url, workers.take(1)[0])
            direct(local), direct(s3)

            # per-batch cost, one batch at a time, the kinds interleaved so that the machine's noise hits them alike
            kinds = {
                "direct_local": (lambda: direct(local), {"writer": me}),
                "upload_local": (
                    lambda job: upload(ingests["local"].url, job),
                    {"client": me, "ingest": pids["local"]},
                ),
                "direct_s3": (lambda: direct(s3), {"writer": me, "moto": moto.proc.pid}),
                "upload_s3": (
                    lambda job: upload(ingests["s3a"].url, job),
                    {"client": me, "ingest": pids["s3a"], "moto": moto.proc.pid},
                ),
            }
            walls = {k: [] for k in kinds}
            cpus = {k: {} for k in kinds}
            for i in range(n):
                jobs = workers.take(2)
                for kind, (fn, procs) in kinds.items():
                    watch = {**procs, "orchestrator": orch.proc.pid} if kind.startswith("upload") else procs
                    c0 = {name: cpu_seconds(pid) for name, pid in watch.items()}
                    t0 = time.perf_counter()
                    fn(jobs.pop()) if kind.startswith("upload") else fn()
                    walls[kind].append(time.perf_counter() - t0)
                    for name, pid in watch.items():
                        cpus[kind][name] = cpus[kind].get(name, 0.0) + cpu_seconds(pid) - c0[name]
                log(
                    f"round {i + 1}/{n}: "
                    + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in walls.items())
                    + f" load {load()}"
                )
            for kind in kinds:
                results[kind] = stats(walls[kind], nbytes, cpus[kind])
            cpu_total = {k: sum(results[k]["cpu_s_per_batch"].values()) for k in kinds}
            results["cost_ratio"] = {
                "s3_wall": round(results["upload_s3"]["s_per_batch"] / results["direct_s3"]["s_per_batch"], 3),
                "s3_cpu": round(cpu_total["upload_s3"] / cpu_total["direct_s3"], 3),
                "local_wall": round(results["upload_local"]["s_per_batch"] / results["direct_local"]["s_per_batch"], 3),
                "local_cpu": round(cpu_total["upload_local"] / cpu_total["direct_local"], 3),
            }
            log(f"cost_ratio: {results['cost_ratio']}")

            # sustained: `clients` uploads at once through one or two ingest processes, the setups interleaved
            setups = {
                "tmpfs_1proc": ["shma"],
                "tmpfs_2proc": ["shma", "shmb"],
                "s3_1proc": ["s3a"],
                "s3_2proc": ["s3a", "s3b"],
            }
            m = 2 * clients
            walls = {k: [] for k in setups}
            cpus = {k: {} for k in setups}
            for r in range(args.repeat):
                for setup, names in setups.items():
                    jobs = workers.take(m)
                    urls = [ingests[name].url for name in names]
                    watch = {name: pids[name] for name in names} | {"orchestrator": orch.proc.pid}
                    if setup.startswith("s3"):
                        watch["moto"] = moto.proc.pid
                    c0 = {name: cpu_seconds(pid) for name, pid in watch.items()}
                    t0 = time.perf_counter()
                    with cf.ThreadPoolExecutor(clients) as pool:
                        list(pool.map(lambda ij, urls=urls: upload(urls[ij[0] % len(urls)], ij[1]), enumerate(jobs)))
                    walls[setup].append(time.perf_counter() - t0)
                    for name, pid in watch.items():
                        label = "ingest" + name[-1] if name in names else name
                        cpus[setup][label] = cpus[setup].get(label, 0.0) + cpu_seconds(pid) - c0[name]
                    log(f"{setup} round {r + 1}: {m} batches in {walls[setup][-1]:.2f} s, load {load()}")
            for setup in setups:
                results[f"sustained_{setup}"] = {"clients": clients, **stats(walls[setup], nbytes, cpus[setup], m)}
            results["second_process_gain"] = {
                sink: round(
                    results[f"sustained_{sink}_2proc"]["MB_per_s"] / results[f"sustained_{sink}_1proc"]["MB_per_s"], 3
                )
                for sink in ("tmpfs", "s3")
            }

            # reads with the digest check, as validators and the learner read
            for name, store in (("read_local", local), ("read_s3", s3)):
                refs = store.list()[:n]
                digests = {r: store.commit(r.version, r.batch_id) for r in refs}
                watch = {"reader": me} | ({"moto": moto.proc.pid} if name == "read_s3" else {})
                c0 = {k: cpu_seconds(p) for k, p in watch.items()}
                seconds = []
                for r in refs:
                    t0 = time.perf_counter()
                    store.read(r.version, r.batch_id, expect_sha256=digests[r])
                    seconds.append(time.perf_counter() - t0)
                results[name] = stats(seconds, nbytes, {k: cpu_seconds(p) - c0[k] for k, p in watch.items()})
                log(f"{name}: {results[name]['s_per_batch']} s per batch")
    finally:
        for proc in ingests.values():
            proc.close()
        for group in groups:
            group.rmdir()
        moto.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_end"] = load()
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
