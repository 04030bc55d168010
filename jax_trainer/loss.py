"""The policy loss: token logprobs in chunks, the GRPO / GSPO / CISPO objectives, mismatch corrections, aggregation.

Notation, per sampled token t of sample i with advantage A_i (the loss mask: a single-turn sample's completion
tokens; a multi-turn episode's model turns only, never its prompt or the environment's tokens between turns, which
are context the policy did not choose: docs/learner.md, "Multi-turn episodes"): lp_t = log pi_theta(t) (the learner,
at `loss.temperature`), old_t = log pi_old(t) (the learner's own logprob at the start of the step, INTELLECT-2, or
the engine's: `logprob_source`), inf_t = the engine's logprob of the sampled token, on the full distribution at the
sampling temperature, and r_t = exp(lp_t - old_t). Which engine: in a pool (`trainer.accepted_from =
"orchestrator"`) the validator's recomputation (`bridge.validator_logprobs`), which no worker can move, unless
`logprob_source = "inference"` trusts the worker's claim; in a single-box run (`"store"`) the worker's, its
`full_logprobs` where it recorded them (vLLM's processed logprobs are renormalised over the top-p nucleus, so a
ratio against them would be biased by the kept mass; see docs/rollouts.md).

Token objective, `loss.policy_loss`:

    grpo, dr_grpo   pg_t = -min(A * (min(r_t, delta) if A < 0 else r_t),    PPO clip with separate low/high
                                A * clip(r_t, 1 - eps_low, 1 + eps_high))   eps (DAPO); INTELLECT-2's two-
                                                                             sided clip delta for A < 0
    gspo            s_i  = exp(mean_{t in i} (lp_t - old_t))                 sequence-level ratio (GSPO): the
                    pg_t = -min(A * s_i, A * clip(s_i, 1 - gspo_eps_low,     geometric mean of the token ratios,
                                                1 + gspo_eps_high))          clipped per sample; every token of
                                                                             i carries it, its gradient flows
                                                                             through all of i's tokens
    cispo           pg_t = -sg(min(r_t, 1 + cispo_eps_high)) * A * lp_t      MiniMax-M1: a clipped, stop-gradient
                                                                             IS weight times the logprob, so no
                                                                             token's gradient is clipped away

`dr_grpo` is the grpo objective with Dr. GRPO's aggregation (`seq_mean_token_sum_norm`) and advantages that
are mean-centred only (`std_normalize = false`); `LossConfig` sets both and refuses contradicting values.

Train/inference mismatch (pi_old against the engine, m_t = old_t - inf_t, no gradient):

    tis_cap      pg_t *= min(exp(m_t), tis_cap)                  truncated importance sampling (token level)
    mismatch:
      token_mask   drop token t       unless exp(m_t)                   in [low, high]
      seq_mask     drop all of i      unless exp(sum_{t in i} m_t)      in [low, high]   (sequence-level MIS)
      geo_mask     drop all of i      unless exp(mean_{t in i} m_t)     in [low, high]   (geometric-mean rejection)

`low`/`high` are `mismatch_low`/`mismatch_high`. A dropped token leaves the loss entirely (its policy term,
KL and entropy terms) and every denominator below: it is as if it had never been sampled. `tis_cap` may be
combined with a mask. With `logprob_source = "inference"` or `"validator"`, pi_old is the engine's logprob,
m_t = 0 and nothing is ever dropped or reweighted.

Each token's loss is l_t = pg_t + kl_coef * k3_t - entropy_coef * H_t, with k3 = exp(ref - lp) - (ref - lp) - 1
(Schulman's unbiased, positive KL estimator; its gradient flows). The batch loss is sum_t w_t * l_t / D over
the optimizer step's kept tokens (the loss mask, i.e. the sampled tokens, times the mismatch mask), with n_i =
the kept sampled tokens of sample i (an episode's model turns together, its environment tokens never counted),
N = the samples with at least one kept token, and `aggregation`:

    token_mean                 w_t = 1              D = kept tokens        every token counts the same (DAPO)
    seq_mean_token_mean        w_t = 1 / n_i        D = N                  mean per sample, then over samples
                                                                            (the original GRPO; biased to short)
    constant                   w_t = 1 / C          D = 1                  sum over a fixed token budget C
    seq_mean_token_sum_norm    w_t = 1 / C          D = N                  each sample's token sum over the
                                                                            constant max length C, mean over
                                                                            samples (Dr. GRPO: no length bias)

C is `constant_normalizer`. Every statistic is over sampled tokens alone: the importance ratios, the mismatch
masks (token_mask per sampled token; seq_mask's sum and geo_mask's mean over the sample's sampled tokens), the
GSPO sequence ratio (the geometric mean over kept sampled tokens), the KL and entropy terms and their metrics.
D depends on the whole step's masks, so `policy_loss` returns the numerator of one
micro-batch with the counts D is made of, and `loss_denominator` turns the step's summed counts into D (the
train step divides the accumulated loss and gradients by it; `batch_loss` does both for one micro-batch).
Logprobs come from `token_logprobs`, which applies the LM head chunk by chunk along the sequence with a
hand-written backward pass that recomputes each chunk's logits, so [batch, seq, vocab] float32 logits never
exist, not in the forward and not in the backward.
"""

