"""GRPO loss pieces against numpy references written from the formulas (not from the JAX code)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_trainer.advantages import group_advantages
from jax_trainer.config import LossConfig
from jax_trainer.loss import batch_loss, loss_denominator, policy_loss, sample_sums, token_logprobs

jax.config.update("jax_enable_x64", False)


# ---- advantages ------------------------------------------------------------------------------------------
def test_std_advantages_match_a_per_group_numpy_loop():
    rng = np.random.default_rng(0)
    rewards = rng.random(24)
    groups = np.repeat([7, 3, 11], 8)
    out = group_advantages(rewards, groups, "std", eps=1e-6)
    for g in (7, 3, 11):
        r = rewards[groups == g]
        expected = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(out.values[groups == g], expected, rtol=1e-5)
    assert out.groups == 3 and out.dropped_groups == 0 and out.keep.all()


def test_mean_advantages_and_online_filtering():
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0], float)
    groups = np.repeat([0, 1, 2], 4)
    out = group_advantages(rewards, groups, "mean")
    np.testing.assert_allclose(out.values[4:8], [-0.25, 0.75, -0.25, -0.25])
    assert out.keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4
    assert out.dropped_groups == 2
    kept_all = group_advantages(rewards, groups, "mean", drop_zero_groups=False)
    assert kept_all.keep.all() and kept_all.dropped_groups == 0


def test_bad_rewards_are_refused():
    with pytest.raises(ValueError, match="non-finite reward at indices \\[1\\]"):
        group_advantages(np.array([0.0, np.nan]), np.array([0, 0]))
    with pytest.raises(ValueError, match="mode"):
        group_advantages(np.zeros(2), np.zeros(2), "median")


# ---- token logprobs --------------------------------------------------------------------------------------
def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("chunk, temperature", [(4, 1.0), (5, 0.6), (64, 1.3)])
def test_chunked_token_logprobs_and_entropy_match_numpy(chunk, temperature):
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((2, 13, 16)).astype(np.float32)
    head = rng.standard_normal((16, 40)).astype(np.float32)
    targets = rng.integers(0, 40, (2, 13))
    lp, ent = token_logprobs(jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(targets), temperature, chunk)
    z = (hidden.astype(np.float64) @ head) / temperature
    logp = _np_log_softmax(z)
    expected = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp), expected, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), -(np.exp(logp) * logp).sum(-1), atol=1e-4)  # float32 sum of p*z


def test_chunked_logprob_gradient_matches_unchunked():
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.standard_normal((1, 9, 8)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((8, 12)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 12, (1, 9)))

    def chunked(h, w):
        return token_logprobs(h, w, targets, 0.7, chunk=4)[0].sum()

    def full(h, w):
        z = (h @ w) / 0.7
        return jnp.take_along_axis(jax.nn.log_softmax(z), targets[..., None], -1).sum()

    for a, b in zip(jax.grad(chunked, (0, 1))(hidden, head), jax.grad(full, (0, 1))(hidden, head)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


# ---- the policy loss -------------------------------------------------------------------------------------
def _samples(mask, seg):
    """(row, boolean index) of every sample with completion tokens: a sample is a (row, segment id) pair."""
    return [(r, (seg[r] == k) & (mask[r] > 0)) for r in range(len(mask)) for k in np.unique(seg[r][mask[r] > 0])]


def numpy_policy_loss(lp, old, adv, mask, seg, s: LossConfig, inf=None, ref=None, ent=None):
    """The loss of `jax_trainer.loss`'s docstring, sample by sample, in float64; also the kept-token mask."""
    lp, old = lp.astype(np.float64), old.astype(np.float64)
    keep = mask.astype(np.float64).copy()
    samples = _samples(mask, seg)
    if s.mismatch != "none":
        low, high = s.mismatch_bounds()
        m = old - inf
        for r, idx in samples:
            if s.mismatch == "token_mask":
                keep[r, idx] = (np.exp(m[r, idx]) >= low) & (np.exp(m[r, idx]) <= high)
            else:
                stat = m[r, idx].sum() if s.mismatch == "seq_mask" else m[r, idx].mean()
                keep[r, idx] = low <= np.exp(stat) <= high
    ratio = np.exp(lp - old)
    per = np.zeros_like(lp)
    for r, idx in samples:
        a = adv[r, idx][0]
        kept = idx & (keep[r] > 0)
        if s.policy_loss in ("grpo", "dr_grpo"):
            x = ratio[r, idx]
            capped = np.minimum(x, s.delta) if a < 0 else x
            per[r, idx] = -np.minimum(a * capped, a * np.clip(x, 1 - s.eps_low, 1 + s.eps_high))
        elif s.policy_loss == "gspo":
            sr = np.exp((lp[r, kept] - old[r, kept]).mean()) if kept.any() else 1.0
            per[r, idx] = -min(a * sr, a * np.clip(sr, 1 - s.gspo_eps_low, 1 + s.gspo_eps_high))
        else:  # cispo
            per[r, idx] = -np.minimum(ratio[r, idx], 1 + s.cispo_eps_high) * a * lp[r, idx]
    if s.tis_cap is not None:
        per = per * np.minimum(np.exp(old - inf), s.tis_cap)
    if s.kl_coef:
        per = per + s.kl_coef * (np.exp(ref - lp) - (ref - lp) - 1)
    if s.entropy_coef:
        per = per - s.entropy_coef * ent
    sample_sums = [(per[r] * keep[r] * idx).sum() for r, idx in samples]
    sample_lens = [(keep[r] * idx).sum() for r, idx in samples]
    kept_samples = [(t, n) for t, n in zip(sample_sums, sample_lens) if n > 0]
    if s.aggregation == "token_mean":
        loss = (per * keep).sum() / keep.sum()
    elif s.aggregation == "seq_mean_token_mean":
        loss = np.mean([t / n for t, n in kept_samples])
    elif s.aggregation == "constant":
        loss = (per * keep).sum() / s.constant_normalizer
    else:  # seq_mean_token_sum_norm
        loss = np.mean([t / s.constant_normalizer for t, _ in kept_samples])
    return loss, keep


