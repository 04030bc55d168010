"""The jitted GRPO step: one pure function `(state, batch) -> (state, metrics)`.

`batch` holds the `PackedBatch` arrays, shape [micro_batches, rows, seq_len] (see `jax_trainer/packing.py`).
Inside one compiled function:

1. pi_old: the learner's logprobs of the batch under the current parameters, computed once before any update
   (INTELLECT-2: with several optimizer steps per batch, the ratio then measures how far those steps moved),
   or the batch's engine logprobs (`logprob_source = "inference"`: the worker's claim; "validator": the
   validator's recomputation, which the pipeline packs in their place), which saves a forward pass.
   Reference-policy logprobs the same way when `kl_coef > 0`.
2. The micro-batches are split into `steps_per_batch` equal groups (INTELLECT-2's `step_per_rollout`); for each
   group, the loss numerator and its gradients are accumulated over its micro-batches (`lax.scan`), divided
   by the group's denominator (kept tokens or samples: `jax_trainer.loss`), clipped by global norm, and AdamW
   applies them. A non-finite loss or gradient norm skips that update (parameters and optimizer state stay as
   they were) and is counted in `state.skipped`; nothing non-finite is ever written into the weights.

Shardings: parameters and optimizer state keep the layout of the logical-axis rules; the batch is split
over `data` x `fsdp` along its rows. The state is donated, so the step updates it in place.

A model with LoRA adapters (`Decoder(lora=...)`) trains the adapters alone: the state's parameters and the
optimizer's moments are the adapters', the frozen base is a separate, undonated argument of the step (no
gradient is taken for it), and the KL reference (`kl_coef > 0`) is the base itself (the adapters at zero).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.loss import loss_denominator, policy_loss, token_logprobs
from jax_trainer.optim import make_optimizer
from jax_trainer.packing import PackedBatch
from jax_trainer.sharding import logical_to_spec, param_shardings

BATCH_KEYS = PackedBatch.ARRAYS
log = logging.getLogger("jax_trainer.train_step")


@struct.dataclass
class TrainState:
    params: Any  # nnx.State of the model's parameters
    opt_state: Any
    step: jax.Array  # optimizer steps applied (= the policy version these parameters are)
    skipped: jax.Array  # updates skipped because the loss or the gradient was not finite


def _shift(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Align with next-token prediction: logits at t score token t+1."""
    return {
        "targets": batch["tokens"][..., 1:],
        "mask": batch["loss_mask"][..., 1:],
        "advantages": batch["advantages"][..., 1:],
        "inference_logprobs": batch["inference_logprobs"][..., 1:],
        "segment_ids": batch["segment_ids"][..., 1:],
    }


