"""The learner's config sections, declared next to the learner: `[model]` (the policy's weights and how the
learner holds them), `[trainer]` (mesh, batches, steps, checkpoints, exports), `[loss]` (the GRPO objective)
and `[optim]` (AdamW and its schedule).

`GRPOTrainer` (loss, optim, trainer), `SFTTrainer`, `Learner` (trainer), `make_optimizer` and the loss
functions take these classes themselves; `[model]` is read where the model is built (`intellect.learner_setup`).
`intellect.config.Config` composes them with the other roles' sections. This module imports no JAX, so that
reading a config stays cheap.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from bridge.config import Dtype, Section, require

Aggregation = Literal["token_mean", "seq_mean_token_mean", "constant", "seq_mean_token_sum_norm"]
PolicyLoss = Literal["grpo", "dr_grpo", "gspo", "cispo"]
Mismatch = Literal["none", "token_mask", "seq_mask", "geo_mask"]
MISMATCH_BOUNDS = {"token_mask": (0.5, 2.0), "seq_mask": (0.5, 2.0), "geo_mask": (0.99, 1.01)}
"""Default [mismatch_low, mismatch_high] of each `loss.mismatch` mode."""
RematPolicy = Literal["none", "full", "save_dots", "offload"]


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections LoRA can adapt: attention q/k/v/o, MLP gate/up/down (`jax_trainer.models.lora`)."""


class LoraConfig(Section):
    """[model.lora]: train LoRA adapters on a frozen base instead of the whole model."""

    rank: int = Field(16, gt=0)
    """Rank of every adapter (A: [in, rank], B: [rank, out])."""
    alpha: float = Field(32.0, gt=0)
    """The adapters' outputs are scaled by alpha / rank."""
    targets: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    """Projections to adapt, by the names users know: q, k, v, o, gate, up, down."""
    seed: int = 0
    """Seed of the adapters' A matrices (B starts at zero, so a fresh adapter leaves the base unchanged)."""
    ship: Literal["merged", "adapter"] = "merged"
    """What each version after 0 is on the wire: the merged model, or the adapter alone (workers and validators
    merge it into version 0 by the merge contract)."""

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        unknown = [t for t in value if t not in LORA_TARGETS]
        if unknown or not value or len(set(value)) != len(value):
            raise ValueError(
                f"{unknown or value} (a projection unknown, none, or one named twice): the decoder's projections "
                f"are {', '.join(LORA_TARGETS)}"
            )
        return value


class LearnerModelConfig(Section):
    """[model]: the policy's base weights and how the learner holds them."""

    path: str = "Qwen/QwQ-32B"
    """Hugging Face model directory (or hub id) holding the base policy, version 0."""
    param_dtype: Dtype = "float32"
    """dtype of the learner's master parameters and optimizer state."""
    compute_dtype: Dtype = "bfloat16"
    """dtype of the learner's matmuls and activations."""
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    """Attention kernel (`jax_trainer.attention`): auto = splash on TPU, cudnn on GPU in bf16, xla otherwise."""
    remat: RematPolicy = "full"
    """What each layer keeps for the backward pass: none, full (recompute all), save_dots, offload (dots to host)."""
    scan_layers: bool | Literal["auto"] = "auto"
    """One `lax.scan` over the stacked layers (compile time independent of depth); auto: on GPU/TPU, not on CPU."""
    scan_unroll: int = Field(1, gt=0)
    """Layers per iteration of the scan (XLA may overlap work across the unrolled layers)."""
    max_seq_len: int = Field(32768, gt=0)
    """Longest prompt plus completion the learner trains on, in tokens."""
    lora: LoraConfig | None = None
    """LoRA adapters to train on the frozen base (a table: rank, alpha, targets, seed); unset: the whole model."""

    @field_validator("remat", mode="before")
    @classmethod
    def _remat_bool(cls, value):
        """Recipes written before the named policies said `remat = true/false`: read as full/none."""
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


