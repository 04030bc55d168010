"""GRPO loss pieces against numpy references written from the formulas (not from the JAX code)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_trainer.advantages import group_advantages
from jax_trainer.config import LossConfig
from jax_trainer.loss import policy_loss, token_logprobs, token_weights

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
def numpy_policy_loss(lp, old, adv, mask, clens, s: LossConfig, inf=None, ref=None, ent=None):
    """The loss of the module docstring, term by term, in float64."""
    ratio = np.exp(lp - old)
    capped = np.where(adv < 0, np.minimum(ratio, s.delta), ratio)
    per = -np.minimum(adv * capped, adv * np.clip(ratio, 1 - s.eps_low, 1 + s.eps_high))
    if s.tis_cap is not None:
        per = per * np.minimum(np.exp(old - inf), s.tis_cap)
    if s.kl_coef:
        per = per + s.kl_coef * (np.exp(ref - lp) - (ref - lp) - 1)
    if s.entropy_coef:
        per = per - s.entropy_coef * ent
    if s.aggregation == "token_mean":
        return (per * mask).sum() / mask.sum()
    if s.aggregation == "seq_mean_token_mean":
        # mean over each sample's own tokens, then over samples; here each row is one sample
        per_sample = (per * mask).sum(1) / mask.sum(1)
        return per_sample.mean()
    return (per * mask).sum() / s.constant_normalizer


CASES = {
    "token_mean": LossConfig(),
    "seq_mean_token_mean": LossConfig(aggregation="seq_mean_token_mean"),
    "constant": LossConfig(aggregation="constant", constant_normalizer=100.0),
    "clip_higher": LossConfig(eps_low=0.1, eps_high=0.28, delta=2.0),
    "tis": LossConfig(tis_cap=1.5),
    "kl": LossConfig(kl_coef=0.05),
    "entropy": LossConfig(entropy_coef=0.01, aggregation="seq_mean_token_mean"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_policy_loss_matches_numpy(name):
    s = CASES[name]
    rng = np.random.default_rng(3)
    rows, seq = 4, 10
    mask = (rng.random((rows, seq)) < 0.7).astype(np.float32)
    mask[:, 0] = 1.0
    lens = mask.sum(1, keepdims=True) * np.ones((1, seq), np.float32)
    lp = (-rng.random((rows, seq)) * 3).astype(np.float32)
    old = (lp + rng.normal(0, 0.6, lp.shape)).astype(np.float32)  # ratios well outside [0.8, 1.2] and > delta
    inf = (old + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    ref = (lp + rng.normal(0, 0.2, lp.shape)).astype(np.float32)
    ent = rng.random((rows, seq)).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (rows, 1)), seq, 1).astype(np.float32)
    weights = token_weights(jnp.asarray(mask), jnp.asarray(lens), s, jnp.sum(mask), jnp.asarray(float(rows)))
    loss, sums = policy_loss(
        jnp.asarray(lp),
        jnp.asarray(old),
        jnp.asarray(adv),
        weights,
        jnp.asarray(mask),
        s,
        inference_logprobs=jnp.asarray(inf),
        ref_logprobs=jnp.asarray(ref),
        entropy=jnp.asarray(ent),
    )
    expected = numpy_policy_loss(lp.astype(np.float64), old, adv, mask, lens, s, inf, ref, ent)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    ratio = np.exp(lp.astype(np.float64) - old)
    assert int(sums["tokens"]) == int(mask.sum())
    assert int(sums["clip_high_sum"]) == int(((adv > 0) & (ratio > 1 + s.eps_high) & (mask > 0)).sum())
    assert int(sums["clip_low_sum"]) == int(((adv < 0) & (ratio < 1 - s.eps_low) & (mask > 0)).sum())
    assert int(sums["clip_delta_sum"]) == int(((adv < 0) & (ratio > s.delta) & (mask > 0)).sum())
    d = old.astype(np.float64) - inf
    np.testing.assert_allclose(float(sums["mismatch_kl_sum"]), ((np.exp(d) - d - 1) * mask).sum(), rtol=1e-4)


def test_two_sided_clip_bounds_the_negative_advantage_loss():
    """INTELLECT-2's delta: with A < 0 the per-token loss stops growing once the ratio passes delta."""
    s = LossConfig(delta=4.0)
    mask = jnp.ones((1, 3))
    adv = -jnp.ones((1, 3))
    w = token_weights(mask, mask * 3, s, jnp.sum(mask), jnp.asarray(1.0))
    lp = jnp.log(jnp.array([[3.0, 10.0, 100.0]]))
    loss, _ = policy_loss(lp, jnp.zeros((1, 3)), adv, w, mask, s)
    np.testing.assert_allclose(float(loss), (3.0 + 4.0 + 4.0) / 3, rtol=1e-6)
    grads = jax.grad(lambda x: policy_loss(x, jnp.zeros((1, 3)), adv, w, mask, s)[0])(lp)
    assert float(grads[0, 0]) != 0 and float(grads[0, 1]) == 0 and float(grads[0, 2]) == 0


def test_kl_gradient_flows_and_tis_needs_inference_logprobs():
    s = LossConfig(kl_coef=1.0)
    mask = jnp.ones((1, 2))
    w = token_weights(mask, mask * 2, s, jnp.sum(mask), jnp.asarray(1.0))
    lp = jnp.array([[-1.0, -2.0]])
    g = jax.grad(lambda x: policy_loss(x, x, jnp.zeros((1, 2)), w, mask, s, ref_logprobs=x - 0.5)[0])(lp)
    # d/dlp of k3 with ref fixed: -exp(ref - lp) + 1, averaged over 2 tokens
    np.testing.assert_allclose(np.asarray(g), (1 - np.exp(-0.5)) / 2 * np.ones((1, 2)), rtol=1e-5)
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss(lp, lp, jnp.zeros((1, 2)), w, mask, LossConfig(tis_cap=2.0))