class GRPOTrainer:
    """Builds the optimizer, the (abstract) initial state and the jitted step for one model and mesh."""

    def __init__(
        self,
        model: nnx.Module,
        mesh: Mesh,
        loss: LossConfig,
        optim: OptimConfig,
        trainer: TrainerConfig | None = None,
        reference: nnx.Module | None = None,
    ):
        """`model` may be abstract (`nnx.eval_shape`) when the state will come from a checkpoint. Of `trainer`
        (default: its defaults) the step reads `steps_per_batch`, `logprob_chunk` and `steps` (the length of
        the learning-rate schedule)."""
        self.mesh = mesh
        self.loss = loss
        self.optim = optim
        self.config = trainer if trainer is not None else TrainerConfig()
        self.tx = make_optimizer(optim, self.config.steps)
        self.lora = getattr(model, "lora", None)
        self.frozen = self.frozen_shardings = None  # the base under LoRA adapters
        if self.lora is not None:
            self.graphdef, params, self.frozen = nnx.split(model, nnx.LoRAParam, ...)
            self.frozen_shardings = param_shardings(self.frozen, mesh)
            if reference is not None:
                raise ValueError("a LoRA model's KL reference is its own base; pass no reference model")
        else:
            self.graphdef, params = nnx.split(model)
        self.param_shardings = param_shardings(params, mesh)
        self._abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.ref_params = nnx.split(reference)[1] if reference is not None else None
        if loss.kl_coef and self.ref_params is None and self.lora is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model")
        self._compiled: dict[tuple[int, ...], Any] = {}  # batch shape -> compiled step
        self.plan = None  # the memory plan of the last compiled step (jax_trainer.plan)

    # ---- state -------------------------------------------------------------------------------------------
    def init_state(self, params) -> TrainState:
        """A fresh state (step 0, zero optimizer moments) around `params` (an nnx.State of arrays: with LoRA,
        the adapters, `trainable(model)`)."""
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_state_shardings())(params)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        step, skipped = (jax.device_put(jnp.zeros((), jnp.int32), replicated) for _ in range(2))
        return TrainState(params=params, opt_state=opt_state, step=step, skipped=skipped)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, without memory: the template a checkpoint restores into."""
        abstract_params = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            self._abstract_params,
            self.param_shardings,
        )
        opt = jax.eval_shape(self.tx.init, abstract_params)
        opt = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt, self.opt_state_shardings()
        )
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(self.mesh, PartitionSpec()))
        return TrainState(params=abstract_params, opt_state=opt, step=scalar, skipped=scalar)

    def model(self, params) -> nnx.Module:
        """The model holding `params` (e.g. `state.params`, to export or evaluate it), on the frozen base with LoRA."""
        return self._merge(params, self.frozen)

    def _merge(self, params, frozen) -> nnx.Module:
        return nnx.merge(self.graphdef, params) if frozen is None else nnx.merge(self.graphdef, params, frozen)

    def opt_state_shardings(self):
        replicated = NamedSharding(self.mesh, PartitionSpec())
        abstract = jax.eval_shape(self.tx.init, self._abstract_params)
        return optax.tree_map_params(
            self.tx, lambda _, s: s, abstract, self.param_shardings, transform_non_params=lambda _: replicated
        )

    def state_shardings(self, state: TrainState):
        return jax.tree.map(lambda x: x.sharding, state)

    def batch_sharding(self, shape) -> NamedSharding:
        return NamedSharding(self.mesh, logical_to_spec((None, "batch", "length"), shape, self.mesh))

    def device_batch(self, packed: PackedBatch) -> dict[str, jax.Array]:
        """Host arrays -> device arrays split over the batch axes (each process supplies what it owns)."""
        out = {}
        for k, v in packed.arrays().items():
            sharding = self.batch_sharding(v.shape)
            out[k] = jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        return out

    # ---- the step ----------------------------------------------------------------------------------------
    def _logprobs(self, params, mb: dict[str, jax.Array], frozen=None):
        model = self._merge(params, frozen)
        hidden = model.hidden_states(mb["tokens"], mb["positions"], mb["segment_ids"])[:, :-1]
        return token_logprobs(
            hidden, model.head(), mb["tokens"][:, 1:], self.loss.temperature, self.config.logprob_chunk
        )

    def _step_fn(self, state: TrainState, batch: dict[str, jax.Array], ref_params, frozen=None):
        loss_cfg, k = self.loss, self.config.steps_per_batch
        shifted = _shift(batch)
        m = batch["tokens"].shape[0]
        if m % k:
            raise ValueError(f"{m} micro-batches do not split into steps_per_batch={k} equal groups")
        if loss_cfg.logprob_source == "recompute" and k == 1:
            # one optimizer step per batch: pi_old is the policy the gradient is taken at, so each micro-batch's
            # own forward gives it (`micro_loss`); a separate forward pass would compute the same numbers again
            old = None
        elif loss_cfg.logprob_source == "recompute":
            old = jax.lax.map(lambda mb: jax.lax.stop_gradient(self._logprobs(state.params, mb, frozen)[0]), batch)
        else:
            old = shifted["inference_logprobs"]
        ref = None
        if loss_cfg.kl_coef and frozen is not None:  # LoRA: the reference is the base, the adapters at zero
            zeros = jax.tree.map(jnp.zeros_like, state.params)
            ref = jax.lax.map(lambda mb: jax.lax.stop_gradient(self._logprobs(zeros, mb, frozen)[0]), batch)
        elif loss_cfg.kl_coef:
            ref = jax.lax.map(lambda mb: jax.lax.stop_gradient(self._logprobs(ref_params, mb)[0]), batch)

        def group(x):
            return x.reshape((k, m // k) + x.shape[1:])

        groups = jax.tree.map(group, {"batch": batch, "shifted": shifted, "old": old, "ref": ref})

        def micro_loss(params, mb, sh, old_lp, ref_lp):
            # the numerator of the step's loss; the denominator needs every micro-batch's (mismatch) masks,
            # so the accumulated loss and gradients are divided by it after the scan (`jax_trainer.loss`)
            lp, ent = self._logprobs(params, mb, frozen)
            if old_lp is None:
                old_lp = jax.lax.stop_gradient(lp)
            return policy_loss(
                lp,
                old_lp,
                sh["advantages"],
                sh["mask"],
                sh["segment_ids"],
                loss_cfg,
                inference_logprobs=sh["inference_logprobs"],
                ref_logprobs=ref_lp,
                entropy=ent,
            )

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def optimizer_step(carry, g):
            params, opt_state, skipped = carry

            def accumulate(acc, xs):
                mb, sh, old_lp, ref_lp = xs
                (loss, sums), grads = grad_fn(params, mb, sh, old_lp, ref_lp)
                acc_loss, acc_sums, acc_grads = acc
                merged = {
                    key: (jnp.maximum if key == "ratio_max" else jnp.add)(acc_sums[key], v) for key, v in sums.items()
                }
                return (acc_loss + loss, merged, jax.tree.map(jnp.add, acc_grads, grads)), None

            first = jax.tree.map(lambda x: x[0], (g["batch"], g["shifted"], g["old"], g["ref"]))
            zero_sums = jax.eval_shape(lambda: grad_fn(params, *first)[0][1])
            init = (
                jnp.zeros((), jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_sums),
                jax.tree.map(jnp.zeros_like, params),
            )
            (loss, sums, grads), _ = jax.lax.scan(accumulate, init, (g["batch"], g["shifted"], g["old"], g["ref"]))
            denominator = loss_denominator(loss_cfg, sums)
            loss = loss / denominator
            sums = {**sums, "pg_loss": sums["pg_loss"] / denominator}
            # divided by the denominator and clipped in one pass over the gradients (||g / D|| = ||g|| / D): a
            # separate division was one more read and write of every gradient, and XLA:CPU's fused kernels
            # materialised the broadcast denominator at the size of the largest stacked parameter
            grad_norm = optax.global_norm(grads) / denominator
            scale = jnp.minimum(1.0, self.optim.grad_clip / (grad_norm + 1e-6))
            factor = scale / denominator
            grads = jax.tree.map(lambda x: x * factor.astype(x.dtype), grads)
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

            def apply(operand):
                p, o, g = operand
                updates, new_o = self.tx.update(g, o, p)
                return optax.apply_updates(p, updates), new_o

            # a step with a non-finite loss or gradient is skipped. A branch, not a `where` over old and new
            # values: with `where`, XLA keeps the old parameters and moments beside the new ones (1.2 GiB more
            # temporaries per device at the Qwen2.5-0.5B shape on 2 devices); the branch updates them in place
            params, opt_state = jax.lax.cond(ok, apply, lambda operand: operand[:2], (params, opt_state, grads))
            metrics = {
                "loss": loss,
                "grad_norm": grad_norm,
                "grad_norm_clipped": grad_norm * scale,
                "skipped": (~ok).astype(jnp.int32),
                **sums,
            }
            return (params, opt_state, skipped + (~ok).astype(jnp.int32)), metrics

        (params, opt_state, skipped), per_step = jax.lax.scan(
            optimizer_step, (state.params, state.opt_state, state.skipped), groups
        )
        metrics = _summarise(per_step)
        new_state = TrainState(params=params, opt_state=opt_state, step=state.step + k, skipped=skipped)
        return new_state, metrics

    def jitted_step(self, state, batch):
        """The jitted step for a state and batch (concrete arrays or `jax.ShapeDtypeStruct`s with shardings)."""
        shardings = self.state_shardings(state)
        batch_sh = {key: v.sharding for key, v in batch.items()}
        ref_sh = None if self.ref_params is None else jax.tree.map(lambda x: x.sharding, self.ref_params)
        frozen_sh = () if self.frozen is None else (self.frozen_shardings,)  # LoRA: the base, a 4th argument
        return jax.jit(
            self._step_fn,
            in_shardings=(shardings, batch_sh, ref_sh, *frozen_sh),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        )

    def abstract_frozen(self):
        """Shapes, dtypes and shardings of the frozen base under LoRA adapters (None without adapters)."""
        if self.frozen is None:
            return None
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), self.frozen, self.frozen_shardings
        )

    def lower(self, state, batch, ref_params=None, frozen=None):
        """The step lowered for `state` and `batch` (arrays or `ShapeDtypeStruct`s with shardings) under
        `jax.set_mesh(self.mesh)`: the activations' sharding constraints, splash attention's `shard_map` and every
        per-backend choice made while tracing (`jax_trainer.topology.platform`) follow the mesh's devices, which may
        be compile-only devices of another platform (`intellect plan --topology`). `frozen`: the LoRA base
        (default: the trainer's own)."""
        with jax.set_mesh(self.mesh):
            frozen = () if self.frozen is None else (self.frozen if frozen is None else frozen,)
            return self.jitted_step(state, batch).lower(state, batch, ref_params, *frozen)

    def abstract_batch(self, micro_batches: int, rows: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes, dtypes and shardings of a packed batch (`jax_trainer.packing`), without memory."""
        shape = (micro_batches, rows, seq_len)
        return {
            k: jax.ShapeDtypeStruct(
                shape,
                jnp.int32 if k in ("tokens", "positions", "segment_ids") else jnp.float32,
                sharding=self.batch_sharding(shape),
            )
            for k in BATCH_KEYS
        }

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        """One step; the first of each batch shape compiles it ahead of time and logs its memory plan."""
        shape = batch["tokens"].shape
        compiled = self._compiled.get(shape)
        if compiled is None:
            from jax_trainer.plan import plan_of

            compiled = self.lower(state, batch, self.ref_params).compile()
            self._compiled[shape] = compiled
            self.plan = plan_of(compiled, self.mesh, state, batch, self.frozen)
            for line in self.plan.lines():
                log.info("%s", line)
        return compiled(state, batch, self.ref_params, *(() if self.frozen is None else (self.frozen,)))


def trainable(model: nnx.Module):
    """The parameters `GRPOTrainer` trains of `model`: its LoRA adapters when it has them, else all of them."""
    if getattr(model, "lora", None) is not None:
        return nnx.state(model, nnx.LoRAParam)
    return nnx.split(model)[1]


def _summarise(per_step: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-optimizer-step sums -> batch-level metrics (means over completion tokens, last grad norm...)."""
    tokens = jnp.maximum(jnp.sum(per_step["tokens"]), 1.0)
    out = {
        "loss": jnp.mean(per_step["loss"]),
        "pg_loss": jnp.mean(per_step["pg_loss"]),
        "grad_norm": per_step["grad_norm"][-1],
        "grad_norm_clipped": per_step["grad_norm_clipped"][-1],
        "skipped": jnp.sum(per_step["skipped"]),
        "tokens": jnp.sum(per_step["tokens"]),
        "entropy": jnp.sum(per_step["entropy_sum"]) / tokens,
        "kl_ref": jnp.sum(per_step["kl_ref_sum"]) / tokens,
        "clip_low_frac": jnp.sum(per_step["clip_low_sum"]) / tokens,
        "clip_high_frac": jnp.sum(per_step["clip_high_sum"]) / tokens,
        "clip_delta_frac": jnp.sum(per_step["clip_delta_sum"]) / tokens,
        "ratio_mean": jnp.sum(per_step["ratio_sum"]) / tokens,
        "ratio_max": jnp.max(per_step["ratio_max"]),
    }
    if "mismatch_kl_sum" in per_step:
        out["mismatch_kl"] = jnp.sum(per_step["mismatch_kl_sum"]) / tokens
    if "mismatch_masked_tokens" in per_step:  # loss.mismatch: the share of tokens and samples it dropped
        out["mismatch_masked_frac"] = jnp.sum(per_step["mismatch_masked_tokens"]) / tokens
        samples = jnp.maximum(jnp.sum(per_step["samples"]), 1.0)
        out["mismatch_masked_sample_frac"] = jnp.sum(per_step["mismatch_masked_samples"]) / samples
    return out
