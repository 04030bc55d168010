"""The learner on multi-turn episodes: loss, ratios, masks and entropy over sampled tokens only.

An episode's sequence interleaves model turns (sampled) with environment turns; a schema-2 rollout batch carries
the mask (docs/design.md section 6). References: the packed arrays are compared with the stored mask position by
position; the loss is compared with `test_loss.numpy_policy_loss` (float64, sample by sample, over the mask it is
given), and it must not move when anything at an environment token changes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_data_pipeline import ListAccepted
from test_loss import CASES, numpy_policy_loss

from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
from jax_trainer.data import AcceptedBatch, RolloutPipeline
from jax_trainer.loss import batch_loss
from jax_trainer.packing import PackingError, Sample, pack


def episode(rng, prompt: int, turns: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, sampled mask) of an episode: a prompt, then model and environment turns, ending with a model one."""
    mask = [0] * prompt
    for k in range(turns):
        if k:
            mask += [0] * int(rng.integers(2, 6))
        mask += [1] * int(rng.integers(1, 6))
    mask = np.array(mask, np.uint8)
    return rng.integers(1, 500, len(mask)).astype(np.int32), mask


def test_pack_puts_loss_advantages_and_logprobs_on_sampled_tokens_only():
    rng = np.random.default_rng(0)
    samples, masks = [], []
    for i in range(5):
        tokens, mask = episode(rng, int(rng.integers(2, 6)), int(rng.integers(1, 4)))
        lp = np.where(mask == 1, -rng.exponential(1.0, len(mask)), 0.0).astype(np.float32)
        adv = float(rng.normal())
        samples.append(Sample(tokens, int(np.argmax(mask)), lp, adv, 0, name=f"b#{i}", sampled=mask))
        masks.append((tokens, mask, lp, adv))
    single = Sample(np.arange(1, 9, dtype=np.int32), 3, np.r_[np.zeros(3), -np.ones(5)].astype(np.float32), 0.5, 0)
    packed = pack([*samples, single], rows=4, seq_len=64)
    tokens = packed.tokens.reshape(-1, 64)
    seg = packed.segment_ids.reshape(-1, 64)
    found = 0
    for r in range(tokens.shape[0]):
        for s in range(1, int(seg[r].max()) + 1):
            where = seg[r] == s
            row = {k: getattr(packed, k).reshape(-1, 64)[r][where] for k in ("loss_mask", "advantages")}
            row["lp"] = packed.inference_logprobs.reshape(-1, 64)[r][where]
            row["lens"] = packed.completion_lens.reshape(-1, 64)[r][where]
            match = [m for m in masks if np.array_equal(m[0], tokens[r][where])]
            if not match:  # the single-turn sample: its completion, as before
                np.testing.assert_array_equal(row["loss_mask"], [0, 0, 0, 1, 1, 1, 1, 1])
                assert set(row["lens"]) == {5.0}
                continue
            _, mask, lp, adv = match[0]
            found += 1
            np.testing.assert_array_equal(row["loss_mask"], mask)
            np.testing.assert_allclose(row["advantages"], np.where(mask == 1, adv, 0.0), rtol=1e-6)
            np.testing.assert_array_equal(row["lp"], np.where(mask == 1, lp, 0.0))
            assert set(row["lens"]) == {float(mask.sum())}  # the per-sample normaliser counts sampled tokens
    assert found == 5


def test_a_malformed_mask_is_refused_naming_the_sample():
    tokens = np.arange(1, 11, dtype=np.int32)
    lp = np.zeros(10, np.float32)
    for mask in (np.r_[1, np.zeros(9)], np.zeros(10), np.ones(5)):
        with pytest.raises(PackingError, match="ep#3: the sampled mask"):
            pack([Sample(tokens, 2, lp, 1.0, 0, name="ep#3", sampled=mask.astype(np.uint8))], 2, 32)


