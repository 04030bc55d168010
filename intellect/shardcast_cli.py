"""`intellect shardcast {origin,relay,fetch}`: the weight broadcast from the command line.

    intellect shardcast origin [CONFIG] --dir runs/x/weights --port 8100
    intellect shardcast relay  [CONFIG] --upstream http://127.0.0.1:8100 --dir /srv/relay --port 8101
    intellect shardcast fetch  [CONFIG] --servers http://127.0.0.1:8101,http://127.0.0.1:8102 --out weights/

Defaults come from the config's `[run]` and `[shardcast]` sections (the origin serves `run.dir/weights` on
`shardcast.host:port`; a relay mirrors `shardcast.servers`, else the origin; a client asks
`shardcast.relays`, else the origin); tunables (timeouts, parallelism, retention) are config keys, e.g.
`--shardcast.timeout_s 10`. Servers print `shardcast ROLE: serving DIR on URL` once they listen and stop
cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ROLE", required=True)

    def role(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("config", nargs="?", type=Path, help="TOML recipe (default: the defaults only)")
        return sub

    origin = role("origin", "serve the learner's weights directory")
    origin.add_argument(
        "--dir", type=Path, help="weights directory holding v000123/ versions (default: run.dir/weights)"
    )
    origin.add_argument("--host", help="address to listen on (default: shardcast.host)")
    origin.add_argument("--port", type=int, help="port to listen on, 0 for any free one (default: shardcast.port)")

    relay = role("relay", "mirror upstream servers and serve what has been verified")
    relay.add_argument(
        "--upstream", help="URL[,URL...] of origins or relays (default: shardcast.servers, else the origin)"
    )
    relay.add_argument("--dir", type=Path, required=True, help="directory the relay keeps its versions in")
    relay.add_argument("--host", help="address to listen on (default: shardcast.host)")
    relay.add_argument("--port", type=int, required=True, help="port to listen on, 0 for any free one")
    relay.add_argument("--keep", type=int, help="newest versions to keep (default: shardcast.keep_versions)")
    relay.add_argument(
        "--orchestrator",
        help="orchestrator whose announced manifest sha256s the relay pins "
        "(default: worker.orchestrator_url; none when shardcast.pin_manifests is false)",
    )

    fetch = role("fetch", "download a version, verified, into DIR/v000123/")
    fetch.add_argument("--servers", help="URL[,URL...] to fetch from (default: shardcast.relays, else the origin)")
    fetch.add_argument("--version", default="latest", help="'latest' (default) or a version number")
    fetch.add_argument("--after", type=int, help="wait for a version newer than this one, then fetch it")
    fetch.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="seconds to wait for the version to be offered (default 0: fail at once)",
    )
    fetch.add_argument("--out", type=Path, required=True, help="directory the version lands in, as v000123/")
    fetch.add_argument("--manifest-sha256", help="refuse a manifest whose sha256 differs (from a trusted source)")
    fetch.add_argument("--json", action="store_true", help="print the outcome as one JSON object")


def run(args: argparse.Namespace) -> int:
    from bridge.shardcast.errors import ShardcastError
    from intellect.cli import config_from_args

    config = config_from_args(args)
    logging.basicConfig(
        level=config.run.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return {"origin": _origin, "relay": _relay, "fetch": _fetch}[args.action](args, config)
    except (ShardcastError, OSError) as e:
        print(f"intellect shardcast {args.action}: {e}", file=sys.stderr)
        return 1


def origin_url(sc) -> str:
    host = f"[{sc.host}]" if ":" in sc.host else sc.host
    return f"http://{host}:{sc.port}"


def _server_limits(sc) -> dict:
    from bridge.shardcast.server import ServerLimits

    return {
        "timeout": sc.timeout_s,
        "limits": ServerLimits(
            max_connections=sc.max_connections,
            max_per_ip=sc.max_connections_per_ip,
            header_timeout=sc.header_timeout_s,
            keepalive=sc.keepalive_s,
            max_header_bytes=sc.max_header_kib << 10,
        ),
    }


def _serve(role: str, directory: Path, make) -> int:
    import asyncio
    import signal

    def ready(url: str) -> None:
        print(f"shardcast {role}: serving {directory} on {url}", flush=True)

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await make(ready)
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    return 0


def _origin(args, config) -> int:
    from bridge.shardcast.origin import serve_origin

    sc = config.shardcast
    directory = args.dir or config.run.weights_dir
    directory.mkdir(parents=True, exist_ok=True)  # the learner may not have exported anything yet
    return _serve(
        "origin",
        directory,
        lambda ready: serve_origin(
            directory,
            host=args.host or sc.host,
            port=sc.port if args.port is None else args.port,
            ready=ready,
            **_server_limits(sc),
        ),
    )


def _relay(args, config) -> int:
    from bridge.shardcast.names import parse_server_list
    from bridge.shardcast.relay import serve_relay

    sc = config.shardcast
    upstreams = parse_server_list(args.upstream or sc.servers or [origin_url(sc)])
    keep = sc.keep_versions if args.keep is None else args.keep
    pin_url = args.orchestrator or (config.worker.orchestrator_url if sc.pin_manifests else None)
    if keep < 1:
        print(f"intellect shardcast relay: --keep {keep}: keep at least 1 version", file=sys.stderr)
        return 1
    return _serve(
        "relay",
        args.dir,
        lambda ready: serve_relay(
            args.dir,
            [str(u) for u in upstreams],
            host=args.host or sc.host,
            port=args.port,
            keep=keep,
            ready=ready,
            grace_s=sc.retire_grace_s,
            patience=sc.patience_s,
            parallel=sc.parallel,
            part_bytes=sc.part_mib << 20,
            max_version_bytes=int(sc.max_version_gib * 2**30),
            fsync=sc.fsync,
            pin_url=pin_url,
            keep_anchor=sc.keep_anchor,
            **_server_limits(sc),
        ),
    )


def _fetch(args, config) -> int:
    from bridge.shardcast.client import ShardcastClient
    from bridge.shardcast.names import parse_version

    sc = config.shardcast
    client = ShardcastClient(
        args.servers or sc.relays or [origin_url(sc)],
        timeout=sc.timeout_s,
        patience=sc.patience_s,
        parallel=sc.parallel,
        part_bytes=sc.part_mib << 20,
        max_version_bytes=int(sc.max_version_gib * 2**30),
        fsync=sc.fsync,
        direct_io=sc.direct_io,
        buffer_bytes=sc.buffer_mib << 20,
    )
    version = args.version if args.version == "latest" else parse_version(args.version, "--version")
    if args.after is not None:
        if version != "latest":
            print("intellect shardcast fetch: give --after or a --version number, not both", file=sys.stderr)
            return 2
        version = client.wait_for_version(args.after, timeout=args.wait)
    with _progress(enabled=sys.stderr.isatty()) as on_progress:
        result = client.fetch(
            version, args.out, wait=args.wait, manifest_sha256=args.manifest_sha256, on_progress=on_progress
        )
    if args.json:
        print(json.dumps(result.to_json()))
    elif result.already_present:
        print(f"{result.path}: already here")
    else:
        print(
            f"{result.path}: {result.received_bytes / 2**20:.1f} MiB received in {result.seconds:.2f} s "
            f"({result.mb_per_s:.0f} MB/s), {result.resumed_bytes / 2**20:.1f} MiB resumed"
        )
    return 0


class _progress:
    """A rich progress bar on stderr when it is a terminal; the context value is the callback (or None)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._bar = None
        self._task = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self._bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._bar.start()
        self._task = self._bar.add_task("fetching", total=None)
        return lambda done, total: self._bar.update(self._task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
