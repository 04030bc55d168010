"""Load on the orchestrator: N simulated nodes in one asyncio process against `intellect orchestrator` on 127.0.0.1.

Each worker heartbeats every second (signed, through bridge.protocol's AsyncOrchestratorClient) and announces
a batch for its assignment every `--batch-every` seconds; validators (one per 50 workers) claim and judge the
batches as they come; a learner reads accepted batches every second and announces a new policy version every
10 s. Latency is measured end to end at the client, per route, over `--seconds` after a warm-up.

Side by side in the same run, the reference: the same N clients sending one unsigned GET /healthz per second
each to the same server (no signature, no database): the floor set by the HTTP stack and this machine. The
service's target is p99 < 100 ms with zero errors at 1,000 nodes on a 2-core machine.

    python benchmarks/orchestrator_load.py [--nodes 100 500 1000] [--seconds 60]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console

from bridge.protocol import (AsyncOrchestratorClient, BatchAnnouncement, HardwareReport, OrchestratorError,
                             RetryPolicy, Verdict)
from orchestrator.process import OrchestratorProcess

TOKEN = "bench-token"
CONFIG = """
[run]
dir = "{dir}"
log_level = "WARNING"
[orchestrator]
allow_cpu_nodes = true
admin_token = "{token}"
heartbeat_interval_s = 1.0
unhealthy_after_s = 5.0
dead_after_s = 30.0
prompts_per_assignment = 1
submit_rate_per_min = 600
submit_burst = 20
ban_after_rejections = 0  # the simulated validators reject 5% at random
[data]
prompts_per_step = 4096
samples_per_prompt = 2
[trainer]
batch_size = 8192
micro_batch_size = 16
async_level = 2
"""


class Recorder:
    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.started: list[float] = []  # when each measured request began (all routes), for the timeline
        self.every: list[float] = []
        self.errors: dict[str, int] = defaultdict(int)
        self.recording = False

    async def timed(self, route: str, call):
        start = time.perf_counter()
        try:
            result = await call
        except (OrchestratorError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if self.recording:
                self.errors[f"{route}: {type(exc).__name__} {getattr(exc, 'status', '')}"] += 1
            return None
        if self.recording:
            self.latency[route].append(time.perf_counter() - start)
            self.started.append(start)
            self.every.append(self.latency[route][-1])
        return result

    def summary(self, seconds: float) -> dict:
        every = [x for xs in self.latency.values() for x in xs]

        def stats(xs: list[float]) -> dict:
            ms = np.array(xs) * 1000
            return {"requests": len(xs), "rps": round(len(xs) / seconds, 1),
                    "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
                    "max_ms": round(float(ms.max()), 2)} if xs else {"requests": 0}

        # p99 within each second of the run: shows whether slow requests are spread out or come in bursts
        timeline = []
        if self.started:
            began = np.array(self.started)
            second = ((began - began.min()) // 1).astype(int)
            lat = np.array(self.every) * 1000
            timeline = [round(float(np.percentile(lat[second == i], 99)), 1) if (second == i).any() else None
                        for i in range(second.max() + 1)]
        return {**stats(every), "errors": sum(self.errors.values()), "error_kinds": dict(self.errors),
                "routes": {route: stats(xs) for route, xs in sorted(self.latency.items())},
                "p99_ms_by_second": timeline}


async def worker(client: AsyncOrchestratorClient, rec: Recorder, stop: asyncio.Event, batch_every: float) -> None:
    await asyncio.sleep(random.uniform(0, 1))
    next_batch = time.monotonic() + random.uniform(0, batch_every)
    n = 0
    while not stop.is_set():
        tick = time.monotonic()
        reply = await rec.timed("heartbeat", client.heartbeat(metrics={"tokens_per_s": 1000.0}))
        if reply and reply.assignments and time.monotonic() >= next_batch:
            a = reply.assignments[0]
            name = f"{client.node_key[:12]}-{n}"
            n += 1
            await rec.timed("announce", client.announce_batch(BatchAnnouncement(
                batch_id=name, assignment_id=a.id, version=a.version, num_samples=a.prompts * a.samples_per_prompt,
                num_tokens=4096, store_path=f"file:///bench/v{a.version:06d}/{name}",
                sha256=hashlib.sha256(name.encode()).hexdigest())))
            next_batch = time.monotonic() + batch_every
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))


async def validator(client: AsyncOrchestratorClient, rec: Recorder, stop: asyncio.Event) -> None:
    while not stop.is_set():
        claim = await rec.timed("claim", client.claim())
        if claim is None or claim.batch is None:
            await asyncio.sleep(0.5)
            continue
        b = claim.batch
        accepted = random.random() < 0.95
        await rec.timed("verdict", client.verdict(b.batch_id, Verdict(
            accepted=accepted, rewards=[1.0] * b.num_samples if accepted else [],
            failed_checks=[] if accepted else ["toploc"], num_tokens=b.num_tokens)))


async def learner(client: AsyncOrchestratorClient, rec: Recorder, stop: asyncio.Event) -> None:
    after, version, last_announce = 0, 0, time.monotonic()
    while not stop.is_set():
        page = await rec.timed("learner_batches", client.batches(min_version=max(0, version - 2), after=after,
                                                                 limit=1000))
        after = page.next_after if page else after
        if time.monotonic() - last_announce >= 10:
            version += 1
            await rec.timed("policy", client.announce_policy(version))
            last_announce = time.monotonic()
        await asyncio.sleep(1.0)


async def health_only(http: aiohttp.ClientSession, url: str, rec: Recorder, stop: asyncio.Event) -> None:
    async def get() -> int:
        async with http.get(url + "/healthz") as reply:
            await reply.read()
            return reply.status

    await asyncio.sleep(random.uniform(0, 1))
    while not stop.is_set():
        tick = time.monotonic()
        status = await rec.timed("healthz", get())
        if status not in (None, 200) and rec.recording:
            rec.errors[f"healthz: HTTP {status}"] += 1
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_load(url: str, server_pid: int, nodes: int, seconds: float, warmup: float, batch_every: float,
                   console: Console) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=nodes + 64)) as http:
        retry = RetryPolicy(attempts=1)  # every failed request counts as an error
        workers = [AsyncOrchestratorClient(url, key=Ed25519PrivateKey.generate(), retry=retry, session=http)
                   for _ in range(nodes)]
        validators = [AsyncOrchestratorClient(url, key=Ed25519PrivateKey.generate(), retry=retry, session=http)
                      for _ in range(max(2, nodes // 50))]
        admin = AsyncOrchestratorClient(url, admin_token=TOKEN, retry=retry, session=http)

        async def join() -> None:  # just before the orchestrator's turn, so that nobody is silent for long
            hw = HardwareReport(cpu_count=8, memory_gib=32)
            for i in range(0, len(workers), 50):
                await asyncio.gather(*(w.register("worker", hw) for w in workers[i:i + 50]))
            await asyncio.gather(*(v.register("validator", hw) for v in validators))

        results = {}
        for name, make in (("healthz_reference", lambda rec, stop: [health_only(http, url, rec, stop)
                                                                    for _ in range(nodes)]),
                           ("orchestrator", lambda rec, stop: [worker(w, rec, stop, batch_every) for w in workers]
                            + [validator(v, rec, stop) for v in validators] + [learner(admin, rec, stop)])):
            if name == "orchestrator":
                await join()
            rec, stop = Recorder(), asyncio.Event()
            gc.collect()
            gc.freeze()  # the simulated nodes' own full collections would show as the server's latency
            tasks = [asyncio.create_task(t) for t in make(rec, stop)]
            await asyncio.sleep(warmup)
            rec.recording = True
            console.log(f"{nodes} nodes, {name}: measuring {seconds:g} s")
            server_cpu, own_cpu = cpu_seconds(server_pid), time.process_time()
            await asyncio.sleep(seconds)
            server_cpu, own_cpu = cpu_seconds(server_pid) - server_cpu, time.process_time() - own_cpu
            rec.recording = False
            stop.set()
            await asyncio.gather(*tasks)
            results[name] = summary = rec.summary(seconds)
            # CPU per request does not depend on what else runs on the machine; latency does.
            summary["server_cpu_ms_per_request"] = round(1000 * server_cpu / max(1, summary["requests"]), 3)
            summary["server_cpu_share"] = round(server_cpu / seconds, 3)
            summary["load_generator_cpu_share"] = round(own_cpu / seconds, 3)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per load")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--batch-every", type=float, default=10.0, help="seconds between a worker's batches")
    args = parser.parse_args()
    console = Console(stderr=True)
    out = {"machine_cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "seconds": args.seconds, "batch_every_s": args.batch_every,
           "target": "1000 nodes: p99 < 100 ms, 0 errors", "loads": {}}
    for nodes in args.nodes:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "bench.toml"
            config.write_text(CONFIG.format(dir=Path(tmp) / "run", token=TOKEN))
            with OrchestratorProcess(Path(tmp) / "server.log", config) as server:
                out["loads"][str(nodes)] = asyncio.run(run_load(server.url, server.proc.pid, nodes, args.seconds, args.warmup,
                                                                args.batch_every, console))
    out["load_average_at_end"] = os.getloadavg()  # the machine is shared: other processes compete for the cores
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
