"""The GRPO policy loss: token logprobs in chunks, clipped importance ratios, corrections and aggregation.

Per completion token t of a sample with advantage A:

    r_t   = pi_theta(t) / pi_old(t)                      pi_old: the learner's own logprob at the start of the
                                                          step (INTELLECT-2) or the inference engine's
    surr1 = A * (min(r_t, delta) if A < 0 else r_t)      two-sided clipping (INTELLECT-2): for A < 0 the ratio
                                                          is capped at delta, so one token cannot blow up
    surr2 = A * clip(r_t, 1 - eps_low, 1 + eps_high)     PPO clipping, separate low/high eps (DAPO clip-higher)
    pg_t  = -min(surr1, surr2) * w_tis                   w_tis = min(pi_old / pi_infer, C), no gradient:
                                                          truncated importance sampling against the engine
    l_t   = pg_t + kl_coef * k3_t - entropy_coef * H_t   k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman's
                                                          unbiased, positive KL estimator); its gradient flows

The batch loss is sum_t weight_t * l_t; `aggregation` names the weights (see `token_weights`).
Logprobs come from `token_logprobs`, which applies the LM head chunk by chunk along the sequence with a
hand-written backward pass that recomputes each chunk's logits, so [batch, seq, vocab] float32 logits never
exist, not in the forward and not in the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_trainer.config import LossConfig
from jax_trainer.kernels import sampled_logprobs


def token_logprobs(
    hidden: jax.Array, head: jax.Array, targets: jax.Array, temperature: float = 1.0, chunk: int = 128
) -> tuple[jax.Array, jax.Array]:
    """log pi(targets[b, t] | hidden[b, t]) and the entropy at each position, both [batch, seq] float32.

    The sequence is processed `chunk` positions at a time (`jax_trainer.kernels.sampled_logprobs`): the
    backward pass recomputes each chunk's logits instead of keeping [batch, seq, vocab] alive.
    """
    b, s, h = hidden.shape
    chunk = min(chunk, s)
    pad = -s % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    n = (s + pad) // chunk
    hs = hidden.reshape(b, n, chunk, h).swapaxes(0, 1)
    ts = targets.reshape(b, n, chunk).swapaxes(0, 1)
    lp, ent = sampled_logprobs(hs, head, ts, temperature)
    lp = lp.swapaxes(0, 1).reshape(b, n * chunk)[:, :s]
    ent = ent.swapaxes(0, 1).reshape(b, n * chunk)[:, :s]
    return lp, ent


def token_weights(
    mask: jax.Array, completion_lens: jax.Array, config: LossConfig, total_tokens: jax.Array, total_samples: jax.Array
) -> jax.Array:
    """Per-token weights of the loss sum; the normaliser of each mode:

    - token_mean:          1 / (completion tokens in the optimizer step's whole batch): every token counts
                           the same, long samples weigh more (DAPO's token-level loss).
    - seq_mean_token_mean: 1 / (samples in the step * the token's own completion length): mean over each
                           sample's tokens, then mean over samples (the original GRPO; biased to short).
    - constant:            1 / constant_normalizer, a fixed token budget (Dr. GRPO): no length bias at all.
    """
    if config.aggregation == "token_mean":
        return mask / jnp.maximum(total_tokens, 1.0)
    if config.aggregation == "seq_mean_token_mean":
        return mask / (jnp.maximum(completion_lens, 1.0) * jnp.maximum(total_samples, 1.0))
    if config.aggregation == "constant":
        return mask / config.constant_normalizer
    raise ValueError(f"loss.aggregation {config.aggregation!r} is not one of token_mean, seq_mean_token_mean, constant")


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    mask: jax.Array,
    config: LossConfig,
    *,
    inference_logprobs: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
):
    """(loss, sums): the weighted loss of one micro-batch and token-summed statistics for the metrics.

    All arrays are [batch, seq] and aligned (token t's logprob, advantage, weight). `sums` holds plain sums
    over completion tokens (divide by `sums["tokens"]` for means), so micro-batches add up exactly.
    """
    old = jax.lax.stop_gradient(old_logprobs)
    log_ratio = logprobs - old
    ratio = jnp.exp(log_ratio)
    neg = advantages < 0
    surr1 = advantages * jnp.where(neg, jnp.minimum(ratio, config.delta), ratio)
    surr2 = advantages * jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    per_token = -jnp.minimum(surr1, surr2)
    if config.tis_cap is not None:
        if inference_logprobs is None:
            raise ValueError("loss.tis_cap is set but no inference logprobs were given")
        per_token = per_token * jax.lax.stop_gradient(jnp.minimum(jnp.exp(old - inference_logprobs), config.tis_cap))
    pg = jnp.sum(weights * per_token)
    total = pg
    kl_sum = jnp.zeros((), jnp.float32)
    if config.kl_coef:
        if ref_logprobs is None:
            raise ValueError("loss.kl_coef > 0 but no reference logprobs were given")
        d = jax.lax.stop_gradient(ref_logprobs) - logprobs
        k3 = jnp.exp(d) - d - 1.0
        total = total + config.kl_coef * jnp.sum(weights * k3)
        kl_sum = jnp.sum(mask * k3)
    ent_sum = jnp.zeros((), jnp.float32)
    if entropy is not None:
        ent_sum = jnp.sum(mask * jax.lax.stop_gradient(entropy))
        if config.entropy_coef:
            total = total - config.entropy_coef * jnp.sum(weights * entropy)

    pos = advantages > 0
    masked_ratio = jnp.where(mask > 0, ratio, 0.0)
    sums = {
        "tokens": jnp.sum(mask),
        "pg_loss": pg,
        "kl_ref_sum": kl_sum,
        "entropy_sum": ent_sum,
        "clip_low_sum": jnp.sum(mask * (neg & (ratio < 1.0 - config.eps_low))),
        "clip_high_sum": jnp.sum(mask * (pos & (ratio > 1.0 + config.eps_high))),
        "clip_delta_sum": jnp.sum(mask * (neg & (ratio > config.delta))),
        "ratio_sum": jnp.sum(masked_ratio),
        "ratio_max": jnp.max(masked_ratio),
    }
    if inference_logprobs is not None:
        # k3 estimate of KL(inference || trainer) on the engine's own samples: the trainer/engine mismatch
        d = jax.lax.stop_gradient(old - inference_logprobs)
        sums["mismatch_kl_sum"] = jnp.sum(mask * (jnp.exp(d) - d - 1.0))
    return total, sums
