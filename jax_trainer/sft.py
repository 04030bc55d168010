"""Supervised fine-tuning: next-token cross-entropy on completion tokens, the warm start before RL.

An example is a prompt and the completion the model should write after it (answer text and stop token).
Examples are packed exactly like rollouts (`jax_trainer.packing`): several per row, segment ids keeping
attention inside each example, `loss_mask` = 1 on completion tokens only, so prompt tokens are never a
target (a multi-turn demonstration narrows it to its trained model turns: `sft_samples`). The loss of one
optimizer step is

    L = - sum_t mask_t * log pi(token_t | tokens_<t) / sum_t mask_t

over every completion token of every micro-batch of the step (a token mean: each completion token counts the
same). Gradients are accumulated over the micro-batches (`lax.scan`), clipped by global norm and applied with
the learner's AdamW (`jax_trainer.optim`); a non-finite loss or gradient skips the update, as in the GRPO step.

`SFTTrainer` reuses the GRPO trainer's state, shardings, checkpoint template and jitting; only the step
function differs. `sft_loop` runs steps over a batch iterator, appends one JSON line per step to a
metrics file (`"role": "sft"`: loss, token accuracy, tokens/s) and shows a rich progress line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.loss import token_logprobs
from jax_trainer.packing import PackedBatch, Sample, pack
from jax_trainer.train_step import GRPOTrainer, TrainState


def sft_samples(examples: Sequence[Sequence[Sequence[int]]], names: Sequence[str] | None = None) -> list[Sample]:
    """(prompt ids, completion ids) pairs -> packing samples (no logprobs, no advantage). An example may carry a
    third element, a 0/1 mask over its completion tokens (a multi-turn demonstration: 1 on the model turns to
    train on, 0 on environment turns and context); without one every completion token is a target."""
    out = []
    for i, example in enumerate(examples):
        prompt, completion = example[0], example[1]
        tokens = np.asarray(list(prompt) + list(completion), np.int32)
        sampled = None
        if len(example) > 2:
            mask = np.asarray(example[2], np.uint8)
            if len(mask) != len(completion):
                raise ValueError(f"example {i}: {len(completion)} completion tokens but {len(mask)} mask values")
            sampled = np.concatenate([np.zeros(len(prompt), np.uint8), mask])
        out.append(
            Sample(
                tokens=tokens,
                prompt_len=len(prompt),
                logprobs=np.zeros(len(tokens), np.float32),
                advantage=0.0,
                version=0,
                name=names[i] if names else f"example {i}",
                sampled=sampled,
            )
        )
    return out


def pack_examples(
    examples: Sequence[Sequence[Sequence[int]]], rows: int, seq_len: int, micro_batches: int | None = None
) -> PackedBatch:
    """Pack examples (`sft_samples`) into [micro_batches, rows, seq_len]; a fixed `micro_batches` keeps one
    compiled shape."""
    return pack(sft_samples(examples), rows, seq_len, micro_batches=micro_batches)


def _argmax_hits(hidden: jax.Array, head: jax.Array, targets: jax.Array, chunk: int) -> jax.Array:
    """1.0 where argmax of the logits equals the target, [batch, seq]; the LM head runs `chunk` positions at a
    time so that [batch, seq, vocab] logits never exist at once."""
    b, s, h = hidden.shape
    chunk = min(chunk, s)
    pad = -s % chunk
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    n = (s + pad) // chunk
    hs = hidden.reshape(b, n, chunk, h).swapaxes(0, 1)
    ts = targets.reshape(b, n, chunk).swapaxes(0, 1)

    def one(xs):
        hc, tc = xs
        logits = jnp.einsum("bch,hv->bcv", hc, head.astype(hc.dtype), preferred_element_type=jnp.float32)
        return (jnp.argmax(logits, axis=-1) == tc).astype(jnp.float32)

    hits = jax.lax.map(one, (hs, ts))
    return hits.swapaxes(0, 1).reshape(b, n * chunk)[:, :s]


class SFTTrainer(GRPOTrainer):
    """The GRPO trainer's state and plumbing with a cross-entropy step (see the module docstring)."""

    def __init__(self, model: nnx.Module, mesh: Mesh, optim: OptimConfig, trainer: TrainerConfig | None = None):
        """Of `trainer` the step reads `logprob_chunk` and `steps` (the schedule's length); one optimizer step
        per batch, logits at temperature 1."""
        trainer = (trainer if trainer is not None else TrainerConfig()).model_copy(update={"steps_per_batch": 1})
        super().__init__(model, mesh, LossConfig(temperature=1.0), optim, trainer)
        self._eval = None

    def _micro_sums(self, params, mb: dict[str, jax.Array]):
        """(sum of token NLL, sum of argmax hits, completion tokens) of one micro-batch."""
        model = nnx.merge(self.graphdef, params)
        hidden = model.hidden_states(mb["tokens"], mb["positions"], mb["segment_ids"])[:, :-1]
        targets, mask = mb["tokens"][:, 1:], mb["loss_mask"][:, 1:]
        lp, _ = token_logprobs(hidden, model.head(), targets, 1.0, self.config.logprob_chunk)
        hits = _argmax_hits(
            jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(model.head()), targets, self.config.logprob_chunk
        )
        return -jnp.sum(mask * lp), jnp.sum(mask * hits), jnp.sum(mask)

    def _step_fn(self, state: TrainState, batch: dict[str, jax.Array], ref_params):
        total = jnp.maximum(jnp.sum(batch["loss_mask"][..., 1:]), 1.0)  # the normaliser: completion tokens

        def micro_loss(params, mb):
            nll, hits, tokens = self._micro_sums(params, mb)
            return nll / total, (hits, tokens)

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def accumulate(acc, mb):
            (loss, (hits, tokens)), grads = grad_fn(state.params, mb)
            a_loss, a_hits, a_grads = acc
            return (a_loss + loss, a_hits + hits, jax.tree.map(jnp.add, a_grads, grads)), None

        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
        (loss, hits, grads), _ = jax.lax.scan(accumulate, init, batch)
        grad_norm = optax.global_norm(grads)
        scale = jnp.minimum(1.0, self.optim.grad_clip / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda x: x * scale.astype(x.dtype), grads)
        updates, new_opt = self.tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_params, state.params)
        opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_opt, state.opt_state)
        metrics = {
            "loss": loss,
            "accuracy": hits / total,
            "tokens": total,
            "grad_norm": grad_norm,
            "skipped": (~ok).astype(jnp.int32),
        }
        new_state = TrainState(
            params=params, opt_state=opt_state, step=state.step + 1, skipped=state.skipped + (~ok).astype(jnp.int32)
        )
        return new_state, metrics

    def evaluate(self, params, batch: dict[str, jax.Array]) -> dict[str, float]:
        """Loss and token accuracy of a batch under `params`, without updating anything."""
        if self._eval is None:

            def fn(params, batch):
                sums = jax.lax.map(lambda mb: self._micro_sums(params, mb), batch)
                nll, hits, tokens = (jnp.sum(x) for x in sums)
                total = jnp.maximum(tokens, 1.0)
                return {"loss": nll / total, "accuracy": hits / total, "tokens": tokens}

            self._eval = jax.jit(fn)
        return {k: float(v) for k, v in self._eval(params, batch).items()}


