"""SHARDCAST speed on loopback, side by side in one run: ours, the reference, and the raw socket limit.

    python benchmarks/shardcast.py [--mib 512] [--clients 1,4] [--chains 1,2,3] [--reference DIR] [--repeat 3]

A version of `--mib` MiB (an HF-like directory: config.json plus one safetensors shard, as `export_params`
writes a model of that size) goes origin -> 2 relays -> N clients, for every N in `--clients`:

- ours: `intellect shardcast origin`, two `relay`s on the origin, N `fetch` processes on both relays, all
  started first; the clock starts when the version is published (its directory renamed into the weights
  directory and STABLE written, as the learner does) and stops when the last client process has exited with
  the version verified and landed. Run three times: with the defaults ("ours": the manifest has part hashes,
  as the learner writes it, so relays pass each checked part on while the rest arrives, and every hop fsyncs
  before STABLE), with a manifest without part hashes ("ours_store_and_forward": each relay stores and
  verifies the whole version before serving it, as before part hashes), and pipelined without fsync, as the
  reference runs ("ours_no_fsync");
- the reference (PyPI `shardcast` 0.3.2, installed with `pip install --no-deps --target DIR`; it needs
  `wget` and `blake3`): an `OriginServer`, two `MiddleNode`s and N `ClientNode`s in their own processes
  (each with its own copy of the package); the clock starts when `broadcast()` is called on the same file
  and stops when the last client has reassembled and verified it. Its polls get their best case: relays
  check every 0.1 s (the default is 30 s) and clients ask every 0.1 s;
- raw: one plain TCP stream of the same bytes on loopback (sendfile from a second process, received into a
  buffer and dropped), the physical limit of a single client's transfer here.

Chains (`--chains`, depths D): origin -> relay 1 -> ... -> relay D -> 1 client, each relay mirroring the one
before it, pipelined ("ours") and store-and-forward ("ours_store_and_forward"), timed the same way. On one
machine every hop shares its CPUs, which the chain then saturates; `--pace-mb-s R` has every server send each
response at most at R MB/s (a stand-in for hops on machines of their own, each bounded by its link). The report's
`pipelined_vs_store_and_forward` puts the two modes' medians side by side for every topology, and
`chain_depth_over_depth_1` divides each depth's median by depth 1's, per mode.

CPU (ours only): every run of ours also reports `cpu_s`, the CPU time (user + system, all threads) each of its
processes spent from the clock's start to the last client's exit: origin, each relay, each client and their total
(from /proc/PID/stat at the clock's start and, for the servers, when the last client has exited; from the
clients' resource usage when they are reaped), and `cpu_bound_s`, that total divided by the number of CPUs: the
shortest wall time this machine's CPUs allow for that work. The summary puts each contestant's median
`cpu_bound_s` beside its median wall time, and `wall_over_cpu_bound`, the ratio of the two medians (near 1: the
run is CPU-bound here).

Per-client MB/s is each client's own transfer (from its first request to the version landed, for the
reference from seeing the version to the verified file). Repeats are interleaved; the summary gives best and
median per contestant. Prints JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import free_port

from bridge.shardcast.manifest import PART_SIZE

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
MIB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")

# `intellect shardcast ...` whose servers send each response at most at PACE bytes/s (argv[1]): a stand-in for
# hops on separate machines, where each link, not one shared CPU, bounds a hop's speed
_PACED = r"""
import asyncio, sys
from bridge.shardcast.server import ShardcastServer
from intellect.cli import main
rate = float(sys.argv.pop(1))
async def send(self, request, resp, f, offset, count):
    loop = asyncio.get_running_loop()
    start, sent = loop.time(), 0
    while count:
        n = min(count, 1 << 20)
        if request.transport is None:
            raise ConnectionResetError("client went away")
        await asyncio.wait_for(loop.sendfile(request.transport, f, offset, n), self.timeout)
        offset, count, sent = offset + n, count - n, sent + n
        if (ahead := start + sent / rate - loop.time()) > 0:
            await asyncio.sleep(ahead)