CASES = {
    "token_mean": LossConfig(),
    "seq_mean_token_mean": LossConfig(aggregation="seq_mean_token_mean"),
    "constant": LossConfig(aggregation="constant", constant_normalizer=100.0),
    "clip_higher": LossConfig(eps_low=0.1, eps_high=0.28, delta=2.0),
    "tis": LossConfig(tis_cap=1.5),
    "kl": LossConfig(kl_coef=0.05),
    "entropy": LossConfig(entropy_coef=0.01, aggregation="seq_mean_token_mean"),
    "gspo": LossConfig(policy_loss="gspo", aggregation="seq_mean_token_mean", gspo_eps_low=0.05, gspo_eps_high=0.08),
    "gspo_token_mean": LossConfig(policy_loss="gspo", gspo_eps_low=0.05, gspo_eps_high=0.08),
    "cispo": LossConfig(policy_loss="cispo", cispo_eps_high=0.3),
    "dr_grpo": LossConfig(policy_loss="dr_grpo", constant_normalizer=12),
    "token_mask": LossConfig(mismatch="token_mask", mismatch_low=0.7, mismatch_high=1.3),
    "seq_mask": LossConfig(mismatch="seq_mask", mismatch_low=0.5, mismatch_high=2.0, aggregation="seq_mean_token_mean"),
    "geo_mask+tis": LossConfig(mismatch="geo_mask", mismatch_low=0.9, mismatch_high=1.1, tis_cap=1.2),
    "seq_mask+gspo+kl": LossConfig(policy_loss="gspo", mismatch="seq_mask", kl_coef=0.1, gspo_eps_high=0.1),
}


def _packed(rng, rows=4, seq=12):
    """Rows of two or three packed samples each: a prompt (no loss) then a completion; padding at the end."""
    mask = np.zeros((rows, seq), np.float32)
    seg = np.zeros((rows, seq), np.int32)
    adv = np.zeros((rows, seq), np.float32)
    for r in range(rows):
        pos, k = 0, 1
        while pos < seq - 3:
            n = int(rng.integers(3, 7))
            n = min(n, seq - pos)
            p = int(rng.integers(1, n - 1))
            seg[r, pos : pos + n] = k
            mask[r, pos + p : pos + n] = 1.0
            adv[r, pos : pos + n] = rng.normal(0, 1)
            pos, k = pos + n, k + 1
    return mask, seg, adv


