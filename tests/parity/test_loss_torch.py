"""The GRPO loss and its parameter gradients: JAX model vs the same loss written in PyTorch on the HF model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from jax_trainer.config import LossConfig
from jax_trainer.loss import batch_loss, token_logprobs
from jax_trainer.models import load_hf, tensor_specs
from jax_trainer.sharding import make_mesh

SETTINGS = {
    "token_mean+tis+kl": LossConfig(temperature=0.7, tis_cap=1.5, kl_coef=0.1, delta=2.0),
    "seq_mean+entropy": LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.02, eps_high=0.28),
    "constant": LossConfig(aggregation="constant", constant_normalizer=64.0),
    "gspo+token_mask+tis": LossConfig(
        policy_loss="gspo",
        aggregation="seq_mean_token_mean",
        gspo_eps_low=0.1,
        gspo_eps_high=0.1,
        mismatch="token_mask",
        mismatch_low=0.8,
        mismatch_high=1.25,
        tis_cap=1.1,
    ),
    "cispo+seq_mask": LossConfig(policy_loss="cispo", mismatch="seq_mask", mismatch_low=0.3, mismatch_high=3.0),
    "dr_grpo+geo_mask": LossConfig(policy_loss="dr_grpo", constant_normalizer=30, mismatch="geo_mask"),
}


def _data(vocab: int, rows: int = 3, seq: int = 24, seed: int = 0):
    """One sample per row, right-padded; logprob arrays aligned with next-token targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, seq))
    prompt = np.array([5, 7, 4])
    lengths = np.array([seq, seq - 6, seq - 3])
    mask = np.zeros((rows, seq - 1), np.float32)
    for r in range(rows):
        mask[r, prompt[r] - 1 : lengths[r] - 1] = 1.0  # targets t = prompt..len-1 sit at t-1
    adv = np.repeat(rng.normal(0, 1, (rows, 1)), seq - 1, 1).astype(np.float32)
    lens = np.repeat(mask.sum(1, keepdims=True), seq - 1, 1)
    noise = lambda s: rng.normal(0, s, (rows, seq - 1)).astype(np.float32)  # noqa: E731
    inf_shift = noise(0.3)
    inf_shift[1] *= 0.02  # sample 1 passes every mismatch mask of SETTINGS, samples 0 and 2 fail the sequence ones
    inf_shift[0] += 0.2
    inf_shift[2] -= 0.2
    return tokens, mask, adv, lens, noise(0.5), inf_shift, noise(0.2)


def _jax_loss_and_grads(model, tokens, mask, adv, lens, old_shift, inf_shift, ref_shift, s):
    graphdef, params = nnx.split(model)

    def loss_fn(p):
        m = nnx.merge(graphdef, p)
        hidden = m.hidden_states(jnp.asarray(tokens))[:, :-1]
        lp, ent = token_logprobs(hidden, m.head(), jnp.asarray(tokens[:, 1:]), s.temperature, chunk=8)
        frozen = jax.lax.stop_gradient(lp)
        segments = jnp.asarray(lens > 0, jnp.int32)  # one sample per row: segment 1
        loss, _ = batch_loss(
            lp,
            frozen + old_shift,
            jnp.asarray(adv),
            jnp.asarray(mask),
            segments,
            s,
            inference_logprobs=frozen + old_shift + inf_shift,
            ref_logprobs=frozen + ref_shift,
            entropy=ent,
        )
        return loss

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return float(loss), grads


def _torch_loss_and_grads(model_dir, tokens, mask, adv, lens, old_shift, inf_shift, ref_shift, s):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    t = lambda x: torch.tensor(np.asarray(x), dtype=torch.float32)  # noqa: E731
    logits = model(torch.tensor(tokens)).logits[:, :-1].double() / s.temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, torch.tensor(tokens[:, 1:])[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    frozen = lp.detach()
    old, inf, ref = frozen + t(old_shift), frozen + t(old_shift) + t(inf_shift), frozen + t(ref_shift)
    A, M = t(adv).double(), t(mask).double()
    m = (old - inf).double()  # the learner/engine log ratio of each token
    if s.mismatch != "none":  # drop tokens (token_mask) or whole rows (one sample per row) out of bounds
        low, high = s.mismatch_bounds()
        stat = {"token_mask": m, "seq_mask": (m * M).sum(1, keepdim=True), "geo_mask": (m * M).sum(1, keepdim=True)}
        if s.mismatch == "geo_mask":
            stat["geo_mask"] = stat["geo_mask"] / M.sum(1, keepdim=True)
        r = torch.exp(stat[s.mismatch])
        M = M * ((r >= low) & (r <= high)).double()
        assert 0 < M.sum() < t(mask).sum(), "the setting's mask should drop some tokens, not all"
    ratio = torch.exp(lp - old)
    if s.policy_loss in ("grpo", "dr_grpo"):
        surr1 = A * torch.where(A < 0, torch.clamp(ratio, max=s.delta), ratio)
        surr2 = A * torch.clamp(ratio, 1 - s.eps_low, 1 + s.eps_high)
        per = -torch.minimum(surr1, surr2)
    elif s.policy_loss == "gspo":  # sequence ratio: geometric mean of the row's token ratios
        seq_ratio = torch.exp(((lp - old) * M).sum(1, keepdim=True) / M.sum(1, keepdim=True))
        per = -torch.minimum(A * seq_ratio, A * torch.clamp(seq_ratio, 1 - s.gspo_eps_low, 1 + s.gspo_eps_high))
    else:  # cispo
        per = -torch.clamp(ratio, max=1 + s.cispo_eps_high).detach() * A * lp
    if s.tis_cap is not None:
        per = per * torch.clamp(torch.exp(old - inf), max=s.tis_cap)
    if s.kl_coef:
        per = per + s.kl_coef * (torch.exp(ref - lp) - (ref - lp) - 1)
    if s.entropy_coef:
        per = per - s.entropy_coef * ent
    if s.aggregation == "token_mean":
        loss = (per * M).sum() / M.sum()
    elif s.aggregation == "seq_mean_token_mean":
        kept = M.sum(1) > 0
        loss = ((per * M).sum(1)[kept] / M.sum(1)[kept]).mean()
    elif s.aggregation == "seq_mean_token_sum_norm":  # Dr. GRPO: token sums over a constant, mean over samples
        kept = M.sum(1) > 0
        loss = ((per * M).sum(1)[kept] / s.constant_normalizer).mean()
    else:
        loss = (per * M).sum() / s.constant_normalizer
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_loss_and_gradients_match_pytorch(tiny_model, name):
    s = SETTINGS[name]
    model_dir = tiny_model(family="qwen2", tie_embeddings=False)
    model = load_hf(model_dir, mesh=make_mesh(fsdp=1, devices=jax.devices()[:1]))
    data = _data(model.cfg.vocab_size)
    loss, grads = _jax_loss_and_grads(model, *data, s)
    ref_loss, ref_grads = _torch_loss_and_grads(model_dir, *data, s)
    assert abs(loss - ref_loss) <= 1e-4 * max(abs(ref_loss), 1e-3), (loss, ref_loss)
    flat = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(grads)}
    for spec in tensor_specs(model.cfg):
        ours = spec.to_hf(spec.of(np.asarray(flat[spec.path])))
        theirs = ref_grads[spec.hf_name]
        scale = np.abs(theirs).max()
        assert scale > 0, spec.hf_name
        assert np.abs(ours - theirs).max() <= 1e-4 * scale, (spec.hf_name, np.abs(ours - theirs).max(), scale)
