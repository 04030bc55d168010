"""Where a run's metrics go: `run.dir/metrics.jsonl`, and Weights & Biases when `run.wandb_mode` asks for it.

Every role appends one JSON object a line to metrics.jsonl, each with "role", "step" and "time": the learner
(`jax_trainer.learner`, one record per step), the supervised warm start (`jax_trainer.sft`), the launcher
(`"pool"` records) and evaluation (`intellect eval --metrics`). The library roles write their lines themselves
and hand each record to a callback; the commands here give them `WandbSink.log` as that callback, and the
launcher and evaluation write through `MetricsLog`, which does both.

W&B (`run.wandb_mode`: "online", "offline", "disabled"; the optional `wandb` package, `pip install -e .[wandb]`):
each process that logs is one W&B run in project `run.wandb_project` (entity `run.wandb_entity`), grouped by
`run.name`, with the job type saying which process it is ("learner", "sft", "launcher", "eval") and a stable id
(run name, job, run directory), so a resumed learner and each evaluation continue their run. Its files are under
`run.dir/wandb/`; the run's config is recorded without the orchestrator's admin token and database URL. An
offline run is uploaded later with `wandb sync run.dir/wandb/offline-run-*`. "online"
without a key (no WANDB_API_KEY, no `wandb login` entry in ~/.netrc) logs offline and says so. A record becomes
one history row: its numbers under "ROLE/KEY" (nested objects such as the learner's staleness histogram as
"ROLE/KEY/SUBKEY", booleans as 0/1), with "ROLE/step" as the x-axis of that role's charts; strings, lists and
nulls (model paths, batch ids) are not metrics and stay in metrics.jsonl only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import netrc
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from intellect.config import Config, ConfigError

log = logging.getLogger("intellect.metrics")


def append_record(path: str | Path, record: Mapping[str, Any]) -> None:
    """One JSON line appended to a metrics.jsonl."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def flatten(record: Mapping[str, Any]) -> dict[str, float | int]:
    """A metrics.jsonl record as one W&B history row: numbers under "ROLE/KEY", nested objects' numbers under
    "ROLE/KEY/SUBKEY", booleans as 0/1; strings, lists and nulls left out."""
    role = str(record.get("role", "run"))
    row: dict[str, float | int] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, bool):
            row[key] = int(value)
        elif isinstance(value, (int, float)):
            row[key] = value
        elif isinstance(value, Mapping):
            for sub, inner in value.items():
                walk(f"{key}/{sub}", inner)

    for key, value in record.items():
        if key != "role":
            walk(f"{role}/{key}", value)
    return row


def has_api_key(env: Mapping[str, str]) -> bool:
    """Whether W&B can authenticate: WANDB_API_KEY, or a `wandb login` entry in ~/.netrc for its host."""
    if env.get("WANDB_API_KEY"):
        return True
    host = re.sub(r"^https?://", "", env.get("WANDB_BASE_URL", "https://api.wandb.ai")).split("/")[0].split(":")[0]
    try:
        return netrc.netrc(env.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(mode: str, env: Mapping[str, str]) -> str:
    """The mode W&B runs in: "online" falls back to "offline" without a key."""
    if mode == "online" and not has_api_key(env):
        log.warning("run.wandb_mode = 'online' but no WANDB_API_KEY or wandb login: logging offline")
        return "offline"
    return mode


def run_id(cfg: Config, job: str) -> str:
    """A W&B run id that is the same for every process of one job of one run directory."""
    where = hashlib.sha256(str(Path(cfg.run.dir).absolute()).encode()).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", cfg.run.name)[:40]
    return f"{name}-{job}-{where}"


_SECRETS = {"orchestrator": {"admin_token", "database_url"}}  # left out of the config W&B records


class WandbSink:
    """One W&B run for one process; `log(record)` adds a metrics.jsonl record as a history row. The run starts
    at the first record (a process that writes none, such as a learner host other than the first, makes none)."""

    def __init__(self, cfg: Config, job: str, env: Mapping[str, str] | None = None):
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                f"run.wandb_mode = {cfg.run.wandb_mode!r} needs the wandb package: pip install -e .[wandb] "
                "(or set run.wandb_mode = 'disabled')"
            ) from exc
        self.wandb, self.cfg, self.job = wandb, cfg, job
        self.mode = wandb_mode(cfg.run.wandb_mode, os.environ if env is None else env)
        self.run = None
        self.roles: set[str] = set()

    def _start(self):
        cfg = self.cfg
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(
            project=cfg.run.wandb_project,
            entity=cfg.run.wandb_entity,
            mode=self.mode,
            dir=str(cfg.run.dir),
            group=cfg.run.name,
            job_type=self.job,
            name=f"{cfg.run.name}-{self.job}",
            id=run_id(cfg, self.job),
            resume="allow",
            config=cfg.model_dump(mode="json", exclude=_SECRETS),
            settings=self.wandb.Settings(console="off", save_code=False, silent=True),
        )
        return self.run

    def log(self, record: Mapping[str, Any]) -> None:
        run = self.run or self._start()
        role = str(record.get("role", "run"))
        if role not in self.roles:
            run.define_metric(f"{role}/step")
            run.define_metric(f"{role}/*", step_metric=f"{role}/step")
            self.roles.add(role)
        run.log(flatten(record))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def wandb_sink(cfg: Config, job: str) -> WandbSink | None:
    """The W&B sink of a process, or None with run.wandb_mode = "disabled"."""
    return None if cfg.run.wandb_mode == "disabled" else WandbSink(cfg, job)


class MetricsLog:
    """Appends records to a metrics.jsonl (default: the run's) and logs each to W&B when enabled."""

    def __init__(self, cfg: Config, job: str, path: str | Path | None = None):
        self.path = Path(path) if path is not None else cfg.run.metrics_path
        self.sink = wandb_sink(cfg, job)

    def write(self, record: Mapping[str, Any]) -> None:
        append_record(self.path, record)
        if self.sink is not None:
            self.sink.log(record)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