class TrainerConfig(Section):
    """[trainer]: the JAX learner's mesh, batches, steps, checkpoints and exports."""

    data: int = 1
    """Size of the `data` mesh axis (pure data parallel); -1 fills it with the devices left over."""
    fsdp: int = -1
    """Size of the `fsdp` mesh axis (parameters and optimizer state sharded); -1 fills the rest."""
    tensor: int = 1
    """Size of the `tensor` mesh axis (tensor parallel within a layer); -1 fills the rest."""
    batch_size: int = Field(512, gt=0)
    """Samples per optimizer step; must equal data.prompts_per_step x data.samples_per_prompt."""
    micro_batch_size: int = Field(16, gt=0)
    """Packed rows of model.max_seq_len tokens per gradient-accumulation micro-batch, across the whole mesh."""
    steps_per_batch: int = Field(1, gt=0)
    """Optimizer steps taken on each rollout batch (INTELLECT-2's step_per_rollout); splits its micro-batches."""
    truncate: bool = False
    """Cut samples longer than model.max_seq_len instead of refusing them (an error names the sample)."""
    logprob_chunk: int = Field(128, gt=0)
    """Sequence positions per chunk of the LM head in the loss (bounds the float32 logits held at once)."""
    coordinator_address: str | None = None
    """host:port of process 0 for multi-host jax.distributed (None: single process, or TPU auto-detection)."""
    num_processes: int | None = Field(None, gt=0)
    """Processes in a multi-host learner (None: auto-detect on TPU, else 1)."""
    process_id: int | None = Field(None, ge=0)
    """This process's index in a multi-host learner (None: auto-detect)."""
    batch_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for a step's rollouts before the learner gives up with an error."""
    micro_batches: int | None = Field(None, gt=0)
    """Fixed micro-batches per step (padded with empty rows) so the step compiles once; None: as many as needed."""
    accepted_from: Literal["orchestrator", "store"] = "orchestrator"
    """Source of accepted batches: the orchestrator (validators' rewards), or every stored batch (trusted box)."""
    rollout_store: str | None = None
    """Rollout store (URL, path or JSON kvstore spec) the learner reads and prunes (None: ingest.store_url's)."""
    rollout_keep_versions: int | None = Field(None, gt=0)
    """Delete stored rollouts of versions older than this many below the current step (None: keep all)."""
    steps: int = Field(1000, gt=0)
    """Optimizer steps to train for; the final policy is version `steps`."""
    async_level: int = Field(2, ge=0)
    """Step n trains on rollouts of version v only if n - v <= async_level (0: synchronous on-policy)."""
    seed: int = 0
    """Seed of the learner's randomness (data order, init of fresh parameters)."""
    checkpoint_interval: int = Field(50, ge=0)
    """Save an orbax checkpoint every this many steps (0: never)."""
    export_interval: int = Field(1, gt=0)
    """Export the policy as a Hugging Face directory for the workers every this many steps."""
    keep_checkpoints: int = Field(3, gt=0)
    """Newest orbax checkpoints kept on disk; older ones are deleted."""
    retain_host_memory: bool | Literal["auto"] = "auto"
    """Keep freed host memory for reuse (glibc; RSS stays at peak): "auto" only where the model leaves room for it."""
    export_dtype: Dtype = "bfloat16"
    """dtype of the exported weights that workers and validators load."""

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        axes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in axes.items():
            require(
                size == -1 or size >= 1,
                (f"trainer.{name}",),
                f"trainer.{name} = {size}: a mesh axis size is a positive integer or -1 (fill)",
            )
        require(
            list(axes.values()).count(-1) <= 1,
            tuple(f"trainer.{a}" for a in axes),
            "at most one of trainer.data, trainer.fsdp, trainer.tensor may be -1 (fill)",
        )
        return self