ShardcastServer._send = send
sys.exit(main(sys.argv[1:]))
"""
_REF_ORIGIN = r"""
import json, sys, time, os
from shardcast.origin_server import OriginServer
origin = OriginServer(sys.argv[1], int(sys.argv[2]))
print("ready", flush=True)
sys.stdin.readline()
t = time.time()
origin.broadcast(sys.argv[3], 50_000_000)
print(json.dumps({"broadcast_s": time.time() - t}), flush=True)
sys.stdin.readline()
"""
_REF_MIDDLE = r"""
import sys, time
from shardcast.middle_node import MiddleNode
node = MiddleNode([sys.argv[1]], sys.argv[2], int(sys.argv[3]), check_interval=0.1)
print("ready", flush=True)
sys.stdin.readline()
"""
_REF_CLIENT = r"""
import json, sys, time
from shardcast.client_node import ClientNode
client = ClientNode(sys.argv[1].split(","), sys.argv[2])
print("ready", flush=True)
start, attempts, out = None, 0, None
while out is None:  # it re-reads the relays' distribution files, which the relays rewrite as they go
    if "v1" in client.list_available_versions():
        start = start or time.time()
        attempts += 1
        out = client.download_version("v1", sys.argv[3])
    if out is None:
        time.sleep(0.1)
print(json.dumps({"ok": True, "seconds": time.time() - start, "attempts": attempts}), flush=True)
"""


class Procs:
    """Child processes, killed at the end whatever happens."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, log: Path, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, **kw)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.procs.clear()


def wait_line(proc: subprocess.Popen, needle: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if needle in line:
            return line
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"process {proc.args} did not print {needle!r} (exit {proc.poll()})")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all its threads) process `pid` has spent so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces: field 3 on
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15: utime, stime, in clock ticks


def exit_times(procs: list[subprocess.Popen], timeout: float = 300.0) -> tuple[list[float], list[float]]:
    """Wall-clock exit time of each process and the CPU seconds (user + system) it spent in its whole life, from
    its resource usage when reaped (a thread per process, blocked in `os.wait4`, which also sets the process's
    returncode); after `timeout` seconds the processes still running are killed and it fails."""
    times: list[float | None] = [None] * len(procs)
    cpu = [0.0] * len(procs)

    def wait(i: int) -> None:
        try:
            _, status, usage = os.wait4(procs[i].pid, 0)
        except ChildProcessError:  # reaped by Popen already (killed after the timeout below)
            return
        times[i] = time.time()
        cpu[i] = usage.ru_utime + usage.ru_stime
        procs[i].returncode = os.waitstatus_to_exitcode(status)

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if None in times:
        late = times.count(None)
        for proc, when in zip(procs, times):
            if when is None:
                proc.kill()
        for t in threads:
            t.join()
        raise RuntimeError(f"{late} client(s) still running after {timeout:.0f} s")
    return times, cpu


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MIB):
            h.update(block)
    return h.hexdigest()


# ---- raw loopback -------------------------------------------------------------------------------------