def _packed_episodes(rng, rows=4, seq=24):
    """Rows of packed episodes: each a prompt, then model turns separated by environment turns (mask 0 inside)."""
    mask = np.zeros((rows, seq), np.float32)
    seg = np.zeros((rows, seq), np.int32)
    adv = np.zeros((rows, seq), np.float32)
    for r in range(rows):
        pos, k = 0, 1
        while pos < seq - 8:
            _, m = episode(rng, int(rng.integers(1, 3)), int(rng.integers(2, 4)))
            m = m[: seq - pos]
            if not m.any():
                break
            n = len(m)
            seg[r, pos : pos + n] = k
            mask[r, pos : pos + n] = m
            adv[r, pos : pos + n] = rng.normal(0, 1)
            pos, k = pos + n, k + 1
    return mask, seg, adv


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "dr_grpo", "gspo", "geo_mask+tis", "entropy"])
def test_the_loss_counts_sampled_tokens_only(name):
    s = CASES[name]
    rng = np.random.default_rng(11)
    mask, seg, adv = _packed_episodes(rng)
    assert ((mask == 0) & (seg > 0)).sum() > mask.sum() / 3  # plenty of environment tokens inside samples
    lp = (-rng.random(mask.shape) * 3).astype(np.float32)
    old = (lp + rng.normal(0, 0.6, lp.shape)).astype(np.float32)
    inf = (old + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    ref = (lp + rng.normal(0, 0.2, lp.shape)).astype(np.float32)
    ent = rng.random(mask.shape).astype(np.float32)

    def loss(lp, old, inf, ref, ent):
        return batch_loss(
            *map(jnp.asarray, (lp, old, adv, mask, seg)),
            s,
            inference_logprobs=jnp.asarray(inf),
            ref_logprobs=jnp.asarray(ref),
            entropy=jnp.asarray(ent),
        )

    got, sums = loss(lp, old, inf, ref, ent)
    expected, keep = numpy_policy_loss(lp, old, adv, mask, seg, s, inf, ref, ent)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)
    assert int(sums["tokens"]) == int(mask.sum()) and int(sums["norm_tokens"]) == int(keep.sum())
    # anything at an environment token (or the prompt) is context: wild values there change nothing
    env = (mask == 0) & (seg > 0)
    noisy = [np.where(env, x + rng.normal(0, 5.0, x.shape).astype(np.float32), x) for x in (lp, old, inf, ref, ent)]
    again, sums2 = loss(*noisy)
    np.testing.assert_allclose(float(again), float(got), rtol=1e-6)
    for key in ("tokens", "norm_tokens", "norm_samples", "entropy_sum", "kl_ref_sum", "mismatch_kl_sum"):
        if key in sums:
            np.testing.assert_allclose(float(sums2[key]), float(sums[key]), rtol=1e-5)


def test_the_pipeline_trains_a_schema_2_batch_on_its_sampled_tokens():
    rng = np.random.default_rng(5)
    store = RolloutStore.open("memory://")
    data = {k: [] for k in ("tokens", "prompt_lens", "logprobs", "proofs", "sampled")}
    for _ in range(8):
        tokens, mask = episode(rng, int(rng.integers(2, 6)), int(rng.integers(1, 4)))
        data["tokens"].append(tokens)
        data["prompt_lens"].append(int(np.argmax(mask)))
        data["logprobs"].append(np.where(mask == 1, -rng.exponential(1.0, len(mask)), 0.0).astype(np.float32))
        data["sampled"].append(mask)
        data["proofs"].append(bytes(258 * -(-int(mask.sum()) // 32)))
    meta = BatchMeta(batch_id="ep", node_key="cd" * 32, version=0, assignment_id="ep")
    batch = RolloutBatch.from_samples(
        meta,
        **data,
        task_ids=np.arange(8) // 4,
        group_ids=np.arange(8) // 4,
        seeds=np.arange(8),
        finish=np.zeros(8),
        rewards=np.zeros(8),
    )
    digest = store.write(batch)
    rewards = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.5]
    accepted = ListAccepted([AcceptedBatch("ep", 0, np.array(rewards), sha256=digest)])
    with RolloutPipeline(store, accepted, samples_per_step=8, rows=2, seq_len=128) as pipe:
        step = pipe.next(0, timeout=300)
    tokens, seg = step.packed.tokens.reshape(-1, 128), step.packed.segment_ids.reshape(-1, 128)
    loss_mask = step.packed.loss_mask.reshape(tokens.shape)
    seen = 0
    for r in range(tokens.shape[0]):
        for s in range(1, int(seg[r].max()) + 1):
            where = seg[r] == s
            i = next(i for i, t in enumerate(data["tokens"]) if np.array_equal(t, tokens[r][where]))
            np.testing.assert_array_equal(loss_mask[r][where], data["sampled"][i])
            seen += 1
    assert seen == 8
