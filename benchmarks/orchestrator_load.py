"""Load on the orchestrator: N simulated nodes in one asyncio process against `intellect orchestrator` on 127.0.0.1.

Each worker heartbeats every second (signed, through bridge.protocol's AsyncOrchestratorClient) and announces
a batch for its assignment every `--batch-every` seconds; validators (one per 50 workers) heartbeat every second
and claim and judge the batches as they come; a learner reads accepted batches every second and announces a new
policy version every 10 s. Latency is measured end to end at the client, per route, over `--seconds` after a warm-up.

Side by side in the same run, the reference: the same N clients sending one unsigned GET /healthz per second
each to the same server (no signature, no database): the floor set by the HTTP stack and this machine. The
service's target is p99 < 100 ms with zero errors at 1,000 nodes on a 2-core machine.

The load generator runs on uvloop, with its long-lived objects frozen out of the garbage collector and fewer
young-generation collections: its own pauses would otherwise show as the server's latency. Its clients are
AsyncOrchestratorClient, which signs and encodes every request, on `_light_http.LightSession` (the same requests
as aiohttp sends, at a fraction of the CPU: the load generator shares the machine with the server it measures);
`--http-client aiohttp` runs them on aiohttp as nodes do.

The server runs with its default connection limits (orchestrator/server.py), so the simulated nodes come from
many loopback addresses (127.0.1.x, `--nodes-per-address` each), as nodes on the internet do.

`--hostile` measures each load twice on fresh servers: clean, then with a hostile mix beside the same honest
nodes (each part from its own loopback addresses): `--free-keys` keys that register, take assignments and never
deliver (heartbeating every second; assignments expire after `--deadline-s`), `--slow-connections` connections
that trickle a request head a byte every 2 s and reconnect when closed, and `--oversized-per-s` requests per
second whose header grows to 1 MiB. It reports the honest nodes' throughput (requests/s, batches announced/s)
against the clean run's, their p99, and what the hostile clients got.

    python benchmarks/orchestrator_load.py [--nodes 100 500 1000] [--seconds 60] [--hostile]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import multiprocessing
import os
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import numpy as np
import uvloop
from _common import OrchestratorProcess
from _light_http import LightSession
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console

from bridge.protocol import (
    AsyncOrchestratorClient,
    BatchAnnouncement,
    HardwareReport,
    OrchestratorError,
    RetryPolicy,
    Verdict,
)

TOKEN = "bench-token"
CONFIG = """
[run]
dir = "{dir}"
log_level = "WARNING"
[orchestrator]
allow_cpu_nodes = true
worker_store_writes = true
admin_token = "{token}"
heartbeat_interval_s = 1.0
unhealthy_after_s = 5.0
dead_after_s = 30.0
prompts_per_assignment = 1
submit_rate_per_min = 600
submit_burst = 20
ban_after_rejections = 0  # the simulated validators reject 5% at random
assignment_deadline_s = {deadline}
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
                kind = f"{route}: {type(exc).__name__} {getattr(exc, 'status', '')}"
                if getattr(exc, "status", None) == 0:  # no answer: what the connection did instead
                    kind += " " + str(exc.detail).rpartition("(last: ")[2].rstrip(")")[:60]
                self.errors[kind] += 1
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
            return (
                {
                    "requests": len(xs),
                    "rps": round(len(xs) / seconds, 1),
                    "p50_ms": round(float(np.percentile(ms, 50)), 2),
                    "p99_ms": round(float(np.percentile(ms, 99)), 2),
                    "max_ms": round(float(ms.max()), 2),
                }
                if xs
                else {"requests": 0}
            )

        # p99 within each second of the run: shows whether slow requests are spread out or come in bursts
        timeline = []
        if self.started:
            began = np.array(self.started)
            second = ((began - began.min()) // 1).astype(int)
            lat = np.array(self.every) * 1000
            timeline = [
                round(float(np.percentile(lat[second == i], 99)), 1) if (second == i).any() else None
                for i in range(second.max() + 1)
            ]
        return {
            **stats(every),
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "routes": {route: stats(xs) for route, xs in sorted(self.latency.items())},
            "p99_ms_by_second": timeline,
        }


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
            await rec.timed(
                "announce",
                client.announce_batch(
                    BatchAnnouncement(
                        batch_id=name,
                        assignment_id=a.id,
                        version=a.version,
                        num_samples=a.prompts * a.samples_per_prompt,
                        num_tokens=4096,
                        store_path=f"file:///bench/v{a.version:06d}/{name}",
                        sha256=hashlib.sha256(name.encode()).hexdigest(),
                    )
                ),
            )
            next_batch = time.monotonic() + batch_every
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))


