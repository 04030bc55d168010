"""Run the JAX learner on a Cloud TPU VM or pod slice: create, install, start, logs, stop, delete.

    python scripts/tpu/pod.py create  --name rl --zone us-east5-a --accelerator v5p-128 [--spot]
    python scripts/tpu/pod.py install --name rl --zone us-east5-a --config configs/intellect2_qwq32b.toml \
        [--env-file secrets.env] [--nfs 10.0.0.2:/share --mount /mnt/intellect] [--model-repo Qwen/QwQ-32B]
    python scripts/tpu/pod.py start   --name rl --zone us-east5-a [-- --trainer.steps 10]
    python scripts/tpu/pod.py logs    --name rl --zone us-east5-a [--worker all]
    python scripts/tpu/pod.py stop    --name rl --zone us-east5-a
    python scripts/tpu/pod.py delete  --name rl --zone us-east5-a

Every action takes `--dry-run`, which prints the exact commands (one per line, shell-quoted) and runs nothing.
Commands that touch the hosts go through `gcloud compute tpus tpu-vm ssh/scp --worker=all`, so every host of
the slice gets the same files and runs the same command; the learner is one process per host.

On each host everything lives in `~/intellect/` (REMOTE_DIR): `.venv/` (Python 3.11 made by uv, this package
with the `trainer` extra and `jax[tpu]`), `pkg/` (the wheel and `host_launch.py`), `config.toml`,
`secrets.env` (optional, mode 0600, e.g. INTELLECT_ORCHESTRATOR__ADMIN_TOKEN=...), `logs/train.log` and
`logs/train.pid`. `start` runs `host_launch.py`, which reads the host's index and the slice's hosts from the
TPU metadata server and sets INTELLECT_TRAINER__COORDINATOR_ADDRESS / NUM_PROCESSES / PROCESS_ID before it
execs `intellect train config.toml`.

Multi-host checkpoints and the base model must be on storage every host sees at the same path: `--nfs`
mounts an NFS export (e.g. Filestore) at `--mount` on every host; point `run.dir` and `model.path` there.
"""

from __future__ import annotations

import argparse
import ast
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST_LAUNCH = Path(__file__).with_name("host_launch.py")
REMOTE_DIR = "intellect"  # relative to the login user's home directory on every host
JAX_TPU = "jax[tpu]==0.10.2"  # the jax of setup.py's trainer extra, with libtpu


def package_wheel_name() -> str:
    """The wheel `pip wheel .` builds, from setup.py's name and version (read, not executed)."""
    fields = {}
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            fields = {
                k.arg: k.value.value
                for k in node.keywords
                if k.arg in ("name", "version") and isinstance(k.value, ast.Constant)
            }
    if set(fields) != {"name", "version"}:
        raise SystemExit(f"pod.py: cannot read name and version from {ROOT / 'setup.py'}")
    return f"{fields['name'].replace('-', '_')}-{fields['version']}-py3-none-any.whl"


class Pod:
    """The gcloud commands for one TPU VM (or slice) named `name` in `zone`."""

    def __init__(self, name: str, zone: str, project: str | None):
        self.name, self.zone, self.project = name, zone, project

    def _where(self) -> list[str]:
        return ["--zone", self.zone] + (["--project", self.project] if self.project else [])

    def gcloud(self, verb: str, *args: str) -> list[str]:
        return ["gcloud", "compute", "tpus", "tpu-vm", verb, self.name, *self._where(), *args]

    def ssh(self, command: str, worker: str = "all") -> list[str]:
        return self.gcloud("ssh", f"--worker={worker}", f"--command={command}")

    def scp(self, sources: Sequence[str | Path], dest: str) -> list[str]:
        return [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "scp",
            *map(str, sources),
            f"{self.name}:{dest}",
            *self._where(),
            "--worker=all",
        ]


def create(pod: Pod, args: argparse.Namespace) -> list[list[str]]:
    extra = ["--spot"] if args.spot else []
    return [pod.gcloud("create", f"--accelerator-type={args.accelerator}", f"--version={args.runtime}", *extra)]


def install(pod: Pod, args: argparse.Namespace) -> list[list[str]]:
    wheel_dir = Path(args.build_dir)
    wheel = wheel_dir / package_wheel_name()
    d = REMOTE_DIR
    steps = [
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheel_dir), str(ROOT)],
        pod.ssh(f"mkdir -p {d}/pkg {d}/logs"),
    ]
    if args.nfs:
        mount = shlex.quote(args.mount)
        steps.append(
            pod.ssh(
                "set -e; sudo apt-get update -q && sudo apt-get install -y -q nfs-common && "
                f"sudo mkdir -p {mount} && (mountpoint -q {mount} || sudo mount -t nfs -o rw,hard "
                f'{shlex.quote(args.nfs)} {mount}) && sudo chown "$(id -u):$(id -g)" {mount}'
            )
        )
    steps.append(pod.scp([wheel, HOST_LAUNCH], f"{d}/pkg/"))
    steps.append(pod.scp([args.config], f"{d}/config.toml"))
    if args.env_file:
        steps.append(pod.scp([args.env_file], f"{d}/secrets.env"))
        steps.append(pod.ssh(f"chmod 600 {d}/secrets.env"))
    requirement = shlex.quote(f"pkg/{wheel.name}[trainer]")
    steps.append(
        pod.ssh(
            f"set -e; cd {d} && python3 -m pip install --user -q uv && ~/.local/bin/uv venv --allow-existing "
            f"--python 3.11 .venv && ~/.local/bin/uv pip install --python .venv/bin/python {requirement} "
            f"{shlex.quote(JAX_TPU)} && .venv/bin/intellect config show config.toml > /dev/null && "
            'echo "$(hostname): installed"'
        )
    )
    if args.model_repo:
        target = shlex.quote(args.model_dir or f"{args.mount}/models/{args.model_repo.split('/')[-1]}")
        steps.append(
            pod.ssh(
                f"set -e; cd {d} && ~/.local/bin/uv pip install --python .venv/bin/python -q huggingface_hub && "
                f".venv/bin/hf download {shlex.quote(args.model_repo)} --local-dir {target}",
                worker="0",
            )
        )
    return steps


