"""`intellect run`: every role of a pool as processes on this machine, wired through one config.

    orchestrator  <- learner (intellect train)        -> weights/v000123 -> SHARDCAST origin -> relays
        ^   ^--------- workers (intellect worker) x N  <- fetch versions ----------------------'
        '------------- validators (intellect validator) x M

Each role is started the way a user starts it (`python -m intellect ROLE CONFIG --section.key value ...`),
with its output in `run.dir/logs/ROLE.log`. The launcher picks free ports on 127.0.0.1, gives each node its
own key under `run.dir/keys/`, lists the validators' keys as the only ones allowed to validate, and hands the
operator token to the roles that need it through the environment (never on a command line).

Phases: an optional supervised warm start (`run.sft_steps`, `intellect sft`, its export becomes the base
model), the calibration check (a bfloat16/float16 replay pool's validators refuse to start without a
calibration of the base model, `intellect calibrate`: the launcher says so before it starts anything, naming the
model to calibrate), held-out evaluation of the base policy (`intellect eval`; with `data.env` it plays episodes,
and "accuracy" is their success rate), the RL run (until the learner has made
`trainer.steps` steps; evaluations every `run.eval_interval` steps on the newest exported version), then a
final evaluation, the processes stopped, and the plots written (`intellect plot`).

Failures: a role that exits is named with the end of its log, and everything is stopped (exit 1), unless
`run.restart_failed` is set, which starts it again. Ctrl-C or SIGTERM stops every role (SIGTERM, then SIGKILL
after a grace period). Every child also gets SIGTERM from the kernel if the launcher itself dies (even by
SIGKILL: PR_SET_PDEATHSIG), so no role is left behind.

Resume (`--resume`): the learner continues from its newest checkpoint (its data cursor makes it skip exactly
the batches it already trained on), the orchestrator reopens its database (the ledger and every batch record
are there), workers and validators rejoin with the same keys; the warm start and the first evaluation are not
repeated.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from intellect.config import Config
from intellect.metrics import MetricsLog

PR_SET_PDEATHSIG = 1
GRACE_S = 20.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the project's one definition: tests and benchmarks use it)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def toml_list(values: Sequence[str]) -> str:
    return json.dumps(list(values))  # a JSON list of strings is a TOML array


# What a worker's process does not inherit: the store's credentials (workers upload; they hold none) and the
# pool's secrets. Validators and the learner read the store with the credentials of the launcher's environment.
WORKER_WITHHELD_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    "INTELLECT_ORCHESTRATOR__ADMIN_TOKEN",
    "INTELLECT_INGEST__TOKEN",
)


@dataclass
class Role:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    withheld: tuple[str, ...] = ()  # variables of the launcher's environment this role does not get

    def environment(self) -> dict[str, str]:
        return {k: v for k, v in {**os.environ, **self.env}.items() if k not in self.withheld}

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class RoleFailed(RuntimeError):
    pass


class Launcher:
    def __init__(
        self, cfg: Config, config_path: Path | None, overrides: Sequence[str], resume: bool = False, console=None
    ):
        self.cfg = cfg
        self.config_path = config_path
        self.user_overrides = list(overrides)
        self.resume = resume
        self.run_dir = Path(cfg.run.dir)
        self.logs = self.run_dir / "logs"
        self.roles: dict[str, Role] = {}
        self.token = cfg.orchestrator.admin_token or secrets.token_hex(16)
        self.orch_url = ""
        self.console = console
        self.evaluating: tuple[Role, int] | None = None
        self.evaluated: set[int] = set()
        self._stopping = False
        self.metrics_log = MetricsLog(cfg, "launcher")  # metrics.jsonl, and W&B when run.wandb_mode asks

    # -- plumbing ----------------------------------------------------------------------------------------

    def command(self, *argv: str, extra: Sequence[str] = ()) -> list[str]:
        cfg = [str(self.config_path)] if self.config_path else []
        return [sys.executable, "-m", "intellect", argv[0], *argv[1:], *cfg, *self.user_overrides, *extra]

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)
        else:
            print(text, flush=True)

    def foreground(self, name: str, argv: list[str]) -> None:
        """Run a phase to completion with its output in its log; RoleFailed if it fails."""
        role = Role(name, argv, self.logs / f"{name}.log", {"INTELLECT_ORCHESTRATOR__ADMIN_TOKEN": self.token})
        role.start()
        code = role.proc.wait()
        if code != 0:
            raise RoleFailed(f"{name} exited with {code}; the end of {role.log}:\n{role.tail()}")

    def metrics(self, record: dict) -> None:
        self.metrics_log.write(record)

    # -- phases ------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        has_state = (self.run_dir / "checkpoints").exists() or self.cfg.run.db_path.exists()
        if has_state and not self.resume:
            raise RoleFailed(
                f"{self.run_dir} holds a run already (checkpoints or orchestrator.db): continue it with "
                "--resume, or choose another run.dir"
            )
        if self.resume and not has_state:
            raise RoleFailed(f"--resume: {self.run_dir} holds no run to continue")
        for d in (self.logs, self.cfg.run.weights_dir, self.cfg.run.keys_dir):
            d.mkdir(parents=True, exist_ok=True)
        if self.resume:
            self.roll_back()

    def roll_back(self) -> None:
        """Before resuming: versions published after the learner's last checkpoint are gone (the restored
        learner will publish others under the same numbers), so their directories are deleted everywhere under
        run.dir (learner, relays, nodes) and the orchestrator's records forget them (`orchestrator.rollback`)."""
        import shutil

        from jax_trainer.checkpoint import Checkpointer
        from orchestrator.db import sqlite_url
        from orchestrator.rollback import rollback

        step = Checkpointer(self.run_dir / "checkpoints").latest_step() or 0
        homes = [self.cfg.run.weights_dir, self.run_dir / "relays", self.run_dir / "nodes"]  # not rollouts/
        stale = [
            p
            for home in homes
            for p in home.rglob("v[0-9][0-9][0-9][0-9][0-9][0-9]")
            if p.is_dir() and int(p.name[1:]) > step
        ]
        for path in stale:
            shutil.rmtree(path)
        url = self.cfg.orchestrator.database_url or sqlite_url(self.cfg.run.db_path)
        counts = rollback(url, step) if self.cfg.orchestrator.database_url or self.cfg.run.db_path.exists() else {}
        self.say(
            f"resuming from the checkpoint at step {step}: removed {len(stale)} version directories of later "
            f"steps; orchestrator records: {counts}"
        )

    @property
    def sft_dir(self) -> Path:
        return self.run_dir / "sft"

    def base_model(self) -> str:
        return str(self.sft_dir) if self.cfg.run.sft_steps else str(self.cfg.model.path)

    def warm_start(self) -> None:
        if not self.cfg.run.sft_steps or (self.sft_dir / "config.json").exists():
            return
        self.say(f"[bold]warm start[/]: {self.cfg.run.sft_steps} supervised steps (log: {self.logs / 'sft.log'})")
        t0 = time.monotonic()
        run = self.cfg.run
        self.foreground(
            "sft",
            self.command(
                "sft",
                "--steps",
                str(run.sft_steps),
                "--lr",
                str(run.sft_lr),
                "--batch-size",
                str(run.sft_batch_size),
                "--out",
                str(self.sft_dir),
            ),
        )
        self.say(f"warm start done in {time.monotonic() - t0:.0f} s: {self.sft_dir}")

    def check_calibration(self) -> None:
        """A bfloat16/float16 replay pool's validators refuse to start without a calibration of the base model
        (`gpu_workers.calibration`): RoleFailed saying what to run, before the pool starts."""
        from gpu_workers.calibration import calibration_problem

        cfg = self.cfg
        if not cfg.run.num_validators:
            return
        problem = calibration_problem(
            cfg.validator, cfg.worker, Path(self.base_model()), cfg.orchestrator.near_tie_rate
        )
        if problem is not None:
            config = self.config_path or "CONFIG"
            raise RoleFailed(
                f"{problem}\nThe pool's base model is {self.base_model()}: `intellect calibrate {config} --model "
                f'{self.base_model()} --out CALIBRATION.toml`, then include it (include = ["CALIBRATION.toml"] at '
                "the top of the recipe) and run again (a finished warm start is kept)."
            )

    def eval_argv(self, model_dir: Path | str, step: int) -> list[str]:
        return self.command(
            "eval", str(model_dir), extra=["--metrics", str(self.cfg.run.metrics_path), "--step", str(step)]
        )

    def evaluate_now(self, model_dir: Path | str, step: int) -> None:
        if not self.cfg.data.eval_tasks or step in self.evaluated:
            return
        self.say(f"evaluating step {step} on {self.cfg.data.eval_tasks} held-out tasks ...")
        self.foreground(f"eval-{step}", self.eval_argv(model_dir, step))
        self.evaluated.add(step)
        self.say(f"held-out accuracy at step {step}: {self.last_accuracy():.1%}")

    def last_accuracy(self) -> float:
        return next((r["accuracy"] for r in reversed(self.read_metrics()) if r.get("role") == "eval"), float("nan"))

    def read_metrics(self) -> list[dict]:
        path = self.cfg.run.metrics_path
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def start_pool(self) -> None:
        cfg = self.cfg
        orch_port, origin_port = free_port(), free_port()
        self.orch_url = f"http://127.0.0.1:{orch_port}"
        origin = f"http://127.0.0.1:{origin_port}"
        relay_ports = [free_port() for _ in range(cfg.run.num_relays)]
        relays = [f"http://127.0.0.1:{p}" for p in relay_ports]
        worker_keys = [cfg.run.keys_dir / f"worker{i}.key" for i in range(cfg.run.num_workers)]
        validator_keys = [cfg.run.keys_dir / f"validator{i}.key" for i in range(cfg.run.num_validators)]
        from bridge.protocol.signing import load_or_create_key, public_key_hex

        allowed = [public_key_hex(load_or_create_key(k)) for k in validator_keys]
        wiring = [
            "--orchestrator.port",
            str(orch_port),
            "--shardcast.host",
            "127.0.0.1",
            "--shardcast.port",
            str(origin_port),
            "--shardcast.relays",
            toml_list(relays or [origin]),
            "--worker.orchestrator_url",
            self.orch_url,
            "--validator.orchestrator_url",
            self.orch_url,
            "--orchestrator.validator_keys",
            toml_list(allowed),
        ]
        env = {"INTELLECT_ORCHESTRATOR__ADMIN_TOKEN": self.token}

        def add(name: str, argv: list[str], withheld: tuple[str, ...] = ()) -> Role:
            role = Role(name, argv, self.logs / f"{name}.log", {} if withheld else env, withheld=withheld)
            self.roles[name] = role
            role.start()
            return role

        add("orchestrator", self.command("orchestrator", extra=[*wiring, "--orchestrator.host", "127.0.0.1"]))
        self.wait_http(self.orch_url + "/healthz", "orchestrator")
        add(
            "origin",
            self.command(
                "shardcast",
                "origin",
                "--dir",
                str(cfg.run.weights_dir),
                "--port",
                str(origin_port),
                "--host",
                "127.0.0.1",
                extra=wiring,
            ),
        )
        for i, port in enumerate(relay_ports):
            add(
                f"relay{i}",
                self.command(
                    "shardcast",
                    "relay",
                    "--upstream",
                    origin,
                    "--dir",
                    str(self.run_dir / "relays" / f"relay{i}"),
                    "--port",
                    str(port),
                    "--host",
                    "127.0.0.1",
                    extra=wiring,
                ),
            )
        add(
            "learner",
            self.command(
                "train", extra=[*wiring, "--model.path", self.base_model(), "--trainer.accepted_from", "orchestrator"]
            ),
        )
        for i, key in enumerate(worker_keys):
            add(
                f"worker{i}",
                self.command("worker", extra=[*wiring, "--worker.key_path", str(key)]),
                withheld=WORKER_WITHHELD_ENV,
            )
        for i, key in enumerate(validator_keys):  # model.path: the base model their calibration must name
            extra = [*wiring, "--validator.key_path", str(key), "--model.path", self.base_model()]
            add(f"validator{i}", self.command("validator", extra=extra))

    def wait_http(self, url: str, name: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            role = self.roles.get(name)
            if role is not None and not role.alive():
                raise RoleFailed(f"{name} exited with {role.proc.returncode}:\n{role.tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1):
                    return
            time.sleep(0.2)
        raise RoleFailed(f"{name} did not answer on {url} within {timeout_s:.0f} s")

    def get_json(self, path: str) -> dict | None:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(self.orch_url + path, timeout=2) as reply:
                return json.loads(reply.read())
        return None

    # -- the RL phase ------------------------------------------------------------------------------------

    def newest_version(self) -> int | None:
        held = [int(p.name[1:]) for p in self.cfg.run.weights_dir.glob("v[0-9]*") if (p / "STABLE").exists()]
        return max(held, default=None)

    def supervise(self, view) -> None:
        """Until the learner finishes: watch every role, run periodic evaluations, log the pool's counts."""
        steps, interval = self.cfg.trainer.steps, self.cfg.run.eval_interval
        last_pool = 0.0
        while True:
            for name, role in self.roles.items():
                if role.alive() or (name == "learner" and role.proc.returncode == 0):
                    continue
                if self.cfg.run.restart_failed and name != "learner":
                    role.restarts += 1
                    self.say(
                        f"[yellow]{name} exited with {role.proc.returncode}; restarting it (restart {role.restarts})[/]"
                    )
                    role.start()
                    continue
                raise RoleFailed(f"{name} exited with {role.proc.returncode}; the end of {role.log}:\n{role.tail()}")
            if self.evaluating is not None and not self.evaluating[0].alive():
                role, step = self.evaluating
                self.evaluating = None
                if role.proc.returncode == 0:
                    self.evaluated.add(step)
                else:
                    self.say(f"[yellow]evaluation at step {step} failed; see {role.log}[/]")
            version = self.newest_version()
            if (
                interval
                and version
                and version % interval == 0
                and version < steps
                and self.evaluating is None
                and version not in self.evaluated
            ):
                role = Role(
                    f"eval-{version}",
                    self.eval_argv(self.cfg.run.weights_dir / f"v{version:06d}", version),
                    self.logs / f"eval-{version}.log",
                )
                role.start()
                self.evaluating = (role, version)
            if time.monotonic() - last_pool >= 10:
                last_pool = time.monotonic()
                self.log_pool()
            view.update(self.status())
            if self.roles["learner"].proc.returncode == 0:
                return
            time.sleep(1.0)

    def pool_counts(self) -> dict[str, int] | None:
        """Accepted and rejected batches, accepted samples, workers and validators, from the public ledger."""
        ledger = self.get_json("/v1/ledger")
        if not ledger:
            return None
        workers = [e for e in ledger["entries"] if e["role"] == "worker"]
        return {
            "accepted_batches": sum(e["accepted_batches"] for e in workers),
            "rejected_batches": sum(e["rejected_batches"] for e in workers),
            "accepted_samples": sum(e["accepted_samples"] for e in workers),
            "workers": len(workers),
            "validators": len(ledger["entries"]) - len(workers),
        }

    def log_pool(self) -> None:
        counts = self.pool_counts()
        if counts is not None:
            self.metrics({"role": "pool", "step": self.learner_step(), "time": time.time(), **counts})

    def learner_step(self) -> int:
        return next((int(r["step"]) for r in reversed(self.read_metrics()) if r.get("role") == "learner"), 0)

    def status(self) -> dict:
        records = self.read_metrics()
        learner = next((r for r in reversed(records) if r.get("role") == "learner"), {})
        evals = [r for r in records if r.get("role") == "eval"]
        counts = self.pool_counts() or {"accepted_batches": 0, "rejected_batches": 0}
        policy = self.get_json("/v1/policy") or {}
        return {
            "step": learner.get("step", 0),
            "steps": self.cfg.trainer.steps,
            "version": policy.get("version"),
            "reward": learner.get("reward_mean"),
            "accuracy": evals[-1]["accuracy"] if evals else None,
            "accuracy_step": evals[-1]["step"] if evals else None,
            "first_accuracy": evals[0]["accuracy"] if evals else None,
            "best_constant": evals[-1].get("best_constant_accuracy") if evals else None,
            "format_rate": evals[-1].get("format_rate") if evals else None,
            "accepted": counts["accepted_batches"],
            "rejected": counts["rejected_batches"],
            "staleness": learner.get("staleness_mean"),
            "tokens_per_s": learner.get("tokens_per_s"),
            "busy": learner.get("busy_frac"),
            "roles": {n: ("up" if r.alive() else f"exit {r.proc.returncode}") for n, r in self.roles.items()},
        }

    # -- stopping ----------------------------------------------------------------------------------------

    def stop_all(self) -> None:
        """Stop in waves, each given GRACE_S before SIGKILL: workers, validators and evaluations first (they
        deregister), then the learner, then the services they talk to."""
        order = ("worker", "validator", "eval", "learner", "relay", "origin", "orchestrator")

        def wave(role: Role) -> int:
            rank = next((i for i, prefix in enumerate(order) if role.name.startswith(prefix)), len(order))
            return max(rank, 2) - 2  # the first three share a wave

        roles = [r for r in self.roles.values() if r.alive()]
        if self.evaluating is not None and self.evaluating[0].alive():
            roles.append(self.evaluating[0])
        for w in sorted({wave(r) for r in roles}):
            members = [r for r in roles if wave(r) == w]
            for r in members:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.terminate()
            deadline = time.monotonic() + GRACE_S
            for r in members:
                try:
                    r.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()

    # -- all of it ---------------------------------------------------------------------------------------

    def run(self, view) -> dict:
        self.prepare()
        t0 = time.monotonic()
        self.warm_start()
        self.check_calibration()
        self.evaluated = {int(r["step"]) for r in self.read_metrics() if r.get("role") == "eval"}
        if 0 not in self.evaluated:
            self.evaluate_now(self.base_model(), 0)
        rl_start = time.monotonic()
        try:
            self.start_pool()
            with view:
                self.supervise(view)
        finally:
            self.log_pool()
            self.stop_all()
            self.metrics_log.close()
        rl_seconds = time.monotonic() - rl_start
        final = self.newest_version()
        if final is not None:
            self.evaluate_now(self.cfg.run.weights_dir / f"v{final:06d}", final)
        plots = self.plot()
        evals = [r for r in self.read_metrics() if r.get("role") == "eval"]
        return {
            "run_dir": str(self.run_dir),
            "final_version": final,
            "rl_seconds": round(rl_seconds, 1),
            "total_seconds": round(time.monotonic() - t0, 1),
            "accuracy": {int(r["step"]): r["accuracy"] for r in evals},
            **gain_summary(evals),
            "plots": plots,
            "final_policy": str(self.cfg.run.weights_dir / f"v{final:06d}") if final is not None else None,
        }

    def plot(self) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-m", "intellect", "plot", str(self.run_dir)], capture_output=True, text=True
        )
        if out.returncode != 0:
            self.say(f"[yellow]plots failed: {out.stderr.strip()[-500:]}[/]")
            return []
        return sorted(str(p) for p in (self.run_dir / "plots").glob("*.png"))


def gain_summary(evals: list[dict]) -> dict:
    """What a run's held-out evaluations (eval records in step order) say it learned: the best constant answer,
    the share of answers in the expected format and pass@1 among them at each step, and the gain, counted from
    the better of the starting policy and the best constant answer (None without a constant to compare with)."""
    if not evals:
        return {"best_constant_accuracy": None, "best_constant_answer": None, "gain": None}
    constant = evals[-1].get("best_constant_accuracy")
    floor = None if constant is None else max(evals[0]["accuracy"], constant)
    return {
        "best_constant_accuracy": constant,
        "best_constant_answer": evals[-1].get("best_constant_answer"),
        "format_rate": {int(r["step"]): r.get("format_rate") for r in evals},
        "accuracy_in_format": {int(r["step"]): r.get("accuracy_in_format") for r in evals},
        "gain": None if floor is None else evals[-1]["accuracy"] - floor,
    }