async def validator_heartbeat(client: AsyncOrchestratorClient, rec: Recorder, stop: asyncio.Event) -> None:
    """Once a second, as a validator does beside its claims (else the service counts it dead after 30 s)."""
    await asyncio.sleep(random.uniform(0, 1))
    while not stop.is_set():
        tick = time.monotonic()
        await rec.timed("heartbeat", client.heartbeat())
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))


async def validator(client: AsyncOrchestratorClient, rec: Recorder, stop: asyncio.Event) -> None:
    beat = asyncio.create_task(validator_heartbeat(client, rec, stop))
    while not stop.is_set():
        claim = await rec.timed("claim", client.claim())
        if claim is None or claim.batch is None:
            await asyncio.sleep(0.5)
            continue
        b = claim.batch
        accepted = random.random() < 0.95
        await rec.timed(
            "verdict",
            client.verdict(
                b.batch_id,
                Verdict(
                    accepted=accepted,
                    rewards=[1.0] * b.num_samples if accepted else [],
                    failed_checks=[] if accepted else ["toploc"],
                    num_tokens=b.num_tokens,
                ),
            ),
        )
    await beat


async def learner(client: AsyncOrchestratorClient, rec: Recorder, stop: asyncio.Event) -> None:
    after, version, last_announce, taken = 0, 0, time.monotonic(), []
    while not stop.is_set():
        page = await rec.timed(
            "learner_batches", client.batches(min_version=max(0, version - 2), after=after, limit=1000)
        )
        after = page.next_after if page else after
        taken += [b.batch_id for b in page.batches] if page else []
        if time.monotonic() - last_announce >= 10:  # a step took what was read since the last one
            version += 1
            await rec.timed("policy", client.announce_policy(version, consumed=taken[-4096:]))
            last_announce, taken = time.monotonic(), []
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


def machine_busy_cpus() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all processes and the kernel (Linux /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values) - idle) / os.sysconf("SC_CLK_TCK"), sum(values) / os.sysconf("SC_CLK_TCK")


async def loop_lag(rec: Recorder, lags: list[float], stop: asyncio.Event) -> None:
    """How late this process's own event loop runs a 10 ms timer: the part of every measured latency that is
    the load generator's, not the server's."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        if rec.recording:
            lags.append(time.perf_counter() - start - 0.01)


def address(block: int, i: int) -> str:
    """The i-th loopback address of a block (1: honest nodes, 2: free keys, 3: slow connections, 4: oversized)."""
    return f"127.{block}.{i // 250}.{i % 250 + 1}"


class Sessions:
    """HTTP sessions, one per source address, `per_address` clients each: `LightSession` (the default) or
    aiohttp's `ClientSession` (`http_client="aiohttp"`, the client that nodes run)."""

    def __init__(self, block: int, per_address: int, http_client: str = "light"):
        self.block, self.per_address, self.http_client, self.sessions = block, per_address, http_client, []

    def for_client(self, i: int) -> aiohttp.ClientSession | LightSession:
        while len(self.sessions) <= i // self.per_address:
            source = address(self.block, len(self.sessions))
            self.sessions.append(
                LightSession(source)
                if self.http_client == "light"
                else aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=self.per_address + 8, local_addr=(source, 0))
                )
            )
        return self.sessions[i // self.per_address]

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sessions))


async def free_key(client: AsyncOrchestratorClient, counts: dict, stop: asyncio.Event) -> None:
    """Takes assignments and never delivers."""
    await asyncio.sleep(random.uniform(0, 1))
    while not stop.is_set():
        tick = time.monotonic()
        try:
            reply = await client.heartbeat()
            counts["assignments_held"] = counts.get("assignments_held", 0) + len(reply.assignments)
            counts["heartbeats"] = counts.get("heartbeats", 0) + 1
        except (OrchestratorError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            name = f"refused {getattr(exc, 'status', type(exc).__name__)}"
            counts[name] = counts.get(name, 0) + 1
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))


