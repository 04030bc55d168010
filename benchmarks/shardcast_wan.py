"""SHARDCAST over shaped WAN links: full versions against deltas, origin -> 2 relays -> clients (run as root).

Every node (origin, relays, clients) runs as its own process in its own network namespace, made here, whose
only interface is a TUN device. This script is the network between them: a packet-level link emulator (a
forked process) that reads every IP packet from the TUN devices and delivers it after each node's access link:
its uplink, then the destination's downlink, each with a rate (serialised packet by packet, a FIFO of at most
`QUEUE_S` seconds, tail drop beyond), a one-way delay, and random loss on the path. It does not need `tc
netem` or `iptables` (kernels without them run it too); packets are 1500-byte IP packets, as on the internet.
A profile's RTT is 4 one-way delays (uplink and downlink, both ways).

Each run: every node holds version 0 (the relays serve it); then versions 1..`--versions` (a Qwen2.5-shaped
bf16 model stepped by AdamW at lr 3e-7, see `shardcast_delta_bytes.py`) are published at the origin one after
another, each with part hashes (so the relays pipeline it: they serve each part once checked and answer 503
for parts still arriving) and with deltas against the version before it, or without. For each version every
client runs `intellect shardcast fetch --version N --wait` with `--parallel` download threads; the time is from
its STABLE to the last client's exit. Beside the times, the report counts failed fetches, landings whose
files do not have the origin's sha256, clients that distrusted a relay, and the lines where relays and
clients logged a distrust or a sha256 failure (an honest setup must show none). Prints JSON.

    sudo .venv/bin/python benchmarks/shardcast_wan.py [--clients 4] [--profiles 100mbit_40ms,20mbit_loss0.1]
        [--versions 20] [--parallel 4] [--kinds full,deltas]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import heapq
import json
import multiprocessing
import os
import platform
import random
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from shardcast_delta_bytes import synthetic_versions  # noqa: E402

from bridge.shardcast import delta  # noqa: E402
from bridge.shardcast.manifest import PART_SIZE, hash_file_parts  # noqa: E402

PY = sys.executable
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
QUEUE_S = 0.05  # the most a link's FIFO holds, in seconds of its rate (~1 BDP at 40 ms RTT)
PROFILES = {
    "100mbit_40ms": {"rate_bps": 100e6, "one_way_s": 0.010, "loss": 0.0},
    "20mbit_40ms_loss0.1": {"rate_bps": 20e6, "one_way_s": 0.010, "loss": 0.001},
}
SMALL_MODEL = {"hidden": 512, "intermediate": 1536, "layers": 4, "vocab": 32000, "heads": 8, "kv_heads": 2}
PREFIX = "scw"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def make_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


class Network:
    """Namespaces `scw-NAME`, each with a TUN `scwI` at 10.99.0.(I+1)/24 whose other end is this process."""

    def __init__(self, names: list[str]):
        self.names = names
        self.ip = {n: f"10.99.0.{i + 1}" for i, n in enumerate(names)}
        self.fds: dict[str, int] = {}
        for i, name in enumerate(names):
            ns = f"{PREFIX}-{name}"
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            sh("ip", "netns", "add", ns)
            self.fds[name] = make_tun(f"{PREFIX}{i}")
            sh("ip", "link", "set", f"{PREFIX}{i}", "netns", ns)
            sh("ip", "-n", ns, "link", "set", f"{PREFIX}{i}", "mtu", "1500")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip[name]}/24", "dev", f"{PREFIX}{i}")
            sh("ip", "-n", ns, "link", "set", f"{PREFIX}{i}", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def exec(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", f"{PREFIX}-{name}"]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", f"{PREFIX}-{name}"], capture_output=True)


def emulate(
    fds: dict[str, int], ips: dict[str, str], rate_bps: float, one_way_s: float, loss: float, stats_path: str
) -> None:
    """The network: every packet through its source's uplink and its destination's downlink (see the module
    docstring), until killed; counts written to `stats_path` every second."""
    rng = random.Random(0)
    by_ip = {bytes(map(int, ip.split("."))): fds[name] for name, ip in ips.items()}
    up_free = dict.fromkeys(fds.values(), 0.0)
    down_free = dict.fromkeys(fds.values(), 0.0)
    poller = select.epoll()
    for fd in fds.values():
        poller.register(fd, select.EPOLLIN)
    heap: list = []
    seq = 0
    stats = {"packets": 0, "bytes": 0, "lost": 0, "queue_drops": 0}
    last_dump = time.monotonic()
    while True:
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, fd, pkt = heapq.heappop(heap)
            try:
                os.write(fd, pkt)
            except OSError:
                pass
        timeout = min(max(heap[0][0] - now, 0.0), 0.2) if heap else 0.2
        for fd, _ in poller.poll(timeout):
            for _ in range(256):
                try:
                    pkt = os.read(fd, 65536)
                except (BlockingIOError, OSError):
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4:
                    continue
                dst = by_ip.get(pkt[16:20])
                if dst is None:
                    continue
                now = time.monotonic()
                bits = len(pkt) * 8
                start = max(now, up_free[fd])
                if start - now > QUEUE_S:
                    stats["queue_drops"] += 1
                    continue
                up_free[fd] = start + bits / rate_bps
                if loss and rng.random() < loss:
                    stats["lost"] += 1
                    continue
                arrive = up_free[fd] + one_way_s
                start = max(arrive, down_free[dst])
                if start - arrive > QUEUE_S:
                    stats["queue_drops"] += 1
                    continue
                down_free[dst] = start + bits / rate_bps
                seq += 1
                heapq.heappush(heap, (down_free[dst] + one_way_s, seq, dst, pkt))
                stats["packets"] += 1
                stats["bytes"] += len(pkt)
        if time.monotonic() - last_dump > 1.0:
            last_dump = time.monotonic()
            Path(stats_path).write_text(json.dumps(stats))


def copy_version(src: Path, dest_root: Path) -> None:
    dest = dest_root / src.name
    dest.mkdir(parents=True)
    for p in src.iterdir():
        if not p.name.endswith(".xzst"):
            shutil.copyfile(p, dest / p.name)


def stage(versions: list[Path], version: int, with_deltas: bool, staging: Path) -> None:
    """`version` as the learner would export it: its files with their part hashes (so relays pass each part on
    as soon as it is checked), with or without deltas against the version before it."""
    staging.mkdir(parents=True)
    src = versions[version]
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["part_size"] = PART_SIZE
    for entry in manifest["files"]:
        shutil.copyfile(src / entry["name"], staging / entry["name"])
        entry["sha256"], entry["parts"] = hash_file_parts(staging / entry["name"], PART_SIZE)
    if with_deltas:
        manifest["deltas"] = delta.write_deltas(staging, manifest["files"], [(version - 1, versions[version - 1])])
    (staging / "manifest.json").write_text(json.dumps(manifest))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def wait_line(proc: subprocess.Popen, needle: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if needle in line:
            return line.strip()
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"{proc.args[-8:]} did not print {needle!r}")


TRUST_EVENTS = ("distrusted", "fails its sha256", "sha256 mismatch")  # what a node logs when it distrusts one


def trust_events(log: Path) -> int:
    """Lines of a node's log where it distrusted a server or caught bytes failing a sha256 check."""
    return sum(any(e in line for e in TRUST_EVENTS) for line in log.read_text(errors="replace").splitlines())