def sft_loop(
    trainer: SFTTrainer,
    state: TrainState,
    batches: Iterator[PackedBatch],
    steps: int,
    *,
    metrics_path: str | Path | None = None,
    progress: bool = True,
    on_step: Callable[[int, dict], None] | None = None,
) -> TrainState:
    """Run `steps` SFT steps on `batches`; one `"role": "sft"` JSON line per step goes to `metrics_path`."""
    bar = _Progress(progress, steps)
    with bar:
        for _ in range(steps):
            packed = next(batches)
            t0 = time.perf_counter()
            state, metrics = trainer.step(state, trainer.device_batch(packed))
            record = {k: float(v) for k, v in metrics.items()}
            elapsed = time.perf_counter() - t0
            step = int(np.asarray(state.step.addressable_data(0)))
            record = {
                "role": "sft",
                "step": step,
                "time": time.time(),
                **record,
                "step_s": elapsed,
                "tokens_per_s": float(np.sum(packed.segment_ids > 0)) / max(elapsed, 1e-9),
            }
            if metrics_path is not None and jax.process_index() == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            bar.update(step, record)
            if on_step is not None:
                on_step(step, record)
    return state


class _Progress:
    """A rich progress line on a terminal (nothing otherwise): step, loss, token accuracy, tokens/s."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled and jax.process_index() == 0, total

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("sft"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.description}"),
                TimeRemainingColumn(),
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.total)
        return self

    def update(self, step: int, r: dict) -> None:
        if self.enabled:
            self.bar.update(
                self.task,
                completed=step,
                description=(f"loss {r['loss']:.4f} acc {r['accuracy']:.3f} {r['tokens_per_s']:.0f} tok/s"),
            )

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
