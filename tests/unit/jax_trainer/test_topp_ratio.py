"""The top-p bias of importance ratios, and its correction by the rollout batch's `full_logprobs`.

A numpy model of the worker's sampler on fixed logits (temperature, then the top-p nucleus, renormalised:
what vLLM's processed logprobs are) against the learner's logprob of the same policy on the full
distribution: the uncorrected ratio is the kept mass, ~0.9 at top-p 0.9; the engine's processed logprob plus
log(kept mass), what the worker records, gives a ratio of 1. Then the field's way from a stored batch
through the learner's pipeline into the `inference_logprobs` the loss's ratios read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
from jax_trainer.config import LossConfig
from jax_trainer.data import RolloutPipeline, StoreListing
from jax_trainer.loss import policy_loss

TOP_P, TEMPERATURE = 0.9, 0.7


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def nucleus_sample(logits: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, processed logprobs, log kept mass) of one sampled token per row: the smallest set of most
    likely tokens whose probability reaches TOP_P is kept, renormalised, and sampled from."""
    full = _log_softmax(logits / TEMPERATURE)
    tokens, processed, kept = [], [], []
    for row in full:
        order = np.argsort(-row)
        p = np.exp(row[order])
        n = int(np.searchsorted(np.cumsum(p), TOP_P) + 1)  # tokens up to and including the one crossing TOP_P
        nucleus = order[:n]
        mass = p[:n].sum()
        t = int(rng.choice(nucleus, p=p[:n] / mass))
        tokens.append(t)
        processed.append(row[t] - np.log(mass))
        kept.append(np.log(mass))
    return np.array(tokens), np.array(processed, np.float32), np.array(kept, np.float32)


def test_top_p_biases_the_uncorrected_ratio_and_full_logprobs_remove_the_bias():
    rng = np.random.default_rng(0)
    rows, seq, vocab = 4, 24, 50
    logits = rng.normal(0, 2.0, (rows * seq, vocab))
    tokens, processed, log_kept = nucleus_sample(logits, rng)
    learner = _log_softmax(logits / TEMPERATURE)[np.arange(len(tokens)), tokens].astype(np.float32)
    full = processed + log_kept  # what the worker records (`full_logprobs`)
    assert np.all(log_kept < 0) and 0.85 < np.exp(log_kept).mean() < 0.97
    # per token, uncorrected: learner / engine = kept mass, ~0.9; corrected: 1
    np.testing.assert_allclose(np.exp(learner - processed), np.exp(log_kept), rtol=1e-5)
    np.testing.assert_allclose(np.exp(learner - full), 1.0, atol=1e-5)

    # through the loss: pi_old is the learner's (logprob_source = "recompute"), the engine's is the inference one
    shape = (rows, seq)
    lp, mask, seg = learner.reshape(shape), jnp.ones(shape), jnp.ones(shape, jnp.int32)
    adv = jnp.asarray(rng.normal(0, 1, (rows, 1)) * np.ones(shape), jnp.float32)
    modes = ("token_mask", "seq_mask", "geo_mask")

    @jax.jit
    def mismatch_sums(inference):
        configs = [LossConfig(mismatch=m, mismatch_low=0.95, mismatch_high=1.05) for m in modes]
        return [policy_loss(lp, lp, adv, mask, seg, c, inference_logprobs=inference)[1] for c in configs]

    biased_all = mismatch_sums(jnp.asarray(processed.reshape(shape)))
    fixed_all = mismatch_sums(jnp.asarray(full.reshape(shape)))
    for mode, biased, fixed in zip(modes, biased_all, fixed_all):
        # every sample's geometric-mean and sequence ratio is the kept mass's: all of them dropped, uncorrected
        expected = rows * seq if mode != "token_mask" else int((np.exp(log_kept) < 0.95).sum())
        assert int(biased["mismatch_masked_tokens"]) == expected > 0, mode
        assert int(fixed["mismatch_masked_tokens"]) == 0, mode
        assert float(biased["mismatch_kl_sum"]) / (rows * seq) > 1e-3 > 1e3 * float(fixed["mismatch_kl_sum"])


def test_full_logprobs_reach_the_learners_inference_logprobs():
    """A stored batch with `full_logprobs`: the packed `inference_logprobs` (what pi_engine is in every ratio)
    are its full-distribution logprobs, not the processed ones; a batch without the field gives the processed."""
    rng = np.random.default_rng(1)
    store = RolloutStore.open("memory://")
    written = {}
    for bid, with_full in (("full", True), ("plain", False)):
        tokens, prompts, processed, full = [], [], [], []
        for _ in range(4):
            length = int(rng.integers(8, 20))
            prompt = int(rng.integers(1, length - 1))
            lp = np.zeros(length, np.float32)
            lp[prompt:] = -rng.exponential(1.0, length - prompt)
            f = lp.copy()
            f[prompt:] += np.log(rng.uniform(0.8, 0.95, length - prompt)).astype(np.float32)
            tokens.append(rng.integers(0, 500, length))
            prompts.append(prompt)
            processed.append(lp)
            full.append(f)
        batch = RolloutBatch.from_samples(
            BatchMeta(batch_id=bid, node_key="cd" * 32, version=0, assignment_id=bid),
            tokens=tokens,
            prompt_lens=prompts,
            logprobs=processed,
            task_ids=[0, 0, 1, 1],
            group_ids=[0, 0, 1, 1],
            seeds=range(4),
            finish=[0] * 4,
            rewards=[0.0] * 4,
            proofs=[bytes(258 * -(-(len(t) - p) // 32)) for t, p in zip(tokens, prompts)],
            full_logprobs=full if with_full else None,
        )
        store.write(batch)
        expected = full if with_full else processed
        written.update({tuple(t.tolist()): e[p:] for t, p, e in zip(tokens, prompts, expected)})
    rewards = {bid: [1.0, 0.0, 0.0, 1.0] for bid in ("full", "plain")}
    with RolloutPipeline(store, StoreListing(store, rewards=rewards), samples_per_step=8, rows=2, seq_len=64) as pipe:
        packed = pipe.next(0, timeout=30).packed
    tokens, seg = packed.tokens.reshape(-1, 64), packed.segment_ids.reshape(-1, 64)
    mask, lp = packed.loss_mask.reshape(tokens.shape), packed.inference_logprobs.reshape(tokens.shape)
    seen = 0
    for r in range(len(tokens)):
        for s in range(1, int(seg[r].max()) + 1):
            where = seg[r] == s
            np.testing.assert_array_equal(lp[r][where & (mask[r] == 1)], written[tuple(tokens[r][where].tolist())])
            seen += 1
    assert seen == 8