def start(pod: Pod, args: argparse.Namespace) -> list[list[str]]:
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    train = shlex.join([".venv/bin/intellect", "train", "config.toml", *overrides])
    d = REMOTE_DIR
    return [
        pod.ssh(
            f'set -e; cd {d} && if [ -f logs/train.pid ] && kill -0 "$(cat logs/train.pid)" 2>/dev/null; then '
            'echo "$(hostname): a learner is already running (logs/train.pid)" >&2; exit 1; fi; '
            "set -a; if [ -f secrets.env ]; then . ./secrets.env; fi; set +a; "
            f"setsid nohup .venv/bin/python pkg/host_launch.py --port {args.port} -- {train} "
            "> logs/train.log 2>&1 < /dev/null & echo $! > logs/train.pid; "
            'echo "$(hostname): learner started, pid $(cat logs/train.pid)"'
        )
    ]


def logs(pod: Pod, args: argparse.Namespace) -> list[list[str]]:
    tail = ["tail", "-n", str(args.lines), *(["-F"] if args.follow else []), f"{REMOTE_DIR}/logs/train.log"]
    return [pod.ssh(shlex.join(tail), worker=args.worker)]


def stop(pod: Pod, args: argparse.Namespace) -> list[list[str]]:
    d = REMOTE_DIR
    return [
        pod.ssh(
            f"cd {d} && if [ -f logs/train.pid ]; then pid=$(cat logs/train.pid); "
            f"kill -TERM -- -$pid 2>/dev/null || true; for _ in $(seq {args.grace_s}); do "
            "kill -0 $pid 2>/dev/null || break; sleep 1; done; kill -KILL -- -$pid 2>/dev/null || true; "
            'rm -f logs/train.pid; echo "$(hostname): learner stopped"; '
            'else echo "$(hostname): no learner running"; fi'
        )
    ]


def delete(pod: Pod, args: argparse.Namespace) -> list[list[str]]:
    return [pod.gcloud("delete", "--quiet")]


ACTIONS = {"create": create, "install": install, "start": start, "logs": logs, "stop": stop, "delete": delete}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    subs = {}
    for name, help_text in (
        ("create", "create the TPU VM or pod slice"),
        ("install", "install the package, config and secrets on every host"),
        ("start", "start `intellect train` on every host"),
        ("logs", "print (and follow) the learner's log"),
        ("stop", "stop the learner on every host"),
        ("delete", "delete the TPU VM or pod slice"),
    ):
        sub = subs[name] = actions.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--name", required=True, help="TPU VM name")
        sub.add_argument("--zone", required=True, help="zone, e.g. us-east5-a (v5p)")
        sub.add_argument("--project", help="Google Cloud project (default: gcloud's configured project)")
        sub.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    subs["create"].add_argument("--accelerator", default="v5p-128", help="accelerator type (v5p-128: 64 chips)")
    subs["create"].add_argument("--runtime", default="v2-alpha-tpuv5", help="TPU VM software version")
    subs["create"].add_argument("--spot", action="store_true", help="a Spot (preemptible) slice")
    inst = subs["install"]
    inst.add_argument("--config", required=True, type=Path, help="the recipe, copied to every host")
    inst.add_argument("--env-file", type=Path, help="KEY=VALUE lines (secrets) copied to every host, mode 0600")
    inst.add_argument("--nfs", help="NFS export SERVER:/PATH to mount on every host (shared run.dir)")
    inst.add_argument("--mount", default="/mnt/intellect", help="where --nfs is mounted")
    inst.add_argument("--model-repo", help="Hugging Face repo downloaded once, by host 0, onto the shared mount")
    inst.add_argument("--model-dir", help="download target of --model-repo (default: MOUNT/models/NAME)")
    inst.add_argument(
        "--build-dir",
        default=str(Path(tempfile.gettempdir()) / "intellect-wheel"),
        help="local directory the wheel is built in",
    )
    subs["start"].add_argument("--port", type=int, default=8482, help="jax.distributed coordinator port")
    subs["start"].add_argument(
        "overrides", nargs=argparse.REMAINDER, help="-- then --section.key VALUE overrides for intellect train"
    )
    subs["logs"].add_argument("--worker", default="0", help="host index, or 'all'")
    subs["logs"].add_argument("--lines", type=int, default=200, help="lines of the log to show")
    subs["logs"].add_argument("--follow", action="store_true", help="keep following the log")
    subs["stop"].add_argument("--grace-s", type=int, default=60, help="seconds between SIGTERM and SIGKILL")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "install":
        for path in filter(None, (args.config, args.env_file)):
            if not path.is_file():
                raise SystemExit(f"pod.py install: {path} is not a file")
    commands = ACTIONS[args.action](Pod(args.name, args.zone, args.project), args)
    if args.dry_run:
        for command in commands:
            print(shlex.join(command))
        return 0
    if shutil.which("gcloud") is None:
        raise SystemExit("pod.py: gcloud is not on PATH; install the Google Cloud CLI (or use --dry-run)")
    for command in commands:
        print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
        status = subprocess.run(command).returncode
        if status != 0:
            print(f"pod.py {args.action}: command failed with status {status}", file=sys.stderr)
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