class LossConfig(Section):
    """[loss]: the policy objective; `jax_trainer.loss` states the formulas."""

    policy_loss: PolicyLoss = "grpo"
    """Token objective: grpo (PPO clip + delta), dr_grpo (grpo with Dr. GRPO's aggregation, no std), gspo, cispo."""
    eps_low: float = Field(0.2, gt=0, lt=1)
    """Lower PPO clip: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = Field(0.2, gt=0)
    """Upper PPO clip: the ratio is clipped above at 1 + eps_high."""
    delta: float = 4.0
    """Two-sided clip: for negative advantages the ratio is also capped at delta (> 1 + eps_high)."""
    gspo_eps_low: float = Field(3e-4, gt=0, lt=1)
    """GSPO's lower clip of the sequence-level ratio (1 - gspo_eps_low; the GSPO paper's 3e-4)."""
    gspo_eps_high: float = Field(4e-4, gt=0)
    """GSPO's upper clip of the sequence-level ratio (1 + gspo_eps_high; the GSPO paper's 4e-4)."""
    cispo_eps_high: float = Field(0.28, gt=0)
    """CISPO's cap on the stop-gradient importance weight: min(ratio, 1 + cispo_eps_high) (no lower bound)."""
    aggregation: Aggregation = "token_mean"
    """Token losses -> one number: token mean, mean of sample means, sum / constant, or Dr. GRPO's sample sums."""
    constant_normalizer: int = Field(32768, gt=0)
    """C: the token budget of aggregation "constant"; the max completion length of "seq_mean_token_sum_norm"."""
    std_normalize: bool = True
    """Divide group advantages by the group's reward std (False: mean-centring only, as in Dr. GRPO)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference policy (0: no reference model is kept)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus."""
    tis_cap: float | None = Field(None, gt=0)
    """Truncated importance sampling: cap on pi_learner / pi_inference per token (None: off)."""
    mismatch: Mismatch = "none"
    """Drop tokens (token_mask) or whole samples (seq_mask, geo_mask) whose learner/engine ratio leaves the bounds."""
    mismatch_low: float | None = Field(None, gt=0)
    """Lower bound of the mismatch ratio (None: 0.5 for token_mask and seq_mask, 0.99 for geo_mask)."""
    mismatch_high: float | None = Field(None, gt=0)
    """Upper bound of the mismatch ratio (None: 2.0 for token_mask and seq_mask, 1.01 for geo_mask)."""
    temperature: float = Field(0.6, gt=0)
    """Temperature the learner divides logits by; must equal worker.temperature."""
    logprob_source: Literal["recompute", "inference", "validator"] = "recompute"
    """pi_old: the learner's ("recompute"), the worker's claim ("inference": trusted workers) or the validator's."""
    near_tie_samples: Literal["drop", "train"] = "drop"
    """Samples whose replay took a near tie (a worker could have chosen it; verdicts name them): "drop" or "train"."""

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        require(
            self.delta > 1 + self.eps_high,
            ("loss.delta", "loss.eps_high"),
            f"loss.delta ({self.delta}) must exceed 1 + loss.eps_high ({1 + self.eps_high})",
        )
        if self.policy_loss == "dr_grpo":
            # the Dr. GRPO preset: fill in its aggregation and advantages, refuse values that contradict them
            for key, value in (("aggregation", "seq_mean_token_sum_norm"), ("std_normalize", False)):
                require(
                    key not in self.model_fields_set or getattr(self, key) == value,
                    ("loss.policy_loss", f"loss.{key}"),
                    f'loss.policy_loss = "dr_grpo" means loss.{key} = {value!r}, not {getattr(self, key)!r}',
                )
                object.__setattr__(self, key, value)
        if self.mismatch != "none":
            low, high = self.mismatch_bounds()
            require(
                low < 1.0 < high,
                ("loss.mismatch_low", "loss.mismatch_high"),
                f"loss.mismatch_low ({low}) must be below 1 and loss.mismatch_high ({high}) above it",
            )
        return self

    def mismatch_bounds(self) -> tuple[float, float]:
        """[low, high] of `mismatch`: the configured bounds, or the mode's defaults (`MISMATCH_BOUNDS`)."""
        low, high = MISMATCH_BOUNDS.get(self.mismatch, (0.0, math.inf))
        return (
            low if self.mismatch_low is None else self.mismatch_low,
            high if self.mismatch_high is None else self.mismatch_high,
        )


class OptimConfig(Section):
    """[optim]: AdamW and its learning-rate schedule."""

    lr: float = Field(3e-7, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decoupled weight decay."""
    b1: float = Field(0.9, ge=0, lt=1)
    """AdamW first-moment decay."""
    b2: float = Field(0.99, ge=0, lt=1)
    """AdamW second-moment decay."""
    eps: float = Field(1e-8, gt=0)
    """AdamW denominator epsilon."""
    grad_clip: float = Field(0.1, gt=0)
    """Clip the global gradient norm to this value."""
    warmup_steps: int = Field(25, ge=0)
    """Steps of linear warmup from 0 to lr."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after warmup: constant, linear decay to 0, or cosine decay to 0."""