from __future__ import annotations

import math

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


def sample_sums(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """[rows, seq] -> [rows, seq]: at each token, the sum of `x` over the token's own sample.

    A sample is a (row, segment id) pair of a packed batch (`jax_trainer.packing`); row by row, so the rows
    stay split over the mesh like the batch.
    """
    seq = x.shape[-1]

    def row(values, ids):
        return jax.ops.segment_sum(values, ids, num_segments=seq + 1)[ids]

    return jax.vmap(row)(x, segment_ids)


def mismatch_keep(
    old_logprobs: jax.Array, inference_logprobs: jax.Array, mask: jax.Array, segment_ids: jax.Array, config: LossConfig
) -> jax.Array:
    """1.0 where the token stays in the loss, 0.0 where `config.mismatch` drops it (module docstring)."""
    mode = config.mismatch
    if mode == "none":
        return jnp.ones_like(mask)
    low, high = config.mismatch_bounds()
    m = jax.lax.stop_gradient(old_logprobs - inference_logprobs) * mask
    if mode == "token_mask":
        stat = m
    elif mode == "seq_mask":
        stat = sample_sums(m, segment_ids)
    elif mode == "geo_mask":
        stat = sample_sums(m, segment_ids) / jnp.maximum(sample_sums(mask, segment_ids), 1.0)
    else:
        raise ValueError(f"loss.mismatch {mode!r} is not one of none, token_mask, seq_mask, geo_mask")
    return ((stat >= math.log(low)) & (stat <= math.log(high))).astype(mask.dtype)


def loss_denominator(config: LossConfig, sums: dict[str, jax.Array]) -> jax.Array:
    """D of the module docstring from the step's summed `norm_tokens` (kept tokens) and `norm_samples` (N)."""
    if config.aggregation == "token_mean":
        return jnp.maximum(sums["norm_tokens"], 1.0)
    if config.aggregation in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        return jnp.maximum(sums["norm_samples"], 1.0)
    if config.aggregation == "constant":
        return jnp.ones((), jnp.float32)
    raise _unknown_aggregation(config)


def _unknown_aggregation(config: LossConfig) -> ValueError:
    return ValueError(
        f"loss.aggregation {config.aggregation!r} is not one of token_mean, seq_mean_token_mean, constant, "
        "seq_mean_token_sum_norm"
    )


def _token_weights(kept: jax.Array, kept_lens: jax.Array, config: LossConfig) -> jax.Array:
    """w_t of the module docstring, times the kept-token mask."""
    if config.aggregation == "token_mean":
        return kept
    if config.aggregation == "seq_mean_token_mean":
        return kept / jnp.maximum(kept_lens, 1.0)
    if config.aggregation in ("constant", "seq_mean_token_sum_norm"):
        return kept / config.constant_normalizer
    raise _unknown_aggregation(config)


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array,
    config: LossConfig,
    *,
    inference_logprobs: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
):
    """(numerator, sums): sum_t w_t * l_t of one micro-batch and token-summed statistics.

    All arrays are [rows, seq] and aligned (token t's logprob, advantage, loss mask, segment id). The loss is
    the numerator summed over the step's micro-batches divided by `loss_denominator(config, summed sums)`.
    `sums` holds plain sums (divide by `sums["tokens"]` for means), so micro-batches add up exactly;
    `norm_tokens` and `norm_samples` are the kept tokens and samples the denominator is made of.
    """
    needs_inference = config.tis_cap is not None or config.mismatch != "none"
    if needs_inference and inference_logprobs is None:
        raise ValueError(
            f"loss.tis_cap = {config.tis_cap} / loss.mismatch = {config.mismatch!r} need the engine's logprobs, "
            "but no inference logprobs were given"
        )
    old = jax.lax.stop_gradient(old_logprobs)
    ratio = jnp.exp(logprobs - old)
    keep = mask
    if inference_logprobs is not None:
        keep = mask * mismatch_keep(old, inference_logprobs, mask, segment_ids, config)
    kept_lens = sample_sums(keep, segment_ids)
    neg, pos = advantages < 0, advantages > 0
    kind = config.policy_loss
    never = jnp.zeros(mask.shape, bool)
    if kind in ("grpo", "dr_grpo"):
        surr1 = advantages * jnp.where(neg, jnp.minimum(ratio, config.delta), ratio)
        surr2 = advantages * jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
        per_token = -jnp.minimum(surr1, surr2)
        clip_low, clip_high = neg & (ratio < 1.0 - config.eps_low), pos & (ratio > 1.0 + config.eps_high)
        clip_delta = neg & (ratio > config.delta)
    elif kind == "gspo":
        seq_ratio = jnp.exp(sample_sums(keep * (logprobs - old), segment_ids) / jnp.maximum(kept_lens, 1.0))
        low, high = 1.0 - config.gspo_eps_low, 1.0 + config.gspo_eps_high
        per_token = -jnp.minimum(advantages * seq_ratio, advantages * jnp.clip(seq_ratio, low, high))
        clip_low, clip_high, clip_delta = neg & (seq_ratio < low), pos & (seq_ratio > high), never
    elif kind == "cispo":
        cap = 1.0 + config.cispo_eps_high
        per_token = -jax.lax.stop_gradient(jnp.minimum(ratio, cap)) * advantages * logprobs
        clip_low, clip_high, clip_delta = never, ratio > cap, never
    else:
        raise ValueError(f"loss.policy_loss {kind!r} is not one of grpo, dr_grpo, gspo, cispo")
    if config.tis_cap is not None:
        per_token = per_token * jax.lax.stop_gradient(jnp.minimum(jnp.exp(old - inference_logprobs), config.tis_cap))
    weights = _token_weights(keep, kept_lens, config)
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

    masked_ratio = jnp.where(mask > 0, ratio, 0.0)
    sums = {
        "tokens": jnp.sum(mask),
        "norm_tokens": jnp.sum(keep),
        "norm_samples": jnp.sum(keep / jnp.maximum(kept_lens, 1.0)),
        "pg_loss": pg,
        "kl_ref_sum": kl_sum,
        "entropy_sum": ent_sum,
        "clip_low_sum": jnp.sum(mask * clip_low),
        "clip_high_sum": jnp.sum(mask * clip_high),
        "clip_delta_sum": jnp.sum(mask * clip_delta),
        "ratio_sum": jnp.sum(masked_ratio),
        "ratio_max": jnp.max(masked_ratio),
    }
    if inference_logprobs is not None:
        # k3 estimate of KL(inference || trainer) on the engine's own samples: the trainer/engine mismatch
        d = jax.lax.stop_gradient(old - inference_logprobs)
        sums["mismatch_kl_sum"] = jnp.sum(mask * (jnp.exp(d) - d - 1.0))
    if config.mismatch != "none":
        dropped = mask - keep
        sums["samples"] = jnp.sum(mask / jnp.maximum(sample_sums(mask, segment_ids), 1.0))
        sums["mismatch_masked_tokens"] = jnp.sum(dropped)
        sums["mismatch_masked_samples"] = jnp.sum(dropped / jnp.maximum(sample_sums(mask, segment_ids), 1.0))
    return total, sums


def batch_loss(*args, **kwargs):
    """(loss, sums) of `policy_loss` for a step made of this one micro-batch: the numerator divided by D."""
    numerator, sums = policy_loss(*args, **kwargs)
    config = args[5] if len(args) > 5 else kwargs["config"]
    return numerator / loss_denominator(config, sums), sums