def raw_serve(port: int, path: str) -> None:
    with socket.create_server(("127.0.0.1", port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn, open(path, "rb") as f:
            size, offset = os.fstat(f.fileno()).st_size, 0
            while offset < size:
                offset += os.sendfile(conn.fileno(), f.fileno(), offset, size - offset)


def raw_loopback(payload: Path, procs: Procs, work: Path) -> float:
    port = free_port()
    server = procs.start([PY, __file__, "--raw-serve", str(port), str(payload)], work / "raw.log")
    wait_line(server, "ready")
    buf = memoryview(bytearray(4 * MIB))
    got = 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        t = time.perf_counter()
        while n := s.recv_into(buf):
            got += n
        seconds = time.perf_counter() - t
    server.wait()
    return got / seconds / 1e6


# ---- ours ---------------------------------------------------------------------------------------------


def part_hashes(path: Path, part_size: int) -> list[str]:
    out = []
    with open(path, "rb") as f:
        while block := f.read(part_size):
            out.append(hashlib.sha256(block).hexdigest())
    return out


def stage_version(payload: Path, staging: Path, part_size: int | None = PART_SIZE) -> None:
    """An HF-like version 1 in `staging` (hard link to the payload: the same bytes, no copy); its manifest has
    part hashes of `part_size` (as the learner writes it), or none (None: as it was written before them)."""
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16"}) + "\n")
    os.link(payload, staging / "model-00001-of-00001.safetensors")
    files = [{"name": p.name, "size": p.stat().st_size, "sha256": sha256(p)} for p in sorted(staging.iterdir())]
    manifest = {"version": 1, "files": files, "total_size": sum(f["size"] for f in files), "created": "bench"}
    if part_size is not None:
        manifest["part_size"] = part_size
        for f in files:
            f["parts"] = part_hashes(staging / f["name"], part_size)
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def run_ours(
    payload: Path,
    clients: int,
    work: Path,
    procs: Procs,
    settings: dict[str, str],
    parts: bool = True,
    chain: int | None = None,
    part_size: int = PART_SIZE,
    pace: float = 0.0,
) -> dict:
    """One run: origin -> 2 relays -> `clients` clients on both, or with `chain` D: origin -> relay 1 -> ... ->
    relay D -> `clients` clients on relay D. `parts`: the manifest has part hashes (relays pipeline); `pace`:
    servers send each response at most at this many bytes/s (0: as fast as they can)."""
    weights, staging = work / "weights", work / "staging" / "v000001"
    weights.mkdir()
    stage_version(payload, staging, part_size if parts else None)
    cli = [PY, "-m", "intellect", "shardcast"]
    servers = [PY, "-c", _PACED, str(pace), "shardcast"] if pace else cli
    # no orchestrator here to announce the manifest's sha256: the relays mirror what the origin offers
    env = {
        **os.environ,
        "INTELLECT_RUN__LOG_LEVEL": "WARNING",
        "INTELLECT_SHARDCAST__PIN_MANIFESTS": "false",
        **settings,
    }
    origin = procs.start(
        [*servers, "origin", "--dir", str(weights), "--port", "0"], work / "origin.log", cwd=REPO, env=env
    )
    origin_url = wait_line(origin, "serving").split()[-1]
    relays, relay_procs = [], []
    for i in range(2 if chain is None else chain):
        upstream = origin_url if chain is None or not relays else relays[-1]
        relay = procs.start(
            [*servers, "relay", "--upstream", upstream, "--dir", str(work / f"relay{i}"), "--port", "0"],
            work / f"relay{i}.log",
            cwd=REPO,
            env=env,
        )
        relays.append(wait_line(relay, "serving").split()[-1])
        relay_procs.append(relay)
    if chain is not None:
        relays = relays[-1:]
    fetchers = [
        procs.start(
            [
                *cli,
                "fetch",
                "--servers",
                ",".join(relays),
                "--out",
                str(work / f"client{i}"),
                "--wait",
                "300",
                "--json",
            ],
            work / f"client{i}.log",
            cwd=REPO,
            env=env,
        )
        for i in range(clients)
    ]
    time.sleep(2.0)  # every client is up and long-polling
    servers_procs = [origin, *relay_procs]
    cpu_at_start = [cpu_seconds(p.pid) for p in [*servers_procs, *fetchers]]
    t0 = time.time()
    os.rename(staging, weights / "v000001")
    (weights / "v000001" / "STABLE").write_text("1\n")
    done, clients_cpu = exit_times(fetchers)
    cpu_at_end = [cpu_seconds(p.pid) for p in servers_procs] + clients_cpu  # the servers still run: read them now
    spent = [end - start for start, end in zip(cpu_at_start, cpu_at_end)]
    results = []
    for i, proc in enumerate(fetchers):
        out = proc.stdout.read()
        if proc.returncode != 0:
            raise RuntimeError(f"client {i} failed: {(work / f'client{i}.log').read_text()[-2000:]}")
        results.append(json.loads(out))
    landed = work / "client0" / "v000001" / "model-00001-of-00001.safetensors"
    assert landed.stat().st_size == payload.stat().st_size and sha256(landed) == sha256(payload)
    procs.kill_all()
    n_servers = len(servers_procs)
    return {
        "end_to_end_s": round(max(done) - t0, 3),
        "per_client_mb_s": [r["mb_per_s"] for r in results],
        "per_client_transfer_s": [r["seconds"] for r in results],
        "cpu_s": {
            "origin": round(spent[0], 2),
            "relays": [round(s, 2) for s in spent[1:n_servers]],
            "clients": [round(s, 2) for s in spent[n_servers:]],
            "total": round(sum(spent), 2),
        },
        "cpu_bound_s": round(sum(spent) / os.cpu_count(), 3),
    }


# ---- the reference ------------------------------------------------------------------------------------


def _reference_env(ref_dir: Path, work: Path, name: str) -> dict:
    """Each process gets its own copy of the package: the reference keeps temporary files next to its own
    source (`temp_distribution.txt`), which processes sharing one installation would overwrite."""
    copy = work / f"pkg-{name}"
    shutil.copytree(ref_dir / "shardcast", copy / "shardcast")
    return {**os.environ, "PYTHONPATH": str(copy), "SHARDCAST_LOG_LEVEL": "WARNING"}


def run_reference(payload: Path, clients: int, work: Path, procs: Procs, ref_dir: Path) -> dict:
    dirs = [work / "ref-origin", work / "ref-relay0", work / "ref-relay1"]
    for d in dirs:
        d.mkdir()
        (d / "data1.bin").write_bytes(b"x" * 1024)  # the reference's clients fetch this from every server at start
    port = free_port()
    origin = procs.start(
        [PY, "-c", _REF_ORIGIN, str(dirs[0]), str(port), str(payload)],
        work / "ref-origin.log",
        env=_reference_env(ref_dir, work, "origin"),
        stdin=subprocess.PIPE,
    )
    wait_line(origin, "ready")
    relays = []
    for i in range(2):
        rport = free_port()
        relay = procs.start(
            [PY, "-c", _REF_MIDDLE, f"http://127.0.0.1:{port}", str(dirs[i + 1]), str(rport)],
            work / f"ref-relay{i}.log",
            env=_reference_env(ref_dir, work, f"relay{i}"),
            stdin=subprocess.PIPE,
        )
        wait_line(relay, "ready")
        relays.append(f"http://127.0.0.1:{rport}")
    fetchers = []
    for i in range(clients):
        proc = procs.start(
            [
                PY,
                "-c",
                _REF_CLIENT,
                ",".join(relays),
                str(work / f"ref-client{i}"),
                str(work / f"ref-client{i}" / "out.bin"),
            ],
            work / f"ref-client{i}.log",
            env=_reference_env(ref_dir, work, f"client{i}"),
        )
        wait_line(proc, "ready")
        fetchers.append(proc)
    time.sleep(1.0)
    t0 = time.time()
    origin.stdin.write("go\n")
    origin.stdin.flush()
    broadcast = json.loads(wait_line(origin, "broadcast_s"))["broadcast_s"]
    done, _ = exit_times(fetchers)
    results = []
    for i, proc in enumerate(fetchers):
        out = json.loads(proc.stdout.read().strip().splitlines()[-1])
        if not out["ok"]:
            raise RuntimeError(f"reference client {i} failed: {(work / f'ref-client{i}.log').read_text()[-2000:]}")
        results.append(out)
    landed = work / "ref-client0" / "out.bin"
    assert landed.stat().st_size == payload.stat().st_size and sha256(landed) == sha256(payload)
    procs.kill_all()
    size = payload.stat().st_size
    return {
        "end_to_end_s": round(max(done) - t0, 3),
        "broadcast_s": round(broadcast, 3),
        "per_client_mb_s": [round(size / r["seconds"] / 1e6, 1) for r in results],
        "per_client_transfer_s": [round(r["seconds"], 3) for r in results],
        "download_attempts": [r["attempts"] for r in results],
    }


# Our variants: (settings, manifest with part hashes). The defaults: pipelined, fsync before STABLE at every
# hop; store-and-forward (a manifest without part hashes); pipelined without fsync, as the reference runs.
VARIANTS = {
    "ours": ({}, True),
    "ours_store_and_forward": ({}, False),
    "ours_no_fsync": ({"INTELLECT_SHARDCAST__FSYNC": "false"}, True),
}
CHAIN_VARIANTS = ("ours", "ours_store_and_forward")


def summarize(entry: dict, raw: float) -> None:
    """Best and median end-to-end time of each contestant, its slowest client as a fraction of raw; where its runs
    measured CPU (ours), the median `cpu_bound_s` and the median wall time over it."""
    for name in [*VARIANTS, "reference"]:
        runs = entry.get(name)
        if isinstance(runs, list) and runs:
            times = [run["end_to_end_s"] for run in runs]
            entry[f"{name}_best_s"], entry[f"{name}_median_s"] = min(times), statistics.median(times)
            entry[f"{name}_slowest_client_fraction_of_raw"] = round(
                statistics.median(min(run["per_client_mb_s"]) for run in runs) / raw, 3
            )
            if all("cpu_bound_s" in run for run in runs):
                bound = statistics.median(run["cpu_bound_s"] for run in runs)
                entry[f"{name}_median_cpu_s"] = statistics.median(run["cpu_s"]["total"] for run in runs)
                entry[f"{name}_median_cpu_bound_s"] = bound
                entry[f"{name}_wall_over_cpu_bound"] = round(entry[f"{name}_median_s"] / bound, 2) if bound else None
    if "reference_best_s" in entry:  # the reference ran (it is a note instead when it could not be installed)
        for name in VARIANTS:
            if f"{name}_best_s" in entry:
                entry[f"{name}_speedup_best_vs_best"] = round(entry["reference_best_s"] / entry[f"{name}_best_s"], 2)


def compare_modes(report: dict) -> None:
    """Pipelined against store-and-forward per topology, and each chain depth against depth 1, per mode."""
    modes = {"pipelined": "ours", "store_and_forward": "ours_store_and_forward"}
    side = {}
    for topology, entry in report["topologies"].items():
        if all(f"{v}_median_s" in entry for v in modes.values()):
            row = {f"{m}_{k}_s": entry[f"{v}_{k}_s"] for m, v in modes.items() for k in ("best", "median")}
            row["speedup_median"] = round(entry["ours_store_and_forward_median_s"] / entry["ours_median_s"], 2)
            for m, v in modes.items():
                if f"{v}_median_cpu_bound_s" in entry:
                    row[f"{m}_median_cpu_bound_s"] = entry[f"{v}_median_cpu_bound_s"]
                    row[f"{m}_wall_over_cpu_bound"] = entry[f"{v}_wall_over_cpu_bound"]
            side[topology] = row
    report["pipelined_vs_store_and_forward"] = side
    chains = {int(t.split()[2].rstrip(":")): e for t, e in report["topologies"].items() if t.startswith("chain depth ")}
    if 1 in chains:
        report["chain_depth_over_depth_1"] = {
            mode: {
                f"depth_{d}": round(chains[d][f"{v}_median_s"] / chains[1][f"{v}_median_s"], 3)
                for d in sorted(chains)
                if d != 1 and f"{v}_median_s" in chains[d]
            }
            for mode, v in modes.items()
            if f"{v}_median_s" in chains[1]
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--clients", default="1,4", help="client counts, comma-separated ('' for none)")
    parser.add_argument("--chains", default="1,2,3", help="relay chain depths, comma-separated ('' for none)")
    parser.add_argument(
        "--pace-mb-s",
        type=float,
        default=0.0,
        help="chains only: every server sends each response at most this fast (MB/s), as over separate links",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        default=Path("/tmp/shardcast_ref"),
        help="directory where PyPI shardcast 0.3.2 is installed (--target); absent: skipped",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--raw-serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_serve:
        return raw_serve(int(args.raw_serve[0]), args.raw_serve[1])
    counts = [int(c) for c in args.clients.split(",") if c.strip()]
    depths = [int(d) for d in args.chains.split(",") if d.strip()]
    has_reference = (args.reference / "shardcast").is_dir() and shutil.which("wget") is not None
    root = Path(tempfile.mkdtemp(prefix="shardcast-bench-", dir=args.workdir))
    procs = Procs()
    report: dict = {
        "mib": args.mib,
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "part_size": PART_SIZE,
        "chain_pace_mb_s_per_response": args.pace_mb_s or None,
        "raw_loopback_mb_s": [],
        "topologies": {},
    }
    try:
        payload = root / "payload.bin"
        with open(payload, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MIB))
        os.sync()
        for r in range(args.repeat):  # interleaved, so that a noisy moment hits every contestant
            report["raw_loopback_mb_s"].append(round(raw_loopback(payload, procs, root), 1))
            for n in counts:
                entry = report["topologies"].setdefault(
                    f"origin->2 relays->{n} clients", {name: [] for name in [*VARIANTS, "reference"]}
                )
                for name, (settings, parts) in VARIANTS.items():
                    work = root / f"{name}-{n}-{r}"
                    work.mkdir()
                    entry[name].append(run_ours(payload, n, work, procs, settings, parts))
                    shutil.rmtree(work)
                    os.sync()  # every contestant starts with nothing left for the disk to write
                if has_reference:
                    work = root / f"ref-{n}-{r}"
                    work.mkdir()
                    try:
                        entry["reference"].append(run_reference(payload, n, work, procs, args.reference))
                    except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # ours are still reported
                        entry.setdefault("reference_errors", []).append(str(e)[-500:])
                    shutil.rmtree(work)
                    os.sync()
            for depth in depths:
                entry = report["topologies"].setdefault(
                    f"chain depth {depth}: origin->{depth} relay(s) in a chain->1 client",
                    {name: [] for name in CHAIN_VARIANTS},
                )
                for name in CHAIN_VARIANTS:
                    settings, parts = VARIANTS[name]
                    work = root / f"{name}-chain{depth}-{r}"
                    work.mkdir()
                    entry[name].append(
                        run_ours(payload, 1, work, procs, settings, parts, chain=depth, pace=args.pace_mb_s * 1e6)
                    )
                    shutil.rmtree(work)
                    os.sync()
        raw = statistics.median(report["raw_loopback_mb_s"])
        report["raw_loopback_median_mb_s"] = raw
        for topology, entry in report["topologies"].items():
            if not has_reference and not topology.startswith("chain"):
                entry["reference"] = (
                    f"not run: PyPI shardcast 0.3.2 not found under {args.reference} or no "
                    "wget; the issue quotes 4.4-7.4 s for 1 client"
                )
            summarize(entry, raw)
        compare_modes(report)
    finally:
        procs.kill_all()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