@pytest.mark.parametrize("name", list(CASES))
def test_policy_loss_matches_numpy(name):
    s = CASES[name]
    rng = np.random.default_rng(3)
    rows, seq = 4, 12
    mask, seg, adv = _packed(rng, rows, seq)
    lp = (-rng.random((rows, seq)) * 3).astype(np.float32)
    old = (lp + rng.normal(0, 0.6, lp.shape)).astype(np.float32)  # ratios well outside [0.8, 1.2] and > delta
    inf = (old + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    ref = (lp + rng.normal(0, 0.2, lp.shape)).astype(np.float32)
    ent = rng.random((rows, seq)).astype(np.float32)
    loss, sums = batch_loss(
        *map(jnp.asarray, (lp, old, adv, mask, seg)),
        s,
        inference_logprobs=jnp.asarray(inf),
        ref_logprobs=jnp.asarray(ref),
        entropy=jnp.asarray(ent),
    )
    expected, keep = numpy_policy_loss(lp, old, adv, mask, seg, s, inf, ref, ent)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert int(sums["tokens"]) == int(mask.sum()) and int(sums["norm_tokens"]) == int(keep.sum())
    if s.policy_loss == "grpo":
        ratio = np.exp(lp.astype(np.float64) - old)
        assert int(sums["clip_high_sum"]) == int(((adv > 0) & (ratio > 1 + s.eps_high) & (mask > 0)).sum())
        assert int(sums["clip_low_sum"]) == int(((adv < 0) & (ratio < 1 - s.eps_low) & (mask > 0)).sum())
        assert int(sums["clip_delta_sum"]) == int(((adv < 0) & (ratio > s.delta) & (mask > 0)).sum())
    d = old.astype(np.float64) - inf
    np.testing.assert_allclose(float(sums["mismatch_kl_sum"]), ((np.exp(d) - d - 1) * mask).sum(), rtol=1e-4)
    if s.mismatch != "none":
        dropped = [(r, idx) for r, idx in _samples(mask, seg) if not keep[r, idx].all()]
        assert 0 < int(sums["mismatch_masked_tokens"]) == int(mask.sum() - keep.sum()) < int(mask.sum())
        if s.mismatch != "token_mask":  # whole samples go
            assert round(float(sums["mismatch_masked_samples"]), 4) == len(dropped)


def test_sample_sums_add_up_each_packed_sample():
    rng = np.random.default_rng(4)
    mask, seg, _ = _packed(rng)
    x = rng.random(mask.shape).astype(np.float32)
    out = np.asarray(sample_sums(jnp.asarray(x), jnp.asarray(seg)))
    for r in range(len(x)):
        for k in np.unique(seg[r]):
            np.testing.assert_allclose(out[r, seg[r] == k], x[r, seg[r] == k].sum(), rtol=1e-6)


def test_a_masked_sample_leaves_the_denominator():
    """seq_mask drops a sample as if it had never been sampled: same loss as the batch without it."""
    s = LossConfig(mismatch="seq_mask", mismatch_low=0.5, mismatch_high=2.0)
    mask = jnp.array([[0, 1, 1, 1, 0, 1, 1]], jnp.float32)
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2]])
    adv = jnp.array([[1, 1, 1, 1, -1, -1, -1]], jnp.float32)
    lp = jnp.log(jnp.array([[0.5, 0.3, 0.2, 0.4, 0.5, 0.6, 0.7]]))
    old = lp - 0.1
    inf = old.at[0, 5:].add(-1.0)  # sample 2: sequence ratio exp(2) > 2
    loss, sums = batch_loss(lp, old, adv, mask, seg, s, inference_logprobs=inf)
    alone, _ = batch_loss(lp[:, :4], old[:, :4], adv[:, :4], mask[:, :4], seg[:, :4], LossConfig())
    np.testing.assert_allclose(float(loss), float(alone), rtol=1e-6)
    np.testing.assert_allclose(float(loss), -np.exp(0.1) * 1.0, rtol=1e-6)  # ratio e^0.1 inside [0.8, 1.2]
    assert float(sums["mismatch_masked_samples"]) == 1.0 and float(sums["mismatch_masked_tokens"]) == 2.0
    grads = jax.jit(jax.grad(lambda x: batch_loss(x, old, adv, mask, seg, s, inference_logprobs=inf)[0]))(lp)
    assert np.all(np.asarray(grads)[0, 4:] == 0) and np.all(np.asarray(grads)[0, 1:4] != 0)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """Where PPO's clip zeroes a token's gradient (A > 0, ratio > 1 + eps), CISPO's is -A * min(r, cap)."""
    mask, seg = jnp.ones((1, 3)), jnp.ones((1, 3), jnp.int32)
    adv = jnp.ones((1, 3))
    lp = jnp.log(jnp.array([[0.3, 0.6, 0.9]]))
    old = jnp.log(jnp.array([[0.2, 0.2, 0.6]]))  # ratios 1.5, 3, 1.5
    cispo = LossConfig(policy_loss="cispo", cispo_eps_high=1.0)
    g = jax.jit(jax.grad(lambda x: batch_loss(x, old, adv, mask, seg, cispo)[0]))(lp)
    np.testing.assert_allclose(np.asarray(g), -np.array([[1.5, 2.0, 1.5]]) / 3, rtol=1e-5)
    g_ppo = jax.jit(jax.grad(lambda x: batch_loss(x, old, adv, mask, seg, LossConfig())[0]))(lp)
    assert np.all(np.asarray(g_ppo) == 0)


