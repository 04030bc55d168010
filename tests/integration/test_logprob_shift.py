"""Issue 49 item 3: engine logprobs no worker can move.

The attack: a bfloat16 worker reports one token's logprob per sample 0.75 nats higher than its engine gave (and
its full-distribution logprob with it). The sampling check must allow bfloat16 rounding, up to 0.75 on one token
(`MAX_LOGPROB_DIFF`), so the validator accepts the batch; wherever the learner divides by the worker's claim
(pi_old under `logprob_source = "inference"`, the TIS weights and mismatch masks under "recompute"), the trained
ratio, and the weights, move. The defence: the validator writes the logprobs it recomputed beside each accepted
batch, under a digest its verdict carries, and the learner takes those (`logprob_source = "validator"`; the
same numbers for TIS and the masks under "recompute"): the honest and the shifted batch then train the same
step, loss, gradients and weights. A file a worker rewrites is refused by its digest.

The batches: a tiny Qwen2 policy, an honest worker made of the validator's own bfloat16 prefill (each token the
assigned seed's Gumbel-max choice, `gpu_workers.replay`; its TOPLOC proofs and logprobs from that prefill), judged
by `validate_batch` as `intellect validator` judges them; the learner's step is `GRPOTrainer`'s on the same
model, fed by `RolloutPipeline` from the store.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoTokenizer

from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
from bridge.validator_logprobs import flat_logprobs, read_validator_logprobs, write_validator_logprobs
from gpu_workers.checks import Declared, Sample, stop_token_ids, validate_batch
from gpu_workers.prefill import Prefill
from gpu_workers.replay import noisy_max
from gpu_workers.tasks import prompt_tokens, synthetic_tasks
from gpu_workers.toploc import build_proofs
from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.data import AcceptedBatch, RolloutPipeline
from jax_trainer.models import load_hf
from jax_trainer.sharding import make_mesh
from jax_trainer.train_step import GRPOTrainer

SHIFT = 0.74  # nats: just inside the bfloat16 bound on one token's |stored - recomputed| logprob (0.75 at T 1, top-p 1)
PROMPTS, GROUP, MAX_TOKENS = 2, 4, 8


def _decode(prefill: Prefill, prompts: list[list[int]], seeds: list[int], stops: frozenset[int]) -> list[list[int]]:
    """Each prompt's completion as the replayable sampler makes it on these logits (T 1, top-p 1)."""
    done = [[] for _ in prompts]
    for position in range(MAX_TOKENS):
        live = [i for i, c in enumerate(done) if not c or (c[-1] not in stops and len(c) < MAX_TOKENS)]
        if not live:
            break
        results = prefill.run([(prompts[i], done[i] + [0]) for i in live])  # the last row: the next token's logits
        logits = torch.stack([r.logits[-1] for r in results])
        choice, _ = noisy_max(logits, [seeds[i] for i in live], [position] * len(live))
        for i, token in zip(live, choice.tolist()):
            done[i].append(int(token))
    return done