async def slow_connection(host: str, port: int, source: str, counts: dict, stop: asyncio.Event) -> None:
    """Holds a connection that trickles a request head, a byte every 2 s; reconnects when closed."""
    await asyncio.sleep(random.uniform(0, 2))
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            counts["connect_failed"] = counts.get("connect_failed", 0) + 1
            await asyncio.sleep(1)
            continue
        counts["connections"] = counts.get("connections", 0) + 1
        started = time.monotonic()
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            while not stop.is_set():
                try:
                    answer = await asyncio.wait_for(reader.read(256), 2.0)
                except asyncio.TimeoutError:
                    writer.write(b"a")
                    await writer.drain()
                    continue
                status = answer[9:12].decode(errors="replace") if answer else "closed"
                counts[f"ended {status}"] = counts.get(f"ended {status}", 0) + 1
                counts["held_s_total"] = counts.get("held_s_total", 0.0) + time.monotonic() - started
                break
        except OSError:
            counts["ended reset"] = counts.get("ended reset", 0) + 1
        finally:
            writer.close()


async def oversized(host: str, port: int, source: str, per_s: float, counts: dict, stop: asyncio.Event) -> None:
    """Requests whose header grows to 1 MiB, `per_s` of them per second."""
    chunk = b"b" * 65536
    while not stop.is_set():
        tick = time.monotonic()
        sent, writer = 0, None
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range(16):
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
            writer.write(b"\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(256), 5)
            status = answer[9:12].decode(errors="replace") if answer else "closed"
        except (OSError, asyncio.TimeoutError):
            status = "reset"
        counts[f"answered {status}"] = counts.get(f"answered {status}", 0) + 1
        counts["bytes_sent_before_close"] = counts.get("bytes_sent_before_close", 0) + sent
        if writer is not None:
            writer.close()
        try:  # the pause before the next, cut short by the stop
            await asyncio.wait_for(stop.wait(), max(0.0, 1.0 / per_s - (time.monotonic() - tick)))
        except asyncio.TimeoutError:
            pass


async def hostile_mix(url: str, hostile: dict, per_address: int, http_client: str, registered, stop_flag) -> dict:
    """The attackers (in their own process, as they would be on their own machines): register the free keys,
    set `registered`, run until `stop_flag` is set; returns what each kind of client got."""
    host, port = url.rsplit("/", 1)[1].split(":")
    sessions = Sessions(2, per_address, http_client)
    retry = RetryPolicy(attempts=1)
    free = [
        AsyncOrchestratorClient(url, key=Ed25519PrivateKey.generate(), retry=retry, session=sessions.for_client(i))
        for i in range(hostile["free_keys"])
    ]
    hw = HardwareReport(cpu_count=8, memory_gib=32)
    for i in range(0, len(free), 50):
        await asyncio.gather(*(f.register("worker", hw) for f in free[i : i + 50]))
    registered.set()
    mix: dict[str, dict] = {"free_keys": {}, "slow_connections": {}, "oversized_headers": {}}
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(t)
        for t in [free_key(f, mix["free_keys"], stop) for f in free]
        + [
            slow_connection(host, int(port), address(3, i // 30), mix["slow_connections"], stop)
            for i in range(hostile["slow_connections"])
        ]
        + [
            oversized(host, int(port), address(4, i), hostile["oversized_per_s"] / 4, mix["oversized_headers"], stop)
            for i in range(4 if hostile["oversized_per_s"] > 0 else 0)
        ]
    ]
    while not stop_flag.is_set():
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*tasks)
    await sessions.close()
    return mix


def _hostile_process(
    url: str, hostile: dict, per_address: int, http_client: str, registered, stop_flag, results
) -> None:
    gc.collect()
    gc.freeze()
    results.put(uvloop.run(hostile_mix(url, hostile, per_address, http_client, registered, stop_flag)))


async def run_load(
    url: str,
    server_pid: int,
    nodes: int,
    seconds: float,
    warmup: float,
    batch_every: float,
    console: Console,
    reference: bool = True,
    hostile: dict | None = None,
    per_address: int = 20,
    http_client: str = "light",
) -> dict:
    honest = Sessions(1, per_address, http_client)
    try:
        return await _run_load(
            url, server_pid, nodes, seconds, warmup, batch_every, console, reference, hostile, honest, per_address
        )
    finally:
        await honest.close()


async def _run_load(
    url,
    server_pid,
    nodes,
    seconds,
    warmup,
    batch_every,
    console,
    reference,
    hostile,
    honest: Sessions,
    per_address: int,
) -> dict:
    retry = RetryPolicy(attempts=1)  # every failed request counts as an error
    workers = [
        AsyncOrchestratorClient(url, key=Ed25519PrivateKey.generate(), retry=retry, session=honest.for_client(i))
        for i in range(nodes)
    ]
    validators = [
        AsyncOrchestratorClient(
            url, key=Ed25519PrivateKey.generate(), retry=retry, session=honest.for_client(nodes + i)
        )
        for i in range(max(2, nodes // 50))
    ]
    admin = AsyncOrchestratorClient(
        url, admin_token=TOKEN, retry=retry, session=honest.for_client(nodes + len(validators))
    )

    async def join() -> None:  # just before the orchestrator's turn, so that nobody is silent for long
        hw = HardwareReport(cpu_count=8, memory_gib=32)
        for i in range(0, len(workers), 50):
            await asyncio.gather(*(w.register("worker", hw) for w in workers[i : i + 50]))
        await asyncio.gather(*(v.register("validator", hw) for v in validators))

    attackers = None
    if hostile:
        ctx = multiprocessing.get_context("spawn")
        registered, stop_flag, mix_results = ctx.Event(), ctx.Event(), ctx.Queue()
        attackers = ctx.Process(
            target=_hostile_process,
            args=(url, hostile, per_address, honest.http_client, registered, stop_flag, mix_results),
            daemon=True,
        )

    results = {}
    phases = (
        [
            (
                "healthz_reference",
                lambda rec, stop: [health_only(honest.for_client(i), url, rec, stop) for i in range(nodes)],
            )
        ]
        if reference
        else []
    )
    phases.append(
        (
            "orchestrator",
            lambda rec, stop: (
                [worker(w, rec, stop, batch_every) for w in workers]
                + [validator(v, rec, stop) for v in validators]
                + [learner(admin, rec, stop)]
            ),
        )
    )
    for name, make in phases:
        if name == "orchestrator":
            await join()
            if attackers is not None:
                attackers.start()
                while not registered.is_set():
                    await asyncio.sleep(0.1)
        rec, stop = Recorder(), asyncio.Event()
        gc.collect()
        gc.freeze()  # the simulated nodes' own full collections would show as the server's latency
        gc.set_threshold(10_000, 20, 1000)  # and so would their frequent young ones (4.6 s in a minute)
        lags: list[float] = []
        tasks = [asyncio.create_task(t) for t in make(rec, stop)]
        tasks.append(asyncio.create_task(loop_lag(rec, lags, stop)))
        await asyncio.sleep(warmup)
        rec.recording = True
        console.log(f"{nodes} nodes, {name}: measuring {seconds:g} s")
        server_cpu, own_cpu, machine = cpu_seconds(server_pid), time.process_time(), machine_busy_cpus()
        attackers_cpu = cpu_seconds(attackers.pid) if attackers is not None and name == "orchestrator" else None
        await asyncio.sleep(seconds)
        server_cpu, own_cpu = cpu_seconds(server_pid) - server_cpu, time.process_time() - own_cpu
        busy, total = (now - then for now, then in zip(machine_busy_cpus(), machine))
        if attackers_cpu is not None:
            attackers_cpu = cpu_seconds(attackers.pid) - attackers_cpu
        rec.recording = False
        stop.set()
        await asyncio.gather(*tasks)
        results[name] = summary = rec.summary(seconds)
        # CPU per request does not depend on what else runs on the machine; latency does.
        summary["server_cpu_ms_per_request"] = round(1000 * server_cpu / max(1, summary["requests"]), 3)
        summary["server_cpu_share"] = round(server_cpu / seconds, 3)
        summary["load_generator_cpu_share"] = round(own_cpu / seconds, 3)
        if attackers_cpu is not None:
            summary["hostile_process_cpu_share"] = round(attackers_cpu / seconds, 3)
        # the whole machine, in CPUs busy of os.cpu_count(): near it, every process waits for a CPU
        summary["machine_cpus_busy"] = round(busy / total * (os.cpu_count() or 1), 2)
        lag_ms = np.array(lags or [0.0]) * 1000
        summary["load_generator_loop_lag_ms"] = {
            "p50": round(float(np.percentile(lag_ms, 50)), 2),
            "p99": round(float(np.percentile(lag_ms, 99)), 2),
            "max": round(float(lag_ms.max()), 2),
        }
    if attackers is not None:
        stop_flag.set()
        results["hostile_mix"] = await asyncio.to_thread(mix_results.get, True, 60)
        attackers.join(10)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per load")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--batch-every", type=float, default=10.0, help="seconds between a worker's batches")
    parser.add_argument("--nodes-per-address", type=int, default=20, help="honest nodes per loopback address")
    parser.add_argument(
        "--http-client",
        choices=["light", "aiohttp"],
        default="light",
        help="the load generator's HTTP client (light: benchmarks/_light_http.py; aiohttp: what nodes run)",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the GET /healthz floor")
    parser.add_argument("--hostile", action="store_true", help="each load clean, then with the hostile mix")
    parser.add_argument("--free-keys", type=int, default=200)
    parser.add_argument("--slow-connections", type=int, default=300)
    parser.add_argument("--oversized-per-s", type=float, default=20.0)
    parser.add_argument("--deadline-s", type=float, default=15.0, help="orchestrator.assignment_deadline_s")
    args = parser.parse_args()
    console = Console(stderr=True)
    out = {
        "machine_cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "seconds": args.seconds,
        "batch_every_s": args.batch_every,
        "http_client": args.http_client,
        "target": "1000 nodes: p99 < 100 ms, 0 errors; hostile mix: honest throughput >= 90% of clean, p99 < 200 ms",
        "loads": {},
    }
    hostile = (
        {
            "free_keys": args.free_keys,
            "slow_connections": args.slow_connections,
            "oversized_per_s": args.oversized_per_s,
        }
        if args.hostile
        else None
    )
    if hostile:
        out["hostile_mix"] = hostile

    def measure(nodes: int, mix: dict | None, reference: bool) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "bench.toml"
            config.write_text(CONFIG.format(dir=Path(tmp) / "run", token=TOKEN, deadline=args.deadline_s))
            with OrchestratorProcess(Path(tmp) / "server.log", config) as server:
                result = uvloop.run(
                    run_load(
                        server.url,
                        server.proc.pid,
                        nodes,
                        args.seconds,
                        args.warmup,
                        args.batch_every,
                        console,
                        reference,
                        mix,
                        args.nodes_per_address,
                        args.http_client,
                    )
                )
                if mix:
                    log = server.log()
                    result["hostile_mix"]["server_log"] = {
                        "expired_lines": log.count("expired ("),
                        "tracebacks": log.count("Traceback"),
                    }
                return result

    for nodes in args.nodes:
        clean = measure(nodes, None, not args.no_reference)
        if not hostile:
            out["loads"][str(nodes)] = clean
            continue
        attacked = measure(nodes, hostile, False)
        a, b = clean["orchestrator"], attacked["orchestrator"]
        out["loads"][str(nodes)] = {
            "clean": clean,
            "hostile": attacked,
            "honest_throughput_ratio": round(b["rps"] / a["rps"], 3) if a.get("rps") else None,
            "honest_batches_ratio": (
                round(b["routes"]["announce"]["requests"] / a["routes"]["announce"]["requests"], 3)
                if a["routes"].get("announce", {}).get("requests")
                else None
            ),
            "honest_p99_ms": {"clean": a.get("p99_ms"), "hostile": b.get("p99_ms")},
            "honest_errors": {"clean": a.get("errors"), "hostile": b.get("errors")},
        }
    out["load_average_at_end"] = os.getloadavg()  # the machine is shared: other processes compete for the cores
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