def test_dr_grpo_is_a_preset_that_refuses_contradictions():
    s = LossConfig(policy_loss="dr_grpo")
    assert s.aggregation == "seq_mean_token_sum_norm" and s.std_normalize is False
    with pytest.raises(ValueError, match="dr_grpo.*aggregation"):
        LossConfig(policy_loss="dr_grpo", aggregation="token_mean")
    with pytest.raises(ValueError, match="mismatch_low"):
        LossConfig(mismatch="geo_mask", mismatch_low=1.5)
    assert LossConfig(mismatch="geo_mask").mismatch_bounds() == (0.99, 1.01)


def test_two_sided_clip_bounds_the_negative_advantage_loss():
    """INTELLECT-2's delta: with A < 0 the per-token loss stops growing once the ratio passes delta."""
    s = LossConfig(delta=4.0)
    mask, seg = jnp.ones((1, 3)), jnp.ones((1, 3), jnp.int32)
    adv = -jnp.ones((1, 3))
    lp = jnp.log(jnp.array([[3.0, 10.0, 100.0]]))
    loss, _ = batch_loss(lp, jnp.zeros((1, 3)), adv, mask, seg, s)
    np.testing.assert_allclose(float(loss), (3.0 + 4.0 + 4.0) / 3, rtol=1e-6)
    grads = jax.grad(lambda x: batch_loss(x, jnp.zeros((1, 3)), adv, mask, seg, s)[0])(lp)
    assert float(grads[0, 0]) != 0 and float(grads[0, 1]) == 0 and float(grads[0, 2]) == 0


def test_kl_gradient_flows_and_corrections_need_inference_logprobs():
    s = LossConfig(kl_coef=1.0)
    mask, seg = jnp.ones((1, 2)), jnp.ones((1, 2), jnp.int32)
    lp = jnp.array([[-1.0, -2.0]])
    g = jax.grad(lambda x: batch_loss(x, x, jnp.zeros((1, 2)), mask, seg, s, ref_logprobs=x - 0.5)[0])(lp)
    # d/dlp of k3 with ref fixed: -exp(ref - lp) + 1, averaged over 2 tokens
    np.testing.assert_allclose(np.asarray(g), (1 - np.exp(-0.5)) / 2 * np.ones((1, 2)), rtol=1e-5)
    for config in (LossConfig(tis_cap=2.0), LossConfig(mismatch="seq_mask")):
        with pytest.raises(ValueError, match="no inference logprobs"):
            policy_loss(lp, lp, jnp.zeros((1, 2)), mask, seg, config)


@pytest.mark.parametrize("name", ["seq_mask", "gspo", "dr_grpo"])
def test_micro_batches_add_up_to_the_whole_batch(name):
    """What the train step does: numerators and sums added over micro-batches, then divided by D once, give the
    loss of the whole batch as one (the denominators count kept tokens/samples of every micro-batch)."""
    s = CASES[name]
    rng = np.random.default_rng(5)
    mask, seg, adv = _packed(rng, rows=4, seq=12)
    lp = (-rng.random(mask.shape) * 3).astype(np.float32)
    old = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    inf = (old + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    whole, _ = batch_loss(*map(jnp.asarray, (lp, old, adv, mask, seg)), s, inference_logprobs=jnp.asarray(inf))
    parts = [
        policy_loss(*(jnp.asarray(x[h]) for x in (lp, old, adv, mask, seg)), s, inference_logprobs=jnp.asarray(inf[h]))
        for h in (slice(0, 2), slice(2, 4))
    ]
    summed = {k: parts[0][1][k] + parts[1][1][k] for k in ("norm_tokens", "norm_samples")}
    np.testing.assert_allclose(
        float((parts[0][0] + parts[1][0]) / loss_denominator(s, summed)), float(whole), rtol=1e-5
    )
    assert float(parts[0][0] / loss_denominator(s, parts[0][1])) != pytest.approx(float(whole), rel=1e-3)
