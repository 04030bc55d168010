"""Start one learner process on one host of a TPU VM slice, with its place in the process group filled in.

    python host_launch.py [--port 8482] [--metadata-url URL] [--dry-run] -- intellect train config.toml ...

`pod.py start` runs this on every host of the slice at once (`--worker=all`). It reads the host's place from
the TPU VM metadata server, the same attributes `jax.distributed` reads on Cloud TPU:

- `agent-worker-number`: this host's index, which becomes the JAX process id;
- `worker-network-endpoints`: every host of the slice, comma-separated, either as plain addresses or as
  `name:id:address` triples; their count is the number of processes, and the first is the coordinator.

It then runs the command with `INTELLECT_TRAINER__COORDINATOR_ADDRESS`, `INTELLECT_TRAINER__NUM_PROCESSES`
and `INTELLECT_TRAINER__PROCESS_ID` set, so that `intellect train` calls `jax.distributed.initialize` with
them (the config leaves all three unset by default, which means one process). The process replaces this one
(exec), so its pid, signals and exit status are the learner's. `--dry-run` prints the environment and the
command instead. Standard library only: it runs before anything else is known to work on the host.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import urllib.error
import urllib.request

DEFAULT_PORT = 8482  # the port jax.distributed itself uses for the coordinator on Cloud TPU
ENV_KEYS = (
    "INTELLECT_TRAINER__COORDINATOR_ADDRESS",
    "INTELLECT_TRAINER__NUM_PROCESSES",
    "INTELLECT_TRAINER__PROCESS_ID",
)


def default_metadata_url() -> str:
    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    return f"http://{host}/computeMetadata/v1/instance/attributes"


def read_attribute(base_url: str, name: str, timeout_s: float = 10.0) -> str:
    """One metadata attribute as text; an error names the attribute and the URL."""
    url = f"{base_url.rstrip('/')}/{name}"
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.read().decode().strip()
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(
            f"host_launch: cannot read TPU metadata attribute {name!r} from {url}: {exc}. "
            "Run this on a TPU VM host (or pass --metadata-url)."
        ) from exc


def parse_endpoints(text: str) -> list[str]:
    """Host addresses from `worker-network-endpoints` (plain addresses or name:id:address triples)."""
    hosts = []
    for entry in (e.strip() for e in text.split(",")):
        parts = entry.split(":")
        if not entry or len(parts) not in (1, 3) or not parts[-1]:
            raise SystemExit(
                f"host_launch: worker-network-endpoints entry {entry!r} is neither an address nor "
                f"name:id:address (whole value: {text!r})"
            )
        hosts.append(parts[-1])
    return hosts


def process_env(worker_number: str, endpoints: str, port: int) -> dict[str, str]:
    """The three INTELLECT_TRAINER__* variables of this host, checked against each other."""
    hosts = parse_endpoints(endpoints)
    try:
        pid = int(worker_number)
    except ValueError:
        raise SystemExit(f"host_launch: agent-worker-number {worker_number!r} is not an integer") from None
    if not 0 <= pid < len(hosts):
        raise SystemExit(
            f"host_launch: agent-worker-number {pid} is outside the {len(hosts)} hosts of "
            f"worker-network-endpoints ({', '.join(hosts)})"
        )
    coordinator = f"[{hosts[0]}]" if ":" in hosts[0] else hosts[0]
    return dict(zip(ENV_KEYS, (f"{coordinator}:{port}", str(len(hosts)), str(pid))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="coordinator port on host 0")
    parser.add_argument(
        "--metadata-url", default=None, help="base URL of the instance attributes (default: the GCE metadata server)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the environment and command, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: host_launch.py [options] -- intellect train CONFIG")
    base = args.metadata_url or default_metadata_url()
    env = process_env(
        read_attribute(base, "agent-worker-number"), read_attribute(base, "worker-network-endpoints"), args.port
    )
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command))
        return 0
    print(
        f"host_launch: process {env[ENV_KEYS[2]]} of {env[ENV_KEYS[1]]}, coordinator {env[ENV_KEYS[0]]}",
        file=sys.stderr,
        flush=True,
    )
    try:
        os.execvpe(command[0], command, {**os.environ, **env})
    except OSError as exc:
        raise SystemExit(f"host_launch: cannot run {command[0]!r}: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