def run_series(
    net: Network,
    versions: list[Path],
    clients: list[str],
    work: Path,
    with_deltas: bool,
    parallel: int,
    fetch_timeout: float,
) -> dict:
    """Versions 1..N published one after another through origin -> 2 pipelining relays -> clients; every client
    fetches each one (`parallel` download threads). A failed fetch, a wrong byte or a distrusted relay is
    counted, not fatal: the next version goes on."""
    cli = [PY, "-m", "intellect", "shardcast"]
    # no orchestrator here: relays mirror what the origin offers (pinning is tested elsewhere)
    env = {
        **os.environ,
        "INTELLECT_RUN__LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(REPO),
        "INTELLECT_SHARDCAST__PIN_MANIFESTS": "false",
        "INTELLECT_SHARDCAST__PARALLEL": str(parallel),
    }
    procs: list[subprocess.Popen] = []
    logs = []

    def start(node: str, argv: list[str], log_name: str | None = None) -> subprocess.Popen:
        log = open(work / f"{log_name or node}.log", "wb")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [*net.exec(node), *cli, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True
            )
        )
        return procs[-1]

    per_version: list[dict] = []
    try:
        origin_dir = work / "origin"
        copy_version(versions[0], origin_dir)
        origin = start("origin", ["origin", "--dir", str(origin_dir), "--host", net.ip["origin"], "--port", "8100"])
        wait_line(origin, "serving")
        relays = ("relay0", "relay1")
        relay_urls = []
        for r in relays:
            copy_version(versions[0], work / r)
            (work / r / "v000000" / ".synced").write_text("1\n")
            relay = start(
                r,
                [
                    "relay",
                    "--upstream",
                    f"http://{net.ip['origin']}:8100",
                    "--dir",
                    str(work / r),
                    "--host",
                    net.ip[r],
                    "--port",
                    "8101",
                    "--keep",
                    "3",
                ],
            )
            wait_line(relay, "serving")
            relay_urls.append(f"http://{net.ip[r]}:8101")
        for c in clients:
            copy_version(versions[0], work / c)
        for version in range(1, len(versions)):
            staging = work / "staging" / f"v{version:06d}"
            stage(versions, version, with_deltas, staging)
            fetchers = {}
            for c in clients:
                argv = ["fetch", "--servers", ",".join(relay_urls), "--version", str(version), "--wait", "900"]
                fetchers[c] = start(c, [*argv, "--out", str(work / c), "--json"], f"{c}-v{version}")
            time.sleep(3.0)  # every client is up and waiting
            t0 = time.monotonic()
            os.rename(staging, origin_dir / f"v{version:06d}")
            (origin_dir / f"v{version:06d}" / "STABLE").write_text(f"{version}\n")
            expected = json.loads((origin_dir / f"v{version:06d}" / "manifest.json").read_text())["files"]
            row: dict = {"version": version, "failed": {}, "wrong_bytes": [], "distrusted": [], "received": []}
            ends, fetch_s = [], []
            for c, proc in fetchers.items():
                try:
                    out, _ = proc.communicate(timeout=max(1.0, t0 + fetch_timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, _ = proc.communicate()
                ends.append(time.monotonic())
                log = work / f"{c}-v{version}.log"
                if proc.returncode != 0:
                    row["failed"][c] = log.read_text(errors="replace")[-600:]
                    continue
                result = json.loads(out.strip().splitlines()[-1])
                row["received"].append(result["received_bytes"])
                fetch_s.append(result["seconds"])
                row["distrusted"] += [f"{c}: {s}" for s, st in result["servers"].items() if st["distrusted"]]
                for entry in expected:
                    if sha256(work / c / f"v{version:06d}" / entry["name"]) != entry["sha256"]:
                        row["wrong_bytes"].append(f"{c}: {entry['name']}")
                old = work / c / f"v{version - 2:06d}"
                if version >= 2 and old.exists():
                    shutil.rmtree(old)  # a client keeps the base of the next delta, not every version
            row["stable_to_last_client_s"] = round(max(ends) - t0, 2)
            row["per_client_fetch_s"] = fetch_s  # each client's own download, after the wait
            per_version.append(row)
            print(json.dumps({"kind": "deltas" if with_deltas else "full", **row}), file=sys.stderr, flush=True)
        times = [row["stable_to_last_client_s"] for row in per_version]
        return {
            "versions": len(per_version),
            "stable_to_last_client_s": round(statistics.median(times), 2),  # median over the versions
            "per_version_s": times,
            "failed_fetches": sum(len(row["failed"]) for row in per_version),
            "wrong_landings": sum(len(row["wrong_bytes"]) for row in per_version),
            "clients_distrusting_a_relay": sum(len(row["distrusted"]) for row in per_version),
            "relay_trust_events": {r: trust_events(work / f"{r}.log") for r in relays},
            "client_trust_events": sum(
                trust_events(work / f"{c}-v{v}.log") for c in clients for v in range(1, len(versions))
            ),
            "failures": {f"v{row['version']}": row["failed"] for row in per_version if row["failed"]},
            "per_client_received_bytes": [row["received"] for row in per_version],
            "per_client_fetch_s": [row["per_client_fetch_s"] for row in per_version],
            "version_bytes": sum(e["size"] for e in expected),
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=10)
        for log in logs:
            log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--layers", type=int, default=SMALL_MODEL["layers"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--versions", type=int, default=1, help="consecutive versions published per run (1..N)")
    ap.add_argument("--parallel", type=int, default=4, help="download threads of every client and relay")
    ap.add_argument("--kinds", default="full,deltas", help="full, deltas, or both (comma-separated)")
    ap.add_argument("--fetch-timeout", type=float, default=1200.0, help="seconds a client may take per version")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if not kinds or any(k not in ("full", "deltas") for k in kinds):
        sys.exit(f"--kinds {args.kinds!r}: expected 'full', 'deltas' or 'full,deltas'")
    if args.versions < 1 or args.parallel < 1:
        sys.exit(f"--versions {args.versions} and --parallel {args.parallel} must be at least 1")
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark makes network namespaces and TUN devices")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still removes the namespaces
    root = Path(tempfile.mkdtemp(prefix="shardcast-wan-", dir=args.workdir))
    clients = [f"client{i}" for i in range(args.clients)]
    net = Network(["origin", "relay0", "relay1", *clients])
    report: dict = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "clients": args.clients,
        "versions": args.versions,
        "parallel": args.parallel,
        "model": {**SMALL_MODEL, "layers": args.layers, "lr": 3e-7},
        "queue_s": QUEUE_S,
        "profiles": {},
    }
    try:
        versions = synthetic_versions(root / "versions", args.versions, args.layers, 3e-7, 0, SMALL_MODEL)
        for name in args.profiles.split(","):
            profile = PROFILES[name]
            stats_path = root / f"net-{name}.json"
            ctx = multiprocessing.get_context("fork")
            emulator = ctx.Process(
                target=emulate,
                args=(net.fds, net.ip, profile["rate_bps"], profile["one_way_s"], profile["loss"], str(stats_path)),
                daemon=True,
            )
            emulator.start()
            entry = report["profiles"][name] = {
                **profile,
                "rtt_ms": round(4 * profile["one_way_s"] * 1000),
                **{k: [] for k in kinds},
            }
            try:
                for r in range(args.repeat):
                    for kind in kinds:
                        work = root / f"{name}-{kind}-{r}"
                        work.mkdir()
                        entry[kind].append(
                            run_series(
                                net, versions, clients, work, kind == "deltas", args.parallel, args.fetch_timeout
                            )
                        )
                        shutil.rmtree(work)
                        print(json.dumps({name: {kind: entry[kind][-1]}}), file=sys.stderr, flush=True)
            finally:
                emulator.kill()
                emulator.join()
            for kind in kinds:
                runs = entry[kind]
                entry[f"{kind}_summary"] = {
                    "best_median_s": min(run["stable_to_last_client_s"] for run in runs),  # over repeats
                    "failed_fetches": sum(run["failed_fetches"] for run in runs),
                    "wrong_landings": sum(run["wrong_landings"] for run in runs),
                    "clients_distrusting_a_relay": sum(run["clients_distrusting_a_relay"] for run in runs),
                    "relay_trust_events": sum(sum(run["relay_trust_events"].values()) for run in runs),
                    "client_trust_events": sum(run["client_trust_events"] for run in runs),
                }
            if len(kinds) == 2:
                best = {k: entry[f"{k}_summary"]["best_median_s"] for k in kinds}
                entry["speedup_deltas_vs_full"] = round(best["full"] / best["deltas"], 1)
            if stats_path.exists():
                entry["emulator_last_counts"] = json.loads(stats_path.read_text())
    finally:
        net.close()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
