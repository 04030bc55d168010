"""The one configuration schema shared by every role: the sections the components declare, composed.

`Config` has a section per role (`[model]`, `[trainer]`, `[loss]`, `[optim]`, `[data]`, `[orchestrator]`,
`[shardcast]`, `[worker]`, `[validator]`, `[run]`); every field has a type, a default and a one-line docstring.
Each section is declared next to the component that takes it (`jax_trainer.config`, `gpu_workers.config`,
`bridge.shardcast.config`, `orchestrator.config`); `[run]`, read by the commands themselves, is declared here,
and so are the checks that span sections (`Config._check`). `intellect.config_io` reads a config from a TOML
file, the environment and flags, and writes one back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from bridge.config import Section
from bridge.config import require as _require
from bridge.shardcast.config import ShardcastConfig
from gpu_workers.config import DataConfig, ValidatorConfig, WorkerConfig
from jax_trainer.config import LearnerModelConfig, LossConfig, OptimConfig, TrainerConfig
from orchestrator.config import IngestConfig, OrchestratorConfig


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key, its source and a fix."""


class RunConfig(Section):
    """[run]: the run directory (its layout is the properties below), local process counts, logging."""

    dir: Path = Path("runs/default")
    """Run directory: checkpoints/, weights/, rollouts/, orchestrator.db, metrics.jsonl, logs/, plots/."""
    name: str = Field("intellect", min_length=1)
    """Name of the run in logs and the dashboard."""
    num_workers: int = Field(1, ge=0)
    """Rollout workers `intellect run` starts on this machine."""
    num_validators: int = Field(1, ge=0)
    """Validators `intellect run` starts on this machine."""
    num_relays: int = Field(0, ge=0)
    """SHARDCAST relays `intellect run` starts between the origin and the workers."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Logging level of every process."""
    sft_steps: int = Field(0, ge=0)
    """Supervised warm-start steps `intellect run` makes before RL (0: none; RL starts from model.path)."""
    sft_lr: float = Field(1e-3, gt=0)
    """Peak learning rate of the warm start (the tiny demo's 1e-3; a pretrained model wants far less)."""
    sft_batch_size: int = Field(64, gt=0)
    """Examples per warm-start step."""
    sft_think_lines: list[int] = []
    """Warm start: completions write the answer on k lines, k drawn from this list apart from the target (empty: 1)."""
    eval_interval: int = Field(0, ge=0)
    """`intellect run` scores held-out accuracy every this many learner steps (0: at the start and end only)."""
    restart_failed: bool = False
    """`intellect run` restarts a worker, validator, relay or service that exits, instead of stopping the run."""
    wandb_mode: Literal["online", "offline", "disabled"] = "disabled"
    """Weights & Biases logging of metrics.jsonl's records (online without WANDB_API_KEY or a login: offline)."""
    wandb_project: str = Field("intellect", min_length=1)
    """W&B project the run's processes log to (one W&B run per role, grouped by run.name)."""
    wandb_entity: str | None = None
    """W&B entity (user or team) owning the project (None: the account's default)."""

    @field_validator("sft_think_lines")
    @classmethod
    def _lines(cls, value: list[int]) -> list[int]:
        if any(k < 1 for k in value):
            raise ValueError(f"every count must be >= 1 (lines holding the answer), got {value}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @property
    def checkpoints_dir(self) -> Path:
        return self.dir / "checkpoints"

    @property
    def weights_dir(self) -> Path:
        return self.dir / "weights"

    @property
    def rollouts_dir(self) -> Path:
        return self.dir / "rollouts"

    @property
    def db_path(self) -> Path:
        return self.dir / "orchestrator.db"

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def plots_dir(self) -> Path:
        return self.dir / "plots"

    @property
    def keys_dir(self) -> Path:
        return self.dir / "keys"


class Config(BaseSettings):
    """Everything every role needs; build it with `intellect.config_io.load_config`, not by reading the
    environment."""

    model_config = SettingsConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: LearnerModelConfig = Field(default_factory=LearnerModelConfig)
    """The policy: where the base weights are and how the learner holds them."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The JAX learner: mesh, batch sizes, step count, checkpoints and exports."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The GRPO objective: clipping, aggregation, penalties."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The AdamW optimizer and its learning-rate schedule."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompts, group size, lengths and filters."""
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    """The coordination service."""
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    """Batch uploads: the rollout store they are written to and the processes that take them."""
    shardcast: ShardcastConfig = Field(default_factory=ShardcastConfig)
    """Weight broadcast from the learner to the workers."""
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    """Rollout workers."""
    validator: ValidatorConfig = Field(default_factory=ValidatorConfig)
    """Validators: TOPLOC thresholds and prefill dtype."""
    run: RunConfig = Field(default_factory=RunConfig)
    """The run as a whole: directory, name, local process counts, logging."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only the values passed in (no env, dotenv or secrets): `load_config` reads every source itself."""
        return (init_settings,)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if "logprob_source" not in self.loss.model_fields_set:
            # unset: a pool takes pi_old from its validators' recomputation (learns as well as the workers' claims
            # on the demo, and no worker can move it: benchmarks/RESULTS.md); a single box without validators
            # recomputes it in the learner
            self.loss.logprob_source = "validator" if self.trainer.accepted_from == "orchestrator" else "recompute"
        batch = self.data.prompts_per_step * self.data.samples_per_prompt
        _require(
            self.trainer.batch_size == batch,
            ("trainer.batch_size", "data.prompts_per_step", "data.samples_per_prompt"),
            f"trainer.batch_size ({self.trainer.batch_size}) must equal data.prompts_per_step "
            f"({self.data.prompts_per_step}) x data.samples_per_prompt ({self.data.samples_per_prompt}) = {batch}",
        )
        if self.data.env is None:
            longest = self.data.max_prompt_len + self.data.max_new_tokens
            _require(
                longest <= self.model.max_seq_len,
                ("model.max_seq_len", "data.max_prompt_len", "data.max_new_tokens"),
                f"model.max_seq_len ({self.model.max_seq_len}) is shorter than data.max_prompt_len + "
                f"data.max_new_tokens ({longest})",
            )
        else:
            from gpu_workers.config import episode_limits

            limits = episode_limits(self.worker, self.data)
            _require(
                limits.max_total_tokens <= self.model.max_seq_len,
                ("model.max_seq_len", "data.max_episode_tokens", "data.max_turns"),
                f"model.max_seq_len ({self.model.max_seq_len}) is shorter than an episode may be "
                f"({limits.max_total_tokens} tokens: data.max_episode_tokens, or data.max_prompt_len and "
                "data.max_turns turns at their caps)",
            )
            _require(
                self.data.max_prompt_len < limits.max_total_tokens,
                ("data.max_prompt_len", "data.max_episode_tokens"),
                f"data.max_episode_tokens ({limits.max_total_tokens}) leaves no room for a model turn after a "
                f"prompt of data.max_prompt_len ({self.data.max_prompt_len}) tokens",
            )
        levels = max(1, len(self.data.curriculum))
        _require(
            self.orchestrator.num_tasks is None or self.orchestrator.num_tasks % levels == 0,
            ("orchestrator.num_tasks", "data.curriculum"),
            f"orchestrator.num_tasks ({self.orchestrator.num_tasks}) must be the training list's length, "
            f"data.num_tasks x {levels} curriculum levels",
        )
        _require(
            self.data.online_filter or not self.data.dynamic_sampling,
            ("data.dynamic_sampling", "data.online_filter"),
            "data.dynamic_sampling fills each step with groups whose rewards differ: "
            "it needs data.online_filter = true",
        )
        _require(
            self.loss.temperature == self.worker.temperature,
            ("loss.temperature", "worker.temperature"),
            f"loss.temperature ({self.loss.temperature}) must equal worker.temperature "
            f"({self.worker.temperature}): the learner must score samples with the distribution they came from",
        )
        _require(
            self.loss.logprob_source != "validator" or self.trainer.accepted_from == "orchestrator",
            ("loss.logprob_source", "trainer.accepted_from"),
            'loss.logprob_source = "validator" reads the logprobs validators wrote beside the batches they accepted: '
            'it needs trainer.accepted_from = "orchestrator" (a single box without validators: "inference" or '
            '"recompute")',
        )
        _require(
            self.worker.max_tokens is None or self.worker.max_tokens <= self.data.max_new_tokens,
            ("worker.max_tokens", "data.max_new_tokens"),
            f"worker.max_tokens ({self.worker.max_tokens}) exceeds data.max_new_tokens ({self.data.max_new_tokens})",
        )
        _require(
            self.shardcast.keep_versions >= self.trainer.async_level + 1,
            ("shardcast.keep_versions", "trainer.async_level"),
            f"shardcast.keep_versions ({self.shardcast.keep_versions}) must be at least trainer.async_level + 1 "
            f"({self.trainer.async_level + 1}): workers may still need every version in the async window",
        )
        return self


SECTIONS: dict[str, type[Section]] = {name: f.annotation for name, f in Config.model_fields.items()}


def rollout_store(cfg: Config, role: Literal["ingest", "validator", "learner"]) -> str:
    """The rollout store as `role` opens it: its own setting (validator.store_url, trainer.rollout_store), else
    ingest.store_url (the store uploads are written to), else <run.dir>/rollouts. Each role's credentials come
    from its own environment; workers open no store (they upload)."""
    own = {"ingest": None, "validator": cfg.validator.store_url, "learner": cfg.trainer.rollout_store}[role]
    return own or cfg.ingest.store_url or str(cfg.run.rollouts_dir)