def store_judged(store: RolloutStore, name: str, samples, seeds, rewards, verdict) -> tuple[str, str]:
    """Write judged samples (groups of GROUP) as batch `name` of version 0, and the validator's logprobs beside it:
    (the batch's digest, the logprobs' digest)."""
    batch = RolloutBatch.from_samples(
        BatchMeta(name, "ab" * 32, version=0, assignment_id=name, model_dtype="bfloat16"),
        tokens=[np.r_[s.prompt_tokens, s.completion_tokens] for s in samples],
        prompt_lens=[len(s.prompt_tokens) for s in samples],
        logprobs=[np.r_[np.zeros(len(s.prompt_tokens)), s.logprobs] for s in samples],
        full_logprobs=[np.r_[np.zeros(len(s.prompt_tokens)), s.logprobs] for s in samples],
        task_ids=[i // GROUP for i in range(len(samples))],
        group_ids=[i // GROUP for i in range(len(samples))],
        seeds=seeds,
        finish=[s.finish for s in samples],
        rewards=rewards,
        proofs=[s.proofs for s in samples],
    )
    sha = store.write(batch)
    return sha, write_validator_logprobs(store, batch, sha, flat_logprobs(batch, verdict.logprobs))


@pytest.fixture(scope="module")
def judged(tiny_model):
    """(the model, the honest batch, the shifted batch, their verdicts) in one memory store."""
    model = tiny_model("qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prefill = Prefill(model, dtype="bfloat16")
    stops = stop_token_ids(model)
    tasks = synthetic_tasks("sort", PROMPTS, seed=3, digits=3)
    prompts = [prompt_tokens(tasks[i // GROUP], tokenizer) for i in range(PROMPTS * GROUP)]
    seeds = [1000 + i for i in range(len(prompts))]
    completions = _decode(prefill, prompts, seeds, stops)
    results = prefill.run(list(zip(prompts, completions)))
    honest, shifted = [], []
    rewards = [1.0, 0.0, 0.0, 1.0] * PROMPTS
    for prompt, tokens, result, seed, reward in zip(prompts, completions, results, seeds, rewards):
        lp = torch.log_softmax(result.logits.float(), -1)[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()
        sample = Sample(
            prompt_tokens=prompt,
            completion_tokens=tokens,
            logprobs=lp,
            finish=0 if tokens[-1] in stops else 1,
            proofs=b"".join(build_proofs(result.hidden.to(torch.bfloat16))),
            seed=seed,
            reward=reward,
        )
        honest.append(sample)
        moved = lp.copy()
        j = int(np.argmin(lp))  # the least likely token: room to move it up by SHIFT and stay a logprob (<= 0)
        moved[j] += SHIFT
        shifted.append(dataclasses.replace(sample, logprobs=moved))
    declared = Declared(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, stop_token_ids=stops, dtype="bfloat16")
    store = RolloutStore.open("memory://")
    out = {}
    for name, samples in (("honest", honest), ("shifted", shifted)):
        verdict = validate_batch(samples, prefill, declared)
        sha, logprobs_sha = store_judged(store, name, samples, seeds, rewards, verdict)
        out[name] = (verdict, AcceptedBatch(name, 0, np.asarray(rewards, np.float32), sha, None, logprobs_sha))
    return model, store, out


class _Listing:
    def __init__(self, record: AcceptedBatch):
        self.record = record

    def accepted(self, min_version: int) -> list[AcceptedBatch]:
        return [self.record]


def test_a_shifted_logprob_per_sample_is_accepted_in_bfloat16(judged):
    _, _, out = judged
    honest, shifted = out["honest"][0], out["shifted"][0]
    assert honest.accepted, honest.reasons()
    assert shifted.accepted, shifted.reasons()  # the attack passes the validator: 0.75 is within rounding
    worst = [s.numbers("sampling")["max_logprob_diff"] for s in shifted.samples]
    assert min(worst) > SHIFT - 0.05  # every sample carries one moved token
    for h, s in zip(honest.logprobs, shifted.logprobs):  # the validator's own numbers do not see the claim
        np.testing.assert_array_equal(h, s)


LOSSES = {  # "inference" and "validator" run the same step: pi_old is the packed engine logprobs (checked below)
    "engine pi_old": LossConfig(logprob_source="validator", temperature=1.0),
    "recompute + TIS + mask": LossConfig(
        logprob_source="recompute", tis_cap=1.5, mismatch="token_mask", temperature=1.0
    ),
}
CASES = (  # (loss, whose logprobs the pipeline packs as the engine's, whether the shift moves the step)
    ("engine pi_old", "worker", True),  # logprob_source = "inference"
    ("recompute + TIS + mask", "worker", True),
    ("engine pi_old", "validator", False),  # logprob_source = "validator"
    ("recompute + TIS + mask", "validator", False),
)


def test_the_shift_moves_the_step_only_where_the_worker_s_claim_is_read(judged):
    model_dir, store, out = judged
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    model = load_hf(model_dir, mesh=mesh, param_dtype="float32", compute_dtype="float32")
    params = nnx.split(model)[1]
    optim = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1e3)
    trainers = {name: GRPOTrainer(model, mesh, loss, optim, TrainerConfig()) for name, loss in LOSSES.items()}
    inference = GRPOTrainer(model, mesh, LossConfig(logprob_source="inference", temperature=1.0), optim)
    abstract = (trainers["engine pi_old"].abstract_state(), trainers["engine pi_old"].abstract_batch(1, 8, 64))
    assert inference.lower(*abstract).as_text() == trainers["engine pi_old"].lower(*abstract).as_text()

    def train(loss: str, source: str, name: str):
        with RolloutPipeline(
            store, _Listing(out[name][1]), samples_per_step=PROMPTS * GROUP, rows=8, seq_len=64, engine_logprobs=source
        ) as pipe:
            packed = pipe.next(0, timeout=30).packed
        trainer = trainers[loss]
        state = trainer.init_state(jax.tree.map(lambda x: x.copy(), params))  # the step donates its state
        state, metrics = trainer.step(state, trainer.device_batch(packed))
        return {k: float(v) for k, v in metrics.items()}, [np.asarray(x) for x in jax.tree.leaves(state.params)]

    for loss, source, moves in CASES:
        (honest_metrics, honest_params), (shifted_metrics, shifted_params) = (
            train(loss, source, name) for name in ("honest", "shifted")
        )
        changed = [not np.array_equal(a, b) for a, b in zip(honest_params, shifted_params)]
        case = f"{loss}, the {source}'s logprobs"
        if moves:
            keys = ("ratio_mean", "ratio_max") if loss == "engine pi_old" else ("loss", "mismatch_kl")
            assert any(honest_metrics[k] != shifted_metrics[k] for k in keys), (case, honest_metrics, shifted_metrics)
            assert any(changed), case
        else:
            assert honest_metrics == shifted_metrics, case
            assert not any(changed), case  # the same gradients, so the same weights, bit for bit


def test_a_rewritten_validator_file_is_refused_by_its_digest(judged):
    _, store, out = judged
    record = out["honest"][1]
    batch = store.read(0, "honest", expect_sha256=record.sha256)
    good = read_validator_logprobs(store, batch, record.sha256, record.logprobs_sha256)
    moved = good.copy()
    moved[np.flatnonzero(moved)[0]] += SHIFT  # a worker with write access moves one token in the file
    write_validator_logprobs(store, batch, record.sha256, moved)
    with pytest.raises(ValueError, match="validator_logprobs"):
        read_validator_logprobs(store, batch, record.sha256, record.logprobs_sha256)
    with RolloutPipeline(
        store, _Listing(record), samples_per_step=PROMPTS * GROUP, rows=8, seq_len=64, engine_logprobs="validator"
    ) as pipe:
        with pytest.raises(TimeoutError):
            pipe.next(0, timeout=3)
        assert pipe.cursor()["totals"]["invalid_batches"] == 1
    write_validator_logprobs(store, batch, record.sha256, good)  # the module's other tests read it again
